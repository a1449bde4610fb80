"""On a machine with no TPU, every script here runs JAX on the CPU without starting libtpu
(requirements.txt installs it for --mode=compile): otherwise each process prints a screen of
TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES errors that read as failures."""

from training import xla_flags

xla_flags.skip_absent_tpu()
