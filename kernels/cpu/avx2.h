/* The AVX-512 intrinsics the CPU kernels use, emulated lane for lane on AVX2 + FMA (two 256-bit halves).
 *
 * Included by every kernel source right after <immintrin.h>. Where the compiler targets AVX-512 it only
 * supplies VDPBF16PS when the CPU lacks AVX512-BF16 (two FMAs, as below). Elsewhere (an AVX2 CPU: AMD Zen 1-3, Intel Haswell to Alder Lake clients) it
 * maps each _mm512_* (and the two AVX512VL _mm256_mask*_epi16) the kernels call to a function of the same
 * meaning over 16-lane types made of two 256-bit halves (__m512 becomes a pair of __m256). One source then serves both instruction sets:
 *
 *   - lane-wise ops (add, mul, fmadd, max, shifts, masked loads/stores) are the same IEEE operations lane
 *     by lane, so they round the same;
 *   - the reductions keep the tree of gcc's _mm512_reduce_add_ps (lanes l + l+8, then + l+4, + l+2, + l+1):
 *     reduce_add and hsum16 (hsum.h) give the same sums;
 *   - VDPBF16PS (acc += a_odd b_odd, then += a_even b_even, each product exact in float32) is two FMAs in
 *     that order: equal except where the instruction flushes denormals (inputs below 2^-126: not seen in
 *     model weights or activations);
 *   - scalef(p, n) is p * 2^n, exact for the integral n in [-126, 127] the kernels' exp passes it.
 *
 * So a row's result is one fixed instruction sequence here too (row invariance by construction, the
 * property deterministic mode needs), and float32 results are meant to equal the AVX-512 build's bit for
 * bit (by the argument above; checked on AVX2 against the reference and for row invariance, not yet side by
 * side with an AVX-512 machine). Speed: 16 ymm registers instead of 32 zmm, so linear.c blocks fewer rows
 * and columns per loop on AVX2 (that only changes what runs side by side, never a value).
 */
#ifndef TRITONSPEC_AVX2_H
#define TRITONSPEC_AVX2_H
#if !defined(__AVX512F__)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the CPU kernels need AVX-512 or AVX2 + FMA (built with -march=native)"
#endif
#include <immintrin.h>
#include <stdint.h>

#pragma GCC diagnostic ignored "-Wpsabi" /* 64-byte vectors passed between non-inlined helpers: fine within one library */
#define TS_INLINE static inline __attribute__((always_inline))

/* The 16-lane types as pairs of 256-bit registers: a struct, not GCC's 64-byte vector, which has no
 * register class without AVX-512 and would live on the stack (measured: 3-5x slower). */
typedef struct { __m256 lo, hi; } ts_f16;
typedef struct { __m256i lo, hi; } ts_i16;
#define __m512 ts_f16
#define __m512i ts_i16
#define __m512bh ts_i16

TS_INLINE __m256 ts_lo(__m512 v) { return v.lo; }
TS_INLINE __m256 ts_hi(__m512 v) { return v.hi; }
TS_INLINE __m512 ts_join(__m256 lo, __m256 hi) { __m512 r = {lo, hi}; return r; }
TS_INLINE __m256i ts_ilo(__m512i v) { return v.lo; }
TS_INLINE __m256i ts_ihi(__m512i v) { return v.hi; }
TS_INLINE __m512i ts_ijoin(__m256i lo, __m256i hi) { __m512i r = {lo, hi}; return r; }

/* lane masks (all ones where bit i of m is set) for the low (bits 0-7) and high (8-15) halves */
TS_INLINE __m256i ts_mask8(unsigned m) {
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)m), bit), bit);
}

#define TS_BINARY(NAME, OP256)                                                                   \
    TS_INLINE __m512 NAME(__m512 a, __m512 b) {                                                  \
        return ts_join(OP256(ts_lo(a), ts_lo(b)), OP256(ts_hi(a), ts_hi(b)));                    \
    }
TS_BINARY(ts_add_ps, _mm256_add_ps)
TS_BINARY(ts_sub_ps, _mm256_sub_ps)
TS_BINARY(ts_mul_ps, _mm256_mul_ps)
TS_BINARY(ts_div_ps, _mm256_div_ps)
TS_BINARY(ts_max_ps, _mm256_max_ps)
#define _mm512_add_ps ts_add_ps
#define _mm512_sub_ps ts_sub_ps
#define _mm512_mul_ps ts_mul_ps
#define _mm512_div_ps ts_div_ps
#define _mm512_max_ps ts_max_ps

