/* SafeBits per-element math: the ONE definition shared by the CPU C backend (cpu.c) and the CUDA backend
 * (cuda_kernels.cu). The PyTorch reference (reference.py) mirrors every function here operation by operation.
 *
 * The RNG constants (SB_WEYL, SB_MIX_MUL1, SB_MIX_MUL2, SB_UNIFORM_BITS) are NOT written here: the Python
 * loader prepends them (safebits_hvd.kernels.source.constant_defines()).
 *
 * Rules: pure integer / float32 / float64 operations, no compiler intrinsics, no FMA (compiled with
 * -ffp-contract=off on the host and --fmad=false under NVRTC), so gcc and NVRTC produce the same bits.
 */
#ifndef SAFEBITS_MATH_H
#define SAFEBITS_MATH_H

#if !defined(SB_WEYL) || !defined(SB_MIX_MUL1) || !defined(SB_MIX_MUL2) || !defined(SB_UNIFORM_BITS)
#error "safebits_math.h needs the RNG constants from safebits_hvd.rng.c_defines() prepended"
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SB_HD __host__ __device__ __forceinline__
typedef unsigned int sb_u32;
typedef long long sb_i64;
#else
#include <stdint.h>
#include <string.h>
#define SB_HD static inline
typedef uint32_t sb_u32;
typedef int64_t sb_i64;
#endif

/* Action kinds SB_FLOAT32 ... SB_TOPK come from safebits_hvd.actions.ActionKind (kernels/source.py). */
#if !defined(SB_FLOAT32) || !defined(SB_TOPK)
#error "safebits_math.h needs the action kinds from safebits_hvd.kernels.source.constant_defines()"
#endif

/* Lanes of the per-bucket float64 sums whose value decides a quantized output (the SIGN scale): element i of a
 * bucket (local index) is added, in index order, to lane i % SB_SUM_LANES; lanes are then added 0, 1, ..., 7. */
#define SB_SUM_LANES 8

SB_HD sb_u32 sb_f2u(float x) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return (sb_u32)__float_as_uint(x);
#else
    sb_u32 u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

SB_HD float sb_u2f(sb_u32 u) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* |x| as an ordered integer key: for non-NaN x the order of keys is the order of magnitudes, NaN keys are
 * above +inf. Used for the bucket max (QUANT scale) and the TOPK selection. */
SB_HD sb_u32 sb_abs_key(float x) { return sb_f2u(x) & 0x7fffffffu; }

/* MurmurHash3 fmix32. */
SB_HD sb_u32 sb_mix32(sb_u32 x) {
    x ^= x >> 16;
    x *= (sb_u32)SB_MIX_MUL1;
    x ^= x >> 13;
    x *= (sb_u32)SB_MIX_MUL2;
    x ^= x >> 16;
    return x;
}

/* The uniform draw in [0, 1) of global element index j under a stream key (see safebits_hvd/rng.py). */
SB_HD float sb_uniform(sb_u32 key, sb_i64 j) {
    sb_u32 x = (sb_u32)j * (sb_u32)SB_WEYL + key;
    x = sb_mix32(x);
    return (float)(x >> (32 - SB_UNIFORM_BITS)) * (1.0f / (float)(1u << SB_UNIFORM_BITS));
}

/* float32 -> fp16 (round to nearest, ties to even) -> float32, exactly torch's x.half().float():
 * overflow gives +-inf, half subnormals are kept, signed zeros kept. NaN gives a quiet NaN. Branch-free. */
SB_HD float sb_fp16_rne(float x) {
    sb_u32 b = sb_f2u(x);
    sb_u32 sign = b & 0x80000000u;
    sb_u32 a = b & 0x7fffffffu;
    /* normal halves: keep 10 mantissa bits, RNE on the 13 dropped bits (a carry may bump the exponent) */
    sb_u32 rn = (a + 0x0fffu + ((a >> 13) & 1u)) & 0xffffe000u;
    /* subnormal halves (|x| < 2^-14): multiples of 2^-24; (y + 2^23) - 2^23 rounds y < 2^22 to an integer, RNE */
    float y = sb_u2f(a) * 16777216.0f;
    float r = (y + 8388608.0f) - 8388608.0f;
    sb_u32 rs = sb_f2u(r * 5.9604644775390625e-08f);
    sb_u32 m = a < 0x38800000u ? rs : rn;
    m = a >= 0x477ff000u ? 0x7f800000u : m;          /* >= 65520 rounds to inf */
    m = a > 0x7f800000u ? 0x7fc00000u : m;           /* NaN */
    return sb_u2f(sign | m);
}

/* float32 -> bfloat16 (RNE) -> float32, exactly torch's x.bfloat16().float() (NaN gives +quiet NaN). */
SB_HD float sb_bf16_rne(float x) {
    sb_u32 b = sb_f2u(x);
    sb_u32 r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    r = (b & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : r;
    return sb_u2f(r);
}

/* QUANT element: scale = max|v| of the bucket (> 0; the caller writes 0 for a zero bucket), s = levels as
 * float, u = the uniform draw (stochastic) or 0.5f (nearest). c = min(floor(|v|/scale*s + u), s) computed as a
 * clamp then a truncation (t >= 0, so truncation is floor; a NaN t clamps to s); q = c * (scale / s) carrying
 * the sign bit of v (so -0.0 gives -0.0). Sign handling by bit operations keeps the loop branch-free (gcc does
 * not if-convert two float selects on one condition). */
SB_HD float sb_quant(float v, float scale, float s, float u) {
    sb_u32 b = sb_f2u(v);
    float r = (sb_u2f(b & 0x7fffffffu) / scale) * s;
    float t = r + u;
    t = t < s ? t : s;
    float c = (float)(int)t;
    return sb_u2f(sb_f2u(c * (scale / s)) | (b & 0x80000000u));
}

/* SIGN element: scale = (float)(lane-ordered double sum of |v| / len). sign(0) = +1. */
SB_HD float sb_sign(float v, float scale) { return v >= 0.0f ? scale : -scale; }

#endif /* SAFEBITS_MATH_H */
