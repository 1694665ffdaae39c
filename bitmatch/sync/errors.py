"""The errors of bitmatch.sync: every failed update raises a SyncError and keeps the previous version."""


class SyncError(RuntimeError):
    """A weight update failed; the previous version stays in place."""


class FingerprintMismatchError(SyncError):
    def __init__(self, name: str, expected: str, got: str, where: str = ""):
        self.name, self.expected, self.got = name, expected, got
        super().__init__(f"fingerprint mismatch for tensor {name!r}{where}: expected {expected}, got {got}")


class WeightsNotReadyError(SyncError):
    """Generation refused: no verified weight version of the expected number is loaded."""


class CanonicalOrderError(SyncError):
    """The sender's kernels run another canonical order (or backend) than the receiver's: the same
    weights would give other bits (bitmatch.kernels.order)."""


class WeightVersionError(SyncError):
    """A rollout was sampled with another weight version than the trainer expects."""


class AuthenticationError(SyncError):
    """The peer did not present the shared token."""
