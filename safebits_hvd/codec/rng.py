"""The counter-based RNG of stochastic rounding, defined once.

The uniform draw for element ``j`` of tensor ``i`` at step ``t`` under ``seed`` is a pure function::

    key      = mix(mix(mix(seed) ^ t) ^ i)                      # per (seed, step, tensor), on the host
    x        = (j * WEYL + key) mod 2**32                        # per element
    u(j)     = (mix(x) >> 8) * 2**-24                            # 24 random bits in [0, 1)

where ``mix`` is MurmurHash3's 32-bit finalizer. Because the draw is a function of its coordinates, the screening
pass and the sending pass see the same numbers, the CPU and CUDA kernels produce the same codes, and nothing
random is stored or checkpointed (the seed and the step are enough).

The constants below are the single source: the C/CUDA kernels receive them as ``#define`` lines prepended to
``kernels/safebits_math.h`` (see :func:`c_defines`), and :func:`uniform` is the PyTorch reference.
"""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
WEYL = 0x9E3779B9          # golden-ratio increment: consecutive j map to well-spread x
MIX_MUL1 = 0x85EBCA6B      # MurmurHash3 fmix32 multipliers
MIX_MUL2 = 0xC2B2AE35
UNIFORM_BITS = 24          # a float32 holds 24 bits exactly, so u is exact and < 1


def mix32(x: int) -> int:
    """MurmurHash3's fmix32 on a Python int (host side)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> 13
    x = (x * MIX_MUL2) & MASK32
    x ^= x >> 16
    return x


def stream_key(seed: int, step: int, tensor_index: int) -> int:
    """The 32-bit key of the draws of one tensor at one step."""
    return mix32(mix32(mix32(seed & MASK32) ^ (step & MASK32)) ^ (tensor_index & MASK32))


def stream_keys(seed: int, step: int, tensor_indices: np.ndarray) -> np.ndarray:
    """:func:`stream_key` of many tensors at once (uint32: NumPy's uint32 products wrap modulo 2^32, as fmix32's)."""
    if len(tensor_indices) == 1:          # the dense path's group of one: Python integers cost less than NumPy's
        return np.array([stream_key(seed, step, int(tensor_indices[0]))], dtype=np.uint32)
    x = np.uint32(mix32(mix32(seed & MASK32) ^ (step & MASK32))) ^ tensor_indices.astype(np.uint32)
    for shift, multiplier in ((16, MIX_MUL1), (13, MIX_MUL2)):
        x ^= x >> np.uint32(shift)
        x *= np.uint32(multiplier)
    return x ^ (x >> np.uint32(16))


def uniform(key: int, index: torch.Tensor) -> torch.Tensor:
    """PyTorch reference of the per-element draw: float32 uniforms in [0, 1) for int64 element indices."""
    x = (index.to(torch.int64) * WEYL + key) & MASK32
    x = x ^ (x >> 16)
    x = (x * MIX_MUL1) & MASK32
    x = x ^ (x >> 13)
    x = (x * MIX_MUL2) & MASK32
    x = x ^ (x >> 16)
    return (x >> (32 - UNIFORM_BITS)).to(torch.float32) * (1.0 / (1 << UNIFORM_BITS))


def c_defines() -> str:
    """``#define`` lines that give the C and CUDA kernels these constants."""
    return (f"#define SB_WEYL {WEYL}u\n#define SB_MIX_MUL1 {MIX_MUL1}u\n#define SB_MIX_MUL2 {MIX_MUL2}u\n"
            f"#define SB_UNIFORM_BITS {UNIFORM_BITS}\n")
