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
 * multiply-adds; then an online softmax per row, and p @ V again as an outer product (per key, the V row's
 * 16-dim chunks and 8 broadcasts of p). Tiles run heaviest first over the threads (dynamic schedule). The
 * online softmax works in log2 units (scale * log2 e folded into the queries, exp2_ps) with a lazy maximum:
 * a row's maximum moves, and its sum (kept lane-wise until the end) and acc are rescaled, only when a score
 * passes it by more than LAZY; full blocks skip the causal masks. 1.09-1.20x over a maximum and rescale per
 * block with exp_ps (100-1,700 tokens of the demo's heads, 300-1,000 of SmolLM2's; one thread, 2026-12-06,
 * Xeon); that version had in turn replaced a libm expf per row and block, which spilled the score registers
 * (1.14-1.24x over it). Not row-invariant (the rounding
 * depends on the tile a row falls in, as SDPA's does): prompts only; decode rounds and deterministic mode
 * keep attention.c. On CPUs with AMX, prompts of at least AMX_MIN_P tokens with D % 32 == 0 run tile_amx
 * instead (below): both products on the tile unit from exact three-part bfloat16 splits, float32-class error.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx2.h" /* AVX2 + FMA CPUs: the AVX-512 intrinsics below, emulated lane for lane */
#include "amx.h"
#include "exp.h"

#define MQ 8        /* query rows per tile */
#define NV 2        /* 16-key vectors per block (MQ x NV score registers; 8 x 2 measured fastest: 4 x 4, 6 x 4,
                     * 6 x 2, 10 x 2, 12 x 2 and 16 x 1 were as fast or slower) */
#define KB (16 * NV) /* keys per block */
#if NV != 2
#error "max_moves and row_p take a block of two 16-key vectors"
#endif
#define PF_MAX_D 256 /* head dim */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define LAZY 8.0f /* how far (log2 units) a score may pass a row's running maximum before it moves */

/* lanes [0, n) of 16 (n clamped to [0, 16]) */
ALWAYS_INLINE __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* The online softmax of one query row over a block of 32 keys (both tiles: scores s[0], s[1] in log2 units;
 * vis: the keys the row sees), with a lazy maximum: the row's maximum m moves, and its sum and acc are
 * rescaled, only when a visible score passes m by more than LAZY, so p = 2^(s - m) stays below 2^LAZY. */

/* whether the row's maximum m moves in this block; if so, *mn is the block's visible maximum */
ALWAYS_INLINE int max_moves(const __m512 s[2], const __mmask16 vis[2], float m, float* mn) {
    const __m512 up = _mm512_set1_ps(m + LAZY);
    if (!(_mm512_mask_cmp_ps_mask(vis[0], s[0], up, _CMP_GT_OQ) | _mm512_mask_cmp_ps_mask(vis[1], s[1], up, _CMP_GT_OQ)))
        return 0;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 t = _mm512_mask_max_ps(ninf, vis[0], ninf, s[0]);
    *mn = _mm512_reduce_max_ps(_mm512_mask_max_ps(t, vis[1], t, s[1]));
    return 1;
}

/* the row's sum (lane-wise) and acc [D] from maximum m to mn: times 2^(m - mn) */
ALWAYS_INLINE void rescale_row(__m512* l, float* acc, int64_t D, float m, float mn) {
    const __m512 al = exp2_ps(_mm512_set1_ps(m - mn));
    *l = _mm512_mul_ps(*l, al);
    for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), al));
}

/* p = 2^(s - m), zero on the keys the row does not see (diag: the block crosses the diagonal), added to the sum */
ALWAYS_INLINE void row_p(const __m512 s[2], const __mmask16 vis[2], int diag, float m, __m512 p[2], __m512* l) {
    const __m512 mv = _mm512_set1_ps(m);
    for (int w = 0; w < 2; w++) {
        p[w] = exp2_ps(_mm512_sub_ps(s[w], mv));
        if (diag) p[w] = _mm512_maskz_mov_ps(vis[w], p[w]);
    }
    *l = _mm512_add_ps(*l, _mm512_add_ps(p[0], p[1]));
}

