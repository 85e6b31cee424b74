"""Benchmarks: ``bench/throughput.py`` (data, step, end to end), ``bench/kernels.py``,
``bench/gpu_check.sh``; ``bench/common.py`` holds what they share (timing, memory, the
environment block, tables, JSON)."""
