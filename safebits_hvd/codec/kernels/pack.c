/* SafeBits packed wire format, CPU side: the fused packing pass (sb_quantize_pack_ef) and the decoder (sb_decode).
 * The format (header + sections) is specified in safebits_hvd/codec/wire.py; the header is written and validated in
 * Python, these functions read and write the BODY (the payload after the 16-byte header).
 *
 * Compiled in the same translation unit as cpu.c (after it): the quantizer is cpu.c's sb_quant_bucket, which
 * calls the code/value functions of safebits_math.h, so the packed codes decode to exactly the q that
 * sb_quantize_ef sends.
 *
 * Threads never write the same byte: the packing pass hands out GROUPS of consecutive buckets whose code bit
 * ranges start on byte boundaries (512-element buckets at 1/2/4/8 bits, and 5 trits per byte, are one bucket per
 * group; other sizes take up to 8 buckets per group). A group's bit writer is flushed at its end.
 */

/* LSB-first bit writer: whole bytes are stored as soon as they are complete. */
typedef struct {
    unsigned char *p;
    unsigned long long acc;
    int nacc;
} sb_bitw;

static inline void sb_bitw_put(sb_bitw *w, sb_u32 word, int nbits) {
    w->acc |= (unsigned long long)word << w->nacc;
    w->nacc += nbits;
    while (w->nacc >= 8) {
        *w->p++ = (unsigned char)w->acc;
        w->acc >>= 8;
        w->nacc -= 8;
    }
}

static inline void sb_bitw_flush(sb_bitw *w) {
    if (w->nacc > 0) *w->p++ = (unsigned char)w->acc; /* padding bits are zero */
    w->acc = 0;
    w->nacc = 0;
}

/* m words of nbits each. On a byte boundary: 1/2/4/8-bit words a byte at a time; 3/5/6/7-bit words 8 at a time
 * (8 words of nbits bits are exactly nbits whole bytes). Each byte-at-a-time width has its own loop with a
 * constant shift pattern, which the compiler vectorizes (a loop over a variable `per` it does not). */
#define SB_PUT_BYTES(PER, NBITS)                                                                             \
    for (int b = 0; b < nbytes; b++) {                                                                       \
        sb_u32 byte = 0;                                                                                     \
        for (int k = 0; k < (PER); k++) byte |= word[b * (PER) + k] << (k * (NBITS));                        \
        p[b] = (unsigned char)byte;                                                                          \
    }
SB_CLONES void sb_bitw_put_many(sb_bitw *w, const sb_u32 *restrict word, int m, int nbits) {
    int i = 0;
    if (w->nacc == 0 && (nbits == 1 || nbits == 2 || nbits == 4 || nbits == 8)) {
        int per = 8 / nbits, nbytes = m / per;
        unsigned char *restrict p = w->p;
        switch (nbits) {
        case 8: SB_PUT_BYTES(1, 8) break;
        case 4: SB_PUT_BYTES(2, 4) break;
        case 2: SB_PUT_BYTES(4, 2) break;
        default: SB_PUT_BYTES(8, 1) break;
        }
        w->p += nbytes;
        i = nbytes * per;
    } else if (w->nacc == 0 && nbits < 8) {
        unsigned char *restrict p = w->p;
        for (; i + 8 <= m; i += 8) {
            unsigned long long acc = 0;
            for (int k = 0; k < 8; k++) acc |= (unsigned long long)word[i + k] << (k * nbits);
            for (int k = 0; k < nbits; k++) *p++ = (unsigned char)(acc >> (8 * k));
        }
        w->p = p;
    }
    for (; i < m; i++) sb_bitw_put(w, word[i], nbits);
}
#undef SB_PUT_BYTES

/* Base-3 writer: 5 trit digits per byte, digit i of a byte weighs 3^i. */
typedef struct {
    unsigned char *p;
    sb_u32 acc, mul;
    int cnt;
} sb_tritw;

