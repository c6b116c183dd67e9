"""Error feedback (docs/DESIGN.md, "The algorithm as implemented", step 3): the per-parameter residual ``e``.

Each step the compressor sends ``q = Q(v)`` for ``v = g + e`` and keeps ``e <- v - q``, where ``q`` is exactly what
went on the wire, so nothing is lost, only delayed: over any number of steps
``sum(sent) + e_final = sum(gradients)`` (up to float32 rounding of the additions).

The arithmetic itself is fused into the quantization kernel (``kernels.quantize_ef``) to touch memory once;
this module owns the residual buffers: creation, lookup and checkpointing. Under Horovod every rank keeps (and
checkpoints) its own residuals.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Residual buffers: one flat float32 tensor per parameter name, created as zeros on first use."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        # Counts every change of which tensor holds a residual (made, moved, removed, loaded); residuals are
        # otherwise updated in place, so a list of them (with their addresses) made at one version holds until
        # the next.
        self.version = 0

    def residual(self, name: str, numel: int, device: torch.device) -> torch.Tensor:
        """The residual of ``name`` (flat float32, ``numel`` elements, on ``device``), created as zeros.

        Raises ``ValueError`` if it exists with another size: replacing it would silently drop what it holds."""
        e = self.residuals.get(name)
        if e is None:
            e = torch.zeros(numel, dtype=torch.float32, device=device)
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

    def pop(self, name: str) -> torch.Tensor | None:
        """Remove ``name``'s residual and return it (None if it has none)."""
        self.version += 1
        return self.residuals.pop(name, None)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: e.detach().clone() for name, e in self.residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, e in state.items():
            if not isinstance(e, torch.Tensor) or e.dtype != torch.float32 or e.dim() != 1:
                raise ValueError(f"residual {name!r} must be a flat float32 tensor")
            if not torch.isfinite(e).all():
                raise ValueError(f"residual {name!r} holds non-finite values")
        self.residuals = {name: e.detach().clone() for name, e in state.items()}
        self.version += 1
