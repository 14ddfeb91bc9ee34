/* Row-invariant decode/tree attention for x86-64 CPUs with AVX-512, or AVX2 + FMA through avx2.h (float32 and
 * bfloat16 storage).
 *
 *     out[b, q, h, :] = sum_j softmax_j(scale * q[b, q, h, :] . k[b, j, h / G, :]) v[b, j, h / G, :]
 *
 * over the slots j the query sees, in ascending slot order: the committed prefix j < P = prefix_lens[b],
 * then the tree slots j = P + t whose tree_mask[b, q, t] is set (slots >= S are never read). G = Hq / Hkv
 * query heads share a KV head (GQA). A query that sees nothing gets zeros.
 *
 * Row invariance: one (b, q, kv head) is one task; it walks its visible slots in blocks of 64 *visible*
 * keys (block edges counted along the visible sequence, not in slot numbers) with an online softmax in
 * float32: scores by one fixed dot-product sequence, the block's max, exp by one polynomial, the sum and
 * the weighted values accumulated key after key. Nothing depends on the other queries, the batch, the
 * tree's other nodes or the thread count, only on the keys the query sees and their order. A token's
 * attention is therefore the same bit for bit when it is verified as a tree node (prefix + its ancestors'
 * slots + its own) and when it is decoded alone after those ancestors were committed (the same keys at
 * consecutive slots): speculative and plain decoding agree, in bfloat16 too.
 *
 * Speed: a decode step's attention reads each visible K and V row once per KV head (L2-resident for
 * decode lengths), so this is ~10x less work than a masked SDPA over a padded key bound. A prompt runs
 * as a causal tree (deterministic mode), so the per-key work matters too: scores of 16 keys reduced in
 * one transposed tree (hsum.h, the bits of _mm512_reduce_add_ps), the head dims 16/32/64/128
 * specialised at compile time (the chains stay in registers), K and V chunks loaded once for up to 4 heads, a
 * vector block max and a 64-byte scan of the mask row made causal prompts 2-3x faster than the first
 * version (400-800 tokens of the demo's shapes 2.6-3.0x, 300 of SmolLM2's 2.1-2.7x) and one-query decode
 * over 500-1000 keys 1.7-2.1x, at the same bits (2026-12-02, quiet runs; checked on 168 random calls).
 * Several queries of a row over a prefix of at least one full block (a verify's tree rows) share that
 * prefix's full blocks: a task takes a group of up to 16 of them for one KV head and runs each block query
 * after query while its K and V rows sit in L1, then each query goes on alone (the same calls in the same
 * order per query, so the same bits as alone; TRITONSPEC_CPU_ATTENTION_SHARED=0 turns it off for A/B
 * runs). Demo verify (13 queries, 4 heads / 2 KV heads, D 32, 800 keys) 205 -> 157 us on one thread,
 * 114 -> 83 us on two; SmolLM2's (9 / 3, D 64) 2,500 keys 1.27 -> 1.12 ms, 300 keys 155 -> 146 us
 * (two threads; 2026-12-04, AVX2 Zen 3). In those shared blocks, acc += p v then runs for up to 8 (query,
 * head) rows of a group at once (PV_WIDE: each V chunk loaded once for them, up to 16 independent FMA
 * chains where one query's G heads x chunks were latency-bound), each chain still key after key: demo
 * shape, 12 queries, 800 keys, 90-93 -> 84-88 us; SmolLM2's, 16 queries, 2,500 keys, 1.19-1.27 -> 1.13 ms
 * (one thread, the operator alone, alternating builds; 2026-12-06, Xeon with AMX, a training run beside).
 * There (AVX-512, groups of at least KT_MIN_ROWS (query, head) rows) the scores come from the block transposed
 * once per KV head (transpose16: 16 keys in the lanes, scores_t): each (head, key) is still the fmadd chain over
 * the chunks from zero and the tree of _mm512_reduce_add_ps, now across 16 vectors instead of shuffles inside
 * one, so the same bits; the lane-sum tree's ~2 shuffles per (query, head, key) are gone. Same shapes, one
 * thread, the operator alone, on and off in one process (2026-12-06, Xeon): demo 12 queries 800 keys 116 ->
 * 83 us, 300 keys 53 -> 43 us; SmolLM2's 16 queries 700 keys 357 -> 325 us (set_transposed_scores, for A/B).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2.h" /* AVX2 + FMA CPUs: the AVX-512 intrinsics below, emulated lane for lane */
#include "bf16.h"
#include "exp.h"
#include "hsum.h"

#define BLOCK 64   /* visible keys per online-softmax block */
#define MAX_G 16   /* query heads per KV head */
#define MAX_D 256  /* head dim */
#define SMALL_WORK (1 << 17) /* multiply-adds below which one thread runs the call */

/* The transposed scores of the shared-prefix path (scores_t): on unless TRITONSPEC_CPU_ATTENTION_KT=0 at the first
 * call, or turned off by tritonspec_attention_kt(0) (kernels/cpu_attention.py set_transposed_scores, for
 * side-by-side runs). Both ways give the same bits. */
