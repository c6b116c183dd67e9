/* SafeBits CUDA backend: one thread block per bucket, per-element math from safebits_math.h.
 *
 * Compiled by NVRTC (CuPy RawModule) from source.translation_unit() (constants, safebits_math.h, this file),
 * with --fmad=false
 * --ftz=false --prec-div=true, so every float result is bit-identical to the C backend. The block-wide values
 * that decide outputs are computed exactly as in cpu.c: the QUANT scale is an integer max of |v| keys, the SIGN
 * scale is summed by SB_SUM_LANES threads each walking its lane in element order, the TOPK threshold (the kk-th
 * largest key) is found by a bitwise radix search with integer counts and ties are kept lowest index first.
 * Statistics: per-block float64 tree reductions into a per-bucket scratch array that the host sums.
 */
#define SB_THREADS 256

struct sb_block_params {
    float scale;     /* QUANT: max|v|; SIGN: mean|v| */
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
                                 int topk, sb_block_params *P, unsigned *sh_u, double *sh_lane) {
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
    } else if (kind == SB_SIGN) {
        if (tid < SB_SUM_LANES) {
            double acc = 0.0;
            for (int i = tid; i < len; i += SB_SUM_LANES) {
                float x = sb_load(g, e, has_g, j0 + i);
                acc += (double)(x < 0.0f ? -x : x);
            }
            sh_lane[tid] = acc;
        }
        __syncthreads();
        if (tid == 0) {
            double total = sh_lane[0];
            for (int l = 1; l < SB_SUM_LANES; l++) total += sh_lane[l];
            P->scale = (float)(total / (double)len);
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

__device__ __forceinline__ float sb_element(float v, int kind, int levels, int stochastic, const sb_block_params *P,
                                            sb_u32 key, long long j, int i) {
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
        return sb_quant(v, P->scale, (float)levels, u);
    }
    case SB_SIGN:
        return sb_sign(v, P->scale);
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
                      int levels, int stochastic, int topk, unsigned int key, double *part) {
    __shared__ sb_block_params P;
    __shared__ unsigned sh_u;
    __shared__ double sh_lane[SB_SUM_LANES];
    __shared__ double sh[4 * SB_THREADS];
    long long b = blockIdx.x;
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    sb_block_prepare(g, e, has_g, j0, len, kind, topk, &P, &sh_u, sh_lane);
    double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
    for (int i = threadIdx.x; i < len; i += blockDim.x) {
        long long j = j0 + i;
        float v = sb_load(g, e, has_g, j);
        float q = sb_element(v, kind, levels, stochastic, &P, (sb_u32)key, j, i);
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
                 unsigned int key, double *part) {
    __shared__ sb_block_params P;
    __shared__ unsigned sh_u;
    __shared__ double sh_lane[SB_SUM_LANES];
    __shared__ double sh[4 * SB_THREADS];
    long long b = buckets[blockIdx.x];
    long long j0 = b * (long long)bucket;
    int len = (int)((n - j0) < bucket ? (n - j0) : bucket);
    for (int a = 0; a < nact; a++) {
        int kind = kinds[a];
        sb_block_prepare(g, e, has_g, j0, len, kind, topks[a], &P, &sh_u, sh_lane);
        double a0 = 0.0, a1 = 0.0, a2 = 0.0, a3 = 0.0;
        for (int i = threadIdx.x; i < len; i += blockDim.x) {
            long long j = j0 + i;
            float v = sb_load(g, e, has_g, j);
            float q = sb_element(v, kind, levels[a], stochastic[a], &P, (sb_u32)key, j, i);
            double qd = (double)q, vd = (double)v, d = qd - vd;
            a0 += d * d;
            a1 += qd * vd;
            a2 += qd * qd;
            a3 += vd * vd;
        }
        sb_block_stats(a0, a1, a2, a3, sh, part + ((long long)blockIdx.x * nact + a) * 4);
    }
}
