"""The zoo as an lm-evaluation-harness model (training/downstream.py, training/zoo_lm.py):
what lm-eval receives is the model's own forward and --mode=generate's sampler; local tasks
(multiple choice, rolling perplexity, generation with a stop string) run offline through
lm-eval's own evaluator; bad input gets one line each; a Variable Assignment run logs its
local task during training and --mode=harness writes lm-eval's result JSON; lm-eval's
registry makes the model from model_args.

One byte-level text run of 1 step (max_len 32), trained once for the module, and one
Variable Assignment run of 4 steps. lm-eval's own task index (14,000 YAMLs) is never read
here: the tasks are local, so nothing is downloaded. The slow test trains on 2 processes."""

import importlib
import json
import logging
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# pytest puts tests/ on sys.path (for its conftest, which is in no package), where
# tests/multiprocess.py would stand for the `multiprocess` package that lm-eval's `datasets`
# imports: the package is imported first, without tests/ on the path.
_TESTS = str(pathlib.Path(__file__).resolve().parents[1])
_saved = list(sys.path)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != _TESTS]
try:
  importlib.import_module('multiprocess.pool')
except ImportError:
  pass  # Without lm-eval (and datasets) installed: the module is skipped below.
finally:
  sys.path[:] = _saved

lm_eval = pytest.importorskip('lm_eval', reason='lm-eval is not installed: '
                              'pip install -r requirements-eval.txt')

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402

from configs import local_text, tiny  # noqa: E402
from input_pipeline import synthetic  # noqa: E402
from training import assembly, downstream, sampling, train, zoo_lm  # noqa: E402

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # A test that reached for the hub would hang.
os.environ.setdefault('HF_HUB_OFFLINE', '1')

SEQ_LEN = 32  # The text model's window (max_len).
CORPUS = '\n'.join(f'the cat sat on the mat number {i % 7}; the dog ran {i % 3} times.'
                   for i in range(300))
BOS = synthetic.BOS


def _text_config(tmp):
  config = local_text.get_config()
  config.data.files = str(tmp / 'corpus.txt')
  config.data.data_dir = str(tmp / 'tfds')
  config.data.chunk_bytes = 2048
  config.data.prefetch_batches = 1
  config.model.update(d_model=32, n_heads=2, n_layers=1)
  config.update(seq_len=SEQ_LEN, batch_size=4, total_steps=1, warmup_steps=1,
                learning_rate=0.01, log_every_steps=2, eval_every_steps=0, eval_steps=1,
                checkpoint_every_steps=1, peak_tflops_per_device=1.0, async_checkpointing=False)
  config.generate.update(eval_samples=0, temperature=0.0)
  config.harness.batch_size = 4
  config.loss_chunk_len = 8  # The scored rows' logits are formed in chunks, as the loss's.
  return config


@pytest.fixture(scope='module')
def text_run(tmp_path_factory):
  """(config, workdir, ZooLM) of a byte-level run of one layer trained 1 step."""
  tmp = tmp_path_factory.mktemp('text_run')
  (tmp / 'corpus.txt').write_text(CORPUS)
  workdir = str(tmp / 'run')
  config = _text_config(tmp)
  train.train_and_evaluate(config, workdir)
  restored = assembly.restore(config, workdir)
  return config, workdir, zoo_lm.ZooLM.from_restored(restored, batch_size=4, workdir=workdir)


def _instances(kind, args):
  return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


def _forward_logp(restored, tokens, scored):
  """log p of the last `scored` tokens of `tokens` by one plain forward of the model."""
  tokens = jnp.asarray([tokens], jnp.int32)
  logits = jax.jit(restored.model.apply)({'params': restored.params}, tokens[:, :-1])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)[0]
  picked = jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
  greedy = jnp.argmax(logits[0], axis=-1) == tokens[0, 1:]
  return float(jnp.sum(picked[-scored:])), bool(jnp.all(greedy[-scored:]))


def _byte_ids(text):
  return [b + 3 for b in text.encode()]


