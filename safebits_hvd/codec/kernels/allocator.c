/* The convex-hull greedy of allocator.py, compiled: the production path of allocator.allocate().
 *
 * allocator.py states the algorithm and holds a NumPy version of it (the fallback without a C compiler, and the
 * test oracle for this file). Both use the same float64 operations and the same tie-breaking, so they return the
 * same choice bit for bit; tests hold them equal on random instances full of ties.
 *
 *   1. choice = cheapest admissible action (ties: smaller error, then lower index); infeasible if over budget.
 *   2. Per tensor, gift-wrap the lower convex hull upward from choice: the next point is the steepest one
 *      (most error saved per extra bit; ties: the costliest, then the lower index). Edge slopes are clamped to
 *      fall strictly along a chain, so ordering edges by slope keeps each chain in order.
 *   3. Take edges in order of (slope descending, position along the chain, tensor index) while they fit; an
 *      edge that does not fit blocks the rest of its tensor's chain.
 *
 * Step 3 without sorting every edge: the greedy takes the longest prefix of that order that fits the budget, then
 * goes on through the rest taking what still fits. The prefix is found by weighted quickselect (linear time); of
 * the rest, only edges that could still fit (extra bits <= what is left, tensor not blocked) are sorted, usually
 * a few. Inadmissible actions have err = +inf.
 */
#include <math.h>
#include <string.h>

typedef unsigned long long sb_u64;

enum {
    SB_ALLOC_FEASIBLE = 0,
    SB_ALLOC_INFEASIBLE = 1,
    SB_ALLOC_TOO_LARGE = -1,         /* over 2^30 edges: positions are ints */
    SB_ALLOC_NO_ADMISSIBLE = -2,     /* a tensor whose errors are all +inf */
    SB_ALLOC_BAD_COST = -3,          /* a cost below 0 or at least 2^53 (float64 slopes need exact costs) */
    SB_ALLOC_BAD_ERROR = -4,         /* an error that is NaN or negative */
    SB_ALLOC_COSTS_OVERFLOW = -5,    /* the tensors' largest costs add up to 2^62 bits or more */
};

#define SB_COST_LIMIT (1LL << 53)
#define SB_TOTAL_LIMIT (1LL << 62)

/* Sort key of a slope: unsigned integers in the order of the doubles, descending (a larger slope, a smaller key).
 * Slopes are never NaN; -0.0 and +0.0 compare equal, as in NumPy's sort. */
static sb_u64 sb_descending_key(double x) {
    sb_u64 bits;
    if (x == 0.0) x = 0.0;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits >> 63) ? ~bits : bits | 0x8000000000000000ULL;   /* ascending in x */
    return ~bits;
}

