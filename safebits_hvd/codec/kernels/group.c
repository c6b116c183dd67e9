/* Multi-tensor entry points: one call over the members of a group, each member with its own tensors, action and
 * key (docs/DESIGN.md, "The batched step").
 *
 * Compiled in the same translation unit as cpu.c and pack.c (after them). Every member is processed by the same
 * per-tensor functions (sb_screen, sb_quantize_pack_ef, sb_decode) with the same arguments, so every result is
 * bitwise that of one call per member. Members up to SB_PAR_MIN elements run in parallel across members, one thread
 * each; larger ones after them, one at a time, each with nthreads (as a call of its own would), outside any parallel
 * construct: in libgomp a parallel region nested in another, even an inactive one, starts its threads anew on every
 * call, which costs more than the work of a 64K-element tensor (docs/RESULTS.md 5.1).
 */

#define SB_HEADER_BYTES 16 /* safebits_hvd/codec/wire.py HEADER_BYTES */
#define SB_OUTPUT_SCREEN 0 /* kernels.GroupOutput */
#define SB_OUTPUT_PAYLOAD 1
#define SB_OUTPUT_VALUES 2

/* 1 when every element of x[0..n) is finite (no early exit: the loop vectorizes). */
static int sb_all_finite(const float *x, sb_i64 n) {
    int bad = 0;
    for (sb_i64 i = 0; i < n; i++) bad |= sb_nonfinite(x[i]);
    return !bad;
}

/* sb_passes and sb_first_candidate (the screen's test, the first action to send) are in safebits_math.h: the CUDA
 * group kernels make the same choice. */


/* Run CALL(k, threads) for every member k (CALL returns nonzero on failure, which sets `fail`): those of at most
 * SB_PAR_MIN elements in parallel across members, one thread each; then the larger ones, one at a time with every
 * thread, outside the parallel construct (see the top of this file). */
