/* SafeBits CPU backend: OpenMP loops over buckets calling the per-element math of safebits_math.h.
 *
 * The Python loader (cpu.py) compiles source.translation_unit("cpu.c") (constants, safebits_math.h, this file)
 * as ONE translation unit with
 * `cc -O3 -fopenmp -ffp-contract=off -fPIC -shared` (no -ffast-math, no -march=native: bit-identical to the
 * PyTorch reference). Hot per-bucket functions are also built for AVX2 with target_clones (runtime dispatch by
 * the CPU); a target changes the vector width, never an IEEE result (no FMA: -ffp-contract=off).
 * tests/test_kernel_targets.py builds each target alone (and AVX-512's, not cloned: slower here for the Lloyd-Max
 * actions, docs/RESULTS.md 5.2) and compares their bits.
 *
 * Every bucket is processed by one thread: pass 1 reads g and e into a bucket buffer (L1) and reduces max|v| or
 * the lane sums, pass 2 quantizes into `out`, pass 3 writes e = v - q and accumulates the float64 statistics in
 * the order both backends share (safebits_math.h, SB_STAT_PARTIALS). Per-bucket statistics go to a scratch array
 * summed in that order too, so results depend neither on the thread count nor on the backend.
 */
#include <stdlib.h>
#include <string.h>

#ifndef SB_PAR_MIN
#define SB_PAR_MIN 32768 /* elements below which the loops stay serial (OpenMP fork costs more) */
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(SB_NO_CLONES)
#define SB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SB_CLONES
#endif

typedef struct {
    int kind, levels, stochastic, topk, trits; /* trits: QUANT levels == 1 packed 5 trits per byte (no -0.0) */
} sb_action;

/* Per-thread scratch that outlives a call: slot `slot` of the calling thread, 64-byte aligned, at least `bytes` long
 * (NULL when out of memory). A malloc per call costs more than a small tensor's work (the 1,000-tensor step,
 * docs/RESULTS.md 5.1). SB_SCRATCH_PART: a call's per-bucket statistics, held by the calling thread until it
 * returns; SB_SCRATCH_V, _Q, _K, _W: one bucket's buffers, per loop iteration, on the thread that runs it;
 * SB_SCRATCH_BODY (group.c): an aligned copy of a payload body, held across a packing call on the same thread. No
 * function that holds a slot calls another that takes the same slot. */
enum { SB_SCRATCH_PART, SB_SCRATCH_V, SB_SCRATCH_Q, SB_SCRATCH_K, SB_SCRATCH_W, SB_SCRATCH_BODY, SB_SCRATCH_SLOTS };
static __thread void *sb_scratch_at[SB_SCRATCH_SLOTS];
static __thread size_t sb_scratch_bytes[SB_SCRATCH_SLOTS];

static void *sb_scratch(int slot, size_t bytes) {
    if (sb_scratch_bytes[slot] < bytes || !sb_scratch_at[slot]) {
        size_t size = (bytes + 63) / 64 * 64 + 64; /* aligned_alloc wants a multiple of the alignment */
        free(sb_scratch_at[slot]);
        sb_scratch_at[slot] = aligned_alloc(64, size);
        sb_scratch_bytes[slot] = sb_scratch_at[slot] ? size : 0;
    }
    return sb_scratch_at[slot];
}

/* for (sb_i64 VAR = 0; VAR < COUNT; VAR++) BODY, across `nthreads` OpenMP threads when `parallel` (static: equal
 * parts; dynamic: one iteration at a time), else on this thread outside any OpenMP construct: an inactive parallel
 * region still starts a team of one (about 0.2 us), more than a small tensor's work. */
#define SB_LOOP(PRAGMA, parallel, VAR, COUNT, ...)                                                                    \
    do {                                                                                                              \
        if (parallel) {                                                                                               \
            _Pragma(PRAGMA) for (sb_i64 VAR = 0; VAR < (COUNT); VAR++) __VA_ARGS__                                    \
        } else {                                                                                                      \
            for (sb_i64 VAR = 0; VAR < (COUNT); VAR++) __VA_ARGS__                                                    \
        }                                                                                                             \
    } while (0)
