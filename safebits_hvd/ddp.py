"""The DDP front end's public module, ``from safebits_hvd import ddp as sbddp`` (its code:
:mod:`safebits_hvd.frontends.ddp`)."""

from .frontends.ddp import AcrossNodesState, SafeBitsState, safebits_hook

__all__ = ["AcrossNodesState", "SafeBitsState", "safebits_hook"]
