/* fp32 linears for steps of few rows: y = x . w^T with w [n, k] row-major, as nn.Linear keeps it.
 *
 * A step of a few rows (decodes, a sequence verifying its drafts) streams every weight from
 * memory once and does little arithmetic with it. torch's fp32 GEMM on AVX2 packs the weight
 * and blocks for large products: at 2-8 rows it reads the weights at a fraction of the rate one
 * row does. Here tiles of 3 weight rows by 4 input rows keep 12 sums in registers (AVX2 FMA):
 * the weight tile is read from memory once per step and from L1 for the other input rows.
 *
 * Every output is one dot product whose summation order depends only on k (8 lanes, in order,
 * then the lanes summed in a fixed tree), never on the number of rows or the tile it falls in:
 * a row's result is the same alone or in any batch. Without AVX2 a scalar loop keeps that too.
 */
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>

static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[b, a] = x[b] . w[a] for NW weight rows and NX input rows; k a multiple of 8 here. */
#define F32_TILE(NW, NX)                                                                         \
    static inline __attribute__((always_inline)) void f32_tile_##NW##_##NX(                      \
        const float *x, int64_t xs, const float *w, int64_t k, float *y, int64_t ys) {           \
        __m256 acc[NW][NX];                                                                      \
        for (int a = 0; a < NW; a++)                                                             \
            for (int b = 0; b < NX; b++) acc[a][b] = _mm256_setzero_ps();                        \
        for (int64_t i = 0; i < k; i += 8) {                                                     \
            __m256 wv[NW];                                                                       \
            for (int a = 0; a < NW; a++) wv[a] = _mm256_loadu_ps(w + a * k + i);                 \
            for (int b = 0; b < NX; b++) {                                                       \
                __m256 xv = _mm256_loadu_ps(x + b * xs + i);                                     \
                for (int a = 0; a < NW; a++) acc[a][b] = _mm256_fmadd_ps(wv[a], xv, acc[a][b]); \
            }                                                                                    \
        }                                                                                        \
        for (int a = 0; a < NW; a++)                                                             \
            for (int b = 0; b < NX; b++) y[b * ys + a] = lanes_sum(acc[a][b]);                   \
    }
F32_TILE(3, 4)
F32_TILE(3, 1)
F32_TILE(1, 4)
F32_TILE(1, 1)

static void f32_rows(const float *x, int64_t rows, int64_t xs, const float *w, int64_t j,
                     int64_t nw, int64_t k, float *y, int64_t ys) {
    int64_t m = 0;
    for (; m + 4 <= rows; m += 4) {
        if (nw == 3) f32_tile_3_4(x + m * xs, xs, w + j * k, k, y + m * ys + j, ys);
        else for (int64_t a = j; a < j + nw; a++) f32_tile_1_4(x + m * xs, xs, w + a * k, k, y + m * ys + a, ys);
    }
    for (; m < rows; m++) {
        if (nw == 3) f32_tile_3_1(x + m * xs, xs, w + j * k, k, y + m * ys + j, ys);
        else for (int64_t a = j; a < j + nw; a++) f32_tile_1_1(x + m * xs, xs, w + a * k, k, y + m * ys + a, ys);
    }
}
#else
static void f32_rows(const float *x, int64_t rows, int64_t xs, const float *w, int64_t j,
                     int64_t nw, int64_t k, float *y, int64_t ys) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t a = j; a < j + nw; a++) {
            float s = 0.0f;
            for (int64_t i = 0; i < k; i++) s += x[m * xs + i] * w[a * k + i];
            y[m * ys + a] = s;
        }
}
#endif

/* k a multiple of 8; x rows `x_stride` floats apart, y rows `y_stride`. */
void linear_f32(const float *x, int64_t rows, int64_t x_stride, const float *w, int64_t n, int64_t k,
                float *y, int64_t y_stride, int threads) {
    int64_t tiles = (n + 2) / 3;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t j = t * 3;
        f32_rows(x, rows, x_stride, w, j, n - j < 3 ? n - j : 3, k, y, y_stride);
    }
}