#define SB_LOOP_STATIC(parallel, VAR, COUNT, ...)                                                                     \
    SB_LOOP("omp parallel for schedule(static) num_threads(nthreads)", parallel, VAR, COUNT, __VA_ARGS__)
#define SB_LOOP_DYNAMIC(parallel, VAR, COUNT, ...)                                                                    \
    SB_LOOP("omp parallel for schedule(dynamic, 1) num_threads(nthreads)", parallel, VAR, COUNT, __VA_ARGS__)

/* Marks a failure (out of memory) from inside an SB_LOOP body, on any thread. */
#define SB_FAIL(flag) do { _Pragma("omp atomic write") flag = 1; } while (0)

/* The TOPK threshold: the k-th largest (k in 1..n) magnitude key sb_abs_key(v[i]) of v[0..n).
 *
 * A branch-light, vectorizable search on the key VALUE instead of a quickselect on the keys (whose unpredictable
 * branches cost ~15 cycles per element): keep an interval [lo, hi) that holds the answer t, with
 * above = #(key >= hi) < k <= cnt_lo = #(key >= lo), and shrink it by counting the keys above three quartile
 * thresholds per pass (three independent counts per pass hide the latency of one). Only counting is involved, so
 * the result is exactly the k-th largest key whatever the ties. Passes run first on the top 15 key bits as 16-bit
 * lanes (h, twice the lanes per vector), then on the full keys; the search stops early once the answer is the
 * largest (k - above == 1) or the smallest (k == cnt_lo) key of the interval, found by one masked max/min pass.
 * Keys are < 2^31 (no sign bit), so signed compares are exact. h: n scratch shorts. */
#define SB_SEL_CHUNK 4096 /* elements per 16-bit count chunk: no lane or total overflows int16 */

SB_CLONES static sb_u32 sb_select_kth_largest(const float *restrict v, short *restrict h, int n, int k) {
    int i, above = 0, cnt_lo = n;
    short m16 = 0;
    for (i = 0; i < n; i++) {
        short x = (short)(sb_abs_key(v[i]) >> 16);
        h[i] = x;
        m16 = x > m16 ? x : m16;
    }
    /* 16-bit phase: t >> 16 in [lo, hi) */
    int lo = 0, hi = (int)m16 + 1, pass = 0;
    while (hi - lo > 1 && k - above != 1 && k != cnt_lo) {
        int w = hi - lo, t1, t2, t3;
        if (pass++ == 0) { /* 8, 2 and 1/2 octaves below the max (128 units per octave): top-k thresholds of
                            * real gradients lie within an octave or two of the bucket max, so this brackets t
                            * far tighter than quartiles of [0, max] */
            t1 = hi - 1024 > lo ? hi - 1024 : lo;
            t2 = hi - 256 > lo ? hi - 256 : lo;
            t3 = hi - 64 > lo ? hi - 64 : lo;
        } else {
            t1 = lo + w / 4;
            t2 = lo + w / 2;
            t3 = lo + w * 3 / 4;
        }
        int c1 = 0, c2 = 0, c3 = 0;
        for (int i0 = 0; i0 < n; i0 += SB_SEL_CHUNK) {
            int i1 = i0 + SB_SEL_CHUNK < n ? i0 + SB_SEL_CHUNK : n;
            short d1 = 0, d2 = 0, d3 = 0, u1 = (short)(t1 - 1), u2 = (short)(t2 - 1), u3 = (short)(t3 - 1);
            for (i = i0; i < i1; i++) {
                d1 += h[i] > u1;
                d2 += h[i] > u2;
                d3 += h[i] > u3;
            }
            c1 += d1;
            c2 += d2;
            c3 += d3;
        }
        /* the largest threshold with >= k keys at or above it is the new lo (t1 may equal lo: c1 = cnt_lo) */
        if (c3 >= k) { lo = t3; cnt_lo = c3; }
        else if (c2 >= k) { lo = t2; cnt_lo = c2; hi = t3; above = c3; }
        else if (c1 >= k) { lo = t1; cnt_lo = c1; hi = t2; above = c2; }
        else { hi = t1; above = c1; }
    }
    /* 32-bit phase: t in [lo32, hi32]; closed upper bound so that hi32 = 2^31 - 1 stays a signed int */
    int lo32 = lo << 16, hi32 = (int)(((sb_u32)hi << 16) - 1u);
    for (;;) {
        if (k - above == 1) { /* t = the largest key <= hi32 */
            int m = -1;
            for (i = 0; i < n; i++) {
                int x = (int)sb_abs_key(v[i]);
                x = x <= hi32 ? x : -1;
                m = x > m ? x : m;
            }
            return (sb_u32)m;
        }
        if (k == cnt_lo) { /* t = the smallest key >= lo32 */
            int m = 0x7fffffff;
            for (i = 0; i < n; i++) {
                int x = (int)sb_abs_key(v[i]);
                x = x >= lo32 ? x : 0x7fffffff;
                m = x < m ? x : m;
            }
            return (sb_u32)m;
        }
        if (hi32 == lo32) return (sb_u32)lo32;
        sb_i64 w = (sb_i64)hi32 - lo32 + 1; /* >= 2 */
        int t1 = lo32 + (int)(w / 4), t2 = lo32 + (int)(w / 2), t3 = lo32 + (int)(w * 3 / 4);
        int c1 = 0, c2 = 0, c3 = 0, u1 = t1 - 1, u2 = t2 - 1, u3 = t3 - 1;
        for (i = 0; i < n; i++) {
            int x = (int)sb_abs_key(v[i]);
            c1 += x > u1;
            c2 += x > u2;
            c3 += x > u3;
        }
        if (c3 >= k) { lo32 = t3; cnt_lo = c3; }
        else if (c2 >= k) { lo32 = t2; cnt_lo = c2; hi32 = t3 - 1; above = c3; }
        else if (c1 >= k) { lo32 = t1; cnt_lo = c1; hi32 = t2 - 1; above = c2; }
        else { hi32 = t1 - 1; above = c1; }
    }
}