TS_INLINE __m512 ts_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    return ts_join(_mm256_fmadd_ps(ts_lo(a), ts_lo(b), ts_lo(c)), _mm256_fmadd_ps(ts_hi(a), ts_hi(b), ts_hi(c)));
}
TS_INLINE __m512 ts_fnmadd_ps(__m512 a, __m512 b, __m512 c) {
    return ts_join(_mm256_fnmadd_ps(ts_lo(a), ts_lo(b), ts_lo(c)), _mm256_fnmadd_ps(ts_hi(a), ts_hi(b), ts_hi(c)));
}
#define _mm512_fmadd_ps ts_fmadd_ps
#define _mm512_fnmadd_ps ts_fnmadd_ps

TS_INLINE __m512 ts_set1_ps(float f) { __m256 h = _mm256_set1_ps(f); return ts_join(h, h); }
TS_INLINE __m512 ts_setzero_ps(void) { return ts_set1_ps(0.0f); }
TS_INLINE __m512 ts_loadu_ps(const float* p) { return ts_join(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
TS_INLINE __m512 ts_load_ps(const float* p) { return ts_join(_mm256_load_ps(p), _mm256_load_ps(p + 8)); }
TS_INLINE void ts_storeu_ps(float* p, __m512 v) { _mm256_storeu_ps(p, ts_lo(v)); _mm256_storeu_ps(p + 8, ts_hi(v)); }
TS_INLINE void ts_store_ps(float* p, __m512 v) { _mm256_store_ps(p, ts_lo(v)); _mm256_store_ps(p + 8, ts_hi(v)); }
#define _mm512_set1_ps ts_set1_ps
#define _mm512_setzero_ps ts_setzero_ps
#define _mm512_loadu_ps(p) ts_loadu_ps((const float*)(p))
#define _mm512_load_ps(p) ts_load_ps((const float*)(p))
#define _mm512_storeu_ps(p, v) ts_storeu_ps((float*)(p), v)
#define _mm512_store_ps(p, v) ts_store_ps((float*)(p), v)

/* masked float loads and stores: masked-off lanes read as 0 and are never touched (no fault) */
TS_INLINE __m512 ts_maskz_loadu_ps(__mmask16 m, const float* p) {
    if (m == 0xffff) return ts_loadu_ps(p);
    __m256 lo = _mm256_maskload_ps(p, ts_mask8(m & 0xff));
    __m256 hi = (m >> 8) ? _mm256_maskload_ps(p + 8, ts_mask8(m >> 8)) : _mm256_setzero_ps();
    return ts_join(lo, hi);
}
TS_INLINE void ts_mask_storeu_ps(float* p, __mmask16 m, __m512 v) {
    if (m == 0xffff) { ts_storeu_ps(p, v); return; }
    _mm256_maskstore_ps(p, ts_mask8(m & 0xff), ts_lo(v));
    if (m >> 8) _mm256_maskstore_ps(p + 8, ts_mask8(m >> 8), ts_hi(v));
}
TS_INLINE __m512 ts_maskz_mov_ps(__mmask16 m, __m512 v) {
    return ts_join(_mm256_and_ps(_mm256_castsi256_ps(ts_mask8(m & 0xff)), ts_lo(v)),
                   _mm256_and_ps(_mm256_castsi256_ps(ts_mask8(m >> 8)), ts_hi(v)));
}
TS_INLINE __m512 ts_mask_max_ps(__m512 src, __mmask16 m, __m512 a, __m512 b) {
    __m512 mx = ts_max_ps(a, b);
    return ts_join(_mm256_blendv_ps(ts_lo(src), ts_lo(mx), _mm256_castsi256_ps(ts_mask8(m & 0xff))),
                   _mm256_blendv_ps(ts_hi(src), ts_hi(mx), _mm256_castsi256_ps(ts_mask8(m >> 8))));
}
#define _mm512_maskz_loadu_ps(m, p) ts_maskz_loadu_ps(m, (const float*)(p))
#define _mm512_mask_storeu_ps(p, m, v) ts_mask_storeu_ps((float*)(p), m, v)
#define _mm512_maskz_mov_ps ts_maskz_mov_ps
#define _mm512_mask_max_ps ts_mask_max_ps

/* gcc's _mm512_reduce_add_ps tree: (hi + lo), then the 128-bit halves, then lanes l + l+2, then l + l+1 */
TS_INLINE float ts_reduce_add_ps(__m512 v) {
    __m256 t3 = _mm256_add_ps(ts_hi(v), ts_lo(v));
    __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1)));
}
TS_INLINE float ts_reduce_max_ps(__m512 v) {
    __m256 t3 = _mm256_max_ps(ts_hi(v), ts_lo(v));
    __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
    __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}
#define _mm512_reduce_add_ps ts_reduce_add_ps
#define _mm512_reduce_max_ps ts_reduce_max_ps

