"""Base recipe: the selective-attention paper's C4 language model (section 5).

Every recipe in configs/ starts from this file and edits it. Sizes follow the paper's
single knob d: d_model = 64 d, n_heads = n_layers = d. A field set to 0 is derived.
"""

import ml_collections

from models import attention, transformer


def get_config() -> ml_collections.ConfigDict:
  """The default (C4, d=8) configuration."""
  config = ml_collections.ConfigDict()

  config.seed = 0                       # Seeds parameters, dropout and the data order.

  # Model.
  config.model = model = ml_collections.ConfigDict()
  model.d = 8                           # Size knob: d_model = 64 d, n_heads = n_layers = d.
  model.d_model = 0                     # Residual width; 0 = 64 d.
  model.n_heads = 0                     # Heads per layer; 0 = d.
  model.n_layers = 0                    # Blocks; 0 = d.
  model.head_dim = 0                    # Per-head width; 0 = d_model / n_heads.
  model.mlp_dim = 0                     # SwiGLU width; 0 = 8/3 d_model rounded up to 64.
  model.vocab_size = 8192               # Token ids (the 8K SentencePiece vocabulary).
  model.max_len = 512                   # Learned position table size (>= seq_len).
  model.position_embedding = 'learned'  # 'learned' absolute positions, 'sinusoidal' (fixed, at the
                                        # embedding's scale), or
                                        # 'none' (variants with relative positions, e.g.
                                        # transformer_xl; the universal stack's coordinates).
  model.attention = 'dense'             # Registry name, or a comma list with one name per layer.
  model.attention_impl = 'auto'         # 'auto' (per backend and variant), 'xla', 'blocksparse',
                                        # 'cpu_kernel', 'fused', 'cudnn', 'splash'.
  model.attention_block_size = 128      # Query/key block length of 'blocksparse' (at least 512 on
                                        # GPU/TPU; twice this for dense and selective attention's
                                        # rows of >= 4,096 on a CPU).
  # Every variant's hyper-parameters, with the defaults each variant declares next to its code
  # (OPTIONS in models/attention/<family>.py: one-line docs there). Override them as
  # --config.model.attention_options.<name>=<value>; e.g. stride (Sparse Transformer l),
  # summary (fixed c), window (local w), span_limit (adaptive span S), selective_budgets (K_l).
  model.attention_options = ml_collections.ConfigDict(attention.default_options())
  model.qk_norm = True                  # RMS-normalize queries and keys.
  model.tied_embeddings = False         # Share input embedding and output projection.
  model.dropout_rate = 0.0              # Residual dropout (the paper states none).
  model.dtype = 'bfloat16'              # Compute dtype.
  model.param_dtype = 'float32'         # Parameter (and optimizer state) dtype.
  model.remat = 'none'                  # 'none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable'.
  model.block = 'pre_ln'                # Residual wiring of a layer: pre_ln | gtrxl | reversible
                                        # (models/blocks.py).
  # Every block's hyper-parameters, with the defaults each block declares next to its code
  # (OPTIONS in models/blocks.py), as --config.model.block_options.<name>=<value>: gate_bias
  # (GTrXL's gate bias b_g at init).
  model.block_options = ml_collections.ConfigDict(transformer.default_options('block_options'))
  model.stack = 'auto'                  # How blocks are applied (models/stacks.py): 'unrolled',
                                        # 'scan' (identical layers), 'scan_cycle' (a repeating
                                        # cycle, e.g. interleaved strided A1/A2), 'universal'
                                        # (one shared block, several steps); 'auto' = scan
                                        # where it applies, else unrolled.
  model.ff_chunk_len = 0                # Positions per chunk of the SwiGLU feed-forward (its
                                        # hidden activation is never whole); 0 = no chunking.
  # Every stack's hyper-parameters, with the defaults each stack declares next to its code
  # (OPTIONS in models/stacks.py and models/universal.py). Override them as
  # --config.model.stack_options.<name>=<value>. The Universal Transformer's
  # (model.stack='universal': one weight-shared block, model.n_layers=1 there, applied for
  # several steps): steps (T without ACT), act (halt per position with ACT, Graves 2016),
  # max_steps (ACT's cap M), ponder (ACT's ponder cost weight τ: loss += τ mean(N + R)).
  model.stack_options = ml_collections.ConfigDict(transformer.default_options('stack_options'))

  # Data.
  config.data = data = ml_collections.ConfigDict()
  data.name = 'c4'                      # 'c4'/'tfds' (data.tfds_name), 'local_text', or a synthetic task
                                        # ('variable_assignment', 'copy', 'parity', 'duplication').
  data.tfds_name = 'c4/en:3.0.1'        # TFDS dataset for 'c4'/'tfds' (prepared; never downloaded).
  data.data_dir = ''                    # TFDS data_dir (local path or gs://); '' = TFDS default.
  data.train_split = 'train'            # TFDS split to train on (each process reads its slice).
  data.eval_split = 'validation'        # TFDS split to evaluate on.
  data.text_key = 'text'                # Feature holding the text.
  data.tokenizer = 'sentencepiece'      # 'sentencepiece' or 'byte' (256 bytes + pad/bos/eos).
  data.vocab_size = 8000                # SentencePiece pieces (paper: 8K); model.vocab_size pads it.
  data.spm_model_type = 'unigram'       # SentencePiece model: 'unigram' or 'bpe'.
  data.vocab_path = ''                  # SentencePiece model file (local or gs://); '' = workdir/vocab/.
                                        # Trained there on first use, reused afterwards.
  data.spm_sample_docs = 50_000         # Training-split documents SentencePiece learns from.
  data.packing = 'packed'               # 'packed' | 'concat' | 'stream' (row r of consecutive
                                        # batches continues one text stream: for segment-recurrent
                                        # attention).
  data.pack_min_piece = 64              # 'packed': cut a document to fill a row if >= this many
                                        # tokens fit; 0 = only cut documents longer than a row.
  data.pack_align = 1                   # 'packed': documents start at multiples of this (set it to
                                        # the stride of fixed / block_local attention).
  data.shuffle_buffer = 10_000          # Documents in the shuffle buffer (after the seeded file shuffle).
  data.prefetch_batches = 4             # Batches prepared ahead of the train step.
  # Local text corpora (data.name = 'local_text'), prepared as a TFDS dataset under data_dir.
  data.files = ''                       # Comma-separated globs: one large file, or many documents.
  data.corpus = 'local'                 # Name of the prepared dataset (a fingerprint is appended).
  data.validation_fraction = 0.05       # Share of bytes (one file) or files (many) for validation.
  data.test_fraction = 0.05             # Share for test (enwik8/text8: 90M/5M/5M bytes).
  data.chunk_bytes = 1 << 20            # Bytes per stored example when a file is cut.
  # Synthetic-task hyper-parameters (selective-attention paper, appendix A.1-A.2).
  data.num_variables = 3                # Variable Assignment: distinct variables.
  data.num_values = 1000                # Variable Assignment: possible values.
  data.num_assignments = 128            # Variable Assignment: assignments per example.
  data.num_symbols = 64                 # Copy: alphabet size.
  data.max_length = 24                  # Copy: longest string (L_max).
  data.num_bits = 32                    # Parity: random bits per example.
  data.dup_length = 127                 # Duplication (Reformer): length L of w in 0 w 0 w.

  # Optimization (paper: AdamW beta2 0.999, 1,000 warm-up steps, lr 0.005, cosine decay).
  config.total_steps = 524_288          # Optimizer steps.
  config.batch_size = 256               # Global batch, in sequences.
  config.seq_len = 512                  # Tokens per row (text data).
  config.grad_accum_steps = 1           # Micro-batches per step (batch_size must divide).
  config.learning_rate = 0.005          # Peak learning rate.
  config.warmup_steps = 1000            # Linear warm-up steps.
  config.end_learning_rate_fraction = 0.0  # Cosine decay ends at this fraction of the peak.
  config.adam_b1 = 0.9                  # AdamW beta1.
  config.adam_b2 = 0.999                # AdamW beta2.
  config.adam_eps = 1e-8                # AdamW epsilon.
  config.weight_decay = 0.1             # Decoupled weight decay on matrices (not norms).
  config.clip_grad_norm = 1.0           # Global-norm clipping; 0 disables.
  config.loss_chunk_len = 128           # Positions per chunk of the fused output projection + CE.

  # Logging, evaluation and checkpoints.
  config.log_every_steps = 100          # Console/TensorBoard train metrics interval.
  config.eval_every_steps = 5000        # Evaluation interval; 0 disables periodic eval.
  config.eval_steps = 20                # Validation batches per evaluation; 0 = the whole split.
  config.eval_batch_size = 0            # Validation batch; 0 = batch_size.
  config.checkpoint_every_steps = 5000  # Checkpoint interval (always also at the end and on SIGTERM).
  config.keep_checkpoints = 3           # Checkpoints kept on disk (the latest ones).
  config.async_checkpointing = True     # Write checkpoints in the background.
  config.eval_checkpoint_step = 0      # --mode=eval: checkpoint step to evaluate; 0 = latest.
  config.eval_window = 0                # Sliding-window eval of long documents: tokens of context
                                        # each scored token sees (absolute positions); 0 = rows as trained.
  config.eval_stride = 0                # Tokens scored per window (the window moves by it); 0 = eval_window / 2.
  config.inspect_len = 256              # --mode=inspect: sequence length of the plotted masks; 0 = seq_len.
  config.peak_tflops_per_device = 0.0   # Peak for MFU; 0 = device table, else a measured matmul peak.
  config.profile_steps = 0              # Train steps traced by the JAX profiler into WORKDIR/profile
                                        # (TensorBoard's profile plugin, XProf); 0 = off.
  config.profile_start_step = 2         # Steps of this process (a resume counts from its restored
                                        # step) run before the trace starts: step 0 compiles.

  # --mode=compile (training/aot.py): the run's programs compiled for a TPU slice from any host.
  config.compile_topology = ''          # TPU topology, e.g. 'v5e:2x2', 'v5e:4x4', 'v4:2x2x4', 'v6e:2x2'.
  config.compile_topology_num_slices = 1  # Slices of that topology joined over DCN.

  # Sampling (--mode=generate; training/sampling.py) and the samples written at each eval.
  config.generate = generate = ml_collections.ConfigDict()
  generate.step = 0                     # Checkpoint step to sample from; 0 = latest.
  generate.prompt = ''                  # One prompt (text, tokenized with the run's tokenizer).
  generate.prompt_file = ''             # Or a file of prompts, one per line (overrides prompt).
  generate.max_new_tokens = 128         # Tokens per prompt at most (default: capped to max_len).
  generate.temperature = 1.0            # Softmax temperature; 0 = greedy.
  generate.top_k = 0                    # Keep the k most likely tokens; 0 = all.
  generate.top_p = 1.0                  # Nucleus: smallest set with this probability mass; 1 = all.
  generate.seed = 0                     # Sampling seed.
  generate.stop_at_eos = True           # A row ends at the tokenizer's EOS.
  generate.batch_size = 8               # Prompts decoded together.
  generate.eval_samples = 2             # Samples written to TensorBoard at each eval (text data); 0 = none.
  generate.eval_new_tokens = 64         # Their length in new tokens.

  # Context pruning of selective attention (section 4; training/pruning.py).
  config.pruning = pruning = ml_collections.ConfigDict()
  pruning.budget_file = ''              # Budgets JSON written/read by the pruning modes;
                                        # '' = WORKDIR/budgets.json.
  pruning.step = 8                      # C: tokens cut from one layer per greedy iteration.
  pruning.batches = 1                   # Training batches the greedy allocation measures.
  pruning.tolerance = 0.0               # Stop when the loss exceeds the unpruned one by this.
  pruning.target_loss = 0.0             # > 0: stop at this loss instead (e.g. a dense model's).

  # Sharding: mesh sizes (-1 = all remaining devices) and the logical-to-mesh rule table.
  # data, fsdp and tensor are sizes within one TPU slice (ICI); on several slices (DCN) the
  # mesh axes 'data' and 'fsdp' have sizes data * dcn_data and fsdp * dcn_fsdp.
  config.mesh = mesh = ml_collections.ConfigDict()
  mesh.data = -1                        # Pure data parallelism.
  mesh.fsdp = 1                         # Parameters and optimizer state sharded (ZeRO-3 style).
  mesh.tensor = 1                       # Heads and MLP width split (Megatron style).
  mesh.dcn_data = 1                     # Slices over which the batch is split (data parallel).
  mesh.dcn_fsdp = 1                     # Slices over which parameters are also sharded (FSDP).
  config.logical_axis_rules = [
      ('batch', ('data', 'fsdp')),
      ('embed', 'fsdp'),
      ('heads', 'tensor'),
      ('mlp', 'tensor'),
      ('vocab', 'tensor'),
      ('kv', None),
      ('length', None),
      ('qkv', None),
      ('gate', None),
      ('layers', None),
      ('norm', None),
      ('length_table', None),
  ]
  return config