/* acc[r][c .. c + 16 W) += sum_{j < jn} pb[r][j] v[j][c ...], W = 1 or 2 vectors (a rescale ran before, where due) */
#define PV(W)                                                                                            \
    do {                                                                                                 \
        __m512 a[MQ][W];                                                                                 \
        _Pragma("GCC unroll 16") for (int r = 0; r < MQ; r++)                                            \
            _Pragma("GCC unroll 2") for (int w = 0; w < W; w++) a[r][w] = _mm512_loadu_ps(acc[r] + c + 16 * w); \
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
    float m[MQ];
    const float scale2 = scale * 1.44269504088896341f; /* scores in log2 units (exp2_ps) */
    __m512 lv[MQ]; /* the rows' softmax sums, lane-wise (summed once at the end) */
    for (int r = 0; r < MQ; r++) {
        for (int64_t d = 0; d < D; d++) qs[r][d] = r < nq ? q[(i0 + r) * sqp + d] * scale2 : 0.0f;
        memset(acc[r], 0, sizeof(float) * D);
        m[r] = -INFINITY;
        lv[r] = _mm512_setzero_ps();
    }
    const int64_t last = i0 + nq - 1; /* keys 0 .. last are visible to some row */
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
        /* the online softmax (max_moves, rescale_row, row_p); masks on the diagonal block only */
        const int diag = j0 + KB - 1 > i0; /* some row does not see every key of this block */
#pragma GCC unroll 16
        for (int r = 0; r < MQ; r++) {
            const int64_t n = i0 + r - j0 + 1; /* keys j0 .. i0 + r of this block are visible */
            const __mmask16 vis[2] = {diag ? first_lanes(n) : (__mmask16)0xffff, diag ? first_lanes(n - 16) : (__mmask16)0xffff};
            float mn;
            if (max_moves(s[r], vis, m[r], &mn)) {
                if (m[r] != -INFINITY) rescale_row(&lv[r], acc[r], D, m[r], mn); /* zero until the row's first key */
                m[r] = mn;
            }
            __m512 p[2];
            row_p(s[r], vis, diag, m[r], p, &lv[r]);
            _mm512_storeu_ps(pb[r], p[0]);
            _mm512_storeu_ps(pb[r] + 16, p[1]);
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* ------------------------------------------------------------------------------------------------------
 * AMX: the same attention with both products on the tile unit, float32-class accuracy ("bf16x3").
 *
 * Each float32 operand x is split exactly into three bfloat16 parts, x = x0 + x1 + x2 (split3_ps: x0 is x
 * truncated to 8 significand bits, x1 the remainder's top 8, x2 what is left, at most 8 bits; each
 * subtraction is exact in float32). A product x y is then the six terms x0 y0 + x1 y0 + x2 y0 + x0 y1 +
 * x1 y1 + x0 y2 (the three dropped ones are below 2^-21 |x y| together), each bf16 x bf16 product exact in
 * float32, accumulated by TDPBF16PS in float32. So a score q . k and an output sum_j p_j v_j carry
 * float32-class error, like the AVX-512 tile's FMA chains (measured closer to a float64 reference), but
 * round differently: prompts only, as the AVX-512 tile, and never mixed within one call.
 *
 * A tile is 16 query rows of one head; a block 32 keys: the scores as two 16 x 16 tiles (6 TDPBF16PS each
 * per 32 head dims, two independent chains), an online softmax on AVX-512 in log2 units (scale * log2 e
 * folded into the queries, exp2_ps) with the AVX-512 tile's lazy maximum (max_moves, rescale_row, row_p),
 * p split into three parts, then p @ V as 16 x 16
 * tiles over 16 head dims each (6 TDPBF16PS). K and V are packed once per KV head into the tiles' layouts
 * (pack_kv_amx). Block b + 1's scores are issued before block b's softmax and block b's p @ V is added after
 * block b + 1's, so the tile unit and the vector units can overlap. AMX reads bfloat16 inputs below 2^-126 as
 * zero (parts of values that small). One thread, the kernel alone against the AVX-512 tile with the same
 * softmax (2026-12-06, Xeon): demo heads (4 / 2, D 32) 128 tokens 1.06x, 256 1.15x, 394-2,600 1.22-1.25x;
 * SmolLM2's (9 / 3, D 64) 128-200 tokens 0.99-1.01x, 300-1,000 1.12-1.15x. At 64 tokens it measured no faster
 * than the AVX-512 tile of the time (the split and the packing), hence AMX_MIN_P.
 * ------------------------------------------------------------------------------------------------------ */
#define AQ 16 /* query rows per AMX tile */
#define AK 32 /* keys per block (one PV tile's contraction) */
#define AMX_MIN_P 128 /* shorter prompts run the AVX-512 tile: as fast or faster below ~128 tokens (the split and packing) */

static int pf_amx_on = -1; /* -1 undecided; 0 off; 1 on */
static int64_t pf_amx_calls = 0; /* calls the AMX path ran (kernels/cpu_prefill.py amx_calls: tests see the path) */

static inline int pf_amx(void) { return prompt_amx_get(&pf_amx_on); }
int tritonspec_prefill_amx(int on) { return prompt_amx_set(&pf_amx_on, on); } /* amx.h */
int64_t tritonspec_prefill_amx_calls(void) { return pf_amx_calls; }

/* One KV head's K and V as AMX B tiles (1 KB each, three parts in a row), zero past P:
 *   K: tile ((n * DC + dc) * 3 + part): keys 16 n .. 16 n + 15 x head dims 32 dc .. 32 dc + 31, [d / 2][key][d % 2];
 *   V: tile ((blk * C + c) * 3 + part): keys 32 blk .. + 31 x head dims 16 c .. 16 c + 15, [key / 2][d][key % 2]. */
static void pack_kv_amx(const float* k, int64_t skp, const float* v, int64_t svp, int64_t P, int64_t D, int64_t nblk,
                        uint16_t* kt, uint16_t* vt) {
    const int64_t DC = D / 32, C = D / 16;
    const size_t bytes = (size_t)(nblk * AK * D * 3) * sizeof(uint16_t);
    if (P % AK) { /* the last block's keys past P */
        memset(kt + (nblk - 1) * AK * D * 3, 0, bytes / nblk);
        memset(vt + (nblk - 1) * AK * D * 3, 0, bytes / nblk);
    }
    /* a key's 16 d-pairs go down one column of its K tile: uint32 element 16 i + j % 16 for pair i */
    const __m512i down = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    /* two keys' 16 head dims interleaved: (j, d) at 2 d, (j + 1, d) at 2 d + 1 */
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t j = 0; j < P; j++)
        for (int64_t dc = 0; dc < DC; dc++) {
            __m512 a[3], b[3];
            split3_ps(_mm512_loadu_ps(k + j * skp + dc * 32), &a[0], &a[1], &a[2]);
            split3_ps(_mm512_loadu_ps(k + j * skp + dc * 32 + 16), &b[0], &b[1], &b[2]);
            uint16_t* kb = kt + ((j / 16) * DC + dc) * 3 * 512;
            for (int t = 0; t < 3; t++)
                _mm512_i32scatter_epi32((int*)(kb + t * 512) + j % 16, down, bf16_pair(a[t], b[t]), 4);
        }
    for (int64_t j = 0; j < P; j += 2)
        for (int64_t c = 0; c < C; c++) {
            __m512 a[3], b[3];
            split3_ps(_mm512_loadu_ps(v + j * svp + c * 16), &a[0], &a[1], &a[2]);
            split3_ps(j + 1 < P ? _mm512_loadu_ps(v + (j + 1) * svp + c * 16) : _mm512_setzero_ps(), &b[0], &b[1], &b[2]);
            uint16_t* vb = vt + ((j / AK) * C + c) * 3 * 512 + ((j % AK) / 2) * 32;
            for (int t = 0; t < 3; t++)
                _mm512_store_si512(vb + t * 512, _mm512_permutexvar_epi16(zip, bf16_pair(a[t], b[t])));
        }
}

/* the scores of key block blk (log2 units) into tiles 0 (keys 32 blk .. + 15) and 1 (the next 16); stored by
 * amx_scores_store */
ALWAYS_INLINE void amx_scores(uint16_t (*qa)[3][AQ][32], const uint16_t* kt, int64_t blk, int64_t DC) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t dc = 0; dc < DC; dc++) {
        _tile_loadd(2, qa[dc][0], 64);
        _tile_loadd(3, qa[dc][1], 64);
        _tile_loadd(4, qa[dc][2], 64);
        six_terms(kt + ((2 * blk) * DC + dc) * 3 * 512, kt + ((2 * blk + 1) * DC + dc) * 3 * 512);
    }
}
ALWAYS_INLINE void amx_scores_store(float* s) { /* s [AQ][AK] */
    _tile_stored(0, s, AK * 4);
    _tile_stored(1, s + 16, AK * 4);
}