/* exp_ps's rounding and scaling */
TS_INLINE __m512 ts_roundscale_nearest(__m512 x) {
    return ts_join(_mm256_round_ps(ts_lo(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                   _mm256_round_ps(ts_hi(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#define _mm512_roundscale_ps(x, imm) ts_roundscale_nearest(x) /* the kernels pass TO_NEAREST_INT | NO_EXC */
TS_INLINE __m256 ts_pow2(__m256 n) { /* 2^n for integral n, clamped to the normal exponents [-126, 127] */
    __m256i e = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(127.0f)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}
TS_INLINE __m512 ts_scalef_ps(__m512 p, __m512 n) {
    return ts_join(_mm256_mul_ps(ts_lo(p), ts_pow2(ts_lo(n))), _mm256_mul_ps(ts_hi(p), ts_pow2(ts_hi(n))));
}
#define _mm512_scalef_ps ts_scalef_ps

/* integers */
TS_INLINE __m512 ts_castsi512_ps(__m512i v) { return ts_join(_mm256_castsi256_ps(v.lo), _mm256_castsi256_ps(v.hi)); }
TS_INLINE __m512i ts_castps_si512(__m512 v) { return ts_ijoin(_mm256_castps_si256(v.lo), _mm256_castps_si256(v.hi)); }
#define _mm512_castsi512_ps ts_castsi512_ps
#define _mm512_castps_si512 ts_castps_si512
TS_INLINE __m512i ts_set1_epi32(int a) { __m256i h = _mm256_set1_epi32(a); return ts_ijoin(h, h); }
TS_INLINE __m512i ts_set1_epi8(char a) { __m256i h = _mm256_set1_epi8(a); return ts_ijoin(h, h); }
TS_INLINE __m512i ts_add_epi32(__m512i a, __m512i b) {
    return ts_ijoin(_mm256_add_epi32(ts_ilo(a), ts_ilo(b)), _mm256_add_epi32(ts_ihi(a), ts_ihi(b)));
}
TS_INLINE __m512i ts_and_si512(__m512i a, __m512i b) {
    return ts_ijoin(_mm256_and_si256(ts_ilo(a), ts_ilo(b)), _mm256_and_si256(ts_ihi(a), ts_ihi(b)));
}
#define _mm512_slli_epi32(a, n) ts_ijoin(_mm256_slli_epi32(ts_ilo(a), n), _mm256_slli_epi32(ts_ihi(a), n))
#define _mm512_srli_epi32(a, n) ts_ijoin(_mm256_srli_epi32(ts_ilo(a), n), _mm256_srli_epi32(ts_ihi(a), n))
#define _mm512_set1_epi32 ts_set1_epi32
#define _mm512_set1_epi8 ts_set1_epi8
#define _mm512_add_epi32 ts_add_epi32
#define _mm512_and_si512 ts_and_si512
TS_INLINE __m512i ts_loadu_si512(const void* p) {
    return ts_ijoin(_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1));
}
#define _mm512_loadu_si512 ts_loadu_si512
TS_INLINE __m512i ts_cvtepu16_epi32(__m256i h) { /* 16 x uint16 -> 16 x int32 */
    return ts_ijoin(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)));
}
#define _mm512_cvtepu16_epi32 ts_cvtepu16_epi32
TS_INLINE __m256i ts_cvtepi32_epi16(__m512i v) { /* truncation; the kernels pass values < 2^16 (packus is exact there) */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(ts_ilo(v), ts_ihi(v)), _MM_SHUFFLE(3, 1, 2, 0));
}
#define _mm512_cvtepi32_epi16 ts_cvtepi32_epi16
/* any predicate (a macro: _mm256_cmp_ps takes an immediate); the masked form ANDs the mask in */
#define _mm512_cmp_ps_mask(a, b, imm)                                                   \
    ((__mmask16)(_mm256_movemask_ps(_mm256_cmp_ps(ts_lo(a), ts_lo(b), imm)) |           \
                 (_mm256_movemask_ps(_mm256_cmp_ps(ts_hi(a), ts_hi(b), imm)) << 8)))
#define _mm512_mask_cmp_ps_mask(k, a, b, imm) ((__mmask16)((k) & _mm512_cmp_ps_mask(a, b, imm)))
TS_INLINE __m512i ts_mask_or_epi32(__m512i src, __mmask16 m, __m512i a, __m512i b) {
    __m256i lo = _mm256_or_si256(ts_ilo(a), ts_ilo(b)), hi = _mm256_or_si256(ts_ihi(a), ts_ihi(b));
    return ts_ijoin(_mm256_blendv_epi8(ts_ilo(src), lo, ts_mask8(m & 0xff)),
                    _mm256_blendv_epi8(ts_ihi(src), hi, ts_mask8(m >> 8)));
}
#define _mm512_mask_or_epi32 ts_mask_or_epi32
TS_INLINE uint64_t ts_test_epi8_mask(__m512i a, __m512i b) { /* bit i: byte i of a & b is non-zero */
    const __m256i z = _mm256_setzero_si256();
    uint32_t lo = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(ts_ilo(a), ts_ilo(b)), z));
    uint32_t hi = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_and_si256(ts_ihi(a), ts_ihi(b)), z));
    return ~(((uint64_t)hi << 32) | lo);
}
#define _mm512_test_epi8_mask ts_test_epi8_mask

