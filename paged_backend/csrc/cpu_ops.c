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
