/* SafeBits CUDA backend: one thread block per bucket, per-element math from safebits_math.h.
 *
 * Compiled by NVRTC (CuPy's bindings, cuda.py) from source.translation_unit() (constants, safebits_math.h, this file),
 * with --fmad=false
 * --ftz=false --prec-div=true, so every float result is bit-identical to the C backend. The block-wide values
 * that decide outputs are computed exactly as in cpu.c: the QUANT scale is an integer max of |v| keys, the SIGN
 * scale, the LLOYD_MAX RMS and its candidates' errors are summed by SB_SUM_LANES threads each walking its lane in
 * element order, the TOPK threshold (the kk-th
 * largest key) is found by radix selection a byte at a time with integer counts, and ties are kept lowest index
 * first.
 * Statistics: per-block float64 tree reductions into a per-bucket scratch array that the host sums.
 *
 * Packed wire format (safebits_hvd/codec/wire.py): sb_quantize_pack_ef_kernel computes exactly what
 * sb_quantize_ef_kernel does and writes the codes into a payload whose body the host zeroed: a bucket's bit-packed
 * codes (trits: digit * 3^i added, a byte never exceeds 242, so no carry) staged in shared memory, then assembled
 * and stored as whole 32-bit words counted from the 16-byte-aligned payload start (sb_codes_begin). sb_decode_kernel
 * reads them back (one block per bucket).
 */
#define SB_THREADS SB_STAT_PARTIALS /* a block sums the statistics in the shared order */

struct sb_block_params {
    float scale;     /* QUANT: max|v|; SIGN: mean|v|; LLOYD_MAX: the chosen multiple of the RMS */
    sb_u32 thresh;   /* TOPK: the kk-th largest key */
    long long cut;   /* TOPK: elements equal to thresh at local index <= cut are kept; -1: none */
    int all;         /* TOPK: keep every element (kk >= len) */
};

/* The shared memory of one block of the screen and packing passes: one struct, so that the per-bucket device
 * functions below serve the per-tensor kernels and the group kernels alike. */
