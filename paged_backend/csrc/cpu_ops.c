/* Fused elementwise ops for bf16 rows on CPU: one call where torch runs 3-9 ops.
 *
 * Each op rounds to bf16 exactly where the torch ops it replaces do (see `paged_backend.cpu_ops`),
 * so outputs match them but for the last-bit differences of a different summation order or exp.
 * Single-threaded: the engine calls them for small steps only, where torch's per-op dispatch
 * costs more than the arithmetic. Built at first use with the system C compiler.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 to_bf16(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return to_f32(to_bf16(f)); }

/* out = bf16(h * rsqrt(mean(h^2) + eps) * weight) per row (one rounding, as F.rms_norm), h = x,
 * or with `residual`: h = bf16(x + residual), also written to `new_residual`. */
void rms_norm_bf16(const bf16 *x, const bf16 *residual, const bf16 *weight, bf16 *out,
                   bf16 *new_residual, int64_t rows, int64_t dim, int64_t x_stride, float eps) {
    float h[dim];
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *xr = x + r * x_stride;
        for (int64_t i = 0; i < dim; i++) h[i] = to_f32(xr[i]);
        if (residual) {
            for (int64_t i = 0; i < dim; i++) {
                bf16 sum = to_bf16(h[i] + to_f32(residual[r * dim + i]));
                new_residual[r * dim + i] = sum;
                h[i] = to_f32(sum);
            }
        }
        float acc[16] = {0};
        for (int64_t i = 0; i < dim; i += 16)
            for (int k = 0; k < 16 && i + k < dim; k++) acc[k] += h[i + k] * h[i + k];
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) sum += acc[k];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = to_bf16(h[i] * inv * to_f32(weight[i]));
    }
}

/* Rotate-half rotary embedding, in place on `heads` heads of `dim` per token row:
 * x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin [tokens, dim] in bf16. */
void rotary_bf16(bf16 *x, const bf16 *cos, const bf16 *sin, int64_t tokens, int64_t heads,
                 int64_t dim, int64_t x_stride) {
    int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const bf16 *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads; h++) {
            bf16 *v = x + t * x_stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                float a = to_f32(v[i]), b = to_f32(v[i + half]);
                float lo = round_bf16(a * to_f32(c[i])) + round_bf16(-b * to_f32(s[i]));
                float hi = round_bf16(b * to_f32(c[i + half])) + round_bf16(a * to_f32(s[i + half]));
                v[i] = to_bf16(lo);
                v[i + half] = to_bf16(hi);
            }
        }
    }
}

/* out = bf16(bf16(silu(gate)) * up) for rows x = [gate | up], each `dim` wide. */
void silu_and_mul_bf16(const bf16 *x, bf16 *out, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *gate = x + r * 2 * dim, *up = gate + dim;
        for (int64_t i = 0; i < dim; i++) {
            float g = to_f32(gate[i]);
            out[r * dim + i] = to_bf16(round_bf16(g / (1.0f + expf(-g))) * to_f32(up[i]));
        }
    }
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp),
 * written in plain arithmetic so that loops over it vectorise. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

static inline float dot_bf16(const float *q, const bf16 *k, int64_t dim) {
    float acc[16] = {0};
    for (int64_t i = 0; i < dim; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += q[i + j] * to_f32(k[i + j]);
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += acc[j];
    return sum;
}

/* One decode step of paged attention: for each sequence, write its new token's k/v into the
 * head-major caches [kv_heads, slots, dim] (slot = block * block_size + offset), then attend its
 * query heads over all `seq_lens[s]` tokens (fp32 scores and softmax, exact two-pass), out in
 * bf16 [seqs, heads, dim]. Query heads h * group .. h * group + group - 1 read kv head h. `dim` is
 * a multiple of 16. Each token's heads are packed in q, k and v, whose rows are `q_stride`,
 * `k_stride`, `v_stride` apart (views into the fused qkv output); `scores` holds group * max len. */
void decode_attention_bf16(const bf16 *q, const bf16 *k, const bf16 *v, int64_t q_stride,
                           int64_t k_stride, int64_t v_stride,
                           bf16 *k_cache, bf16 *v_cache, int64_t cache_head_stride,
                           const int32_t *block_tables, int64_t max_blocks,
                           const int32_t *seq_lens, int64_t block_size, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t dim, float scale,
                           bf16 *out, float *scores) {
    int64_t group = num_heads / num_kv_heads;
    float qf[group * dim], acc[group * dim];
    for (int64_t s = 0; s < num_seqs; s++) {
        const int32_t *table = block_tables + s * max_blocks;
        int64_t len = seq_lens[s], pos = len - 1;
        int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            bf16 *kc = k_cache + h * cache_head_stride, *vc = v_cache + h * cache_head_stride;
            memcpy(kc + slot * dim, k + s * k_stride + h * dim, dim * sizeof(bf16));
            memcpy(vc + slot * dim, v + s * v_stride + h * dim, dim * sizeof(bf16));
            for (int64_t i = 0; i < group * dim; i++)
                qf[i] = to_f32(q[s * q_stride + h * group * dim + i]);
            for (int64_t t = 0; t < len; t++) {
                const bf16 *kr = kc + ((int64_t)table[t / block_size] * block_size + t % block_size) * dim;
                for (int64_t g = 0; g < group; g++)
                    scores[g * len + t] = dot_bf16(qf + g * dim, kr, dim) * scale;
            }
            float total[group];
            for (int64_t g = 0; g < group; g++) {
                float *sg = scores + g * len, top = sg[0], part[16] = {0};
                for (int64_t t = 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
                for (int64_t t = 0; t < len; t++) sg[t] = exp_nonpositive(sg[t] - top);
                for (int64_t t = 0; t < len; t++) part[t & 15] += sg[t];
                total[g] = 0.0f;
                for (int j = 0; j < 16; j++) total[g] += part[j];
            }
            memset(acc, 0, sizeof acc);
            for (int64_t t = 0; t < len; t++) {
                const bf16 *vr = vc + ((int64_t)table[t / block_size] * block_size + t % block_size) * dim;
                for (int64_t g = 0; g < group; g++) {
                    float p = scores[g * len + t];
                    for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += p * to_f32(vr[i]);
                }
            }
            for (int64_t i = 0; i < group * dim; i++)
                out[(s * num_heads + h * group) * dim + i] = to_bf16(acc[i] / total[i / dim]);
        }
    }
}
