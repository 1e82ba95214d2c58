/* A decode step of an fp32 model in C: RMSNorm, rotary, SiLU-and-mul, decode attention over the
 * paged cache, and all of a step's layers in one call (`decode_layers_f32`, on `linear_f32`).
 *
 * On CPUs without bf16 arithmetic (AVX2) models run in fp32, and at one row torch spends more of
 * a step on dispatch (~270 ops, 10-20 us each) and on gathering each layer's K/V blocks than on
 * reading the weights. These loops are plain C that the compiler vectorises for the target CPU;
 * they follow torch's fp32 formulas (sums in another order: outputs agree to rounding).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

void linear_f32(const float *x, int64_t rows, int64_t x_stride, const float *w, int64_t n,
                int64_t k, float *y, int64_t y_stride, int threads);
void linear_f32_serial(const float *x, int64_t rows, int64_t x_stride, const float *w, int64_t n,
                       int64_t k, float *y, int64_t y_stride);
void quantize_activations(const void *x, int x_bf16, int64_t rows, int64_t k, int64_t x_stride,
                          int64_t block, int8_t *xq, float *xd, int16_t *bsum, int threads);
void quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                  const int8_t *xq, const float *xd, const int16_t *bsum,
                  int64_t rows, void *out, int out_bf16, int64_t out_stride, int threads);

/* out = h * rsqrt(mean(h^2) + eps) * weight per row, h = x, or with `residual`: h = x + residual,
 * also written to `new_residual` (which may be `residual`). */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out,
                  float *new_residual, int64_t rows, int64_t dim, int64_t x_stride, float eps,
                  int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *h = x + r * x_stride;
        if (residual) {
            float *sum = new_residual + r * dim;
            for (int64_t i = 0; i < dim; i++) sum[i] = h[i] + residual[r * dim + i];
            h = sum;
        }
        float acc[16] = {0};
        int64_t full = dim / 16 * 16; /* whole vectors first: a loop without branches vectorises */
        for (int64_t i = 0; i < full; i += 16)
            for (int k = 0; k < 16; k++) acc[k] += h[i + k] * h[i + k];
        for (int64_t i = full; i < dim; i++) acc[i - full] += h[i] * h[i];
        float total = 0.0f;
        for (int k = 0; k < 16; k++) total += acc[k];
        float inv = 1.0f / sqrtf(total / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = h[i] * inv * weight[i];
    }
}

/* Rotate-half rotary embedding, in place on the first `rot_dim` dims of `heads` heads of `dim`
 * per token row (rows `x_stride` apart); cos/sin [tokens, rot_dim]. */
void rotary_f32(float *x, const float *cos, const float *sin, int64_t tokens, int64_t heads,
                int64_t dim, int64_t rot_dim, int64_t x_stride, int threads) {
    int64_t half = rot_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + t * rot_dim, *s = sin + t * rot_dim;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * x_stride + h * dim;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out = silu(gate) * up for rows [gate | up] of 2 * dim; sigmoid from exp(-|g|), so that the
 * loop vectorises and never overflows. */
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * dim, *up = gate + dim;
        for (int64_t i = 0; i < dim; i++) {
            float g = gate[i], e = exp_nonpositive(-fabsf(g));
            float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            out[r * dim + i] = g * sigmoid * up[i];
        }
    }
}

/* out = sum_j p[j] v[key j] over a query's `n` keys from `first` on (rows through the block
 * table), dim a multiple of 16: 64 dims at a time in registers, keys in order. */
static void weighted_values(const float *p, const float *vc, const int32_t *table, int64_t first,
                            int64_t n, int64_t block_size, int64_t dim, float *out) {
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        int64_t width = dim - d0 < 64 ? dim - d0 : 64;
#ifdef __AVX2__
        if (width == 64) {
            __m256 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; j++) {
                const float *vr = vc + slot_of(table, first + j, block_size) * dim + d0;
                __m256 w = _mm256_set1_ps(p[j]);
                for (int i = 0; i < 8; i++)
                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * i), acc[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + d0 + 8 * i, acc[i]);
            continue;
        }
#endif
        float acc[64] = {0};
        for (int64_t j = 0; j < n; j++) {
            const float *vr = vc + slot_of(table, first + j, block_size) * dim + d0;
            for (int64_t d = 0; d < width; d++) acc[d] = fmaf(p[j], vr[d], acc[d]);
        }
        memcpy(out + d0, acc, width * sizeof(float));
    }
}

