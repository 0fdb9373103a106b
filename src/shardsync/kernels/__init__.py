"""Device kernels for the engine's process step (benchmarks use them as a realistic per-layer step)."""
