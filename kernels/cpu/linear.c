/* Row-invariant small-M linear layer for x86-64 CPUs with AVX-512 (float32) and AVX512-BF16 (bfloat16); on
 * AVX2 + FMA CPUs (and AVX-512 without BF16) avx2.h emulates the intrinsics lane for lane.
 *
 *     y[m, n] = sum_k x[m, k] * w[n, k]  (+ b[n])       x [M, K] (row stride ldx), w [N, K], y [M, N] (row stride ldy)
 *
 * Every output element is one 16-lane accumulator walked over k in ascending 16- (float32) or
 * 32-element (bfloat16 pairs, VDPBF16PS) chunks, zero-masked at the ragged end, then reduced by
 * the tree of _mm512_reduce_add_ps (a block's accumulators 16 at once, hsum.h) and the bias added
 * once. That sequence never depends on M, on which rows
 * share the call, on the blocking chosen for M, or on the thread count (threads split N), so a row's
 * result is the same bit for bit whether it is decoded alone or verified among 63 others.
 *
 * Speed: decoding reads every weight once per step, so the kernel is written to stream w at memory
 * speed: NB weight rows per block (one accumulator each per x row), the block NB rows ahead
 * prefetched into L1 while this one is multiplied, up to 4 x rows sharing each weight load.
 * Built by kernels/cpu_linear.py with gcc -O3 -march=native -fopenmp and loaded with ctypes.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "avx2.h" /* AVX2 + FMA CPUs: the AVX-512 intrinsics below, emulated lane for lane */
#include "bf16.h"
#include "hsum.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#ifndef DPBF16 /* VDPBF16PS: acc += the bfloat16 pair products (avx2.h supplies it on AVX2) */
#define DPBF16(acc, a, b) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b))
#endif

/* s[i * NB + j] = the lane sum of acc[i][j] (acc: [4][8]; the MB x NB used, 16 per hsum16). */
ALWAYS_INLINE void sums(const __m512* acc, int MB, int NB, float* s) {
    __m512 v[32];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) v[i * NB + j] = acc[i * 8 + j];
    for (int e = MB * NB; e < 32; e++) v[e] = _mm512_setzero_ps();
    for (int e = 0; e < MB * NB; e += 16) _mm512_storeu_ps(s + e, hsum16(v + e));
}

/* One block: MB x rows times NB weight rows. MB and NB are compile-time constants at every call site. */
ALWAYS_INLINE void f32_block(const float* x, int64_t ldx, const float* w, int64_t K, const float* b,
                             float* y, int64_t ldy, int MB, int NB, int prefetch) {
    __m512 acc[4][8];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t ahead = (int64_t)NB * K;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[8];
        for (int j = 0; j < NB; j++) {
            if (prefetch) _mm_prefetch((const char*)(w + j * K + k + ahead), _MM_HINT_T0);
            wv[j] = _mm512_loadu_ps(w + j * K + k);
        }
        for (int i = 0; i < MB; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < K) {
        __mmask16 mk = (__mmask16)((1u << (K - k)) - 1u);
        __m512 wv[8];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_ps(mk, w + j * K + k);
        for (int i = 0; i < MB; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(mk, x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    float s[32];
    sums(&acc[0][0], MB, NB, s);
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) y[i * ldy + j] = b ? s[i * NB + j] + b[j] : s[i * NB + j];
}

ALWAYS_INLINE void bf16_block(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t K, const uint16_t* b,
                              uint16_t* y, int64_t ldy, int MB, int NB, int prefetch) {
    __m512 acc[4][8];
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    const int64_t ahead = (int64_t)NB * K;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[8];
        for (int j = 0; j < NB; j++) {
            if (prefetch) _mm_prefetch((const char*)(w + j * K + k + ahead), _MM_HINT_T0);
            wv[j] = _mm512_loadu_si512(w + j * K + k);
        }
        for (int i = 0; i < MB; i++) {
            __m512i xv = _mm512_loadu_si512(x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] = DPBF16(acc[i][j], xv, wv[j]);
        }
    }
    if (k < K) {
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1ull);
        __m512i wv[8];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_epi16(mk, w + j * K + k);
        for (int i = 0; i < MB; i++) {
            __m512i xv = _mm512_maskz_loadu_epi16(mk, x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] = DPBF16(acc[i][j], xv, wv[j]);
        }
    }
    float s[32];
    sums(&acc[0][0], MB, NB, s);
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++)
            y[i * ldy + j] = float_to_bf16(b ? s[i * NB + j] + bf16_to_float(b[j]) : s[i * NB + j]);
}

/* The rows of one NB-wide column block, in blocks of 4 rows (then 3, 2, 1). Only the first row block
 * prefetches: the later ones find the weights in L1. */
#define ROWS(BLOCK, NB, PTR_N0)                                                                          \
    for (int64_t m0 = 0; m0 < M; m0 += 4) {                                                               \
        int pf = m0 == 0;                                                                                 \
        int64_t left = M - m0;                                                                            \
        const T* xm = x + m0 * ldx;                                                                       \
        T* ym = y + m0 * ldy + n0;                                                                        \
        const T* bn = b ? b + n0 : 0;                                                                     \
        if (left >= 4) BLOCK(xm, ldx, PTR_N0, K, bn, ym, ldy, 4, NB, pf);                                 \
        else if (left == 3) BLOCK(xm, ldx, PTR_N0, K, bn, ym, ldy, 3, NB, pf);                            \
        else if (left == 2) BLOCK(xm, ldx, PTR_N0, K, bn, ym, ldy, 2, NB, pf);                            \
        else BLOCK(xm, ldx, PTR_N0, K, bn, ym, ldy, 1, NB, pf);                                           \
    }

/* Columns split over threads in whole NB-blocks; the last, ragged block runs one column at a time
 * (same arithmetic per element, NB only decides how many share a loop). NB is NB_FEW for one or two
 * rows (more independent chains while streaming) and NB_MANY otherwise (register budget: 4 x NB_MANY
 * accumulators): 8 and 4 with AVX-512's 32 registers, 4 and 2 with AVX2's 16 (each emulated 16-lane
 * accumulator takes two). */
#ifdef __AVX512F__
#define NB_FEW 8
#define NB_MANY 4
#else
#define NB_FEW 4
#define NB_MANY 2
#endif
#define LINEAR(NAME, T, BLOCK)                                                                            \
    void NAME(const T* x, int64_t M, int64_t ldx, const T* w, int64_t N, int64_t K, const T* b, T* y,   \
              int64_t ldy, int threads) {                                                                 \
        const int NBW = M <= 2 ? NB_FEW : NB_MANY;                                                        \
        const int64_t blocks = N / NBW;                                                                   \
        if (NBW == NB_FEW) {                                                                              \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
            for (int64_t blk = 0; blk < blocks; blk++) {                                                  \
                int64_t n0 = blk * NB_FEW;                                                                \
                ROWS(BLOCK, NB_FEW, w + n0 * K)                                                           \
            }                                                                                             \
        } else {                                                                                          \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
            for (int64_t blk = 0; blk < blocks; blk++) {                                                  \
                int64_t n0 = blk * NB_MANY;                                                               \
                ROWS(BLOCK, NB_MANY, w + n0 * K)                                                          \
            }                                                                                             \
        }                                                                                                 \
        for (int64_t n0 = blocks * NBW; n0 < N; n0++) {                                                   \
            ROWS(BLOCK, 1, w + n0 * K)                                                                    \
        }                                                                                                 \
    }

