"""Exceptions raised by SafeBits."""


class SafeBitsError(RuntimeError):
    """Base class of SafeBits' runtime errors."""


class SafeBitsConsistencyError(SafeBitsError):
    """Ranks disagree on the allocation (digest mismatch): raised on every rank instead of diverging silently."""


class SafeBitsNonFiniteError(SafeBitsError, FloatingPointError):
    """A gradient holds NaN or Inf (the message names the parameter and the step)."""
