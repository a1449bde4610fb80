"""Bad text-data configs fail with a clear message before any training compute.

Every case runs train.train_and_evaluate with the compute entry points replaced by a function
that fails the test (the no_compute fixture), and checks that no checkpoint folder appears.
"""

import re

import pytest

from training import train


def _fails_before_compute(config, workdir, error, match):
  with pytest.raises(error, match=match):
    train.train_and_evaluate(config, str(workdir))
  assert not (workdir / 'checkpoints').exists()


def test_missing_data_dir(kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': str(tmp_path / 'no_such_folder')})
  _fails_before_compute(config, tmp_path / 'run', FileNotFoundError,
                        r"data\.data_dir='.*no_such_folder' does not exist")


def test_data_dir_without_prepared_c4(kit, no_compute, tmp_path):
  (tmp_path / 'empty_tfds').mkdir()
  config = kit.config({'data.data_dir': str(tmp_path / 'empty_tfds')})
  _fails_before_compute(config, tmp_path / 'run', FileNotFoundError,
                        r"TFDS dataset 'c4/en:3\.0\.1' (is not prepared|not found) in "
                        r'.*empty_tfds')


def test_unknown_split(c4, spm_path, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.eval_split': 'valid'})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r"data\.eval_split='valid': c4/en/3\.0\.1 has splits "
                        r"\['train', 'validation'\]")


@pytest.mark.parametrize('split', ['validation[:0]', 'validation[100%:]'])
def test_empty_split_slice(c4, spm_path, kit, no_compute, tmp_path, split):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.eval_split': split})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        rf"data\.eval_split='{re.escape(split)}' selects no example of c4/en/3\.0\.1")


def test_unknown_text_feature(c4, spm_path, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.text_key': 'content'})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r"data\.text_key='content' is not a feature of c4/en/3\.0\.1: "
                        r"\['text', 'timestamp', 'url'\]")


def test_local_files_matching_nothing(kit, no_compute, tmp_path):
  config = kit.local_text_config(str(tmp_path / 'corpus' / 'nothing*.txt'),
                                 str(tmp_path / 'tfds'))
  _fails_before_compute(config, tmp_path / 'run', FileNotFoundError,
                        r"data\.files pattern '.*nothing\*\.txt' matches no file")
  config = kit.local_text_config(' , ', str(tmp_path / 'tfds'))
  _fails_before_compute(config, tmp_path / 'run', FileNotFoundError, r'data\.files is empty')


def test_empty_corpus(kit, no_compute, tmp_path):
  (tmp_path / 'corpus').mkdir()
  for name in ('a.txt', 'b.txt'):
    (tmp_path / 'corpus' / name).write_bytes(b'')
  config = kit.local_text_config(str(tmp_path / 'corpus' / '*.txt'), str(tmp_path / 'tfds'))
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'empty corpus: the 2 file\(s\) of data\.files hold no bytes')


def test_split_that_would_be_empty(kit, no_compute, tmp_path):
  kit.write_corpus(tmp_path / 'corpus', {'only.txt': 500, 'other.txt': 500})
  config = kit.local_text_config(str(tmp_path / 'corpus' / '*.txt'), str(tmp_path / 'tfds'),
                                 {'data.validation_fraction': 0.01, 'data.test_fraction': 0.0})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'the validation split of data\.files would be empty \(2 file\(s\)\)')


def test_vocabulary_larger_than_the_corpus_supports(c4, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_size': 5000,
                       'data.spm_sample_docs': 20})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'data\.vocab_size=5000 is larger than the sample of \d+ lines supports '
                        r'\(at most \d+ pieces\): lower data\.vocab_size or raise '
                        r'data\.spm_sample_docs')
  vocab = tmp_path / 'run' / 'vocab'
  assert not vocab.exists() or not list(vocab.iterdir())  # No half-written model left.


def test_vocabulary_file_of_another_size(c4, spm_path, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.vocab_size': 500})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'the vocabulary file .*spm_400\.model has 400 pieces but '
                        r'data\.vocab_size=500: .*set data\.vocab_size=400')


def test_vocabulary_file_that_is_not_a_model(c4, kit, no_compute, tmp_path):
  bad = tmp_path / 'bad.model'
  bad.write_bytes(b'not a sentencepiece model')
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': str(bad)})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'bad\.model is not a SentencePiece model')


def test_unknown_packing_mode(c4, spm_path, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.packing': 'pack'})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r"data\.packing must be one of "
                        r"\('packed', 'concat', 'stream'\), got 'pack'")


def test_negative_pack_min_piece(c4, spm_path, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.pack_min_piece': -1})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'data\.pack_min_piece must be >= 0, got -1')


def test_unknown_tokenizer(c4, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.tokenizer': 'bytes'})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r"data\.tokenizer must be 'sentencepiece' or 'byte', got 'bytes'")


def test_too_small_sentencepiece_vocabulary(c4, kit, no_compute, tmp_path):
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_size': 256})
  _fails_before_compute(config, tmp_path / 'run', ValueError,
                        r'data\.vocab_size=256 is too small for a byte-fallback SentencePiece '
                        r'model \(at least 262\)')


def test_batch_not_divisible_by_processes(c4, spm_path, kit):
  import input_pipeline  # pylint: disable=import-outside-toplevel
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'batch_size': 5})
  with pytest.raises(ValueError, match=r'batch_size=5 is not divisible by the 2 processes'):
    input_pipeline.make_source(config, process_index=0, process_count=2)


@pytest.mark.parametrize('process', [0, 1])
def test_a_split_too_small_for_every_process_fails_on_every_process(c4, spm_path, kit, process):
  # One validation example over 2 processes: process 1's share is empty. Before, process 1
  # failed at its first eval read (TFDS: "Instruction [] corresponds to no data!") after
  # training, and process 0 waited for it in a collective until the shutdown timeout.
  import input_pipeline  # pylint: disable=import-outside-toplevel
  config = kit.config({'data.data_dir': c4.data_dir, 'data.vocab_path': spm_path,
                       'data.eval_split': 'validation[:1]', 'batch_size': 2})
  with pytest.raises(ValueError, match=r"data\.eval_split='validation\[:1\]' has 1 example\(s\) "
                                       r'of c4/en/3\.0\.1, too few to give each of the 2 '
                                       r'processes one \(process\(es\) \[1\] would read none\)'):
    input_pipeline.make_source(config, process_index=process, process_count=2)