#define T float
LINEAR(tritonspec_linear_f32, float, f32_block)
#undef T
#define T uint16_t
LINEAR(tritonspec_linear_bf16, uint16_t, bf16_block)
#undef T

/* ---------------------------------------------------------------------------------------------
 * float32 on weights packed into 16-column panels (kernels/cpu_linear.py pack_f32, once at load).
 *
 * The kernel above keeps each output in a 16-lane accumulator and reduces it at the end, so every
 * output needs its own weight row in a register: with many rows it runs at ~35-45% of the FMA peak,
 * and one row is latency-bound on the reduction. Here each output is one lane, accumulated over k
 * (an outer product, as BLAS GEMMs do), so a register tile of MR rows x 16 NP columns shares every
 * weight load among MR rows and every x broadcast among 16 NP columns:
 *
 *     y[m][n] = fma(x[m][K-1], w[n][K-1], ... fma(x[m][1], w[n][1], fma(x[m][0], w[n][0], +0.0)) ...)  (+ b[n])
 *
 * one fused multiply-add per k in ascending order from +0.0, then the bias added once. That sequence
 * is the same for any tile shape (MR, NP), any M, any other rows and any thread count (threads split
 * the panels), and for any vector width (each lane is one scalar chain): row invariance by
 * construction, and the same bits on every CPU with FMA.
 *
 * Packed layout: wp [N/16][K][16], wp[p][k][j] = w[16 p + j][k]: a panel's k-steps are consecutive
 * 64-byte lines (one linear stream per panel). Tiles (MR x NP panels, 2 NP accumulators of 8 lanes
 * per row, at most 12 of AVX2's 16 registers): one row 1 x 4 (eight independent chains, four
 * streams), two rows 2 x 3, three 3 x 2, four 2 x 3 twice, five 3 x 2 + 2 x 2, more 6 x 1 (then the
 * leftover rows). The first row tile of a panel group prefetches 16 lines ahead; the later ones find
 * the group in L1/L2. Measured (AMD EPYC Zen 3, 2 threads, SmolLM2's projections and head, float32):
 * 0.6-0.75x the time of the kernel above at 1-3 rows, ~0.7x at 6-16, ~0.5x at 64 and more; faster
 * than MKL's sgemm up to 256 rows (perf/CPU_DECODE.md).
 * --------------------------------------------------------------------------------------------- */
#define PANEL 16
#define PANEL_AHEAD 16

ALWAYS_INLINE void panel_tile(const float* x, int64_t ldx, const float* wp, int64_t K, const float* b, float* y,
                              int64_t ldy, int MR, int NP, int prefetch) {
    const int64_t ps = K * PANEL; /* panel stride */
    __m256 acc[6][8];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 2 * NP; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 w[8];
        for (int p = 0; p < NP; p++) {
            const float* line = wp + p * ps + k * PANEL;
            w[2 * p] = _mm256_loadu_ps(line);
            w[2 * p + 1] = _mm256_loadu_ps(line + 8);
            if (prefetch) _mm_prefetch((const char*)(line + PANEL_AHEAD * PANEL), _MM_HINT_T0);
        }
        for (int i = 0; i < MR; i++) {
            const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
            for (int j = 0; j < 2 * NP; j++) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
        }
    }
#pragma GCC unroll 6 /* so the accumulators stay in registers in the k loop: see panel_tile_bf16 */
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * NP; j++) {
            __m256 s = acc[i][j];
            if (b) s = _mm256_add_ps(s, _mm256_loadu_ps(b + j * 8));
            _mm256_storeu_ps(y + i * ldy + j * 8, s);
        }
}

#define PANEL_TILE(MR, NP)                                                                              \
    panel_tile(x + m0 * ldx, ldx, wp + pn * K * PANEL, K, b ? b + pn * PANEL : 0, y + m0 * ldy + pn * PANEL, \
               ldy, MR, NP, m0 == 0)

/* every row of x against panels [pn, pn + NP), in row tiles of MRX = 6 / NP rows (6, 3, 2, 1), the
 * leftover rows in one smaller tile */
#define PANEL_GROUP(NP, MRX)                                                                            \
    ALWAYS_INLINE void panel_group##NP(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t K, \
                                       const float* b, float* y, int64_t ldy, int64_t pn) {            \
        int64_t m0 = 0;                                                                                \
        for (; m0 + MRX <= M; m0 += MRX) PANEL_TILE(MRX, NP);                                          \
        switch (M - m0) {                                                                              \
            case 5: PANEL_TILE(5, NP); break;                                                          \
            case 4: PANEL_TILE(4, NP); break;                                                          \
            case 3: PANEL_TILE(3, NP); break;                                                          \
            case 2: PANEL_TILE(2, NP); break;                                                          \
            case 1: PANEL_TILE(1, NP); break;                                                          \
        }                                                                                              \
    }
PANEL_GROUP(1, 6)
PANEL_GROUP(2, 3)
PANEL_GROUP(3, 2)
PANEL_GROUP(4, 1)

#ifdef __AVX512F__
/* AVX-512 tiles for many rows: MR rows x NP panels, one 16-lane accumulator per row and panel (at most
 * 6 x 4 = 24 of the 32 registers, 4 weight registers, a broadcast): per k, NP loads and MR broadcasts
 * feed MR x NP fused multiply-adds (the 8-lane 6 x 1 tile above: 2 loads and 6 broadcasts feed 12 half
 * as wide). Each lane is the same chain over k as above (vector width never changes a lane's
 * arithmetic), so these tiles give the same bits. */
ALWAYS_INLINE void panel_tile512(const float* x, int64_t ldx, const float* wp, int64_t K, const float* b, float* y,
                                 int64_t ldy, int MR, int NP, int prefetch) {
    const int64_t ps = K * PANEL;
    __m512 acc[6][4];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NP; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 w[4];
        for (int p = 0; p < NP; p++) {
            const float* line = wp + p * ps + k * PANEL;
            w[p] = _mm512_loadu_ps(line);
            if (prefetch) _mm_prefetch((const char*)(line + PANEL_AHEAD * PANEL), _MM_HINT_T0);
        }
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
            for (int j = 0; j < NP; j++) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 4
        for (int j = 0; j < NP; j++) {
            __m512 s = acc[i][j];
            if (b) s = _mm512_add_ps(s, _mm512_loadu_ps(b + j * PANEL));
            _mm512_storeu_ps(y + i * ldy + j * PANEL, s);
        }
}

