"""Byte-level language model on local text files (enwik8/text8 style), reported in bits per byte.

  python main.py --config=configs/local_text.py --config.data.files=/data/enwik8
  python main.py --config=configs/local_text.py --config.data.files='/corpus/*.txt' \
      --config.data.tokenizer=sentencepiece --config.data.vocab_size=8000

One file is cut 90% / 5% / 5% into train / validation / test by bytes, the way the papers cut
enwik8 and text8; many files are split per file. The files are prepared once as a TFDS dataset
under data.data_dir and streamed by the same code as C4. Sized for a CPU or one GPU: a d=4
model on 512-byte rows.
"""

from configs import default


def get_config():
  """Local-text byte-level recipe."""
  config = default.get_config()
  config.data.name = 'local_text'
  config.data.files = ''                # Required: --config.data.files=PATH[,GLOB...].
  config.data.corpus = 'local'          # Name of the prepared TFDS dataset.
  config.data.data_dir = ''             # '' = the TFDS default folder (~/tensorflow_datasets).
  config.data.tokenizer = 'byte'        # 256 bytes + pad/bos/eos; bits per byte in eval.
  config.data.packing = 'concat'        # A continuous stream, as in the enwik8/text8 papers.
  config.data.chunk_bytes = 1 << 16     # 64 KiB examples: shuffling mixes the corpus finely.
  config.data.shuffle_buffer = 1000

  config.model.d = 4
  config.model.vocab_size = 0           # 0 = the tokenizer's vocabulary (259 for bytes).
  config.model.max_len = 0              # 0 = seq_len.
  config.model.dtype = 'float32'        # bf16 matmuls are slow on most CPUs; use bf16 on GPU/TPU.

  config.seq_len = 512
  config.batch_size = 16
  config.total_steps = 5000
  config.learning_rate = 0.002
  config.warmup_steps = 200
  config.log_every_steps = 50
  config.eval_every_steps = 500
  config.eval_steps = 20
  config.checkpoint_every_steps = 500
  return config
