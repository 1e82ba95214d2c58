/* fp32 linears: y = x . w^T with w [n, k] row-major, as nn.Linear keeps it.
 *
 * A step of a few rows (decodes, a sequence verifying its drafts) streams every weight from
 * memory once and does little arithmetic with it. torch's fp32 GEMM on AVX2 packs the weight
 * and blocks for large products: at 2-8 rows it reads the weights at a fraction of the rate one
 * row does. Here a tile of NW weight rows by NX input rows keeps its NW x NX sums in registers
 * (AVX2 FMA), and the tile's shape follows the step's row count (`tile_shape`), so that every
 * step of up to 6 rows takes all its rows in one pass over the weights, with at least as many
 * multiply-adds as loads: a verifying step of 5 rows costs little more than a decode of one.
 * The weight tile is read from memory once a step and from L1 for further groups of rows.
 * A prefill's rows go in blocks whose activations a core's L2 holds (`X_BLOCK_BYTES`: 113 rows
 * at 576 inputs as 57 + 56), each block through every weight tile: one pass over all rows per tile
 * streamed them from L3 (960 x 576 at 512 rows on a 2-core AVX2 EPYC: 10.8 -> 8.3 ms, torch's
 * 9.0-9.5), so that where torch's GEMM is not clearly faster there, this kernel serves every
 * step (`kernel_choice`) and a row's bits never depend on its step.
 *
 * Every output is one dot product whose summation order depends only on k (8 lanes, in order,
 * then the lanes summed in a fixed tree), never on the number of rows or the tile it falls in:
 * a row's result is the same alone or in any batch. Without AVX2 a scalar loop keeps that too.
 *
 * `linear_f16w` is the same on fp16 weights (a GPTQ / AWQ checkpoint's head, a GGUF file's F16
 * tensors): each converts exactly to fp32 as it is loaded, so the outputs are `linear_f32`'s bits
 * on the converted weight, for half its bytes. `linear_blocks_f32` is the same on GGUF blocks of
 * 32 (Q4_0, Q4_1, Q8_0): a model served in fp32 from such a file (the embedded default model)
 * holds its weights dequantized, but each block decodes in registers to exactly those values
 * (d * level + offset: the product is exact in fp32, so one rounding, as `dequantize_rows`), so
 * the outputs are `linear_f32`'s bits on the dequantized weight, for 0.56-1.06 bytes a weight
 * instead of 4. The weights' kind is their ggml type id throughout: 0 fp32, 1 fp16, else a block
 * type.
 */
#include <stdint.h>

#include "common.h"

/* Weight rows a tile for a step of `rows` input rows, and the most input rows a group. 16 AVX2
 * registers hold the NW x NX sums and the operand there are fewer of (`F32_TILE`); from 7 rows
 * the rows go in groups of 3-4 against 3 weight rows. */
static void tile_shape(int64_t rows, int *nw, int *nx) {
    static const int weight_rows[5] = {0, 4, 6, 4, 3};
    *nw = rows <= 4 ? weight_rows[rows] : rows <= 6 ? 2 : 3;
    *nx = rows <= 4 ? (int)rows : rows <= 6 ? 6 : 4;
}

/* The bytes of a weight row of k weights of `type` (0 fp32, 1 fp16, Q4_0, Q4_1, Q8_0). */
static int64_t weight_row_bytes(int type, int64_t k) {
    if (type == 0 || type == 1) return (type ? 2 : 4) * k;
    return k / 32 * block_bytes(type);
}

#ifdef __AVX2__
#include <immintrin.h>
/* From two input rows a tile computes long enough a cache line that the hardware prefetcher
 * falls behind (5 rows: ~1.6x a row's step); asking for the weights 16 KB ahead brings a 5-row
 * step to ~1.2x (2-core Zen 3). At one row it costs a little: the prefetcher keeps up there. */
#define PREFETCH_FLOATS 4096
#define PREFETCH_MIN_ROWS 2

static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[b, a] = x[b] . w[a] for NW weight rows and NX input rows; k a multiple of 8 here. KIND: the
 * weights' type, f32 or f16 (`load_f32`, `load_f16`). */
