/* SafeBits per-element math: the ONE definition shared by the CPU C backend (cpu.c) and the CUDA backend
 * (cuda_kernels.cu). The PyTorch reference (reference.py) mirrors every function here operation by operation.
 *
 * The RNG constants (SB_WEYL, SB_MIX_MUL1, SB_MIX_MUL2, SB_UNIFORM_BITS) are NOT written here: the Python
 * loader prepends them (safebits_hvd.codec.kernels.source.constant_defines()).
 *
 * Rules: pure integer / float32 / float64 operations, no compiler intrinsics, no FMA (compiled with
 * -ffp-contract=off on the host and --fmad=false under NVRTC), so gcc and NVRTC produce the same bits.
 */
#ifndef SAFEBITS_MATH_H
#define SAFEBITS_MATH_H

#if !defined(SB_WEYL) || !defined(SB_MIX_MUL1) || !defined(SB_MIX_MUL2) || !defined(SB_UNIFORM_BITS)
#error "safebits_math.h needs the RNG constants from safebits_hvd.codec.rng.c_defines() prepended"
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SB_HD __host__ __device__ __forceinline__
typedef unsigned int sb_u32;
typedef long long sb_i64;
#define SB_TABLE __constant__ const
#else
#include <math.h>
#include <stdint.h>
#include <string.h>
#define SB_HD static inline
#define SB_TABLE static const
typedef uint32_t sb_u32;
typedef int64_t sb_i64;
#endif

/* Action kinds SB_FLOAT32 ... SB_LLOYD_MAX come from safebits_hvd.codec.actions.ActionKind, the Lloyd-Max tables
 * SB_LM_* from safebits_hvd.codec.actions.LLOYD_MAX_LEVELS (kernels/source.py). */
#if !defined(SB_FLOAT32) || !defined(SB_TOPK) || !defined(SB_LLOYD_MAX) || !defined(SB_LM_LEVEL_TABLE)
#error "safebits_math.h needs the action kinds and tables from safebits_hvd.codec.kernels.source.constant_defines()"
#endif

/* Lanes of the per-bucket float64 sums whose value decides a quantized output (the SIGN scale): element i of a
 * bucket (local index) is added, in index order, to lane i % SB_SUM_LANES; lanes are then added 0, 1, ..., 7. */
#define SB_SUM_LANES 8

/* The order of the float64 statistics (STAT_COLUMNS), the same in both backends so that CPU and GPU screen and
 * escalate alike at the margin: a sum of terms x_0, x_1, ... (a bucket's elements; a tensor's buckets' sums) adds
 * x_i, in index order, to partial i % SB_STAT_PARTIALS, each partial starting at +0.0; then, for s =
 * SB_STAT_PARTIALS / 2, ..., 2, 1, partial t += partial t + s for every t < s; the sum is partial 0. A CUDA block of
 * SB_STAT_PARTIALS threads sums this way (thread t takes elements t, t + 256, ...; then a tree in shared memory);
 * the C backend does the same adds in the same order (cpu.c, sb_bucket_stats and sb_sum_partials). */
#define SB_STAT_PARTIALS 256

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

/* NaN or +-Inf: an exponent of all ones (the NaN/Inf check of the batched step). */
SB_HD int sb_nonfinite(float x) { return (sb_f2u(x) & 0x7f800000u) == 0x7f800000u; }

/* MurmurHash3 fmix32. */
SB_HD sb_u32 sb_mix32(sb_u32 x) {
    x ^= x >> 16;
    x *= (sb_u32)SB_MIX_MUL1;
    x ^= x >> 13;
    x *= (sb_u32)SB_MIX_MUL2;
    x ^= x >> 16;
    return x;
}

/* The uniform draw in [0, 1) of global element index j under a stream key (see safebits_hvd/codec/rng.py). */
SB_HD float sb_uniform(sb_u32 key, sb_i64 j) {
    sb_u32 x = (sb_u32)j * (sb_u32)SB_WEYL + key;
    x = sb_mix32(x);
    return (float)(x >> (32 - SB_UNIFORM_BITS)) * (1.0f / (float)(1u << SB_UNIFORM_BITS));
}

