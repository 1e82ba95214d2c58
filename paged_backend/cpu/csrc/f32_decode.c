/* The elementwise ops and decode attention of an fp32 model in C: RMSNorm, rotary, SiLU/GeGLU-and-
 * mul, decode attention over the paged cache (`decode_layers` runs a step's layers on them).
 *
 * On CPUs without bf16 arithmetic (AVX2) models run in fp32, and at one row torch spends more of
 * a step on dispatch (~270 ops, 10-20 us each) and on gathering each layer's K/V blocks than on
 * reading the weights. These loops are plain C that the compiler vectorises for the target CPU;
 * they follow torch's fp32 formulas (sums in another order: outputs agree to rounding).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* out = h * rsqrt(mean(h^2) + eps) * (offset + weight) per row (`offset` 1 for Gemma's weights,
 * stored as offsets from 1), h = x, or with `residual`: h = x + residual, also written to
 * `new_residual` (which may be `residual`). `out` may be x. */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out,
                  float *new_residual, int64_t rows, int64_t dim, int64_t x_stride, float eps,
                  float offset, int threads) {
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
        for (int64_t i = 0; i < dim; i++) out[r * dim + i] = h[i] * inv * (offset + weight[i]);
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

/* out = act(gate) * up for rows [gate | up] of 2 * dim, act(g) = g * sigmoid(z) with z = g (SiLU)
 * or, with `gelu`, `gelu_arg(g)` (GeGLU); sigmoid from exp(-|z|), which never overflows. */
void act_and_mul_f32(const float *x, float *out, int64_t rows, int64_t dim, int gelu, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * dim, *up = gate + dim;
        int64_t i = 0;
#ifdef __AVX2__
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; i + 8 <= dim; i += 8) { /* the scalar loop's operations, 8 lanes at a time */
            __m256 g = _mm256_loadu_ps(gate + i), z = g;
            if (gelu)
                z = _mm256_mul_ps(_mm256_set1_ps(GELU_SCALE),
                                  _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_CUBIC), g), g), g, g));
            __m256 e = exp_clamped8(_mm256_or_ps(z, sign));
            __m256 sum = _mm256_add_ps(one, e), nonneg = _mm256_cmp_ps(z, sign, _CMP_GE_OQ);
            __m256 sigmoid = _mm256_blendv_ps(_mm256_div_ps(e, sum), _mm256_div_ps(one, sum), nonneg);
            _mm256_storeu_ps(out + r * dim + i,
                             _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < dim; i++) {
            float g = gate[i], z = gelu ? gelu_arg(g) : g, e = exp_nonpositive(-fabsf(z));
            float sigmoid = z >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
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
/* A unit's keys converted to fp32 lie in one "block" of this many rows (a power of two, so
 * `slot_of` shifts), from slot 0 of `FLAT_TABLE`. */
#define FLAT_BLOCK ((int64_t)1 << 40)
static const int32_t FLAT_TABLE = 0;
#define VALUE_HEADS 3 /* query heads sharing each value row read */
#define PREFETCH_KEYS 16 /* how far ahead of the scores their key rows are asked for */

/* Row `row` of `dim` values of a cache of fp32 or fp16 rows. */
static inline const void *cache_row(const void *cache, int half, int64_t row, int64_t dim) {
    return (const char *)cache + row * dim * (half ? 2 : 4);
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Ask for the key rows of positions [from, to) into L1 and their value rows into L2, where the
 * value pass reads them after the scores. A block's rows lie together but blocks do not, and
 * the hardware's prefetchers stop at a block's end (4 keys on CPU): without this, decode
 * attention waited on its loads (a batch-32 step of the default model: ~3x its read time). */
static void prefetch_rows(const void *kc, const void *vc, int half, const int32_t *table,
                          int64_t from, int64_t to, int64_t block_size, int64_t dim) {
#ifdef __AVX2__
    int64_t row_bytes = dim * (half ? 2 : 4);
    for (int64_t key = from; key < to;) {
        int64_t slot = slot_of(table, key, block_size), count = block_size - key % block_size;
        count = count < to - key ? count : to - key;
        const char *k = cache_row(kc, half, slot, dim), *v = cache_row(vc, half, slot, dim);
        for (int64_t b = 0; b < count * row_bytes; b += 64) {
            _mm_prefetch(k + b, _MM_HINT_T0);
            _mm_prefetch(v + b, _MM_HINT_T1);
        }
        key += count;
    }
#else
    (void)kc, (void)vc, (void)half, (void)table, (void)from, (void)to, (void)block_size, (void)dim;
#endif
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

/* out[j] = cache row of position first + j (through the block table) as fp32, for n positions
 * of an fp16 key or value cache: exact, so the tiles read the bits they would convert
 * themselves. */
static void rows_to_f32(const uint16_t *cache, const int32_t *table, int64_t first, int64_t n,
                        int64_t block_size, int64_t dim, float *out) {
    for (int64_t j = 0; j < n; j++) {
        const uint16_t *row = cache + slot_of(table, first + j, block_size) * dim;
        int64_t d = 0;
#ifdef __AVX2__
        for (; d < dim; d += 8) _mm256_storeu_ps(out + j * dim + d, load_f16(row + d));
#endif
        for (; d < dim; d++) out[j * dim + d] = f16_to_f32(row + d);
    }
}

/* The first key position the query at `pos` sees: the last `window` (where > 0), else all. */
static inline int64_t window_first(int64_t pos, int64_t window) {
    return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

/* The rows of a step (decodes, drafts being verified, chunks of prompts): sequence s has the rows
 * query_start[s] .. query_start[s + 1] - 1, its last tokens, at positions up to seq_lens[s] - 1.
 * Write each row's new k/v (rows `k_stride`/`v_stride` apart, heads side by side) at its
 * position, then attend its q (heads side by side, rows `q_stride` apart) causally over the
 * sequence's tokens up to its own (the last `window` of them, where > 0) through `block_tables`,
 * into `out` [rows][heads][dim]. The caches (rows addressed as at `slot_of`) hold fp32 rows
 * or, with `kv_half`, fp16 rows (the new k/v rounded to nearest even as they are written).
 *
 * The work splits over threads by (sequence, kv head, chunk of the sequence's rows): the chunk's
 * query heads of the kv head meet its keys a block at a time (`key_scores`, tiles of 4 keys by
 * up to 3 query vectors), then each row's softmax over its own keys (`softmax_row`), then P.V
 * with each value row read once for up to 3 heads (`weighted_values`). Scores go in `scores` (a
 * row of `scores_stride` >= group * the longest context for each thread; chunks have at most
 * as many rows as it holds). Each row's bits are those of the row attended alone, whatever the
 * step (its batch, its chunk of a prompt, the cached context before it).
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
     * again). A step of few sequences splits their rows so that each thread has two units, and
     * a chunk has no more rows than a thread's scores hold over the longest context (a prompt's
     * chunk splits into many). A row's bits do not depend on its chunk. */
    int64_t chunk_seq[total_rows], chunk_row[total_rows], chunk_rows[total_rows], chunks = 0;
    int64_t pieces = (2 * threads + num_seqs * num_kv_heads - 1) / (num_seqs * num_kv_heads);
    int64_t longest = 1, most_rows;
    for (int64_t s = 0; s < num_seqs; s++) longest = seq_lens[s] > longest ? seq_lens[s] : longest;
    most_rows = scores_stride / (group * longest);
    most_rows = most_rows > 1 ? most_rows : 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t a = query_start[s], r = query_start[s + 1] - a, c = r < pieces ? r : pieces;
        if (c < (r + most_rows - 1) / most_rows) c = (r + most_rows - 1) / most_rows;
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
        int half = kv_half;
        int64_t key0 = first, bs = block_size; /* where key `first` is, through `table` */
        /* A chunk of several rows over fp16 K/V reads its keys and values converted once (the
         * tiles would convert each again for every 3 query vectors, on the FMA ports). */
        float *kv32 = half && rows > 1 ? malloc(2 * n * dim * sizeof(float)) : NULL;
        if (kv32) {
            rows_to_f32(kc, table, first, n, block_size, dim, kv32);
            rows_to_f32(vc, table, first, n, block_size, dim, kv32 + n * dim);
            kc = kv32, vc = kv32 + n * dim, half = 0;
            table = &FLAT_TABLE, key0 = 0, bs = FLAT_BLOCK;
        }
        const float *qs[nq];
        for (int64_t i = 0; i < nq; i++)
            qs[i] = q + (t0 + i / group) * q_stride + (head + i % group) * dim;
        float *sc = scores + omp_get_thread_num() * scores_stride; /* [nq][n] */
        prefetch_rows(kc, vc, half, table, key0, key0 + min64(n, PREFETCH_KEYS), bs, dim);
        for (int64_t j = 0; j < n;) { /* the keys of one block at a time */
            int64_t slot = slot_of(table, key0 + j, bs);
            int64_t count = bs - (key0 + j) % bs;
            count = count < n - j ? count : n - j;
            int64_t ahead = j + PREFETCH_KEYS; /* the keys as many ahead as this block's */
            prefetch_rows(kc, vc, half, table, key0 + min64(n, ahead), key0 + min64(n, ahead + count),
                          bs, dim);
            key_scores(qs, nq, cache_row(kc, half, slot, dim), half, count, dim, sc + j, n);
            j += count;
        }
        for (int64_t r = 0; r < rows; r++) { /* each row over its own keys */
            int64_t pos = pos0 + r, from = window_first(pos, window);
            float *p = sc + r * group * n + (from - first);
            for (int64_t m = 0; m < group; m++) softmax_row(p + m * n, pos + 1 - from, scale, softcap);
            for (int64_t m = 0; m < group; m += VALUE_HEADS)
                weighted_values(p + m * n, n, group - m < VALUE_HEADS ? group - m : VALUE_HEADS, vc,
                                half, table, key0 + from - first, pos + 1 - from, bs, dim,
                                out + ((t0 + r) * num_heads + head + m) * dim);
        }
        free(kv32);
    }
}
