/* Causal prefill attention for x86-64 CPUs with AVX-512 (float32); AVX2 + FMA CPUs build it through avx2.h
 * (kernels/cpu_prefill.py runs it where it was measured faster than PyTorch's SDPA: AVX-512).
 *
 *     out[b, i, h, :] = sum_{j <= i} softmax_j(scale * q[b, i, h, :] . k[b, j, h / G, :]) v[b, j, h / G, :]
 *
 * over a prompt's own P positions (an empty prefix), G = Hq / Hkv query heads per KV head (GQA).
 *
 * Why a kernel of our own: PyTorch's CPU flash attention computes whole key blocks of 512 for queries
 * of up to 512 positions, so a causal prompt of <= 512 tokens costs as much as a full one, and its
 * small-head GEMMs ran at ~76 G multiply-adds a second (full-attention equivalent) on one Zen 4 core.
 * Here a tile of MQ = 8 query rows of one head walks the key blocks of KB = 32 keys up to its last
 * row only (the masked half is skipped), as an outer product: per head dim d, two 16-key loads of the
 * transposed K (built once per KV head, zero-padded to whole blocks) and 8 broadcasts feed 16
 * multiply-adds; then an online softmax per row (exp_ps), and p @ V again as an outer product (per key,
 * the V row's 16-dim chunks and 8 broadcasts of p). Tiles run heaviest first over the threads
 * (dynamic schedule). The online softmax runs the tile's rows side by side: their new maxima and rescale
 * factors as one vector (exp_ps; a libm expf call per row spilled the 16 score registers around it), and
 * each row's sum kept lane-wise until the end: 1.14-1.24x over per-row expf and sums (100-2,600 tokens of
 * the demo's heads, 300 of SmolLM2's; one thread, 2026-12-06, Xeon). Not row-invariant (the rounding
 * depends on the tile a row falls in, as SDPA's does): prompts only; decode rounds and deterministic mode
 * keep attention.c.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h" /* AVX2 + FMA CPUs: the AVX-512 intrinsics below, emulated lane for lane */
#include "exp.h"

#define MQ 8        /* query rows per tile */
#define NV 2        /* 16-key vectors per block (MQ x NV score registers; 8 x 2 measured fastest: 4 x 4, 6 x 4,
                     * 6 x 2, 10 x 2, 12 x 2 and 16 x 1 were as fast or slower) */
#define KB (16 * NV) /* keys per block */
#define PF_MAX_D 256 /* head dim */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* lanes [0, n) of 16 (n clamped to [0, 16]) */
ALWAYS_INLINE __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* acc[r][c .. c + 16 W) = alpha[r] acc[r][...] + sum_{j < jn} pb[r][j] v[j][c ...], W = 1 or 2 vectors */
#define PV(W)                                                                                            \
    do {                                                                                                 \
        __m512 a[MQ][W];                                                                                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < MQ; r++) {                                          \
            const __m512 al = _mm512_set1_ps(alpha[r]);                                                  \
            _Pragma("GCC unroll 2") for (int w = 0; w < W; w++) a[r][w] =                               \
                _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c + 16 * w), al);                                 \
        }                                                                                                \
        for (int64_t j = 0; j < jn; j++) {                                                               \
            const float* vr = v + (j0 + j) * svp + c;                                                    \
            __m512 vv[W];                                                                                \
            _Pragma("GCC unroll 2") for (int w = 0; w < W; w++) vv[w] = _mm512_loadu_ps(vr + 16 * w);   \
            _Pragma("GCC unroll 16") for (int r = 0; r < MQ; r++) {                                      \
                const __m512 p = _mm512_set1_ps(pb[r][j]);                                               \
                _Pragma("GCC unroll 2") for (int w = 0; w < W; w++) a[r][w] =                           \
                    _mm512_fmadd_ps(p, vv[w], a[r][w]);                                                  \
            }                                                                                            \
        }                                                                                                \
        _Pragma("GCC unroll 16") for (int r = 0; r < MQ; r++)                                            \
            _Pragma("GCC unroll 2") for (int w = 0; w < W; w++) _mm512_storeu_ps(acc[r] + c + 16 * w, a[r][w]); \
    } while (0)

/* Query rows i0 .. i0 + nq - 1 (nq <= MQ) of one head: q rows at q + i sqp, the KV head's transposed K in
 * key blocks kt [P / KB][D][KB] (one block's 8-16 KB contiguous; zero past P), its V rows at v + j svp,
 * output rows at o + i sop. */
static void tile(const float* q, int64_t sqp, const float* kt, const float* v, int64_t svp, float* o,
                 int64_t sop, int64_t i0, int nq, int64_t D, float scale) {
    float qs[MQ][PF_MAX_D] __attribute__((aligned(64)));
    float acc[MQ][PF_MAX_D] __attribute__((aligned(64)));
    float pb[MQ][KB] __attribute__((aligned(64)));
    float m[16] __attribute__((aligned(64))), alpha[16] __attribute__((aligned(64)));
    __m512 lv[MQ]; /* the rows' softmax sums, lane-wise (summed once at the end) */
    for (int r = 0; r < MQ; r++) {
        for (int64_t d = 0; d < D; d++) qs[r][d] = r < nq ? q[(i0 + r) * sqp + d] * scale : 0.0f;
        memset(acc[r], 0, sizeof(float) * D);
        m[r] = -INFINITY;
        lv[r] = _mm512_setzero_ps();
    }
    const int64_t last = i0 + nq - 1; /* keys 0 .. last are visible to some row */
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        __m512 s[MQ][NV];
#pragma GCC unroll 16
        for (int r = 0; r < MQ; r++)
            for (int w = 0; w < NV; w++) s[r][w] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const float* kd = kt + j0 * D + d * KB;
            __m512 kk[NV];
            for (int w = 0; w < NV; w++) kk[w] = _mm512_loadu_ps(kd + 16 * w);
#pragma GCC unroll 16
            for (int r = 0; r < MQ; r++) {
                const __m512 qb = _mm512_set1_ps(qs[r][d]);
                for (int w = 0; w < NV; w++) s[r][w] = _mm512_fmadd_ps(qb, kk[w], s[r][w]);
            }
        }
        /* the online softmax, rows side by side: each row's block max, then the rows' new maxima and
         * rescale factors as one vector (no libm call: it would spill the score registers), then p */
        float bmax[16] __attribute__((aligned(64)));