#define PANEL_TILE512(MR, NP)                                                                              \
    panel_tile512(x + m0 * ldx, ldx, wp + pn * K * PANEL, K, b ? b + pn * PANEL : 0, y + m0 * ldy + pn * PANEL, \
                  ldy, MR, NP, m0 == 0)

#define PANEL_GROUP512(NP)                                                                              \
    ALWAYS_INLINE void panel_group512_##NP(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t K, \
                                           const float* b, float* y, int64_t ldy, int64_t pn) {        \
        int64_t m0 = 0;                                                                                \
        for (; m0 + 6 <= M; m0 += 6) PANEL_TILE512(6, NP);                                             \
        switch (M - m0) {                                                                              \
            case 5: PANEL_TILE512(5, NP); break;                                                       \
            case 4: PANEL_TILE512(4, NP); break;                                                       \
            case 3: PANEL_TILE512(3, NP); break;                                                       \
            case 2: PANEL_TILE512(2, NP); break;                                                       \
            case 1: PANEL_TILE512(1, NP); break;                                                       \
        }                                                                                              \
    }
PANEL_GROUP512(1)
PANEL_GROUP512(2)
PANEL_GROUP512(4)

/* Calls with at least this many rows run the AVX-512 tiles (0: never; kernels/cpu_linear.py
 * set_wide_panel_rows, for side-by-side measurements). Measured (AMD EPYC Zen 4, 2026-12-05, 1 and 2
 * threads, the demo and SmolLM2 projections): 0.7-0.85x the 8-lane tiles' time from 8 rows on,
 * 0.85-1.05x at 6-7, up to 1.27x at 4 (small K): so from 6 rows. Returns the previous value. */
static int wide_rows = 6;
int tritonspec_panels_wide_rows(int rows) {
    const int old = wide_rows;
    if (rows >= 0) wide_rows = rows;
    return old;
}

/* Tall tiles for 7..TALL_ROWS rows: the rows in balanced row tiles of 7..14 (MR x 2 panels <= 28
 * accumulators, 2 weight registers, a broadcast); one tile runs all of k, several take turns over blocks of
 * TALL_BLOCK k-steps, each tile's accumulators parked in a buffer between its blocks (stored and reloaded
 * exactly: the chain is unchanged). The first tile streams a block from memory, prefetching TALL_AHEAD
 * k-steps ahead, and the others find it in L1, so the FMAs of every tile run while the weights stream.
 * The 6 x 4 tiles above take such a call in row tiles that each walk the whole panel group: the first
 * streams it from memory, the others re-read it from L2 with no memory traffic to overlap. Measured (Intel
 * Xeon with AMX, SmolLM2's float32 projections and head, 2 threads, 2026-12-05), time over one row's:
 * 7 rows 1.10-1.14x -> 1.04-1.10x, 14 rows 1.41x -> 1.19x, 19 rows 1.71x -> 1.37x, 28 rows 2.07x -> 1.62x, 64 rows
 * 3.69x -> 3.24x, 112 rows 5.26x -> 5.16x; 256 rows level, 512 rows 1.19x slower (so TALL_ROWS stops at 112).
 * One panel for up to 28 rows in one tile (15+ broadcasts per 64-byte load) ran slower than the 6-row tiles.
 * Same lanes, same chains, same bits. */
#define TALL_TILE 14
#define TALL_TILES 8
/* tall_group's switch covers tiles of 7..14 rows: M > 14 split into ceil(M / 14) balanced tiles never gives
 * fewer than 7 */
_Static_assert(TALL_TILE == 14, "tall_group's TALL_CASEs cover tiles of 7..14 rows");
#define TALL_BLOCK 32
#define TALL_AHEAD 48

ALWAYS_INLINE void tall_tile(const float* x, int64_t ldx, const float* wp, int64_t K, const float* b, float* y,
                             int64_t ldy, int MR, int NP, int64_t k0, int64_t k1, __m512* park, int prefetch) {
    const int64_t ps = K * PANEL;
    __m512 acc[2 * TALL_TILE];
#pragma GCC unroll 28
    for (int a = 0; a < MR * NP; a++) acc[a] = k0 == 0 ? _mm512_setzero_ps() : park[a];
    for (int64_t k = k0; k < k1; k++) {
        __m512 w[2];
#pragma GCC unroll 2
        for (int p = 0; p < NP; p++) {
            const float* line = wp + p * ps + k * PANEL;
            w[p] = _mm512_loadu_ps(line);
            if (prefetch) _mm_prefetch((const char*)(line + TALL_AHEAD * PANEL), _MM_HINT_T0);
        }
#pragma GCC unroll 14
        for (int i = 0; i < MR; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
#pragma GCC unroll 2
            for (int p = 0; p < NP; p++) acc[i * NP + p] = _mm512_fmadd_ps(xv, w[p], acc[i * NP + p]);
        }
    }
    if (k1 < K) {
#pragma GCC unroll 28
        for (int a = 0; a < MR * NP; a++) park[a] = acc[a];
        return;
    }
#pragma GCC unroll 14
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 2
        for (int p = 0; p < NP; p++) {
            __m512 s = acc[i * NP + p];
            if (b) s = _mm512_add_ps(s, _mm512_loadu_ps(b + p * PANEL));
            _mm512_storeu_ps(y + i * ldy + p * PANEL, s);
        }
}

#define TALL_CASE(MR)                                                                            \
    case MR:                                                                                     \
        if (np == 2) tall_tile(xr, ldx, wq, K, bq, yr, ldy, (MR), 2, k0, k1, park[t], t == 0);   \
        else tall_tile(xr, ldx, wq, K, bq, yr, ldy, (MR), 1, k0, k1, park[t], t == 0);           \
        break;

/* every row (7 <= M <= TALL_TILES x TALL_TILE) against panels [pn, pn + np) */
static void tall_group(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t K, const float* b, float* y,
                       int64_t ldy, int64_t pn, int np) {
    const float* wq = wp + pn * K * PANEL;
    const float* bq = b ? b + pn * PANEL : 0;
    __m512 park[TALL_TILES][2 * TALL_TILE];
    const int64_t tiles = (M + TALL_TILE - 1) / TALL_TILE, base = M / tiles, extra = M % tiles; /* base >= 7 */
    const int64_t block = tiles == 1 ? K : TALL_BLOCK;
    for (int64_t k0 = 0; k0 < K; k0 += block) {
        const int64_t k1 = k0 + block < K ? k0 + block : K;
        int64_t m0 = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t mr = base + (t < extra);
            const float* xr = x + m0 * ldx;
            float* yr = y + m0 * ldy + pn * PANEL;
            switch (mr) {
                TALL_CASE(7) TALL_CASE(8) TALL_CASE(9) TALL_CASE(10) TALL_CASE(11) TALL_CASE(12) TALL_CASE(13)
                TALL_CASE(14)
            }
            m0 += mr;
        }
    }
}

