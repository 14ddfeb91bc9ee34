/* Row-invariant decode/tree attention for x86-64 CPUs with AVX-512 (float32 and bfloat16 storage).
 *
 *     out[b, q, h, :] = sum_j softmax_j(scale * q[b, q, h, :] . k[b, j, h / G, :]) v[b, j, h / G, :]
 *
 * over the slots j the query sees, in ascending slot order: the committed prefix j < P = prefix_lens[b],
 * then the tree slots j = P + t whose tree_mask[b, q, t] is set (slots >= S are never read). G = Hq / Hkv
 * query heads share a KV head (GQA). A query that sees nothing gets zeros.
 *
 * Row invariance: one (b, q, kv head) is one task; it walks its visible slots in blocks of 64 *visible*
 * keys (block edges counted along the visible sequence, not in slot numbers) with an online softmax in
 * float32: scores by one fixed dot-product sequence, the block's max, exp by one polynomial, the sum and
 * the weighted values accumulated key after key. Nothing depends on the other queries, the batch, the
 * tree's other nodes or the thread count, only on the keys the query sees and their order. A token's
 * attention is therefore the same bit for bit when it is verified as a tree node (prefix + its ancestors'
 * slots + its own) and when it is decoded alone after those ancestors were committed (the same keys at
 * consecutive slots): speculative and plain decoding agree, in bfloat16 too.
 *
 * Speed: a decode step's attention reads each visible K and V row once per KV head (L2-resident for
 * decode lengths), so this is ~10x less work than a masked SDPA over a padded key bound.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "bf16.h"

#define BLOCK 64   /* visible keys per online-softmax block */
#define MAX_G 16   /* query heads per KV head */
#define MAX_D 256  /* head dim */
#define SMALL_WORK (1 << 17) /* multiply-adds below which one thread runs the call */