static int kt_on = -1;
static inline int kt_enabled(void) {
    if (kt_on < 0) {
        const char* e = getenv("TRITONSPEC_CPU_ATTENTION_KT");
        kt_on = !(e && e[0] == '0');
    }
    return kt_on;
}
int tritonspec_attention_kt(int on) { /* returns the previous setting */
    const int prev = kt_enabled();
    kt_on = on != 0;
    return prev;
}
static int64_t kt_blocks = 0; /* blocks scored transposed (kernels/cpu_attention.py transposed_blocks: tests see the path) */
int64_t tritonspec_attention_kt_blocks(void) { return kt_blocks; }

/* the prefix slots a query of a row with prefix length P sees in a cache of S slots */
static inline int64_t visible_prefix(int64_t P, int64_t S) { return P < S ? (P > 0 ? P : 0) : S; }

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

/* 16 (or fewer, masked) elements as float32 from float32 or bfloat16 storage. */
static inline __m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The visible slots of one query, from cursor (j, t) on, up to BLOCK of them, in ascending slot order:
 * the prefix slots j < pre, then the tree slots P + t (t < lim) whose mask byte is set. A unit-stride
 * mask is scanned 64 bytes at a time (a causal prompt's row is thousands of bytes). Returns their count. */
static inline int next_block(int64_t* slot, int64_t* j_, int64_t* t_, int64_t pre, int64_t P, const uint8_t* mrow,
                             int64_t smt, int64_t lim) {
    int n = 0;
    int64_t j = *j_, t = *t_;
    while (n < BLOCK && j < pre) slot[n++] = j++;
    if (P < 0) /* slots < 0 are never seen */
        while (n < BLOCK && t < lim && P + t < 0) t++;
    if (smt == 1)
        while (n < BLOCK && t + 64 <= lim) {
            uint64_t bits = _mm512_test_epi8_mask(_mm512_loadu_si512(mrow + t), _mm512_set1_epi8(-1));
            int64_t next = t + 64;
            while (bits) {
                if (n == BLOCK) { next = t + __builtin_ctzll(bits); break; }
                slot[n++] = P + t + __builtin_ctzll(bits);
                bits &= bits - 1;
            }
            t = next;
        }
    while (n < BLOCK && t < lim) {
        if (mrow[t * smt]) slot[n++] = P + t;
        t++;
    }
    *j_ = j;
    *t_ = t;
    return n;
}

/* The online softmax's update of one block for the G heads (s: the block's n scores, which become p = exp(s - m)):
 * block max (exact in any order), rescale, exp, sum. */
static inline __attribute__((always_inline)) void softmax_update(float (*acc)[MAX_D], float (*s)[BLOCK], float* m,
                                                             float* l, int n, int G, int64_t nd) {
    for (int g = 0; g < G; g++) {
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int i0 = 0; i0 < n; i0 += 16)
            mx = _mm512_mask_max_ps(mx, tail_mask(n - i0), mx, _mm512_loadu_ps(&s[g][i0]));
        const float bm = _mm512_reduce_max_ps(mx);
        const float mn = bm > m[g] ? bm : m[g];
        const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mn);
        m[g] = mn;
        __m512 sum = _mm512_setzero_ps();
        for (int i0 = 0; i0 < n; i0 += 16) {
            __mmask16 mk = tail_mask(n - i0);
            __m512 p = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(&s[g][i0]), _mm512_set1_ps(mn))));
            _mm512_storeu_ps(&s[g][i0], p);
            sum = _mm512_add_ps(sum, p);
        }
        l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);
        if (alpha != 1.0f)
            for (int64_t c = 0; c < nd; c++)
                _mm512_store_ps(&acc[g][16 * c], _mm512_mul_ps(_mm512_load_ps(&acc[g][16 * c]), _mm512_set1_ps(alpha)));
    }
}

/* One task: query row (b, q), KV head kh, its G query heads; T = element type (float or uint16_t).
 * Per (head g, key): the score is one 16-lane fmadd chain over the D/16 chunks in ascending order from
 * zero, reduced by _mm512_reduce_add_ps's tree (hsum16, 16 keys at once), times scale; per (g, chunk c):
 * the accumulator runs acc = p_i * v_i + acc over the visible keys in order (register chains, up to
 * CHAINS side by side; for G <= 4 each K and V chunk is loaded once for the G heads, larger G runs head
 * by head). The loop nesting only decides what runs side by side: every value is the same sequence of
 * roundings whatever the block, the other keys or the other queries. ND = D / 16 for the
 * head dims specialised at compile time (16, 32, 64, 128), 0 for any other D. */
