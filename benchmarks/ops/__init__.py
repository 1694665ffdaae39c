"""Op benchmarks: each bitmatch op or kernel against its stock (or previous) counterpart, with its invariance checks."""
