"""Exceptions raised by SafeBits."""


class SafeBitsError(RuntimeError):
    """Base class of SafeBits' runtime errors."""


class SafeBitsConsistencyError(SafeBitsError):
    """Ranks disagree on the allocation (digest mismatch): raised on every rank instead of diverging silently."""


class SafeBitsNonFiniteError(SafeBitsError, FloatingPointError):
    """A gradient holds NaN or Inf (the message names the parameter and the step)."""


class SafeBitsTimeoutError(SafeBitsError, TimeoutError):
    """A collective of SafeBits did not complete on every rank within ``SafeBits(timeout=...)`` seconds (a rank
    that never joins it: another process set, a crashed or stalled rank, a model registered differently)."""
