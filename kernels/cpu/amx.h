/* What the AMX kernels share (linear.c's packed bfloat16 weights and float32 prompt projections, prefill.c's prompt
 * attention); kernels/cpu_linear.py hashes this header into the build key. Only for builds with AMX (Sapphire Rapids and later). */
#ifndef TRITONSPEC_AMX_H
#define TRITONSPEC_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The LDTILECFG operand: palette 1, per tile its rows and bytes per row. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Load a configuration of the first n tiles, each rows[t] rows of 64 bytes (the thread's tile state). */
static inline void amx_configure(int n, const uint8_t* rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < n; t++) {
        c.rows[t] = rows[t];
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

#define AMX_INLINE static inline __attribute__((always_inline))

/* linear.c: 1 where AMX runs here (the CPU flags, TRITONSPEC_CPU_AMX != 0, the OS granted the tile state) */
int tritonspec_amx_enabled(void);

/* The switch of a prompt path on the tile unit (prefill.c's attention, linear.c's projections): *state -1
 * undecided, 0 off, 1 on. On where AMX runs unless TRITONSPEC_CPU_PREFILL_AMX=0 at the first call;
 * prompt_amx_set sets it for side-by-side runs (on < 0: only asks) and returns the previous setting. */
static inline int prompt_amx_get(int* state) {
    if (*state < 0) {
        const char* e = getenv("TRITONSPEC_CPU_PREFILL_AMX");
        *state = !(e && e[0] == '0') && tritonspec_amx_enabled();
    }
    return *state;
}
static inline int prompt_amx_set(int* state, int on) {
    const int prev = prompt_amx_get(state);
    if (on >= 0) *state = on != 0 && tritonspec_amx_enabled();
    return prev;
}

#ifdef __AVX512BF16__
/* The three-part bfloat16 splits both AMX float32 kernels use (prefill.c's prompt attention, linear.c's
 * prompt projections): an operand split exactly into x0 + x1 + x2, six of the nine part products kept. */
/* 16 lanes: x = x0 + x1 + x2 exactly, each part a bfloat16 value held in float32: x0 keeps x's top 8
 * significand bits (truncated), x1 the next 8 of the remainder, x2 the rest (at most 8 bits) */
AMX_INLINE void split3_ps(__m512 x, __m512* x0, __m512* x1, __m512* x2) {
    const __m512 hi = _mm512_castsi512_ps(_mm512_set1_epi32((int)0xffff0000u));
    *x0 = _mm512_and_ps(x, hi);
    const __m512 r = _mm512_sub_ps(x, *x0);
    *x1 = _mm512_and_ps(r, hi);
    *x2 = _mm512_sub_ps(r, *x1);
}
/* 32 bfloat16 values (exact in bfloat16, so the conversion does not round): lo's 16 then hi's 16 */
AMX_INLINE __m512i bf16_pair(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

/* tiles 0 and 1 += A (x) B0 and A (x) B1, where A's three parts are in tiles 2-4 and B0, B1 are three B tiles each
 * (parts 0-2, 1 KB apart): the six part products x0 y0 + x1 y0 + x2 y0 + x0 y1 + x1 y1 + x0 y2 per accumulator, the
 * two chains interleaved (B parts through tiles 5-7) */
AMX_INLINE void six_terms(const uint16_t* b0, const uint16_t* b1) {
    _tile_loadd(5, b0, 64);
    _tile_loadd(6, b1, 64);
    _tile_dpbf16ps(0, 2, 5); /* x0 y0 */
    _tile_dpbf16ps(1, 2, 6);
    _tile_dpbf16ps(0, 3, 5); /* x1 y0 */
    _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(0, 4, 5); /* x2 y0 */
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b0 + 512, 64);
    _tile_loadd(5, b1 + 512, 64);
    _tile_dpbf16ps(0, 2, 7); /* x0 y1 */
    _tile_dpbf16ps(1, 2, 5);
    _tile_dpbf16ps(0, 3, 7); /* x1 y1 */
    _tile_dpbf16ps(1, 3, 5);
    _tile_loadd(6, b0 + 1024, 64);
    _tile_loadd(7, b1 + 1024, 64);
    _tile_dpbf16ps(0, 2, 6); /* x0 y2 */
    _tile_dpbf16ps(1, 2, 7);
}

#endif

#endif
#endif