#define CHAINS 8
#define WIDE_CHAINS 16 /* the shared-prefix path's query groups: up to 16 accumulators of 16 lanes */
#ifdef __AVX512F__
#define MAX_GC 8 /* ... of up to 8 (query, head) rows */
#else
#define MAX_GC 1 /* AVX2 (avx2.h): 16 registers, and 16 emulated 16-lane chains would spill: query by query */
#endif
#define TASK(NAME, T, LOAD)                                                                                  \
    /* a query's state: qf (its G heads, float32), acc, m, l */                                              \
    static inline __attribute__((always_inline)) void NAME##_init(                                           \
        const T* qrow, int64_t sqh, int G, int64_t D, int64_t nd, float (*qf)[MAX_D], float (*acc)[MAX_D],   \
        float* m, float* l) {                                                                                 \
        for (int g = 0; g < G; g++) {                                                                         \
            for (int64_t c = 0; c < nd; c++) {                                                                \
                __mmask16 mk = tail_mask(D - 16 * c);                                                         \
                _mm512_store_ps(&qf[g][16 * c], LOAD(qrow + g * sqh + 16 * c, mk));                           \
                _mm512_store_ps(&acc[g][16 * c], _mm512_setzero_ps());                                        \
            }                                                                                                 \
            m[g] = -INFINITY;                                                                                 \
            l[g] = 0.0f;                                                                                      \
        }                                                                                                     \
    }                                                                                                         \
    /* one block of n visible keys at slot[]: scores, the online softmax's update (s becomes p) */           \
    static inline __attribute__((always_inline)) void NAME##_sm(                                             \
        float (*qf)[MAX_D], float (*acc)[MAX_D], float (*s)[BLOCK], float* m, float* l, const T* kb,          \
        int64_t sks, const int64_t* slot, int n, int G, int64_t D, int64_t nd, float scale) {                 \
        switch (G) { /* scores: each K chunk loaded once for the G heads, 16 / G keys at a time */            \
        case 1: NAME##_scores(qf, s, kb, slot, n, sks, D, nd, scale, 1); break;                               \
        case 2: NAME##_scores(qf, s, kb, slot, n, sks, D, nd, scale, 2); break;                               \
        case 3: NAME##_scores(qf, s, kb, slot, n, sks, D, nd, scale, 3); break;                               \
        case 4: NAME##_scores(qf, s, kb, slot, n, sks, D, nd, scale, 4); break;                               \
        default: /* one head at a time, 16 keys per hsum16 */                                                 \
            for (int g = 0; g < G; g++) NAME##_scores(qf + g, s + g, kb, slot, n, sks, D, nd, scale, 1);      \
        }                                                                                                     \
        softmax_update(acc, s, m, l, n, G, nd);                                                               \
    }                                                                                                         \
    /* one block of n visible keys at slot[]: scores, the online softmax's update, acc += p v */              \
    static inline __attribute__((always_inline)) void NAME##_block(                                          \
        float (*qf)[MAX_D], float (*acc)[MAX_D], float (*s)[BLOCK], float* m, float* l, const T* kb,          \
        const T* vb, int64_t sks, int64_t svs, const int64_t* slot, int n, int G, int64_t D, int64_t nd,      \
        float scale, const int ND) {                                                                          \
        NAME##_sm(qf, acc, s, m, l, kb, sks, slot, n, G, D, nd, scale);                                       \
        switch (G) { /* acc += p v, key after key: each V chunk loaded once for the G heads */               \
        case 1: PV_HEADS(NAME, acc, s, 1); break;                                                             \
        case 2: PV_HEADS(NAME, acc, s, 2); break;                                                             \
        case 3: PV_HEADS(NAME, acc, s, 3); break;                                                             \
        case 4: PV_HEADS(NAME, acc, s, 4); break;                                                             \
        default: /* one head at a time, CHAINS chunks side by side */                                        \
            for (int g = 0; g < G; g++) PV_HEADS(NAME, acc + g, s + g, 1);                                    \
        }                                                                                                     \
    }                                                                                                         \
    /* from cursor (j, t) on: the query's remaining blocks, then its output [G, D] (float32) */               \
    static inline __attribute__((always_inline)) void NAME##_rest(                                           \
        float (*qf)[MAX_D], float (*acc)[MAX_D], float (*s)[BLOCK], float* m, float* l, const T* kb,          \
        const T* vb, int64_t sks, int64_t svs, int64_t P, const uint8_t* mrow, int64_t smt, int64_t T_,       \
        int64_t S, int G, int64_t D, int64_t nd, float scale, float* outf, int64_t j, const int ND) {         \
        const int64_t pre = visible_prefix(P, S);                                                             \
        const int64_t lim = T_ < S - P ? T_ : S - P; /* tree offsets t with P + t < S */                      \
        int64_t t = 0; /* cursor: prefix slot j, then tree offset t */                                        \
        int64_t slot[BLOCK];                                                                                  \
        for (;;) {                                                                                            \
            const int n = next_block(slot, &j, &t, pre, P, mrow, smt, lim);                                   \
            if (n == 0) break;                                                                                \
            NAME##_block(qf, acc, s, m, l, kb, vb, sks, svs, slot, n, G, D, nd, scale, ND);                   \
        }                                                                                                     \
        for (int g = 0; g < G; g++) {                                                                         \
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;                                               \
            for (int64_t d = 0; d < D; d++) outf[g * D + d] = acc[g][d] * inv;                                \
        }                                                                                                     \
    }                                                                                                         \
    static inline __attribute__((always_inline)) void NAME##_body(                                           \
        const T* qrow, int64_t sqh, const T* kb, const T* vb, int64_t sks, int64_t svs, int64_t P,           \
        const uint8_t* mrow, int64_t smt, int64_t T_, int64_t S, int G, int64_t D, float scale, float* outf, \
        const int ND) {                                                                                       \
        const int64_t nd = ND ? ND : (D + 15) / 16;                                                           \
        if (ND) D = 16 * ND;                                                                                  \
        float qf[MAX_G][MAX_D] __attribute__((aligned(64)));                                                  \
        float acc[MAX_G][MAX_D] __attribute__((aligned(64)));                                                 \
        float s[MAX_G][BLOCK] __attribute__((aligned(64)));                                                   \
        float m[MAX_G], l[MAX_G];                                                                             \
        NAME##_init(qrow, sqh, G, D, nd, qf, acc, m, l);                                                      \
        NAME##_rest(qf, acc, s, m, l, kb, vb, sks, svs, P, mrow, smt, T_, S, G, D, nd, scale, outf, 0, ND);   \
    }                                                                                                         \
    /* Queries q0..q0+nq-1 of one row and KV head, which share the prefix's first nfull blocks (full       \
     * blocks of consecutive prefix slots: the first blocks of each query's visible sequence): those      \
     * blocks run query after query while their K and V rows sit in L1, then each query goes on alone.     \
     * Every query's values are those of NAME##_body (the same blocks, the same calls). st: scratch of     \
     * nq * G * (2 * MAX_D + BLOCK + 2) floats, 64-byte aligned; outf: [nq, G, D] float32. */     \
    static inline __attribute__((always_inline)) void NAME##_multi_body(                                     \
        const T* q0row, int64_t sqq, int64_t sqh, int64_t nq, const T* kb, const T* vb, int64_t sks,         \
        int64_t svs, int64_t P, const uint8_t* m0row, int64_t smq, int64_t smt, int64_t T_, int64_t S,       \
        int64_t nfull, int G, int64_t D, float scale, float* st, float (*kt)[BLOCK], float* outf,            \
        const int ND) {                                                                                       \
        const int64_t nd = ND ? ND : (D + 15) / 16;                                                           \
        if (ND) D = 16 * ND;                                                                                  \
        float(*qf)[MAX_D] = (float(*)[MAX_D])st;                                                              \
        float(*acc)[MAX_D] = qf + nq * G;                                                                     \
        float(*s)[BLOCK] = (float(*)[BLOCK])(acc + nq * G);                                                   \
        float* m = (float*)(s + nq * G);                                                                      \
        float* l = m + nq * G;                                                                                \
        for (int64_t i = 0; i < nq; i++)                                                                      \
            NAME##_init(q0row + i * sqq, sqh, G, D, nd, qf + i * G, acc + i * G, m + i * G, l + i * G);       \
        int64_t slot[BLOCK];                                                                                  \
        const int n = BLOCK;                                                                                  \
        /* queries whose acc += p v run side by side: their G heads each are GC = QN * G rows of acc and s,   \
         * contiguous, over the same V rows (one load of a V chunk for all of them; QN * G * chunks           \
         * independent FMA chains instead of G * chunks, whose latency bound a query alone) */                \
        const int QN = G > MAX_GC ? 1 : MAX_GC / G;                                                           \
        for (int64_t b = 0; b < nfull; b++) {                                                                 \
            for (int i = 0; i < BLOCK; i++) slot[i] = b * BLOCK + i;                                          \
            if (QN == 1) { /* query after query, scores, softmax and acc += p v each */                       \
                for (int64_t i = 0; i < nq; i++)                                                              \
                    NAME##_block(qf + i * G, acc + i * G, s + i * G, m + i * G, l + i * G, kb, vb, sks, svs,  \
                                 slot, n, G, D, nd, scale, ND);                                               \
                continue;                                                                                     \
            }                                                                                                 \
            if (KT_ON(nq * G)) { /* many (query, head) rows: scores from the transposed block */             \
                NAME##_keys_t(kt, kb, slot, sks, D, nd);                                                      \
                _Pragma("omp atomic")                                                                         \
                kt_blocks++;                                                                                  \
                for (int64_t i = 0; i < nq; i++) {                                                            \
                    KT_SCORES(qf + i * G, s + i * G, kt, G, nd, scale);                                       \
                    softmax_update(acc + i * G, s + i * G, m + i * G, l + i * G, n, G, nd);                   \
                }                                                                                             \
            } else                                                                                            \
                for (int64_t i = 0; i < nq; i++)                                                              \
                    NAME##_sm(qf + i * G, acc + i * G, s + i * G, m + i * G, l + i * G, kb, sks, slot, n, G, D, \
                              nd, scale);                                                                     \
            for (int64_t i0 = 0; i0 < nq; i0 += QN) {                                                         \
                const int gc = (int)((nq - i0 < QN ? nq - i0 : QN) * G);                                      \
                float(*acc_)[MAX_D] = acc + i0 * G;                                                           \
                float(*s_)[BLOCK] = s + i0 * G;                                                               \
                switch (gc) {                                                                                 \
                case 1: PV_WIDE(NAME, acc_, s_, 1); break;                                                    \
                case 2: PV_WIDE(NAME, acc_, s_, 2); break;                                                    \
                case 3: PV_WIDE(NAME, acc_, s_, 3); break;                                                    \
                case 4: PV_WIDE(NAME, acc_, s_, 4); break;                                                    \
                case 5: PV_WIDE(NAME, acc_, s_, 5); break;                                                    \
                case 6: PV_WIDE(NAME, acc_, s_, 6); break;                                                    \
                case 7: PV_WIDE(NAME, acc_, s_, 7); break;                                                    \
                case 8: PV_WIDE(NAME, acc_, s_, 8); break;                                                    \
                default: /* not reached: gc <= MAX_GC <= 8 here */                                            \
                    for (int g = 0; g < gc; g++) PV_HEADS(NAME, acc_ + g, s_ + g, 1);                         \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int64_t i = 0; i < nq; i++)                                                                      \
            NAME##_rest(qf + i * G, acc + i * G, s + i * G, m + i * G, l + i * G, kb, vb, sks, svs, P,        \
                        m0row + i * smq, smt, T_, S, G, D, nd, scale, outf + i * G * D, nfull * BLOCK, ND);   \
    }                                                                                                         \
    static void NAME(const T* qrow, int64_t sqh, const T* kb, const T* vb, int64_t sks, int64_t svs, int64_t P, \
                     const uint8_t* mrow, int64_t smt, int64_t T_, int64_t S, int G, int64_t D, float scale,  \
                     float* outf /* [G, D] float32 */) {                                                      \
        switch (D) {                                                                                          \
        case 32: NAME##_body(qrow, sqh, kb, vb, sks, svs, P, mrow, smt, T_, S, G, D, scale, outf, 2); break; \
        case 64: NAME##_body(qrow, sqh, kb, vb, sks, svs, P, mrow, smt, T_, S, G, D, scale, outf, 4); break; \
        case 128: NAME##_body(qrow, sqh, kb, vb, sks, svs, P, mrow, smt, T_, S, G, D, scale, outf, 8); break; \
        case 16: NAME##_body(qrow, sqh, kb, vb, sks, svs, P, mrow, smt, T_, S, G, D, scale, outf, 1); break; \
        default: NAME##_body(qrow, sqh, kb, vb, sks, svs, P, mrow, smt, T_, S, G, D, scale, outf, 0);        \
        }                                                                                                     \
    }                                                                                                         \
    static void NAME##_multi(const T* q0row, int64_t sqq, int64_t sqh, int64_t nq, const T* kb, const T* vb,  \
                             int64_t sks, int64_t svs, int64_t P, const uint8_t* m0row, int64_t smq,          \
                             int64_t smt, int64_t T_, int64_t S, int64_t nfull, int G, int64_t D, float scale, \
                             float* st, float (*kt)[BLOCK], float* outf /* [nq, G, D] float32 */) {           \
        switch (D) {                                                                                          \
        case 32: NAME##_multi_body(q0row, sqq, sqh, nq, kb, vb, sks, svs, P, m0row, smq, smt, T_, S, nfull, G, D, scale, st, kt, outf, 2); break; \
        case 64: NAME##_multi_body(q0row, sqq, sqh, nq, kb, vb, sks, svs, P, m0row, smq, smt, T_, S, nfull, G, D, scale, st, kt, outf, 4); break; \
        case 128: NAME##_multi_body(q0row, sqq, sqh, nq, kb, vb, sks, svs, P, m0row, smq, smt, T_, S, nfull, G, D, scale, st, kt, outf, 8); break; \
        case 16: NAME##_multi_body(q0row, sqq, sqh, nq, kb, vb, sks, svs, P, m0row, smq, smt, T_, S, nfull, G, D, scale, st, kt, outf, 1); break; \
        default: NAME##_multi_body(q0row, sqq, sqh, nq, kb, vb, sks, svs, P, m0row, smq, smt, T_, S, nfull, G, D, scale, st, kt, outf, 0); \
        }                                                                                                     \
    }