def test_loglikelihoods_lm_eval_receives_are_the_models_forward(text_run, caplog):
  _, _, lm = text_run
  restored = lm.restored
  long_context = 'the dog ran 2 times. ' * 3 + 'end'  # 66 bytes: more than the window of 32.
  pairs = [('the cat', ' sat'), ('', 'the'), ('the dog ran', ' 1 times.'),
           ('x', 'y'), ('the cat sat on the', ' mat number 3'), (long_context, ' the cat'),
           (long_context + 'x', ' z')]
  with caplog.at_level(logging.WARNING):
    got = lm.loglikelihood(_instances('loglikelihood', pairs))
  for (context, continuation), (logp, greedy) in zip(pairs, got):
    tokens = [BOS] + _byte_ids(context + continuation)
    scored = len(_byte_ids(continuation))
    tokens = tokens[-(SEQ_LEN + 1):]  # A long context is cut from the left.
    want, want_greedy = _forward_logp(restored, tokens, scored)
    assert logp == pytest.approx(want, abs=1e-4), (context, continuation)
    assert greedy == want_greedy
  # The cut is said once, in one line, for the two long contexts.
  cuts = [r.getMessage() for r in caplog.records if 'longer than the model' in r.getMessage()]
  assert len(cuts) == 1 and '\n' not in cuts[0], cuts
  assert 'cut from the left' in cuts[0] and 'max_len=32' in cuts[0]
  assert lm.scorer.truncated == 2
  # A context's trailing space belongs to the continuation (as in lm-eval's HF model).
  moved, kept = lm.loglikelihood(_instances('loglikelihood', [('the cat ', 'sat'),
                                                               ('the cat', ' sat')]))
  assert moved == kept
  # Rows of one bucket width share one compiled program: widths 16 and 32 here.
  assert sorted(width for _, width in lm.scorer._programs) == [16, 32]


def test_rolling_loglikelihood_scores_each_token_once_as_lm_eval_windows_them(text_run):
  _, _, lm = text_run
  texts = ['the cat sat on the mat number 1; the dog ran 2 times. the cat sat', 'short']
  got = lm.loglikelihood_rolling(_instances('loglikelihood_rolling', [(t,) for t in texts]))
  for text, total in zip(texts, got):
    want = 0.0
    # lm-eval's own windows (its Hugging Face model's): disjoint predictions, full context.
    for context, predicted in map(lm_utils.make_disjoint_window,
                                  lm_utils.get_rolling_token_windows(
                                      _byte_ids(text), BOS, SEQ_LEN, 1)):
      want += _forward_logp(lm.restored, context + predicted, len(predicted))[0]
    assert total == pytest.approx(want, abs=1e-3), text


def test_greedy_generate_until_is_mode_generate(text_run):
  config, workdir, lm = text_run
  config = config.copy_and_resolve_references()
  config.generate.update(prompt='the cat', max_new_tokens=12, temperature=0.0,
                         stop_at_eos=True, batch_size=1)
  record, = sampling.sample_checkpoint(config, workdir)
  free, cut, other = lm.generate_until(_instances('generate_until', [
      ('the cat', {'until': [], 'max_gen_toks': 12}),
      ('the cat', {'until': [record['completion'][3:5]], 'max_gen_toks': 12}),
      ('the dog', {'until': ['\n'], 'max_gen_toks': 5, 'do_sample': False})]))
  assert free == record['completion']
  assert cut == record['completion'][:3]  # Cut before the stop string.
  assert len(other.encode()) <= 5


def _write_task(folder, name, body, docs):
  data = folder / f'{name}.jsonl'
  if docs is not None:
    data.write_text(''.join(json.dumps(d) + '\n' for d in docs))
  (folder / f'{name}.yaml').write_text(
      f'task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n'
      f'test_split: test\n{body}metadata:\n  version: 1.0\n')


MC = ('output_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: choices\n'
      'doc_to_target: answer\nmetric_list:\n  - metric: acc\n')
ROLLING = ('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: text\n'
           'metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n')
GENERATE = ('output_type: generate_until\ndoc_to_text: q\ndoc_to_target: a\n'
            'generation_kwargs:\n  until: [";"]\n  max_gen_toks: 8\n  do_sample: false\n'
            'metric_list:\n  - metric: exact_match\n')