#define TILE(KIND, WT, NW, NX)                                                                     \
    static void KIND##_tile_##NW##_##NX(const float *x, int64_t xs, const void *wv, int64_t k,     \
                                        float *y, int64_t ys) {                                    \
        const WT *w = wv;                                                                          \
        __m256 acc[NW][NX];                                                                        \
        for (int a = 0; a < NW; a++)                                                               \
            for (int b = 0; b < NX; b++) acc[a][b] = _mm256_setzero_ps();                          \
        for (int64_t i = 0; i < k; i += 8) {                                                       \
            if (NX >= PREFETCH_MIN_ROWS && i % 16 == 0)                                            \
                for (int a = 0; a < NW; a++)                                                       \
                    _mm_prefetch((const char *)(w + a * k + i + PREFETCH_FLOATS), _MM_HINT_T0);    \
            if (NX < NW) {                                                                         \
                __m256 xv[NX];                                                                     \
                for (int b = 0; b < NX; b++) xv[b] = _mm256_loadu_ps(x + b * xs + i);              \
                for (int a = 0; a < NW; a++) {                                                     \
                    __m256 wv = load_##KIND(w + a * k + i);                                       \
                    for (int b = 0; b < NX; b++)                                           \
                        acc[a][b] = _mm256_fmadd_ps(wv, xv[b], acc[a][b]);                         \
                }                                                                                  \
            } else {                                                                               \
                __m256 wv[NW];                                                                     \
                for (int a = 0; a < NW; a++) wv[a] = load_##KIND(w + a * k + i);                  \
                for (int b = 0; b < NX; b++) {                                                     \
                    __m256 xv = _mm256_loadu_ps(x + b * xs + i);                                   \
                    for (int a = 0; a < NW; a++)                                           \
                        acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]);                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int a = 0; a < NW; a++)                                                               \
            for (int b = 0; b < NX; b++) y[b * ys + a] = lanes_sum(acc[a][b]);                     \
    }
/* The 32 weights of a block of `type` (Q4_0, Q4_1, Q8_0), as `dequantize_rows` gives them:
 * d * level + offset, one rounding (the product is exact: an fp16 scale times a level of at
 * most 8 bits), the offset -8d for Q4_0, the block's minimum for Q4_1, +0 for Q8_0. */
static inline __attribute__((always_inline)) void block_values(int type, const uint8_t *blk,
                                                               __m256 v[4]) {
    /* The scale (and Q4_1's minimum after it) from one load of their fp16 bits */
    uint32_t halves;
    memcpy(&halves, blk, 4);
    __m128 scales = _mm_cvtph_ps(_mm_cvtsi32_si128((int)halves));
    __m256 d = _mm256_broadcastss_ps(scales);
    if (type == Q8_0) {
        for (int s = 0; s < 4; s++) {
            __m128i q = _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * s));
            v[s] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)),
                                   _mm256_setzero_ps());
        }
        return;
    }
    __m256 offset = type == Q4_1 ? _mm256_broadcastss_ps(_mm_movehdup_ps(scales))
                                 : _mm256_mul_ps(_mm256_set1_ps(-8.0f), d);
    /* Bytes 0-7 and 8-15 widened to 32-bit lanes once each: a lane's low nibble is one level,
     * its byte shifted right by 4 the other (fewer shuffles than widening each nibble half). */
    const uint8_t *q = blk + (type == Q4_1 ? 4 : 2);
    __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    __m256i nibble = _mm256_set1_epi32(15);
    __m256i levels[4] = {_mm256_and_si256(first, nibble), _mm256_and_si256(second, nibble),
                         _mm256_srli_epi32(first, 4), _mm256_srli_epi32(second, 4)};
    for (int s = 0; s < 4; s++) v[s] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(levels[s]), offset);
}

/* TILE for weights in blocks of 32 of TYPE: each block decoded once a tile, its 4 vectors taken
 * in order, so that each sum runs in TILE's order. */
