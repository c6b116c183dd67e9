"""Error feedback (docs/DESIGN.md, "The algorithm as implemented", step 3): the per-parameter residual ``e``.

Each step the compressor sends ``q = Q(v)`` for ``v = g + e`` and keeps ``e <- v - q``, where ``q`` is exactly what
went on the wire, so nothing is lost, only delayed: over any number of steps
``sum(sent) + e_final = sum(gradients)`` (up to float32 rounding of the additions; with bfloat16 residuals, up to
their rounding too).

The arithmetic itself is fused into the quantization kernel (``kernels.quantize_ef``) to touch memory once;
this module owns the residual buffers: creation, lookup, checkpointing, and their storage type. Under Horovod every
rank keeps (and checkpoints) its own residuals.
"""

from __future__ import annotations

import torch

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
"""What a residual can be stored as. bfloat16 halves the memory error feedback takes (a full gradient's worth per
rank, which is what sharded training saves elsewhere): the send passes still work in float32, on a copy
(:meth:`ErrorFeedback.staging`), and each step's new residual is rounded to bfloat16 when stored."""


class ErrorFeedback:
    """Residual buffers: one flat tensor per parameter name, of ``dtype`` (one of :data:`RESIDUAL_DTYPES`),
    created as zeros on first use."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {[str(d) for d in RESIDUAL_DTYPES]}, got {dtype!r}")
        self.dtype = dtype
        self.residuals: dict[str, torch.Tensor] = {}
        # Counts every change of which tensor holds a residual (made, moved, removed, loaded) or of the staging
        # buffer; residuals are otherwise updated in place, so a list of them (with their addresses) made at one
        # version holds until the next.
        self.version = 0
        self._staging: dict[torch.device, torch.Tensor] = {}

    @property
    def stages(self) -> bool:
        """Whether the residuals are stored in another type than the float32 the send passes work in."""
        return self.dtype != torch.float32

    @property
    def nbytes(self) -> int:
        """Bytes the residuals take (what error feedback costs in memory)."""
        return sum(e.numel() * e.element_size() for e in self.residuals.values())

    def residual(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """The residual of ``name`` (flat, ``numel`` elements of :attr:`dtype`, on ``device``), created as zeros.

        Raises ``ValueError`` if it exists with another size: replacing it would silently drop what it holds."""
        e = self.residuals.get(name)
        if e is None:
            e = torch.zeros(numel, dtype=self.dtype, device=device)
            self.residuals[name] = e
            self.version += 1
        elif e.numel() != numel:
            raise ValueError(f"the error-feedback residual of {name!r} holds {e.numel()} elements, not {numel}: it "
                             f"was restored from a state of another model or world size")
        elif e.device != device:
            e = e.to(device)
            self.residuals[name] = e
            self.version += 1
        return e

    def staging(self, elements: int, device: torch.device) -> torch.Tensor:
        """A float32 buffer of at least ``elements`` on ``device`` that a send pass works in while the residuals are
        stored as bfloat16: one per device, reused by every group (grown when a group needs more, which counts as a
        change of :attr:`version`)."""
        buffer = self._staging.get(device)
        if buffer is None or buffer.numel() < elements:
            buffer = self._staging[device] = torch.empty(elements, dtype=torch.float32, device=device)
            self.version += 1
        return buffer

    def pop(self, name: str) -> torch.Tensor | None:
        """Remove ``name``'s residual and return it (None if it has none)."""
        self.version += 1
        return self.residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: e.detach().clone() for name, e in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict`'s residuals, float32 or bfloat16 whatever :attr:`dtype` is (a float32 state
        loaded into bfloat16 residuals is rounded)."""
        for name, e in state.items():
            if not isinstance(e, torch.Tensor) or e.dtype not in RESIDUAL_DTYPES or e.dim() != 1:
                raise ValueError(f"residual {name!r} must be a flat float32 or bfloat16 tensor")
            if not torch.isfinite(e).all():
                raise ValueError(f"residual {name!r} holds non-finite values")
        self.residuals = {name: e.detach().to(self.dtype, copy=True) for name, e in state.items()}
        self.version += 1
