"""--mode=generate (training/sampling.py): samples of a trained byte-level text run, written to
WORKDIR/samples_step_<N>.jsonl; the checkpoint step chosen; the errors a user can make (a
prompt too long, no prompt for a synthetic task, a missing step, a variant that cannot
decode: a test-only one, as every registered variant decodes); the eval samples written as
TensorBoard text (LSH's too); the command line.

One text run of 4 steps (checkpoints 2 and 4), trained once for the module."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import local_text
from input_pipeline import tokenizers
from models import decode
from training import assembly, metrics, run_config, sampling, train

SEQ_LEN = 32  # The model's max_len.
CORPUS = '\n'.join(f'the cat sat on the mat number {i % 7}; the dog ran {i % 3} times.'
                   for i in range(300))


def _text_config(tmp, **generate_settings):
  config = local_text.get_config()
  config.data.files = str(tmp / 'corpus.txt')
  config.data.data_dir = str(tmp / 'tfds')
  config.data.chunk_bytes = 2048
  config.data.prefetch_batches = 1
  config.model.update(d_model=32, n_heads=2, n_layers=2)
  config.update(seq_len=SEQ_LEN, batch_size=4, total_steps=4, warmup_steps=1, learning_rate=0.01,
                log_every_steps=2, eval_every_steps=0, eval_steps=1, checkpoint_every_steps=2,
                peak_tflops_per_device=1.0, async_checkpointing=False)
  config.generate.update({'max_new_tokens': 6, 'temperature': 0.0, **generate_settings})
  return config


@pytest.fixture(scope='module')
def text_run(tmp_path_factory):
  """(folder, workdir) of a byte-level run trained 4 steps, checkpoints at steps 2 and 4."""
  tmp = tmp_path_factory.mktemp('text_run')
  (tmp / 'corpus.txt').write_text(CORPUS)
  workdir = str(tmp / 'run')
  config = _text_config(tmp)
  config.eval_every_steps = 4  # One eval, at the end: it writes the text samples.
  train.train_and_evaluate(config, workdir)
  return tmp, workdir


def test_training_writes_samples_at_each_eval(text_run):
  import tensorflow as tf
  _, workdir = text_run
  tags = set()
  for event_file in (pathlib.Path(workdir) / 'tensorboard').iterdir():
    for event in tf.compat.v1.train.summary_iterator(str(event_file)):
      tags |= {(event.step, value.tag) for value in event.summary.value
               if value.tag.startswith('samples/')}
  assert tags == {(4, 'samples/0'), (4, 'samples/1')}


PROMPTS = ['the cat', 'x', 'the dog ran 2 times']  # 8, 2 and 20 tokens with BOS.


def _prompt_file_config(tmp):
  """The 3 prompts in a file (with blank lines), greedy, 2 per batch: two batches, the second
  padded with a repeated row."""
  path = tmp / 'prompts.txt'
  path.write_text(f'{PROMPTS[0]}\n\n{PROMPTS[1]}\n   \n{PROMPTS[2]}\n')
  return _text_config(tmp, prompt_file=str(path), batch_size=2)


@pytest.fixture(scope='module')
def greedy_records(text_run):
  """generate's records of the 3 prompts (the sampler compiled once for the module)."""
  tmp, workdir = text_run
  return sampling.sample_checkpoint(_prompt_file_config(tmp), workdir)


def _restore(config, workdir, step=0):
  setup = assembly.build(config, workdir=workdir)
  setup.data.close()
  step, params = assembly.latest_params(setup, workdir, step=step)
  return setup, step, params