/* Calls of 7 up to this many rows (at most TALL_TILES x TALL_TILE = 112; 0: none) run the tall tiles
 * (kernels/cpu_linear.py set_tall_panel_rows, for side-by-side measurements). Returns the previous value. */
static int tall_rows = TALL_TILES * TALL_TILE;
int tritonspec_panels_tall_rows(int rows) {
    const int old = tall_rows;
    if (rows >= 0) tall_rows = rows > TALL_TILES * TALL_TILE ? TALL_TILES * TALL_TILE : rows;
    return old;
}

/* calls that ran the tall tiles (kernels/cpu_linear.py tall_panel_calls: tests see the path taken) */
static int64_t tall_calls;
int64_t tritonspec_panels_tall_calls(void) { return tall_calls; }

/* every row against every panel in tall tiles, in tasks of 2 panels (1 where fewer panels than 2 tasks a
 * thread would leave a thread idle); the odd panel left over alone */
static void panels512_tall(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t panels, int64_t K,
                           const float* b, float* y, int64_t ldy, int threads) {
    tall_calls++;
    const int NP = panels >= 2 * 2 * threads ? 2 : 1;
    const int64_t groups = panels / NP, tasks = groups + (panels - groups * NP);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        if (t >= groups) tall_group(x, M, ldx, wp, K, b, y, ldy, groups * NP + (t - groups), 1);
        else tall_group(x, M, ldx, wp, K, b, y, ldy, t * NP, NP);
    }
}

/* every row of x against every panel, in tasks of 4 panels (the 6 x 4 tile), or 2 or 1 where fewer
 * panels than 2 tasks a thread would leave a thread idle; then the panels left over one at a time */
static void panels512(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t panels, int64_t K,
                      const float* b, float* y, int64_t ldy, int threads) {
    const int NP = panels >= 4 * 2 * threads ? 4 : panels >= 2 * 2 * threads ? 2 : 1;
    const int64_t groups = panels / NP, tasks = groups + (panels - groups * NP);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        if (t >= groups) {
            panel_group512_1(x, M, ldx, wp, K, b, y, ldy, groups * NP + (t - groups));
            continue;
        }
        switch (NP) {
            case 4: panel_group512_4(x, M, ldx, wp, K, b, y, ldy, t * 4); break;
            case 2: panel_group512_2(x, M, ldx, wp, K, b, y, ldy, t * 2); break;
            default: panel_group512_1(x, M, ldx, wp, K, b, y, ldy, t);
        }
    }
}
#else
int tritonspec_panels_wide_rows(int rows) { /* no AVX-512: the 8-lane tiles only */
    (void)rows;
    return 0;
}
int tritonspec_panels_tall_rows(int rows) { /* no AVX-512: the 8-lane tiles only */
    (void)rows;
    return 0;
}
int64_t tritonspec_panels_tall_calls(void) { return 0; }
#endif

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w^T (+ b), w packed into N / 16 panels. */
void tritonspec_linear_f32_panels(const float* x, int64_t M, int64_t ldx, const float* wp, int64_t N, int64_t K,
                                  const float* b, float* y, int64_t ldy, int threads) {
    const int64_t panels = N / PANEL;
#ifdef __AVX512F__
    if (wide_rows > 0 && M >= wide_rows && M >= 7 && M <= tall_rows && panels > 0 && K > 0) {
        panels512_tall(x, M, ldx, wp, panels, K, b, y, ldy, threads < 1 ? 1 : threads);
        return;
    }
    if (wide_rows > 0 && M >= wide_rows && panels > 0) {
        panels512(x, M, ldx, wp, panels, K, b, y, ldy, threads < 1 ? 1 : threads);
        return;
    }
#endif
    const int NP = M == 1 ? 4 : (M == 2 || M == 4) ? 3 : (M == 3 || M == 5) ? 2 : 1;
    const int64_t groups = panels / NP, tasks = groups + (panels - groups * NP);
    if (M <= 0 || panels <= 0) return;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        if (t >= groups) { /* the panels left over after the groups of NP, one at a time */
            panel_group1(x, M, ldx, wp, K, b, y, ldy, groups * NP + (t - groups));
            continue;
        }
        switch (NP) {
            case 4: panel_group4(x, M, ldx, wp, K, b, y, ldy, t * 4); break;
            case 3: panel_group3(x, M, ldx, wp, K, b, y, ldy, t * 3); break;
            case 2: panel_group2(x, M, ldx, wp, K, b, y, ldy, t * 2); break;
            default: panel_group1(x, M, ldx, wp, K, b, y, ldy, t);
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * bfloat16 on weights packed into 16-column panels (kernels/cpu_linear.py pack_panels, once at load):
 * the kernel above on half the bytes. bfloat16 -> float32 is exact (the bits shifted left by 16), so
 *
 *     y[m][n] = bf16(fma(x[m][K-1], w[n][K-1], ... fma(x[m][0], w[n][0], +0.0) ...) (+ b[n]))
 *
 * is the float32 panel kernel's chain on the widened values, rounded once to bfloat16 (nearest even):
 * bit for bit tritonspec_linear_f32_panels(x.float(), w.float(), b.float()) rounded, and row-invariant
 * the same way. x is widened once per call into a float32 buffer (M x K), so a row tile broadcasts
 * from it as the float32 kernel does.
 *
 * Packed layout: wp [N/16][K][16] uint16, pairs interleaved so one 32-byte load widens to two 8-lane
 * vectors with one shift and one mask: wp[p][k][2 j + h] = w[16 p + 8 h + j][k] (j < 8, h < 2), so
 * the 32-bit lane j holds column j in its low half and column 8 + j in its high half.
 * --------------------------------------------------------------------------------------------- */
#define PANEL_AHEAD_BF16 32 /* k-steps prefetched ahead: 32 half-lines = 16 cache lines */

/* 8 bfloat16 -> float32 (exact) */
ALWAYS_INLINE __m256 widen_bf16x8(const uint16_t* h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)h)), 16));
}

/* 8 float32 -> bfloat16, rounded to nearest even, NaN kept quiet: float_to_bf16 (bf16.h) lane for lane, in
 * registers (a scalar loop over a stored copy made gcc keep every accumulator on the stack) */
ALWAYS_INLINE void store_bf16x8(uint16_t* y, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i h = _mm256_blendv_epi8(rounded, quiet, nan); /* 0..0xffff in each 32-bit lane */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128((__m128i*)y, _mm256_castsi256_si128(packed));
}