/* The lane-ordered float64 sum of |v| (square == 0: the SIGN scale) or of v^2 (square == 1: the LLOYD_MAX scale)
 * over one bucket: element i goes to lane i % SB_SUM_LANES in index order, then lanes 0, 1, ..., 7 are added (the
 * CUDA backend sums exactly so). */
static inline double sb_lane_sum(const float *restrict v, int len, int square) {
    double lane[SB_SUM_LANES] = {0};
    int i, l;
    for (i = 0; i + SB_SUM_LANES <= len; i += SB_SUM_LANES)
        for (l = 0; l < SB_SUM_LANES; l++) {
            double x = (double)v[i + l];
            lane[l] += square ? x * x : (x < 0.0 ? -x : x);
        }
    for (l = 0; i + l < len; l++) {
        double x = (double)v[i + l];
        lane[l] += square ? x * x : (x < 0.0 ? -x : x);
    }
    double total = lane[0];
    for (l = 1; l < SB_SUM_LANES; l++) total += lane[l];
    return total;
}

/* err[f] = the lane-ordered float32 sum of sb_lm_err2 over one bucket at scale[f], for every candidate f at once:
 * each candidate keeps its own 8 lanes and their order, so each sum is bitwise that of a pass of its own, while the
 * candidates' independent additions overlap (one pass per candidate waits on its single chain of lane additions). */
