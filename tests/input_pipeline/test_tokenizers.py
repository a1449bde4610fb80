"""Tests for input_pipeline.tokenizers: lossless byte and SentencePiece round trips, ids."""

import numpy as np
import pytest
import sentencepiece as spm

from input_pipeline import tokenizers
from input_pipeline.synthetic import BOS, EOS, PAD


def _random_unicode(rs: np.random.RandomState, length: int) -> str:
  """Random code points from every plane (surrogates excluded), some from common blocks."""
  out = []
  for _ in range(length):
    if rs.rand() < 0.3:
      lo, hi = [(0x20, 0x7f), (0x300, 0x370), (0x1f600, 0x1f650), (0x4e00, 0x4f00)][rs.randint(4)]
      cp = rs.randint(lo, hi)
    else:
      cp = rs.randint(0, 0x110000)
      while 0xd800 <= cp <= 0xdfff:
        cp = rs.randint(0, 0x110000)
    out.append(chr(cp))
  return ''.join(out)


UNUSUAL = [
    '',
    ' ',
    '   ',
    '\n',
    '\n\n\nline after blank lines\n',
    'trailing space ',
    '  leading and  double  spaces',
    '\ttab\tseparated\t\tcolumns\t',
    'windows\r\nline\r\nends\r',
    'no-break\u00a0space and ideographic\u3000space and thin\u2009space',
    'combining: e\u0301 a\u0308 n\u0303 and zero\u200dwidth joiner',
    'emoji: 😀 👍🏽 🇫🇷 👩‍👩‍👧',
    'Ωμέγα привет 日本語 עברית العربية हिन्दी',
    'Kalo mine ruta.\nPoshi delo!',
    '\x00nul \x07bell \x7fdel \ufeffbom',
    'math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and private \ue000 and plane 16 \U0010fffd',
]


def test_byte_tokenizer_round_trips_random_utf8():
  tok = tokenizers.ByteTokenizer()
  token_bytes = tok.token_bytes()
  assert tok.vocab_size == 259 and token_bytes.shape == (259,)
  np.testing.assert_array_equal(token_bytes[:3], 0)
  np.testing.assert_array_equal(token_bytes[3:], 1)
  rs = np.random.RandomState(0)
  texts = UNUSUAL + [_random_unicode(rs, rs.randint(0, 60)) for _ in range(200)]
  encoded = tok.encode_batch(texts)
  from_bytes = tok.encode_batch([t.encode('utf-8') for t in texts])
  assert len(encoded) == len(texts)
  for text, ids, ids_b in zip(texts, encoded, from_bytes):
    raw = text.encode('utf-8')
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, ids_b)
    assert ids[0] == BOS and ids[-1] == EOS and len(ids) == len(raw) + 2
    np.testing.assert_array_equal(ids[1:-1] - 3, np.frombuffer(raw, np.uint8))
    assert tok.decode(ids) == text
    assert token_bytes[ids].sum() == len(raw)


def test_byte_tokenizer_keeps_invalid_utf8_bytes():
  tok = tokenizers.ByteTokenizer()
  raw = 'é日😀'.encode()[1:-1]  # Cut in the middle of the first and the last character.
  ids = tok.encode_batch([raw])[0]
  np.testing.assert_array_equal(ids[1:-1] - 3, np.frombuffer(raw, np.uint8))
  assert tok.token_bytes()[ids].sum() == len(raw)


@pytest.fixture(scope='module')
def spm_tok(spm_proto):
  return tokenizers.SentencePieceTokenizer(spm_proto)


def test_sentencepiece_reserved_ids(spm_proto, spm_tok, kit):
  sp = spm.SentencePieceProcessor(model_proto=spm_proto)
  assert (sp.pad_id(), sp.bos_id(), sp.eos_id(), sp.unk_id()) == (PAD, BOS, EOS, 3)
  assert spm_tok.vocab_size == sp.get_piece_size() == kit.spm_vocab
  # The 256 byte-fallback pieces are all there.
  assert sum(sp.is_byte(i) for i in range(sp.get_piece_size())) == 256
  token_bytes = spm_tok.token_bytes()
  np.testing.assert_array_equal(token_bytes[:4], 0)
  assert np.all(token_bytes[4:] >= 1)


@pytest.mark.parametrize('index', range(len(UNUSUAL)))
def test_sentencepiece_is_lossless_on_unusual_text(spm_tok, index):
  text = UNUSUAL[index]
  ids = spm_tok.encode_batch([text])[0]
  assert ids.dtype == np.int32
  assert ids[0] == BOS and ids[-1] == EOS
  assert not np.isin(ids[1:-1], [PAD, BOS, EOS, tokenizers.UNK]).any()
  assert spm_tok.decode(ids) == text
  assert spm_tok.token_bytes()[ids].sum() == len(text.encode('utf-8'))


