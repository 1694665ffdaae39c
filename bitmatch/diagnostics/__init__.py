"""Diagnostics: they observe a model, an engine or a training step and report, and never change one.

- ``verify``: ``compare`` (bit patterns), ``locate`` / ``locate_pair`` (the first divergent op);
- ``tracing``: the per-op recorder and trace diff ``locate`` runs on;
- ``faults``: the planted faults of ``--inject`` (the controls of ``locate``);
- ``stepcheck``: ``StepChecker``, the per-step comparison TRL, verl and a custom loop share;
- ``replay``: a repro bundle run again against a checkpoint (``bitmatch replay``);
- ``controls``, ``family_check``: the stock controls and the family cases of ``bitmatch check``.

Import the module you need (``from bitmatch.diagnostics.verify import compare``): this package's
``__init__`` loads none of them, so ``import bitmatch.diagnostics`` stays light.
"""
