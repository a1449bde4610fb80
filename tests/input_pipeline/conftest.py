"""Shared fixtures for the text pipeline tests: a fake C4, a SentencePiece model, tiny configs.

The fake C4 is written by a local TFDS builder named 'c4' (version 3.0.1, config 'en') into a
temporary data_dir, so `tfds.builder('c4/en:3.0.1', data_dir=...)` reads it like the real one.
Its documents are pseudo-English built from a fixed syllable list with numpy RandomState, with
some non-ASCII words, tabs and newlines. Nothing touches the network or a shared data folder.

The test modules here share one JAX persistent compilation cache (every tiny run compiles the
same train step; loading it takes a second instead of ten on 2 cores).
"""

import dataclasses
import pathlib

import jax
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from configs import default
from input_pipeline import tokenizers

tfds.disable_progress_bar()

_SYLLABLES = ('ka', 'lo', 'mi', 'ne', 'ru', 'ta', 'shi', 'po', 'de', 'ga', 'vo', 'zu', 'bel',
              'tor', 'qua', 'fen', 'ix', 'ow', 'th', 'an')
_EXTRAS = ('café', 'naïve', 'Zürich', '日本語', 'Ωμέγα', 'привет', '😀', '✓', 'e\u0301', '€5',
           '1234', 'a\tb')


def _word_list() -> list[str]:
  rs = np.random.RandomState(0)
  return sorted({''.join(rs.choice(_SYLLABLES, rs.randint(1, 4))) for _ in range(400)})


WORDS = _word_list()

# Overrides (dotted config keys) on top of configs/default.py for every text test: a d=1
# model on 4 rows of 64 tokens, a 400-piece SentencePiece vocabulary.
TINY = {
    'peak_tflops_per_device': 1.0,  # Skip the matmul peak measurement.
    'model.d': 1,
    'model.dtype': 'float32',
    'model.vocab_size': 0,          # 0 = the tokenizer's vocabulary.
    'model.max_len': 64,
    'seq_len': 64,
    'batch_size': 4,
    'total_steps': 4,
    'warmup_steps': 1,
    'log_every_steps': 1,
    'eval_every_steps': 0,
    'eval_steps': 0,
    'checkpoint_every_steps': 2,
    'loss_chunk_len': 64,
    'data.vocab_size': 400,
    'data.spm_sample_docs': 200,
    'data.shuffle_buffer': 16,
    'data.prefetch_batches': 2,
}
SPM_VOCAB = 400


def make_text(rs: np.random.RandomState) -> str:
  """One pseudo-English document: 1-6 lines of 2-16 words, some of them non-ASCII."""
  lines = []
  for _ in range(rs.randint(1, 7)):
    words = list(rs.choice(WORDS, rs.randint(2, 17)))
    if rs.rand() < 0.5:
      words.insert(rs.randint(len(words) + 1), _EXTRAS[rs.randint(len(_EXTRAS))])
    lines.append(' '.join(words).capitalize() + rs.choice(['.', '!', '?', ',']))
  return '\n'.join(lines)


def make_docs(seed: int, count: int) -> list[str]:
  """`count` documents from a fixed seed."""
  rs = np.random.RandomState(seed)
  return [make_text(rs) for _ in range(count)]


TRAIN_DOCS = make_docs(1, 200)
VALIDATION_DOCS = make_docs(2, 13)