/* nextafter(x, -inf) for x not NaN, inlined (it runs once per hull edge). */
static double sb_next_down(double x) {
    if (x == INFINITY) return 1.7976931348623157e308;
    if (x == -INFINITY) return x;
    if (x == 0.0) return -4.9406564584124654e-324;
    sb_u64 bits;
    memcpy(&bits, &x, sizeof bits);
    bits = x > 0.0 ? bits - 1 : bits + 1;
    memcpy(&x, &bits, sizeof x);
    return x;
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

/* Sorts the listed edges marked in maybe[0, n) into cand[0, m) in greedy order (key, then listing position: they
 * are gathered in listing order and the radix sort is stable); returns m. */
static sb_i64 sb_sort_marked(const unsigned char *maybe, const sb_u64 *key, sb_i64 n, sb_u64 *cand_key, int *cand,
                             sb_u64 *tmp_key, int *tmp_cand) {
    sb_i64 m = 0;
    for (sb_i64 p = 0; p < n; p++)
        if (maybe[p]) {
            cand_key[m] = key[p];
            cand[m++] = (int)p;
        }
    sb_radix_sort(cand_key, cand, tmp_key, tmp_cand, m);
    return m;
}

/* Greedy order of two edges given by listing position: key, then position (the listing is chain position-major,
 * tensor-minor, so equal slopes go by position along the chain, then tensor). */
static int sb_before(const sb_u64 *key, int a, int b) { return key[a] < key[b] || (key[a] == key[b] && a < b); }

static void sb_swap(int *perm, sb_i64 i, sb_i64 j) {
    int t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
}

/* Partitions perm[lo, hi) around a median-of-three pivot; returns the pivot's final index. */
static sb_i64 sb_partition(const sb_u64 *key, int *perm, sb_i64 lo, sb_i64 hi) {
    sb_i64 mid = lo + (hi - lo) / 2, last = hi - 1;
    if (sb_before(key, perm[mid], perm[lo])) sb_swap(perm, mid, lo);
    if (sb_before(key, perm[last], perm[lo])) sb_swap(perm, last, lo);
    if (sb_before(key, perm[mid], perm[last])) sb_swap(perm, mid, last);   /* the median now sits at last */
    int pivot = perm[last];
    sb_i64 store = lo;
    for (sb_i64 i = lo; i < last; i++)
        if (sb_before(key, perm[i], pivot)) sb_swap(perm, i, store++);
    sb_swap(perm, store, last);
    return store;
}

static sb_i64 sb_edge_capacity(sb_i64 tensors, int actions) { return tensors * (actions > 1 ? actions - 1 : 1); }

/* Bytes of the workspace sb_allocate needs (the caller keeps one, so no step allocates or faults in memory). */
sb_i64 sb_allocate_workspace_bytes(sb_i64 tensors, int actions) {
    sb_i64 cap = sb_edge_capacity(tensors, actions);
    return cap * (5 * (sb_i64)sizeof(sb_u64) + 5 * (sb_i64)sizeof(int) + 1)
           + 2 * tensors * (sb_i64)sizeof(int) + actions * (sb_i64)sizeof(int);
}

/* costs, err: (tensors, actions) row-major. budget: the budget in bits, an integer (the caller floors it).
 * work: sb_allocate_workspace_bytes(tensors, actions) bytes, 8-byte aligned.
 * Writes choice and *min_cost_bits (the cost of the cheapest admissible configuration); returns an SB_ALLOC_ code
 * (on SB_ALLOC_INFEASIBLE, choice is that cheapest configuration). */
int sb_allocate(const sb_i64 *costs, const double *err, sb_i64 tensors, int actions, sb_i64 budget,
                sb_i64 *choice, sb_i64 *min_cost_bits, void *work) {
    sb_i64 min_cost = 0, max_total = 0;
    for (sb_i64 t = 0; t < tensors; t++) {
        const sb_i64 *c = costs + t * actions;
        const double *e = err + t * actions;
        int best = -1;
        sb_i64 dearest = 0;
        for (int a = 0; a < actions; a++) {
            if (c[a] < 0 || c[a] >= SB_COST_LIMIT) return SB_ALLOC_BAD_COST;
            if (c[a] > dearest) dearest = c[a];
            if (e[a] == INFINITY) continue;
            if (!(e[a] >= 0.0)) return SB_ALLOC_BAD_ERROR;
            if (best < 0 || c[a] < c[best] || (c[a] == c[best] && e[a] < e[best])) best = a;
        }
        if (best < 0) return SB_ALLOC_NO_ADMISSIBLE;
        max_total += dearest;                        /* < 2^62 + 2^53: no overflow before the test */
        if (max_total >= SB_TOTAL_LIMIT) return SB_ALLOC_COSTS_OVERFLOW;
        choice[t] = best;
        min_cost += c[best];
    }
    *min_cost_bits = min_cost;
    if (min_cost > budget) return SB_ALLOC_INFEASIBLE;

    int max_edges = actions > 1 ? actions - 1 : 1;   /* costs rise strictly along a chain */
    sb_i64 cap = sb_edge_capacity(tensors, actions);
    if (cap > 1073741823) return SB_ALLOC_TOO_LARGE;
    /* Per hull edge (index t * max_edges + k): slope, destination. Per listed edge (position): key, extra bits,
     * hull edge. Then the sort's buffers, per tensor the chain length and the edges taken (-1: blocked). */
    double *slope = (double *)work;
    sb_u64 *key = (sb_u64 *)(slope + cap);
    sb_i64 *dcost = (sb_i64 *)(key + cap);
    sb_u64 *cand_key = (sb_u64 *)(dcost + cap), *tmp_key = cand_key + cap;
    int *to = (int *)(tmp_key + cap), *edge_of = to + cap, *perm = edge_of + cap, *cand = perm + cap;
    int *tmp_cand = cand + cap, *edges = tmp_cand + cap, *taken = edges + tensors, *by_cost = taken + tensors;
    unsigned char *maybe = (unsigned char *)(by_cost + actions);

    int longest = 0;
    for (sb_i64 t = 0; t < tensors; t++) {
        const sb_i64 *c = costs + t * actions;
        const double *e = err + t * actions;
        int m = 0;
        for (int a = 0; a < actions; a++) {           /* insertion sort, stable: equal costs keep index order */
            if (e[a] == INFINITY) continue;
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
            double down = sb_next_down(prev);
            prev = best_slope < down ? best_slope : down;
            slope[t * max_edges + k] = prev;
            to[t * max_edges + k] = best;
            k++;
            cur = best;
        }
        edges[t] = k;
        taken[t] = 0;
        if (k > longest) longest = k;
    }

    sb_i64 n = 0;
    for (int k = 0; k < longest; k++)
        for (sb_i64 t = 0; t < tensors; t++)
            if (k < edges[t]) {
                int edge = (int)(t * max_edges + k), from = k ? to[edge - 1] : (int)choice[t];
                key[n] = sb_descending_key(slope[edge]);
                dcost[n] = costs[t * actions + to[edge]] - costs[t * actions + from];
                edge_of[n] = edge;
                perm[n] = (int)n;
                n++;
            }

    /* The longest prefix that fits: perm[0, lo) once the selection stops; perm[lo] is the first edge that does not
     * fit (if cut). Invariant: perm[0, lo) precede perm[lo, hi), which precede perm[hi, n). */
    sb_i64 remaining = budget - min_cost, lo = 0, hi = n, rounds = 0, round_limit = 8;
    for (sb_i64 k = n; k > 1; k >>= 1) round_limit += 2;
    int cut = 0;
    while (lo < hi) {
        if (++rounds > round_limit) {    /* unlucky pivots: sort what is left and scan it (bounds the time) */
            memset(maybe, 0, (size_t)n);
            for (sb_i64 i = lo; i < hi; i++) maybe[perm[i]] = 1;
            sb_i64 m = sb_sort_marked(maybe, key, n, cand_key, cand, tmp_key, tmp_cand);
            memcpy(perm + lo, cand, sizeof(int) * (size_t)m);
            for (; lo < hi; lo++) {
                if (dcost[perm[lo]] > remaining) {
                    cut = 1;
                    break;
                }
                remaining -= dcost[perm[lo]];
            }
            break;
        }
        sb_i64 mid = sb_partition(key, perm, lo, hi), left = 0;
        for (sb_i64 i = lo; i < mid; i++) left += dcost[perm[i]];
        if (left > remaining) {
            hi = mid;
        } else if (left + dcost[perm[mid]] > remaining) {
            remaining -= left;
            lo = mid;
            cut = 1;
            break;
        } else {
            remaining -= left + dcost[perm[mid]];
            lo = mid + 1;
        }
    }
    for (sb_i64 i = 0; i < lo; i++) {                /* a tensor's prefix edges are the start of its chain */
        int edge = edge_of[perm[i]], k = edge % max_edges + 1;
        sb_i64 t = edge / max_edges;
        if (taken[t] < k) taken[t] = k;
    }
    for (sb_i64 t = 0; t < tensors; t++)
        if (taken[t] > 0) choice[t] = to[t * max_edges + taken[t] - 1];
    if (!cut) return SB_ALLOC_FEASIBLE;

    taken[edge_of[perm[lo]] / max_edges] = -1;       /* the first edge that does not fit blocks its chain */
    memset(maybe, 0, (size_t)n);
    for (sb_i64 i = lo + 1; i < n; i++) {
        int p = perm[i];
        if (taken[edge_of[p] / max_edges] >= 0 && dcost[p] <= remaining) maybe[p] = 1;
    }
    sb_i64 m = sb_sort_marked(maybe, key, n, cand_key, cand, tmp_key, tmp_cand);
    for (sb_i64 j = 0; j < m; j++) {
        int p = cand[j], edge = edge_of[p], k = edge % max_edges;
        sb_i64 t = edge / max_edges;
        if (taken[t] != k) continue;                 /* blocked, or an earlier edge of the chain was not taken */
        if (dcost[p] <= remaining) {
            remaining -= dcost[p];
            choice[t] = to[edge];
            taken[t] = k + 1;
        } else {
            taken[t] = -1;      /* blocked: this edge no longer fits, and none after it may be taken */
        }
    }
    return SB_ALLOC_FEASIBLE;
}
