/* What the AMX kernels share (linear.c's packed bfloat16 weights, prefill.c's prompt attention); kernels/cpu_linear.py
 * hashes this header into the build key. Only for builds with AMX (Sapphire Rapids and later). */
#ifndef TRITONSPEC_AMX_H
#define TRITONSPEC_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
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

/* linear.c: 1 where AMX runs here (the CPU flags, TRITONSPEC_CPU_AMX != 0, the OS granted the tile state) */
int tritonspec_amx_enabled(void);

#endif
#endif
