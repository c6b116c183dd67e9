/* SafeBits CUDA backend: one thread block per bucket, per-element math from safebits_math.h.
 *
 * Compiled by NVRTC (CuPy RawModule) from source.translation_unit() (constants, safebits_math.h, this file),
 * with --fmad=false
 * --ftz=false --prec-div=true, so every float result is bit-identical to the C backend. The block-wide values
 * that decide outputs are computed exactly as in cpu.c: the QUANT scale is an integer max of |v| keys, the SIGN
 * scale, the LLOYD_MAX RMS and its candidates' errors are summed by SB_SUM_LANES threads each walking its lane in
 * element order, the TOPK threshold (the kk-th
 * largest key) is found by a bitwise radix search with integer counts and ties are kept lowest index first.
 * Statistics: per-block float64 tree reductions into a per-bucket scratch array that the host sums.
 *
 * Packed wire format (safebits_hvd/wire.py): sb_quantize_pack_ef_kernel computes exactly what
 * sb_quantize_ef_kernel does and writes the codes into a payload whose body the host zeroed: bit-packed codes
 * with 32-bit atomicOr (trits with atomicAdd of digit * 3^i: a byte never exceeds 242, so no carry) on words
 * counted from the 16-byte-aligned payload start. sb_decode_kernel reads them back (one block per bucket).
 */
#define SB_THREADS 256

struct sb_block_params {
    float scale;     /* QUANT: max|v|; SIGN: mean|v|; LLOYD_MAX: the chosen multiple of the RMS */
    sb_u32 thresh;   /* TOPK: the kk-th largest key */
    long long cut;   /* TOPK: elements equal to thresh at local index <= cut are kept; -1: none */
    int all;         /* TOPK: keep every element (kk >= len) */
};

__device__ __forceinline__ float sb_load(const float *g, const float *e, int has_g, long long j) {
    return has_g ? g[j] + e[j] : e[j];
}

__device__ __forceinline__ unsigned sb_block_count(unsigned mine, unsigned *sh) {
    __syncthreads();
    if (threadIdx.x == 0) *sh = 0;
    __syncthreads();
    if (mine) atomicAdd(sh, mine);
    __syncthreads();
    return *sh;
}

/* Block-wide parameters of one bucket [j0, j0 + len) for one action. Every thread returns the same values. */
__device__ void sb_block_prepare(const float *g, const float *e, int has_g, long long j0, int len, int kind,
                                 int levels, int trits, int topk, sb_block_params *P, unsigned *sh_u,
                                 double *sh_lane) {
    int tid = threadIdx.x;
    if (kind == SB_QUANT) {
        sb_u32 mk = 0;
        for (int i = tid; i < len; i += blockDim.x) {
            sb_u32 k = sb_abs_key(sb_load(g, e, has_g, j0 + i));
            mk = k > mk ? k : mk;
        }
        __syncthreads();
        if (tid == 0) *sh_u = 0;
        __syncthreads();
        atomicMax(sh_u, mk);
        __syncthreads();
        if (tid == 0) P->scale = sb_u2f(*sh_u);
    } else if (kind == SB_SIGN || kind == SB_LLOYD_MAX) { /* the lane-ordered sums of cpu.c's sb_lane_sum */
        int square = kind == SB_LLOYD_MAX;
        if (tid < SB_SUM_LANES) {
            double acc = 0.0;
            for (int i = tid; i < len; i += SB_SUM_LANES) {
                double x = (double)sb_load(g, e, has_g, j0 + i);
                acc += square ? x * x : (x < 0.0 ? -x : x);
            }
            sh_lane[tid] = acc;
        }
        __syncthreads();
        if (tid == 0) {
            double total = sh_lane[0];
            for (int l = 1; l < SB_SUM_LANES; l++) total += sh_lane[l];
            P->scale = square ? sb_lm_scale(total, len) : (float)(total / (double)len);
        }
        if (square) { /* LLOYD_MAX: the candidate rms * factor with the least squared error, as cpu.c's
                       * sb_lm_best_scale (lane-ordered sums, the first on a tie) */
            __syncthreads();
            float rms = P->scale, best = rms * sb_lm_factor[0], best_err = 0.0f;
            for (int f = 0; f < SB_LM_NFACTORS; f++) {
                float scale = rms * sb_lm_factor[f];
                if (tid < SB_SUM_LANES) {
                    float acc = 0.0f;
                    for (int i = tid; i < len; i += SB_SUM_LANES)
                        acc += sb_lm_err2(sb_load(g, e, has_g, j0 + i), scale, levels);
                    sh_lane[tid] = (double)acc; /* exact: read back as the float32 it was */
                }
                __syncthreads();
                if (tid == 0) {
                    float err = (float)sh_lane[0];
                    for (int l = 1; l < SB_SUM_LANES; l++) err += (float)sh_lane[l];
                    if (f == 0 || err < best_err) {
                        best = scale;
                        best_err = err;
                    }
                }
                __syncthreads();
            }
            if (tid == 0) P->scale = best;
        }
    } else if (kind == SB_TOPK) {
        int kk = topk < len ? topk : len;
        if (kk >= len) {
            if (tid == 0) P->all = 1;
        } else {
            sb_u32 t = 0;
            for (int bit = 30; bit >= 0; bit--) {
                sb_u32 cand = t | (1u << bit);
                unsigned c = 0;
                for (int i = tid; i < len; i += blockDim.x) c += sb_abs_key(sb_load(g, e, has_g, j0 + i)) >= cand;
                if (sb_block_count(c, sh_u) >= (unsigned)kk) t = cand;
            }
            unsigned c = 0;
            for (int i = tid; i < len; i += blockDim.x) c += sb_abs_key(sb_load(g, e, has_g, j0 + i)) > t;
            unsigned gt = sb_block_count(c, sh_u);
            if (tid == 0) {
                int eq_left = kk - (int)gt;
                long long cut = -1;
                for (int i = 0; i < len && eq_left > 0; i++)
                    if (sb_abs_key(sb_load(g, e, has_g, j0 + i)) == t) {
                        cut = i;
                        eq_left--;
                    }
                P->all = 0;
                P->thresh = t;
                P->cut = cut;
            }
        }
    }
    __syncthreads();
}