#if SB_LM_NFACTORS != 3
#error "sb_lm_candidates measures exactly three candidate scales (safebits_hvd.codec.actions.LLOYD_MAX_SCALE_FACTORS)"
#endif
static inline __attribute__((always_inline)) void sb_lm_candidates(const float *restrict v, int len,
                                                                    const float *restrict scale, int levels,
                                                                    float *restrict err) {
    float lane0[SB_SUM_LANES] = {0}, lane1[SB_SUM_LANES] = {0}, lane2[SB_SUM_LANES] = {0};
    float s0 = scale[0], s1 = scale[1], s2 = scale[2];
    int i, l;
    for (i = 0; i + SB_SUM_LANES <= len; i += SB_SUM_LANES)
        for (l = 0; l < SB_SUM_LANES; l++) {
            float x = v[i + l];
            lane0[l] += sb_lm_err2(x, s0, levels);
            lane1[l] += sb_lm_err2(x, s1, levels);
            lane2[l] += sb_lm_err2(x, s2, levels);
        }
    for (l = 0; i + l < len; l++) {
        float x = v[i + l];
        lane0[l] += sb_lm_err2(x, s0, levels);
        lane1[l] += sb_lm_err2(x, s1, levels);
        lane2[l] += sb_lm_err2(x, s2, levels);
    }
    err[0] = lane0[0];
    err[1] = lane1[0];
    err[2] = lane2[0];
    for (l = 1; l < SB_SUM_LANES; l++) {
        err[0] += lane0[l];
        err[1] += lane1[l];
        err[2] += lane2[l];
    }
}

/* LLOYD_MAX for one bucket (safebits_math.h): the scale is the candidate rms * factor whose lane-ordered float32 sum
 * of sb_lm_err2 is least, the first on a tie (a later NaN sum never wins; the CUDA backend sums the same way); then
 * q, and with word != NULL the wire words. Always inlined into sb_lm_bucket's switch, so that `levels` is a constant
 * there: the threshold and select loops unroll and the element loops vectorize. */
static inline __attribute__((always_inline)) void sb_lm_bucket_at(const float *restrict v, float *restrict q,
                                                                   sb_u32 *restrict word, int len, int levels,
                                                                   int trits, float *scale_out) {
    float rms = sb_lm_scale(sb_lane_sum(v, len, 1), len), candidate[SB_LM_NFACTORS], err[SB_LM_NFACTORS];
    int i, f;
    for (f = 0; f < SB_LM_NFACTORS; f++) candidate[f] = rms * sb_lm_factor[f];
    sb_lm_candidates(v, len, candidate, levels, err);
    float scale = candidate[0], best_err = err[0];
    for (f = 1; f < SB_LM_NFACTORS; f++)
        if (err[f] < best_err) {
            scale = candidate[f];
            best_err = err[f];
        }
    if (scale_out) *scale_out = scale;
    if (word) { /* packing pass: the same code and value functions, keeping the code */
        int cb = sb_lm_bits(levels);
        for (i = 0; i < len; i++) {
            float c = sb_lm_code(v[i], scale, levels);
            sb_u32 neg = sb_quant_sign(v[i], c, trits);
            q[i] = sb_lm_signed(sb_lm_magnitude(v[i], scale, levels), neg, scale); /* sb_lm_value(c, neg, ...) */
            word[i] = sb_quant_word(c, neg, cb, trits);
        }
    } else {
        for (i = 0; i < len; i++) q[i] = sb_lm(v[i], scale, levels, trits);
    }
}

/* The cases are the keys of safebits_hvd.codec.actions.LLOYD_MAX_LEVELS (the wire decoder refuses any other count).
 * Cloned itself: a callee is compiled for the default target even when its caller is a clone. */
SB_CLONES static void sb_lm_bucket(const float *restrict v, float *restrict q, sb_u32 *restrict word, int len,
                                int levels, float *scale_out) {
    switch (levels) {
    case 3:
        sb_lm_bucket_at(v, q, word, len, 3, 1, scale_out);
        break;
    case 4:
        sb_lm_bucket_at(v, q, word, len, 4, 0, scale_out);
        break;
    case 8:
        sb_lm_bucket_at(v, q, word, len, 8, 0, scale_out);
        break;
    case 16:
        sb_lm_bucket_at(v, q, word, len, 16, 0, scale_out);
        break;
    case 32:
        sb_lm_bucket_at(v, q, word, len, 32, 0, scale_out);
        break;
    default:
        sb_lm_bucket_at(v, q, word, len, 64, 0, scale_out);
        break;
    }
}