/* s[g][i] = scale * (q_g . k_i) for the GC heads and the block's n keys, 16 / GC keys at a time: a K
 * chunk is loaded once for the GC heads; each (head, key) is the one fmadd chain and hsum16 tree. */
#define SCORES(NAME, T, LOAD)                                                                                \
    static inline __attribute__((always_inline)) void NAME##_scores(                                         \
        float (*qf)[MAX_D], float (*s)[BLOCK], const T* kb, const int64_t* slot, int n, int64_t sks,         \
        int64_t D, int64_t nd, float scale, const int GC) {                                                   \
        const int KG = 16 / GC;                                                                               \
        for (int i0 = 0; i0 < n; i0 += KG) {                                                                  \
            __m512 dot[16];                                                                                   \
            for (int e = 0; e < 16; e++) dot[e] = _mm512_setzero_ps();                                        \
            for (int i = 0; i < KG; i++) {                                                                    \
                const T* kr = kb + slot[i0 + i < n ? i0 + i : i0] * sks;                                      \
                for (int64_t c = 0; c < nd; c++) {                                                            \
                    const __m512 kv = LOAD(kr + 16 * c, tail_mask(D - 16 * c));                               \
                    for (int g = 0; g < GC; g++)                                                              \
                        dot[g * KG + i] = _mm512_fmadd_ps(_mm512_load_ps(&qf[g][16 * c]), kv, dot[g * KG + i]); \
                }                                                                                             \
            }                                                                                                 \
            float tmp[16] __attribute__((aligned(64)));                                                       \
            _mm512_store_ps(tmp, _mm512_mul_ps(hsum16(dot), _mm512_set1_ps(scale)));                          \
            for (int g = 0; g < GC; g++)                                                                      \
                for (int i = 0; i < KG && i0 + i < n; i++) s[g][i0 + i] = tmp[g * KG + i];                    \
        }                                                                                                     \
    }

