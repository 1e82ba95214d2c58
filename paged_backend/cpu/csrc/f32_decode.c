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
void quantize_activations(const void *x, int x_bf16, int64_t rows, int64_t k, int64_t x_stride,
                          int64_t block, int8_t *xq, float *xd, int16_t *bsum, int threads);
void quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                  const int8_t *xq, const float *xd, const int16_t *bsum,
                  int64_t rows, void *out, int out_bf16, int64_t out_stride, int threads);
#ifdef __AVX512BF16__
void gemm_bf16(const uint16_t *x, int64_t rows, int64_t x_stride, const uint16_t *wp, int64_t n,
               int64_t k, void *out, int out_bf16, int threads);
#endif

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

#ifdef __AVX2__
EXP_CLAMPED(exp_clamped8, 256) /* exp_nonpositive on 8 lanes, the same bits */
#endif

/* out = silu(gate) * up for rows [gate | up] of 2 * dim; sigmoid from exp(-|g|), which never
 * overflows. */
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * dim, *up = gate + dim;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= dim; i += 8) { /* the scalar loop's operations, 8 lanes at a time */
            __m256 g = _mm256_loadu_ps(gate + i), e = exp_clamped8(_mm256_or_ps(g, sign));
            __m256 sum = _mm256_add_ps(one, e), nonneg = _mm256_cmp_ps(g, sign, _CMP_GE_OQ);
            __m256 sigmoid = _mm256_blendv_ps(_mm256_div_ps(e, sum), _mm256_div_ps(one, sum), nonneg);
            _mm256_storeu_ps(out + r * dim + i,
                             _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < dim; i++) {
            float g = gate[i], e = exp_nonpositive(-fabsf(g));
            float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
            out[r * dim + i] = g * sigmoid * up[i];
        }
    }
}

/* Decode attention's inner loops. Every result is one fixed sequence of operations on its inputs,
 * whatever the tile it falls in or the other rows of the step: a row's output is the same bits
 * alone, in a batch, or verifying drafts (it reads the same keys, those up to its own). The
 * caches hold fp32 or fp16 rows (`half`); fp16 values convert exactly as they are read, so an
 * fp16 cache gives the bits of an fp32 cache holding the same values. */
#define SCORE_KEYS 4 /* keys a score tile */
#define VALUE_HEADS 3 /* query heads sharing each value row read */

/* Row `row` of `dim` values of a cache of fp32 or fp16 rows. */
static inline const void *cache_row(const void *cache, int half, int64_t row, int64_t dim) {
    return (const char *)cache + row * dim * (half ? 2 : 4);
}

/* Write x[0..dim) at row `slot` of the cache, rounding to nearest even into an fp16 one. */
static void store_row(void *cache, int half, int64_t slot, int64_t dim, const float *x) {
    if (!half) {
        memcpy((float *)cache + slot * dim, x, dim * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)cache + slot * dim;
    int64_t i = 0;
#ifdef __AVX2__
    for (; i + 8 <= dim; i += 8)
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < dim; i++) out[i] = f32_to_f16(x[i]);
}

#ifdef __AVX2__
/* Lane i: the sum of vector i's lanes, ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)). */
static inline __m128 lane_sums4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Scores of NQ query vectors against SCORE_KEYS consecutive keys of type T, 8 dims a step. */
#define SCORE_TILE(KIND, T, NQ)                                                                    \
    static void KIND##_score_tile_##NQ(const float *const *q, const void *key_rows, int64_t dim,   \
                                       float *out, int64_t out_stride) {                          \
        const T *keys = (const T *)key_rows;                                                       \
        __m256 acc[NQ][SCORE_KEYS];                                                                \
        for (int m = 0; m < NQ; m++)                                                               \
            for (int a = 0; a < SCORE_KEYS; a++) acc[m][a] = _mm256_setzero_ps();                  \
        for (int64_t d = 0; d < dim; d += 8) {                                                     \
            __m256 kv[SCORE_KEYS];                                                                 \
            for (int a = 0; a < SCORE_KEYS; a++) kv[a] = load_##KIND(keys + a * dim + d);          \
            for (int m = 0; m < NQ; m++) {                                                         \
                __m256 qv = _mm256_loadu_ps(q[m] + d);                                            \
                for (int a = 0; a < SCORE_KEYS; a++)                                               \
                    acc[m][a] = _mm256_fmadd_ps(qv, kv[a], acc[m][a]);                             \
            }                                                                                      \
        }                                                                                          \
        for (int m = 0; m < NQ; m++)                                                               \
            _mm_storeu_ps(out + m * out_stride,                                                    \
                          lane_sums4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));                 \
    }
