"""The two records the training code passes around: a TrainState (what a checkpoint holds)
and a Setup (everything built from a config before any compute; training/assembly.py builds
it, training/steps.py jits its steps). They live apart from both so that neither of those
imports the other."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import ml_collections
import optax

import input_pipeline
from models import transformer


@flax.struct.dataclass
class TrainState:
  """Everything a checkpoint holds.

  Attributes:
    step: optimizer steps taken (int32 scalar).
    params: model parameters.
    opt_state: optimizer state.
    memory: the 'memory' collection of segment-recurrent attention (the previous segment's
      layer inputs, one entry per batch row), carried to the next batch and checkpointed so
      a resumed run continues the same streams; {} for every other model.
  """
  step: jax.Array
  params: Any
  opt_state: Any
  memory: Any = flax.struct.field(default_factory=dict)


@dataclasses.dataclass
class Setup:
  """Everything built from a config before any compute.

  Attributes:
    config: the run config.
    model_config: the resolved TransformerConfig.
    model: the Decoder.
    data: the DataSource; None when built without data (`build(..., data=False)`).
    seq_len: tokens per row of the program (the data's, or config.seq_len without data).
    mesh: the device mesh.
    rules: logical axis rules.
    tx: the optimizer.
    schedule: the learning-rate schedule.
    abstract_state: TrainState of ShapeDtypeStructs carrying the target shardings.
    state_sharding: shardings of the TrainState.
    batch_sharding: sharding of every batch array.
    init_fn: rng -> freshly initialized (unboxed) TrainState.
    data_shard: (index, count): this process's block of every batch's rows, as the batch
      sharding lays them out over the processes (sharding.data_shard); its data source reads
      that block.
  """
  config: ml_collections.ConfigDict
  model_config: transformer.TransformerConfig
  model: transformer.Decoder
  data: input_pipeline.DataSource | None
  seq_len: int
  mesh: jax.sharding.Mesh
  rules: Any
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  abstract_state: TrainState
  state_sharding: Any
  batch_sharding: jax.sharding.NamedSharding
  init_fn: Any
  data_shard: tuple[int, int] = (0, 1)

  def global_rows(self, local_rows: int) -> int:
    """Rows of the global batch assembled from `local_rows` rows on each process."""
    return local_rows * self.data_shard[1]
