"""The schema of a run: every setting declared once, with its default, doc, range and what
a change of it on a recorded run is (configs/declare.py). No recipe: configs/default.py (the
selective-attention paper's C4 model) and every other recipe in configs/ build a config from
these defaults and override what they choose.

Sizes follow the selective-attention paper's single knob d: d_model = 64 d, n_heads =
n_layers = d. A field set to 0 is derived.

What reads it: declare.build (the ConfigDict every recipe starts from), training/run_config.py
(the kind of a change: 'model' changes what the parameters mean and is refused, 'training'
changes what the optimizer does and a resume refuses it, 'runtime' changes how the run is
executed and is always applied; a setting without one takes its group's), training/settings.py
(the ranges, checked before anything is built), and models/transformer.TransformerConfig,
whose field defaults are the model section's (tests/models/test_transformer.py checks them).
The attention variants', blocks' and stacks' hyper-parameters are declared next to their code
(OPTIONS in models/), and their group here is an `Options` entry.
"""

from configs.declare import (INTEGER, MODEL, REAL, RUNTIME, TRAINING, Group, Options, Range,
                             Setting)

MODEL_SETTINGS = Group('The model.', change=MODEL, settings={
    'd': Setting(8, 'Size knob: d_model = 64 d, n_heads = n_layers = d.',
                 bounds=Range(INTEGER, 0), zero_means='d_model, n_heads and n_layers given'),
    'd_model': Setting(0, 'Residual width; 0 = 64 d.', bounds=Range(INTEGER, 0),
                       zero_means='64 d'),
    'n_heads': Setting(0, 'Heads per layer; 0 = d.', bounds=Range(INTEGER, 0), zero_means='d'),
    'n_layers': Setting(0, 'Blocks; 0 = d.', bounds=Range(INTEGER, 0), zero_means='d'),
    'head_dim': Setting(0, 'Per-head width; 0 = d_model / n_heads.', bounds=Range(INTEGER, 0),
                        zero_means='d_model / n_heads'),
    'mlp_dim': Setting(0, 'SwiGLU width; 0 = 8/3 d_model rounded up to 64.',
                       bounds=Range(INTEGER, 0), zero_means='8/3 d_model rounded up to 64'),
    'vocab_size': Setting(8192, "Token ids (the 8K SentencePiece vocabulary); 0 = the data's "
                          'vocabulary, padded to a multiple of 128.', bounds=Range(INTEGER, 0),
                          zero_means="the data's vocabulary"),
    'max_len': Setting(512, 'Learned position table size (>= seq_len); 0 = the sequence '
                       'length.', bounds=Range(INTEGER, 0), zero_means='the sequence length'),
    'position_embedding': Setting(
        'learned', "'learned' absolute positions, 'sinusoidal' (fixed, at the embedding's "
        "scale), or 'none' (variants with relative positions, e.g. transformer_xl; the "
        "universal stack's coordinates)."),
    'attention': Setting('dense', 'Registry name, or a comma list with one name per layer.'),
    'attention_impl': Setting(
        'auto', "'auto' (per backend and variant), 'xla', 'blocksparse', 'cpu_kernel', "
        "'fused', 'cudnn', 'splash', 'pallas'.", change=RUNTIME),  # The same attention, another kernel.
    'attention_block_size': Setting(
        128, "Query/key block length of 'blocksparse' (at least 512 on GPU/TPU; twice this for "
        "dense and selective attention's rows of >= 4,096 on a CPU).", change=RUNTIME,
        bounds=Range(INTEGER, 1)),
    'attention_options': Options(
        'attention_options', "The variants' hyper-parameters, one group per variant, with the "
        'defaults each variant declares next to its code (OPTIONS in '
        'models/attention/<family>.py: one-line docs there), as '
        '--config.model.attention_options.<variant>.<name>=<value>; a layer sees only its own '
        "variant's. E.g. strided.stride (Sparse Transformer l), fixed.summary (c), local.window "
        '(w), adaptive_span.limit (S), selective.budgets (K_l).'),
    'qk_norm': Setting(True, 'RMS-normalize queries and keys.'),
    'tied_embeddings': Setting(False, 'Share input embedding and output projection.'),
    'dropout_rate': Setting(0.0, 'Residual dropout (the paper states none).',
                            change=TRAINING, bounds=Range(REAL, 0, 1)),  # Training only.
    'dtype': Setting('float32', "Compute dtype ('bfloat16' in the C4 recipe).",
                     change=TRAINING),  # Eval may use another precision.
    'param_dtype': Setting('float32', 'Parameter (and optimizer state) dtype.'),
    'remat': Setting('none', "'none', 'full', 'dots_saveable', "
                     "'dots_with_no_batch_dims_saveable'.",
                     change=RUNTIME),  # Recomputation: the same values.
    'residual': Setting('pre_ln', 'Residual wiring of a layer: pre_ln | gtrxl | reversible '
                        '(models/residual.py).'),
    'residual_options': Options(
        'residual_options', "Every residual wiring's hyper-parameters, with the defaults each "
        'declares next to its code (OPTIONS in models/residual.py), as '
        "--config.model.residual_options.<name>=<value>: gate_bias (GTrXL's gate bias b_g at "
        'init).'),
    'stack': Setting(
        'auto', "How layers are applied (models/stacks.py): 'unrolled', 'scan' (identical "
        "layers), 'scan_cycle' (a repeating cycle, e.g. interleaved strided A1/A2), "
        "'universal' (one shared layer, several steps); 'auto' = scan where it applies, else "
        'unrolled.'),
    'ff_chunk_len': Setting(
        0, 'Positions per chunk of the SwiGLU feed-forward (its hidden activation is never '
        'whole); 0 = no chunking.', change=RUNTIME,  # The same values.
        bounds=Range(INTEGER, 0), zero_means='no chunking'),
    'stack_options': Options(
        'stack_options', "Every stack's hyper-parameters, with the defaults each stack declares "
        'next to its code (OPTIONS in models/stacks.py and models/universal.py), as '
        "--config.model.stack_options.<name>=<value>. The Universal Transformer's "
        "(model.stack='universal': one weight-shared block, model.n_layers=1 there, applied "
        'for several steps): steps (T without ACT), act (halt per position with ACT, Graves '
        "2016), max_steps (ACT's cap M), ponder (ACT's ponder cost weight τ: loss += τ "
        'mean(N + R)).'),
})

