/* Rotary embedding and KV-cache writes for the eager CPU decode path (float32 and bfloat16 storage).
 *
 *     rope:     y = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[D/2:], x[:D/2])
 *               rounded as PyTorch's eager ops round it: each product to the storage dtype, then the sum,
 *               so y is bit-identical to runtime/rope.py's Rope.apply (no fused multiply-add below).
 *     kv_write: cache[row b, slot s(b, i)] = k[b, i] (and v), s = -1 -> the trash slot S - 1.
 *
 * Why: in an eager step these are ~20 small PyTorch ops per layer (slices, negation, concatenation,
 * products, index tensors, two index_put_); one call each costs a few microseconds instead.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Element access per storage type: LOAD widens to float, ROUND rounds a product or sum to the storage
 * dtype (and back to float), STORE narrows. float32: identity; bfloat16: each product rounded as eager
 * PyTorch rounds it. */
#define LOAD_f32(v) (v)
#define ROUND_f32(v) (v)
#define STORE_f32(v) (v)
#define LOAD_bf16(v) bf16_to_float(v)
#define ROUND_bf16(v) bf16_to_float(float_to_bf16(v))
#define STORE_bf16(v) float_to_bf16(v)

/* x [B, Q, H, D] at strides (sxb, sxq, sxh, 1); cos, sin [B, Q, D] at strides (scb, scq, 1); y [B, Q, H, D]
 * contiguous. */
#define ROPE(NAME, T, DT)                                                                                     \
    void NAME(const T* x, int64_t B, int64_t Q, int64_t H, int64_t D, int64_t sxb, int64_t sxq, int64_t sxh, \
              const T* cs, const T* sn, int64_t scb, int64_t scq, T* y) {                                   \
        const int64_t half = D / 2;                                                                         \
        for (int64_t b = 0; b < B; b++)                                                                     \
            for (int64_t q = 0; q < Q; q++) {                                                               \
                const T* c = cs + b * scb + q * scq;                                                        \
                const T* s = sn + b * scb + q * scq;                                                        \
                for (int64_t h = 0; h < H; h++) {                                                           \
                    const T* xr = x + b * sxb + q * sxq + h * sxh;                                          \
                    T* yr = y + ((b * Q + q) * H + h) * D;                                                  \
                    for (int64_t d = 0; d < D; d++) {                                                       \
                        const float rot = d < half ? -LOAD_##DT(xr[d + half]) : LOAD_##DT(xr[d - half]);    \
                        const float a = ROUND_##DT(LOAD_##DT(xr[d]) * LOAD_##DT(c[d]));                     \
                        const float r = ROUND_##DT(rot * LOAD_##DT(s[d]));                                  \
                        yr[d] = STORE_##DT(a + r);                                                          \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
    }

ROPE(tritonspec_rope_f32, float, f32)
ROPE(tritonspec_rope_bf16, uint16_t, bf16)

/* cache [B_max, S, Hkv, D] at strides (scb, scs, D, 1) (one layer); src [B, Q, Hkv, D] at strides
 * (ssb, ssq, D, 1); slots [B, Q] contiguous. elem: bytes per element. Returns the number of slots outside
 * [-1, S) (then nothing is written). */
int64_t tritonspec_kv_write(char* cache, int64_t scb, int64_t scs, int64_t S, const char* src, int64_t ssb,
                            int64_t ssq, const int64_t* slots, int64_t B, int64_t Q, int64_t row_bytes, int64_t elem) {
    int64_t bad = 0;
    for (int64_t i = 0; i < B * Q; i++) bad += slots[i] < -1 || slots[i] >= S;
    if (bad) return bad;
    for (int64_t b = 0; b < B; b++)
        for (int64_t q = 0; q < Q; q++) {
            int64_t s = slots[b * Q + q];
            if (s < 0) s = S - 1;
            memcpy(cache + (b * scb + s * scs) * elem, src + (b * ssb + q * ssq) * elem, (size_t)row_bytes);
        }
    return 0;
}