#define SCORE_TILES(KIND, T) SCORE_TILE(KIND, T, 1) SCORE_TILE(KIND, T, 2) SCORE_TILE(KIND, T, 3)
SCORE_TILES(f32, float)
SCORE_TILES(f16, uint16_t)
typedef void (*score_tile_fn)(const float *const *, const void *, int64_t, float *, int64_t);
static score_tile_fn const SCORE_TILE_FNS[2][3] = {
    {f32_score_tile_1, f32_score_tile_2, f32_score_tile_3},
    {f16_score_tile_1, f16_score_tile_2, f16_score_tile_3},
};

static float score_one(const float *q, const void *key, int half, int64_t dim) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        __m256 kd = half ? load_f16((const uint16_t *)key + d) : load_f32((const float *)key + d);
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kd, acc);
    }
    return _mm_cvtss_f32(lane_sums4(acc, acc, acc, acc));
}
#else
static inline float cache_value(const void *row, int half, int64_t i) {
    return half ? f16_to_f32((const uint16_t *)row + i) : ((const float *)row)[i];
}

static float score_one(const float *q, const void *key, int half, int64_t dim) {
    float lane[8] = {0};
    for (int64_t d = 0; d < dim; d += 8)
        for (int l = 0; l < 8; l++) lane[l] = fmaf(q[d + l], cache_value(key, half, d + l), lane[l]);
    return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}
#endif

/* out[m * out_stride + j] = q[m] . key_j for `nq` query vectors and `count` consecutive keys
 * (cache rows of `dim`), dim a multiple of 8. */
static void key_scores(const float *const *q, int64_t nq, const void *keys, int half,
                       int64_t count, int64_t dim, float *out, int64_t out_stride) {
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + SCORE_KEYS <= count; j += SCORE_KEYS)
        for (int64_t m = 0; m < nq;) {
            int64_t left = nq - m, take = left == 4 ? 2 : left < 3 ? left : 3; /* 4: 2 + 2 */
            SCORE_TILE_FNS[half][take - 1](q + m, cache_row(keys, half, j, dim), dim,
                                           out + m * out_stride + j, out_stride);
            m += take;
        }
#endif
    for (; j < count; j++)
        for (int64_t m = 0; m < nq; m++)
            out[m * out_stride + j] = score_one(q[m], cache_row(keys, half, j, dim), half, dim);
}

/* row[j] = exp(row[j] - top) for row[j] <= top (the compiler does not vectorise the scalar loop). */
static void exp_shifted(float *row, int64_t n, float top) {
    int64_t j = 0;
#ifdef __AVX2__
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(row + j, exp_clamped8(_mm256_sub_ps(_mm256_loadu_ps(row + j),
                                                             _mm256_set1_ps(top))));
#endif
    for (; j < n; j++) row[j] = exp_nonpositive(row[j] - top);
}

/* row = softmax(scale * row) in place over n scores (capped first where softcap > 0: tanh(s /
 * cap) * cap, Gemma 2). The max and the sum go 8 lanes at a time (loops the compiler
 * vectorises; the exp: `exp_shifted`), the sum's lanes added in a fixed tree, then the tail in
 * order. */
