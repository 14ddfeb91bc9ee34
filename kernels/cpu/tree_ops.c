/* The decode round's index bookkeeping on the CPU: greedy verification, the draft tree's node arrays, prompt
 * lookup, the lookup branch's graft, and the accepted path's K/V compaction. Integers, booleans and copies, so
 * each result is exactly its PyTorch reference's (kernels/verify.py verify_greedy_reference, runtime/tree.py
 * build_tree, runtime/ngram.py ngram_lookup and graft_chain, kernels/kv_compact.py kv_compact_reference, where
 * the math is stated) on the inputs the decoder passes; the references stay the specification and run while a
 * round is traced, on CUDA, and under cpu_linear="torch". Inputs the decoder never passes and the reference
 * rejects (an index out of range) raise in the C++ wrappers (kernels/cpu/linear_op.cpp) before any write.
 *
 * Why: each reference is fixed-shape tensor work (no host sync, so CUDA graphs and compiled rounds take
 * it), which on a CPU is 30-130 small PyTorch ops: on the demo pair, an eager default round spent 0.64 ms
 * in greedy verification, 0.30 in the graft, 0.25 in the lookup, 0.21 building the tree and 0.14 moving
 * the K/V, 16 % of a 9.7 ms round (2026-12-04). One call each costs microseconds.
 *
 * Index tensors are contiguous int64 (hist: unit stride along a row), masks one byte per bool.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx2.h" /* AVX2 + FMA CPUs: the AVX-512 intrinsics of argmax_row, emulated lane for lane */

/* tokens, parents, argmax [B, N]; nodes, emitted [B, W] (W = max_depth + 1); num [B]. Per row: from the root,
 * at each depth the lowest-numbered child whose token is the target's argmax at the current node; stop at the
 * first depth without one; then the bonus token (the argmax at the last accepted node) after the accepted
 * tokens. Unused entries are -1. */
void tritonspec_verify_greedy(const int64_t* tokens, const int64_t* parents, const int64_t* argmax, int64_t B,
                              int64_t N, int64_t max_depth, int64_t* nodes, int64_t* num, int64_t* emitted) {
    const int64_t W = max_depth + 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *tok = tokens + b * N, *par = parents + b * N, *am = argmax + b * N;
        int64_t *nd = nodes + b * W, *em = emitted + b * W;
        for (int64_t i = 0; i < W; i++) nd[i] = em[i] = -1;
        nd[0] = 0;
        int64_t cur = 0, n = 0;
        for (int64_t depth = 1; depth <= max_depth; depth++) {
            const int64_t want = am[cur];
            int64_t first = -1;
            for (int64_t j = 1; j < N; j++)
                if (par[j] >= 0 && par[j] == cur && tok[j] == want) {
                    first = j;
                    break;
                }
            if (first < 0) break; /* a row that missed stays stopped: the rest stays -1 */
            cur = first;
            nd[depth] = first;
            em[depth - 1] = tok[first];
            n++;
        }
        em[n] = am[cur];
        num[b] = n;
    }
}

/* keep [B, K1] (kept candidate ids, K1 = N - 1), cand_parent [B, C], cand_depth [C] -> parents, depth [B, N],
 * mask [B, N, N] (bytes): node i + 1 is candidate keep[i]; its parent is the node of its parent candidate
 * (the root, 0, for a level-1 candidate; -1 when that candidate was not kept); mask[i, j] = node j is node i
 * or one of its first max_depth ancestors. node_of: scratch of C int64. */
void tritonspec_build_tree(const int64_t* keep, const int64_t* cand_parent, const int64_t* cand_depth, int64_t B,
                           int64_t K1, int64_t C, int64_t max_depth, int64_t* parents, int64_t* depth, uint8_t* mask,
                           int64_t* node_of) {
    const int64_t N = K1 + 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *kp = keep + b * K1, *cp = cand_parent + b * C;
        int64_t *par = parents + b * N, *dep = depth + b * N;
        uint8_t* m = mask + b * N * N;
        for (int64_t c = 0; c < C; c++) node_of[c] = -1;
        for (int64_t i = 0; i < K1; i++) node_of[kp[i]] = i + 1;
        par[0] = -1;
        dep[0] = 0;
        for (int64_t i = 0; i < K1; i++) {
            const int64_t pc = cp[kp[i]];
            par[i + 1] = pc >= 0 ? node_of[pc] : 0;
            dep[i + 1] = cand_depth[kp[i]];
        }
        memset(m, 0, (size_t)(N * N));
        for (int64_t i = 0; i < N; i++) {
            int64_t a = i;
            for (int64_t s = 0; s <= max_depth && a >= 0; s++) {
                m[i * N + a] = 1;
                a = par[a];
            }
        }
    }
}