/* ot [AQ][D] = p @ V of key block blk (p's parts pa [3][AQ][AK]), 32 head dims at a time in tiles 0 and 1 */
ALWAYS_INLINE void amx_pv(uint16_t (*pa)[AQ][AK], const uint16_t* vt, int64_t blk, int64_t C, float* ot) {
    _tile_loadd(2, pa[0], 64);
    _tile_loadd(3, pa[1], 64);
    _tile_loadd(4, pa[2], 64);
    for (int64_t c = 0; c < C; c += 2) {
        const uint16_t* v0 = vt + (blk * C + c) * 3 * 512;
        _tile_zero(0);
        _tile_zero(1);
        six_terms(v0, v0 + 3 * 512);
        _tile_stored(0, ot + c * 16, C * 64);
        _tile_stored(1, ot + c * 16 + 16, C * 64);
    }
}

/* acc [AQ][D] += ot [AQ][D] (a block's p @ V) */
ALWAYS_INLINE void add_block(float* acc, const float* ot, int64_t D) {
    for (int r = 0; r < AQ; r++)
        for (int64_t c = 0; c < D; c += 16)
            _mm512_store_ps(acc + r * D + c, _mm512_add_ps(_mm512_load_ps(acc + r * D + c), _mm512_load_ps(ot + r * D + c)));
}