def test_local_tasks_run_offline_through_lm_evals_evaluator(text_run, tmp_path):
  _, _, lm = text_run
  mc_docs = [{'q': 'the cat sat on the', 'choices': ['mat', 'dog', 'cat'], 'answer': 0},
             {'q': 'the dog ran 2', 'choices': ['times.', 'mat'], 'answer': 1}]
  _write_task(tmp_path, 'zoo_test_mc', MC, mc_docs)
  _write_task(tmp_path, 'zoo_test_rolling', ROLLING,
              [{'text': 'the cat sat on the mat number 1; the dog ran 2 times.'},
               {'text': 'the dog ran 0 times.'}])
  _write_task(tmp_path, 'zoo_test_generate', GENERATE,
              [{'q': 'the cat sat', 'a': ' on the mat'}, {'q': 'the dog', 'a': 'x'}])
  names = ['zoo_test_mc', 'zoo_test_rolling', 'zoo_test_generate']
  manager, loaded = downstream.load_tasks(names, [str(tmp_path)], defaults=False)
  results = zoo_lm.evaluate(lm, manager, loaded)
  got = results['results']
  assert set(got) == set(names)
  # The multiple-choice accuracy is what the model's own log-likelihoods choose.
  right = 0
  for doc in mc_docs:
    scores = [lm.scorer.loglikelihood([(doc['q'], ' ' + c)])[0][0] for c in doc['choices']]
    right += int(np.argmax(scores) == doc['answer'])
  assert got['zoo_test_mc']['acc,none'] == pytest.approx(right / len(mc_docs))
  assert np.isfinite(got['zoo_test_rolling']['word_perplexity,none'])
  assert got['zoo_test_rolling']['bits_per_byte,none'] > 0
  assert 0 <= got['zoo_test_generate']['exact_match,none'] <= 1
  assert results['n-samples']['zoo_test_generate']['effective'] == 2
  assert results['config']['zoo_max_len'] == SEQ_LEN
  json.dumps(results, default=lm_utils.handle_non_serializable)  # What --mode=harness writes.


def test_bad_tasks_get_one_line_each(tmp_path):
  _write_task(tmp_path, 'zoo_test_mc', MC, [{'q': 'a', 'choices': ['b'], 'answer': 0}])
  with pytest.raises(ValueError) as e:
    downstream.load_tasks(['zoo_test_mcq'], [str(tmp_path)], defaults=False)
  assert str(e.value).startswith("unknown lm-eval task 'zoo_test_mcq'; did you mean "
                                 'zoo_test_mc?'), e.value
  _write_task(tmp_path, 'zoo_test_absent', MC, None)  # Its data file was never written.
  with pytest.raises(ValueError) as e:
    downstream.load_tasks(['zoo_test_absent'], [str(tmp_path)], defaults=False)
  message = str(e.value)
  assert message.startswith("lm-eval task 'zoo_test_absent': its data could not be read"), message
  assert '\n' not in message and 'zoo_test_absent.jsonl' in message


def test_missing_lm_eval_says_what_to_install(monkeypatch):
  import builtins
  real = builtins.__import__

  def no_lm_eval(name, *args, **kwargs):
    if name == 'lm_eval' or name.startswith('lm_eval.'):
      raise ImportError(f'No module named {name!r}')
    return real(name, *args, **kwargs)

  monkeypatch.setattr(builtins, '__import__', no_lm_eval)
  with pytest.raises(downstream.MissingPackage, match='pip install -r requirements-eval.txt'):
    downstream.require_lm_eval()