/* exp(x) for x <= 0 (lanes below -87 give ~0 and are masked by the caller when invalid); Cephes' expf
 * polynomial, ~1 ulp. The same instruction sequence for every lane, so a value's result never depends on
 * the lane it sits in. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

/* 16 (or fewer, masked) elements as float32 from float32 or bfloat16 storage. */
static inline __m512 load_f32(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
    __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* One task: query row (b, q), KV head kh, its G query heads. T = element type (float or uint16_t). */
#define TASK(NAME, T, LOAD)                                                                                  \
    static void NAME(const T* qrow, int64_t sqh, const T* kb, const T* vb, int64_t sks, int64_t svs,         \
                     int64_t P, const uint8_t* mrow, int64_t smt, int64_t T_, int64_t S, int G, int64_t D, float scale,    \
                     float* outf /* [G, D] float32 */) {                                                      \
        const int64_t nd = (D + 15) / 16;                                                                     \
        float qf[MAX_G][MAX_D] __attribute__((aligned(64)));                                                  \
        float acc[MAX_G][MAX_D] __attribute__((aligned(64)));                                                 \
        float s[MAX_G][BLOCK] __attribute__((aligned(64)));                                                   \
        float m[MAX_G], l[MAX_G];                                                                             \
        for (int g = 0; g < G; g++) {                                                                         \
            for (int64_t c = 0; c < nd; c++) {                                                                \
                __mmask16 mk = tail_mask(D - 16 * c);                                                         \
                _mm512_store_ps(&qf[g][16 * c], LOAD(qrow + g * sqh + 16 * c, mk));                           \
                _mm512_store_ps(&acc[g][16 * c], _mm512_setzero_ps());                                        \
            }                                                                                                 \
            m[g] = -INFINITY;                                                                                 \
            l[g] = 0.0f;                                                                                      \
        }                                                                                                     \
        const int64_t pre = P < S ? (P > 0 ? P : 0) : S;                                                      \
        int64_t j = 0, t = 0; /* cursor: prefix slot j, then tree offset t */                                 \
        int64_t slot[BLOCK];                                                                                  \
        for (;;) {                                                                                            \
            int n = 0;                                                                                        \
            while (n < BLOCK && j < pre) slot[n++] = j++;                                                     \
            while (n < BLOCK && t < T_ && P + t < S) {                                                        \
                if (mrow[t * smt] && P + t >= 0) slot[n++] = P + t; /* a negative P: slots < 0 unseen */    \
                t++;                                                                                          \
            }                                                                                                 \
            if (n == 0) break;                                                                                \
            for (int i = 0; i < n; i++) { /* scores */                                                        \
                const T* kr = kb + slot[i] * sks;                                                             \
                __m512 dot[MAX_G];                                                                            \
                for (int g = 0; g < G; g++) dot[g] = _mm512_setzero_ps();                                     \
                for (int64_t c = 0; c < nd; c++) {                                                            \
                    __m512 kv = LOAD(kr + 16 * c, tail_mask(D - 16 * c));                                    \
                    for (int g = 0; g < G; g++) dot[g] = _mm512_fmadd_ps(_mm512_load_ps(&qf[g][16 * c]), kv, dot[g]); \
                }                                                                                             \
                for (int g = 0; g < G; g++) s[g][i] = _mm512_reduce_add_ps(dot[g]) * scale;                   \
            }                                                                                                 \
            for (int g = 0; g < G; g++) { /* online softmax: block max, rescale, exp, sum */                  \
                float bm = s[g][0];                                                                           \
                for (int i = 1; i < n; i++) bm = s[g][i] > bm ? s[g][i] : bm;                                 \
                const float mn = bm > m[g] ? bm : m[g];                                                       \
                const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mn);                               \
                m[g] = mn;                                                                                    \
                __m512 sum = _mm512_setzero_ps();                                                             \
                for (int i0 = 0; i0 < n; i0 += 16) {                                                          \
                    __mmask16 mk = tail_mask(n - i0);                                                         \
                    __m512 p = _mm512_maskz_mov_ps(mk, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(&s[g][i0]), _mm512_set1_ps(mn)))); \
                    _mm512_storeu_ps(&s[g][i0], p);                                                           \
                    sum = _mm512_add_ps(sum, p);                                                              \
                }                                                                                             \
                l[g] = l[g] * alpha + _mm512_reduce_add_ps(sum);                                              \
                if (alpha != 1.0f)                                                                            \
                    for (int64_t c = 0; c < nd; c++)                                                          \
                        _mm512_store_ps(&acc[g][16 * c], _mm512_mul_ps(_mm512_load_ps(&acc[g][16 * c]), _mm512_set1_ps(alpha))); \
            }                                                                                                 \
            for (int i = 0; i < n; i++) { /* acc += p v, key after key */                                     \
                const T* vr = vb + slot[i] * svs;                                                             \
                for (int64_t c = 0; c < nd; c++) {                                                            \
                    __m512 vv = LOAD(vr + 16 * c, tail_mask(D - 16 * c));                                     \
                    for (int g = 0; g < G; g++)                                                               \
                        _mm512_store_ps(&acc[g][16 * c], _mm512_fmadd_ps(_mm512_set1_ps(s[g][i]), vv,           \
                                                                         _mm512_load_ps(&acc[g][16 * c])));   \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
        for (int g = 0; g < G; g++) {                                                                         \
            const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;                                               \
            for (int64_t d = 0; d < D; d++) outf[g * D + d] = acc[g][d] * inv;                                \
        }                                                                                                     \
    }

TASK(task_f32, float, load_f32)
TASK(task_bf16, uint16_t, load_bf16)

/* q [B, Q, Hq, D] at strides (sqb, sqq, sqh, 1); k, v [>=B, >=S, Hkv, D] at strides (skb, sks, skh, 1) and
 * (svb, svs, svh, 1); prefix_lens [B]; tree_mask [B, Q, T] (bytes) at strides (smb, smq, smt); out [B, Q, Hq, D]
 * contiguous.
 * Returns 0, or -1 when G or D exceed the kernel's limits (the caller checks them first). */
#define ATTENTION(NAME, T, TASKFN, STORE)                                                                     \
    int NAME(const T* q, int64_t B, int64_t Q, int64_t Hq, int64_t D, int64_t sqb, int64_t sqq, int64_t sqh, \
             const T* k, const T* v, int64_t Hkv, int64_t skb, int64_t sks, int64_t skh, int64_t svb,         \
             int64_t svs, int64_t svh, const int64_t* prefix_lens, const uint8_t* tree_mask, int64_t smb,        \
             int64_t smq, int64_t smt, int64_t T_,                                                          \
             int64_t S, float scale, T* out, int threads) {                                                   \
        if (Hkv <= 0 || Hq % Hkv || Hq / Hkv > MAX_G || D > MAX_D) return -1;                                 \
        const int G = (int)(Hq / Hkv);                                                                        \
        const int64_t tasks = B * Q * Hkv;                                                                    \
        int64_t keys = 0; /* work bound: small calls run on one thread (the result never depends on it) */  \
        for (int64_t b = 0; b < B; b++) keys += (prefix_lens[b] < S ? prefix_lens[b] : S) + T_;             \
        if (keys * Q * Hq * D < SMALL_WORK) threads = 1;                                                     \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                                     \
        for (int64_t task = 0; task < tasks; task++) {                                                        \
            const int64_t b = task / (Q * Hkv), qi = (task / Hkv) % Q, kh = task % Hkv;                       \
            float o[MAX_G * MAX_D];                                                                           \
            TASKFN(q + b * sqb + qi * sqq + kh * G * sqh, sqh, k + b * skb + kh * skh, v + b * svb + kh * svh, \
                   sks, svs, prefix_lens[b], tree_mask + b * smb + qi * smq, smt, T_, S, G, D, scale, o);     \
            T* dst = out + ((b * Q + qi) * Hq + kh * G) * D;                                                  \
            for (int64_t e = 0; e < G * D; e++) dst[e] = STORE(o[e]);                                         \
        }                                                                                                     \
        return 0;                                                                                             \
    }

#define STORE_F32(x) (x)
ATTENTION(tritonspec_tree_attention_f32, float, task_f32, STORE_F32)
ATTENTION(tritonspec_tree_attention_bf16, uint16_t, task_bf16, float_to_bf16)
