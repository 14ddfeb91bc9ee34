/* bfloat16 <-> float32 for the CPU kernels (linear.c, attention.c, rope_kv.c): round to nearest even,
 * NaN kept quiet. Included by each source; kernels/cpu_linear.py hashes it into the build key. */
#ifndef TRITONSPEC_BF16_H
#define TRITONSPEC_BF16_H
#include <stdint.h>

static inline __attribute__((always_inline)) uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

static inline __attribute__((always_inline)) float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}
#endif
