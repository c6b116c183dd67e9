/* Multi-tensor entry points: one call over the members of a group, each member with its own tensors, action and
 * key (docs/DESIGN.md, "The batched step").
 *
 * Compiled in the same translation unit as cpu.c and pack.c (after them). Every member is processed by the same
 * per-tensor functions (sb_screen, sb_quantize_pack_ef, sb_decode) with the same arguments, so every result is
 * bitwise that of one call per member. Members up to SB_PAR_MIN elements run in parallel across members, one thread
 * each; larger ones one after another, each with nthreads (as a call of its own would).
 */

#define SB_HEADER_BYTES 16 /* safebits_hvd/wire.py HEADER_BYTES */
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

/* Per member k (tensor index member[k]): check g for NaN/Inf (when check_finite), screen every action on its
 * sampled buckets (when do_screen), choose the action to send (the allocated one unless screen_enabled says
 * otherwise), and pack it: header (from the table headers[tensor][action], 16 bytes) and body, back to back in
 * member order in `buffer`; q into sent[k] unless 0. A non-finite member is neither screened nor packed (chosen -1,
 * no bytes): the caller sends it on its own path. offsets[0..m]: where each member's payload starts, and the end.
 * output (kernels.GroupOutput): SB_OUTPUT_SCREEN, the check, the screen and the choice only (nothing written,
 * offsets and stats zero; the two-phase first hop packs each tensor's segments apart); SB_OUTPUT_PAYLOAD, as above;
 * SB_OUTPUT_VALUES, q into sent[k] (every one given) and the residual, no payload (sb_quantize_ef; offsets zero).
 * Returns 0, -1 when out of memory, -2 when the payloads would not fit `capacity` bytes. */
