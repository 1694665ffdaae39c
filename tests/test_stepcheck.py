"""The per-step check every RL adapter runs (bitmatch/diagnostics/stepcheck.py): the metrics carry how much was
compared (``bitmatch/compared_tokens``, ``bitmatch/compared_seqs``) beside the mismatch count, and a
step that compares nothing is a failure under "raise" (a zero mismatch count must mean "checked
and equal", never "nothing checked"). Control: the same step with one token in the mask passes."""
from __future__ import annotations

import logging

import pytest
import torch

from bitmatch.diagnostics.stepcheck import METRIC_KEYS, BitmatchMismatchError, NothingComparedError, StepChecker


def _lp(b=3, t=5, seed=0):
    return -torch.rand(b, t, generator=torch.Generator().manual_seed(seed))


def _check(checker, rollout, trainer, mask, **kw):
    logged = {}
    c = checker.check(step=7, mode="train", rollout=rollout, trainer=trainer, mask=mask, log_metrics=logged.update,
                      **kw)
    return c, logged


def test_metrics_carry_compared_tokens_and_sequences(tmp_path):
    lp = _lp()
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])   # row 1 compares nothing
    checker = StepChecker("raise", str(tmp_path))
    c, m = _check(checker, lp, lp.clone(), mask)
    assert set(m) == set(METRIC_KEYS) and len(METRIC_KEYS) == 5
    assert m["bitmatch/compared_tokens"] == 4.0 and m["bitmatch/compared_seqs"] == 2.0, m
    assert m["bitmatch/mismatch_tokens"] == 0.0 and m["bitmatch/diff_max"] == 0.0, m
    assert c.total == 4 and c.seqs == 2 and c.bitmatched
    assert "4 tokens in 2 sequences, 0 step(s) with mismatches" in checker.summary(), checker.summary()
    # no mask: every row and token
    _, m = _check(StepChecker("raise", str(tmp_path)), lp, lp.clone(), None)
    assert (m["bitmatch/compared_tokens"], m["bitmatch/compared_seqs"]) == (15.0, 3.0), m


def test_mismatch_counts_beside_compared_counts(tmp_path):
    lp = _lp()
    other = lp.clone()
    other[2, 0] = torch.nextafter(other[2, 0], torch.tensor(0.0))          # one ulp on a compared token
    other[1, 4] += 1.0                                                     # outside the mask: ignored
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with pytest.raises(BitmatchMismatchError, match="1 of 10 completion tokens") as e:
        _check(StepChecker("raise", str(tmp_path), max_bundles=0), lp, other, mask)
    assert not isinstance(e.value, NothingComparedError)
    c, m = _check(StepChecker("log", str(tmp_path), max_bundles=0), lp, other, mask)
    counts = (m["bitmatch/mismatch_tokens"], m["bitmatch/compared_tokens"], m["bitmatch/compared_seqs"])
    assert counts == (1.0, 10.0, 3.0)
    assert not c.bitmatched


def test_nothing_compared_raises_naming_why(tmp_path):
    lp = _lp()
    checker = StepChecker("raise", str(tmp_path))
    logged = {}
    with pytest.raises(NothingComparedError, match=r"step 7 \(train\) compared no token.*nothing proves") as e:
        checker.check(step=7, mode="train", rollout=lp, trainer=lp.clone(), mask=torch.zeros(3, 5),
                      log_metrics=logged.update)
    assert isinstance(e.value, BitmatchMismatchError)      # what callers catching mismatches already catch
    # the metrics were logged before the raise, and say so
    assert logged["bitmatch/compared_tokens"] == 0.0 and logged["bitmatch/compared_seqs"] == 0.0, logged
    assert not checker.history[-1].bitmatched
    assert "1 step(s) with nothing compared" in checker.summary()
    # control: the same step with one token in the mask passes
    mask = torch.zeros(3, 5)
    mask[1, 2] = 1
    c = checker.check(step=8, mode="train", rollout=lp, trainer=lp.clone(), mask=mask)
    assert c.bitmatched and (c.total, c.seqs) == (1, 1)
    # no sequences at all
    with pytest.raises(NothingComparedError, match=r"\(0, 5\)"):
        checker.check(step=9, mode="train", rollout=lp[:0], trainer=lp[:0], mask=None)


def test_nothing_compared_warns_or_logs_under_the_other_policies(tmp_path, caplog):
    lp = _lp()
    with pytest.warns(UserWarning, match="compared no token"):
        StepChecker("warn", str(tmp_path)).check(step=1, mode="eval", rollout=lp, trainer=lp, mask=torch.zeros(3, 5))
    with caplog.at_level(logging.WARNING, logger="bitmatch.stepcheck"):
        c = StepChecker("log", str(tmp_path)).check(step=2, mode="eval", rollout=lp, trainer=lp, mask=torch.zeros(3, 5))
    assert "compared no token" in caplog.text and c.total == 0


def test_counts_are_summed_over_processes(tmp_path):
    """With a reduce (the adapters gather across ranks), an empty rank is fine when another compared
    tokens; all ranks empty raises and says so."""
    lp = _lp()
    other_rank = torch.tensor([[0.0, 0.0, 0.0, 6.0, 2.0]], dtype=torch.float64)   # 6 tokens in 2 sequences

    def reduce(stats):
        return torch.cat([stats, other_rank])

    c, m = _check(StepChecker("raise", str(tmp_path)), lp, lp.clone(), torch.zeros(3, 5), reduce=reduce)
    assert (m["bitmatch/compared_tokens"], m["bitmatch/compared_seqs"]) == (6.0, 2.0) and c.bitmatched
    with pytest.raises(NothingComparedError, match="on any of 2 processes"):
        _check(StepChecker("raise", str(tmp_path)), lp, lp.clone(), torch.zeros(3, 5),
               reduce=lambda s: torch.cat([s, torch.zeros(1, 5, dtype=torch.float64)]))