static void softmax_row(float *row, int64_t n, float scale, float softcap) {
    for (int64_t j = 0; j < n; j++) row[j] *= scale;
    if (softcap > 0.0f)
        for (int64_t j = 0; j < n; j++) row[j] = tanhf(row[j] / softcap) * softcap;
    float top[8], lane[8], sum;
    int64_t j = 0;
    for (int l = 0; l < 8; l++) top[l] = -INFINITY, lane[l] = 0.0f;
    for (; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) top[l] = row[j + l] > top[l] ? row[j + l] : top[l];
    for (; j < n; j++) top[0] = row[j] > top[0] ? row[j] : top[0];
    for (int l = 1; l < 8; l++) top[0] = top[l] > top[0] ? top[l] : top[0];
    exp_shifted(row, n, top[0]);
    for (j = 0; j + 8 <= n; j += 8)
        for (int l = 0; l < 8; l++) lane[l] += row[j + l];
    sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
    for (; j < n; j++) sum += row[j];
    for (j = 0; j < n; j++) row[j] /= sum;
}

/* out_m = sum_j p_m[j] v[key j] for `heads` (<= VALUE_HEADS) query heads of one row (their
 * probabilities `p_stride` apart, outputs `dim` apart) over n keys from `first` on (rows through
 * the block table), a block's keys at a time. dim a multiple of 16, 32 dims at a time in
 * registers: each value row is read once for all the heads. Each output adds its keys in order,
 * one fma a key: the bits of the head taken alone. */
#ifdef __AVX2__
#define VALUE_TILE(KIND, T, NH, NV)                                                                \
    static void KIND##_value_tile_##NH##_##NV(const float *p, int64_t p_stride, const void *vc,    \
                                              const int32_t *table, int64_t first, int64_t n,     \
                                              int64_t block_size, int64_t dim, int64_t d0,        \
                                              float *out) {                                        \
        __m256 acc[NH][NV];                                                                        \
        for (int m = 0; m < NH; m++)                                                               \
            for (int i = 0; i < NV; i++) acc[m][i] = _mm256_setzero_ps();                          \
        for (int64_t j = 0; j < n;) {                                                              \
            int64_t count = block_size - (first + j) % block_size;                                 \
            count = count < n - j ? count : n - j;                                                 \
            const T *vr = (const T *)vc + slot_of(table, first + j, block_size) * dim + d0;        \
            for (int64_t e = 0; e < count; e++, vr += dim) {                                       \
                __m256 v[NV];                                                                      \
                for (int i = 0; i < NV; i++) v[i] = load_##KIND(vr + 8 * i);                       \
                for (int m = 0; m < NH; m++) {                                                     \
                    __m256 w = _mm256_set1_ps(p[m * p_stride + j + e]);                            \
                    for (int i = 0; i < NV; i++) acc[m][i] = _mm256_fmadd_ps(w, v[i], acc[m][i]);  \
                }                                                                                  \
            }                                                                                      \
            j += count;                                                                            \
        }                                                                                          \
        for (int m = 0; m < NH; m++)                                                               \
            for (int i = 0; i < NV; i++) _mm256_storeu_ps(out + m * dim + d0 + 8 * i, acc[m][i]);  \
    }
#define VALUE_TILES(KIND, T)                                                                       \
    VALUE_TILE(KIND, T, 1, 2) VALUE_TILE(KIND, T, 1, 4) VALUE_TILE(KIND, T, 2, 2)                  \
    VALUE_TILE(KIND, T, 2, 4) VALUE_TILE(KIND, T, 3, 2) VALUE_TILE(KIND, T, 3, 4)
VALUE_TILES(f32, float)
VALUE_TILES(f16, uint16_t)
typedef void (*value_tile_fn)(const float *, int64_t, const void *, const int32_t *, int64_t,
                              int64_t, int64_t, int64_t, int64_t, float *);
