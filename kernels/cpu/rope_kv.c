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

/* x [B, Q, H, D] at strides (sxb, sxq, sxh, 1); cos, sin [B, Q, D] at strides (scb, scq, 1); y [B, Q, H, D]
 * contiguous. */
void tritonspec_rope_f32(const float* x, int64_t B, int64_t Q, int64_t H, int64_t D, int64_t sxb, int64_t sxq,
                         int64_t sxh, const float* cs, const float* sn, int64_t scb, int64_t scq, float* y) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t q = 0; q < Q; q++) {
            const float* c = cs + b * scb + q * scq;
            const float* s = sn + b * scb + q * scq;
            for (int64_t h = 0; h < H; h++) {
                const float* xr = x + b * sxb + q * sxq + h * sxh;
                float* yr = y + ((b * Q + q) * H + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    const float rot = d < half ? -xr[d + half] : xr[d - half];
                    const float a = xr[d] * c[d];
                    const float r = rot * s[d];
                    yr[d] = a + r;
                }
            }
        }
}

void tritonspec_rope_bf16(const uint16_t* x, int64_t B, int64_t Q, int64_t H, int64_t D, int64_t sxb, int64_t sxq,
                          int64_t sxh, const uint16_t* cs, const uint16_t* sn, int64_t scb, int64_t scq, uint16_t* y) {
    const int64_t half = D / 2;
    for (int64_t b = 0; b < B; b++)
        for (int64_t q = 0; q < Q; q++) {
            const uint16_t* c = cs + b * scb + q * scq;
            const uint16_t* s = sn + b * scb + q * scq;
            for (int64_t h = 0; h < H; h++) {
                const uint16_t* xr = x + b * sxb + q * sxq + h * sxh;
                uint16_t* yr = y + ((b * Q + q) * H + h) * D;
                for (int64_t d = 0; d < D; d++) {
                    const float rot = d < half ? -bf16_to_float(xr[d + half]) : bf16_to_float(xr[d - half]);
                    const float a = bf16_to_float(float_to_bf16(bf16_to_float(xr[d]) * bf16_to_float(c[d])));
                    const float r = bf16_to_float(float_to_bf16(rot * bf16_to_float(s[d])));
                    yr[d] = float_to_bf16(a + r);
                }
            }
        }
}

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