SB_CLONES void sb_tritw_put_many(sb_tritw *w, const sb_u32 *restrict d, int m) {
    int i = 0;
    if (w->cnt == 0) {
        int nbytes = m / 5;
        unsigned char *restrict p = w->p;
        for (int b = 0; b < nbytes; b++) {
            const sb_u32 *x = d + 5 * b;
            p[b] = (unsigned char)(x[0] + 3u * x[1] + 9u * x[2] + 27u * x[3] + 81u * x[4]);
        }
        w->p += nbytes;
        i = nbytes * 5;
    }
    for (; i < m; i++) {
        if (w->cnt == 0) w->mul = 1u;
        w->acc += d[i] * w->mul;
        w->mul *= 3u;
        if (++w->cnt == 5) {
            *w->p++ = (unsigned char)w->acc;
            w->acc = 0;
            w->cnt = 0;
        }
    }
}

static void sb_tritw_flush(sb_tritw *w) {
    if (w->cnt > 0) *w->p++ = (unsigned char)w->acc;
    w->acc = 0;
    w->cnt = 0;
}

/* Where the sections of a body start, and how the packing pass groups buckets. */
typedef struct {
    sb_i64 nb, kept_full, codes_off; /* buckets; TOPK kept per full bucket; byte offset of the code section */
    int code_bits;                   /* bits per code (QUANT/LLOYD_MAX/SIGN) or index (TOPK); 0: trits/floats */
    sb_i64 group;                    /* buckets per group (their codes end on a byte boundary) */
} sb_layout;