DATA_SETTINGS = Group('Data: dataset, tokenizer, vocabulary, task sizes.', change=MODEL, settings={
    'name': Setting('c4', "'c4'/'tfds' (data.tfds_name), 'local_text', or a synthetic task "
                    "('variable_assignment', 'copy', 'parity', 'duplication')."),
    'tfds_name': Setting('c4/en:3.0.1',
                         "TFDS dataset for 'c4'/'tfds' (prepared; never downloaded)."),
    'data_dir': Setting('', "TFDS data_dir (local path or gs://); '' = TFDS default.",
                        change=RUNTIME),  # Where the prepared data lives.
    'train_split': Setting('train', 'TFDS split to train on (each process reads its slice).',
                           change=TRAINING),  # What is trained on, and in which order.
    'eval_split': Setting('validation', 'TFDS split to evaluate on.', change=RUNTIME),
    'text_key': Setting('text', 'Feature holding the text.'),
    'tokenizer': Setting('sentencepiece',
                         "'sentencepiece' or 'byte' (256 bytes + pad/bos/eos)."),
    'vocab_size': Setting(8000, 'SentencePiece pieces (paper: 8K); model.vocab_size pads it.'),
    'spm_model_type': Setting('unigram', "SentencePiece model: 'unigram' or 'bpe'."),
    'vocab_path': Setting('', "SentencePiece model file (local or gs://); '' = workdir/vocab/. "
                          'Trained there on first use, reused afterwards.'),
    'spm_sample_docs': Setting(50_000, 'Training-split documents SentencePiece learns from.'),
    'packing': Setting('packed', "'packed' | 'concat' | 'stream' (row r of consecutive batches "
                       'continues one text stream: for segment-recurrent attention).',
                       change=TRAINING),
    'pack_min_piece': Setting(64, "'packed': cut a document to fill a row if >= this many "
                              'tokens fit; 0 = only cut documents longer than a row.',
                              change=TRAINING),
    'pack_align': Setting(1, "'packed': documents start at multiples of this (set it to the "
                          'stride of fixed / block_local attention).', change=TRAINING),
    'shuffle_buffer': Setting(10_000, 'Documents in the shuffle buffer (after the seeded file '
                              'shuffle).', change=TRAINING),
    'prefetch_batches': Setting(4, 'Batches prepared ahead of the train step.', change=RUNTIME),
    # Local text corpora (data.name = 'local_text'), prepared as a TFDS dataset under data_dir.
    'files': Setting('', 'Comma-separated globs: one large file, or many documents.'),
    'corpus': Setting('local', 'Name of the prepared dataset (a fingerprint is appended).'),
    'validation_fraction': Setting(0.05, 'Share of bytes (one file) or files (many) for '
                                   'validation.'),
    'test_fraction': Setting(0.05, 'Share for test (enwik8/text8: 90M/5M/5M bytes).'),
    'chunk_bytes': Setting(1 << 20, 'Bytes per stored example when a file is cut.'),
    # Synthetic-task hyper-parameters (selective-attention paper, appendix A.1-A.2).
    'num_variables': Setting(3, 'Variable Assignment: distinct variables.'),
    'num_values': Setting(1000, 'Variable Assignment: possible values.'),
    'num_assignments': Setting(128, 'Variable Assignment: assignments per example.'),
    'num_symbols': Setting(64, 'Copy: alphabet size.'),
    'max_length': Setting(24, 'Copy: longest string (L_max).'),
    'num_bits': Setting(32, 'Parity: random bits per example.'),
    'dup_length': Setting(127, 'Duplication (Reformer): length L of w in 0 w 0 w.'),
})

