"""Assembles kernel translation units: the shared constants (defined once, in Python), then the shared math
header, then one backend's file. Both the C and the CUDA backend compile exactly what this returns."""

from __future__ import annotations

from pathlib import Path

from .. import rng
from ..actions import LLOYD_MAX_LEVELS, ActionKind, lloyd_max_levels, lloyd_max_scale_factors, lloyd_max_thresholds

HERE = Path(__file__).resolve().parent


def _float_list(values: list[float]) -> str:
    # repr of a float32 value read back as a float literal is that float32 exactly
    return "{" + ", ".join(f"{x!r}f" for x in values) + "}"


def lloyd_max_defines() -> str:
    """The Lloyd-Max tables (:data:`safebits_hvd.codec.actions.LLOYD_MAX_LEVELS`) for ``safebits_math.h``: all
    codebooks' magnitudes back to back (``SB_LM_LEVEL_TABLE``), the rounding thresholds at the same positions
    (``SB_LM_THRESHOLD_TABLE``; entry ``first + k`` separates magnitudes ``k - 1`` and ``k``, entry ``first`` is
    unused), ``SB_LM_FIRST(levels)``, the position of a codebook's first magnitude, and the candidate scale factors
    ``SB_LM_FACTORS`` (:data:`safebits_hvd.codec.actions.LLOYD_MAX_SCALE_FACTORS`)."""
    levels, thresholds, first = [], [], []
    for count in sorted(LLOYD_MAX_LEVELS):
        first.append((count, len(levels)))
        levels += lloyd_max_levels(count)
        thresholds += [0.0, *lloyd_max_thresholds(count)]
    select = "".join(f"(levels) == {count} ? {pos} : " for count, pos in first[:-1]) + str(first[-1][1])
    return (f"#define SB_LM_LEVEL_TABLE {_float_list(levels)}\n"
            f"#define SB_LM_THRESHOLD_TABLE {_float_list(thresholds)}\n"
            f"#define SB_LM_TABLE_SIZE {len(levels)}\n"
            f"#define SB_LM_FIRST(levels) ({select})\n"
            f"#define SB_LM_FACTORS {_float_list(lloyd_max_scale_factors())}\n"
            f"#define SB_LM_NFACTORS {len(lloyd_max_scale_factors())}\n")


def constant_defines() -> str:
    """``#define`` lines for the RNG constants, the action kinds (``SB_<KIND>``) and the Lloyd-Max tables."""
    kinds = "".join(f"#define SB_{kind.name} {int(kind)}\n" for kind in ActionKind)
    return rng.c_defines() + kinds + lloyd_max_defines()


def translation_unit(backend_file: str) -> str:
    """Constants + ``safebits_math.h`` + ``backend_file`` (``cpu.c`` or ``cuda_kernels.cu``)."""
    return (constant_defines() + (HERE / "safebits_math.h").read_text() + f'\n#line 1 "{backend_file}"\n'
            + (HERE / backend_file).read_text())