SCORES(task_f32, float, load_f32)
SCORES(task_bf16, uint16_t, load_bf16)

#ifdef __AVX512F__
/* r[0..15] (16 rows of 16 floats) transposed in registers: r[j] becomes column j (64 shuffles). */
static inline __attribute__((always_inline)) void transpose16(__m512* r) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) { /* lane L: r[2i][4L], r[2i+1][4L], r[2i][4L+1], r[2i+1][4L+1] (lo); +2, +3 (hi) */
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* u[4g + k], lane L: column 4L + k of rows 4g..4g+3 */
        u[4 * g] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int k = 0; k < 4; k++) { /* t[k]: columns k, 8+k of rows 0-7; t[4+k]: 4+k, 12+k; t[8+k], t[12+k]: rows 8-15 */
        t[k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        t[4 + k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        t[8 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        t[12 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
        r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xDD);
    }
}

/* kt[d][i] = the block's key i (slot[i], i < BLOCK: a full block) at dim d as float32, for d < 16 nd (zeros past D,
 * as the masked loads of NAME##_scores give them) */
#define KEYS_T(NAME, T, LOAD)                                                                                 \
    static inline __attribute__((always_inline)) void NAME##_keys_t(float (*kt)[BLOCK], const T* kb,          \
                                                                    const int64_t* slot, int64_t sks,         \
                                                                    int64_t D, int64_t nd) {                  \
        for (int i0 = 0; i0 < BLOCK; i0 += 16)                                                                \
            for (int64_t c = 0; c < nd; c++) {                                                                \
                __m512 r[16];                                                                                 \
                for (int i = 0; i < 16; i++) r[i] = LOAD(kb + slot[i0 + i] * sks + 16 * c, tail_mask(D - 16 * c)); \
                transpose16(r);                                                                               \
                for (int e = 0; e < 16; e++) _mm512_store_ps(&kt[16 * c + e][i0], r[e]);                      \
            }                                                                                                 \
    }
KEYS_T(task_f32, float, load_f32)
KEYS_T(task_bf16, uint16_t, load_bf16)

/* NAME##_scores' values from the transposed block, 16 keys in the lanes: per (head, key) the same fmadd chain
 * over the chunks from zero (lane e of chunk c: q[16c + e] * k[16c + e]), the same tree as hsum16 (e + e+8,
 * + e+4, + e+2, + e+1) across the 16 vectors, times scale. No shuffles per query: the transposition is paid
 * once per block and KV head for the group's queries. */
static inline __attribute__((always_inline)) void scores_t(float (*qf)[MAX_D], float (*s)[BLOCK],
                                                           float (*kt)[BLOCK], int G, int64_t nd, float scale) {
    for (int g = 0; g < G; g++)
        for (int i0 = 0; i0 < BLOCK; i0 += 16) {
            __m512 a[16];
            for (int e = 0; e < 16; e++) a[e] = _mm512_setzero_ps();
            for (int64_t c = 0; c < nd; c++)
                for (int e = 0; e < 16; e++)
                    a[e] = _mm512_fmadd_ps(_mm512_set1_ps(qf[g][16 * c + e]), _mm512_load_ps(&kt[16 * c + e][i0]), a[e]);
            for (int e = 0; e < 8; e++) a[e] = _mm512_add_ps(a[e], a[e + 8]);
            for (int e = 0; e < 4; e++) a[e] = _mm512_add_ps(a[e], a[e + 4]);
            for (int e = 0; e < 2; e++) a[e] = _mm512_add_ps(a[e], a[e + 2]);
            _mm512_store_ps(&s[g][i0], _mm512_mul_ps(_mm512_add_ps(a[0], a[1]), _mm512_set1_ps(scale)));
        }
}
/* (query, head) rows of a group from which the transposed scores pay for the transposition: 4 (was 8) since a
 * verify of (2,1,3) / (3,1,4) chains on the demo's 4 heads / 2 KV heads runs groups of 6 and 8 rows at batch 4:
 * on and off in one process (one thread, 4 rows of 256-786 keys, D 32, 2026-12-06), 2 queries 95 / 93 -> 83 / 81 us
 * with the cache in L2, 3 queries 129 / 116 -> 111 / 101 us; over 12 layers' caches (L3) 3 queries 190 / 194 -> 171 /
 * 173 us. */
#define KT_MIN_ROWS 4
#define KT_ON(rows) (kt_enabled() && (rows) >= KT_MIN_ROWS)
#define KT_SCORES scores_t
#else /* AVX2: query by query (MAX_GC 1), this branch never runs */
#define KT_ON(rows) 0
#define KT_SCORES(...) ((void)0)
#define task_f32_keys_t(...) ((void)0)
#define task_bf16_keys_t(...) ((void)0)
#endif

/* acc[g][16 c] += p_i v_i for the GC heads g and the NC chunks c0..c0+NC-1, key after key in order: a
 * V chunk is loaded once and used by the GC heads (the same roundings as one chain at a time). */
#define PVG(NAME, T, LOAD)                                                                                   \
    static inline __attribute__((always_inline)) void NAME##_pvg(                                            \
        float (*acc)[MAX_D], float (*s)[BLOCK], const T* vb, const int64_t* slot, int n, int64_t svs,        \
        int64_t D, int64_t c0, const int NC, const int GC) {                                                  \
        __m512 a[WIDE_CHAINS];                                                                                \
        for (int c = 0; c < NC; c++)                                                                          \
            for (int g = 0; g < GC; g++) a[c * GC + g] = _mm512_load_ps(&acc[g][16 * (c0 + c)]);              \
        for (int i = 0; i < n; i++) {                                                                         \
            const T* vr = vb + slot[i] * svs + 16 * c0;                                                       \
            for (int c = 0; c < NC; c++) {                                                                    \
                const __m512 vv = LOAD(vr + 16 * c, tail_mask(D - 16 * (c0 + c)));                            \
                for (int g = 0; g < GC; g++)                                                                  \
                    a[c * GC + g] = _mm512_fmadd_ps(_mm512_set1_ps(s[g][i]), vv, a[c * GC + g]);              \
            }                                                                                                 \
        }                                                                                                     \
        for (int c = 0; c < NC; c++)                                                                          \
            for (int g = 0; g < GC; g++) _mm512_store_ps(&acc[g][16 * (c0 + c)], a[c * GC + g]);              \
    }