static sb_i64 sb_gcd(sb_i64 a, sb_i64 b) {
    while (b) {
        sb_i64 t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static sb_layout sb_body_layout(const sb_action *act, sb_i64 n, sb_i64 bucket) {
    sb_layout L = {0, 0, 0, 0, 1};
    L.nb = (n + bucket - 1) / bucket;
    if (sb_has_scales(act->kind)) {
        L.codes_off = 4 * L.nb;
        if (act->trits) {
            L.group = 5 / sb_gcd(bucket % 5, 5); /* gcd(0, 5) = 5: a bucket is a whole number of bytes */
            return L;
        }
        L.code_bits = sb_code_bits(act->kind, act->levels, 0);
    } else if (act->kind == SB_TOPK) {
        L.kept_full = act->topk < bucket ? act->topk : bucket;
        sb_i64 full = n / bucket, rest = n % bucket;
        sb_i64 kept = full * L.kept_full + (rest < L.kept_full ? rest : L.kept_full);
        L.codes_off = 2 * kept;
        L.code_bits = sb_index_bits(bucket);
    } else {
        return L;
    }
    sb_i64 bits_per_bucket = act->kind == SB_TOPK ? L.kept_full * L.code_bits : bucket * L.code_bits;
    L.group = 8 / sb_gcd(bits_per_bucket % 8, 8);
    return L;
}

/* The fused packing pass: v = g + e (e when g is NULL); q = Q(v); the wire codes of q go to `body`; e = v - q;
 * q itself to `sent` unless it is NULL (what decoding the body gives, bitwise; `sent` may be `g`: each bucket is
 * read before it is written); stats = [sum (q-v)^2, sum q v, sum q^2, sum v^2] summed exactly as sb_quantize_ef
 * does (bitwise equal). Returns 0, or -1 when out of memory. */
int sb_quantize_pack_ef(const float *g, float *e, unsigned char *body, float *sent, sb_i64 n, sb_i64 bucket,
                        int kind, int levels, int stochastic, int topk, int trits, sb_u32 key, double *stats,
                        int nthreads) {
    sb_action act = {kind, levels, stochastic, topk, trits};
    sb_layout L = sb_body_layout(&act, n, bucket);
    sb_i64 ngroups = (L.nb + L.group - 1) / L.group;
    int fail = 0;
    memset(stats, 0, 4 * sizeof(double));
    if (n <= 0) return 0;
    double *part = (double *)sb_scratch(SB_SCRATCH_PART, (size_t)L.nb * 4 * sizeof(double));
    if (!part) return -1;
    if (nthreads < 1) nthreads = 1;
    float *scales = (float *)body;                 /* QUANT / SIGN: 4-byte aligned (body starts at byte 16) */
    unsigned short *half = (unsigned short *)body; /* FLOAT16 / BFLOAT16 values, TOPK bf16 values */
    unsigned char *codes = body + L.codes_off;
    SB_LOOP_STATIC(n > SB_PAR_MIN && nthreads > 1, grp, ngroups, {
            float *vb = (float *)sb_scratch(SB_SCRATCH_V, (size_t)bucket * sizeof(float));
            float *qb = (float *)sb_scratch(SB_SCRATCH_Q, (size_t)bucket * sizeof(float));
            sb_u32 *kb = (sb_u32 *)sb_scratch(SB_SCRATCH_K, (size_t)bucket * sizeof(sb_u32));
            sb_u32 *wb = (sb_u32 *)sb_scratch(SB_SCRATCH_W, (size_t)bucket * sizeof(sb_u32));
            if (!vb || !qb || !kb || !wb) {
                SB_FAIL(fail);
                continue;
            }
            sb_i64 b0 = grp * L.group, b1 = b0 + L.group < L.nb ? b0 + L.group : L.nb;
            /* group starts: bit b0 * bits_per_bucket, trit b0 * bucket; both whole bytes by construction */
            sb_bitw bw = {codes + (kind == SB_TOPK ? b0 * L.kept_full : b0 * bucket) * L.code_bits / 8, 0, 0};
            sb_tritw tw = {codes + b0 * bucket / 5, 0, 1, 0};
            for (sb_i64 b = b0; b < b1; b++) {
                sb_i64 j0 = b * bucket;
                int len = (int)((n - j0) < bucket ? (n - j0) : bucket), i;
                float scale = 0.0f;
                sb_load_v(g ? g + j0 : NULL, e + j0, vb, len);
                int m = sb_quant_bucket(&act, vb, qb, len, j0, key, kb, wb, &scale);
                switch (kind) {
                case SB_FLOAT32:
                    memcpy(body + 4 * j0, qb, (size_t)len * sizeof(float));
                    break;
                case SB_FLOAT16:
                    for (i = 0; i < len; i++) half[j0 + i] = (unsigned short)sb_fp16_code(qb[i]); /* exact */
                    break;
                case SB_BFLOAT16:
                    for (i = 0; i < len; i++) half[j0 + i] = (unsigned short)sb_bf16_code(qb[i]);
                    break;
                case SB_QUANT:
                case SB_LLOYD_MAX:
                case SB_SIGN:
                    scales[b] = scale;
                    if (trits) sb_tritw_put_many(&tw, wb, m);
                    else sb_bitw_put_many(&bw, wb, m, L.code_bits);
                    break;
                case SB_TOPK:
                    for (i = 0; i < m; i++) half[b * L.kept_full + i] = (unsigned short)sb_bf16_code(qb[wb[i]]);
                    sb_bitw_put_many(&bw, wb, m, L.code_bits);
                    break;
                default:
                    break;
                }
                sb_bucket_stats(qb, vb, e + j0, len, part + 4 * b);
                if (sent) memcpy(sent + j0, qb, (size_t)len * sizeof(float));
            }
            sb_bitw_flush(&bw);
            sb_tritw_flush(&tw);
    });
    if (!fail) sb_sum_partials(part, L.nb, 4, 0, stats);
    return fail ? -1 : 0;
}

/* wb[0..m) = the m words of nbits at bit position bit0. On a byte boundary: a byte at a time for 1/2/4/8-bit words,
 * 8 words (nbits whole bytes) at a time for 3 to 7 bits. Each width has its own loop with constant shifts, which
 * the compiler vectorizes (loops over a variable width it does not). */
#define SB_GET_BYTES(PER, NBITS)                                                                             \
    for (int b = 0; b < nbytes; b++)                                                                         \
        for (int k = 0; k < (PER); k++) wb[b * (PER) + k] = ((sb_u32)q[b] >> (k * (NBITS))) & mask;
#define SB_GET_OCTETS(NBITS)                                                                                 \
    for (; i + 8 <= m; i += 8, q += (NBITS)) {                                                               \
        unsigned long long acc = 0;                                                                          \
        for (int k = 0; k < (NBITS); k++) acc |= (unsigned long long)q[k] << (8 * k);                        \
        for (int k = 0; k < 8; k++) wb[i + k] = (sb_u32)(acc >> (k * (NBITS))) & mask;                       \
    }
SB_CLONES void sb_get_many(const unsigned char *restrict p, sb_i64 bit0, int m, int nbits, sb_u32 *restrict wb) {
    int i = 0;
    const unsigned char *restrict q = p + (bit0 >> 3);
    sb_u32 mask = (1u << nbits) - 1u;
    if ((bit0 & 7) == 0 && (nbits == 1 || nbits == 2 || nbits == 4 || nbits == 8)) {
        int per = 8 / nbits, nbytes = m / per;
        switch (nbits) {
        case 8: SB_GET_BYTES(1, 8) break;
        case 4: SB_GET_BYTES(2, 4) break;
        case 2: SB_GET_BYTES(4, 2) break;
        default: SB_GET_BYTES(8, 1) break;
        }
        i = nbytes * per;
    } else if ((bit0 & 7) == 0 && nbits < 8) {
        switch (nbits) {
        case 3: SB_GET_OCTETS(3) break;
        case 5: SB_GET_OCTETS(5) break;
        case 6: SB_GET_OCTETS(6) break;
        default: SB_GET_OCTETS(7) break;
        }
    }
    for (; i < m; i++) wb[i] = sb_get_bits(p, bit0 + (sb_i64)i * nbits, nbits);
}
#undef SB_GET_BYTES
#undef SB_GET_OCTETS

/* x[0..m) = val[wb[i]]: a code word's value from a table made once per bucket, not recomputed per element. */
SB_CLONES void sb_lookup_many(const sb_u32 *restrict wb, int m, const float *restrict val, float *restrict x) {
    for (int i = 0; i < m; i++) x[i] = val[wb[i]];
}

/* The 5 trit digits of every byte value (digit i = byte / 3^i % 3, as sb_get_trit; bytes above 242 never come
 * from the packer but decode the same way), as constant expressions: no division per element, no init race. */
#define SB_T1(b) {(b) % 3, (b) / 3 % 3, (b) / 9 % 3, (b) / 27 % 3, (b) / 81 % 3}
#define SB_T4(b) SB_T1(b), SB_T1((b) + 1), SB_T1((b) + 2), SB_T1((b) + 3)
#define SB_T16(b) SB_T4(b), SB_T4((b) + 4), SB_T4((b) + 8), SB_T4((b) + 12)
#define SB_T64(b) SB_T16(b), SB_T16((b) + 16), SB_T16((b) + 32), SB_T16((b) + 48)
static const unsigned char sb_trit5[256][5] = {SB_T64(0), SB_T64(64), SB_T64(128), SB_T64(192)};
#undef SB_T1
#undef SB_T4
#undef SB_T16
#undef SB_T64

/* x[0..m) = val[digit] of elements j0 .. j0 + m of a trit stream: a bucket may start and end inside a byte (512
 * elements are 102.4 bytes), so the partial first and last bytes are split from the whole ones. A table load,
 * not a compare, picks the value: digits are random, branches on them would mispredict. */
SB_CLONES void sb_get_trits_many(const unsigned char *restrict p, sb_i64 j0, int m, const float *restrict val,
                                 float *restrict x) {
    const unsigned char *restrict q = p + j0 / 5;
    int off = (int)(j0 % 5), i = 0, l;
    if (off) {
        const unsigned char *d = sb_trit5[*q++];
        for (l = off; l < 5 && i < m; l++) x[i++] = val[d[l]];
    }
    for (; i + 5 <= m; i += 5) {
        const unsigned char *d = sb_trit5[*q++];
        for (l = 0; l < 5; l++) x[i + l] = val[d[l]];
    }
    if (i < m) {
        const unsigned char *d = sb_trit5[*q];
        for (l = 0; i < m; l++) x[i++] = val[d[l]];
    }
}

/* x[0..m) = the values of m 8-bit sign-magnitude QUANT codes (one byte each). */
SB_CLONES void sb_quant_bytes(const unsigned char *restrict p, int m, float scale, float s, float *restrict x) {
    for (int i = 0; i < m; i++) x[i] = sb_quant_value(sb_quant_word_code(p[i], 8, 0), sb_quant_word_sign(p[i], 8, 0),
                                                      scale, s);
}

/* TOPK payloads only: are the local indices of every bucket strictly ascending and inside the bucket? Checked
 * before anything is written, so a corrupt payload never touches memory outside `out`. Returns the first bad
 * bucket, or -1. */
static sb_i64 sb_check_topk(const unsigned char *codes, const sb_layout *L, sb_i64 n, sb_i64 bucket) {
    for (sb_i64 b = 0; b < L->nb; b++) {
        sb_i64 j0 = b * bucket;
        sb_i64 len = (n - j0) < bucket ? (n - j0) : bucket;
        sb_i64 kk = L->kept_full < len ? L->kept_full : len;
        sb_i64 prev = -1;
        for (sb_i64 r = 0; r < kk; r++) {
            sb_i64 idx = (sb_i64)sb_get_bits(codes, (b * L->kept_full + r) * L->code_bits, L->code_bits);
            if (idx <= prev || idx >= len) return b;
            prev = idx;
        }
    }
    return -1;
}

/* out = decode(body) (accumulate == 0) or out = (out + decode(body)) / divisor (float32 add, then the division
 * unless divisor is 1: the average over ranks in the same pass as the last rank's payload). The header fields were
 * validated in Python. Returns 0, -1 when out of memory, or -2 - b when bucket b of a TOPK payload has indices
 * that are out of range or not ascending (nothing is written then). */
int sb_decode(const unsigned char *body, float *out, sb_i64 n, sb_i64 bucket, int kind, int levels, int topk,
              int trits, int accumulate, float divisor, int nthreads) {
    sb_action act = {kind, levels, 0, topk, trits};
    sb_layout L = sb_body_layout(&act, n, bucket);
    int fail = 0;
    if (n <= 0) return 0;
    const unsigned char *codes = body + L.codes_off;
    if (kind == SB_TOPK) {
        sb_i64 bad = sb_check_topk(codes, &L, n, bucket);
        if (bad >= 0) return (int)(-2 - (bad < 0x3fffffff ? bad : 0x3fffffff));
    }
    if (nthreads < 1) nthreads = 1;
    const float *scales = (const float *)body;
    const unsigned short *half = (const unsigned short *)body;
    float s = (float)levels;
    int cb = L.code_bits;
    SB_LOOP_STATIC(n > SB_PAR_MIN && nthreads > 1, b, L.nb, {
            float *xb = (float *)sb_scratch(SB_SCRATCH_V, (size_t)bucket * sizeof(float));
            sb_u32 *wb = (sb_u32 *)sb_scratch(SB_SCRATCH_W, (size_t)bucket * sizeof(sb_u32));
            if (!xb || !wb) {
                SB_FAIL(fail);
                continue;
            }
            sb_i64 j0 = b * bucket;
            int len = (int)((n - j0) < bucket ? (n - j0) : bucket), i;
            float *x = xb;
            float val[128]; /* a bucket's value of each code word of up to 7 bits (QUANT, LLOYD_MAX) */
            switch (kind) {
            case SB_FLOAT32:
                x = (float *)(body + 4 * j0); /* the values themselves */
                break;
            case SB_FLOAT16:
                for (i = 0; i < len; i++) xb[i] = sb_fp16_value(half[j0 + i]);
                break;
            case SB_BFLOAT16:
                for (i = 0; i < len; i++) xb[i] = sb_bf16_value(half[j0 + i]);
                break;
            case SB_QUANT: {
                float scale = scales[b];
                if (trits) { /* a digit has 3 values: compute them once per bucket with the shared functions */
                    for (sb_u32 w = 0; w < 3; w++)
                        val[w] = sb_quant_value(sb_quant_word_code(w, cb, 1), sb_quant_word_sign(w, cb, 1), scale, s);
                    sb_get_trits_many(codes, j0, len, val, xb);
                } else if (cb == 8) { /* 8-bit codes are whole bytes: read them in the value loop */
                    sb_quant_bytes(codes + j0, len, scale, s, xb);
                } else if (cb < 8) { /* the value of each of the 2^cb words once per bucket */
                    for (sb_u32 w = 0; w < (1u << cb); w++)
                        val[w] = sb_quant_value(sb_quant_word_code(w, cb, 0), sb_quant_word_sign(w, cb, 0), scale, s);
                    sb_get_many(codes, j0 * cb, len, cb, wb);
                    sb_lookup_many(wb, len, val, xb);
                } else { /* 9 to 16 bits (up to 32767 levels): rare; per element */
                    sb_get_many(codes, j0 * cb, len, cb, wb);
                    for (i = 0; i < len; i++)
                        xb[i] = sb_quant_value(sb_quant_word_code(wb[i], cb, 0), sb_quant_word_sign(wb[i], cb, 0),
                                               scale, s);
                }
                break;
            }
            case SB_LLOYD_MAX: {
                float scale = scales[b];
                if (trits) { /* as QUANT trits: the 3 values once per bucket */
                    for (sb_u32 w = 0; w < 3; w++)
                        val[w] = sb_lm_value(sb_quant_word_code(w, 0, 1), sb_quant_word_sign(w, 0, 1), scale, levels);
                    sb_get_trits_many(codes, j0, len, val, xb);
                } else { /* as QUANT: a table of the 2^cb word values per bucket */
                    for (sb_u32 w = 0; w < (1u << cb); w++)
                        val[w] = sb_lm_value(sb_quant_word_code(w, cb, 0), sb_quant_word_sign(w, cb, 0), scale,
                                             levels);
                    sb_get_many(codes, j0 * cb, len, cb, wb);
                    sb_lookup_many(wb, len, val, xb);
                }
                break;
            }
            case SB_SIGN: {
                float scale = scales[b];
                sb_get_many(codes, j0, len, 1, wb);
                for (i = 0; i < len; i++) xb[i] = sb_sign_value(wb[i], scale);
                break;
            }
            case SB_TOPK: {
                int kk = (int)(L.kept_full < len ? L.kept_full : len);
                sb_get_many(codes, b * L.kept_full * cb, kk, cb, wb);
                for (i = 0; i < len; i++) xb[i] = 0.0f;
                for (i = 0; i < kk; i++) xb[wb[i]] = sb_bf16_value(half[b * L.kept_full + i]);
                break;
            }
            default:
                for (i = 0; i < len; i++) xb[i] = 0.0f;
                break;
            }
            float *o = out + j0;
            if (accumulate && divisor != 1.0f)
                for (i = 0; i < len; i++) o[i] = (o[i] + x[i]) / divisor;
            else if (accumulate)
                for (i = 0; i < len; i++) o[i] += x[i];
            else
                memcpy(o, x, (size_t)len * sizeof(float));
    });
    return fail ? -1 : 0;
}