def test_greedy_samples_of_a_prompt_file_are_written_and_equal_decode_generate(
    text_run, greedy_records):
  tmp, workdir = text_run
  records = greedy_records
  assert [r['prompt'] for r in records] == PROMPTS
  assert [r['prompt_tokens'] for r in records] == [8, 2, 20]
  path = pathlib.Path(workdir) / 'samples_step_4.jsonl'
  assert [json.loads(line) for line in path.read_text().splitlines()] == records
  config = _prompt_file_config(tmp)
  # The same prompts in one batch through the sampler: the same greedy tokens.
  tokenizer = tokenizers.ByteTokenizer()
  setup, _, params = _restore(config, workdir)
  ids = [t[:-1] for t in tokenizer.encode_batch(PROMPTS)]  # [BOS] + bytes, no EOS.
  batch = np.zeros((3, 20), np.int32)
  for i, t in enumerate(ids):
    batch[i, :t.size] = t
  tokens, ends = decode.generate(setup.model, params, jnp.asarray(batch), [t.size for t in ids],
                                 6, jax.random.key(0), temperature=0.0, eos_id=tokenizers.EOS)
  for i, r in enumerate(records):
    assert r['index'] == i and r['step'] == 4
    assert {k: r[k] for k in ('max_new_tokens', 'temperature', 'top_k', 'top_p', 'seed',
                              'stop_at_eos', 'batch_size')} == {
        'max_new_tokens': 6, 'temperature': 0.0, 'top_k': 0, 'top_p': 1.0, 'seed': 0,
        'stop_at_eos': True, 'batch_size': 2}
    assert r['new_tokens'] == len(r['completion_ids'])
    assert r['stopped_at_eos'] == (r['completion_ids'][-1:] == [tokenizers.EOS])
    assert r['new_tokens'] == 6 or r['stopped_at_eos']
    assert r['completion'] == tokenizer.decode(r['completion_ids'])
    direct = np.asarray(tokens)[i, ids[i].size:int(ends[i])].tolist()
    assert r['completion_ids'] == direct, (i, r, direct)
  assert sampling.sample_checkpoint(config, workdir) == records  # Greedy: deterministic.


SAMPLED = {'temperature': 1.0, 'top_k': 5, 'seed': 3}


def test_sampling_settings_and_an_empty_prompt_start_from_bos(text_run, capsys):
  tmp, workdir = text_run
  config = _text_config(tmp, **SAMPLED)
  first = sampling.sample_checkpoint(config, workdir)
  assert len(first) == 1 and first[0]['prompt'] == '' and first[0]['prompt_tokens'] == 1
  assert sampling.sample_checkpoint(config, workdir) == first  # The seed fixes the sample.
  out = capsys.readouterr().out
  assert '=== sample 0 (step 4; prompt 1 tokens' in out
  assert f'--- continuation\n{first[0]["completion"]}\n' in out


def test_step_chooses_the_checkpoint_and_a_missing_step_names_the_saved_ones(text_run):
  tmp, workdir = text_run
  # The settings of the test above: the sampler is compiled already.
  latest = sampling.sample_checkpoint(_text_config(tmp, **SAMPLED), workdir)
  records = sampling.sample_checkpoint(_text_config(tmp, step=2, **SAMPLED), workdir)
  assert records[0]['step'] == 2 and latest[0]['step'] == 4
  assert (pathlib.Path(workdir) / 'samples_step_2.jsonl').exists()
  with pytest.raises(FileNotFoundError, match=r'no checkpoint step 3 .*saved steps: .*2.*4'):
    sampling.sample_checkpoint(_text_config(tmp, prompt='the', step=3), workdir)


def test_a_prompt_that_leaves_no_room_is_an_error_naming_it(text_run):
  tmp, workdir = text_run
  long = 'a' * 40  # 41 tokens with BOS; max_len 32.
  with pytest.raises(ValueError, match=r"prompt 0 \(generate.prompt\) has 41 tokens and the "
                                       r"model's max_len is 32: no room"):
    sampling.sample_checkpoint(_text_config(tmp, prompt=long), workdir)
  (tmp / 'two.txt').write_text('the cat\n' + 'b' * 28 + '\n')  # 29 tokens + 6 new > 32.
  with pytest.raises(ValueError, match=r'prompt 1 \(line 2 of .*two.txt\) has 29 tokens; with '
                                       r'generate.max_new_tokens=6 .* max_len=32. Set '
                                       r'generate.max_new_tokens <= 3'):
    sampling.sample_checkpoint(_text_config(tmp, prompt_file=str(tmp / 'two.txt')), workdir)
  # max_new_tokens alone fills max_len: shortening the prompt is no advice.
  with pytest.raises(ValueError, match=r'has 8 tokens; .*generate.max_new_tokens <= 24$'):
    sampling.sample_checkpoint(_text_config(tmp, prompt='the cat', max_new_tokens=40), workdir)
  with pytest.raises(FileNotFoundError, match='generate.prompt_file .*missing.txt does not exist'):
    sampling.sample_checkpoint(_text_config(tmp, prompt_file=str(tmp / 'missing.txt')), workdir)
  with pytest.raises(ValueError, match='generate.top_p must be in'):
    sampling.sample_checkpoint(_text_config(tmp, prompt='the', top_p=0.0), workdir)