#define SB_FOR_MEMBERS(CALL)                                                                  \
    do {                                                                                      \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (m > 1)")     \
        for (int k = 0; k < m; k++)                                                           \
            if (n[k] <= SB_PAR_MIN && CALL(k, 1)) {                                           \
                _Pragma("omp atomic write")                                                   \
                fail = 1;                                                                     \
            }                                                                                 \
        for (int k = 0; k < m; k++)                                                           \
            if (n[k] > SB_PAR_MIN && CALL(k, nthreads)) fail = 1;                             \
    } while (0)

/* sb_pack_group's arguments, for the per-member steps below. */
typedef struct {
    const sb_i64 *member, *g, *e, *sent, *n, *samples, *nsel;
    const sb_u32 *keys;
    sb_i64 bucket;
    int nact;
    const int *kinds, *levels, *stochastic, *topks, *trits, *allocated;
    const sb_i64 *cost_order;
    const unsigned char *lossless;
    int lossless_index, check_finite, do_screen, screen_enabled;
    double max_distortion, min_cosine;
    const unsigned char *headers;
    unsigned char *buffer, *finite;
    double *screen_stats, *stats;
    int *chosen;
    const sb_i64 *offsets;
} sb_send_args;

/* Phase 1 of member k: the finite check, the screen and the choice. */
static int sb_screen_member(const sb_send_args *s, int k, int threads) {
    const float *gk = (const float *)(intptr_t)s->g[k];
    double *sk = s->screen_stats + (size_t)k * s->nact * 4;
    s->finite[k] = (unsigned char)(!s->check_finite || sb_all_finite(gk, s->n[k]));
    if (!s->finite[k]) {
        s->chosen[k] = -1;
        return 0;
    }
    int rc = 0;
    if (s->do_screen)
        rc = sb_screen(gk, (const float *)(intptr_t)s->e[k], s->n[k], s->bucket,
                       s->samples[k] ? (const sb_i64 *)(intptr_t)s->samples[k] : NULL, s->nsel[k], s->nact, s->kinds,
                       s->levels, s->stochastic, s->topks, s->trits, s->keys[k], sk, threads);
    s->chosen[k] = s->screen_enabled && s->do_screen
                       ? sb_first_candidate(sk, s->nact, s->allocated[k], s->cost_order + (size_t)s->member[k] * s->nact,
                                            s->lossless, s->lossless_index, s->max_distortion, s->min_cosine)
                       : s->allocated[k];
    return rc;
}

/* SB_OUTPUT_VALUES for member k: q into sent[k] and the residual (stats zero for an unsent member). */
static int sb_values_member(const sb_send_args *s, int k, int threads) {
    int a = s->chosen[k];
    if (a < 0) return 0;
    return sb_quantize_ef((const float *)(intptr_t)s->g[k], (float *)(intptr_t)s->e[k], (float *)(intptr_t)s->sent[k],
                          s->n[k], s->bucket, s->kinds[a], s->levels[a], s->stochastic[a], s->topks[a], s->trits[a],
                          s->keys[k], s->stats + 4 * k, threads);
}

/* Phase 3 for member k: header and body at offsets[k]. A body that does not start 16-byte aligned (payloads of any
 * length lie back to back) is packed into an aligned scratch buffer and copied: the kernels write float32 and 16-bit
 * words. */
static int sb_pack_member(const sb_send_args *s, int k, int threads) {
    memset(s->stats + 4 * k, 0, 4 * sizeof(double));
    int a = s->chosen[k];
    if (a < 0) return 0;
    unsigned char *payload = s->buffer + s->offsets[k];
    sb_i64 body_bytes = s->offsets[k + 1] - s->offsets[k] - SB_HEADER_BYTES;
    memcpy(payload, s->headers + ((size_t)s->member[k] * s->nact + a) * SB_HEADER_BYTES, SB_HEADER_BYTES);
    unsigned char *body = payload + SB_HEADER_BYTES, *scratch = NULL;
    if ((uintptr_t)body % 16) {
        scratch = (unsigned char *)sb_scratch(SB_SCRATCH_BODY, (size_t)body_bytes);
        if (!scratch) return -1;
    }
    int rc = sb_quantize_pack_ef((const float *)(intptr_t)s->g[k], (float *)(intptr_t)s->e[k], scratch ? scratch : body,
                                 s->sent[k] ? (float *)(intptr_t)s->sent[k] : NULL, s->n[k], s->bucket, s->kinds[a],
                                 s->levels[a], s->stochastic[a], s->topks[a], s->trits[a], s->keys[k], s->stats + 4 * k,
                                 threads);
    if (scratch) memcpy(body, scratch, (size_t)body_bytes);
    return rc;
}

/* Per member k (tensor index member[k]): check g for NaN/Inf (when check_finite), screen every action on its
 * sampled buckets (when do_screen), choose the action to send (the allocated one unless screen_enabled says
 * otherwise), and pack it: header (from the table headers[tensor][action], 16 bytes) and body, back to back in
 * member order in `buffer`; q into sent[k] unless 0. A non-finite member is neither screened nor packed (chosen -1,
 * no bytes): the caller sends it on its own path. offsets[0..m]: where each member's payload starts, and the end.
 * output (kernels.GroupOutput): SB_OUTPUT_SCREEN, the check, the screen and the choice only (nothing written,
 * offsets and stats zero; the two-phase first hop packs each tensor's segments apart); SB_OUTPUT_PAYLOAD, as above;
 * SB_OUTPUT_VALUES, q into sent[k] (every one given) and the residual, no payload (sb_quantize_ef; offsets zero).
 * Returns 0, -1 when out of memory, -2 when the payloads would not fit `capacity` bytes. */
int sb_pack_group(int m, const sb_i64 *member, const sb_i64 *g, const sb_i64 *e, const sb_i64 *sent,
                  const sb_i64 *n, const sb_i64 *samples, const sb_i64 *nsel, const sb_u32 *keys, sb_i64 bucket,
                  int nact, const int *kinds, const int *levels, const int *stochastic, const int *topks,
                  const int *trits, const int *allocated, const sb_i64 *cost_order, const unsigned char *lossless,
                  int lossless_index, int check_finite, int do_screen, int screen_enabled, double max_distortion,
                  double min_cosine, const sb_i64 *payload_bytes, const unsigned char *headers,
                  unsigned char *buffer, sb_i64 capacity, unsigned char *finite, double *screen_stats, int *chosen,
                  sb_i64 *offsets, double *stats, int output, int nthreads) {
    int fail = 0;
    if (nthreads < 1) nthreads = 1;
    sb_send_args s = {member, g, e, sent, n, samples, nsel, keys, bucket, nact, kinds, levels, stochastic, topks,
                      trits, allocated, cost_order, lossless, lossless_index, check_finite, do_screen, screen_enabled,
                      max_distortion, min_cosine, headers, buffer, finite, screen_stats, stats, chosen, offsets};
#define SB_SCREEN(k, threads) sb_screen_member(&s, k, threads)
#define SB_VALUES(k, threads) sb_values_member(&s, k, threads)
#define SB_PACK(k, threads) sb_pack_member(&s, k, threads)
    /* Phase 1: finite check, screen and choice. */
    SB_FOR_MEMBERS(SB_SCREEN);
    if (fail) return -1;
    if (output != SB_OUTPUT_PAYLOAD) {
        memset(offsets, 0, (size_t)(m + 1) * sizeof(sb_i64));
        memset(stats, 0, (size_t)m * 4 * sizeof(double));
    }
    if (output == SB_OUTPUT_SCREEN) return 0;
    if (output == SB_OUTPUT_VALUES) {
        SB_FOR_MEMBERS(SB_VALUES);
        return fail ? -1 : 0;
    }
    /* Phase 2: the layout (member order, back to back). */
    offsets[0] = 0;
    for (int k = 0; k < m; k++)
        offsets[k + 1] = offsets[k] + (chosen[k] < 0 ? 0 : payload_bytes[member[k] * nact + chosen[k]]);
    if (offsets[m] > capacity) return -2;
    /* Phase 3: pack. */
    SB_FOR_MEMBERS(SB_PACK);
#undef SB_SCREEN
#undef SB_VALUES
#undef SB_PACK
    return fail ? -1 : 0;
}

/* sb_decode_group's arguments, for the per-member step below. */
typedef struct {
    int ranks;
    const sb_i64 *bodies, *body_bytes;
    const int *actions;
    const sb_i64 *outs, *n;
    const int *own;
    sb_i64 bucket;
    const int *kinds, *levels, *topks, *trits;
    float divisor;
    sb_i64 *bad;          /* the lowest slot with invalid top-k indices, or -1 */
} sb_decode_args;

/* Member k's sum over ranks, in rank order. */
static int sb_decode_member(const sb_decode_args *d, int k, int threads) {
    int ranks = d->ranks, own = d->own[k];
    float *out = (float *)(intptr_t)d->outs[k];
    int added = 0, last = own == ranks - 1 ? ranks - 2 : ranks - 1;
    for (int r = 0; r < ranks; r++) {
        if (r == own) continue;
        sb_i64 slot = (sb_i64)k * ranks + r;
        int a = d->actions[slot];
        const unsigned char *body = (const unsigned char *)(intptr_t)d->bodies[slot];
        unsigned char *scratch = NULL;
        if ((uintptr_t)body % 16) {
            scratch = (unsigned char *)sb_scratch(SB_SCRATCH_BODY, (size_t)d->body_bytes[slot]);
            if (!scratch) return -1;
            memcpy(scratch, body, (size_t)d->body_bytes[slot]);
            body = scratch;
        }
        int accumulate = own >= 0 || r > 0;
        int rc = sb_decode(body, out, d->n[k], d->bucket, d->kinds[a], d->levels[a], d->topks[a], d->trits[a],
                           accumulate, accumulate && r == last ? d->divisor : 1.0f, threads);
        if (rc == -1) return -1;
        if (rc <= -2) {
#pragma omp critical(sb_decode_group_bad)
            if (*d->bad < 0 || slot < *d->bad) *d->bad = slot;
            return 0;
        }
        added += accumulate;
    }
    if (!added && d->divisor != 1.0f)
        for (sb_i64 i = 0; i < d->n[k]; i++) out[i] = out[i] / d->divisor;
    return 0;
}

/* The sum over ranks of every member of a gathered group, in rank order: member k's payload from rank r has its
 * body at bodies[k * ranks + r] (body_bytes long) and its action at actions[k * ranks + r]. own[k] < 0: out[k] is
 * written with rank 0's values, then ranks 1.. are added; own[k] = r: out[k] already holds rank r's values and the
 * other ranks are added in rank order (bitwise the same sum, see collectives.FusedAllgather). The last addition
 * also divides by `divisor`; when nothing is added, out[k] is divided after.
 * Returns 0, -1 when out of memory, or -2 - (k * ranks + r) for the first payload whose top-k indices are invalid. */
int sb_decode_group(int m, int ranks, const sb_i64 *bodies, const sb_i64 *body_bytes, const int *actions,
                    const sb_i64 *outs, const sb_i64 *n, const int *own, sb_i64 bucket, const int *kinds,
                    const int *levels, const int *topks, const int *trits, float divisor, int nthreads) {
    int fail = 0;
    sb_i64 bad = -1;
    if (nthreads < 1) nthreads = 1;
    sb_decode_args d = {ranks, bodies, body_bytes, actions, outs, n, own, bucket, kinds, levels, topks, trits, divisor,
                        &bad};
#define SB_DECODE(k, threads) sb_decode_member(&d, k, threads)
    SB_FOR_MEMBERS(SB_DECODE);
#undef SB_DECODE
    if (fail) return -1;
    return bad >= 0 ? (int)(-2 - bad) : 0;
}