/* hist [B, S] at row stride sh (tokens by position, the root at L[b]) -> chain [B, M], valid [B, M] (bytes):
 * for the latest position q < L whose last run (<= n_max) tokens equal the sequence's last ones, run >=
 * n_min, preferring the longest run, then a continuation known in full (q + M <= L), then the latest q; the
 * chain is hist[q + 1 .. q + M] (valid while <= L). No such q: nothing valid, every chain entry the last
 * position's token (the reference's clamped gather). */
void tritonspec_ngram_lookup(const int64_t* hist, int64_t sh, const int64_t* L, int64_t B, int64_t S, int64_t M,
                             int64_t n_max, int64_t n_min, int64_t* chain, uint8_t* valid) {
    for (int64_t b = 0; b < B; b++) {
        const int64_t* h = hist + b * sh;
        const int64_t l = L[b];
        int64_t best = -1;
        for (int64_t q = 0; q < S && q < l; q++) {
            int64_t run = 0; /* tokens ending at q equal to those ending at l, compared back to front; as in the */
            for (; run < n_max; run++) { /* reference, -1 before the sequence at q and -2 before it at l */
                const int64_t a = q - run >= 0 ? h[q - run] : -1, c = l - run >= 0 ? h[l - run] : -2;
                if (a != c) break;
            }
            if (run < n_min) continue;
            const int64_t score = run * (4 * S) + (q + M <= l) * (2 * S) + q;
            if (score > best) best = score;
        }
        const int64_t start = (best >= 0 ? best % S : S - 1) + 1;
        for (int64_t m = 0; m < M; m++) {
            const int64_t pos = start + m;
            chain[b * M + m] = h[pos < S - 1 ? pos : S - 1];
            valid[b * M + m] = best >= 0 && pos <= l;
        }
    }
}

/* tokens, parents, depth [B, N]; mask [B, N, N] (bytes); chain [B, M], valid [B, M] (bytes) -> the tree with the
 * chain grafted below the root, T = N + M nodes: tok, par, dep [B, T], out [B, T, T] (bytes), added [B]
 * (runtime/ngram.py graft_chain): the deepest node whose ancestors-or-self all hold the chain's tokens at their
 * depths (k of them below the root) is followed by the valid chain's remaining tokens as nodes N, N + 1, ...;
 * the other nodes N + r are padding (parent -1, the root's token, depth 1, seeing the root and themselves). */
void tritonspec_graft_chain(const int64_t* tokens, const int64_t* parents, const int64_t* depth, const uint8_t* mask,
                            const int64_t* chain, const uint8_t* valid, int64_t B, int64_t N, int64_t M, int64_t* tok,
                            int64_t* par, int64_t* dep, uint8_t* out, int64_t* added, uint8_t* on) {
    const int64_t T = N + M;
    for (int64_t b = 0; b < B; b++) {
        const int64_t *tk = tokens + b * N, *pa = parents + b * N, *de = depth + b * N, *ch = chain + b * M;
        const uint8_t *mk = mask + b * N * N, *va = valid + b * M;
        int64_t nvalid = 0;
        for (int64_t r = 0; r < M; r++) nvalid += va[r] != 0;
        for (int64_t i = 0; i < N; i++) {
            const int64_t d = (de[i] < 1 ? 1 : de[i] > M ? M : de[i]) - 1;
            on[i] = i == 0 || (tk[i] == ch[d] && va[d] && de[i] <= M && pa[i] >= 0);
        }
        int64_t k = -1, a = N; /* the deepest node on the chain's path (lowest id among equals) */
        for (int64_t i = 0; i < N; i++) {
            if (!(pa[i] >= 0 || i == 0)) continue;
            int path = 1;
            for (int64_t j = 0; j < N && path; j++) path = !(mk[i * N + j] && !on[j]);
            if (path && de[i] > k) k = de[i], a = i;
        }
        if (k < 0) a = 0; /* no node on the path: the reference's lowest node scoring -1 */
        const int64_t add = nvalid - k;
        added[b] = add;
        int64_t *to = tok + b * T, *po = par + b * T, *dout = dep + b * T;
        uint8_t* o = out + b * T * T;
        memcpy(to, tk, (size_t)N * sizeof(int64_t));
        memcpy(po, pa, (size_t)N * sizeof(int64_t));
        memcpy(dout, de, (size_t)N * sizeof(int64_t));
        memset(o, 0, (size_t)(T * T));
        for (int64_t i = 0; i < N; i++) memcpy(o + i * T, mk + i * N, (size_t)N);
        for (int64_t r = 0; r < M; r++) {
            uint8_t* row = o + (N + r) * T;
            if (r < add) {
                int64_t g = k + r;
                g = g < 0 ? 0 : g > M - 1 ? M - 1 : g;
                to[N + r] = ch[g];
                po[N + r] = r == 0 ? a : N + r - 1;
                dout[N + r] = k + r + 1;
                if (a < N) memcpy(row, mk + a * N, (size_t)N);
                for (int64_t c = N; c <= N + r; c++) row[c] = 1;
            } else {
                to[N + r] = tk[0];
                po[N + r] = -1;
                dout[N + r] = 1;
                row[0] = 1;
                row[N + r] = 1;
            }
        }
    }
}