__device__ __forceinline__ float sb_element(float v, int kind, int levels, int stochastic, int trits,
                                            const sb_block_params *P, sb_u32 key, long long j, int i) {
    switch (kind) {
    case SB_FLOAT32:
        return v;
    case SB_FLOAT16:
        return sb_fp16_rne(v);
    case SB_BFLOAT16:
        return sb_bf16_rne(v);
    case SB_QUANT: {
        if (sb_f2u(P->scale) == 0u) return 0.0f;
        float u = stochastic ? sb_uniform(key, j) : 0.5f;
        return sb_quant(v, P->scale, (float)levels, u, trits);
    }
    case SB_SIGN:
        return sb_sign(v, P->scale);
    case SB_LLOYD_MAX:
        return sb_lm(v, P->scale, levels, trits);
    case SB_TOPK: {
        if (P->all) return sb_bf16_rne(v);
        sb_u32 k = sb_abs_key(v);
        int keep = k > P->thresh || (k == P->thresh && (long long)i <= P->cut);
        return keep ? sb_bf16_rne(v) : 0.0f;
    }
    default:
        return 0.0f;
    }
}

/* Deterministic block tree reduction of 4 doubles; thread 0 writes them to dst. */
__device__ void sb_block_stats(double a0, double a1, double a2, double a3, double *sh, double *dst) {
    int tid = threadIdx.x;
    __syncthreads();
    sh[tid] = a0;
    sh[SB_THREADS + tid] = a1;
    sh[2 * SB_THREADS + tid] = a2;
    sh[3 * SB_THREADS + tid] = a3;
    __syncthreads();
    for (int s = SB_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s)
            for (int c = 0; c < 4; c++) sh[c * SB_THREADS + tid] += sh[c * SB_THREADS + tid + s];
        __syncthreads();
    }
    if (tid == 0)
        for (int c = 0; c < 4; c++) dst[c] = sh[c * SB_THREADS];
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_quantize_ef_kernel(const float *g, float *e, float *out, int has_g, long long n, int bucket, int kind,
                      int levels, int stochastic, int topk, int trits, unsigned int key, double *part) {
    __shared__ sb_block_params P;
    __shared__ unsigned sh_u;
    __shared__ double sh_lane[SB_SUM_LANES];
    __shared__ double sh[4 * SB_THREADS];
    long long b = blockIdx.x;
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_block_prepare(g, e, has_g, j0, len, kind, levels, trits, topk, &P, &sh_u, sh_lane);
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        long long j = j0 + i;
        float v = sb_load(g, e, has_g, j);
        float q = sb_element(v, kind, levels, stochastic, trits, &P, (sb_u32)key, j, i);
        out[j] = q;
        e[j] = v - q;
        double qd = (double)q, vd = (double)v, d = qd - vd;
        a0 += d * d;
        a1 += qd * vd;
        a2 += qd * qd;
        a3 += vd * vd;
    }
    sb_block_stats(a0, a1, a2, a3, sh, part + 4 * b);
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_screen_kernel(const float *g, const float *e, int has_g, long long n, int bucket, const long long *buckets,
                 int nact, const int *kinds, const int *levels, const int *stochastic, const int *topks,
                 const int *trits, unsigned int key, double *part) {
    __shared__ sb_block_params P;
    __shared__ unsigned sh_u;
    __shared__ double sh_lane[SB_SUM_LANES];
    __shared__ double sh[4 * SB_THREADS];
    long long b = buckets[blockIdx.x];
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    for (int a = 0; a < nact; a++) {
        int kind = kinds[a];
        sb_block_prepare(g, e, has_g, j0, len, kind, levels[a], trits[a], topks[a], &P, &sh_u, sh_lane);
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
        for (int i = threadIdx.x; i < len; i += blockDim.x) {
            long long j = j0 + i;
            float v = sb_load(g, e, has_g, j);
            float q = sb_element(v, kind, levels[a], stochastic[a], trits[a], &P, (sb_u32)key, j, i);
            double qd = (double)q, vd = (double)v, d = qd - vd;
            a0 += d * d;
            a1 += qd * vd;
            a2 += qd * qd;
            a3 += vd * vd;
        }
        sb_block_stats(a0, a1, a2, a3, sh, part + ((long long)blockIdx.x * nact + a) * 4);
    }
}