GENERATE_SETTINGS = Group(
    'Sampling (--mode=generate; training/sampling.py) and the samples written at each eval.',
    change=RUNTIME, settings={
        'step': Setting(0, 'Checkpoint step to sample from; 0 = latest.'),
        'prompt': Setting('', "One prompt (text, tokenized with the run's tokenizer)."),
        'prompt_file': Setting('', 'Or a file of prompts, one per line (overrides prompt).'),
        'max_new_tokens': Setting(128, 'Tokens per prompt at most (default: capped to '
                                  'max_len).'),
        'temperature': Setting(1.0, 'Softmax temperature; 0 = greedy.'),
        'top_k': Setting(0, 'Keep the k most likely tokens; 0 = all.'),
        'top_p': Setting(1.0, 'Nucleus: smallest set with this probability mass; 1 = all.'),
        'seed': Setting(0, 'Sampling seed.'),
        'stop_at_eos': Setting(True, "A row ends at the tokenizer's EOS."),
        'batch_size': Setting(8, 'Prompts decoded together.'),
        'eval_samples': Setting(2, 'Samples written to TensorBoard at each eval (text data); '
                                '0 = none.'),
        'eval_new_tokens': Setting(64, 'Their length in new tokens.'),
    })

PRUNING_SETTINGS = Group(
    'Context pruning of selective attention (section 4; training/pruning.py).', change=RUNTIME,
    settings={
        'budget_file': Setting('', "Budgets JSON written/read by the pruning modes; '' = "
                               'WORKDIR/budgets.json.'),
        'step': Setting(8, 'C: tokens cut from one layer per greedy iteration.'),
        'batches': Setting(1, 'Training batches the greedy allocation measures.'),
        'tolerance': Setting(0.0, 'Stop when the loss exceeds the unpruned one by this.'),
        'target_loss': Setting(0.0, "> 0: stop at this loss instead (e.g. a dense model's)."),
    })