/* cache [L, B_max, S, ...] at strides (sl, sb, ss) in bytes-per-element units of elem, each slot row_bytes of
 * contiguous bytes; start [B]; nodes [B, W] (the accepted path, -1 = none) -> in place, for every layer: slot
 * start + j takes what slot start + nodes[j] held (all of a row's path read before any write, through tmp of
 * W * row_bytes). Returns the number of (row, j) whose source or destination lies outside [0, S) (then
 * nothing is written). */
int64_t tritonspec_kv_compact(char* cache, int64_t sl, int64_t sb, int64_t ss, int64_t L, int64_t B, int64_t S,
                              const int64_t* start, const int64_t* nodes, int64_t W, int64_t row_bytes, int64_t elem,
                              char* tmp) {
    int64_t bad = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < W; j++) {
            const int64_t nd = nodes[b * W + j];
            if (nd >= 0) bad += start[b] + nd < 0 || start[b] + nd >= S || start[b] + j < 0 || start[b] + j >= S;
        }
    if (bad) return bad;
    for (int64_t l = 0; l < L; l++)
        for (int64_t b = 0; b < B; b++) {
            char* row = cache + (l * sl + b * sb) * elem;
            const int64_t* nd = nodes + b * W;
            int64_t n = 0;
            for (int64_t j = 0; j < W; j++)
                if (nd[j] >= 0 && nd[j] != j) memcpy(tmp + (n++) * row_bytes, row + (start[b] + nd[j]) * ss * elem, (size_t)row_bytes);
            n = 0;
            for (int64_t j = 0; j < W; j++)
                if (nd[j] >= 0 && nd[j] != j) memcpy(row + (start[b] + j) * ss * elem, tmp + (n++) * row_bytes, (size_t)row_bytes);
        }
    return 0;
}

/* runtime/sampling.py RowRandom.draw's hashes: h[b, j] = mix32(mix32((idx_j + base_b) mod 2^32) ^ key_b), base_b =
 * mix32(key_b ^ mix32(counter_b mod 2^32)), idx_j = j for j < n (the coins), 2^31 + j - n after (the noise); mix32 is
 * Wellons' lowbias32 on 32-bit words (the reference's int64 arithmetic mod 2^32). h: [B, n + vocab]. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    return x ^ (x >> 16);
}

void tritonspec_row_hash(const int64_t* key, const int64_t* counter, int64_t B, int64_t n, int64_t vocab, int64_t* h) {
    for (int64_t b = 0; b < B; b++) {
        const uint32_t k = (uint32_t)key[b], base = mix32(k ^ mix32((uint32_t)counter[b]));
        int64_t* row = h + b * (n + vocab);
        for (int64_t j = 0; j < n; j++) row[j] = mix32(mix32((uint32_t)j + base) ^ k);
        for (int64_t j = 0; j < vocab; j++) row[n + j] = mix32(mix32((uint32_t)j + 0x80000000u + base) ^ k);
    }
}

/* kernels/verify_chain.py verify_chain_reference: a sampled chain's lossless verification. tokens [B, N] (node 0 the
 * root), probs [B, N, V] (p), q [B, N - 1, V], u [B, N], xi [B, V]; nodes, emitted [B, N], num [B]. Depth i's draft
 * x is accepted while every shallower one was, q(x) > 0 and u_i * q(x) <= p(x) in float64 (exact: a product of two
 * float32 values); then the bonus is the first maximal index of r / xi (float32 division), r = max(p - q, 0) at
 * the last accepted node after a rejection (p when every draft was accepted), or p when r is all zero. NaN as
 * the reference: clamp keeps it, a NaN residual falls back to p (its amax is NaN), argmax takes the first NaN. */
