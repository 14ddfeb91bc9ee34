/* Row-invariant RMSNorm for x86-64 CPUs with AVX-512, or AVX2 + FMA through avx2.h (float32 and bfloat16 storage).
 *
 *     s = x (+ residual)                         rounded to the storage dtype, as PyTorch's add
 *     y = w * round(s * rsqrt(mean(s^2) + eps))  the sum of squares in float32, y rounded once
 *
 * Each row's sum of squares is one 16-lane float32 accumulator walked over H in order, then
 * _mm512_reduce_add_ps: the same sequence whatever the number of rows or threads (rows are split over
 * threads whole), so a row's result never depends on the call it sits in, eager or compiled (inductor
 * sees an opaque operator and cannot re-associate the reduction by row count).
 *
 * Also SwiGLU's gate product (tritonspec_silu_mul_*), one pass over the gate_up projection's rows:
 *
 *     y[m, i] = round(round(silu(g)) * u),  g = x[m, i], u = x[m, I + i],  silu(g) = g / (1 + exp(-g))
 *
 * in float32 with exp_ps (exp.h, ~1 ulp), each rounding to the storage dtype as PyTorch's F.silu(g) * u
 * rounds (bfloat16: twice; float32: the ops' own). Every element runs the same instruction sequence (a
 * row's tail in masked lanes), so a row's values never depend on its call. Why: the two PyTorch ops read a
 * strided half of gate_up each and cost ~4 us a call at one decode row, ~130 us at 440 prompt rows (the
 * demo's MLP, one thread).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "avx2.h" /* AVX2 + FMA CPUs: the AVX-512 intrinsics below, emulated lane for lane */
#include "exp.h"

#define SMALL_ROWS 64 /* calls with fewer rows run on one thread */

/* ROW (an expression of m) for each row m < M: a plain loop on one thread below SMALL_ROWS rows or with one
 * thread (an OpenMP region costs ~0.2 us even then), else the rows split statically over the threads */
#define FOR_ROWS(M, threads, ROW)                                                                              \
    do {                                                                                                      \
        if ((M) < SMALL_ROWS || (threads) <= 1) {                                                             \
            for (int64_t m = 0; m < (M); m++) ROW;                                                            \
        } else {                                                                                              \
            _Pragma("omp parallel for schedule(static) num_threads(threads)")                                 \
            for (int64_t m = 0; m < (M); m++) ROW;                                                            \
        }                                                                                                     \
    } while (0)

static inline __mmask16 tail16(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }
static inline __m512 ld_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 ld_bf16(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 rnd_f32(__m512 v) { return v; }
static inline __m512 rnd_bf16(__m512 v) { /* round to nearest even to bfloat16, kept as float32 (NaN quiet) */
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline void st_f32(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void st_bf16(uint16_t* p, __m512 v, __mmask16 m) { /* v already bfloat16-exact */
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

/* x, residual: rows at strides ldx, ldr (unit stride along H); y, s: [M, H] contiguous (s written when
 * residual is given). FOR_ROWS: EAGLE-3.1's fc_norm gather (linear_op.cpp aux_gather) calls this once per row
 * and chunk, on one thread, where an OpenMP region would cost more than the row. */
#define RMS(NAME, T, LD, RND, ST)                                                                            \
    static inline __attribute__((always_inline)) void NAME##_row(const T* xr, const T* rr, const T* w,       \
                                                                 int64_t H, float eps, T* yr, T* sr) {       \
        __m512 acc = _mm512_setzero_ps();                                                                     \
        for (int64_t h = 0; h < H; h += 16) {                                                                 \
            __mmask16 mk = tail16(H - h);                                                                     \
            __m512 v = LD(xr + h, mk);                                                                        \
            if (rr) {                                                                                         \
                v = RND(_mm512_add_ps(v, LD(rr + h, mk)));                                                    \
                ST(sr + h, v, mk);                                                                            \
            }                                                                                                 \
            acc = _mm512_fmadd_ps(v, v, acc);                                                                 \
        }                                                                                                     \
        const float rstd = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)H + eps);                          \
        const T* src = rr ? sr : xr;                                                                          \
        for (int64_t h = 0; h < H; h += 16) {                                                                 \
            __mmask16 mk = tail16(H - h);                                                                     \
            __m512 n = RND(_mm512_mul_ps(LD(src + h, mk), _mm512_set1_ps(rstd)));                             \
            ST(yr + h, RND(_mm512_mul_ps(LD(w + h, mk), n)), mk);                                             \
        }                                                                                                     \
    }                                                                                                         \
    void NAME(const T* x, int64_t ldx, const T* r, int64_t ldr, const T* w, int64_t M, int64_t H, float eps,  \
              T* y, T* s, int threads) {                                                                      \
        FOR_ROWS(M, threads, NAME##_row(x + m * ldx, r ? r + m * ldr : 0, w, H, eps, y + m * H, r ? s + m * H : 0)); \
    }

RMS(tritonspec_rms_norm_f32, float, ld_f32, rnd_f32, st_f32)
RMS(tritonspec_rms_norm_bf16, uint16_t, ld_bf16, rnd_bf16, st_bf16)

/* x: M rows of [gate (I) | up (I)] at row stride ldx (unit stride along the row); y: [M, I] contiguous. */
#define SILU_MUL(NAME, T, LD, RND, ST)                                                                       \
    static inline __attribute__((always_inline)) void NAME##_row(const T* xr, int64_t I, T* yr) {           \
        const __m512 one = _mm512_set1_ps(1.0f);                                                              \
        for (int64_t i = 0; i < I; i += 16) {                                                                 \
            const __mmask16 mk = tail16(I - i);                                                               \
            const __m512 g = LD(xr + i, mk), u = LD(xr + I + i, mk);                                          \
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)); /* exp(-g) */                    \
            const __m512 sg = RND(_mm512_div_ps(g, _mm512_add_ps(one, e)));                                   \
            ST(yr + i, RND(_mm512_mul_ps(sg, u)), mk);                                                        \
        }                                                                                                     \
    }                                                                                                         \
    void NAME(const T* x, int64_t ldx, int64_t M, int64_t I, T* y, int threads) {                             \
        FOR_ROWS(M, threads, NAME##_row(x + m * ldx, I, y + m * I));                                          \
    }

SILU_MUL(tritonspec_silu_mul_f32, float, ld_f32, rnd_f32, st_f32)
SILU_MUL(tritonspec_silu_mul_bf16, uint16_t, ld_bf16, rnd_bf16, st_bf16)
