"""Assembles kernel translation units: the shared constants (defined once, in Python), then the shared math
header, then one backend's file. Both the C and the CUDA backend compile exactly what this returns."""

from __future__ import annotations

from pathlib import Path

from .. import rng
from ..actions import ActionKind

HERE = Path(__file__).resolve().parent


def constant_defines() -> str:
    """``#define`` lines for the RNG constants and the action kinds (``SB_<KIND>``)."""
    kinds = "".join(f"#define SB_{kind.name} {int(kind)}\n" for kind in ActionKind)
    return rng.c_defines() + kinds


def translation_unit(backend_file: str) -> str:
    """Constants + ``safebits_math.h`` + ``backend_file`` (``cpu.c`` or ``cuda_kernels.cu``)."""
    return (constant_defines() + (HERE / "safebits_math.h").read_text() + f'\n#line 1 "{backend_file}"\n'
            + (HERE / backend_file).read_text())
