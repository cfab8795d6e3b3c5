"""Step 1's experiments: what the benchmarks sweep and the tests cover beyond the notebooks' kernels."""