/* y: bfloat16 output and bias (b, y), or, weight-only bfloat16, float32 ones (bf, yf; then b = y = 0): the callers
 * pass constants, so the choice folds away */
ALWAYS_INLINE void panel_tile_bf16(const float* x, int64_t ldx, const uint16_t* wp, int64_t K, const uint16_t* b,
                                   uint16_t* y, const float* bf, float* yf, int64_t ldy, int MR, int NP, int prefetch) {
    const int64_t ps = K * PANEL;
    __m256 acc[5][8]; /* MR <= 5 (PANEL_GROUP_BF16), 2 NP <= 8 */
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < 2 * NP; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        /* one panel widened at a time, used at once: two weight registers live, not 2 NP */
        for (int p = 0; p < NP; p++) {
            const uint16_t* line = wp + p * ps + k * PANEL;
            const __m256i u = _mm256_loadu_si256((const __m256i*)line);
            const __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
            const __m256 hi = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
            if (prefetch && !(k & 1)) _mm_prefetch((const char*)(line + PANEL_AHEAD_BF16 * PANEL), _MM_HINT_T0);
            for (int i = 0; i < MR; i++) {
                const __m256 xv = _mm256_broadcast_ss(x + i * ldx + k);
                acc[i][2 * p] = _mm256_fmadd_ps(xv, lo, acc[i][2 * p]);
                acc[i][2 * p + 1] = _mm256_fmadd_ps(xv, hi, acc[i][2 * p + 1]);
            }
        }
    }
    /* unrolled, so the accumulators stay in registers in the k loop (not unrolled, gcc kept a stack copy
     * of every accumulator updated at each k) */
#pragma GCC unroll 5
    for (int i = 0; i < MR; i++)
#pragma GCC unroll 8
        for (int j = 0; j < 2 * NP; j++) {
            __m256 s = acc[i][j];
            if (yf) {
                if (bf) s = _mm256_add_ps(s, _mm256_loadu_ps(bf + j * 8));
                _mm256_storeu_ps(yf + i * ldy + j * 8, s);
                continue;
            }
            if (b) s = _mm256_add_ps(s, widen_bf16x8(b + j * 8));
            store_bf16x8(y + i * ldy + j * 8, s);
        }
}

#define PANEL_TILE_BF16(MR, NP)                                                                         \
    panel_tile_bf16(x + m0 * ldx, ldx, wp + pn * K * PANEL, K, b ? b + pn * PANEL : 0,                  \
                    y ? y + m0 * ldy + pn * PANEL : 0, bf ? bf + pn * PANEL : 0,                         \
                    yf ? yf + m0 * ldy + pn * PANEL : 0, ldy, MR, NP, m0 == 0)
/* every row of x against panels [pn, pn + NP), in balanced row tiles of at most MRX rows (7 rows: 4 + 3, not
 * 6 + 1: a one-row tile of one panel has two FMA chains and runs latency-bound). One panel: at most 5 rows
 * (ten accumulators): a 6-row tile left no register for the mask and ran at half speed (SmolLM2's 121
 * matrices, 2 threads, 64 rows: 203 ms in 6-row tiles, 106 in 5-row ones; widening each panel once into a
 * float32 buffer for the row tiles to share, tried, measured 149). */
#define PANEL_GROUP_BF16(NP, MRX)                                                                       \
    ALWAYS_INLINE void panel_group_bf16_##NP(const float* x, int64_t M, int64_t ldx, const uint16_t* wp,  \
                                             int64_t K, const uint16_t* b, uint16_t* y, const float* bf,  \
                                             float* yf, int64_t ldy, int64_t pn) {                        \
        const int64_t tiles = (M + MRX - 1) / MRX, base = M / tiles, extra = M % tiles;                \
        int64_t m0 = 0;                                                                                \
        for (int64_t t = 0; t < tiles; t++) {                                                          \
            const int64_t mr = base + (t < extra);                                                     \
            switch (mr) {                                                                              \
                case 5: PANEL_TILE_BF16(5, NP); break;                                                 \
                case 4: PANEL_TILE_BF16(4, NP); break;                                                 \
                case 3: PANEL_TILE_BF16(3, NP); break;                                                 \
                case 2: PANEL_TILE_BF16(2, NP); break;                                                 \
                default: PANEL_TILE_BF16(1, NP); break;                                                \
            }                                                                                          \
            m0 += mr;                                                                                  \
        }                                                                                              \
    }
PANEL_GROUP_BF16(1, 5)
PANEL_GROUP_BF16(2, 3)
PANEL_GROUP_BF16(4, 1)

/* The float32 copy of x: a per-thread buffer kept between calls up to XBUF_KEEP floats (decode rounds: up to
 * 256 rows of K = 2048; no allocation per call), a buffer of the call's own above that (long prompts). */
#define XBUF_KEEP ((int64_t)1 << 19)
static __thread float* xbuf;
static __thread int64_t xbuf_len;

static float* x_buffer(int64_t n) {
    if (n > XBUF_KEEP) return (float*)malloc((size_t)n * sizeof(float));
    if (n > xbuf_len) {
        float* grown = (float*)realloc(xbuf, (size_t)n * sizeof(float));
        if (!grown) return 0;
        xbuf = grown;
        xbuf_len = n;
    }
    return xbuf;
}

/* y [M, N] bfloat16 (row stride ldy) = x [M, K] bfloat16 (row stride ldx) @ w^T (+ b), w packed into
 * N / 16 interleaved bfloat16 panels. Returns 0, or 1 when the float32 buffer for x could not be had. */
int tritonspec_linear_bf16_panels(const uint16_t* xh, int64_t M, int64_t ldx, const uint16_t* wp, int64_t N,
                                  int64_t K, const uint16_t* b, uint16_t* y, int64_t ldy, int threads) {
    const int64_t panels = N / PANEL;
    /* one row: 1 x 4 panels (eight chains); two: 2 x 2; more: row tiles of one panel, up to 5 rows each, so
     * up to 5 rows stream each panel once (tiles of several panels hold more widened weights than AVX2's
     * 16 registers leave room for) */
    const int NP = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int64_t groups = panels / NP, tasks = groups + (panels - groups * NP);
    if (M <= 0 || panels <= 0) return 0;
    float* x = x_buffer(M * K);
    if (!x) return 1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) x[m * K + k] = bf16_to_float(xh[m * ldx + k]);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        if (t >= groups) {
            panel_group_bf16_1(x, M, K, wp, K, b, y, 0, 0, ldy, groups * NP + (t - groups));
            continue;
        }
        switch (NP) {
            case 4: panel_group_bf16_4(x, M, K, wp, K, b, y, 0, 0, ldy, t * 4); break;
            case 2: panel_group_bf16_2(x, M, K, wp, K, b, y, 0, 0, ldy, t * 2); break;
            default: panel_group_bf16_1(x, M, K, wp, K, b, y, 0, 0, ldy, t);
        }
    }
    if (x != xbuf) free(x);
    return 0;
}