int sb_send_group(int m, const sb_i64 *member, const sb_i64 *g, const sb_i64 *e, const sb_i64 *sent,
                  const sb_i64 *n, const sb_i64 *samples, const sb_i64 *nsel, const sb_u32 *keys, sb_i64 bucket,
                  int nact, const int *kinds, const int *levels, const int *stochastic, const int *topks,
                  const int *trits, const int *allocated, const sb_i64 *cost_order, const unsigned char *lossless,
                  int lossless_index, int check_finite, int do_screen, int screen_enabled, double max_distortion,
                  double min_cosine, const sb_i64 *payload_bytes, const unsigned char *headers,
                  unsigned char *buffer, sb_i64 capacity, unsigned char *finite, double *screen_stats, int *chosen,
                  sb_i64 *offsets, double *stats, int output, int nthreads) {
    int fail = 0;
    if (nthreads < 1) nthreads = 1;
    /* Phase 1: finite check, screen and choice. */
    for (int large = 0; large < 2; large++) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (!large && m > 1)
        for (int k = 0; k < m; k++) {
            if ((n[k] > SB_PAR_MIN) != large) continue;
            sb_i64 t = member[k];
            const float *gk = (const float *)(intptr_t)g[k];
            double *sk = screen_stats + (size_t)k * nact * 4;
            finite[k] = (unsigned char)(!check_finite || sb_all_finite(gk, n[k]));
            if (!finite[k]) {
                chosen[k] = -1;
                continue;
            }
            if (do_screen) {
                int rc = sb_screen(gk, (const float *)(intptr_t)e[k], n[k], bucket,
                                   samples[k] ? (const sb_i64 *)(intptr_t)samples[k] : NULL, nsel[k], nact, kinds,
                                   levels, stochastic, topks, trits, keys[k], sk, large ? nthreads : 1);
                if (rc) {
#pragma omp atomic write
                    fail = 1;
                }
            }
            chosen[k] = screen_enabled && do_screen
                            ? sb_first_candidate(sk, nact, allocated[k], cost_order + (size_t)t * nact, lossless,
                                                 lossless_index, max_distortion, min_cosine)
                            : allocated[k];
        }
    }
    if (fail) return -1;
    if (output != SB_OUTPUT_PAYLOAD) {
        memset(offsets, 0, (size_t)(m + 1) * sizeof(sb_i64));
        memset(stats, 0, (size_t)m * 4 * sizeof(double));
    }
    if (output == SB_OUTPUT_SCREEN) return 0;
    if (output == SB_OUTPUT_VALUES) {
        for (int large = 0; large < 2; large++) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (!large && m > 1)
            for (int k = 0; k < m; k++) {
                if ((n[k] > SB_PAR_MIN) != large) continue;
                int a = chosen[k];
                if (a < 0) continue;
                int rc = sb_quantize_ef((const float *)(intptr_t)g[k], (float *)(intptr_t)e[k],
                                        (float *)(intptr_t)sent[k], n[k], bucket, kinds[a], levels[a], stochastic[a],
                                        topks[a], trits[a], keys[k], stats + 4 * k, large ? nthreads : 1);
                if (rc) {
#pragma omp atomic write
                    fail = 1;
                }
            }
        }
        return fail ? -1 : 0;
    }
    /* Phase 2: the layout (member order, back to back). */
    offsets[0] = 0;
    for (int k = 0; k < m; k++)
        offsets[k + 1] = offsets[k] + (chosen[k] < 0 ? 0 : payload_bytes[member[k] * nact + chosen[k]]);
    if (offsets[m] > capacity) return -2;
    /* Phase 3: pack. A body that does not start 16-byte aligned (payloads of any length lie back to back) is packed
     * into an aligned scratch buffer and copied: the kernels write float32 and 16-bit words. */
    for (int large = 0; large < 2; large++) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (!large && m > 1)
        for (int k = 0; k < m; k++) {
            if ((n[k] > SB_PAR_MIN) != large) continue;
            memset(stats + 4 * k, 0, 4 * sizeof(double));
            int a = chosen[k];
            if (a < 0) continue;
            sb_i64 t = member[k];
            unsigned char *payload = buffer + offsets[k];
            sb_i64 body_bytes = offsets[k + 1] - offsets[k] - SB_HEADER_BYTES;
            memcpy(payload, headers + ((size_t)t * nact + a) * SB_HEADER_BYTES, SB_HEADER_BYTES);
            unsigned char *body = payload + SB_HEADER_BYTES, *scratch = NULL;
            if ((uintptr_t)body % 16) {
                scratch = (unsigned char *)aligned_alloc(16, (size_t)((body_bytes + 16) / 16 * 16));
                if (!scratch) {
#pragma omp atomic write
                    fail = 1;
                    continue;
                }
            }
            int rc = sb_quantize_pack_ef((const float *)(intptr_t)g[k], (float *)(intptr_t)e[k],
                                         scratch ? scratch : body, sent[k] ? (float *)(intptr_t)sent[k] : NULL, n[k],
                                         bucket, kinds[a], levels[a], stochastic[a], topks[a], trits[a], keys[k],
                                         stats + 4 * k, large ? nthreads : 1);
            if (scratch) {
                memcpy(body, scratch, (size_t)body_bytes);
                free(scratch);
            }
            if (rc) {
#pragma omp atomic write
                fail = 1;
            }
        }
    }
    return fail ? -1 : 0;
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
    for (int large = 0; large < 2; large++) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (!large && m > 1)
        for (int k = 0; k < m; k++) {
            if ((n[k] > SB_PAR_MIN) != large) continue;
            float *out = (float *)(intptr_t)outs[k];
            int added = 0, last = own[k] == ranks - 1 ? ranks - 2 : ranks - 1;
            for (int r = 0; r < ranks; r++) {
                if (r == own[k]) continue;
                sb_i64 slot = (sb_i64)k * ranks + r;
                int a = actions[slot];
                const unsigned char *body = (const unsigned char *)(intptr_t)bodies[slot];
                unsigned char *scratch = NULL;
                if ((uintptr_t)body % 16) {
                    scratch = (unsigned char *)aligned_alloc(16, (size_t)((body_bytes[slot] + 16) / 16 * 16));
                    if (!scratch) {
#pragma omp atomic write
                        fail = 1;
                        break;
                    }
                    memcpy(scratch, body, (size_t)body_bytes[slot]);
                    body = scratch;
                }
                int accumulate = own[k] >= 0 || r > 0;
                int rc = sb_decode(body, out, n[k], bucket, kinds[a], levels[a], topks[a], trits[a], accumulate,
                                   accumulate && r == last ? divisor : 1.0f, large ? nthreads : 1);
                free(scratch);
                if (rc == -1) {
#pragma omp atomic write
                    fail = 1;
                    break;
                }
                if (rc <= -2) {
#pragma omp critical(sb_decode_group_bad)
                    if (bad < 0 || slot < bad) bad = slot;
                    break;
                }
                added += accumulate;
            }
            if (!added && divisor != 1.0f)
                for (sb_i64 i = 0; i < n[k]; i++) out[i] = out[i] / divisor;
        }
    }
    if (fail) return -1;
    return bad >= 0 ? (int)(-2 - bad) : 0;
}