class FakeC4(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """C4's name, version, config and features, holding TRAIN_DOCS and VALIDATION_DOCS."""

  name = 'c4'
  VERSION = tfds.core.Version('3.0.1')
  BUILDER_CONFIGS = [tfds.core.BuilderConfig(name='en')]

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict({
            'text': tfds.features.Text(),
            'timestamp': tfds.features.Text(),
            'url': tfds.features.Text(),
        }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples('train', TRAIN_DOCS),
            'validation': self._generate_examples('validation', VALIDATION_DOCS)}

  def _generate_examples(self, split, docs):
    for i, doc in enumerate(docs):
      yield f'{split}-{i}', {'text': doc, 'timestamp': f'2019-04-{i % 28 + 1:02d}T00:00:00Z',
                             'url': f'https://example.com/{split}/{i}'}


@dataclasses.dataclass(frozen=True)
class C4:
  """The prepared fake C4.

  Attributes:
    data_dir: the TFDS data_dir holding c4/en/3.0.1.
    train: the training documents, in generation order.
    validation: the validation documents.
  """
  data_dir: str
  train: list[str]
  validation: list[str]


@pytest.fixture(scope='session')
def c4(tmp_path_factory) -> C4:
  """Writes the fake C4 once per session."""
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  FakeC4(config='en', data_dir=data_dir).download_and_prepare()
  return C4(data_dir=data_dir, train=TRAIN_DOCS, validation=VALIDATION_DOCS)


@pytest.fixture(scope='session')
def spm_proto() -> bytes:
  """A 400-piece SentencePiece model trained on the fake C4's training documents."""
  return tokenizers.train_sentencepiece(TRAIN_DOCS, vocab_size=SPM_VOCAB, num_threads=1)


@pytest.fixture(scope='session')
def spm_path(spm_proto, tmp_path_factory) -> str:
  """spm_proto written to a file, for data.vocab_path."""
  path = tmp_path_factory.mktemp('vocab') / f'spm_{SPM_VOCAB}.model'
  path.write_bytes(spm_proto)
  return str(path)


class Kit:
  """Helpers for the text tests (a fixture, as the test folders are not packages)."""

  words = WORDS
  train_docs = TRAIN_DOCS
  validation_docs = VALIDATION_DOCS
  spm_vocab = SPM_VOCAB
  tiny = TINY
  make_text = staticmethod(make_text)
  make_docs = staticmethod(make_docs)

  @staticmethod
  def config(extra: dict | None = None, base=None) -> ml_collections.ConfigDict:
    """`base` (default: configs/default.py) with TINY and then `extra` (dotted keys) applied."""
    config = base if base is not None else default.get_config()
    for key, value in {**TINY, **(extra or {})}.items():
      node = config
      *parents, leaf = key.split('.')
      for p in parents:
        node = node[p]
      node[leaf] = value
    return config

  @classmethod
  def local_text_config(cls, files: str, data_dir: str,
                        extra: dict | None = None) -> ml_collections.ConfigDict:
    """A byte-level local_text config: configs/local_text.py if it exists, else the default.

    model.vocab_size is pinned to the SentencePiece size so that byte runs compile the same
    programs as the C4 runs (the byte ids 0..258 fit in it).
    """
    overrides = {'data.name': 'local_text', 'data.files': files, 'data.data_dir': data_dir,
                 'data.tokenizer': 'byte', 'model.vocab_size': SPM_VOCAB, **(extra or {})}
    try:
      from configs import local_text  # pylint: disable=import-outside-toplevel
    except ImportError:
      return cls.config(overrides)
    return cls.config(overrides, base=local_text.get_config())

  @staticmethod
  def write_corpus(folder: pathlib.Path, sizes: dict[str, int],
                   seed: int = 0) -> dict[str, bytes]:
    """Writes a file of exactly `size` bytes per relative path; returns relpath -> bytes.

    Every file starts with a unique tag, so its bytes can be found again in a split.
    """
    rs = np.random.RandomState(seed)
    out = {}
    for rel, size in sizes.items():
      text = f'<<{rel}#{rs.randint(10**9)}>>\n'
      while len(text.encode()) < size:
        text += make_text(rs) + '\n'
      data = text.encode()[:size]
      path = folder / rel
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_bytes(data)
      out[rel] = data
    return out

  @staticmethod
  def max_abs_diff(a, b) -> float:
    """Largest absolute difference between two trees of arrays with the same structure."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope='session')
def kit() -> type[Kit]:
  return Kit


@pytest.fixture(scope='module', autouse=True)
def _compile_cache(compile_cache):
  """Every module here runs with the session's persistent compilation cache (tests/conftest.py):
  the pipelines' runs build the same small programs again and again."""
  del compile_cache