/* [half][heads - 1][32 dims left] */
static value_tile_fn const VALUE_TILE_FNS[2][VALUE_HEADS][2] = {
    {{f32_value_tile_1_2, f32_value_tile_1_4},
     {f32_value_tile_2_2, f32_value_tile_2_4},
     {f32_value_tile_3_2, f32_value_tile_3_4}},
    {{f16_value_tile_1_2, f16_value_tile_1_4},
     {f16_value_tile_2_2, f16_value_tile_2_4},
     {f16_value_tile_3_2, f16_value_tile_3_4}},
};
#endif

static void weighted_values(const float *p, int64_t p_stride, int64_t heads, const void *vc,
                            int half, const int32_t *table, int64_t first, int64_t n,
                            int64_t block_size, int64_t dim, float *out) {
#ifdef __AVX2__
    for (int64_t d0 = 0; d0 < dim; d0 += 32)
        VALUE_TILE_FNS[half][heads - 1][dim - d0 >= 32](p, p_stride, vc, table, first, n,
                                                        block_size, dim, d0, out);
#else
    for (int64_t m = 0; m < heads; m++)
        for (int64_t d = 0; d < dim; d++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < n; j++) {
                const void *row = cache_row(vc, half, slot_of(table, first + j, block_size), dim);
                acc = fmaf(p[m * p_stride + j], cache_value(row, half, d), acc);
            }
            out[m * dim + d] = acc;
        }
#endif
}

