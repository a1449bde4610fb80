"""What a compiled program costs, read from the program itself: the kernels, FLOPs, bytes and
collectives of optimized HLO (hlo_cost), the chips' published figures (chips), a roofline
estimate of the step (roofline), and the report of `--mode=compile` (compile_report,
program_stats).

Imported by `--mode=compile` (training/aot.py), the benchmarks and the tests; a training run
does not load it (tests/test_layering.py checks).
"""
