"""Version and readiness of an engine's weights: what the engine holds per step, kept on the model.

A ``Receiver`` owns one ``WeightState`` and attaches it to its target; the engine asks
``require_ready(model)`` before each generation and holds ``WeightState.generation()`` for the step,
so no commit happens inside it.
"""
from __future__ import annotations

import contextlib
import threading

from bitmatch.models.state import create_state, get_state

from .errors import WeightsNotReadyError, WeightVersionError
from .fingerprint import Manifest


class WeightState:
    """Version and readiness of an engine's weights; the engine holds ``generation()`` per step."""

    def __init__(self):
        self.lock = threading.RLock()
        self.version: int | None = None
        self.manifest: Manifest | None = None
        self.updating: int | None = None   # version being staged
        self.failure: str | None = None    # why the last update failed
        self.live_check = None             # the receiver's check that the live bytes are the verified ones
        self.quantization = None           # the receiver's mode: an engine over its target must run the same

    @property
    def ready(self) -> bool:
        return self.version is not None and self.failure is None and self.updating is None

    def require_ready(self, expected_version: int | None = None, check_live: bool = True) -> int:
        """Return the loaded version; raise WeightsNotReadyError / WeightVersionError otherwise
        (``check_live``: also the receiver's check that the live bytes are still the verified ones)."""
        if self.failure is not None:
            held = ("no verified version is loaded" if self.version is None
                    else f"version {self.version} is still loaded")
            raise WeightsNotReadyError(f"refusing to generate: {self.failure}; {held}, waiting for a full "
                                       f"update to succeed")
        if self.updating is not None:
            raise WeightsNotReadyError(f"refusing to generate: update to version {self.updating} in progress")
        if self.version is None:
            raise WeightsNotReadyError("refusing to generate: no verified weight version loaded yet")
        if check_live and self.live_check is not None:
            problem = self.live_check()
            if problem is not None:
                self.failure = problem
                raise WeightsNotReadyError(f"refusing to generate: {problem}; publish a new version (the live "
                                           f"weights are no longer version {self.version})")
        if expected_version is not None and self.version != expected_version:
            raise WeightVersionError(f"engine holds weight version {self.version}, expected {expected_version}")
        return self.version

    @contextlib.contextmanager
    def generation(self, expected_version: int | None = None):
        """Hold the weights for one generation step: no commit can happen inside; yields the version."""
        with self.lock:
            yield self.require_ready(expected_version)


def attach_state(model, state: WeightState) -> None:
    """Make ``state`` the WeightState of ``model`` (kept in its ``ModelState``; a copy of the model
    is no receiver's target, so it does not carry it)."""
    create_state(model).weights = state


def weight_state(model) -> WeightState | None:
    """The WeightState a receiver attached to ``model`` (None for a model no receiver manages)."""
    st = get_state(model)
    return None if st is None else st.weights


def require_ready(model, expected_version: int | None = None) -> int | None:
    """For engines: call before each generation. Returns the weight version to stamp on the outputs
    (None when no receiver manages ``model``); raises WeightsNotReadyError when a managed model has
    no fully verified version (update in progress or failed)."""
    st = weight_state(model)
    return None if st is None else st.require_ready(expected_version)