def test_the_default_length_is_capped_to_the_context_and_said(text_run, caplog):
  # Issue 35: the default generate.max_new_tokens (128) on a model of max_len 128 was refused
  # whatever the prompt. Not set on the command line (the record's 6 here), it is capped at
  # what the context leaves.
  tmp, workdir = text_run
  default = run_config.Request(keys=frozenset({'generate.prompt'}))
  with caplog.at_level('INFO'):
    [record] = sampling.sample_checkpoint(_text_config(tmp, prompt='b' * 27), workdir, default)
  assert record['max_new_tokens'] == 4 and record['prompt_tokens'] == 28
  assert 1 <= record['new_tokens'] <= 4
  assert ('generate.max_new_tokens=6 (not set on the command line) is more than the model\'s '
          'context leaves after the longest prompt (max_len=32, 28 prompt tokens): generating '
          'up to 4 new tokens') in caplog.text
  with pytest.raises(ValueError, match=r'has 41 tokens and the model\'s max_len is 32: no room'):
    sampling.sample_checkpoint(_text_config(tmp, prompt='a' * 40), workdir, default)


def _synthetic_config(**model):
  from configs import tiny
  config = tiny.get_config()
  config.update_from_flattened_dict({'peak_tflops_per_device': 1.0, 'batch_size': 16,
                                     'data.num_assignments': 8, 'eval_steps': 1})
  config.model.update(model)
  return config


def test_a_synthetic_task_takes_token_ids_and_needs_a_prompt(tmp_path):
  with pytest.raises(ValueError, match=r'give a prompt: --config.generate.prompt="1 5 9" .*'
                                       r'synthetic task without a tokenizer.*token ids in \[0, '):
    sampling.sample_checkpoint(_synthetic_config(), str(tmp_path))
  assert [t.tolist() for t in sampling.encode_prompts(
      [('1 5  9', 'x'), ('2', 'y')], None, 20)] == [[1, 5, 9], [2]]
  with pytest.raises(ValueError, match=r'prompt 0 \(x\) has token ids \[20\] outside'):
    sampling.encode_prompts([('1 20', 'x')], None, 20)
  with pytest.raises(ValueError, match='integer token ids'):
    sampling.encode_prompts([('the cat', 'x')], None, 20)


def test_a_variant_that_cannot_decode_is_a_clear_error_before_any_restore(tmp_path, no_decode):
  config = _synthetic_config(attention=no_decode)
  config.generate.update(prompt='1 4 5', max_new_tokens=4)
  with pytest.raises(NotImplementedError, match=r"model \(test_no_decode attention.*cannot "
                                                r'generate: NoDecodeAttention cannot decode'):
    sampling.sample_checkpoint(config, str(tmp_path))  # No checkpoint: it fails before looking.
  lsh = _synthetic_config(attention='lsh')  # Decodes: it gets as far as the checkpoint.
  lsh.model.attention_options.lsh.update(chunk_len=4, n_buckets=4)
  lsh.generate.update(prompt='1 4 5', max_new_tokens=4)
  with pytest.raises(FileNotFoundError, match='train a model first'):
    sampling.sample_checkpoint(lsh, str(tmp_path / 'lsh'))