/* The rows of a decode step, or of a step verifying drafts: sequence s has the rows
 * query_start[s] .. query_start[s + 1] - 1, its last tokens, at positions up to seq_lens[s] - 1.
 * Write each row's new k/v (rows `k_stride`/`v_stride` apart, heads side by side) at its
 * position, then attend its q (heads side by side, rows `q_stride` apart) causally over the
 * sequence's tokens up to its own (the last `window` of them, where > 0) through `block_tables`,
 * into `out` [rows][heads][dim]. The caches are head-major [kv_heads][slots][dim].
 *
 * The work splits over threads by (row, kv head): the kv head's `group` query heads meet its
 * keys a block at a time through `linear_f32_serial` (a row of 1,000 keys: ~2x faster than a dot
 * product a key, query head by query head), whose results do not depend on the tile or the other
 * rows: a row's output is the same in any batch, and a row verifying a draft gives the bits a
 * plain decode at that position gives (it reads the same keys, those up to its own). Scores go
 * in `scores` (a row of `scores_stride` >= group * context for each thread), then softmax, then
 * P.V in registers. `softcap` > 0 caps the scaled scores (tanh(s / cap) * cap, Gemma 2). */
void decode_attention_f32(const float *q, const float *k, const float *v, int64_t q_stride,
                          int64_t k_stride, int64_t v_stride, float *k_cache, float *v_cache,
                          int64_t cache_head_stride, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq_lens, const int32_t *query_start,
                          int64_t block_size, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t dim, float scale, float *out,
                          float *scores, int64_t scores_stride, int threads, int64_t window,
                          float softcap) {
    int64_t group = num_heads / num_kv_heads, total_rows = query_start[num_seqs];
    if (total_rows <= 0) return;
    int32_t seq_of[total_rows]; /* each row's sequence */
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = query_start[s]; t < query_start[s + 1]; t++) {
            seq_of[t] = (int32_t)s;
            int64_t pos = seq_lens[s] - (query_start[s + 1] - t);
            int64_t slot = slot_of(block_tables + s * max_blocks, pos, block_size);
            for (int64_t h = 0; h < num_kv_heads; h++) {
                int64_t at = h * cache_head_stride + slot * dim;
                memcpy(k_cache + at, k + t * k_stride + h * dim, dim * sizeof(float));
                memcpy(v_cache + at, v + t * v_stride + h * dim, dim * sizeof(float));
            }
        }
    int64_t units = total_rows * num_kv_heads;
#pragma omp parallel for num_threads(threads) if (threads > 1 && units > 1) schedule(dynamic)
    for (int64_t u = 0; u < units; u++) {
        int64_t t = u / num_kv_heads, h = u % num_kv_heads, head = h * group;
        int64_t s = seq_of[t], pos = seq_lens[s] - (query_start[s + 1] - t);
        int64_t first = window > 0 && pos + 1 > window ? pos + 1 - window : 0, n = pos + 1 - first;
        const int32_t *table = block_tables + s * max_blocks;
        const float *kc = k_cache + h * cache_head_stride, *vc = v_cache + h * cache_head_stride;
        const float *qr = q + t * q_stride + head * dim;
        float *sc = scores + omp_get_thread_num() * scores_stride;
        for (int64_t j = 0; j < n;) { /* the keys of one block at a time */
            int64_t slot = slot_of(table, first + j, block_size);
            int64_t count = block_size - (first + j) % block_size;
            count = count < n - j ? count : n - j;
            linear_f32_serial(qr, group, dim, kc + slot * dim, count, dim, sc + j, n);
            j += count;
        }
        for (int64_t m = 0; m < group; m++) {
            float *row = sc + m * n, top = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < n; j++) row[j] *= scale;
            if (softcap > 0.0f)
                for (int64_t j = 0; j < n; j++) row[j] = tanhf(row[j] / softcap) * softcap;
            for (int64_t j = 0; j < n; j++) top = row[j] > top ? row[j] : top;
            for (int64_t j = 0; j < n; j++) {
                row[j] = exp_nonpositive(row[j] - top);
                sum += row[j];
            }
            for (int64_t j = 0; j < n; j++) row[j] /= sum;
            weighted_values(row, vc, table, first, n, block_size, dim,
                            out + (t * num_heads + head + m) * dim);
        }
    }
}

/* A layer linear of the fused step, from its descriptor of LINEAR_WORDS words: the number of
 * parts (weights side by side in the output: a fused qkv or gate/up projection), the bias address
 * (0: none), then each part's (type, address, outputs, row bytes): type 0 an fp32 weight [n][k]
 * for `linear_f32`, else a GGUF block type for `quant_matmul`, on activations quantized into
 * `act` (for the part's block size, once for consecutive parts that share it). */