/* Query rows i0 .. i0 + nq - 1 (nq <= AQ) of one head over its KV head's packed K and V (pack_kv_amx). The
 * thread's tile configuration is loaded (tiles 0-7: 16 rows x 64 bytes). Software-pipelined: block b + 1's
 * scores are issued to the tile unit before block b's softmax runs on the vector units, and block b's p @ V is
 * added to acc only after block b + 1's softmax (double buffers s, pa, ot), so the two units overlap. */
static void tile_amx(const float* q, int64_t sqp, const uint16_t* kt, const uint16_t* vt, float* o, int64_t sop,
                     int64_t i0, int nq, int64_t D, float scale) {
    const int64_t DC = D / 32, C = D / 16;
    uint16_t qa[PF_MAX_D / 32][3][AQ][32] __attribute__((aligned(64)));
    uint16_t pa[2][3][AQ][AK] __attribute__((aligned(64)));
    float s[2][AQ][AK] __attribute__((aligned(64)));
    float ot[2][AQ * PF_MAX_D] __attribute__((aligned(64))); /* rows of D (a row's stride is D, not PF_MAX_D: */
    float accb[AQ * PF_MAX_D] __attribute__((aligned(64)));  /* the tile's working set stays small in L1) */
    __m512 l[AQ]; /* the rows' sums, lane-wise */
    float m[AQ];
    const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f); /* scores in log2 units */
    for (int r = 0; r < AQ; r++) {
        for (int64_t dc = 0; dc < DC; dc++) {
            const float* qr = q + (i0 + r) * sqp + dc * 32;
            __m512 x[3], y[3];
            split3_ps(r < nq ? _mm512_mul_ps(_mm512_loadu_ps(qr), sc) : _mm512_setzero_ps(), &x[0], &x[1], &x[2]);
            split3_ps(r < nq ? _mm512_mul_ps(_mm512_loadu_ps(qr + 16), sc) : _mm512_setzero_ps(), &y[0], &y[1], &y[2]);
            for (int t = 0; t < 3; t++) _mm512_store_si512(qa[dc][t][r], bf16_pair(x[t], y[t]));
        }
        memset(accb + r * D, 0, sizeof(float) * D);
        l[r] = _mm512_setzero_ps();
        m[r] = -INFINITY;
    }
    const int64_t last = i0 + nq - 1, nb = last / AK + 1; /* key blocks some row sees */
    int64_t pending = -1; /* the block whose p @ V is in ot but not yet in acc */
    amx_scores(qa, kt, 0, DC);
    amx_scores_store(&s[0][0][0]);
    for (int64_t blk = 0; blk < nb; blk++) {
        const int64_t j0 = blk * AK;
        if (blk + 1 < nb) amx_scores(qa, kt, blk + 1, DC);
        float(*sb)[AK] = s[blk & 1];
        /* the online softmax (max_moves, rescale_row, row_p); masks on the diagonal block only */
        const int diag = j0 + AK - 1 > i0; /* some row does not see every key of this block */
        for (int r = 0; r < AQ; r++) {
            const int64_t nv = i0 + r - j0 + 1;
            const __mmask16 vis[2] = {diag ? first_lanes(nv) : (__mmask16)0xffff, diag ? first_lanes(nv - 16) : (__mmask16)0xffff};
            const __m512 sv[2] = {_mm512_load_ps(sb[r]), _mm512_load_ps(sb[r] + 16)};
            float mn;
            if (max_moves(sv, vis, m[r], &mn)) {
                if (m[r] != -INFINITY) { /* acc and the sum are zero until the row's first key */
                    if (pending >= 0) { /* the previous block's p @ V belongs to the old maximum */
                        add_block(accb, ot[pending & 1], D);
                        pending = -1;
                    }
                    rescale_row(&l[r], accb + r * D, D, m[r], mn);
                }
                m[r] = mn;
            }
            __m512 p[2], x[3], y[3];
            row_p(sv, vis, diag, m[r], p, &l[r]);
            split3_ps(p[0], &x[0], &x[1], &x[2]);
            split3_ps(p[1], &y[0], &y[1], &y[2]);
            for (int t = 0; t < 3; t++) _mm512_store_si512(pa[blk & 1][t][r], bf16_pair(x[t], y[t]));
        }
        if (blk + 1 < nb) amx_scores_store(&s[(blk + 1) & 1][0][0]);
        if (pending >= 0) add_block(accb, ot[pending & 1], D);
        amx_pv(pa[blk & 1], vt, blk, C, ot[blk & 1]);
        pending = blk;
    }
    add_block(accb, ot[pending & 1], D);
    for (int r = 0; r < nq; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(l[r]));
        float* orow = o + (i0 + r) * sop;
        for (int64_t c = 0; c < D; c += 16) _mm512_storeu_ps(orow + c, _mm512_mul_ps(_mm512_load_ps(accb + r * D + c), inv));
    }
}