/* Every quantizer below is split into a CODE function (what the packed wire format carries, see
 * safebits_hvd/codec/wire.py) and a VALUE function (the float32 that code stands for). The sending pass (quantize_ef),
 * the packing pass (quantize_pack_ef) and the decoder all go through them, so q == decode(encode(v)) bitwise. */

/* float32 -> IEEE half bits, round to nearest, ties to even (torch's x.half()): overflow gives +-inf, half
 * subnormals are kept, signed zeros kept, NaN gives the quiet NaN 0x7e00. Branch-free. */
SB_HD sb_u32 sb_fp16_code(float x) {
    sb_u32 b = sb_f2u(x);
    sb_u32 sign = (b >> 16) & 0x8000u;
    sb_u32 a = b & 0x7fffffffu;
    /* normal halves: keep 10 mantissa bits, RNE on the 13 dropped bits (a carry may bump the exponent), then
     * rebias the exponent from 127 to 15 (unsigned wrap for small a is discarded by the select below) */
    sb_u32 rn = (a + 0x0fffu + ((a >> 13) & 1u)) & 0xffffe000u;
    sb_u32 hn = (rn >> 13) - 0x1c000u;
    /* subnormal halves (|x| < 2^-14): multiples of 2^-24; (y + 2^23) - 2^23 rounds y < 2^22 to an integer, RNE.
     * Large a is replaced by 0 first so that the float -> int conversion stays in range (no UB). */
    float y = sb_u2f(a < 0x38800000u ? a : 0u) * 16777216.0f;
    float r = (y + 8388608.0f) - 8388608.0f;
    sb_u32 h = a < 0x38800000u ? (sb_u32)(int)r : hn;
    h = a >= 0x477ff000u ? 0x7c00u : h;           /* >= 65520 rounds to inf */
    h = a > 0x7f800000u ? 0x7e00u : h;            /* NaN */
    return sign | h;
}

/* IEEE half bits -> float32 (exact; NaN gives sign | 0x7fc00000). */
SB_HD float sb_fp16_value(sb_u32 h) {
    sb_u32 sign = (h & 0x8000u) << 16;
    sb_u32 ex = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    sb_u32 normal = ((ex + 112u) << 23) | (m << 13);
    sb_u32 sub = sb_f2u((float)(int)m * 5.9604644775390625e-08f); /* m * 2^-24, exact */
    sb_u32 r = ex == 0u ? sub : normal;
    r = ex == 31u ? (m ? 0x7fc00000u : 0x7f800000u) : r;
    return sb_u2f(sign | r);
}

/* float32 -> fp16 (RNE) -> float32, exactly torch's x.half().float(). */
SB_HD float sb_fp16_rne(float x) { return sb_fp16_value(sb_fp16_code(x)); }

