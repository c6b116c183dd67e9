/* The convex-hull greedy of allocator.py, compiled: the production path of allocator.allocate().
 *
 * allocator.py states the algorithm and holds a NumPy version of it (the fallback without a C compiler, and the
 * test oracle for this file). Both use the same float64 operations in the same order and the same tie-breaking,
 * so they return the same choice bit for bit; tests hold them equal on random instances full of ties.
 *
 *   1. choice = cheapest admissible action (ties: smaller error, then lower index); infeasible if over budget.
 *   2. Per tensor, gift-wrap the lower convex hull upward from choice: the next point is the steepest one
 *      (most error saved per extra bit; ties: the costliest, then the lower index). Edge slopes are clamped to
 *      fall strictly along a chain, so ordering edges by slope keeps each chain in order.
 *   3. Take edges in order of (slope descending, position along the chain, tensor index) while they fit; an
 *      edge that does not fit blocks the rest of its tensor's chain. The order is a stable radix sort of the
 *      edges by slope (listed by chain position, then tensor), linear in the number of edges.
 *
 * Inadmissible actions have err = +inf. Errors are finite or +inf and >= 0 (the caller checks).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef unsigned long long sb_u64;

/* Sort key of a slope: unsigned integers in the order of the doubles, descending (a larger slope, a smaller key).
 * Slopes are never NaN; -0.0 and +0.0 compare equal, as in NumPy's sort. */
static sb_u64 sb_descending_key(double x) {
    sb_u64 bits;
    if (x == 0.0) x = 0.0;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits >> 63) ? ~bits : bits | 0x8000000000000000ULL;   /* ascending in x */
    return ~bits;
}

/* Stable LSD radix sort of idx by key, 8 bits a pass; a pass whose digit is the same for all keys is skipped. */
static void sb_radix_sort(sb_u64 *key, int *idx, sb_u64 *key_tmp, int *idx_tmp, sb_i64 n) {
    if (n == 0) return;
    for (int shift = 0; shift < 64; shift += 8) {
        sb_i64 count[257] = {0};
        for (sb_i64 i = 0; i < n; i++) count[((key[i] >> shift) & 0xFF) + 1]++;
        if (count[((key[0] >> shift) & 0xFF) + 1] == n) continue;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (sb_i64 i = 0; i < n; i++) {
            sb_i64 at = count[(key[i] >> shift) & 0xFF]++;
            key_tmp[at] = key[i];
            idx_tmp[at] = idx[i];
        }
        memcpy(key, key_tmp, sizeof(sb_u64) * (size_t)n);
        memcpy(idx, idx_tmp, sizeof(int) * (size_t)n);
    }
}

/* costs, err: (tensors, actions) row-major. budget: the budget in bits, an integer (the caller floors it).
 * Writes choice and *min_cost_bits (the cost of the cheapest admissible configuration); returns 0 (feasible),
 * 1 (infeasible: choice is that cheapest configuration), -1 (out of memory, or over 2^30 edges) or -2 (a tensor with no admissible
 * action). */
int sb_allocate(const sb_i64 *costs, const double *err, sb_i64 tensors, int actions, sb_i64 budget,
                sb_i64 *choice, sb_i64 *min_cost_bits) {
    sb_i64 min_cost = 0;
    for (sb_i64 t = 0; t < tensors; t++) {
        const sb_i64 *c = costs + t * actions;
        const double *e = err + t * actions;
        int best = -1;
        for (int a = 0; a < actions; a++) {
            if (!isfinite(e[a])) continue;
            if (best < 0 || c[a] < c[best] || (c[a] == c[best] && e[a] < e[best])) best = a;
        }
        if (best < 0) return -2;
        choice[t] = best;
        min_cost += c[best];
    }
    *min_cost_bits = min_cost;
    if (min_cost > budget) return 1;

    int max_edges = actions > 1 ? actions - 1 : 1;   /* costs rise strictly along a chain */
    sb_i64 cap = tensors * max_edges;
    if (cap > 1073741823) return -1;                 /* edge indices are ints */
    double *slope = malloc(sizeof(double) * (size_t)cap);
    int *to = malloc(sizeof(int) * (size_t)cap);
    int *edges = malloc(sizeof(int) * (size_t)tensors);
    int *taken = calloc((size_t)tensors, sizeof(int));       /* edges taken per tensor; -1: blocked */
    sb_u64 *key = malloc(sizeof(sb_u64) * (size_t)cap * 2);
    int *order = malloc(sizeof(int) * (size_t)cap * 2);
    if (!slope || !to || !edges || !taken || !key || !order) {
        free(slope); free(to); free(edges); free(taken); free(key); free(order);
        return -1;
    }

    int longest = 0;
    int *by_cost = malloc(sizeof(int) * (size_t)actions);   /* one tensor's admissible actions, (cost, index) */
    if (!by_cost) {
        free(slope); free(to); free(edges); free(taken); free(key); free(order);
        return -1;
    }
    for (sb_i64 t = 0; t < tensors; t++) {
        const sb_i64 *c = costs + t * actions;
        const double *e = err + t * actions;
        int m = 0;
        for (int a = 0; a < actions; a++) {           /* insertion sort, stable: equal costs keep index order */
            if (!isfinite(e[a])) continue;
            int j = m++;
            for (; j > 0 && c[by_cost[j - 1]] > c[a]; j--) by_cost[j] = by_cost[j - 1];
            by_cost[j] = a;
        }
        int cur = (int)choice[t], k = 0, pos = 0;
        double prev = INFINITY;
        for (;;) {
            while (pos < m && c[by_cost[pos]] <= c[cur]) pos++;    /* candidates: dearer than cur */
            int best = -1;
            double best_slope = 0.0;
            for (int j = pos; j < m; j++) {
                int a = by_cost[j];
                if (!(e[a] < e[cur])) continue;
                double s = (e[cur] - e[a]) / ((double)c[a] - (double)c[cur]);
                /* steepest; among equal slopes the costliest; among equal costs the lower index (met first) */
                if (best < 0 || s > best_slope || (s == best_slope && c[a] > c[best])) {
                    best = a;
                    best_slope = s;
                }
            }
            if (best < 0) break;
            prev = fmin(best_slope, nextafter(prev, -INFINITY));
            slope[t * max_edges + k] = prev;
            to[t * max_edges + k] = best;
            k++;
            cur = best;
        }
        edges[t] = k;
        if (k > longest) longest = k;
    }
    free(by_cost);

    /* Edges listed position-major, tensor-minor; a stable sort by slope then orders ties by (position, tensor). */
    sb_i64 n = 0;
    for (int k = 0; k < longest; k++)
        for (sb_i64 t = 0; t < tensors; t++)
            if (k < edges[t]) {
                key[n] = sb_descending_key(slope[t * max_edges + k]);
                order[n++] = (int)(t * max_edges + k);
            }
    sb_radix_sort(key, order, key + cap, order + cap, n);

    sb_i64 remaining = budget - min_cost;
    for (sb_i64 i = 0; i < n; i++) {
        sb_i64 t = order[i] / max_edges;
        int k = order[i] % max_edges;
        if (taken[t] != k) continue;                 /* blocked, or an earlier edge of the chain was not taken */
        int dest = to[order[i]];
        sb_i64 dcost = costs[t * actions + dest] - costs[t * actions + choice[t]];
        if (dcost <= remaining) {
            remaining -= dcost;
            choice[t] = dest;
            taken[t] = k + 1;
        } else {
            taken[t] = -1;      /* blocked: this edge no longer fits, and none after it may be taken */
        }
    }
    free(slope); free(to); free(edges); free(taken); free(key); free(order);
    return 0;
}