/* q[0..len) = Q(v[0..len)) for one bucket whose first element has global index j0. kb: len scratch words (TOPK,
 * and QUANT's packing pass).
 * With word != NULL (the packing pass) also the wire codes: QUANT: len sb_quant_word()s and *scale; SIGN: len
 * sign codes and *scale; TOPK: the kept local indices in ascending order. Returns the number of words written
 * (0 for the float kinds, whose wire values the packer takes from q). */
SB_CLONES int sb_quant_bucket(const sb_action *act, const float *restrict v, float *restrict q, int len,
                              sb_i64 j0, sb_u32 key, sb_u32 *restrict kb, sb_u32 *restrict word, float *scale_out) {
    int i;
    switch (act->kind) {
    case SB_FLOAT32:
        memcpy(q, v, (size_t)len * sizeof(float));
        return 0;
    case SB_FLOAT16:
        for (i = 0; i < len; i++) q[i] = sb_fp16_rne(v[i]);
        return 0;
    case SB_BFLOAT16:
        for (i = 0; i < len; i++) q[i] = sb_bf16_rne(v[i]);
        return 0;
    case SB_QUANT: {
        sb_u32 mk = 0;
        for (i = 0; i < len; i++) {
            sb_u32 k = sb_abs_key(v[i]);
            mk = k > mk ? k : mk;
        }
        float scale = sb_u2f(mk), s = (float)act->levels;
        int trits = act->trits, cb = sb_quant_bits(act->levels);
        if (scale_out) *scale_out = scale;
        if (mk == 0) { /* zero bucket: +0.0 everywhere, codes 0 (decodes to 0 * (0 / s) = +0.0) */
            for (i = 0; i < len; i++) q[i] = 0.0f;
            if (word) memset(word, 0, (size_t)len * sizeof(sb_u32));
            return word ? len : 0;
        }
        if (word) { /* packing pass: the same code and value functions, keeping the code */
            sb_u32 j32 = (sb_u32)j0;
            float *restrict u = (float *)kb; /* the draws first: two simple loops vectorize, one mixed does not */
            if (act->stochastic)
                for (i = 0; i < len; i++) u[i] = sb_uniform(key, (sb_i64)(j32 + (sb_u32)i));
            else
                for (i = 0; i < len; i++) u[i] = 0.5f;
            for (i = 0; i < len; i++) {
                float c = sb_quant_code(v[i], scale, s, u[i]);
                sb_u32 neg = sb_quant_sign(v[i], c, trits);
                q[i] = sb_quant_value(c, neg, scale, s);
                word[i] = sb_quant_word(c, neg, cb, trits);
            }
            return len;
        }
        if (act->stochastic) {
            sb_u32 j32 = (sb_u32)j0;
            for (i = 0; i < len; i++)
                q[i] = sb_quant(v[i], scale, s, sb_uniform(key, (sb_i64)(j32 + (sb_u32)i)), trits);
        } else {
            for (i = 0; i < len; i++) q[i] = sb_quant(v[i], scale, s, 0.5f, trits);
        }
        return 0;
    }
    case SB_SIGN: {
        float scale = (float)(sb_lane_sum(v, len, 0) / (double)len);
        if (scale_out) *scale_out = scale;
        if (word) {
            for (i = 0; i < len; i++) {
                word[i] = sb_sign_code(v[i]);
                q[i] = sb_sign_value(word[i], scale);
            }
            return len;
        }
        for (i = 0; i < len; i++) q[i] = sb_sign(v[i], scale);
        return 0;
    }
    case SB_LLOYD_MAX: /* levels is one of 3, 4, 8, 16 (checked in Python and by the wire decoder) */
        sb_lm_bucket(v, q, word, len, act->levels, scale_out);
        return word ? len : 0;
    case SB_TOPK: {
        int kk = act->topk < len ? act->topk : len;
        if (kk >= len) {
            for (i = 0; i < len; i++) q[i] = sb_bf16_rne(v[i]);
            if (word)
                for (i = 0; i < len; i++) word[i] = (sb_u32)i;
            return word ? len : 0;
        }
        sb_u32 t = sb_select_kth_largest(v, (short *)kb, len, kk);
        /* keep every key >= t (a vectorizable select): exactly kk of them unless t has more ties than the
         * places left, then the highest-index ties are dropped again (ties are kept lowest index first) */
        int ge = 0;
        for (i = 0; i < len; i++) {
            sb_u32 k = sb_abs_key(v[i]);
            ge += k >= t;
            q[i] = k >= t ? sb_bf16_rne(v[i]) : 0.0f;
        }
        int cut = len; /* ties at index >= cut are dropped */
        for (i = len - 1, ge -= kk; ge > 0; i--) {
            if (sb_abs_key(v[i]) == t) {
                q[i] = 0.0f;
                cut = i;
                ge--;
            }
        }
        if (!word) return 0;
        /* the kept indices, ascending; branch-free (a kept/dropped branch would mispredict ~kk times) */
        unsigned char *restrict kf = (unsigned char *)kb;
        for (i = 0; i < len; i++) {
            sb_u32 k = sb_abs_key(v[i]);
            kf[i] = (unsigned char)((k > t) | ((k == t) & (i < cut)));
        }
        int m = 0;
        for (i = 0; i + 8 <= len; i += 8) {
            unsigned long long f8;
            memcpy(&f8, kf + i, 8);
            if (!f8) continue;
            for (int l = 0; l < 8; l++) {
                word[m] = (sb_u32)(i + l);
                m += kf[i + l];
            }
        }
        for (; i < len; i++) {
            word[m] = (sb_u32)i;
            m += kf[i];
        }
        return m;
    }
    default:
        for (i = 0; i < len; i++) q[i] = 0.0f;
        return 0;
    }
}

