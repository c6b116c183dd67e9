"""The FSDP2 front end's public module, ``from safebits_hvd import fsdp as sbfsdp`` (its code:
:mod:`safebits_hvd.frontends.fsdp`)."""

from .frontends.fsdp import FSDPState, SafeBitsReduceScatter, compress

__all__ = ["FSDPState", "SafeBitsReduceScatter", "compress"]
