"""Weight-sync benchmarks: publish, verify and fingerprinting against a plain copy."""