/* Where the sections of a payload body start (bytes from the payload start, header included). */
struct sb_layout {
    long long nb, kept_full, scales_off, codes_off;
    int code_bits; /* per code (QUANT bitstream, LLOYD_MAX, SIGN = 1) or per index (TOPK); 0 for trits */
};

__device__ sb_layout sb_body_layout(long long n, int bucket, int kind, int levels, int topk, int trits) {
    sb_layout L;
    L.nb = (n + bucket - 1) / bucket;
    L.kept_full = topk < bucket ? topk : bucket;
    L.scales_off = 16;
    L.codes_off = 16;
    L.code_bits = 0;
    if (sb_has_scales(kind)) {
        L.codes_off = 16 + 4 * L.nb;
        L.code_bits = sb_code_bits(kind, levels, trits);
    } else if (kind == SB_TOPK) {
        long long full = n / bucket, rest = n % bucket;
        L.codes_off = 16 + 2 * (full * L.kept_full + (rest < L.kept_full ? rest : L.kept_full));
        L.code_bits = sb_index_bits(bucket);
    }
    return L;
}

/* OR an nbits word into the bitstream at absolute bit position `bit` of a 4-byte-aligned, zeroed buffer. */
__device__ __forceinline__ void sb_put_bits_atomic(unsigned char *base, long long bit, sb_u32 word, int nbits) {
    if (!word) return;
    unsigned int *w = (unsigned int *)base;
    long long wi = bit >> 5;
    int sh = (int)(bit & 31);
    unsigned long long x = (unsigned long long)word << sh;
    atomicOr(w + wi, (unsigned int)x);
    if (sh + nbits > 32) atomicOr(w + wi + 1, (unsigned int)(x >> 32));
}

/* Add trit digit d of element j to a 5-trits-per-byte stream starting at byte `off` of `base`. */
__device__ __forceinline__ void sb_put_trit_atomic(unsigned char *base, long long off, long long j, sb_u32 d) {
    if (!d) return;
    long long byte = off + j / 5;
    atomicAdd((unsigned int *)base + (byte >> 2), (d * sb_pow3((int)(j % 5))) << (8 * (int)(byte & 3)));
}

/* Element j's code word w in the codes section at byte `off`: 5 trits per byte, or cb bits. */
__device__ __forceinline__ void sb_put_code_atomic(unsigned char *base, long long off, long long j, sb_u32 w,
                                                   int cb, int trits) {
    if (trits) sb_put_trit_atomic(base, off, j, w);
    else sb_put_bits_atomic(base, off * 8 + j * cb, w, cb);
}