struct sb_shared {
    sb_block_params P;
    unsigned u;
    double lane[SB_SUM_LANES];
    double sh[4 * SB_THREADS];
    int scan[SB_THREADS];
    long long code_word;  /* sb_codes_begin: the first 32-bit payload word of the bucket's codes */
    int code_words;       /* and how many there are (0: written with global atomics) */
    int code_shared;      /* bit 0: the first word is shared with the previous bucket; bit 1: the last, the next */
    long long code_off;   /* the codes section's first byte */
    long long code_first; /* the global index of the bucket's first item */
    int code_count, code_cb, code_trits; /* its items, bits per item (0 for trits), trits */
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

/* Block-wide parameters of one bucket [j0, j0 + len) for one action, into S->P. Every thread returns the same
 * values. The sums that cpu.c takes in SB_SUM_LANES lanes (element i into lane i % SB_SUM_LANES, in index order)
 * are taken here in the same order by SB_SUM_LANES threads; a Lloyd-Max candidate's error terms (a compare per
 * threshold each) are computed by the whole block into shared memory first (S->sh, free until sb_block_stats), so
 * only the additions stay sequential. The top-k ties' cut is found by a scan of per-thread counts instead of one
 * thread walking the bucket. */
#define SB_SCRATCH_DOUBLES (4 * SB_THREADS)
__device__ __forceinline__ void sb_block_prepare(const float *g, const float *e, int has_g, long long j0, int len, int kind,
                                 int levels, int trits, int topk, sb_shared *S) {
    sb_block_params *P = &S->P;
    int tid = threadIdx.x;
    if (kind == SB_QUANT) {
        sb_u32 mk = 0;
        for (int i = tid; i < len; i += blockDim.x) {
            sb_u32 k = sb_abs_key(sb_load(g, e, has_g, j0 + i));
            mk = k > mk ? k : mk;
        }
        __syncthreads();
        if (tid == 0) S->u = 0;
        __syncthreads();
        atomicMax(&S->u, mk);
        __syncthreads();
        if (tid == 0) P->scale = sb_u2f(S->u);
    } else if (kind == SB_SIGN || kind == SB_LLOYD_MAX) { /* the lane-ordered sums of cpu.c's sb_lane_sum */
        int square = kind == SB_LLOYD_MAX;
        if (tid < SB_SUM_LANES) {
            double acc = 0.0;
            for (int i = tid; i < len; i += SB_SUM_LANES) {
                double x = (double)sb_load(g, e, has_g, j0 + i);
                acc += square ? x * x : (x < 0.0 ? -x : x);
            }
            S->lane[tid] = acc;
        }
        __syncthreads();
        if (tid == 0) {
            double total = S->lane[0];
            for (int l = 1; l < SB_SUM_LANES; l++) total += S->lane[l];
            P->scale = square ? sb_lm_scale(total, len) : (float)(total / (double)len);
        }
        if (square) { /* LLOYD_MAX: the candidate rms * factor with the least squared error, as cpu.c's
                       * sb_lm_best_scale (lane-ordered float32 sums, the first on a tie) */
            __syncthreads();
            float rms = P->scale, best = rms * sb_lm_factor[0], best_err = 0.0f, *errs = (float *)S->sh;
            for (int f = 0; f < SB_LM_NFACTORS; f++) {
                float scale = rms * sb_lm_factor[f], lane_err = 0.0f;
                for (int c0 = 0; c0 < len; c0 += 2 * SB_SCRATCH_DOUBLES) {
                    int clen = len - c0 < 2 * SB_SCRATCH_DOUBLES ? len - c0 : 2 * SB_SCRATCH_DOUBLES;
                    __syncthreads();
                    for (int i = tid; i < clen; i += blockDim.x)
                        errs[i] = sb_lm_err2(sb_load(g, e, has_g, j0 + c0 + i), scale, levels);
                    __syncthreads();
                    if (tid < SB_SUM_LANES)
                        for (int i = tid; i < clen; i += SB_SUM_LANES) lane_err += errs[i];
                }
                if (tid < SB_SUM_LANES) S->lane[tid] = (double)lane_err; /* exact: read back as the float32 */
                __syncthreads();
                if (tid == 0) {
                    float err = (float)S->lane[0];
                    for (int l = 1; l < SB_SUM_LANES; l++) err += (float)S->lane[l];
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
            /* t = the kk-th largest key (cpu.c: a bitwise search of the greatest t with kk keys >= t, the same
             * integer), by radix selection a byte at a time: a histogram of the next byte among the keys that share
             * the bytes chosen so far, then the bin that holds the kk-th largest. Four passes, not 31. */
            sb_u32 t = 0, mask = 0;
            int need = kk;
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int d = tid; d < 256; d += blockDim.x) S->scan[d] = 0;
                __syncthreads();
                for (int i = tid; i < len; i += blockDim.x) {
                    sb_u32 k = sb_abs_key(sb_load(g, e, has_g, j0 + i));
                    if ((k & mask) == t) atomicAdd(&S->scan[(k >> shift) & 255u], 1);
                }
                __syncthreads();
                if (tid == 0) {
                    int d = 255, above = 0;
                    while (d > 0 && above + S->scan[d] < need) above += S->scan[d--];
                    S->u = (unsigned)d;
                    S->scan[0] = need - above; /* read below, after the barrier, before the next clearing */
                }
                __syncthreads();
                t |= S->u << shift;
                mask |= 255u << shift;
                need = S->scan[0];
                __syncthreads();
            }
            unsigned c = 0;
            for (int i = tid; i < len; i += blockDim.x) c += sb_abs_key(sb_load(g, e, has_g, j0 + i)) > t;
            int eq_left = kk - (int)sb_block_count(c, &S->u); /* >= 1 when kk >= 1: t is the kk-th largest key */
            /* The cut: the eq_left-th element equal to t in index order. Each thread counts them in its own
             * contiguous range; an exclusive scan of the counts tells the one thread whose range holds it. */
            int per = (len + (int)blockDim.x - 1) / (int)blockDim.x, lo = tid * per;
            int hi = lo + per < len ? lo + per : len, mine = 0;
            for (int i = lo; i < hi; i++) mine += sb_abs_key(sb_load(g, e, has_g, j0 + i)) == t;
            S->scan[tid] = mine;
            __syncthreads();
            if (tid == 0) {
                int before = 0;
                for (int k = 0; k < (int)blockDim.x; k++) {
                    int count = S->scan[k];
                    S->scan[k] = before;
                    before += count;
                }
                P->all = 0;
                P->thresh = t;
                P->cut = -1;
            }
            __syncthreads();
            int before = S->scan[tid];
            if (before < eq_left && eq_left <= before + mine)
                for (int i = lo, seen = before; i < hi; i++)
                    if (sb_abs_key(sb_load(g, e, has_g, j0 + i)) == t && ++seen == eq_left) {
                        P->cut = i;
                        break;
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

/* One element's four statistics (STAT_COLUMNS: (q - v)^2, q v, q^2, v^2) added to a thread's sums, in float64. */
__device__ __forceinline__ void sb_accumulate(float q, float v, double *a) {
    double qd = (double)q, vd = (double)v, d = qd - vd;
    a[0] += d * d;
    a[1] += qd * vd;
    a[2] += qd * qd;
    a[3] += vd * vd;
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

/* Bucket b quantized by one action: its four sums into dst[0 .. 3] and, with out, q into out and the residual
 * v - q into e (the screen passes no out and writes nothing: e is read only then). */
__device__ __forceinline__ void sb_quantize_bucket(const float *g, float *e, float *out, int has_g, long long n, int bucket,
                                   long long b, int kind, int levels, int stochastic, int topk, int trits,
                                   unsigned int key, double *dst, sb_shared *S) {
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_block_prepare(g, e, has_g, j0, len, kind, levels, trits, topk, S);
    double a[4] = {0.0, 0.0, 0.0, 0.0};
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        long long j = j0 + i;
        float v = sb_load(g, e, has_g, j);
        float q = sb_element(v, kind, levels, stochastic, trits, &S->P, (sb_u32)key, j, i);
        if (out) {
            out[j] = q;
            e[j] = v - q;
        }
        sb_accumulate(q, v, a);
    }
    sb_block_stats(a[0], a[1], a[2], a[3], S->sh, dst);
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_quantize_ef_kernel(const float *g, float *e, float *out, int has_g, long long n, int bucket, int kind,
                      int levels, int stochastic, int topk, int trits, unsigned int key, double *part) {
    __shared__ sb_shared S;
    sb_quantize_bucket(g, e, out, has_g, n, bucket, blockIdx.x, kind, levels, stochastic, topk, trits, key,
                       part + 4 * (long long)blockIdx.x, &S);
}

/* The screen of bucket b for one action: its four sums into dst[0 .. 3], nothing written. */
__device__ __forceinline__ void sb_screen_bucket(const float *g, const float *e, int has_g, long long n, int bucket, long long b,
                                 int kind, int levels, int stochastic, int topk, int trits, unsigned int key,
                                 double *dst, sb_shared *S) {
    sb_quantize_bucket(g, (float *)e, nullptr, has_g, n, bucket, b, kind, levels, stochastic, topk, trits, key, dst,
                       S);
}

/* One block per (screened bucket, action) pair, blockIdx.x = pair * nact + action: the actions of a bucket run in
 * parallel blocks (one block looping over them left most of the GPU idle on a sampled screen). */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_screen_kernel(const float *g, const float *e, int has_g, long long n, int bucket, const long long *buckets,
                 int nact, const int *kinds, const int *levels, const int *stochastic, const int *topks,
                 const int *trits, unsigned int key, double *part) {
    __shared__ sb_shared S;
    long long p = blockIdx.x / nact;
    int a = (int)(blockIdx.x % nact);
    sb_screen_bucket(g, e, has_g, n, bucket, buckets[p], kinds[a], levels[a], stochastic[a], topks[a], trits[a], key,
                     part + (long long)blockIdx.x * 4, &S);
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

/* A bucket's codes (QUANT, LLOYD_MAX and SIGN words, or TOPK local indices): item t (global index first + t: the
 * element, or the top-k entry) is staged in shared memory as one 16-bit value (S->sh, free between
 * sb_block_prepare and sb_block_stats), then each thread assembles whole 32-bit payload words in registers from the
 * staged items and stores them plainly; no atomics. Only a word the bucket shares with a neighbour's bytes takes a
 * global atomic into the zeroed body: a first word that does not start at the bucket's first code, a last word its
 * codes do not fill. With the default geometry (codes of whole 32-bit words per bucket) only a tensor's last,
 * partial word is one. Items that do not fit the scratch (or wider than 16 bits) are written one by one with global
 * atomics (S->code_words = 0). The section's geometry lives in shared memory, not in registers. Every thread of the
 * block calls begin and end. */
#define SB_CODE_ITEMS (4 * SB_SCRATCH_DOUBLES) /* 16-bit items in S->sh */
__device__ __forceinline__ void sb_codes_begin(long long off, long long first, int count, int cb, int trits,
                                               sb_shared *S) {
    if (threadIdx.x == 0) {
        long long lo_bit, hi_bit;
        int lo_shared, hi_shared;
        if (trits) { /* 5 per byte: a byte is shared when the bucket does not start (end) on a multiple of 5 */
            lo_bit = (off + first / 5) * 8;
            hi_bit = (off + (first + count - 1) / 5 + 1) * 8;
            lo_shared = (lo_bit & 31) != 0 || first % 5 != 0;
            hi_shared = (hi_bit & 31) != 0 || (first + count) % 5 != 0;
        } else {
            lo_bit = off * 8 + first * cb;
            hi_bit = lo_bit + (long long)count * cb;
            lo_shared = (lo_bit & 31) != 0;
            hi_shared = (hi_bit & 31) != 0;
        }
        S->code_word = lo_bit >> 5;
        S->code_words = count > 0 && count <= SB_CODE_ITEMS && cb <= 16 ? (int)(((hi_bit + 31) >> 5) - (lo_bit >> 5))
                                                                         : 0;
        /* A last word that is not whole is shared even in the tensor's last bucket: past the payload's end may lie
         * another tensor's bytes (a caller's buffer), which a plain store would overwrite. */
        S->code_shared = lo_shared | hi_shared << 1;
        S->code_off = off;
        S->code_first = first;
        S->code_cb = cb;
        S->code_trits = trits;
        S->code_count = count;
    }
    __syncthreads();
}

/* Item g (global index: the element, or the top-k entry) of the section that sb_codes_begin described: its cb-bit
 * word, or its trit digit. Every item of the bucket is put, zeros included. */
__device__ __forceinline__ void sb_put_code(sb_shared *S, unsigned char *base, long long g, sb_u32 w) {
    if (S->code_words) ((unsigned short *)S->sh)[g - S->code_first] = (unsigned short)w;
    else if (w) sb_put_code_atomic(base, S->code_off, g, w, S->code_cb, S->code_trits);
}

/* Payload word W (absolute, from the 4-byte-aligned payload start) assembled from the staged items that touch it. */
__device__ __forceinline__ sb_u32 sb_code_word(const sb_shared *S, long long W) {
    const unsigned short *items = (const unsigned short *)S->sh;
    long long first = S->code_first, last = first + S->code_count - 1, off = S->code_off;
    unsigned long long x = 0;
    if (S->code_trits) {
        for (int byte_in_word = 0; byte_in_word < 4; byte_in_word++) {
            long long g0 = (4 * W + byte_in_word - off) * 5;
            sb_u32 byte = 0;
            for (long long g = g0 > first ? g0 : first; g < g0 + 5 && g <= last; g++)
                byte += (sb_u32)items[g - first] * sb_pow3((int)(g - g0));
            x |= (unsigned long long)byte << (8 * byte_in_word);
        }
        return (sb_u32)x;
    }
    int cb = S->code_cb;
    long long rel = 32 * W - off * 8; /* the word's first bit, from the section start */
    long long g = rel <= 0 ? 0 : rel / cb, hi = (rel + 31) / cb;
    for (g = g > first ? g : first; g <= hi && g <= last; g++) {
        long long pos = g * cb - rel;
        unsigned long long v = items[g - first];
        x |= pos >= 0 ? v << pos : v >> -pos;
    }
    return (sb_u32)x;
}

__device__ __forceinline__ void sb_codes_end(sb_shared *S, unsigned char *base) {
    __syncthreads();
    int n = S->code_words, shared = S->code_shared;
    unsigned *out = (unsigned *)base + S->code_word;
    for (int w = threadIdx.x; w < n; w += blockDim.x) {
        sb_u32 x = sb_code_word(S, S->code_word + w);
        if (!(w == 0 && (shared & 1)) && !(w == n - 1 && (shared & 2))) out[w] = x; /* wholly this bucket's */
        else if (x) {
            if (S->code_trits) atomicAdd(out + w, x); /* a byte's trits never carry: at most 242 */
            else atomicOr(out + w, x);
        }
    }
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

/* The packing pass of bucket b of a payload whose body is zeroed (16-byte aligned): scale and codes into
 * `payload`, e <- v - q, q into sent (has_sent), the bucket's four sums into dst. */
__device__ void sb_pack_bucket(const float *g, float *e, unsigned char *payload, float *sent, int has_g, int has_sent,
                               long long n, int bucket, int kind, int levels, int stochastic, int topk, int trits,
                               unsigned int key, long long b, double *dst, sb_shared *S) {
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_layout L = sb_body_layout(n, bucket, kind, levels, topk, trits);
    sb_block_prepare(g, e, has_g, j0, len, kind, levels, trits, topk, S);
    if (threadIdx.x == 0 && sb_has_scales(kind))
        ((float *)(payload + L.scales_off))[b] = S->P.scale; /* 0 for a zero QUANT bucket */
    float s = (float)levels;
    int cb = L.code_bits;
    int coded = kind == SB_QUANT || kind == SB_LLOYD_MAX || kind == SB_SIGN, indexed = kind == SB_TOPK;
    if (coded) sb_codes_begin(L.codes_off, j0, len, kind == SB_SIGN ? 1 : cb, kind == SB_SIGN ? 0 : trits, S);
    if (indexed) sb_codes_begin(L.codes_off, b * L.kept_full, topk < len ? topk : len, cb, 0, S);
    double a[4] = {0.0, 0.0, 0.0, 0.0};
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
            case SB_QUANT: {
                sb_u32 w = 0; /* a zero bucket: q = +0.0, codes 0 */
                if (sb_f2u(S->P.scale) != 0u) {
                    float u = stochastic ? sb_uniform((sb_u32)key, j) : 0.5f;
                    float c = sb_quant_code(v, S->P.scale, s, u);
                    sb_u32 neg = sb_quant_sign(v, c, trits);
                    q = sb_quant_value(c, neg, S->P.scale, s);
                    w = sb_quant_word(c, neg, cb, trits);
                }
                sb_put_code(S, payload, j, w);
                break;
            }
            case SB_LLOYD_MAX: {
                float c = sb_lm_code(v, S->P.scale, levels);
                sb_u32 neg = sb_quant_sign(v, c, trits);
                q = sb_lm_value(c, neg, S->P.scale, levels);
                sb_put_code(S, payload, j, sb_quant_word(c, neg, cb, trits));
                break;
            }
            case SB_SIGN: {
                sb_u32 code = sb_sign_code(v);
                q = sb_sign_value(code, S->P.scale);
                sb_put_code(S, payload, j, code);
                break;
            }
            case SB_TOPK:
                q = sb_element(v, kind, levels, stochastic, trits, &S->P, (sb_u32)key, j, i);
                if (S->P.all) {
                    kept = 1;
                } else {
                    sb_u32 k = sb_abs_key(v);
                    kept = k > S->P.thresh || (k == S->P.thresh && (long long)i <= S->P.cut);
                }
                break;
            default:
                break;
            }
        }
        if (kind == SB_TOPK) {
            int total;
            int r = sb_block_exclusive_scan(kept, S->scan, &total);
            if (kept) {
                long long entry = b * L.kept_full + kept_before + r;
                ((unsigned short *)(payload + 16))[entry] = (unsigned short)sb_bf16_code(q);
                sb_put_code(S, payload, entry, (sb_u32)i);
            }
            kept_before += total;
        }
        if (live) {
            e[j] = v - q;
            if (has_sent) sent[j] = q; /* may be g: this thread read g[j] above */
            sb_accumulate(q, v, a);
        }
    }
    if (coded || indexed) sb_codes_end(S, payload);
    sb_block_stats(a[0], a[1], a[2], a[3], S->sh, dst);
}

extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_quantize_pack_ef_kernel(const float *g, float *e, unsigned char *payload, float *sent, int has_g,
                           int has_sent, long long n, int bucket, int kind, int levels, int stochastic, int topk,
                           int trits, unsigned int key, double *part) {
    __shared__ sb_shared S;
    long long b = blockIdx.x;
    sb_pack_bucket(g, e, payload, sent, has_g, has_sent, n, bucket, kind, levels, stochastic, topk, trits, key, b,
                   part + 4 * b, &S);
}

/* 1 when the local indices of top-k bucket b of a payload are ascending and in range. */
__device__ int sb_topk_bucket_valid(const unsigned char *payload, long long n, int bucket, int topk, long long b) {
    sb_layout L = sb_body_layout(n, bucket, SB_TOPK, 0, topk, 0);
    long long j0 = b * bucket;
    long long len = (n - j0) < bucket ? (n - j0) : bucket;
    long long kk = L.kept_full < len ? L.kept_full : len;
    long long prev = -1;
    for (long long r = 0; r < kk; r++) {
        long long idx = sb_get_bits(payload + L.codes_off, (b * L.kept_full + r) * L.code_bits, L.code_bits);
        if (idx <= prev || idx >= len) return 0;
        prev = idx;
    }
    return 1;
}

/* TOPK payloads: *bad = the lowest bucket whose local indices are out of range or not ascending (one thread
 * per bucket; *bad starts at INT_MAX). Run before decoding so a corrupt payload writes nothing. */
extern "C" __global__ void sb_check_topk_kernel(const unsigned char *payload, long long n, int bucket, int topk,
                                                int *bad) {
    long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= (n + bucket - 1) / bucket) return;
    if (!sb_topk_bucket_valid(payload, n, bucket, topk, b)) atomicMin(bad, (int)(b < 0x7ffffffe ? b : 0x7ffffffe));
}

/* A 32-bit or 16-bit little-endian value at p, which a payload need not align (a gathered group's payloads follow
 * one another at any byte): one load where it is aligned, else its bytes. */
__device__ __forceinline__ sb_u32 sb_load_u32(const unsigned char *p) {
    if (((unsigned long long)p & 3ull) == 0) return *(const sb_u32 *)p;
    return (sb_u32)p[0] | (sb_u32)p[1] << 8 | (sb_u32)p[2] << 16 | (sb_u32)p[3] << 24;
}
__device__ __forceinline__ sb_u32 sb_load_u16(const unsigned char *p) {
    if (((unsigned long long)p & 1ull) == 0) return *(const unsigned short *)p;
    return (sb_u32)p[0] | (sb_u32)p[1] << 8;
}

/* What decoding one bucket of a payload needs: its sections, its scale, its top-k entries. */
struct sb_decoder {
    const unsigned char *payload, *codes, *half;
    long long first; /* TOPK: the bucket's first entry */
    float scale, s;
    int kind, levels, trits, cb, kk;
};

__device__ sb_decoder sb_decoder_of(const unsigned char *payload, long long n, int bucket, int kind, int levels,
                                    int topk, int trits, long long b, int len) {
    sb_layout L = sb_body_layout(n, bucket, kind, levels, topk, trits);
    sb_decoder D;
    D.payload = payload;
    D.codes = payload + L.codes_off;
    D.half = payload + 16;
    D.scale = sb_has_scales(kind) ? sb_u2f(sb_load_u32(payload + L.scales_off + 4 * b)) : 0.0f;
    D.s = (float)levels;
    D.kind = kind;
    D.levels = levels;
    D.trits = trits;
    D.cb = L.code_bits;
    D.first = b * L.kept_full;
    D.kk = (int)(L.kept_full < len ? L.kept_full : len);
    return D;
}

/* The value of element j (local index i in its bucket). */
__device__ __forceinline__ float sb_decode_element(const sb_decoder *D, long long j, int i) {
    const unsigned char *codes = D->codes;
    int cb = D->cb, trits = D->trits;
    float x = 0.0f;
    switch (D->kind) {
    case SB_FLOAT32:
        x = sb_u2f(sb_load_u32(D->payload + 16 + 4 * j));
        break;
    case SB_FLOAT16:
        x = sb_fp16_value(sb_load_u16(D->half + 2 * j));
        break;
    case SB_BFLOAT16:
        x = sb_bf16_value(sb_load_u16(D->half + 2 * j));
        break;
    case SB_QUANT: {
        sb_u32 w = trits ? sb_get_trit(codes, j) : sb_get_bits(codes, j * cb, cb);
        x = sb_quant_value(sb_quant_word_code(w, cb, trits), sb_quant_word_sign(w, cb, trits), D->scale, D->s);
        break;
    }
    case SB_LLOYD_MAX: {
        sb_u32 w = trits ? sb_get_trit(codes, j) : sb_get_bits(codes, j * cb, cb);
        x = sb_lm_value(sb_quant_word_code(w, cb, trits), sb_quant_word_sign(w, cb, trits), D->scale, D->levels);
        break;
    }
    case SB_SIGN:
        x = sb_sign_value(sb_get_bits(codes, j, 1), D->scale);
        break;
    case SB_TOPK: { /* binary search of i among the bucket's ascending kept indices */
        int lo = 0, hi = D->kk - 1;
        while (lo <= hi) {
            int mid = (lo + hi) >> 1;
            int idx = (int)sb_get_bits(codes, (D->first + mid) * cb, cb);
            if (idx == i) {
                x = sb_bf16_value(sb_load_u16(D->half + 2 * (D->first + mid)));
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
    return x;
}

/* out = decode(payload) (accumulate == 0) or out = (out + decode(payload)) / divisor, one block per bucket. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_decode_kernel(const unsigned char *payload, float *out, long long n, int bucket, int kind, int levels, int topk,
                 int trits, int accumulate, float divisor) {
    long long b = blockIdx.x;
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_decoder D = sb_decoder_of(payload, n, bucket, kind, levels, topk, trits, b, len);
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        long long j = j0 + i;
        float x = sb_decode_element(&D, j, i);
        out[j] = !accumulate ? x : divisor != 1.0f ? __fdiv_rn(out[j] + x, divisor) : out[j] + x;
    }
}

/* ---------------------------------------------------------------------------------------------- groups of tensors
 * The batched step (docs/DESIGN.md, "The batched step"; cuda.py send_group / decode_group): each pass is ONE launch
 * over every member of a group, and every block runs the per-tensor kernels' per-bucket device functions above
 * with that member's arguments, so payloads, residuals and sums are bitwise the per-tensor kernels'. A block finds
 * its member by a binary search of an int64 prefix table (off[0] = 0, off[m] = the total; a member without blocks
 * has an empty range). Per-member tables hold int64 pointers, sizes, keys and actions: the host uploads them in
 * one copy per group, and nothing is read back between the launches. */

/* The k < m whose range [off[k], off[k + 1]) holds x, for 0 <= x < off[m]: the largest k with off[k] <= x (an
 * empty range before it has the same start, so the largest is the non-empty one). */
__device__ __forceinline__ int sb_segment_of(const long long *off, int m, long long x) {
    int lo = 0, hi = m - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (off[mid] <= x) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* bad[k] = 1 when member k's gradient has a NaN/Inf (bad is zeroed by the host); one block per bucket. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_group_finite_kernel(int m, const long long *bucket_off, const long long *gp, const long long *n, int bucket,
                       long long *bad) {
    int k = sb_segment_of(bucket_off, m, blockIdx.x);
    const float *g = (const float *)gp[k];
    if (!g) return; /* no gradient: nothing to check (uniform across the block) */
    long long j0 = (blockIdx.x - bucket_off[k]) * (long long)bucket;
    int len = (int)((n[k] - j0) < bucket ? (n[k] - j0) : bucket);
    int any = 0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) any |= sb_nonfinite(g[j0 + i]);
    if (__syncthreads_or(any) && threadIdx.x == 0) bad[k] = 1; /* every writer writes 1: no atomic needed */
}

/* The screen of every (member, sampled bucket) pair, one block per pair and action (blockIdx.x = pair * nact +
 * action, as sb_screen_kernel): pair p of member k is its bucket samples[k][p - pair_off[k]] (all buckets in order
 * when samples[k] is 0). part: (pairs, nact, 4); a member found non-finite gets zeros (it is not screened). */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_group_screen_kernel(int m, const long long *pair_off, const long long *gp, const long long *ep,
                       const long long *n, const long long *samples, const long long *keys, const long long *bad,
                       int bucket, int nact, const int *kinds, const int *levels, const int *stochastic,
                       const int *topks, const int *trits, double *part) {
    __shared__ sb_shared S;
    long long p = blockIdx.x / nact;
    int a = (int)(blockIdx.x % nact);
    int k = sb_segment_of(pair_off, m, p);
    double *dst = part + (long long)blockIdx.x * 4;
    if (bad[k]) {
        if (threadIdx.x < 4) dst[threadIdx.x] = 0.0;
        return;
    }
    long long local = p - pair_off[k];
    const long long *sample = (const long long *)samples[k];
    const float *e = (const float *)ep[k];
    int has_g = gp[k] != 0;
    sb_screen_bucket(has_g ? (const float *)gp[k] : e, e, has_g, n[k], bucket, sample ? sample[local] : local,
                     kinds[a], levels[a], stochastic[a], topks[a], trits[a], (unsigned int)keys[k], dst, &S);
}

/* out[s * width + w] = the sum over rows p in [seg_off[s], seg_off[s + 1]) (seg_off NULL: one range, [0, rows))
 * of part[p * width + w] (4 doubles each), one block per (s, w), in the statistics' shared order
 * (safebits_math.h, SB_STAT_PARTIALS): each thread adds its rows (p = start + tid, + SB_THREADS, ...) in order, then
 * the tree of sb_block_stats; bitwise the C backend's sb_sum_partials. An empty range gives zeros. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_segment_sum_kernel(const double *part, const long long *seg_off, long long rows, int width, double *out) {
    __shared__ double sh[4 * SB_THREADS];
    long long s = blockIdx.x / width;
    int w = (int)(blockIdx.x % width);
    long long lo = seg_off ? seg_off[s] : 0, hi = seg_off ? seg_off[s + 1] : rows;
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (long long p = lo + threadIdx.x; p < hi; p += blockDim.x) {
        const double *row = part + (p * width + w) * 4;
        a0 += row[0];
        a1 += row[1];
        a2 += row[2];
        a3 += row[3];
    }
    sb_block_stats(a0, a1, a2, a3, sh, out + 4 * (long long)blockIdx.x);
}

/* The choice and the layout, ONE block: per member the action to send (sb_first_candidate on the screen's sums
 * when `choose`, else the allocated one; -1 for a non-finite member), and with `layout` the offsets of the chosen
 * payloads back to back (offsets[0] = 0, offsets[k + 1] = offsets[k] + the bytes of member k's; 0 for -1), an
 * exact int64 prefix sum, chunk after chunk of SB_THREADS members; without it every offset is 0. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_group_choose_kernel(int m, const long long *tensor, const long long *allocated, const long long *bad,
                       const double *screen_stats, int choose, int nact, const long long *cost_order,
                       const unsigned char *lossless, int lossless_index, double max_distortion,
                       double min_cosine, const long long *payload_bytes, int layout, long long *chosen,
                       long long *offsets) {
    __shared__ long long scan[SB_THREADS];
    __shared__ long long carry; /* the bytes of the chunks before this one (shared: no register lives across the
                                   choice's float64 divisions, which would spill it) */
    if (threadIdx.x == 0) {
        offsets[0] = 0;
        carry = 0;
    }
    for (int base = 0; base < m; base += blockDim.x) {
        int k = base + (int)threadIdx.x;
        long long size = 0;
        if (k < m) {
            long long t = tensor[k];
            int a = bad[k] ? -1
                    : choose ? sb_first_candidate(screen_stats + (long long)k * nact * 4, nact, (int)allocated[k],
                                                  cost_order + t * nact, lossless, lossless_index, max_distortion,
                                                  min_cosine)
                             : (int)allocated[k];
            chosen[k] = a;
            size = layout && a >= 0 ? payload_bytes[t * nact + a] : 0;
        }
        scan[threadIdx.x] = size; /* inclusive scan of the chunk (Hillis-Steele) */
        __syncthreads();
        for (int d = 1; d < (int)blockDim.x; d <<= 1) {
            long long add = (int)threadIdx.x >= d ? scan[threadIdx.x - d] : 0;
            __syncthreads();
            scan[threadIdx.x] += add;
            __syncthreads();
        }
        if (k < m) offsets[k + 1] = carry + scan[threadIdx.x];
        __syncthreads();
        if (threadIdx.x == 0) carry += scan[blockDim.x - 1];
        __syncthreads();
    }
}

/* The staging payloads, each at a 16-byte-aligned stage_off[k] (the per-tensor kernels' word-wide atomics need
 * the alignment; the back-to-back buffer has none): 16-byte chunk 0 = the header of the chosen action, the other
 * chunks of the chosen payload zeroed (the packing pass ORs codes in). One thread per chunk of the stage. */
extern "C" __global__ void sb_group_stage_kernel(int m, const long long *stage_off, const long long *tensor,
                                                 const long long *chosen, int nact, const long long *payload_bytes,
                                                 const uint4 *headers, uint4 *stage) {
    long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c * 16 >= stage_off[m]) return;
    int k = sb_segment_of(stage_off, m, c * 16);
    long long local = c - stage_off[k] / 16;
    long long a = chosen[k];
    if (a < 0 || local * 16 >= payload_bytes[tensor[k] * nact + a]) return;
    stage[c] = local == 0 ? headers[tensor[k] * nact + a] : make_uint4(0u, 0u, 0u, 0u);
}

/* The packing pass of every bucket of every member at its chosen action into its staging payload, one block per
 * bucket (sb_pack_bucket, as sb_quantize_pack_ef_kernel); part: (buckets, 4), zeros for an unsent member. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_group_pack_kernel(int m, const long long *bucket_off, const long long *gp, const long long *ep,
                     const long long *sp, const long long *n, const long long *keys, const long long *chosen,
                     const long long *stage_addr, int bucket, const int *kinds, const int *levels,
                     const int *stochastic, const int *topks, const int *trits, double *part) {
    __shared__ sb_shared S;
    int k = sb_segment_of(bucket_off, m, blockIdx.x);
    double *dst = part + 4 * (long long)blockIdx.x;
    int a = (int)chosen[k];
    if (a < 0) {
        if (threadIdx.x < 4) dst[threadIdx.x] = 0.0;
        return;
    }
    float *e = (float *)ep[k];
    int has_g = gp[k] != 0, has_sent = sp[k] != 0;
    sb_pack_bucket(has_g ? (const float *)gp[k] : e, e, (unsigned char *)stage_addr[k], has_sent ? (float *)sp[k] : e,
                   has_g, has_sent, n[k], bucket, kinds[a], levels[a], stochastic[a], topks[a], trits[a],
                   (unsigned int)keys[k], blockIdx.x - bucket_off[k], dst, &S);
}

/* Segments copied back to back: segment k (len[k] bytes with has_len, else dst_off[k + 1] - dst_off[k]) from
 * address src_addr[k] to dst + dst_off[k], in chunks of `chunk` bytes, one block per chunk: chunk_off[k] is the
 * first chunk of segment k, counted by the host with the same `chunk` from a bound of its length (its largest
 * payload), so a block looks its segment up once and its threads copy bytes without a search. The staging payloads
 * into the back-to-back buffer (send), misaligned gathered payloads into an aligned stage (decode). */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_gather_kernel(int m, const long long *chunk_off, long long chunk, const long long *dst_off, const long long *len,
                 int has_len, const long long *src_addr, unsigned char *dst) {
    int k = sb_segment_of(chunk_off, m, blockIdx.x);
    long long size = has_len ? len[k] : dst_off[k + 1] - dst_off[k];
    long long lo = (blockIdx.x - chunk_off[k]) * chunk;
    long long hi = lo + chunk < size ? lo + chunk : size;
    const unsigned char *src = (const unsigned char *)src_addr[k];
    unsigned char *out = dst + dst_off[k];
    for (long long y = lo + threadIdx.x; y < hi; y += blockDim.x) out[y] = src[y];
}

/* The receive side of a gathered group (docs/DESIGN.md, "The batched step"; cuda.py receive_group): two launches
 * and no read back. error[0] and error[1] start at SB_NO_ERROR; the host reads them when the step closes. */
#define SB_NO_ERROR 0x7fffffff

__device__ __forceinline__ int sb_same_header(const unsigned char *a, const unsigned char *b) {
    int same = 1;
    for (int i = 0; i < 16; i++) same &= a[i] == b[i];
    return same;
}

/* Where each of a gathered group's payloads starts and at which menu action, found on the device as
 * kernels.locate_payloads finds it on the host. Buffer order is rank after rank, member after member (slot s =
 * r * m + k); assumed[s] is where payload s starts if every rank sent its allocated action expected[s], row[s] its
 * tensor's row of the tables (payload_bytes and headers, `nact` actions a row). Every thread checks headers at the
 * assumed starts; from the first that differs (an escalated payload moves every later one) thread 0 reads header
 * after header. Out, member-major (k * ranks + r): addr (the payload's address) and action. A buffer that is not
 * the rows' menu payloads filling it exactly sets error[0] (the host finds what is wrong when the step closes)
 * and the decode that follows writes nothing. One block. */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_group_locate_kernel(const unsigned char *buf, long long length, int m, int ranks, const long long *row,
                       const long long *expected, const long long *assumed, int nact,
                       const long long *payload_bytes, const unsigned char *headers, long long *addr,
                       long long *action, int *error) {
    __shared__ int first;
    int slots = m * ranks;
    if (threadIdx.x == 0) first = slots;
    __syncthreads();
    for (int s = threadIdx.x; s < slots; s += blockDim.x) {
        long long at = assumed[s], cell = row[s] * nact + expected[s];
        if (at + 16 > length || !sb_same_header(buf + at, headers + cell * 16)) atomicMin(&first, s);
    }
    __syncthreads();
    int f = first;
    for (int s = threadIdx.x; s < f; s += blockDim.x) {
        long long slot = (long long)(s % m) * ranks + s / m;
        addr[slot] = (long long)(buf + assumed[s]);
        action[slot] = expected[s];
    }
    if (threadIdx.x != 0) return;
    long long at = 0;
    if (f < slots) at = assumed[f];
    else if (slots) at = assumed[slots - 1] + payload_bytes[row[slots - 1] * nact + expected[slots - 1]];
    for (int s = f; s < slots; s++) {
        int a = -1;
        for (int c = 0; c < nact && a < 0 && at + 16 <= length; c++)
            if (sb_same_header(buf + at, headers + (row[s] * nact + c) * 16)) a = c;
        if (a < 0) break;
        long long slot = (long long)(s % m) * ranks + s / m;
        addr[slot] = (long long)(buf + at);
        action[slot] = a;
        at += payload_bytes[row[s] * nact + a];
        if (s == slots - 1) f = slots;
    }
    if (f < slots || at != length) error[0] = f < slots ? f : slots;
}

/* The rank-order sum of every bucket of every member of a gathered group, one block per bucket: member k's
 * payload from rank r at addr[k * ranks + r] (any alignment), action[k * ranks + r] (sb_group_locate_kernel).
 * Each element goes through exactly the per-tensor sequence (sb_decode_kernel per rank, kernels.decode_group):
 * own[k] < 0: rank 0 written, ranks 1.. added; own[k] = r: out[k] holds rank r's values, the other ranks are added
 * in rank order; the last addition divides by `divisor`; nothing added: out divided after (IEEE division, as
 * group.c). Every element is read and written by the same thread for every rank, so no synchronization is needed
 * between ranks. Nothing is written when error[0] is set (the group was not located); a top-k bucket whose local
 * indices are out of range or not ascending sets error[1] to the lowest such slot (the step fails at its close). */
extern "C" __global__ void __launch_bounds__(SB_THREADS)
sb_group_decode_kernel(int m, int ranks, const long long *bucket_off, const long long *outp, const long long *n,
                       const long long *own, const long long *addr, const long long *action, int bucket,
                       const int *kinds, const int *levels, const int *topks, const int *trits, float divisor,
                       int *error) {
    if (error[0] != SB_NO_ERROR) return;
    int k = sb_segment_of(bucket_off, m, blockIdx.x);
    long long b = blockIdx.x - bucket_off[k], nk = n[k];
    long long j0 = b * (long long)bucket;
    int len = (int)((nk - j0) < bucket ? (nk - j0) : bucket);
    float *out = (float *)outp[k];
    int mine = (int)own[k], last = mine == ranks - 1 ? ranks - 2 : ranks - 1, added = 0;
    for (int r = 0; r < ranks; r++) {
        if (r == mine) continue;
        long long slot = (long long)k * ranks + r;
        int a = (int)action[slot];
        const unsigned char *payload = (const unsigned char *)addr[slot];
        if (kinds[a] == SB_TOPK && threadIdx.x == 0 && !sb_topk_bucket_valid(payload, nk, bucket, topks[a], b))
            atomicMin(error + 1, (int)(slot < SB_NO_ERROR - 1 ? slot : SB_NO_ERROR - 1));
        sb_decoder D = sb_decoder_of(payload, nk, bucket, kinds[a], levels[a], topks[a], trits[a], b, len);
        int accumulate = mine >= 0 || r > 0;
        float d = accumulate && r == last ? divisor : 1.0f;
        for (int i = threadIdx.x; i < len; i += blockDim.x) {
            long long j = j0 + i;
            float x = sb_decode_element(&D, j, i);
            out[j] = !accumulate ? x : d != 1.0f ? __fdiv_rn(out[j] + x, d) : out[j] + x;
        }
        added += accumulate;
    }
    if (!added && divisor != 1.0f)
        for (int i = threadIdx.x; i < len; i += blockDim.x) out[j0 + i] = __fdiv_rn(out[j0 + i], divisor);
}