HARNESS_SETTINGS = Group(
    "Downstream tasks through EleutherAI's lm-evaluation-harness (--mode=harness; "
    'training/downstream.py; needs requirements-eval.txt).', change=RUNTIME, settings={
        'tasks': Setting('', "Comma list of lm-eval task or group names (e.g. "
                         "'lambada_openai,hellaswag'); '' = the run's own local task "
                         "(zoo_variable_assignment for the Variable Assignment task)."),
        'limit': Setting(0, 'Documents per task at most (the first ones); 0 = all.',
                         bounds=Range(INTEGER, 0), zero_means='every document'),
        'include_path': Setting('', 'Folder of task YAMLs of your own (lm-eval\'s '
                                '--include_path), read besides the zoo\'s local tasks.'),
        'num_fewshot': Setting(-1, 'Few-shot examples per prompt (lm-eval\'s --num_fewshot); '
                               "-1 = each task's own default.", bounds=Range(INTEGER, -1)),
        'step': Setting(0, 'Checkpoint step to evaluate; 0 = latest.', bounds=Range(INTEGER, 0),
                        zero_means='the latest'),
        'batch_size': Setting(32, 'Rows of one compiled scoring or sampling program (a '
                              'multiple of the data-parallel devices is used).',
                              bounds=Range(INTEGER, 1)),
        'every_steps': Setting(0, 'During training: run harness.tasks on the latest parameters '
                               'every this many steps and at the last, written to TensorBoard '
                               'as harness/<task>/<metric>; 0 = never.',
                               bounds=Range(INTEGER, 0), zero_means='never'),
    })

MESH_SETTINGS = Group(
    'Sharding: mesh sizes (-1 = all remaining devices). data, fsdp and tensor are sizes within '
    "one TPU slice (ICI); on several slices (DCN) the mesh axes 'data' and 'fsdp' have sizes "
    'data * dcn_data and fsdp * dcn_fsdp.', change=RUNTIME, settings={
        'data': Setting(-1, 'Pure data parallelism.'),
        'fsdp': Setting(1, 'Parameters and optimizer state sharded (ZeRO-3 style).'),
        'tensor': Setting(1, 'Heads and MLP width split (Megatron style).'),
        'dcn_data': Setting(1, 'Slices over which the batch is split (data parallel).'),
        'dcn_fsdp': Setting(1, 'Slices over which parameters are also sharded (FSDP).'),
    })