/* float32 -> bfloat16 (RNE) -> float32, exactly torch's x.bfloat16().float() (NaN gives +quiet NaN). */
SB_HD float sb_bf16_rne(float x) {
    sb_u32 b = sb_f2u(x);
    sb_u32 r = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    r = (b & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : r;
    return sb_u2f(r);
}

/* The bf16 word of an already rounded value q = sb_bf16_rne(v) (its low 16 bits are zero), and back. */
SB_HD sb_u32 sb_bf16_code(float q) { return sb_f2u(q) >> 16; }
SB_HD float sb_bf16_value(sb_u32 w) { return sb_u2f(w << 16); }

/* QUANT element: scale = max|v| of the bucket (> 0; a zero bucket is all +0.0 with codes 0, handled by the
 * caller), s = levels as float, u = the uniform draw (stochastic) or 0.5f (nearest).
 * Magnitude code c = min(floor(|v|/scale*s + u), s) computed as a clamp then a truncation (t >= 0, so truncation
 * is floor; a NaN t clamps to s), returned as an exact small float. */
SB_HD float sb_quant_code(float v, float scale, float s, float u) {
    float r = (sb_u2f(sb_f2u(v) & 0x7fffffffu) / scale) * s;
    float t = r + u;
    t = t < s ? t : s;
    return (float)(int)t;
}

/* The sign bit (0 or 0x80000000) that travels with magnitude c: the sign bit of v (so -0.0 gives -0.0), except
 * that a trit has no -0 (trits != 0: c == 0 is +0.0). Bit operations keep the loops branch-free. */
SB_HD sb_u32 sb_quant_sign(float v, float c, int trits) {
    sb_u32 keep = (sb_u32)((c != 0.0f) | (trits == 0)) << 31;
    return sb_f2u(v) & keep;
}

/* QUANT value of (c, sign): c * (scale / s) carrying the sign bit. */
SB_HD float sb_quant_value(float c, sb_u32 neg, float scale, float s) {
    return sb_u2f(sb_f2u(c * (scale / s)) | neg);
}

/* q = Q(v) for a QUANT element (sb_quant_value of sb_quant_code). */
SB_HD float sb_quant(float v, float scale, float s, float u, int trits) {
    float c = sb_quant_code(v, scale, s, u);
    return sb_quant_value(c, sb_quant_sign(v, c, trits), scale, s);
}

/* The wire word of (c, neg): a trit digit (0: 0, 1: +1, 2: -1; trits have neg == 0 when c == 0) or a
 * sign-magnitude code of cb bits (sign at bit cb - 1, magnitude below). */
SB_HD sb_u32 sb_quant_word(float c, sb_u32 neg, int cb, int trits) {
    sb_u32 ci = (sb_u32)(int)c, nb = neg >> 31;
    return trits ? ci + nb : ci | (nb << (cb - 1));
}

/* The decoder's inverse of sb_quant_word: magnitude c (as float) and sign bit. */
SB_HD float sb_quant_word_code(sb_u32 w, int cb, int trits) {
    return (float)(int)(trits ? (sb_u32)(w != 0u) : (w & ((1u << (cb - 1)) - 1u)));
}
SB_HD sb_u32 sb_quant_word_sign(sb_u32 w, int cb, int trits) {
    return (trits ? (sb_u32)(w == 2u) : (w >> (cb - 1)) & 1u) << 31;
}

/* SIGN element: code 1 = negative (sign(0) = +1, NaN counts as negative); scale = (float)(lane-ordered double sum
 * of |v| / len). */
SB_HD sb_u32 sb_sign_code(float v) { return (sb_u32)!(v >= 0.0f); }
SB_HD float sb_sign_value(sb_u32 code, float scale) { return code ? -scale : scale; }
SB_HD float sb_sign(float v, float scale) { return sb_sign_value(sb_sign_code(v), scale); }

/* LLOYD_MAX: q = +-level[c] * scale, level[] the codebook's magnitudes (ascending; level[0] = 0 for 3 levels).
 * scale: of the candidates rms * factor[f] (rms = (float)sqrt(lane-ordered double sum of v^2 / len), f ascending),
 * the first with the least lane-ordered float32 sum of sb_lm_err2 over the bucket. Codes travel as QUANT words do
 * (sb_quant_sign / sb_quant_word: a sign-magnitude word of log2(levels) bits, or a trit for 3 levels). */
SB_TABLE float sb_lm_level[SB_LM_TABLE_SIZE] = SB_LM_LEVEL_TABLE;
SB_TABLE float sb_lm_threshold[SB_LM_TABLE_SIZE] = SB_LM_THRESHOLD_TABLE;
SB_TABLE float sb_lm_factor[SB_LM_NFACTORS] = SB_LM_FACTORS;

/* Magnitudes of a codebook: 2 for 3 levels (0 and one), levels / 2 otherwise. */
SB_HD int sb_lm_magnitudes(int levels) { return (levels + 1) / 2; }

SB_HD float sb_lm_scale(double sum_sq, int len) { return (float)sqrt(sum_sq / (double)len); }

/* Magnitude code c (an exact small float): how many of the codebook's thresholds r = |v| * (1 / scale) reaches,
 * i.e. the nearest magnitude (a NaN ratio, e.g. 0 * inf in a zero bucket, gives 0). A product by the reciprocal,
 * not a division: the reciprocal is hoisted out of the element loops. Table reads use the loop index only, so every
 * CUDA thread of a warp reads the same constant. */
SB_HD float sb_lm_code(float v, float scale, int levels) {
    float r = sb_u2f(sb_f2u(v) & 0x7fffffffu) * (1.0f / scale);
    int first = SB_LM_FIRST(levels), m = sb_lm_magnitudes(levels);
    float c = 0.0f;
    for (int k = 1; k < m; k++) c += r >= sb_lm_threshold[first + k] ? 1.0f : 0.0f;
    return c;
}

/* level[sb_lm_code(v, scale, levels)] without the code: one compare-and-select per threshold. The thresholds
 * ascend, so the last one r reaches picks the same level as the count of those reached (a NaN r reaches none:
 * level[0], as code 0). Its compares are sb_lm_code's, which the compiler shares when both are inlined together:
 * the encoder needs no select chain over the code. */
SB_HD float sb_lm_magnitude(float v, float scale, int levels) {
    float r = sb_u2f(sb_f2u(v) & 0x7fffffffu) * (1.0f / scale);
    int first = SB_LM_FIRST(levels), m = sb_lm_magnitudes(levels);
    float x = sb_lm_level[first];
    for (int k = 1; k < m; k++) x = r >= sb_lm_threshold[first + k] ? sb_lm_level[first + k] : x;
    return x;
}

/* A magnitude level (sb_lm_level[]) times scale, carrying the sign bit `neg`. */
SB_HD float sb_lm_signed(float level, sb_u32 neg, float scale) { return sb_u2f(sb_f2u(level * scale) | neg); }

/* LLOYD_MAX value of (c, sign), the decoder's side: level[c] * scale carrying the sign bit (a select chain, not an
 * indexed read). */
SB_HD float sb_lm_value(float c, sb_u32 neg, float scale, int levels) {
    int first = SB_LM_FIRST(levels), m = sb_lm_magnitudes(levels);
    float x = sb_lm_level[first];
    for (int k = 1; k < m; k++) x = c >= (float)k ? sb_lm_level[first + k] : x;
    return sb_lm_signed(x, neg, scale);
}

/* q = Q(v) for a LLOYD_MAX element: sb_lm_value(c, sign) with c = sb_lm_code(v), the level taken from the same
 * compares (sb_lm_magnitude). */
SB_HD float sb_lm(float v, float scale, int levels, int trits) {
    float c = sb_lm_code(v, scale, levels);
    return sb_lm_signed(sb_lm_magnitude(v, scale, levels), sb_quant_sign(v, c, trits), scale);
}

/* (level[c] * scale - |v|)^2 in float32, = (q - v)^2 up to rounding: what the scale choice sums (in float32 lanes:
 * the choice only has to be the same everywhere, and float32 halves its cost). */
SB_HD float sb_lm_err2(float v, float scale, int levels) {
    float d = sb_lm_magnitude(v, scale, levels) * scale - sb_u2f(sb_f2u(v) & 0x7fffffffu);
    return d * d;
}

/* nbits (1..16) bits at bit position `bit` of an LSB-first bitstream; reads only the bytes that hold them. */
SB_HD sb_u32 sb_get_bits(const unsigned char *p, sb_i64 bit, int nbits) {
    const unsigned char *q = p + (bit >> 3);
    int sh = (int)(bit & 7);
    int nbytes = (sh + nbits + 7) >> 3;
    sb_u32 acc = 0;
    for (int i = 0; i < nbytes; i++) acc |= (sb_u32)q[i] << (8 * i);
    return (acc >> sh) & ((1u << nbits) - 1u);
}

/* 3^i for i in 0..4: the weight of trit i within its byte (byte = sum_i digit_i * 3^i). */
SB_HD sb_u32 sb_pow3(int i) {
    sb_u32 p = 1u;
    for (int k = 0; k < i; k++) p *= 3u;
    return p;
}

/* Trit digit of element j of a 5-trits-per-byte stream. */
SB_HD sb_u32 sb_get_trit(const unsigned char *p, sb_i64 j) {
    return ((sb_u32)p[j / 5] / sb_pow3((int)(j % 5))) % 3u;
}

/* Bits of one top-k local index for buckets of `bucket` elements: ceil(log2(bucket)). */
SB_HD int sb_index_bits(sb_i64 bucket) {
    int b = 0;
    while (((sb_i64)1 << b) < bucket) b++;
    return b;
}

/* Bits of one sign-magnitude QUANT code: 1 + ceil(log2(levels + 1)). */
SB_HD int sb_quant_bits(int levels) { return 1 + sb_index_bits((sb_i64)levels + 1); }

/* Bits of one LLOYD_MAX word: log2(levels) (sign bit on top); 0 for 3 levels (trits). */
SB_HD int sb_lm_bits(int levels) { return levels == 3 ? 0 : sb_index_bits((sb_i64)levels); }

/* Bits per code of the scale-and-codes kinds (QUANT bitstream, LLOYD_MAX, SIGN); 0 for trits and other kinds. */
SB_HD int sb_code_bits(int kind, int levels, int trits) {
    if (trits) return 0;
    return kind == SB_QUANT ? sb_quant_bits(levels) : kind == SB_LLOYD_MAX ? sb_lm_bits(levels)
                                                      : kind == SB_SIGN ? 1 : 0;
}

/* Kinds whose body is one fp32 scale per bucket, then the codes. */
SB_HD int sb_has_scales(int kind) { return kind == SB_QUANT || kind == SB_SIGN || kind == SB_LLOYD_MAX; }

/* The screen's test of one action's four sums [err2, qv, q2, v2] (safebits_hvd/policy/screen.py: distortion_cosine_of,
 * then passes with margin 0), in the same float64 operations: admissible when distortion <= max_distortion and
 * cosine >= min_cosine. Python takes a square root of a negative sum as NaN explicitly; sqrt does so itself. */
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define SB_INF_D __longlong_as_double(0x7ff0000000000000LL)
#else
#define SB_INF_D ((double)INFINITY)
#endif
SB_HD int sb_passes(const double *s, double max_distortion, double min_cosine) {
    double err2 = s[0], qv = s[1], q2 = s[2], v2 = s[3];
    double d = v2 > 0 ? err2 / v2 : (err2 == 0 ? 0.0 : SB_INF_D);
    if (!isfinite(d)) d = SB_INF_D;
    double den = sqrt(q2) * sqrt(v2);
    double c = den > 0 ? qv / den : ((q2 == 0 && v2 == 0) ? 1.0 : 0.0);
    if (!isfinite(c)) c = -SB_INF_D;
    return d <= max_distortion && c >= min_cosine;
}

/* The first action to send (safebits_hvd/policy/budget.py, BudgetPolicy.send_order; kernels.first_candidates): the
 * allocated one if the screen admits it (the lossless one always is), else the cheapest admissible lossy action in
 * cost_order (this tensor's row), else the lossless one. stats: (nact, 4). */
SB_HD int sb_first_candidate(const double *stats, int nact, int allocated, const sb_i64 *cost_order,
                             const unsigned char *lossless, int lossless_index, double max_distortion,
                             double min_cosine) {
    if (lossless[allocated] || sb_passes(stats + 4 * allocated, max_distortion, min_cosine)) return allocated;
    for (int p = 0; p < nact; p++) {
        int a = (int)cost_order[p];
        if (!lossless[a] && sb_passes(stats + 4 * a, max_distortion, min_cosine)) return a;
    }
    return lossless_index;
}

#endif /* SAFEBITS_MATH_H */