def test_sentencepiece_is_lossless_on_corpus_and_random_text(spm_tok, kit):
  rs = np.random.RandomState(1)
  texts = (kit.validation_docs + kit.make_docs(7, 50)
           + [_random_unicode(rs, rs.randint(0, 40)) for _ in range(100)])
  token_bytes = spm_tok.token_bytes()
  encoded = spm_tok.encode_batch(texts)
  assert len(encoded) == len(texts)
  for text, ids in zip(texts, encoded):
    assert ids[0] == BOS and ids[-1] == EOS
    assert not np.isin(ids[1:-1], [PAD, BOS, EOS, tokenizers.UNK]).any()
    assert spm_tok.decode(ids) == text
    assert token_bytes[ids].sum() == len(text.encode('utf-8'))
  # bytes input is decoded as UTF-8 and gives the same ids.
  for a, b in zip(encoded, spm_tok.encode_batch([t.encode() for t in texts])):
    np.testing.assert_array_equal(a, b)
  # The model learned the corpus: its documents take far fewer pieces than bytes.
  corpus = kit.validation_docs
  pieces = sum(len(ids) - 2 for ids in spm_tok.encode_batch(corpus))
  assert pieces < 0.75 * sum(len(t.encode()) for t in corpus)


def test_sentencepiece_keeps_a_literal_lower_one_eighth_block(spm_tok):
  """U+2581 is SentencePiece's internal space symbol; a literal one must survive."""
  text = 'a\u2581b \u2581'
  ids = spm_tok.encode_batch([text])[0]
  assert spm_tok.decode(ids) == text
  assert spm_tok.token_bytes()[ids].sum() == len(text.encode('utf-8'))


def test_train_sentencepiece_bpe_is_lossless(kit):
  proto = tokenizers.train_sentencepiece(kit.train_docs, vocab_size=kit.spm_vocab,
                                         model_type='bpe', num_threads=1)
  tok = tokenizers.SentencePieceTokenizer(proto)
  assert tok.vocab_size == kit.spm_vocab
  token_bytes = tok.token_bytes()
  for text in UNUSUAL[1:] + kit.validation_docs:
    ids = tok.encode_batch([text])[0]
    assert ids[0] == BOS and ids[-1] == EOS
    assert tok.decode(ids) == text
    assert token_bytes[ids].sum() == len(text.encode('utf-8'))


def test_train_sentencepiece_rejects_bad_arguments(kit):
  with pytest.raises(ValueError, match=r"data\.spm_model_type must be 'unigram' or 'bpe'"):
    tokenizers.train_sentencepiece(kit.train_docs, vocab_size=400, model_type='word')
  with pytest.raises(ValueError, match=r'data\.vocab_size=200 is too small .*\(at least 262\)'):
    tokenizers.train_sentencepiece(kit.train_docs, vocab_size=200)
  with pytest.raises(ValueError, match=r'no text \(empty corpus\?\)'):
    tokenizers.train_sentencepiece(['', '\n\n', '   '], vocab_size=400)


def test_get_sentencepiece_trains_once_then_reuses(tmp_path, kit):
  path = tokenizers.default_vocab_path(str(tmp_path), 400, 'unigram')
  assert path == str(tmp_path / 'vocab' / 'spm_unigram_400.model')
  calls = []

  def sample():
    calls.append(1)
    return iter(kit.train_docs)

  first = tokenizers.get_sentencepiece(path, vocab_size=400, model_type='unigram',
                                       sample_fn=sample)
  assert calls == [1]
  data = (tmp_path / 'vocab' / 'spm_unigram_400.model').read_bytes()
  assert [p.name for p in (tmp_path / 'vocab').iterdir()] == ['spm_unigram_400.model']
  second = tokenizers.get_sentencepiece(path, vocab_size=400, model_type='unigram',
                                        sample_fn=sample)
  assert calls == [1]  # Not trained again.
  assert (tmp_path / 'vocab' / 'spm_unigram_400.model').read_bytes() == data
  text = kit.validation_docs[0]
  np.testing.assert_array_equal(first.encode_batch([text])[0], second.encode_batch([text])[0])


def test_decode_drops_ids_of_the_padded_model_vocabulary(spm_tok):
  """model.vocab_size pads the tokenizer's vocabulary; an id sampled there decodes to nothing
  (it used to wrap around for bytes and raise in SentencePiece)."""
  byte = tokenizers.ByteTokenizer()
  ids = byte.encode_batch(['hi'])[0]
  assert byte.decode([*ids, byte.vocab_size, byte.vocab_size + 253]) == 'hi'
  ids = spm_tok.encode_batch(['hello world'])[0]
  assert spm_tok.decode([*ids, spm_tok.vocab_size, spm_tok.vocab_size + 7]) == 'hello world'