/* The first key position the query at `pos` sees: the last `window` (where > 0), else all. */
static inline int64_t window_first(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* The rows of a decode step, or of a step verifying drafts: sequence s has the rows
 * query_start[s] .. query_start[s + 1] - 1, its last tokens, at positions up to seq_lens[s] - 1.
 * Write each row's new k/v (rows `k_stride`/`v_stride` apart, heads side by side) at its
 * position, then attend its q (heads side by side, rows `q_stride` apart) causally over the
 * sequence's tokens up to its own (the last `window` of them, where > 0) through `block_tables`,
 * into `out` [rows][heads][dim]. The caches are head-major [kv_heads][slots][dim], of fp32 rows
 * or, with `kv_half`, of fp16 rows (the new k/v rounded to nearest even as they are written).
 *
 * The work splits over threads by (sequence, kv head, chunk of the sequence's rows): the chunk's
 * query heads of the kv head meet its keys a block at a time (`key_scores`, tiles of 4 keys by
 * up to 3 query vectors), then each row's softmax over its own keys (`softmax_row`), then P.V
 * with each value row read once for up to 3 heads (`weighted_values`). Scores go in `scores` (a
 * row of `scores_stride` >= group * the most rows a sequence has * context for each thread).
 * `softcap` > 0 caps the scaled scores (tanh(s / cap) * cap, Gemma 2). */
void decode_attention_f32(const float *q, const float *k, const float *v, int64_t q_stride,
                          int64_t k_stride, int64_t v_stride, void *k_cache, void *v_cache,
                          int kv_half, int64_t cache_head_stride, const int32_t *block_tables,
                          int64_t max_blocks, const int32_t *seq_lens, const int32_t *query_start,
                          int64_t block_size, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t dim, float scale, float *out,
                          float *scores, int64_t scores_stride, int threads, int64_t window,
                          float softcap) {
    int64_t group = num_heads / num_kv_heads, total_rows = query_start[num_seqs];
    int64_t head_rows = cache_head_stride / dim; /* a kv head's slots */
    if (total_rows <= 0) return;
    for (int64_t s = 0; s < num_seqs; s++)
        for (int64_t t = query_start[s]; t < query_start[s + 1]; t++) {
            int64_t pos = seq_lens[s] - (query_start[s + 1] - t);
            int64_t slot = slot_of(block_tables + s * max_blocks, pos, block_size);
            for (int64_t h = 0; h < num_kv_heads; h++) {
                int64_t at = h * head_rows + slot;
                store_row(k_cache, kv_half, at, dim, k + t * k_stride + h * dim);
                store_row(v_cache, kv_half, at, dim, v + t * v_stride + h * dim);
            }
        }
    /* A unit: one kv head of a sequence over a chunk of its rows, which meet each key and value
     * row in one pass (a verifying step's rows would each stream the layer's cache from memory
     * again). A step of few sequences splits their rows so that each thread has two units. */
    int64_t chunk_seq[total_rows], chunk_row[total_rows], chunk_rows[total_rows], chunks = 0;
    int64_t pieces = (2 * threads + num_seqs * num_kv_heads - 1) / (num_seqs * num_kv_heads);
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t a = query_start[s], r = query_start[s + 1] - a, c = r < pieces ? r : pieces;
        for (int64_t i = 0; i < c; i++, chunks++) {
            chunk_seq[chunks] = s;
            chunk_row[chunks] = a + r * i / c;
            chunk_rows[chunks] = r * (i + 1) / c - r * i / c;
        }
    }
    int64_t units = chunks * num_kv_heads;
#pragma omp parallel for num_threads(threads) if (threads > 1 && units > 1) schedule(dynamic)
    for (int64_t u = 0; u < units; u++) {
        int64_t c = u / num_kv_heads, h = u % num_kv_heads, head = h * group;
        int64_t s = chunk_seq[c], t0 = chunk_row[c], rows = chunk_rows[c], nq = rows * group;
        int64_t pos0 = seq_lens[s] - (query_start[s + 1] - t0); /* the chunk's first row's */
        int64_t first = window_first(pos0, window);
        int64_t n = pos0 + rows - first; /* keys any row of the chunk sees */
        const int32_t *table = block_tables + s * max_blocks;
        const void *kc = cache_row(k_cache, kv_half, h * head_rows, dim);
        const void *vc = cache_row(v_cache, kv_half, h * head_rows, dim);
        const float *qs[nq];
        for (int64_t i = 0; i < nq; i++)
            qs[i] = q + (t0 + i / group) * q_stride + (head + i % group) * dim;
        float *sc = scores + omp_get_thread_num() * scores_stride; /* [nq][n] */
        for (int64_t j = 0; j < n;) { /* the keys of one block at a time */
            int64_t slot = slot_of(table, first + j, block_size);
            int64_t count = block_size - (first + j) % block_size;
            count = count < n - j ? count : n - j;
            key_scores(qs, nq, cache_row(kc, kv_half, slot, dim), kv_half, count, dim, sc + j, n);
            j += count;
        }
        for (int64_t r = 0; r < rows; r++) { /* each row over its own keys */
            int64_t pos = pos0 + r, from = window_first(pos, window);
            float *p = sc + r * group * n + (from - first);
            for (int64_t m = 0; m < group; m++) softmax_row(p + m * n, pos + 1 - from, scale, softcap);
            for (int64_t m = 0; m < group; m += VALUE_HEADS)
                weighted_values(p + m * n, n, group - m < VALUE_HEADS ? group - m : VALUE_HEADS, vc,
                                kv_half, table, from, pos + 1 - from, block_size, dim,
                                out + ((t0 + r) * num_heads + head + m) * dim);
        }
    }
}

/* A layer linear of the fused steps, from its descriptor of LINEAR_WORDS words: the number of
 * parts (weights side by side in the output: a fused qkv or gate/up projection), the bias address
 * (0: none; fp32 only), then each part's (type, address, outputs, row bytes): type 0 a float
 * weight, else a GGUF block type for `quant_matmul`, on activations quantized into `act` (for the
 * part's block size, once for consecutive parts that share it). x [rows][k] and y [rows][n_total]
 * are fp32 (`decode_layers_f32`; type 0: an fp32 weight [n][k] for `linear_f32`) or, with
 * `bf16_io`, bf16 (`decode_layers_bf16`; type 0: the one part, the packed copy `gemm_bf16`
 * reads, which only AVX512-BF16 builds make), each output rounded once as the modules' are. */
void fused_linear(const int64_t *d, const void *x, int bf16_io, int64_t rows, int64_t k, void *y,
                  int64_t n_total, float *act, int64_t max_k, int threads) {
    int64_t kp = act_stride(max_k), block = 0, column = 0, elem = bf16_io ? 2 : 4;
    float *xd = act;
    int16_t *bsum = (int16_t *)(xd + rows * kp / 32);
    int8_t *xq = (int8_t *)(bsum + rows * kp / 16);
    for (int64_t p = 0; p < d[0]; p++) {
        const int64_t *part = d + 2 + 4 * p;
        int type = (int)part[0];
        void *out = (char *)y + column * elem;
        if (type == 0 && !bf16_io) {
            linear_f32(x, rows, k, (const float *)part[1], part[2], k, out, n_total, threads);
        } else if (type == 0) {
#ifdef __AVX512BF16__
            gemm_bf16(x, rows, k, (const uint16_t *)part[1], part[2], k, out, 1, threads);
#endif
        } else {
            int64_t need = type >= 12 ? 256 : 32; /* the K-quants' super-blocks (Q4_K = 12 on) */
            if (block != need)
                quantize_activations(x, bf16_io, rows, k, k, need, xq, xd, bsum, threads);
            block = need;
            quant_matmul(type, (const uint8_t *)part[1], part[2], k, part[3], xq, xd, bsum,
                         rows, out, bf16_io, n_total, threads);
        }
        column += part[2];
    }
    const float *bias = (const float *)d[1];
    float *yf = y;
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n_total; i++) yf[r * n_total + i] += bias[i];
}