/* Four float64 lanes as one GCC/Clang vector (an AVX2 register): the eight lanes of a sum (SB_SUM_LANES) are two. */
typedef double sb_d4 __attribute__((vector_size(4 * sizeof(double))));
typedef float sb_f4 __attribute__((vector_size(4 * sizeof(float))));

/* The tree that ends a sum in the shared order (SB_STAT_PARTIALS): p[c][0] = the sum of the 4 columns' first
 * `w` partials (those after them are +0.0, and adding +0.0 to a partial, never -0.0 since each starts at +0.0,
 * changes nothing: those adds are skipped). */
static void sb_stat_tree(double p[4][SB_STAT_PARTIALS], int w) {
    for (int s = SB_STAT_PARTIALS / 2; s > 0; s >>= 1) {
        int pairs = w - s < s ? w - s : s; /* t < s with t + s < w: a bound the compiler can vectorize */
        for (int c = 0; c < 4; c++)
            for (int t = 0; t < pairs; t++) p[c][t] += p[c][t + s];
    }
}

/* sb_bucket_stats of a full bucket of 2 * SB_STAT_PARTIALS elements (the default bucket): the same sums, with the
 * tree's first two levels taken in registers as the partials are made. Partial t is (+0.0 + term t) + term t + P
 * (P = SB_STAT_PARTIALS), and after the levels s = P/2 and P/4 the partial t < P/4 holds
 * (partial t + partial t + P/2) + (partial t + P/4 + partial t + 3P/4): the operations sb_bucket_stats makes, in
 * its order, without storing and reloading three quarters of the partials. */
#define SB_STAT_TERMS(i, D, QV, QQ, VV)                                                                   \
    double D, QV, QQ, VV;                                                                                  \
    do {                                                                                                   \
        double qd_ = (double)q[i], vd_ = (double)v[i], d_ = qd_ - vd_;                                     \
        D = d_ * d_;                                                                                       \
        QV = qd_ * vd_;                                                                                    \
        QQ = qd_ * qd_;                                                                                    \
        VV = vd_ * vd_;                                                                                    \
    } while (0)