def test_tasks_run_during_training_and_mode_harness_writes_lm_evals_result(tmp_path):
  """A Variable Assignment run with harness.every_steps logs the local task beside the eval;
  --mode=harness then writes lm-eval's result JSON of its last checkpoint."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  config = tiny.get_config()
  config.update(total_steps=4, batch_size=16, eval_every_steps=2, eval_steps=2,
                checkpoint_every_steps=4, log_every_steps=2, async_checkpointing=False,
                peak_tflops_per_device=1.0)
  config.model.d = 1
  config.harness.update(every_steps=2, limit=8, batch_size=16)
  workdir = tmp_path / 'run'
  train.train_and_evaluate(config, str(workdir))
  tags = {}
  for event_file in (workdir / 'tensorboard').iterdir():
    for event in tf.compat.v1.train.summary_iterator(str(event_file)):
      for value in event.summary.value:
        tags.setdefault(value.tag, set()).add(event.step)
  task = downstream.VARIABLE_ASSIGNMENT_TASK
  assert tags[f'harness/{task}/acc'] == {2, 4} == tags['eval/accuracy']

  config.harness.update(every_steps=0, limit=20)
  results = zoo_lm.run_tasks(config, str(workdir))
  written = json.loads((workdir / 'harness_step_4.json').read_text())
  assert written['results'][task]['acc,none'] == results['results'][task]['acc,none']
  assert written['n-samples'][task] == {'original': 32, 'effective': 20}  # 2 eval batches.
  assert written['config']['zoo_step'] == 4
  # The task stays in the workdir for lm-eval's own command line (--include_path).
  assert (workdir / 'harness_tasks' / f'{task}.yaml').is_file()
  # The documents are the rows --mode=eval scores: the validation stream's.
  docs = downstream.variable_assignment_docs(config)
  batch = synthetic.make_task('variable_assignment', num_variables=3, num_values=16,
                              num_assignments=4).batch(10**6, 1, 16)
  assert docs[16]['context'] == ' '.join(map(str, batch['inputs'][0]))
  assert docs[16]['answer'] == batch['targets'][0, -1] - 9


def test_a_task_without_its_data_stops_training_before_its_first_step(tmp_path):
  _write_task(tmp_path, 'zoo_test_absent', MC, None)
  config = tiny.get_config()
  config.update(total_steps=2, batch_size=16, eval_every_steps=0)
  config.harness.update(every_steps=1, tasks='zoo_test_absent', include_path=str(tmp_path))
  with pytest.raises(ValueError, match="^lm-eval task 'zoo_test_absent': its data could not"):
    train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert not (tmp_path / 'run' / 'config.json').exists()  # No state was made.


def test_sentencepiece_pairs_split_the_whole_texts_tokens():
  from input_pipeline import tokenizers  # pylint: disable=import-outside-toplevel
  words = ['the', 'cat', 'sat', 'on', 'mat', 'dog', 'ran', 'times', 'number', 'seven']
  sample = [' '.join(words[(i * k) % len(words)] for k in range(1, 9)) for i in range(400)]
  proto = tokenizers.train_sentencepiece(sample, vocab_size=288, num_threads=1)
  codec = downstream.TokenizerText(tokenizers.SentencePieceTokenizer(proto))
  for context, continuation in [('the cat sat on the', ' mat'), ('the cat ', 'sat'),
                                ('the do', 'g ran'), ('', 'the dog'), ('times', '.'),
                                ('numb', 'er seven'), ('the ca', 't sat')]:
    head, tail = codec.encode_pair(context, continuation)
    # The continuation's tokens are the whole text's past the context's, so the pair scores
    # the tokens the whole text has.
    assert head + tail == codec.encode(context + continuation), (context, continuation)
    assert tail, (context, continuation)
  head, tail = codec.encode_pair('the cat ', 'sat')
  assert codec.decode(tail) == ' sat'  # The context's trailing space went with it.
  # 'the ca' alone is not how 'the cat' starts: the tokens the two share are the context's,
  # and the piece that spans the boundary is scored with the continuation.
  assert codec.encode('the ca') != codec.encode('the cat sat')[:len(codec.encode('the ca'))]
  head, tail = codec.encode_pair('the ca', 't sat')
  assert codec.decode(head) == 'the c' and codec.decode(tail) == 'at sat'


def test_lm_evals_registry_makes_the_zoo_model_from_model_args(text_run):
  _, workdir, lm = text_run
  from lm_eval.api.registry import get_model  # pylint: disable=import-outside-toplevel
  made = get_model('zoo').create_from_arg_string(
      f'workdir={workdir},step=1,eval_steps=3', {'batch_size': 4})
  assert isinstance(made, zoo_lm.ZooLM) and made.restored.step == 1
  assert made.restored.setup.config.eval_steps == 3  # A run-time override applies.
  assert made.scorer.rows == 4
  pair = [('the cat', ' sat')]
  assert made.scorer.loglikelihood(pair) == lm.scorer.loglikelihood(pair)
  with pytest.raises(ValueError, match=r'changes its model.*model\.n_layers'):
    get_model('zoo').create_from_arg_string(f'workdir={workdir},model.n_layers=3')
  with pytest.raises(ValueError, match="model_args no_such_key=1 is neither the zoo model's own"):
    get_model('zoo').create_from_arg_string(f'workdir={workdir},no_such_key=1')


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_scores_alike_on_one_and_on_two(harness, tmp_path):
  from tests import multiprocess  # pylint: disable=import-outside-toplevel
  extra = {'total_steps': 8, 'checkpoint_every_steps': 8, 'harness.batch_size': 8}
  workdir = tmp_path / 'run'
  multiprocess.run(harness, workdir, tmp_path, extra, 'train')
  evaluated = harness.run_main(workdir, extra, mode='eval', devices=1)
  assert evaluated.returncode == 0, evaluated.stderr[-3000:]
  one = harness.run_main(workdir, extra, mode='harness', devices=1)
  assert one.returncode == 0, one.stderr[-3000:]
  task = downstream.VARIABLE_ASSIGNMENT_TASK
  on_one = json.loads((workdir / 'harness_step_8.json').read_text())['results'][task]
  (workdir / 'harness_step_8.json').unlink()
  multiprocess.run(harness, workdir, tmp_path, extra, 'harness', mode='harness')
  on_two = json.loads((workdir / 'harness_step_8.json').read_text())['results'][task]
  assert on_one['acc,none'] == on_two['acc,none']
  assert on_one['sample_len'] == 16  # eval_steps=1 batch of 16 rows: --mode=eval's rows.
  eval_accuracy = json.loads((workdir / 'eval_step_8.json').read_text())['accuracy']
  assert on_one['acc,none'] >= eval_accuracy
