"""Engine benchmarks: bitmatch.Engine against the trainer, stock ops and HF generate; its step, memory and launches."""