#define LINEAR_WORDS 14
static void fused_linear(const int64_t *d, const float *x, int64_t rows, int64_t k, float *y,
                         int64_t n_total, float *act, int64_t max_k, int threads) {
    int64_t kp = act_stride(max_k), block = 0, column = 0;
    float *xd = act;
    int16_t *bsum = (int16_t *)(xd + rows * kp / 32);
    int8_t *xq = (int8_t *)(bsum + rows * kp / 16);
    for (int64_t p = 0; p < d[0]; p++) {
        const int64_t *part = d + 2 + 4 * p;
        int type = (int)part[0];
        if (type == 0) {
            linear_f32(x, rows, k, (const float *)part[1], part[2], k, y + column, n_total, threads);
        } else {
            int64_t need = type >= 12 ? 256 : 32; /* the K-quants' super-blocks (Q4_K = 12 on) */
            if (block != need)
                quantize_activations(x, 0, rows, k, k, need, xq, xd, bsum, threads);
            block = need;
            quant_matmul(type, (const uint8_t *)part[1], part[2], k, part[3], xq, xd, bsum,
                         rows, y + column, 0, n_total, threads);
        }
        column += part[2];
    }
    const float *bias = (const float *)d[1];
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n_total; i++) y[r * n_total + i] += bias[i];
}

/* A decode step through all `num_layers` layers of a Llama-style model in one call, as the layer
 * modules run it on these ops: x [rows, hidden] in, the last layer's output out, and `residual`
 * the residual stream before it. `weights`: LAYER_WORDS words a layer, the input norm's address,
 * the qkv projection's descriptor (`fused_linear`), o's, the post-attention norm's address, then
 * gate_up's and down's. `work`: rows * (hidden + qkv width + heads * head_dim + 3 *
 * intermediate) floats; `act`: rows * kp * 5 / 16 floats (kp: `act_stride` of the widest input)
 * for quantized activations. The rows of `num_seqs` sequences as `decode_attention_f32`
 * takes them; `windows`: each layer's (0: global). */
#define LAYER_WORDS (2 + 4 * LINEAR_WORDS)
void decode_layers_f32(float *x, float *residual, int64_t rows, int64_t hidden, const float *cos,
                       const float *sin, int64_t num_layers, const int64_t *weights,
                       const int64_t *k_caches, const int64_t *v_caches,
                       int64_t cache_head_stride, const int64_t *windows,
                       const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                       const int32_t *query_start, int64_t num_seqs, int64_t block_size,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rot_dim,
                       int64_t intermediate, float eps, float scale, float *work, float *act,
                       float *scores, int64_t scores_stride, int threads) {
    int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    int64_t qkv_width = q_size + 2 * kv_size;
    int64_t max_k = hidden > q_size ? hidden : q_size;
    max_k = max_k > intermediate ? max_k : intermediate;
    float *h = work, *qkv = h + rows * hidden, *attn = qkv + rows * qkv_width;
    float *gate_up = attn + rows * q_size, *mlp = gate_up + rows * 2 * intermediate;
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = weights + LAYER_WORDS * l;
        const int64_t *qkv_proj = w + 1, *o_proj = qkv_proj + LINEAR_WORDS;
        const float *post_norm = (const float *)o_proj[LINEAR_WORDS];
        const int64_t *gate_up_proj = o_proj + LINEAR_WORDS + 1;
        const int64_t *down_proj = gate_up_proj + LINEAR_WORDS;
        if (l == 0) {
            rms_norm_f32(x, NULL, (const float *)w[0], h, NULL, rows, hidden, hidden, eps, threads);
            memcpy(residual, x, rows * hidden * sizeof(float));
        } else {
            rms_norm_f32(x, residual, (const float *)w[0], h, residual, rows, hidden, hidden, eps,
                         threads);
        }
        fused_linear(qkv_proj, h, rows, hidden, qkv, qkv_width, act, max_k, threads);
        rotary_f32(qkv, cos, sin, rows, num_heads + num_kv_heads, head_dim, rot_dim, qkv_width,
                   threads);
        decode_attention_f32(qkv, qkv + q_size, qkv + q_size + kv_size, qkv_width, qkv_width,
                             qkv_width, (float *)k_caches[l], (float *)v_caches[l],
                             cache_head_stride, block_tables, max_blocks, seq_lens, query_start,
                             block_size, num_seqs, num_heads, num_kv_heads, head_dim, scale, attn,
                             scores, scores_stride, threads, windows[l], 0.0f);
        fused_linear(o_proj, attn, rows, q_size, x, hidden, act, max_k, threads);
        rms_norm_f32(x, residual, post_norm, h, residual, rows, hidden, hidden, eps, threads);
        fused_linear(gate_up_proj, h, rows, hidden, gate_up, 2 * intermediate, act, max_k,
                     threads);
        silu_and_mul_f32(gate_up, mlp, rows, intermediate, threads);
        fused_linear(down_proj, mlp, rows, intermediate, x, hidden, act, max_k, threads);
    }
}