/* every chunk for the GC heads from ACC / SC on, NCH / GC chunks at a time (the head dim's when fewer) */
#define PV_CHUNKS(NAME, ACC, SC, GC, NCH)                                                                    \
    do {                                                                                                      \
        const int nc_ = ND && ND < (NCH) / (GC) ? ND : (NCH) / (GC);                                          \
        int64_t c0_ = 0;                                                                                      \
        for (; c0_ + nc_ <= nd; c0_ += nc_) NAME##_pvg(ACC, SC, vb, slot, n, svs, D, c0_, nc_, GC);           \
        for (; c0_ < nd; c0_++) NAME##_pvg(ACC, SC, vb, slot, n, svs, D, c0_, 1, GC);                         \
    } while (0)
/* a query's G heads: CHAINS accumulators at most */
#define PV_HEADS(NAME, ACC, SC, GC) PV_CHUNKS(NAME, ACC, SC, GC, CHAINS)
/* the shared-prefix path's query groups (GC = queries x heads <= MAX_GC): WIDE_CHAINS, so more chains run side by side */
#define PV_WIDE(NAME, ACC, SC, GC) PV_CHUNKS(NAME, ACC, SC, GC, WIDE_CHAINS)

PVG(task_f32, float, load_f32)
PVG(task_bf16, uint16_t, load_bf16)
TASK(task_f32, float, load_f32)
TASK(task_bf16, uint16_t, load_bf16)