#pragma GCC unroll 16
        for (int r = 0; r < MQ; r++) {
            const int64_t n = i0 + r - j0 + 1; /* keys j0 .. i0 + r of this block are visible */
            __m512 t = ninf;
            for (int w = 0; w < NV; w++) t = _mm512_mask_max_ps(t, first_lanes(n - 16 * w), t, s[r][w]);
            bmax[r] = _mm512_reduce_max_ps(t); /* -inf: the row sees no key here */
        }
        const __mmask16 rows = (__mmask16)((1u << MQ) - 1u);
        const __m512 mo = _mm512_maskz_loadu_ps(rows, m), mn = _mm512_max_ps(mo, _mm512_maskz_loadu_ps(rows, bmax));
        /* alpha = exp(m_old - m_new): 0 where the row saw nothing before (acc and l are 0), 1 where its max held */
        const __mmask16 seen = _mm512_cmp_ps_mask(mo, ninf, _CMP_NEQ_OQ) & rows;
        _mm512_mask_storeu_ps(alpha, rows, _mm512_maskz_mov_ps(seen, exp_ps(_mm512_sub_ps(_mm512_maskz_mov_ps(seen, mo), _mm512_maskz_mov_ps(seen, mn)))));
        _mm512_mask_storeu_ps(m, rows, mn);
#pragma GCC unroll 16
        for (int r = 0; r < MQ; r++) {
            const int64_t n = i0 + r - j0 + 1;
            const __m512 mv = _mm512_set1_ps(m[r]); /* lanes the row does not see are masked to p = 0 */
            __m512 ps = _mm512_setzero_ps();
            for (int w = 0; w < NV; w++) {
                const __m512 p = _mm512_maskz_mov_ps(first_lanes(n - 16 * w), exp_ps(_mm512_sub_ps(s[r][w], mv)));
                ps = _mm512_add_ps(ps, p);
                _mm512_storeu_ps(pb[r] + 16 * w, p);
            }
            lv[r] = _mm512_fmadd_ps(lv[r], _mm512_set1_ps(alpha[r]), ps);
        }
        const int64_t jn = last - j0 + 1 < KB ? last - j0 + 1 : KB; /* keys no row sees carry p = 0 */
        int64_t c = 0;
        for (; c + 32 <= D; c += 32) PV(2);
        if (c < D) PV(1);
    }
    for (int r = 0; r < nq; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lv[r]));
        float* orow = o + (i0 + r) * sop;
        for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c), inv));
    }
}

/* out [B, P, Hq, D] (contiguous) = causal attention of q [B, P, Hq, D] over k, v [B, P, Hkv, D] (element
 * strides s*b, s*p, s*h; unit stride along D). D % 16 == 0, D <= 256, Hq % Hkv == 0 (checked by the
 * caller). Returns 0, or 1 when the transposed-K buffer could not be allocated. */
int tritonspec_prefill_attention_f32(const float* q, int64_t B, int64_t P, int64_t Hq, int64_t Hkv, int64_t D,
                                     int64_t sqb, int64_t sqp, int64_t sqh, const float* k, int64_t skb, int64_t skp,
                                     int64_t skh, const float* v, int64_t svb, int64_t svp, int64_t svh, float* out,
                                     float scale, int threads) {
    if (B <= 0 || P <= 0 || Hq <= 0) return 0;
    const int64_t ldkt = (P + KB - 1) / KB * KB;
    float* kt = (float*)aligned_alloc(64, (size_t)(B * Hkv * D * ldkt) * sizeof(float));
    if (!kt) return 1;
    const int64_t G = Hq / Hkv, nblk = (P + MQ - 1) / MQ, heads = B * Hq;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < B * Hkv; bg++) { /* kt[b, g][j / KB][d][j % KB] = k[b, j, g, d], zero past P */
            const int64_t b = bg / Hkv, g = bg % Hkv;
            float* dst = kt + bg * D * ldkt;
            memset(dst + (ldkt - KB) * D, 0, sizeof(float) * KB * D); /* the last block's tail */
            for (int64_t j = 0; j < P; j++) {
                const float* src = k + b * skb + j * skp + g * skh;
                float* col = dst + (j / KB) * KB * D + j % KB;
                for (int64_t d = 0; d < D; d++) col[d * KB] = src[d];
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < nblk * heads; t++) { /* the last (heaviest) query tiles first */
            const int64_t blk = nblk - 1 - t / heads, bh = t % heads, b = bh / Hq, h = bh % Hq, g = h / G;
            const int64_t i0 = blk * MQ;
            const int nq = (int)(P - i0 < MQ ? P - i0 : MQ);
            tile(q + b * sqb + h * sqh, sqp, kt + (b * Hkv + g) * D * ldkt, v + b * svb + g * svh, svp,
                 out + (b * P * Hq + h) * D, Hq * D, i0, nq, D, scale);
        }
    }
    free(kt);
    return 0;
}