SB_CLONES static void sb_full_bucket_stats(const float *restrict q, const float *restrict v, double *acc) {
    enum { P = SB_STAT_PARTIALS, Q = SB_STAT_PARTIALS / 4 };
    double p[4][SB_STAT_PARTIALS];
    for (int t = 0; t < Q; t++) {
        double r[4][4]; /* r[c][j]: column c's partial t + j * Q after both of its elements */
        for (int j = 0; j < 4; j++) {
            SB_STAT_TERMS(t + j * Q, d0, qv0, qq0, vv0);
            SB_STAT_TERMS(t + j * Q + P, d1, qv1, qq1, vv1);
            r[0][j] = (0.0 + d0) + d1;
            r[1][j] = (0.0 + qv0) + qv1;
            r[2][j] = (0.0 + qq0) + qq1;
            r[3][j] = (0.0 + vv0) + vv1;
        }
        for (int c = 0; c < 4; c++) p[c][t] = (r[c][0] + r[c][2]) + (r[c][1] + r[c][3]);
    }
    sb_stat_tree(p, Q); /* the levels from P/8 down */
    for (int k = 0; k < 4; k++) acc[k] = p[k][0];
}
#undef SB_STAT_TERMS

/* acc[0..4) = [sum (q-v)^2, sum q v, sum q^2, sum v^2] in float64 in the shared order (SB_STAT_PARTIALS): element
 * i's terms go to partial i % SB_STAT_PARTIALS, the first from +0.0, then the tree. If e != NULL also e = v - q. */
SB_CLONES void sb_bucket_stats(const float *restrict q, const float *restrict v, float *restrict e, int len,
                               double *acc) {
    double p[4][SB_STAT_PARTIALS];
    int w = len < SB_STAT_PARTIALS ? len : SB_STAT_PARTIALS;
    if (e)
        for (int i = 0; i < len; i++) e[i] = v[i] - q[i];
    if (len == 2 * SB_STAT_PARTIALS) {
        sb_full_bucket_stats(q, v, acc);
        return;
    }
    for (int t = 0; t < w; t++) {
        double qd = (double)q[t], vd = (double)v[t], d = qd - vd;
        p[0][t] = 0.0 + d * d;
        p[1][t] = 0.0 + qd * vd;
        p[2][t] = 0.0 + qd * qd;
        p[3][t] = 0.0 + vd * vd;
    }
    for (int i0 = SB_STAT_PARTIALS; i0 < len; i0 += SB_STAT_PARTIALS) {
        int n = len - i0 < SB_STAT_PARTIALS ? len - i0 : SB_STAT_PARTIALS;
        for (int t = 0; t < n; t++) {
            double qd = (double)q[i0 + t], vd = (double)v[i0 + t], d = qd - vd;
            p[0][t] += d * d;
            p[1][t] += qd * vd;
            p[2][t] += qd * qd;
            p[3][t] += vd * vd;
        }
    }
    sb_stat_tree(p, w);
    for (int k = 0; k < 4; k++) acc[k] = w ? p[k][0] : 0.0;
}

/* vb = g + e (or e when g is NULL). */
SB_CLONES void sb_load_v(const float *restrict g, const float *restrict e, float *restrict vb, int len) {
    int i;
    if (g)
        for (i = 0; i < len; i++) vb[i] = g[i] + e[i];
    else
        memcpy(vb, e, (size_t)len * sizeof(float));
}

/* res[0..4) = the sums over rows b < m of part[b * stride + 4 * col + 0..4), in the shared order
 * (SB_STAT_PARTIALS; the CUDA backend's sb_segment_sum_kernel). */
static void sb_sum_partials(const double *part, sb_i64 m, int stride, int col, double *res) {
    double p[4][SB_STAT_PARTIALS];
    int w = m < SB_STAT_PARTIALS ? (int)m : SB_STAT_PARTIALS;
    for (int t = 0; t < w; t++)
        for (int c = 0; c < 4; c++) p[c][t] = 0.0 + part[(size_t)t * stride + 4 * col + c];
    for (sb_i64 b = w; b < m; b++)
        for (int c = 0; c < 4; c++) p[c][b % SB_STAT_PARTIALS] += part[(size_t)b * stride + 4 * col + c];
    sb_stat_tree(p, w);
    for (int c = 0; c < 4; c++) res[c] = w ? p[c][0] : 0.0;
}