/* The AMX path of tritonspec_prefill_attention_f32 (D % 32 == 0). Returns 0, or 1 when out of memory. */
static int prefill_amx(const float* q, int64_t B, int64_t P, int64_t Hq, int64_t Hkv, int64_t D, int64_t sqb,
                       int64_t sqp, int64_t sqh, const float* k, int64_t skb, int64_t skp, int64_t skh, const float* v,
                       int64_t svb, int64_t svp, int64_t svh, float* out, float scale, int threads) {
    const int64_t nblk = (P + AK - 1) / AK, per = nblk * AK * D * 3; /* uint16 per KV head and tensor */
    uint16_t* kt = (uint16_t*)aligned_alloc(64, (size_t)(2 * B * Hkv * per) * sizeof(uint16_t));
    if (!kt) return 1;
    uint16_t* vt = kt + B * Hkv * per;
    const int64_t G = Hq / Hkv, ntile = (P + AQ - 1) / AQ, heads = B * Hq;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < B * Hkv; bg++) {
            const int64_t b = bg / Hkv, g = bg % Hkv;
            pack_kv_amx(k + b * skb + g * skh, skp, v + b * svb + g * svh, svp, P, D, nblk, kt + bg * per, vt + bg * per);
        }
        static const uint8_t rows16[8] = {16, 16, 16, 16, 16, 16, 16, 16};
        amx_configure(8, rows16);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntile * heads; t++) { /* the last (heaviest) query tiles first */
            const int64_t blk = ntile - 1 - t / heads, bh = t % heads, b = bh / Hq, h = bh % Hq, g = h / G;
            const int64_t i0 = blk * AQ;
            const int nq = (int)(P - i0 < AQ ? P - i0 : AQ);
            tile_amx(q + b * sqb + h * sqh, sqp, kt + (b * Hkv + g) * per, vt + (b * Hkv + g) * per,
                     out + (b * P * Hq + h) * D, Hq * D, i0, nq, D, scale);
        }
        _tile_release();
    }
    free(kt);
    return 0;
}
#else /* built without AMX: never on */
int tritonspec_prefill_amx(int on) { (void)on; return 0; }
int64_t tritonspec_prefill_amx_calls(void) { return 0; }
#endif

/* out [B, P, Hq, D] (contiguous) = causal attention of q [B, P, Hq, D] over k, v [B, P, Hkv, D] (element
 * strides s*b, s*p, s*h; unit stride along D). D % 16 == 0, D <= 256, Hq % Hkv == 0 (checked by the
 * caller). Returns 0, or 1 when the transposed-K buffer could not be allocated. */
int tritonspec_prefill_attention_f32(const float* q, int64_t B, int64_t P, int64_t Hq, int64_t Hkv, int64_t D,
                                     int64_t sqb, int64_t sqp, int64_t sqh, const float* k, int64_t skb, int64_t skp,
                                     int64_t skh, const float* v, int64_t svb, int64_t svp, int64_t svh, float* out,
                                     float scale, int threads) {
    if (B <= 0 || P <= 0 || Hq <= 0) return 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (D % 32 == 0 && P >= AMX_MIN_P && pf_amx()) {
        pf_amx_calls++;
        return prefill_amx(q, B, P, Hq, Hkv, D, sqb, sqp, sqh, k, skb, skp, skh, v, svb, svp, svh, out, scale, threads);
    }
#endif
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