/* Exclusive block-wide prefix sum of one flag per thread; *total gets the sum. sh: SB_THREADS ints. */
__device__ int sb_block_exclusive_scan(int flag, int *sh, int *total) {
    int tid = threadIdx.x;
    __syncthreads();
    sh[tid] = flag;
    __syncthreads();
    for (int off = 1; off < SB_THREADS; off <<= 1) {
        int add = tid >= off ? sh[tid - off] : 0;
        __syncthreads();
        sh[tid] += add;
        __syncthreads();
    }
    *total = sh[SB_THREADS - 1];
    return sh[tid] - flag;
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_quantize_pack_ef_kernel(const float *g, float *e, unsigned char *payload, float *sent, int has_g,
                           int has_sent, long long n, int bucket, int kind, int levels, int stochastic, int topk,
                           int trits, unsigned int key, double *part) {
    __shared__ sb_block_params P;
    __shared__ unsigned sh_u;
    __shared__ double sh_lane[SB_SUM_LANES];
    __shared__ double sh[4 * SB_THREADS];
    __shared__ int sh_scan[SB_THREADS];
    long long b = blockIdx.x;
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_layout L = sb_body_layout(n, bucket, kind, levels, topk, trits);
    sb_block_prepare(g, e, has_g, j0, len, kind, levels, trits, topk, &P, &sh_u, sh_lane);
    if (threadIdx.x == 0 && sb_has_scales(kind))
        ((float *)(payload + L.scales_off))[b] = P.scale; /* 0 for a zero QUANT bucket */
    float s = (float)levels;
    int cb = L.code_bits;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    long long kept_before = 0; /* TOPK: kept entries of this bucket at lower local indices (uniform) */
    /* every thread runs the same number of iterations: the TOPK scan is a block-wide operation */
    for (int c0 = 0; c0 < len; c0 += blockDim.x) {
        int i = c0 + threadIdx.x;
        int live = i < len;
        long long j = j0 + i;
        float v = live ? sb_load(g, e, has_g, j) : 0.0f;
        float q = 0.0f;
        int kept = 0;
        if (live) {
            switch (kind) {
            case SB_FLOAT32:
                q = v;
                ((float *)(payload + 16))[j] = q;
                break;
            case SB_FLOAT16: {
                sb_u32 h = sb_fp16_code(v);
                q = sb_fp16_value(h);
                ((unsigned short *)(payload + 16))[j] = (unsigned short)h;
                break;
            }
            case SB_BFLOAT16:
                q = sb_bf16_rne(v);
                ((unsigned short *)(payload + 16))[j] = (unsigned short)sb_bf16_code(q);
                break;
            case SB_QUANT:
                if (sb_f2u(P.scale) != 0u) { /* a zero bucket: q = +0.0, codes 0 (already zero) */
                    float u = stochastic ? sb_uniform((sb_u32)key, j) : 0.5f;
                    float c = sb_quant_code(v, P.scale, s, u);
                    sb_u32 neg = sb_quant_sign(v, c, trits);
                    q = sb_quant_value(c, neg, P.scale, s);
                    sb_u32 w = sb_quant_word(c, neg, cb, trits);
                    sb_put_code_atomic(payload, L.codes_off, j, w, cb, trits);
                }
                break;
            case SB_LLOYD_MAX: {
                float c = sb_lm_code(v, P.scale, levels);
                sb_u32 neg = sb_quant_sign(v, c, trits);
                q = sb_lm_value(c, neg, P.scale, levels);
                sb_u32 w = sb_quant_word(c, neg, cb, trits);
                sb_put_code_atomic(payload, L.codes_off, j, w, cb, trits);
                break;
            }
            case SB_SIGN: {
                sb_u32 code = sb_sign_code(v);
                q = sb_sign_value(code, P.scale);
                sb_put_bits_atomic(payload, L.codes_off * 8 + j, code, 1);
                break;
            }
            case SB_TOPK:
                q = sb_element(v, kind, levels, stochastic, trits, &P, (sb_u32)key, j, i);
                if (P.all) {
                    kept = 1;
                } else {
                    sb_u32 k = sb_abs_key(v);
                    kept = k > P.thresh || (k == P.thresh && (long long)i <= P.cut);
                }
                break;
            default:
                break;
            }
        }
        if (kind == SB_TOPK) {
            int total;
            int r = sb_block_exclusive_scan(kept, sh_scan, &total);
            if (kept) {
                long long entry = b * L.kept_full + kept_before + r;
                ((unsigned short *)(payload + 16))[entry] = (unsigned short)sb_bf16_code(q);
                sb_put_bits_atomic(payload, L.codes_off * 8 + entry * cb, (sb_u32)i, cb);
            }
            kept_before += total;
        }
        if (live) {
            e[j] = v - q;
            if (has_sent) sent[j] = q; /* may be g: this thread read g[j] above */
            double qd = (double)q, vd = (double)v, d = qd - vd;
            a0 += d * d;
            a1 += qd * vd;
            a2 += qd * qd;
            a3 += vd * vd;
        }
    }
    sb_block_stats(a0, a1, a2, a3, sh, part + 4 * b);
}

/* TOPK payloads: *bad = the lowest bucket whose local indices are out of range or not ascending (one thread
 * per bucket; *bad starts at INT_MAX). Run before decoding so a corrupt payload writes nothing. */
extern "C" __global__ void sb_check_topk_kernel(const unsigned char *payload, long long n, int bucket, int topk,
                                                int *bad) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    sb_layout L = sb_body_layout(n, bucket, SB_TOPK, 0, topk, 0);
    if (b >= L.nb) return;
    long long j0 = b * bucket;
    long long len = (n - j0) < bucket ? (n - j0) : bucket;
    long long kk = L.kept_full < len ? L.kept_full : len;
    long long prev = -1;
    for (long long r = 0; r < kk; r++) {
        long long idx = sb_get_bits(payload + L.codes_off, (b * L.kept_full + r) * L.code_bits, L.code_bits);
        if (idx <= prev || idx >= len) {
            atomicMin(bad, (int)(b < 0x7ffffffe ? b : 0x7ffffffe));
            return;
        }
        prev = idx;
    }
}