/* Weight-only bfloat16: y [M, N] float32 (row stride ldy) = x [M, K] float32 (row stride ldx) @ w^T (+ b float32),
 * w packed into N / 16 interleaved bfloat16 panels (pack_panels of a bfloat16 [N, K]). The tiles above, on x as
 * it is (no copy) and without the rounding to bfloat16:
 *
 *     y[m][n] = fma(x[m][K-1], w[n][K-1], ... fma(x[m][0], w[n][0], +0.0) ...) (+ b[n]),
 *
 * bit for bit tritonspec_linear_f32_panels(x, pack_f32(w.float()), b) (the same chain on the exactly widened
 * weights), so row-invariant the same way, on half the weight bytes: a float32 drafter's decode-round
 * projections (Eagle3Drafter.cpu_weight_dtype) at 1-4 rows take 0.45-0.85x the float32 panels' time (AMD Zen 4,
 * one thread, SmolLM2's drafter shapes), ~1x at 8 and ~1.35x at 150 (8-lane tiles of up to 5 rows of one panel;
 * widening 4 panels into float32 for the 16-lane tiles, tried, cost a pass over the weights: 1.7x at 8 rows).
 * Returns 0 (an int, as the other bfloat16 entry points). */
int tritonspec_linear_f32_bf16_panels(const float* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t N,
                                      int64_t K, const float* b, float* y, int64_t ldy, int threads) {
    const int64_t panels = N / PANEL;
    if (M <= 0 || panels <= 0) return 0;
    const int NP = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int64_t groups = panels / NP, tasks = groups + (panels - groups * NP);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tasks; t++) {
        if (t >= groups) {
            panel_group_bf16_1(x, M, ldx, wp, K, 0, 0, b, y, ldy, groups * NP + (t - groups));
            continue;
        }
        switch (NP) {
            case 4: panel_group_bf16_4(x, M, ldx, wp, K, 0, 0, b, y, ldy, t * 4); break;
            case 2: panel_group_bf16_2(x, M, ldx, wp, K, 0, 0, b, y, ldy, t * 2); break;
            default: panel_group_bf16_1(x, M, ldx, wp, K, 0, 0, b, y, ldy, t);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * bfloat16 on AMX (Sapphire Rapids and later), for weights packed once at load.
 *
 * VDPBF16PS makes a bfloat16 linear layer compute-bound from ~4 rows on (8 rows cost ~2.3 one-row
 * calls on this machine's two cores): what a speculative round's verify pays. One AMX TDPBF16PS
 * multiplies a [rows <= 16, 32] block of x by a [32, 16] block of w^T, so any row count up to 16
 * (and 64 with a few more tiles) streams the weights at memory speed, one row included.
 *
 * Packed layout (kernels/cpu_linear.py pack_bf16, done once at load): wp [N/16][K/32][16][32],
 *     wp[nb][kb][p][2 j + i] = w[16 nb + j][32 kb + 2 p + i]       (the VNNI pair layout of a B tile)
 * so a 16-column block's k-steps are consecutive 1 KB tiles: one linear stream per block.
 *
 *     C[m][j] += sum_{p < 16} x[m][32 kb + 2p] w[16 nb + j][32 kb + 2p] + (odd term)     kb = 0, 1, ...
 *
 * C[m][j] depends on x row m and weight row 16 nb + j only (the tile's other rows and columns do not
 * enter it, whatever the configured row count; tests check it), summed over kb in ascending order,
 * so a row's result is the same for any M, any other rows and any thread count (threads split the
 * column blocks): row invariance by construction. A packed weight always runs this path, so one
 * process never mixes two instruction sequences on one weight. AMX needs the CPU flags, the
 * kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, requested once) and TRITONSPEC_CPU_AMX != 0.
 * --------------------------------------------------------------------------------------------- */
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#include "amx.h"

static int amx_state = -1; /* -1 undecided, 0 off, 1 on */

int tritonspec_amx_enabled(void) {
    if (amx_state < 0) {
        const char* env = getenv("TRITONSPEC_CPU_AMX");
        if (env && strcmp(env, "0") == 0) amx_state = 0;
        else amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

/* tiles 0-3: C [rows][16] float32; 4: x [rows][32] bf16; 5-6: packed weights [16 pairs][16 x 2] */
static inline void amx_rows(int rows, int* current) {
    if (*current == rows) return;
    const uint8_t r = (uint8_t)rows, n[7] = {r, r, r, r, r, 16, 16};
    amx_configure(7, n);
    *current = rows;
}

/* 16 float32 -> bfloat16, bit for bit float_to_bf16 (round to nearest even, NaN kept quiet). */
static inline __m256i bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* y[m][n0 + j] = bf16(C[m][j] (+ b[n0 + j])) for the tile's rows */
static inline void amx_store(const float* c, int rows, const uint16_t* b, uint16_t* y, int64_t ldy, int64_t n0) {
    const __m512 bias = b ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(b + n0))), 16))
                          : _mm512_setzero_ps();
    for (int m = 0; m < rows; m++) {
        __m512 s = _mm512_load_ps(c + m * 16);
        if (b) s = _mm512_add_ps(s, bias);
        _mm256_storeu_si256((__m256i*)(y + m * ldy + n0), bf16x16(s));
    }
}

#define WTILE(NB) (wp + ((NB) * KB + kb) * 512)

/* Four column blocks nb0 .. nb0 + 3 for rows m0 .. m0 + rows - 1 (four independent accumulators keep
 * the unit busy while the weight tiles stream). */
static inline void amx_four(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t KB, int64_t nb0, int rows,
                            const uint16_t* b, uint16_t* y, int64_t ldy) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        _tile_loadd(4, x + kb * 32, ldx * 2);
        _tile_loadd(5, WTILE(nb0 + 0), 64); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, WTILE(nb0 + 1), 64); _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, WTILE(nb0 + 2), 64); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, WTILE(nb0 + 3), 64); _tile_dpbf16ps(3, 4, 6);
    }
    float c[4][16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64); _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    for (int j = 0; j < 4; j++) amx_store(c[j], rows, b, y, ldy, (nb0 + j) * 16);
}

static inline void amx_one(const uint16_t* x, int64_t ldx, const uint16_t* wp, int64_t KB, int64_t nb0, int rows,
                           const uint16_t* b, uint16_t* y, int64_t ldy) {
    _tile_zero(0);
    for (int64_t kb = 0; kb < KB; kb++) {
        _tile_loadd(4, x + kb * 32, ldx * 2);
        _tile_loadd(5, WTILE(nb0), 64);
        _tile_dpbf16ps(0, 4, 5);
    }
    float c[16 * 16] __attribute__((aligned(64)));
    _tile_stored(0, c, 64);
    amx_store(c, rows, b, y, ldy, nb0 * 16);
}
#undef WTILE

