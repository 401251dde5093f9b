"""Benchmarks: bardflow's training step and sampler against the codelab-style baselines."""
