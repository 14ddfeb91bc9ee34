/* Row-invariant small-M linear layer for x86-64 CPUs with AVX-512 (float32) and AVX512-BF16 (bfloat16).
 *
 *     y[m, n] = sum_k x[m, k] * w[n, k]  (+ b[n])       x [M, K] (row stride ldx), w [N, K], y [M, N] (row stride ldy)
 *
 * Every output element is one 16-lane accumulator walked over k in ascending 16- (float32) or
 * 32-element (bfloat16 pairs, VDPBF16PS) chunks, zero-masked at the ragged end, then reduced by
 * _mm512_reduce_add_ps and the bias added once. That sequence never depends on M, on which rows
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

#include "bf16.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

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
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            y[i * ldy + j] = b ? s + b[j] : s;
        }
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
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    if (k < K) {
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1ull);
        __m512i wv[8];
        for (int j = 0; j < NB; j++) wv[j] = _mm512_maskz_loadu_epi16(mk, w + j * K + k);
        for (int i = 0; i < MB; i++) {
            __m512i xv = _mm512_maskz_loadu_epi16(mk, x + i * ldx + k);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xv, (__m512bh)wv[j]);
        }
    }
    for (int i = 0; i < MB; i++)
        for (int j = 0; j < NB; j++) {
            float s = _mm512_reduce_add_ps(acc[i][j]);
            y[i * ldy + j] = float_to_bf16(b ? s + bf16_to_float(b[j]) : s);
        }
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
 * (same arithmetic per element, NB only decides how many share a loop). NB is 8 for one or two
 * rows (more independent chains while streaming) and 4 otherwise (register budget: 4 x 4 accumulators). */
#define LINEAR(NAME, T, BLOCK)                                                                            \
    void NAME(const T* x, int64_t M, int64_t ldx, const T* w, int64_t N, int64_t K, const T* b, T* y,   \
              int64_t ldy, int threads) {                                                                 \
        const int NBW = M <= 2 ? 8 : 4;                                                                   \
        const int64_t blocks = N / NBW;                                                                   \
        if (NBW == 8) {                                                                                   \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
            for (int64_t blk = 0; blk < blocks; blk++) {                                                  \
                int64_t n0 = blk * 8;                                                                     \
                ROWS(BLOCK, 8, w + n0 * K)                                                                \
            }                                                                                             \
        } else {                                                                                          \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                             \
            for (int64_t blk = 0; blk < blocks; blk++) {                                                  \
                int64_t n0 = blk * 4;                                                                     \
                ROWS(BLOCK, 4, w + n0 * K)                                                                \
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

int tritonspec_abi_version(void) { return 1; }