class _Texts:
  """A writer that keeps what write_texts got."""

  def __init__(self):
    self.calls = []

  def write_texts(self, step, texts):
    self.calls.append((step, dict(texts)))


def test_eval_samples_are_written_as_tensorboard_text(text_run, tmp_path, no_decode):
  tmp, workdir = text_run
  config = _text_config(tmp)
  setup, step, params = _restore(config, workdir)
  samples = sampling.eval_samples(setup, None, params, step, 0)
  assert len(samples) == config.generate.eval_samples == 2
  rows = next(iter(setup.data.eval_batches()))['inputs']
  decoded = tokenizers.ByteTokenizer()
  for (prompt, continuation), row in zip(samples, rows):
    # The start of the eval row (up to half of max_len), then at most max_len - 16 new tokens.
    assert decoded.decode(row).startswith(prompt) and 0 < len(prompt.encode()) <= 16
    assert len(continuation.encode()) <= SEQ_LEN - 16
  assert sampling.eval_samples(setup, None, params, step, 0) == samples  # Same key and step.

  logger = metrics.MetricLogger(str(tmp_path), total_steps=4)
  sampling.write_samples(logger, step, samples)
  logger.close()
  import tensorflow as tf
  texts = {}
  for event_file in (tmp_path / 'tensorboard').iterdir():
    for event in tf.compat.v1.train.summary_iterator(str(event_file)):
      for value in event.summary.value:
        texts[(event.step, value.tag)] = tf.make_ndarray(value.tensor).item().decode()
  assert sorted(texts) == [(4, 'samples/0'), (4, 'samples/1')]
  for i, (prompt, continuation) in enumerate(samples):
    text = texts[(4, f'samples/{i}')]
    assert text.startswith('prompt:\n\n    ') and '\n\ncontinuation:\n\n    ' in text
    assert prompt.split('\n')[-1] in text and continuation.split('\n')[0] in text

  writer = _Texts()
  sampling.write_samples(writer, 4, [])
  config.generate.eval_samples = 0
  assert sampling.eval_samples(setup, None, params, step) == []
  synthetic = assembly.build(_synthetic_config())
  assert sampling.eval_samples(synthetic, None, None, 4) == []  # No tokenizer.
  undecodable = _text_config(tmp)
  undecodable.model.attention = no_decode
  undecodable = assembly.build(undecodable, workdir=str(tmp_path / 'no_decode'))
  undecodable.data.close()
  assert sampling.eval_samples(undecodable, undecodable.model, None, 4) == []  # A warning.
  assert writer.calls == []
  # LSH decodes (whole buckets): an untrained LSH model writes its samples too.
  lsh = _text_config(tmp)
  lsh.model.attention = 'lsh'
  lsh.model.attention_options.lsh.update(chunk_len=8, n_buckets=4)
  lsh = assembly.build(lsh, workdir=str(tmp_path / 'lsh'))
  lsh.data.close()
  lsh_samples = sampling.eval_samples(lsh, lsh.model, assembly.init_state(lsh, 0).params, 4)
  assert len(lsh_samples) == 2
  for (prompt, continuation), row in zip(lsh_samples, rows):
    assert decoded.decode(row).startswith(prompt) and 0 < len(prompt.encode()) <= 16


def test_main_generate_prints_the_samples(harness, text_run, greedy_records):
  tmp, workdir = text_run
  proc = subprocess.run(
      [sys.executable, str(harness.repo / 'main.py'), f'--workdir={workdir}', '--mode=generate',
       f'--config.generate.prompt_file={_prompt_file_config(tmp).generate.prompt_file}',
       '--config.generate.batch_size=2', '--config.generate.max_new_tokens=6',
       '--config.generate.temperature=0'],
      env=harness.env(1), cwd=harness.repo, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for r in greedy_records:
    assert (f'--- prompt\n{r["prompt"]}\n--- continuation\n{r["completion"]}\n'
            in proc.stdout), proc.stdout
  lines = (pathlib.Path(workdir) / 'samples_step_4.jsonl').read_text().splitlines()
  assert [json.loads(x) for x in lines] == greedy_records