/* y [M, N] = x [M, K] (row stride ldx) @ w^T (+ b), w packed; 0, or -1 when AMX is off here. */
int tritonspec_linear_bf16_packed(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t N, int64_t K,
                                  const uint16_t* b, uint16_t* y, int64_t ldy, int threads) {
    if (!tritonspec_amx_enabled()) return -1;
    const int64_t KB = K / 32, NB = N / 16, G = NB / 4, tasks = G + (NB - 4 * G);
    if (M <= 0 || NB <= 0) return 0;
#pragma omp parallel num_threads(threads)
    {
        int current = -1;
        /* rows in chunks of 256 (a prefill: the chunk's x stays in L2 while every column block
         * passes; one chunk in decode); one task = four column blocks (then the leftover blocks one
         * by one) over the chunk's row blocks of 16, its weight tiles reused from L2 */
        for (int64_t mc = 0; mc < M; mc += 256) {
            const int64_t mend = M - mc < 256 ? M : mc + 256;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                for (int64_t m0 = mc; m0 < mend; m0 += 16) {
                    int rows = mend - m0 < 16 ? (int)(mend - m0) : 16;
                    amx_rows(rows, &current);
                    if (t < G) amx_four(x + m0 * ldx, ldx, wp, KB, 4 * t, rows, b, y + m0 * ldy, ldy);
                    else amx_one(x + m0 * ldx, ldx, wp, KB, 4 * G + (t - G), rows, b, y + m0 * ldy, ldy);
                }
            }
        }
        if (current >= 0) _tile_release();
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * float32 prompt projections on AMX: y [M, N] = x [M, K] @ w^T (+ b) in three-part bfloat16 splits.
 *
 * A prompt's forward runs hundreds of rows through each projection, compute-bound: the AVX-512 panel
 * kernel reaches this core's float32 peak there (~200 GFLOP/s). The tile unit multiplies bfloat16 at
 * several times that rate, so each float32 operand is split exactly into three bfloat16 parts (amx.h
 * split3_ps: x = x0 + x1 + x2) and six of the nine part products are kept (six_terms: the dropped
 * three are below 2^-21 of the product), each exact in float32 and accumulated by TDPBF16PS in
 * float32: float32-class error (measured closer to a float64 reference than the panel kernel), at
 * 1.4-2.0x the panel kernel's speed at 400-2,400 rows (one and two threads; from 64 rows: kernels/cpu_linear.py
 * PROMPT_AMX_ROWS; perf/CPU_DECODE.md).
 * It rounds differently from the panel kernel, so only a prompt's forward runs it (whose rows need
 * not round like a decode step's, as with MKL on AVX2 CPUs), never a decode round or deterministic
 * mode. Each output depends on its x row and weight row only, summed over k blocks in ascending
 * order: a row comes out the same in any chunk or batch and on any thread count on this path (which
 * kernels/cpu_linear.py picks by the call's row count).
 *
 * Weights (kernels/cpu_linear.py pack_amx3, once per weight, cached): wp [N/16][K/32][3][16][32],
 *     wp[nb][kb][t][p][2 j + i] = part t of w[16 nb + j][32 kb + 2 p + i]
 * x: each thread splits its chunk of rows into the same layout ([rows/16][K/32][3][16][32]) first.
 * A task is 16 rows x 32 columns: tiles 0-1 accumulate, 2-4 hold x's parts, 5-7 stream w's.
 * --------------------------------------------------------------------------------------------- */
#define AMX3_SCRATCH (1200 * 1024) /* bytes of split x rows per chunk: they stay in L2 while w passes */
#define AMX3_KC 4                  /* k steps per block (4 measured best of 2-18: 1.1-1.25x over one block) */

static int prompt_amx_on = -1; /* -1 undecided; 0 off; 1 on */
static int64_t prompt_amx_calls = 0;

static inline int prompt_amx(void) { return prompt_amx_get(&prompt_amx_on); }
int tritonspec_prompt_linear_amx(int on) { return prompt_amx_set(&prompt_amx_on, on); } /* amx.h */
int64_t tritonspec_prompt_linear_amx_calls(void) { return prompt_amx_calls; }

/* rows m0 .. m0 + rows - 1 of x (rows <= 16; zeros past them) as [K/32][3][16][32] */
static void amx3_split_rows(const float* x, int64_t ldx, int rows, int64_t KB, uint16_t* xa) {
    for (int r = 0; r < 16; r++)
        for (int64_t kb = 0; kb < KB; kb++) {
            __m512 a[3], c[3];
            if (r < rows) {
                split3_ps(_mm512_loadu_ps(x + r * ldx + kb * 32), &a[0], &a[1], &a[2]);
                split3_ps(_mm512_loadu_ps(x + r * ldx + kb * 32 + 16), &c[0], &c[1], &c[2]);
            } else {
                a[0] = a[1] = a[2] = c[0] = c[1] = c[2] = _mm512_setzero_ps();
            }
            for (int t = 0; t < 3; t++) _mm512_store_si512(xa + ((kb * 3 + t) * 16 + r) * 32, bf16_pair(a[t], c[t]));
        }
}

/* tile 0 += x (x) one column block's parts: six_terms for a single accumulator */
AMX_INLINE void six_terms_one(const uint16_t* w) {
    _tile_loadd(5, w, 64);
    _tile_dpbf16ps(0, 2, 5); /* x0 w0 */
    _tile_dpbf16ps(0, 3, 5); /* x1 w0 */
    _tile_dpbf16ps(0, 4, 5); /* x2 w0 */
    _tile_loadd(6, w + 512, 64);
    _tile_dpbf16ps(0, 2, 6); /* x0 w1 */
    _tile_dpbf16ps(0, 3, 6); /* x1 w1 */
    _tile_loadd(7, w + 1024, 64);
    _tile_dpbf16ps(0, 2, 7); /* x0 w2 */
}

/* y[m0 .. m0 + rows - 1][n0 .. n0 + 15] = tile t (+ b) */
static inline void amx3_store(int t, int rows, const float* b, float* y, int64_t ldy, int64_t n0) {
    float c[16 * 16] __attribute__((aligned(64)));
    if (rows == 16 && !b) {
        if (t == 0) _tile_stored(0, y + n0, ldy * 4);
        else _tile_stored(1, y + n0, ldy * 4);
        return;
    }
    if (t == 0) _tile_stored(0, c, 64);
    else _tile_stored(1, c, 64);
    const __m512 bias = b ? _mm512_loadu_ps(b + n0) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + r * ldy + n0, _mm512_add_ps(_mm512_load_ps(c + r * 16), bias));
}

