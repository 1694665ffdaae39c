"""Parallel benchmarks: the tensor / expert parallel layouts on several GPUs against the stock layouts."""
