/* Sixteen horizontal sums at once, for the CPU kernels (linear.c, attention.c).
 *
 *     hsum16(v)[i] = sum of the 16 lanes of v[i]
 *
 * by the tree of _mm512_reduce_add_ps (gcc's: lanes l + l+8, then + l+4, then + l+2, then + l+1), so
 * each sum is bit for bit the value _mm512_reduce_add_ps(v[i]) gives, whatever the other vectors hold:
 * the 16 sums go through one transposed tree (shuffles between vectors, one lane-wise add per level, 15
 * adds and 30 shuffles in all) instead of 16 separate reductions (~9 dependent instructions each).
 * Each output lane only ever adds lanes of its own vector, so unused slots may hold anything (zeros).
 * Included by each source; kernels/cpu_linear.py hashes it into the build key. */
#ifndef TRITONSPEC_HSUM_H
#define TRITONSPEC_HSUM_H
#include <immintrin.h>

#include "avx2.h"

#ifdef __AVX512F__

static inline __attribute__((always_inline)) __m512 hsum16(const __m512* v) {
    __m512 a[8], b[4], c[2];
    for (int j = 0; j < 8; j++) /* a[j]: v[2j] lanes l + l+8 (l < 8) in lanes 0-7, v[2j+1]'s in lanes 8-15 */
        a[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int j = 0; j < 4; j++) /* b[j]: 128-bit lane r = v[4j+r]'s four partial sums, + l+4 */
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int j = 0; j < 2; j++) /* c[j]: lane r = v[8j+r]'s two partials, v[8j+4+r]'s two, + l+2 */
        c[j] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    /* + l+1: lane 4r + s = the sum of v[4s + r]; permuted back to lane i = the sum of v[i] */
    __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)));
    const __m512i back = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(back, d);
}
#endif /* __AVX512F__ (avx2.h defines hsum16 on AVX2, the same tree) */
#endif