/* A decode step through all `num_layers` layers of a Llama-style model in one call, as the layer
 * modules run it on these ops: x [rows, hidden] in, the last layer's output out, and `residual`
 * the residual stream before it. `weights`: LAYER_WORDS words a layer, the input norm's address,
 * the qkv projection's descriptor (`fused_linear`), o's, the post-attention norm's address, then
 * gate_up's and down's. `work`: rows * (hidden + qkv width + heads * head_dim + 3 *
 * intermediate) floats; `act`: rows * kp * 5 / 16 floats (kp: `act_stride` of the widest input)
 * for quantized activations. The rows of `num_seqs` sequences as `decode_attention_f32`
 * takes them; `windows`: each layer's (0: global). */
void decode_layers_f32(float *x, float *residual, int64_t rows, int64_t hidden, const float *cos,
                       const float *sin, int64_t num_layers, const int64_t *weights,
                       const int64_t *k_caches, const int64_t *v_caches, int kv_half,
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
        fused_linear(qkv_proj, h, 0, rows, hidden, qkv, qkv_width, act, max_k, threads);
        rotary_f32(qkv, cos, sin, rows, num_heads + num_kv_heads, head_dim, rot_dim, qkv_width,
                   threads);
        decode_attention_f32(qkv, qkv + q_size, qkv + q_size + kv_size, qkv_width, qkv_width,
                             qkv_width, (void *)k_caches[l], (void *)v_caches[l], kv_half,
                             cache_head_stride, block_tables, max_blocks, seq_lens, query_start,
                             block_size, num_seqs, num_heads, num_kv_heads, head_dim, scale, attn,
                             scores, scores_stride, threads, windows[l], 0.0f);
        fused_linear(o_proj, attn, 0, rows, q_size, x, hidden, act, max_k, threads);
        rms_norm_f32(x, residual, post_norm, h, residual, rows, hidden, hidden, eps, threads);
        fused_linear(gate_up_proj, h, 0, rows, hidden, gate_up, 2 * intermediate, act, max_k,
                     threads);
        silu_and_mul_f32(gate_up, mlp, rows, intermediate, threads);
        fused_linear(down_proj, mlp, 0, rows, intermediate, x, hidden, act, max_k, threads);
    }
}