/* 0, or -1 when it does not run here (AMX off, or K % 32 or N % 16 not 0): the caller then runs another kernel */
int tritonspec_linear_f32_amx3(const float* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t N, int64_t K,
                               const float* b, float* y, int64_t ldy, int threads) {
    if (!prompt_amx() || K % 32 || N % 16 || K <= 0) return -1;
    const int64_t KB = K / 32, NB = N / 16, TILE = 3 * 512; /* a (block, k step)'s three parts */
    if (M <= 0 || NB <= 0) return 0;
    int64_t mc = AMX3_SCRATCH / (K * 6) / 16 * 16;
    mc = mc < 16 ? 16 : mc > 256 ? 256 : mc;
    const int64_t per = ((M + threads - 1) / threads + 15) / 16 * 16; /* every thread gets rows */
    if (per < mc) mc = per;
    const int64_t chunks = (M + mc - 1) / mc;
    if (chunks < threads) threads = (int)chunks;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t* xa = aligned_alloc(64, (size_t)(mc / 16) * KB * TILE * sizeof(uint16_t));
        float* acc = aligned_alloc(64, (size_t)(mc / 16) * 512 * sizeof(float)); /* [row block][2 tiles][16][16] */
        if (!xa || !acc) {
            free(xa);
            free(acc);
            xa = NULL;
#pragma omp atomic write
            failed = 1;
        } else {
            const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
            amx_configure(8, rows);
        }
#pragma omp for schedule(static)
        for (int64_t ch = 0; ch < chunks; ch++) {
            if (!xa) continue;
            const int64_t m1 = ch * mc, mend = M - m1 < mc ? M : m1 + mc, nmb = (mend - m1 + 15) / 16;
            for (int64_t i = 0; i < nmb; i++) {
                const int64_t m0 = m1 + 16 * i;
                amx3_split_rows(x + m0 * ldx, ldx, mend - m0 < 16 ? (int)(mend - m0) : 16, KB, xa + i * KB * TILE);
            }
            /* column pairs outer, then k blocks of AMX3_KC steps, then the chunk's row blocks: a pair's weight
             * parts for one k block (AMX3_KC x 6 KB) stay in L1 while every row block passes, and the partial
             * sums wait in acc (exact: float32 stored and reloaded) */
            for (int64_t nb = 0; nb < NB; nb += 2) {
                const uint16_t* w0 = wp + nb * KB * TILE;
                const int two = nb + 1 < NB;
                for (int64_t k0 = 0; k0 < KB; k0 += AMX3_KC) {
                    const int64_t k1 = k0 + AMX3_KC < KB ? k0 + AMX3_KC : KB;
                    for (int64_t i = 0; i < nmb; i++) {
                        const uint16_t* xb = xa + i * KB * TILE;
                        float* ai = acc + i * 512;
                        if (k0 == 0) {
                            _tile_zero(0);
                            _tile_zero(1);
                        } else {
                            _tile_loadd(0, ai, 64);
                            _tile_loadd(1, ai + 256, 64);
                        }
                        for (int64_t kb = k0; kb < k1; kb++) {
                            _tile_loadd(2, xb + kb * TILE, 64);
                            _tile_loadd(3, xb + kb * TILE + 512, 64);
                            _tile_loadd(4, xb + kb * TILE + 1024, 64);
                            if (two) six_terms(w0 + kb * TILE, w0 + (KB + kb) * TILE);
                            else six_terms_one(w0 + kb * TILE);
                        }
                        if (k1 < KB) {
                            _tile_stored(0, ai, 64);
                            _tile_stored(1, ai + 256, 64);
                            continue;
                        }
                        const int64_t m0 = m1 + 16 * i;
                        const int rows = mend - m0 < 16 ? (int)(mend - m0) : 16;
                        amx3_store(0, rows, b, y + m0 * ldy, ldy, nb * 16);
                        if (two) amx3_store(1, rows, b, y + m0 * ldy, ldy, nb * 16 + 16);
                    }
                }
            }
        }
        if (xa) {
            _tile_release();
            free(xa);
            free(acc);
        }
    }
    if (failed) return -2;
#pragma omp atomic
    prompt_amx_calls++;
    return 0;
}
#else
int tritonspec_amx_enabled(void) { return 0; }
int tritonspec_linear_bf16_packed(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t N, int64_t K,
                                  const uint16_t* b, uint16_t* y, int64_t ldy, int threads) {
    (void)x; (void)M; (void)ldx; (void)wp; (void)N; (void)K; (void)b; (void)y; (void)ldy; (void)threads;
    return -1;
}
int tritonspec_prompt_linear_amx(int on) { (void)on; return 0; } /* built without AMX: never on */
int64_t tritonspec_prompt_linear_amx_calls(void) { return 0; }
int tritonspec_linear_f32_amx3(const float* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t N, int64_t K,
                               const float* b, float* y, int64_t ldy, int threads) {
    (void)x; (void)M; (void)ldx; (void)wp; (void)N; (void)K; (void)b; (void)y; (void)ldy; (void)threads;
    return -1;
}
#endif

/* A float32 weight w [N, K] (N % 16 == 0, K % 32 == 0) as three exact bfloat16 parts in the AMX tile layout
 * tritonspec_linear_f32_amx3 reads (kernels/cpu_linear.py pack_amx3, whose PyTorch reference gives the same bits):
 *     wp[nb][kb][t][p][2 j + i] = part t of w[16 nb + j][32 kb + 2 p + i]
 * w = w0 + w1 + w2: w0 is w truncated to bfloat16, w1 the remainder truncated, w2 what is left (exact). Plain C:
 * it runs once per weight and on any CPU. */
static inline uint32_t f32_bits(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}
static inline float bits_f32(uint32_t u) {
    float v;
    memcpy(&v, &u, 4);
    return v;
}
void tritonspec_pack_f32_amx3(const float* w, int64_t N, int64_t K, uint16_t* wp, int threads) {
    const int64_t KB = K / 32, NB = N / 16;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t nb = 0; nb < NB; nb++)
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t* t = wp + (nb * KB + kb) * 3 * 512;
            for (int64_t j = 0; j < 16; j++) {
                const float* row = w + (16 * nb + j) * K + 32 * kb;
                for (int64_t k = 0; k < 32; k++) {
                    const float v = row[k], w0 = bits_f32(f32_bits(v) & 0xffff0000u), r = v - w0;
                    const float w1 = bits_f32(f32_bits(r) & 0xffff0000u), w2 = r - w1;
                    const int64_t at = (k / 2) * 32 + 2 * j + k % 2;
                    t[at] = (uint16_t)(f32_bits(w0) >> 16);
                    t[512 + at] = (uint16_t)(f32_bits(w1) >> 16);
                    t[1024 + at] = (uint16_t)(f32_bits(w2) >> 16);
                }
            }
        }
}

int tritonspec_abi_version(void) { return 1; }