#define BLOCK_TILE(KIND, TYPE, NW, NX)                                                      \
    static void KIND##_tile_##NW##_##NX(const float *x, int64_t xs, const void *wv, int64_t k,     \
                                        float *y, int64_t ys) {                                    \
        const uint8_t *w = wv;                                                                     \
        int64_t bytes = block_bytes(TYPE), row_bytes = k / 32 * bytes;                             \
        __m256 acc[NW][NX];                                                                        \
        for (int a = 0; a < NW; a++)                                                               \
            for (int b = 0; b < NX; b++) acc[a][b] = _mm256_setzero_ps();                          \
        for (int64_t i = 0, at = 0; i < k; i += 32, at += bytes)                                   \
            for (int a = 0; a < NW; a++) {                                                         \
                __m256 v[4];                                                                       \
                block_values(TYPE, w + a * row_bytes + at, v);                                     \
                for (int s = 0; s < 4; s++)                                                        \
                    for (int b = 0; b < NX; b++)                                                   \
                        acc[a][b] = _mm256_fmadd_ps(v[s], _mm256_loadu_ps(x + b * xs + i + 8 * s), \
                                                    acc[a][b]);                                    \
            }                                                                                      \
        for (int a = 0; a < NW; a++)                                                               \
            for (int b = 0; b < NX; b++) y[b * ys + a] = lanes_sum(acc[a][b]);                     \
    }
#define F32_TILE(NW, NX)                                                                           \
    TILE(f32, float, NW, NX) TILE(f16, uint16_t, NW, NX) BLOCK_TILE(q4_0, Q4_0, NW, NX)            \
    BLOCK_TILE(q4_1, Q4_1, NW, NX) BLOCK_TILE(q8_0, Q8_0, NW, NX)
F32_TILE(4, 1)
F32_TILE(6, 2)
F32_TILE(4, 3)
F32_TILE(3, 4)
F32_TILE(3, 3)
F32_TILE(2, 4)
F32_TILE(2, 5)
F32_TILE(2, 6)
F32_TILE(1, 1)
F32_TILE(1, 2)
F32_TILE(1, 3)
F32_TILE(1, 4)
F32_TILE(1, 5)
F32_TILE(1, 6)

/* One tile of `nw` weight rows (a shape `tile_shape` gives, or 1) by `nx` input rows, of the
 * weights' kind `type`. */
#define KIND_CASES(NW, NX)                                                                         \
    switch (type) {                                                                                \
    case 0: f32_tile_##NW##_##NX(x, xs, w, k, y, ys); return;                                      \
    case 1: f16_tile_##NW##_##NX(x, xs, w, k, y, ys); return;                                      \
    case Q4_0: q4_0_tile_##NW##_##NX(x, xs, w, k, y, ys); return;                                  \
    case Q4_1: q4_1_tile_##NW##_##NX(x, xs, w, k, y, ys); return;                                  \
    default: q8_0_tile_##NW##_##NX(x, xs, w, k, y, ys); return;                                    \
    }
#define TILE_CASE(NW, NX)                                                                          \
    case NW * 8 + NX: KIND_CASES(NW, NX)
static void f32_tile(int nw, int nx, const float *x, int64_t xs, const void *w, int type,
                     int64_t k, float *y, int64_t ys) {
    switch (nw * 8 + nx) {
        TILE_CASE(4, 1)
        TILE_CASE(6, 2)
        TILE_CASE(4, 3)
        TILE_CASE(3, 4)
        TILE_CASE(3, 3)
        TILE_CASE(2, 4)
        TILE_CASE(2, 5)
        TILE_CASE(2, 6)
        TILE_CASE(1, 1)
        TILE_CASE(1, 2)
        TILE_CASE(1, 3)
        TILE_CASE(1, 4)
        TILE_CASE(1, 5)
    default: /* 1 x 6 */
        KIND_CASES(1, 6)
    }
}
#else
/* Weight i of row w (of `type`) as fp32: `block_values`' arithmetic for a block type. */
static float weight_at(const void *w, int type, int64_t i) {
    if (type == 0) return ((const float *)w)[i];
    if (type == 1) return f16_to_f32((const uint16_t *)w + i);
    const uint8_t *blk = (const uint8_t *)w + i / 32 * block_bytes(type);
    int j = (int)(i % 32);
    float d = f16_to_f32(blk);
    if (type == Q8_0) return fmaf(d, (float)((const int8_t *)blk)[2 + j], 0.0f);
    const uint8_t *q = blk + (type == Q4_1 ? 4 : 2);
    float level = (float)(j < 16 ? q[j] & 15 : q[j - 16] >> 4);
    return fmaf(d, level, type == Q4_1 ? f16_to_f32(blk + 2) : -8.0f * d);
}