void tritonspec_verify_chain(const int64_t* tokens, const float* probs, const float* q, const float* u, const float* xi,
                             int64_t B, int64_t N, int64_t V, int64_t* nodes, int64_t* num, int64_t* emitted) {
    const int64_t n = N - 1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t* tok = tokens + b * N;
        const float *pb = probs + b * N * V, *qb = q + b * n * V, *ub = u + b * N, *xb = xi + b * V;
        int64_t *nd = nodes + b * N, *em = emitted + b * N;
        for (int64_t i = 0; i < N; i++) em[i] = -1;
        int64_t cnt = 0;
        for (int64_t i = 1; i <= n; i++) {
            const int64_t x = tok[i];
            const double p = (double)pb[(i - 1) * V + x], qq = (double)qb[(i - 1) * V + x];
            if (!(qq > 0 && (double)ub[i] * qq <= p)) break; /* the rest stays rejected: -1 */
            em[i - 1] = x;
            cnt++;
        }
        for (int64_t i = 0; i < N; i++) nd[i] = i <= cnt ? i : -1;
        const float* p_at = pb + cnt * V;
        const float* q_at = cnt < n ? qb + cnt * V : NULL; /* rejected: the residual against q at that depth */
        int residual = 0; /* the reference's amax(max(p - q, 0)) > 0: some p - q > 0 and none NaN (a NaN amax is not) */
        if (q_at) {
            int nan = 0;
            for (int64_t v = 0; v < V; v++) {
                const float d = p_at[v] - q_at[v];
                if (d != d) nan = 1;
                else if (d > 0.0f) residual = 1;
            }
            residual &= !nan;
        }
        int64_t best_v = 0;
        float best = -INFINITY;
        for (int64_t v = 0; v < V; v++) {
            float r = p_at[v];
            if (residual) {
                const float d = p_at[v] - q_at[v];
                r = d < 0.0f ? 0.0f : d;
            }
            const float s = r / xb[v];
            if (s != s) {
                best_v = v; /* argmax: the first NaN */
                break;
            }
            if (s > best) {
                best = s;
                best_v = v;
            }
        }
        em[cnt] = best_v;
        num[b] = cnt;
    }
}

/* x [R, V] float32 or bfloat16 (bf16 != 0), rows ld elements apart; out [R]: per row the lowest index of its
 * maximum, a NaN counting above every number (then the lowest-index NaN): torch.argmax(x, -1) exactly, the
 * verify's greedy token per node. Two passes over a row: its maximum and whether it holds a NaN, 16 lanes at
 * a time (a bfloat16 widened exactly), then the first index equal to it (-0.0 == +0.0, as torch's comparison
 * has it: the first of either). Threads split the rows. ATen's argmax ran one thread at ~1.7 ns an element
 * (SmolLM2's 49,152-token head, 14 rows: 1.2 ms, 8 % of a bfloat16 plain step on an Intel Xeon). */
static inline float argmax_at(const void* x, int bf16, int64_t i) {
    if (!bf16) return ((const float*)x)[i];
    const uint32_t u = (uint32_t)((const uint16_t*)x)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int64_t argmax_row(const void* x, int bf16, int64_t V) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int nan = 0;
    int64_t i = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i))), 16))
                              : _mm512_loadu_ps((const float*)x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        m = _mm512_max_ps(m, v); /* a NaN lane: replaced by the next value (max returns its second operand) */
    }
    float best = _mm512_reduce_max_ps(m); /* only read without a NaN in the row */
    for (; i < V; i++) {
        const float f = argmax_at(x, bf16, i);
        if (f != f) nan = 1;
        else if (f > best) best = f;
    }
    for (i = 0; i < V; i += 16) {
        const int64_t n = V - i < 16 ? V - i : 16;
        int hit = 0;
        for (int64_t j = 0; j < n; j++) {
            const float f = argmax_at(x, bf16, i + j);
            hit |= nan ? f != f : f == best;
        }
        if (hit)
            for (int64_t j = 0; j < n; j++) {
                const float f = argmax_at(x, bf16, i + j);
                if (nan ? f != f : f == best) return i + j;
            }
    }
    return 0; /* not reached for V >= 1 */
}

void tritonspec_argmax(const void* x, int bf16, int64_t R, int64_t V, int64_t ld, int64_t* out, int threads) {
    const int64_t size = bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (R > 1 && threads > 1)
    for (int64_t r = 0; r < R; r++) out[r] = argmax_row((const char*)x + r * ld * size, bf16, V);
}