/* masked 16-bit loads and stores (the ragged end of a bfloat16 row): element by element when not full */
TS_INLINE __m256i ts_maskz_loadu_epi16_16(__mmask16 m, const void* p) {
    if (m == 0xffff) return _mm256_loadu_si256((const __m256i*)p);
    uint16_t buf[16] = {0};
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) buf[i] = ((const uint16_t*)p)[i];
    return _mm256_loadu_si256((const __m256i*)buf);
}
TS_INLINE __m512i ts_maskz_loadu_epi16_32(__mmask32 m, const void* p) {
    if (m == 0xffffffffu) return ts_loadu_si512(p);
    uint16_t buf[32] = {0};
    for (int i = 0; i < 32; i++)
        if (m >> i & 1) buf[i] = ((const uint16_t*)p)[i];
    return ts_loadu_si512(buf);
}
TS_INLINE void ts_mask_storeu_epi16_16(void* p, __mmask16 m, __m256i v) {
    if (m == 0xffff) { _mm256_storeu_si256((__m256i*)p, v); return; }
    uint16_t buf[16];
    _mm256_storeu_si256((__m256i*)buf, v);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) ((uint16_t*)p)[i] = buf[i];
}
#define _mm256_maskz_loadu_epi16 ts_maskz_loadu_epi16_16
#define _mm512_maskz_loadu_epi16 ts_maskz_loadu_epi16_32
#define _mm256_mask_storeu_epi16 ts_mask_storeu_epi16_16

/* VDPBF16PS: acc[i] += a[2i+1] b[2i+1], then += a[2i] b[2i] (bfloat16 pairs; the products are exact in float32) */
TS_INLINE __m256 ts_dpbf16_half(__m256 acc, __m256i a, __m256i b) {
    const __m256i hi16 = _mm256_set1_epi32((int)0xffff0000u);
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, hi16)), _mm256_castsi256_ps(_mm256_and_si256(b, hi16)), acc);
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
}
TS_INLINE __m512 ts_dpbf16_ps(__m512 acc, __m512i a, __m512i b) {
    return ts_join(ts_dpbf16_half(acc.lo, a.lo, b.lo), ts_dpbf16_half(acc.hi, a.hi, b.hi));
}
#define DPBF16(acc, a, b) ts_dpbf16_ps(acc, a, b) /* linear.c's bfloat16 pair dot product */

/* hsum16 (hsum.h) on AVX2: t = lo + hi (lanes l + l+8) for each vector, then eight vectors at a time
 * through one transposed 8-lane tree (l + l+4, + l+2, + l+1): the same pairs as _mm512_reduce_add_ps. */
TS_INLINE __m256 ts_hsum8(const __m256* t) {
    __m256 a[4], b[2];
    for (int j = 0; j < 4; j++) /* 128-bit half r of a[j]: t[2j + r] lanes l + l+4 */
        a[j] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * j], t[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(t[2 * j], t[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++) /* half r of b[j]: t[4j + r] lanes 0-1, t[4j + 2 + r] lanes 2-3, + l+2 */
        b[j] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* + l+1: half r lane s = the sum of t[2s + r]; permuted back to lane i = the sum of t[i] */
    __m256 c = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(b[0], b[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
TS_INLINE __m512 hsum16(const __m512* v) {
    __m256 t[16];
    for (int i = 0; i < 16; i++) t[i] = _mm256_add_ps(ts_hi(v[i]), ts_lo(v[i]));
    return ts_join(ts_hsum8(t), ts_hsum8(t + 8));
}
#elif !defined(__AVX512BF16__)
/* AVX-512 without AVX512-BF16 (Skylake-SP, Ice Lake): VDPBF16PS as two FMAs in its order, as above */
#include <immintrin.h>
static inline __attribute__((always_inline)) __m512 ts_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b) {
    const __m512i hi16 = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i ai = (__m512i)a, bi = (__m512i)b;
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(ai, hi16)), _mm512_castsi512_ps(_mm512_and_si512(bi, hi16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(ai, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(bi, 16)), acc);
}
#define _mm512_dpbf16_ps ts_dpbf16_ps
#endif /* !__AVX512F__, !__AVX512BF16__ */
#endif