LOGICAL_AXIS_RULES = [
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

# A key no entry declares (a field of an older run) is a model change: refused unless allowed.
SETTINGS = Group('A run: the C4 language model of the selective-attention paper, d=8.',
                 change=MODEL, settings={
    'seed': Setting(0, 'Seeds parameters, dropout and the data order.', change=TRAINING),
    'model': MODEL_SETTINGS,
    'data': DATA_SETTINGS,
    # Optimization (paper: AdamW beta2 0.999, 1,000 warm-up steps, lr 0.005, cosine decay).
    # A longer run also stretches the cosine decay from the step it resumes at.
    'total_steps': Setting(524_288, 'Optimizer steps.', change=RUNTIME,
                           bounds=Range(INTEGER, 1)),
    'batch_size': Setting(256, 'Global batch, in sequences.', change=TRAINING,
                          bounds=Range(INTEGER, 1)),
    'seq_len': Setting(512, 'Tokens per row (text data).', change=MODEL,
                       bounds=Range(INTEGER, 1)),
    'grad_accum_steps': Setting(1, 'Micro-batches per step (batch_size must divide).',
                                change=TRAINING, bounds=Range(INTEGER, 1)),
    'learning_rate': Setting(0.005, 'Peak learning rate.', change=TRAINING,
                             bounds=Range(REAL, 0)),
    'warmup_steps': Setting(1000, 'Linear warm-up steps.', change=TRAINING,
                            bounds=Range(INTEGER, 0)),
    'end_learning_rate_fraction': Setting(0.0, 'Cosine decay ends at this fraction of the peak.',
                                          change=TRAINING,
                                          bounds=Range(REAL, 0, 1, hi_inclusive=True)),
    'adam_b1': Setting(0.9, 'AdamW beta1.', change=TRAINING, bounds=Range(REAL, 0, 1)),
    'adam_b2': Setting(0.999, 'AdamW beta2.', change=TRAINING, bounds=Range(REAL, 0, 1)),
    'adam_eps': Setting(1e-8, 'AdamW epsilon.', change=TRAINING, bounds=Range(REAL, 0)),
    'weight_decay': Setting(0.1, 'Decoupled weight decay on matrices (not norms).',
                            change=TRAINING, bounds=Range(REAL, 0)),
    'clip_grad_norm': Setting(1.0, 'Global-norm clipping; 0 disables.', change=TRAINING,
                              bounds=Range(REAL, 0), zero_means='no clipping'),
    'loss_chunk_len': Setting(128, 'Positions per chunk of the fused output projection + CE.',
                              change=RUNTIME, bounds=Range(INTEGER, 0), zero_means='one chunk'),
    # Logging, evaluation and checkpoints.
    'log_every_steps': Setting(100, 'Console/TensorBoard train metrics interval.',
                               change=RUNTIME, bounds=Range(INTEGER, 1)),
    'eval_every_steps': Setting(5000, 'Evaluation interval; 0 disables periodic eval.',
                                change=RUNTIME, bounds=Range(INTEGER, 0),
                                zero_means='no periodic evaluation'),
    'eval_steps': Setting(20, 'Validation batches per evaluation; 0 = the whole split.',
                          change=RUNTIME, bounds=Range(INTEGER, 0), zero_means='the whole split'),
    'eval_batch_size': Setting(0, 'Validation batch; 0 = batch_size.', change=RUNTIME,
                               bounds=Range(INTEGER, 0), zero_means='batch_size'),
    'checkpoint_every_steps': Setting(5000, 'Checkpoint interval (always also at the end and on '
                                      'SIGTERM).', change=RUNTIME, bounds=Range(INTEGER, 1)),
    'keep_checkpoints': Setting(3, 'Checkpoints kept on disk (the latest ones).', change=RUNTIME,
                                bounds=Range(INTEGER, 1)),
    'async_checkpointing': Setting(True, 'Write checkpoints in the background.', change=RUNTIME),
    'eval_checkpoint_step': Setting(0, '--mode=eval: checkpoint step to evaluate; 0 = latest.',
                                    change=RUNTIME, bounds=Range(INTEGER, 0),
                                    zero_means='the latest'),
    'eval_window': Setting(0, 'Sliding-window eval of long documents: tokens of context each '
                           'scored token sees (absolute positions); 0 = rows as trained.',
                           change=RUNTIME),
    'eval_stride': Setting(0, 'Tokens scored per window (the window moves by it); 0 = '
                           'eval_window / 2.', change=RUNTIME),
    'inspect_len': Setting(256, '--mode=inspect: sequence length of the plotted masks; 0 = '
                           'seq_len.', change=RUNTIME, bounds=Range(INTEGER, 0)),
    'peak_tflops_per_device': Setting(0.0, 'Peak for MFU; 0 = device table, else a measured '
                                      'matmul peak.', change=RUNTIME, bounds=Range(REAL, 0),
                                      zero_means='measured or from the device table'),
    'profile_steps': Setting(0, 'Train steps traced by the JAX profiler into WORKDIR/profile '
                             "(TensorBoard's profile plugin, XProf); 0 = off.",
                             change=RUNTIME, bounds=Range(INTEGER, 0)),
    'profile_start_step': Setting(2, 'Steps of this process (a resume counts from its restored '
                                  'step) run before the trace starts: step 0 compiles.',
                                  change=RUNTIME, bounds=Range(INTEGER, 0)),
    # --mode=compile (training/aot.py): the run's programs compiled for a TPU slice from any
    # host.
    'compile_topology': Setting('', "TPU topology, e.g. 'v5e:2x2', 'v5e:4x4', 'v4:2x2x4', "
                                "'v6e:2x2'.", change=RUNTIME),
    'compile_topology_num_slices': Setting(1, 'Slices of that topology joined over DCN.',
                                           change=RUNTIME),
    'generate': GENERATE_SETTINGS,
    'pruning': PRUNING_SETTINGS,
    'harness': HARNESS_SETTINGS,
    'mesh': MESH_SETTINGS,
    'logical_axis_rules': Setting(LOGICAL_AXIS_RULES, 'The logical-to-mesh rule table.',
                                  change=RUNTIME),
})