/* out = decode(payload) (accumulate == 0) or out = (out + decode(payload)) / divisor, one block per bucket. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_decode_kernel(const unsigned char *payload, float *out, long long n, int bucket, int kind, int levels, int topk,
                 int trits, int accumulate, float divisor) {
    long long b = blockIdx.x;
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_layout L = sb_body_layout(n, bucket, kind, levels, topk, trits);
    const unsigned char *codes = payload + L.codes_off;
    const unsigned short *half = (const unsigned short *)(payload + 16);
    float scale = sb_has_scales(kind) ? ((const float *)(payload + L.scales_off))[b] : 0.0f;
    float s = (float)levels;
    int cb = L.code_bits;
    long long first = b * L.kept_full;
    int kk = (int)(L.kept_full < len ? L.kept_full : len);
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        long long j = j0 + i;
        float x = 0.0f;
        switch (kind) {
        case SB_FLOAT32:
            x = ((const float *)(payload + 16))[j];
            break;
        case SB_FLOAT16:
            x = sb_fp16_value(half[j]);
            break;
        case SB_BFLOAT16:
            x = sb_bf16_value(half[j]);
            break;
        case SB_QUANT: {
            sb_u32 w = trits ? sb_get_trit(codes, j) : sb_get_bits(codes, j * cb, cb);
            x = sb_quant_value(sb_quant_word_code(w, cb, trits), sb_quant_word_sign(w, cb, trits), scale, s);
            break;
        }
        case SB_LLOYD_MAX: {
            sb_u32 w = trits ? sb_get_trit(codes, j) : sb_get_bits(codes, j * cb, cb);
            x = sb_lm_value(sb_quant_word_code(w, cb, trits), sb_quant_word_sign(w, cb, trits), scale, levels);
            break;
        }
        case SB_SIGN:
            x = sb_sign_value(sb_get_bits(codes, j, 1), scale);
            break;
        case SB_TOPK: { /* binary search of i among the bucket's ascending kept indices */
            int lo = 0, hi = kk - 1;
            while (lo <= hi) {
                int mid = (lo + hi) >> 1;
                int idx = (int)sb_get_bits(codes, (first + mid) * cb, cb);
                if (idx == i) {
                    x = sb_bf16_value(half[first + mid]);
                    break;
                }
                if (idx < i) lo = mid + 1;
                else hi = mid - 1;
            }
            break;
        }
        default:
            break;
        }
        out[j] = !accumulate ? x : divisor != 1.0f ? __fdiv_rn(out[j] + x, divisor) : out[j] + x;
    }
}