static void f32_tile(int nw, int nx, const float *x, int64_t xs, const void *w, int type,
                     int64_t k, float *y, int64_t ys) {
    for (int b = 0; b < nx; b++)
        for (int a = 0; a < nw; a++) {
            const void *row = (const char *)w + a * weight_row_bytes(type, k);
            float s = 0.0f;
            for (int64_t i = 0; i < k; i++) s += x[b * xs + i] * weight_at(row, type, i);
            y[b * ys + a] = s;
        }
}
#endif

/* Weight row `row` of w, rows k weights of `type` long. */
static const void *weight_row(const void *w, int type, int64_t row, int64_t k) {
    return (const char *)w + row * weight_row_bytes(type, k);
}

/* Weight rows j..j+nw (nw below the tile's height: one at a time) against every input row, in
 * groups of at most `nx` rows sized evenly (7 rows: 4 and 3, not 6 and 1). */
static void f32_rows(const float *x, int64_t rows, int64_t xs, const void *w, int type, int64_t j,
                     int nw, int tile_rows, int nx, int64_t k, float *y, int64_t ys) {
    int64_t groups = (rows + nx - 1) / nx;
    for (int64_t g = 0, m = 0; g < groups; g++) {
        int size = (int)((rows - m) / (groups - g) + ((rows - m) % (groups - g) != 0));
        if (nw == tile_rows)
            f32_tile(nw, size, x + m * xs, xs, weight_row(w, type, j, k), type, k, y + m * ys + j,
                     ys);
        else
            for (int64_t a = j; a < j + nw; a++)
                f32_tile(1, size, x + m * xs, xs, weight_row(w, type, a, k), type, k,
                         y + m * ys + a, ys);
        m += size;
    }
}

#define X_BLOCK_BYTES (256 << 10)

/* The rows in blocks of about even size whose activations take at most X_BLOCK_BYTES (at least
 * 8 rows), each block through every weight tile in a tile shape of its own size. */
static void linear_rows(const float *x, int64_t rows, int64_t x_stride, const void *w, int type,
                        int64_t n, int64_t k, float *y, int64_t y_stride, int threads) {
    if (rows <= 0) return; /* a step's empty part (no rows of its kind) */
    int64_t most = X_BLOCK_BYTES / (4 * k) / 4 * 4;
    if (most < 8) most = 8;
    int64_t blocks = (rows + most - 1) / most;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        int64_t mb = (rows - m0) / (blocks - b) + ((rows - m0) % (blocks - b) != 0);
        int nw, nx;
        tile_shape(mb, &nw, &nx);
        int64_t tiles = (n + nw - 1) / nw;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t j = t * nw;
            f32_rows(x + m0 * x_stride, mb, x_stride, w, type, j, n - j < nw ? (int)(n - j) : nw,
                     nw, nx, k, y + m0 * y_stride, y_stride);
        }
        m0 += mb;
    }
}

/* k a multiple of 8; x rows `x_stride` floats apart, y rows `y_stride`. */
void linear_f32(const float *x, int64_t rows, int64_t x_stride, const float *w, int64_t n, int64_t k,
                float *y, int64_t y_stride, int threads) {
    linear_rows(x, rows, x_stride, w, 0, n, k, y, y_stride, threads);
}

/* `linear_f32` with fp16 weights w [n, k]. */
void linear_f16w(const float *x, int64_t rows, int64_t x_stride, const uint16_t *w, int64_t n,
                 int64_t k, float *y, int64_t y_stride, int threads) {
    linear_rows(x, rows, x_stride, w, 1, n, k, y, y_stride, threads);
}

/* `linear_f32` with weights w [n, k] in GGUF blocks of 32 of `type` (Q4_0, Q4_1, Q8_0; rows
 * contiguous), k a multiple of 32: the bits of `linear_f32` on their `dequantize_rows` values. */
void linear_blocks_f32(const float *x, int64_t rows, int64_t x_stride, int type, const uint8_t *w,
                       int64_t n, int64_t k, float *y, int64_t y_stride, int threads) {
    linear_rows(x, rows, x_stride, w, type, n, k, y, y_stride, threads);
}