/* q [B, Q, Hq, D] at strides (sqb, sqq, sqh, 1); k, v [>=B, >=S, Hkv, D] at strides (skb, sks, skh, 1) and
 * (svb, svs, svh, 1); prefix_lens [B]; tree_mask [B, Q, T] (bytes) at strides (smb, smq, smt); out [B, Q, Hq, D]
 * contiguous.
 * Returns 0, -1 when G or D exceed the kernel's limits (the caller checks them first), or -2 when the scratch
 * of the shared-prefix path could not be allocated. */
#define ATTENTION(NAME, T, TASKFN, STORE)                                                                     \
    int NAME(const T* q, int64_t B, int64_t Q, int64_t Hq, int64_t D, int64_t sqb, int64_t sqq, int64_t sqh, \
             const T* k, const T* v, int64_t Hkv, int64_t skb, int64_t sks, int64_t skh, int64_t svb,         \
             int64_t svs, int64_t svh, const int64_t* prefix_lens, const uint8_t* tree_mask, int64_t smb,     \
             int64_t smq, int64_t smt, int64_t T_,                                                          \
             int64_t S, float scale, T* out, int threads) {                                                   \
        if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D > MAX_D) return -1;                                 \
        const int G = (int)(Hq / Hkv);                                                                        \
        const int64_t tasks = B * Q * Hkv;                                                                    \
        int64_t keys = 0; /* work bound: small calls run on one thread (the result never depends on it) */  \
        for (int64_t b = 0; b < B; b++) keys += (prefix_lens[b] < S ? prefix_lens[b] : S) + T_;             \
        if (keys * Q * Hq * D < SMALL_WORK) threads = 1;                                                     \
        int64_t shared = 0; /* full prefix blocks the rows' queries share */                                  \
        for (int64_t b = 0; b < B && Q > 1; b++) shared += visible_prefix(prefix_lens[b], S) / BLOCK;       \
        const char* off = getenv("TRITONSPEC_CPU_ATTENTION_SHARED"); /* "0": per-query tasks only (A/B runs) */ \
        if (shared > 0 && !(off && off[0] == '0')) { /* several queries over a common prefix: its blocks once per group */ \
            int64_t ng = (2 * threads + B * Hkv - 1) / (B * Hkv); /* groups per (row, KV head): ~2 tasks a thread */ \
            if (ng < (Q + 15) / 16) ng = (Q + 15) / 16;                                                        \
            if (ng > Q) ng = Q;                                                                               \
            const int64_t qg = (Q + ng - 1) / ng;                                                             \
            ng = (Q + qg - 1) / qg;                                                                           \
            /* one scratch per thread, not per task: the query states, then the group's output [qg, G, D] */      \
            const size_t state = (size_t)qg * G * (2 * MAX_D + BLOCK + 2);                                    \
            const size_t kt_at = (state + (size_t)qg * G * D + 15) / 16 * 16; /* the transposed block, aligned */ \
            const size_t bytes = (kt_at + (size_t)MAX_D * BLOCK) * 4;                                          \
            int failed = 0;                                                                                   \
            _Pragma("omp parallel num_threads(threads)")                                                      \
            {                                                                                                 \
                float* st = (float*)aligned_alloc(64, (bytes + 63) / 64 * 64);                                \
                if (!st) {                                                                                    \
                    _Pragma("omp atomic write")                                                               \
                    failed = 1;                                                                               \
                }                                                                                             \
                _Pragma("omp for schedule(static)")                                                           \
                for (int64_t task = 0; task < B * Hkv * ng; task++) {                                         \
                    if (!st) continue;                                                                        \
                    const int64_t b = task / (Hkv * ng), kh = (task / ng) % Hkv, q0 = (task % ng) * qg;        \
                    const int64_t nq = Q - q0 < qg ? Q - q0 : qg, P = prefix_lens[b];                         \
                    float* o = st + state;                                                                    \
                    TASKFN##_multi(q + b * sqb + q0 * sqq + kh * G * sqh, sqq, sqh, nq, k + b * skb + kh * skh, \
                                   v + b * svb + kh * svh, sks, svs, P, tree_mask + b * smb + q0 * smq, smq, smt, \
                                   T_, S, visible_prefix(P, S) / BLOCK, G, D, scale, st,                      \
                                   (float(*)[BLOCK])(st + kt_at), o);                                         \
                    for (int64_t i = 0; i < nq; i++) {                                                        \
                        T* dst = out + ((b * Q + q0 + i) * Hq + kh * G) * D;                                  \
                        for (int64_t e = 0; e < G * D; e++) dst[e] = STORE(o[i * G * D + e]);                 \
                    }                                                                                         \
                }                                                                                             \
                free(st);                                                                                     \
            }                                                                                                 \
            return failed ? -2 : 0;                                                                           \
        }                                                                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                     \
        for (int64_t task = 0; task < tasks; task++) {                                                        \
            const int64_t b = task / (Q * Hkv), qi = (task / Hkv) % Q, kh = task % Hkv;                       \
            float o[MAX_G * MAX_D];                                                                           \
            TASKFN(q + b * sqb + qi * sqq + kh * G * sqh, sqh, k + b * skb + kh * skh, v + b * svb + kh * svh, \
                   sks, svs, prefix_lens[b], tree_mask + b * smb + qi * smq, smt, T_, S, G, D, scale, o);     \
            T* dst = out + ((b * Q + qi) * Hq + kh * G) * D;                                                  \
            for (int64_t e = 0; e < G * D; e++) dst[e] = STORE(o[e]);                                         \
        }                                                                                                     \
        return 0;                                                                                             \
    }

#define STORE_F32(x) (x)
ATTENTION(tritonspec_tree_attention_f32, float, task_f32, STORE_F32)
ATTENTION(tritonspec_tree_attention_bf16, uint16_t, task_bf16, float_to_bf16)