/* The fused sending pass. Returns 0, or -1 when out of memory. */
int sb_quantize_ef(const float *g, float *e, float *out, sb_i64 n, sb_i64 bucket, int kind, int levels,
                   int stochastic, int topk, int trits, sb_u32 key, double *stats, int nthreads) {
    sb_action act = {kind, levels, stochastic, topk, trits};
    sb_i64 nb = (n + bucket - 1) / bucket;
    int fail = 0;
    memset(stats, 0, 4 * sizeof(double));
    if (n <= 0) return 0;
    double *part = (double *)sb_scratch(SB_SCRATCH_PART, (size_t)nb * 4 * sizeof(double));
    if (!part) return -1;
    if (nthreads < 1) nthreads = 1;
    SB_LOOP_STATIC(n > SB_PAR_MIN && nthreads > 1, b, nb, {
        float *vb = (float *)sb_scratch(SB_SCRATCH_V, (size_t)bucket * sizeof(float));
        sb_u32 *kb = (sb_u32 *)sb_scratch(SB_SCRATCH_K, (size_t)bucket * sizeof(sb_u32));
        if (!vb || !kb) {
            SB_FAIL(fail);
            continue;
        }
        sb_i64 j0 = b * bucket;
        int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
        sb_load_v(g ? g + j0 : NULL, e + j0, vb, len);
        sb_quant_bucket(&act, vb, out + j0, len, j0, key, kb, NULL, NULL);
        sb_bucket_stats(out + j0, vb, e + j0, len, part + 4 * b);
    });
    if (!fail) sb_sum_partials(part, nb, 4, 0, stats);
    return fail ? -1 : 0;
}

/* Statistics of every action on the listed buckets (all when buckets is NULL). stats: nact x 4. */
int sb_screen(const float *g, const float *e, sb_i64 n, sb_i64 bucket, const sb_i64 *buckets, sb_i64 nsel,
              int nact, const int *kinds, const int *levels, const int *stochastic, const int *topks,
              const int *trits, sb_u32 key, double *stats, int nthreads) {
    sb_i64 nb = (n + bucket - 1) / bucket;
    int fail = 0, a;
    memset(stats, 0, (size_t)nact * 4 * sizeof(double));
    if (n <= 0) return 0;
    if (!buckets) nsel = nb;
    if (nsel <= 0) return 0;
    double *part = (double *)sb_scratch(SB_SCRATCH_PART, (size_t)nsel * nact * 4 * sizeof(double));
    if (!part) return -1;
    if (nthreads < 1) nthreads = 1;
    SB_LOOP_DYNAMIC(nsel * bucket * nact > SB_PAR_MIN && nthreads > 1, ib, nsel, {
        float *vb = (float *)sb_scratch(SB_SCRATCH_V, (size_t)bucket * sizeof(float));
        float *qb = (float *)sb_scratch(SB_SCRATCH_Q, (size_t)bucket * sizeof(float));
        sb_u32 *kb = (sb_u32 *)sb_scratch(SB_SCRATCH_K, (size_t)bucket * sizeof(sb_u32));
        if (!vb || !qb || !kb) {
            SB_FAIL(fail);
            continue;
        }
        sb_i64 b = buckets ? buckets[ib] : ib;
        double *p = part + (size_t)ib * nact * 4;
        if (b < 0 || b >= nb) { /* out of range: contributes nothing (the Python side validates) */
            memset(p, 0, (size_t)nact * 4 * sizeof(double));
            continue;
        }
        sb_i64 j0 = b * bucket;
        int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
        sb_load_v(g ? g + j0 : NULL, e + j0, vb, len);
        for (int ia = 0; ia < nact; ia++) {
            sb_action act = {kinds[ia], levels[ia], stochastic[ia], topks[ia], trits[ia]};
            sb_quant_bucket(&act, vb, qb, len, j0, key, kb, NULL, NULL);
            sb_bucket_stats(qb, vb, NULL, len, p + 4 * ia);
        }
    });
    if (!fail)
        for (a = 0; a < nact; a++) sb_sum_partials(part, nsel, nact * 4, a, stats + 4 * a);
    return fail ? -1 : 0;
}
