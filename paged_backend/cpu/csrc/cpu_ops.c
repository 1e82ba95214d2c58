/* CPU ops for bf16 models (see `paged_backend.cpu_ops`), built at first use with the system C
 * compiler: fused elementwise ops (one call where torch runs 3-9 ops, rounding to bf16 where those
 * ops do), decode attention over the paged cache, and, on CPUs with AVX512-BF16, products of a
 * few rows with a weight and attention over packed keys. The kernels split their work over
 * `threads` OpenMP threads: built with -fopenmp, they share torch's OpenMP runtime (libgomp.so.1,
 * already loaded by torch), so they run on the threads that torch's own ops have just left
 * spinning.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "common.h"

/* The keys a decode thread reads next (its next sequence and kv head): `n` K and V rows from
 * key `first` through `table`, in the caches `k` and `v`. They are fetched while the current
 * pair's P.V computes, so that reading memory and arithmetic overlap (the V rows too: on 4 KiB
 * pages nearly every block read misses the TLB, and 16 layers of a 1B batch of 32 sequences over
 * 135-270 tokens, their blocks scattered over the cache, ran in 35-38 ms on an AMX Xeon VM with
 * them against 45-49 without). */
typedef struct {
    const bf16 *k, *v;
    const int32_t *table;
    int64_t first, n;
} next_keys;

/* out = bf16(h * rsqrt(mean(h^2) + eps) * (offset + weight)) per row (one rounding, as
 * F.rms_norm; `offset` 1 for Gemma's weights, stored as offsets from 1), h = x, or with
 * `residual`: h = bf16(x + residual), also written to `new_residual`. `out` may be x. */
void rms_norm_bf16(const bf16 *x, const bf16 *residual, const bf16 *weight, bf16 *out,
                   bf16 *new_residual, int64_t rows, int64_t dim, int64_t x_stride, float eps,
                   float offset, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float h[dim];
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
        int64_t full = dim / 16 * 16; /* whole vectors first: a loop without branches vectorises */
        for (int64_t i = 0; i < full; i += 16)
            for (int k = 0; k < 16; k++) acc[k] += h[i + k] * h[i + k];
        for (int64_t i = full; i < dim; i++) acc[i - full] += h[i] * h[i];
        float sum = 0.0f;
        for (int k = 0; k < 16; k++) sum += acc[k];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++)
            out[r * dim + i] = to_bf16(h[i] * inv * (offset + to_f32(weight[i])));
    }
}

/* Rotate-half rotary embedding, in place on the first `rot_dim` dims of `heads` heads of `dim`
 * per token row (all of them but for a partial rotary), the rest left as they are:
 * x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin [tokens, rot_dim] in bf16. */
void rotary_bf16(bf16 *x, const bf16 *cos, const bf16 *sin, int64_t tokens, int64_t heads,
                 int64_t dim, int64_t rot_dim, int64_t x_stride, int threads) {
    int64_t half = rot_dim / 2;
#pragma omp parallel for num_threads(threads) if (tokens * heads * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++) {
        const bf16 *c = cos + t * rot_dim, *s = sin + t * rot_dim;
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

/* The index of each row's largest value, as torch.argmax: the first among equal values, the first
 * NaN where a row has one. `rows` rows of `n` floats, `stride` apart. Per 16-lane vector: torch's
 * CPU argmax runs a scalar loop on one thread (~1.5 ms for 32 rows of a 49k vocabulary). */
void argmax_rows_f32(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out,
                     int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        int64_t best = 0, i = 0;
        float top = row[0];
        int nan = 0;
#ifdef __AVX512F__
        if (n >= 16) { /* each lane keeps its first largest value, then the lanes merge */
            __m512 vtop = _mm512_loadu_ps(row);
            __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __m512i vbest = at;
            __mmask16 unordered = _mm512_cmp_ps_mask(vtop, vtop, _CMP_UNORD_Q);
            for (i = 16; i + 16 <= n; i += 16) {
                __m512 v = _mm512_loadu_ps(row + i);
                at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
                __mmask16 greater = _mm512_cmp_ps_mask(v, vtop, _CMP_GT_OQ);
                unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                vtop = _mm512_mask_mov_ps(vtop, greater, v);
                vbest = _mm512_mask_mov_epi32(vbest, greater, at);
            }
            float tops[16];
            int32_t bests[16];
            _mm512_storeu_ps(tops, vtop);
            _mm512_storeu_si512(bests, vbest);
            top = tops[0], best = bests[0];
            for (int j = 1; j < 16; j++)
                if (tops[j] > top || (tops[j] == top && bests[j] < best)) top = tops[j], best = bests[j];
            nan = unordered != 0;
        }
#endif
        for (; i < n; i++) {
            nan |= row[i] != row[i];
            if (row[i] > top) top = row[i], best = i;
        }
        if (nan)
            for (best = 0; row[best] == row[best]; best++) {}
        out[r] = best;
    }
}

/* Write `tokens` tokens' keys and values (each token's `kv_heads` heads of `dim` elements of
 * `elem_bytes` side by side, rows `k_stride`/`v_stride` elements apart) into the caches at `slots`
 * (addressed as at `slot_of`, heads `cache_head_stride` elements apart): a prefill chunk's
 * k/v in one pass, bf16 or fp32. A slot < 0 is padding: nothing is written for it. */
void store_kv(const char *k, const char *v, int64_t k_stride, int64_t v_stride,
              const int64_t *slots, int64_t tokens, int64_t kv_heads, int64_t dim,
              int64_t elem_bytes, char *k_cache, char *v_cache, int64_t cache_head_stride,
              int threads) {
    int64_t row = dim * elem_bytes;
#pragma omp parallel for num_threads(threads) if (tokens * kv_heads * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < kv_heads && slots[t] >= 0; h++) {
            int64_t at = (h * cache_head_stride + slots[t] * dim) * elem_bytes;
            memcpy(k_cache + at, k + (t * k_stride) * elem_bytes + h * row, row);
            memcpy(v_cache + at, v + (t * v_stride) * elem_bytes + h * row, row);
        }
}

/* out = bf16(bf16(act(gate)) * up) for rows [gate | up] of 2 * dim (as F.silu or F.gelu, then *),
 * act(g) = g * sigmoid(z) with z = g (SiLU) or, with `gelu`, `gelu_arg(g)` (GeGLU); 16 lanes at
 * a time where AVX-512 is there (the same arithmetic in the same order: the same bits). */
void act_and_mul_bf16(const bf16 *x, bf16 *out, int64_t rows, int64_t dim, int gelu, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        const bf16 *gate = x + r * 2 * dim, *up = gate + dim;
        int64_t i = 0;
#ifdef __AVX512BF16__
        for (; i + 16 <= dim; i += 16) {
            __m512 y = act_and_mul16(load_bf16x16(gate + i), load_bf16x16(up + i), gelu);
            _mm256_storeu_si256((__m256i *)(out + r * dim + i), _mm512_cvtepi32_epi16(bf16_bits16(y)));
        }
#endif
        for (; i < dim; i++) {
            float g = to_f32(gate[i]), z = gelu ? gelu_arg(g) : g, e = exp_nonpositive(-fabsf(z));
            float sigmoid = (z >= 0.0f ? 1.0f : e) / (1.0f + e);
            out[r * dim + i] = to_bf16(round_bf16(g * sigmoid) * to_f32(up[i]));
        }
    }
}

/* The butterflies of v[block], half-widths 1, 2, 4, ... in turn, in place: a + b and a - b of
 * each pair. */
static inline void butterflies(float *v, int64_t block) {
    for (int64_t h = 1; h < block; h *= 2)
        for (int64_t i = 0; i < block; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
}

#ifdef __AVX512BF16__
/* The butterflies of half-widths 1, 2, 4 and 8 within 16 lanes: each stage adds the lanes'
 * partners (swapped in) to the lanes times +1 (first of a pair) or -1 (second), which rounds
 * as a + b and a - b do: the scalar stages' bits. */
static inline __m512 butterflies16(__m512 v) {
    const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
    const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
    const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
    const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
    v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));
    v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));
    v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));
    return _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));
}
#endif

/* Each row's n values (rows contiguous), `block` at a time (a power of two up to
 * HADAMARD_MAX_BLOCK dividing n), times the Hadamard matrix of that size over sqrt(block): an
 * orthogonal map (its own inverse) that spreads a few large values over the block, in place;
 * value k of each row first times scale[k] where `scale` is not NULL. Butterflies in fp32,
 * half-widths 1, 2, 4, ... in turn, each value rounded once to the rows' dtype at the end (bf16
 * with `x_bf16`, else fp32), the same bits with AVX-512 (16 lanes at a time) as without:
 * `paged_backend.models.rotation` runs it on weights and activations. */
#define HADAMARD_MAX_BLOCK 4096
void hadamard_rows(void *x, int x_bf16, int64_t rows, int64_t n, int64_t block, const float *scale,
                   int threads) {
    float norm = 1.0f / sqrtf((float)block);
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float v[HADAMARD_MAX_BLOCK];
        for (int64_t k = 0; k < n; k += block) {
            float *xf = (float *)x + r * n + k;
            bf16 *xb = (bf16 *)x + r * n + k;
            const float *sk = scale ? scale + k : NULL;
            int64_t i = 0;
#ifdef __AVX512BF16__
            if (block >= 16) {
                for (; i < block; i += 16) {
                    __m512 y = x_bf16 ? load_bf16x16(xb + i) : _mm512_loadu_ps(xf + i);
                    if (sk) y = _mm512_mul_ps(y, _mm512_loadu_ps(sk + i));
                    _mm512_storeu_ps(v + i, butterflies16(y));
                }
                for (int64_t h = 16; h < block; h *= 2)
                    for (int64_t a = 0; a < block; a += 2 * h)
                        for (int64_t j = a; j < a + h; j += 16) {
                            __m512 p = _mm512_loadu_ps(v + j), q = _mm512_loadu_ps(v + j + h);
                            _mm512_storeu_ps(v + j, _mm512_add_ps(p, q));
                            _mm512_storeu_ps(v + j + h, _mm512_sub_ps(p, q));
                        }
                for (i = 0; i < block; i += 16) {
                    __m512 y = _mm512_mul_ps(_mm512_loadu_ps(v + i), _mm512_set1_ps(norm));
                    if (x_bf16)
                        _mm256_storeu_si256((__m256i *)(xb + i), _mm512_cvtepi32_epi16(bf16_bits16(y)));
                    else
                        _mm512_storeu_ps(xf + i, y);
                }
                continue;
            }
#endif
            for (i = 0; i < block; i++) {
                v[i] = x_bf16 ? to_f32(xb[i]) : xf[i];
                if (sk) v[i] *= sk[i];
            }
            butterflies(v, block);
            for (i = 0; i < block; i++) {
                if (x_bf16)
                    xb[i] = to_bf16(v[i] * norm);
                else
                    xf[i] = v[i] * norm;
            }
        }
    }
}

/* `hadamard_rows` down the columns of x [rows][n]: each column's values, `block` rows at a time
 * (block <= HADAMARD_COLUMN_BLOCK, dividing rows), row r first times scale[r] where `scale` is
 * not NULL; the same arithmetic, so the same bits as rows of the transpose. 16 columns at a
 * time (a tile of block x 16 in fp32), whose loops the compiler runs as vectors. */
#define HADAMARD_COLUMN_BLOCK 256
void hadamard_columns(void *x, int x_bf16, int64_t rows, int64_t n, int64_t block,
                      const float *scale, int threads) {
    float norm = 1.0f / sqrtf((float)block);
    int64_t tiles = (n + 15) / 16, row_blocks = rows / block;
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < row_blocks * tiles; t++) {
        float v[HADAMARD_COLUMN_BLOCK][16];
        int64_t first = t / tiles * block, c0 = t % tiles * 16, width = n - c0 < 16 ? n - c0 : 16;
        for (int64_t k = 0; k < block; k++)
            for (int64_t c = 0; c < 16; c++) {
                int64_t at = (first + k) * n + c0 + c;
                float value = c >= width ? 0.0f : x_bf16 ? to_f32(((bf16 *)x)[at]) : ((float *)x)[at];
                v[k][c] = scale ? value * scale[first + k] : value;
            }
        for (int64_t h = 1; h < block; h *= 2)
            for (int64_t a = 0; a < block; a += 2 * h)
                for (int64_t j = a; j < a + h; j++)
                    for (int64_t c = 0; c < 16; c++) {
                        float p = v[j][c], q = v[j + h][c];
                        v[j][c] = p + q;
                        v[j + h][c] = p - q;
                    }
        for (int64_t k = 0; k < block; k++)
            for (int64_t c = 0; c < width; c++) {
                int64_t at = (first + k) * n + c0 + c;
                if (x_bf16)
                    ((bf16 *)x)[at] = to_bf16(v[k][c] * norm);
                else
                    ((float *)x)[at] = v[k][c] * norm;
            }
    }
}

/* q . k over `dim` (a multiple of 16) bf16 values: exact products, fp32 sums. */
static inline float dot_bf16(const bf16 *q, const bf16 *k, int64_t dim) {
#ifdef __AVX512BF16__
    if (dim % 32 == 0) { /* 16 lanes of pair sums, then one tree reduction */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i),
                                   (__m512bh)_mm512_loadu_si512(k + i));
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float acc[16] = {0};
    for (int64_t i = 0; i < dim; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += to_f32(q[i + j]) * to_f32(k[i + j]);
    float sum = 0.0f;
    for (int j = 0; j < 16; j++) sum += acc[j];
    return sum;
}

#ifdef __AVX512BF16__
/* The sums of 16 vectors' lanes, as one vector (lane j: the sum of a[j]), in 15 adds. */
static inline __m512 hsum16(__m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                         _mm512_shuffle_f32x4(d[0], d[1], 0xdd));
}

/* acc[g][c .. c + 63] += sum over the n keys t of p[g][t] * v_t[c .. c + 63] for GN (1 to 6) query
 * heads. Each 32-bit lane of a V load holds dims 2i (low half) and 2i + 1 (high half), each a
 * bf16 whose fp32 value is those 16 bits shifted up: a shift and a mask make the even and odd
 * dims' vectors, which the accumulators keep apart until the end. */
static inline void pv_rows(const float *p, int64_t n, const bf16 *vc, const int32_t *table,
                           int64_t first, int64_t block_size, int64_t dim, int64_t c, float *acc,
                           const next_keys *next, const int GN) {
    int64_t ahead = next ? next->n : 0;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[6][4];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < 4; j++) a[g][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t++) {
        int64_t key = first + t;
        const bf16 *vr = vc + slot_of(table, key, block_size) * dim + c;
        __m512i lo = _mm512_loadu_si512(vr), hi = _mm512_loadu_si512(vr + 32);
        if (t < ahead) {
            int64_t at = slot_of(next->table, next->first + t, block_size) * dim;
            for (int64_t i = 0; i < dim; i += 32) {
                _mm_prefetch((const char *)(next->k + at + i), _MM_HINT_T1);
                _mm_prefetch((const char *)(next->v + at + i), _MM_HINT_T1);
            }
        }
        __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(lo, high)),
                       _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)),
                       _mm512_castsi512_ps(_mm512_and_si512(hi, high))};
        for (int g = 0; g < GN; g++) {
            __m512 w = _mm512_set1_ps(p[g * n + t]);
            for (int j = 0; j < 4; j++) a[g][j] = _mm512_fmadd_ps(w, v[j], a[g][j]);
        }
    }
    const __m512i first16 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i last16 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int g = 0; g < GN; g++)
        for (int h = 0; h < 2; h++) { /* even and odd dims back in order */
            float *o = acc + g * dim + c + 32 * h;
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(a[g][2 * h], first16, a[g][2 * h + 1]));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a[g][2 * h], last16, a[g][2 * h + 1]));
        }
}

/* acc[g][dim] = sum over the n keys t of p[g][t] * v_t (`p` = scores [group][n], V rows through
 * the block table from key `first`), 64 dims and up to 6 query heads at a time in registers. */
static void pv_avx512(const float *p, int64_t n, int64_t group, const bf16 *vc,
                      const int32_t *table, int64_t first, int64_t block_size, int64_t dim,
                      float *acc, const next_keys *next_pair) {
    for (int64_t c = 0; c < dim; c += 64)
        for (int64_t g0 = 0; g0 < group; g0 += 6) {
            const float *pg = p + g0 * n;
            float *ag = acc + g0 * dim;
            const next_keys *next = c == 0 && g0 == 0 ? next_pair : NULL;
            switch (group - g0 < 6 ? group - g0 : 6) {
            case 1: pv_rows(pg, n, vc, table, first, block_size, dim, c, ag, next, 1); break;
            case 2: pv_rows(pg, n, vc, table, first, block_size, dim, c, ag, next, 2); break;
            case 3: pv_rows(pg, n, vc, table, first, block_size, dim, c, ag, next, 3); break;
            case 4: pv_rows(pg, n, vc, table, first, block_size, dim, c, ag, next, 4); break;
            case 5: pv_rows(pg, n, vc, table, first, block_size, dim, c, ag, next, 5); break;
            default: pv_rows(pg, n, vc, table, first, block_size, dim, c, ag, next, 6); break;
            }
        }
}

/* q . k for 16 keys at once (`dim` a multiple of 32, bf16 products, fp32 sums). */
static inline __m512 dot16_bf16(const bf16 *q, const bf16 *const *k, int64_t dim) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 32) {
        __m512bh qv = (__m512bh)_mm512_loadu_si512(q + i);
        for (int j = 0; j < 16; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], qv, (__m512bh)_mm512_loadu_si512(k[j] + i));
    }
    return hsum16(acc);
}
#endif

/* The largest of x[0..n-1] as the loop m = x[t] > m ? x[t] : m from m = x[0] finds it (NaN only
 * where x[0] is NaN), 16 lanes at a time: that loop's chain of compares ran at one a cycle. */
static inline float max_scores(const float *x, int64_t n) {
    float m = x[0];
    int64_t t = 1;
#ifdef __AVX512F__
    if (n >= 17) {
        __m512 mv = _mm512_set1_ps(m);
        for (; t + 16 <= n; t += 16) {
            __m512 v = _mm512_loadu_ps(x + t);
            mv = _mm512_mask_mov_ps(mv, _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ), v);
        }
        float lanes[16];
        _mm512_storeu_ps(lanes, mv);
        for (int j = 0; j < 16; j++) m = lanes[j] > m ? lanes[j] : m;
    }
#endif
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

/* part[j] += the sum of x[t] over t = j mod 16, t < n, in the order of t: 16 lanes at a time. */
static inline void sum_lanes16(const float *x, int64_t n, float *part) {
    int64_t t = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_loadu_ps(part);
    for (; t + 16 <= n; t += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + t));
    _mm512_storeu_ps(part, acc);
#endif
    for (; t < n; t++) part[t & 15] += x[t];
}

/* The first key row t attends over in a decode step (`lens`: each row's tokens): 0, or past a
 * shared prefix (cascade), or its window's first. */
static inline int64_t first_key(int64_t t, const int32_t *lens, const int32_t *prefix_pos,
                                int64_t prefix_len, int64_t window) {
    int64_t first = prefix_pos && prefix_pos[t] >= 0 ? prefix_len : 0;
    if (window > 0 && lens[t] - window > first) first = lens[t] - window;
    return first;
}

/* A decode thread's work on one of row t's kv heads: the keys it reads, plus a fixed cost of ~16
 * keys a pair. */
static inline int64_t pair_work(int64_t t, const int32_t *lens, const int32_t *prefix_pos,
                                int64_t prefix_len, int64_t window) {
    return lens[t] - first_key(t, lens, prefix_pos, prefix_len, window) + 16;
}

/* One decode step of paged attention: write each row's new k/v into the caches (rows addressed as
 * at `slot_of`), then, after a barrier, attend each row's query heads over its tokens. Sequence s
 * has the rows query_start[s] .. query_start[s + 1] - 1, its last tokens, the last at position
 * seq_lens[s] - 1 (NULL: one row a sequence); a sequence's rows (its token and the drafts being
 * verified) each attend causally, as a one-row sequence ending at its own position would, and each
 * reads its keys itself. All writes come before any read because a row may read a slot that
 * another one writes in this step (a later draft of its sequence, or a request admitted on a
 * prefix-cache hit of the block whose last token another decodes now); writing per pair would let
 * a pair on one thread read that slot before another thread wrote it (fp32 scores and softmax,
 * exact two-pass), out in bf16 [rows, heads, dim]. Query heads h * group .. h * group + group - 1
 * read kv head h. `dim` is a multiple of 16. Each token's heads are packed in q, k and v, whose
 * rows are `q_stride`, `k_stride`, `v_stride` apart (views into the fused qkv output); `scores`
 * holds group * max len floats, `scores_stride` apart, for each of `threads` threads, which share
 * the (row, kv head) pairs.
 *
 * Cascade: where `prefix_pos` is given and prefix_pos[t] >= 0, row t attends only to its
 * tokens from `prefix_len` on and merges, by log-sum-exp, the result of its query row over the
 * first `prefix_len` (a shared prefix): `prefix_out` [kv_heads][prefix_rows][dim] and
 * `prefix_lse` [kv_heads][prefix_rows] (fp32), at rows prefix_pos[t] * group + g.
 *
 * With `window` > 0 (sliding-window layers, no cascade) a row sees its last `window` positions
 * only; the table's entries before them are not read. With `softcap` > 0 (Gemma 2) a scaled
 * score s becomes tanh(s / softcap) * softcap. */
void decode_attention_bf16(const bf16 *q, const bf16 *k, const bf16 *v, int64_t q_stride,
                           int64_t k_stride, int64_t v_stride,
                           bf16 *k_cache, bf16 *v_cache, int64_t cache_head_stride,
                           const int32_t *block_tables, int64_t max_blocks,
                           const int32_t *seq_lens, const int32_t *query_start,
                           int64_t block_size, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t dim, float scale,
                           bf16 *out, float *scores, int64_t scores_stride, int threads,
                           const int32_t *prefix_pos, int64_t prefix_len, const float *prefix_out,
                           const float *prefix_lse, int64_t prefix_rows, int64_t window,
                           float softcap) {
    int64_t rows = query_start ? query_start[num_seqs] : num_seqs;
    if (rows <= 0) return;
    int32_t lens[rows]; /* each row's tokens: its position + 1 */
    const int32_t *tables[rows];
    for (int64_t s = 0; s < num_seqs; s++) {
        int64_t a = query_start ? query_start[s] : s, b = query_start ? query_start[s + 1] : s + 1;
        for (int64_t t = a; t < b; t++) {
            lens[t] = seq_lens[s] - (int32_t)(b - 1 - t);
            tables[t] = block_tables + s * max_blocks;
        }
    }
    int64_t group = num_heads / num_kv_heads, pairs = rows * num_kv_heads;
    int64_t work = 0; /* over all (row, kv head) pairs */
    for (int64_t t = 0; t < rows; t++)
        work += pair_work(t, lens, prefix_pos, prefix_len, window) * num_kv_heads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for /* ends in a barrier: every write lands before the first read below */
        for (int64_t p = 0; p < pairs; p++) {
            int64_t t = p / num_kv_heads, h = p % num_kv_heads;
            int64_t at = h * cache_head_stride + slot_of(tables[t], lens[t] - 1, block_size) * dim;
            memcpy(k_cache + at, k + t * k_stride + h * dim, dim * sizeof(bf16));
            memcpy(v_cache + at, v + t * v_stride + h * dim, dim * sizeof(bf16));
        }
        /* Each thread takes a run of pairs with an equal share of the keys, in order, so that it
         * knows the pair it reads next and fetches its keys during this one's arithmetic. */
        int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
        int64_t lo = work * me / parts, hi = work * (me + 1) / parts, done = 0, p0 = pairs, p1 = pairs;
        for (int64_t p = 0; p < pairs; p++) {
            int64_t t = p / num_kv_heads;
            if (done >= lo && p0 == pairs) p0 = p;
            if (done >= hi) { p1 = p; break; }
            done += pair_work(t, lens, prefix_pos, prefix_len, window);
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t s = p / num_kv_heads, h = p % num_kv_heads; /* s: the row */
            float acc[group * dim], total[group], top[group];
            float *sc = scores + me * scores_stride;
            const int32_t *table = tables[s];
            int64_t len = lens[s];
            int cascade = prefix_pos && prefix_pos[s] >= 0;
            int64_t first = first_key(s, lens, prefix_pos, prefix_len, window);
            int64_t n = len - first;
            next_keys next = {0};
            if (p + 1 < p1) {
                int64_t ns = (p + 1) / num_kv_heads;
                next.k = k_cache + (p + 1) % num_kv_heads * cache_head_stride;
                next.v = v_cache + (p + 1) % num_kv_heads * cache_head_stride;
                next.table = tables[ns];
                next.first = first_key(ns, lens, prefix_pos, prefix_len, window);
                next.n = lens[ns] - next.first;
            }
            bf16 *kc = k_cache + h * cache_head_stride, *vc = v_cache + h * cache_head_stride;
            const bf16 *qh = q + s * q_stride + h * group * dim;
            int64_t t0 = 0;
#ifdef __AVX512BF16__
            for (; dim % 32 == 0 && t0 + 16 <= n; t0 += 16) { /* 16 keys a vector of scores */
                const bf16 *kr[16];
                for (int j = 0; j < 16; j++) {
                    int64_t key = first + t0 + j;
                    int64_t at = slot_of(table, key, block_size) * dim;
                    kr[j] = kc + at;
                    for (int64_t i = 0; i < dim; i += 32) _mm_prefetch((const char *)(vc + at + i), _MM_HINT_T0);
                    int64_t next = key + 16; /* the next 16 keys' K rows, read next */
                    if (next < len) {
                        const bf16 *kn = kc + slot_of(table, next, block_size) * dim;
                        for (int64_t i = 0; i < dim; i += 32) _mm_prefetch((const char *)(kn + i), _MM_HINT_T0);
                    }
                }
                for (int64_t g = 0; g < group; g++)
                    _mm512_storeu_ps(sc + g * n + t0, _mm512_mul_ps(dot16_bf16(qh + g * dim, kr, dim),
                                                                    _mm512_set1_ps(scale)));
            }
#endif
            for (int64_t t = t0; t < n; t++) {
                int64_t key = first + t;
                const bf16 *kr = kc + slot_of(table, key, block_size) * dim;
                for (int64_t g = 0; g < group; g++) sc[g * n + t] = dot_bf16(qh + g * dim, kr, dim) * scale;
            }
            if (softcap > 0.0f)
                for (int64_t i = 0; i < group * n; i++) sc[i] = tanhf(sc[i] / softcap) * softcap;
            for (int64_t g = 0; g < group; g++) {
                float *sg = sc + g * n, m = max_scores(sg, n), part[16] = {0};
                for (int64_t t = 0; t < n; t++) sg[t] = exp_nonpositive(sg[t] - m);
                sum_lanes16(sg, n, part);
                total[g] = 0.0f;
                for (int j = 0; j < 16; j++) total[g] += part[j];
                top[g] = m;
            }
            memset(acc, 0, sizeof acc);
#ifdef __AVX512BF16__
            if (dim % 64 == 0) {
                pv_avx512(sc, n, group, vc, table, first, block_size, dim, acc, &next);
            } else
#endif
            for (int64_t t = 0; t < n; t++) {
                int64_t key = first + t;
                const bf16 *vr = vc + slot_of(table, key, block_size) * dim;
                for (int64_t g = 0; g < group; g++) {
                    float p = sc[g * n + t];
                    for (int64_t i = 0; i < dim; i++) acc[g * dim + i] += p * to_f32(vr[i]);
                }
            }
            bf16 *o = out + (s * num_heads + h * group) * dim;
            for (int64_t g = 0; g < group; g++) {
                float a = 1.0f, b = 0.0f; /* weights of the tail's sums and the prefix's output */
                const float *po = NULL;
                if (cascade) { /* out = (acc e^top + po e^lse) / (total e^top + e^lse) */
                    int64_t row = h * prefix_rows + prefix_pos[s] * group + g;
                    float lse = prefix_lse[row], m = lse > top[g] ? lse : top[g];
                    a = expf(top[g] - m);
                    b = expf(lse - m);
                    po = prefix_out + row * dim;
                }
                float inv = 1.0f / (total[g] * a + b);
                for (int64_t i = 0; i < dim; i++) {
                    float x = acc[g * dim + i] * a + (po ? po[i] * b : 0.0f);
                    o[g * dim + i] = to_bf16(x * inv);
                }
            }
        }
    }
}

/* Kernels on AVX512-BF16 dot products, where the CPU has them (`has_bf16_kernels` says whether
 * this build does): products of a few rows with a weight, and attention over packed keys (a
 * shared prefix, or a prefill chunk's own). */
#ifdef __AVX512BF16__

int has_bf16_kernels(void) { return 1; }

/* exp_nonpositive on 16 lanes (-inf gives 0). */
static inline __m512 exp_nonpositive16(__m512 x) {
    __m512 res = exp_clamped16(x);
    /* exp(-87) is tiny but not 0: padding keys (-inf) must weigh exactly nothing */
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), res);
}

/* out[m][col ..] = x[m] . w for `ROWS` (<= 8) rows of x and the `NB` (1 to 3) packed blocks of
 * 16 outputs at w (`pairs * 32` apart), output rows `n` apart: up to 24 accumulators, each weight
 * load feeding ROWS dot products and each broadcast of x feeding NB (three blocks: a third fewer
 * broadcasts a product than two). */
static inline void gemm_tile(const bf16 *x, int64_t x_stride, const bf16 *w, int64_t pairs,
                             int64_t n, int64_t col, void *out, int out_bf16, const int ROWS,
                             const int NB) {
    __m512 acc[8][3];
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512bh wv[3];
        for (int j = 0; j < NB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * pairs + p) * 32);
        for (int i = 0; i < ROWS; i++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32(((const uint32_t *)(x + i * x_stride))[p]);
            for (int j = 0; j < NB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xb, wv[j]);
        }
    }
    for (int i = 0; i < ROWS; i++)
        for (int j = 0; j < NB; j++) {
            int64_t at = i * n + col + j * 16;
            if (out_bf16)
                _mm256_storeu_si256((__m256i *)((bf16 *)out + at), (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
            else
                _mm512_storeu_ps((float *)out + at, acc[i][j]);
        }
}

#define GEMM_TILE_ROWS(W, COL, NB)                                                               \
    switch (rows - r < 8 ? rows - r : 8) {                                                     \
    case 1: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 1, NB); break;             \
    case 2: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 2, NB); break;             \
    case 3: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 3, NB); break;             \
    case 4: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 4, NB); break;             \
    case 5: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 5, NB); break;             \
    case 6: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 6, NB); break;             \
    case 7: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 7, NB); break;             \
    default: gemm_tile(xr, x_stride, W, pairs, n, COL, o, out_bf16, 8, NB); break;            \
    }

/* x [rows][k] (bf16, rows `x_stride` apart) times a weight [n][k] packed as [n/16][k/2][16][2]
 * (n a multiple of 16, k even): out [rows][n] in bf16 (`out_bf16`, rounded once) or fp32. Exact
 * bf16 products, fp32 sums, as oneDNN's bf16 linear. `threads` threads split the outputs; each
 * takes 48 at a time (16 at 1-2 rows) through all rows, 8 rows at a time, so the weight streams
 * from memory once (at a few rows the step is a read of the weight at the memory's rate). */
void gemm_bf16(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *wp, int64_t n,
               int64_t k, void *out, int out_bf16, int threads) {
#ifdef AMX_GEMM
    /* On AMX every step (one row included, at the memory's rate) runs on the tiles: ~8x the
     * vector kernel's rate from 16 rows on a Xeon, and a row's bits never depend on its step. */
    if (k % 32 == 0 && amx_ready()) {
        gemm_bf16_amx(x, rows, x_stride, wp, n, k, out, out_bf16, threads);
        return;
    }
#endif
    int64_t pairs = k / 2, blocks = n / 16, elem = out_bf16 ? sizeof(bf16) : sizeof(float);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t nb0 = blocks * t / parts, nb1 = blocks * (t + 1) / parts;
        /* At 1-2 rows the product is a read of the weight: one block at a time, a thread reads
         * its blocks (contiguous in the packing) as one stream, which the prefetchers follow
         * better than three streams a block apart (a single-stream decode step of the default
         * model: ~10.8 -> ~9.5 ms). */
        int64_t step = rows <= 2 ? 1 : 3;
        for (int64_t nb = nb0; nb < nb1; nb += step)
            for (int64_t r = 0; r < rows; r += 8) {
                const bf16 *xr = x + r * x_stride;
                void *o = (char *)out + r * n * elem;
                const bf16 *w = wp + nb * pairs * 32;
                if (step == 3 && nb + 2 < nb1) {
                    GEMM_TILE_ROWS(w, nb * 16, 3)
                } else if (step == 3 && nb + 1 < nb1) {
                    GEMM_TILE_ROWS(w, nb * 16, 2)
                } else {
                    GEMM_TILE_ROWS(w, nb * 16, 1)
                }
            }
    }
}

/* out[:, col .. col + 16 * nb) (rows `n` apart) = x [rows] times `nb` (1 to 3) blocks of 16
 * outputs packed as `gemm_bf16`'s (`pairs * 32` apart) that a caller built, 8 rows at a time, on
 * the calling thread: the GEMM of `quant_gemm_bf16`, on the weights it dequantizes. */
void gemm_bf16_strip(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *strip,
                     int64_t pairs, int64_t n, int64_t col, int nb, void *out, int out_bf16) {
    int64_t elem = out_bf16 ? sizeof(bf16) : sizeof(float);
    for (int64_t r = 0; r < rows; r += 8) {
        const bf16 *xr = x + r * x_stride;
        void *o = (char *)out + r * n * elem;
        if (nb == 3) {
            GEMM_TILE_ROWS(strip, col, 3)
        } else if (nb == 2) {
            GEMM_TILE_ROWS(strip, col, 2)
        } else {
            GEMM_TILE_ROWS(strip, col, 1)
        }
    }
}

/* Gather `len` tokens of each of `heads` kv heads' cache rows (addressed as at `slot_of`) through
 * `blocks` and pack them for `prefix_attention_bf16`: keys as [padded/16][dim/2][16][2], values
 * as [padded/2][dim][2] per head, zero past `len` (padded: len rounded up to 32). The threads
 * share chunks of 32 tokens, every head of each: a block-major cache holds a chunk's blocks
 * together, and 3 heads split as evenly as 8. */
void pack_prefix_bf16(const bf16 *k_cache, const bf16 *v_cache, int64_t cache_head_stride,
                      const int32_t *blocks, int64_t block_size, int64_t len, int64_t heads,
                      int64_t dim, bf16 *kp, bf16 *vp, int threads) {
    int64_t padded = (len + 31) / 32 * 32, pairs = dim / 2, chunks = padded / 32;
#pragma omp parallel for num_threads(threads) if (threads > 1 && chunks > 1)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t h = 0; h < heads; h++) {
            bf16 *kh = kp + h * padded * dim, *vh = vp + h * padded * dim;
            int64_t end = len < 32 * c + 32 ? len : 32 * c + 32;
            if (end < 32 * c + 32) { /* the tail past `len` */
                memset(kh + 32 * c * dim, 0, 32 * dim * sizeof(bf16));
                memset(vh + 32 * c * dim, 0, 32 * dim * sizeof(bf16));
            }
            for (int64_t t = 32 * c; t < end; t++) {
                int64_t slot = slot_of(blocks, t, block_size);
                const bf16 *k = k_cache + h * cache_head_stride + slot * dim;
                const bf16 *v = v_cache + h * cache_head_stride + slot * dim;
                bf16 *kd = kh + ((t / 16) * pairs * 16 + t % 16) * 2;
                for (int64_t p = 0; p < pairs; p++) {
                    kd[p * 32] = k[2 * p];
                    kd[p * 32 + 1] = k[2 * p + 1];
                }
                bf16 *vd = vh + (t / 2) * dim * 2 + t % 2;
                for (int64_t d = 0; d < dim; d++) vd[2 * d] = v[d];
            }
        }
}

/* Scores s[i][t] = q_i . k_t of 4 query rows (bf16 [4][dim]) over the packed keys [0, padded), on
 * AVX512-BF16 dot products (exact bf16 products, fp32 sums), rows of s `padded` apart. */
static void scores_rows4(const bf16 *q, const bf16 *kp, int64_t dim, int64_t padded, float *s) {
    int64_t pairs = dim / 2;
    const uint32_t *q0 = (const uint32_t *)q; /* row i's pair p at q0[i * pairs + p] */
    for (int64_t b = 0; b < padded / 16; b += 2) { /* 4 rows x 32 keys at a time */
        __m512 acc[4][2];
        for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        const bf16 *k0 = kp + b * pairs * 32, *k1 = k0 + pairs * 32;
        for (int64_t p = 0; p < pairs; p++) {
            __m512bh kb0 = (__m512bh)_mm512_loadu_si512(k0 + p * 32);
            __m512bh kb1 = (__m512bh)_mm512_loadu_si512(k1 + p * 32);
            for (int i = 0; i < 4; i++) {
                __m512bh x = (__m512bh)_mm512_set1_epi32(q0[i * pairs + p]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, kb0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, kb1);
            }
        }
        for (int i = 0; i < 4; i++) {
            _mm512_storeu_ps(s + i * padded + b * 16, acc[i][0]);
            _mm512_storeu_ps(s + i * padded + b * 16 + 16, acc[i][1]);
        }
    }
}

/* out[i][d] = inv[i] * sum over t < padded of p[i][t] v_t[d] for 4 rows of bf16 probabilities
 * (rows `padded` apart) and the packed values, on AVX512-BF16 dot products. */
static void values_rows4(const bf16 *pb, const bf16 *vp, int64_t dim, int64_t padded,
                         const float *inv, float *out) {
    const uint32_t *pr[4];
    for (int i = 0; i < 4; i++) pr[i] = (const uint32_t *)(pb + i * padded);
    for (int64_t db = 0; db < dim; db += 64) { /* 4 rows x 4 blocks of 16 dims at a time */
        __m512 c[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) c[i][j] = _mm512_setzero_ps();
        int64_t nb = dim - db < 64 ? (dim - db) / 16 : 4;
        for (int64_t tp = 0; tp < padded / 2; tp++) {
            const bf16 *vrow = vp + tp * dim * 2 + db * 2;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(vrow);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(vrow + 32);
            __m512bh v2 = nb > 2 ? (__m512bh)_mm512_loadu_si512(vrow + 64) : v0;
            __m512bh v3 = nb > 3 ? (__m512bh)_mm512_loadu_si512(vrow + 96) : v0;
            for (int i = 0; i < 4; i++) {
                __m512bh x = (__m512bh)_mm512_set1_epi32(pr[i][tp]);
                c[i][0] = _mm512_dpbf16_ps(c[i][0], x, v0);
                c[i][1] = _mm512_dpbf16_ps(c[i][1], x, v1);
                c[i][2] = _mm512_dpbf16_ps(c[i][2], x, v2);
                c[i][3] = _mm512_dpbf16_ps(c[i][3], x, v3);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int64_t j = 0; j < nb; j++)
                _mm512_storeu_ps(out + i * dim + db + 16 * j,
                                 _mm512_mul_ps(c[i][j], _mm512_set1_ps(inv[i])));
    }
}

/* Attention of m query rows (bf16 [m][dim]: 4, or up to 16 `on_tiles`) over packed keys/values
 * (`packed` keys a head, padded to 32), row i over keys lows[i] .. limits[i] - 1: out [m][dim]
 * fp32 and log-sum-exp [m]. QK^T and PV take exact bf16 products with fp32 sums (AVX512-BF16
 * dot products, or AMX tiles 16 rows at a time: one `tdpbf16ps` does 256 `vdpbf16ps`' work, and a
 * RAG batch's cascade decode step had spent ~19% of its time here); softmax in fp32; the
 * probabilities enter PV rounded to bf16, as flash attention on bf16 does; with `softcap` > 0 a
 * scaled score s is tanh(s / softcap) * softcap. `work`: `PREFIX_WORK` * `packed` floats. */
static void prefix_rows(const bf16 *q, int m, int on_tiles, const bf16 *kp, const bf16 *vp,
                        int64_t packed, const int64_t *lows, const int64_t *limits, int64_t dim,
                        float scale, float softcap, float *out, float *lse, float *work) {
    int64_t len = limits[0];
    for (int i = 1; i < m; i++) len = limits[i] > len ? limits[i] : len;
    int64_t padded = (len + 31) / 32 * 32;
    float *s = work, total[16], top[16], inv[16];
    bf16 *pb = (bf16 *)(work + 16 * packed);
#ifdef AMX_GEMM
    if (on_tiles)
        attention_scores_amx(q, m, dim, kp, padded, s, padded);
    else
#endif
        scores_rows4(q, kp, dim, padded, s);
    const __m512 vscale = _mm512_set1_ps(softcap > 0.0f ? 1.0f : scale); /* else scaled here */
    for (int i = 0; i < m; i++) {
        float *si = s + i * padded;
        if (softcap > 0.0f) /* before the mask: tanh would bring -inf back to -softcap */
            for (int64_t t = lows[i]; t < limits[i]; t++)
                si[t] = tanhf(si[t] * scale / softcap) * softcap;
        for (int64_t t = 0; t < lows[i]; t++) si[t] = -INFINITY;
        for (int64_t t = limits[i]; t < padded; t++) si[t] = -INFINITY;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t t = 0; t < padded; t += 16) {
            __m512 x = _mm512_mul_ps(_mm512_loadu_ps(si + t), vscale);
            _mm512_storeu_ps(si + t, x);
            vmax = _mm512_max_ps(vmax, x);
        }
        float mx = _mm512_reduce_max_ps(vmax);
        __m512 vm = _mm512_set1_ps(mx), vsum = _mm512_setzero_ps();
        bf16 *pi = pb + i * padded;
        for (int64_t t = 0; t < padded; t += 16) {
            __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(si + t), vm));
            vsum = _mm512_add_ps(vsum, e);
            _mm256_storeu_si256((__m256i *)(pi + t), (__m256i)_mm512_cvtneps_pbh(e));
        }
        total[i] = _mm512_reduce_add_ps(vsum);
        top[i] = mx;
        inv[i] = 1.0f / total[i];
    }
#ifdef AMX_GEMM
    if (on_tiles)
        attention_values_amx(pb, m, padded, vp, dim, padded, inv, out);
    else
#endif
        values_rows4(pb, vp, dim, padded, inv, out);
    for (int i = 0; i < m; i++) lse[i] = top[i] + logf(total[i]);
}

/* The query rows `prefix_rows` takes at a time: 16 on AMX tiles (dims a multiple of 32), else 4. */
static int prefix_tile_rows(int64_t dim) {
#ifdef AMX_GEMM
    if (dim % 32 == 0 && amx_ready()) return 16;
#endif
    (void)dim;
    return 4;
}

/* The tasks (row tiles of `prefix_rows`, head-major) a thread of `prefix_attention_bf16` and
 * `prefill_attention_bf16` runs. Where the threads divide the kv heads evenly, each runs its own
 * heads' tasks, so that it reads only their packed keys and values: handed out one at a time to
 * whichever thread was free, every head's went through both threads' caches (a RAG batch's
 * decode step, 8 kv heads over ~900 shared tokens: 9.6-11.0 -> 8.3-9.5 ms over 16 layers). Else
 * (one kv head, three on two threads) the next task not yet taken: an even split of a causal
 * chunk's tasks, whose costs differ, ran up to 1.19x slower. */
typedef struct {
    int64_t next, last; /* own tasks: the next and the end; else the end of all */
    int own;
} task_run;

static task_run task_run_of(int64_t heads, int64_t tiles) {
    int64_t parts = omp_get_num_threads(), me = omp_get_thread_num();
    if (heads % parts)
        return (task_run){0, heads * tiles, 0};
    return (task_run){heads / parts * me * tiles, heads / parts * (me + 1) * tiles, 1};
}

/* The thread's next task (`taken`: the count handed out, shared), or -1 when none is left. */
static inline int64_t take_task(task_run *run, int64_t *taken) {
    int64_t task;
    if (run->own) {
        task = run->next++;
    } else {
#pragma omp atomic capture
        task = (*taken)++;
    }
    return task < run->last ? task : -1;
}

/* Attention of each kv head's `rows` query rows (bf16 [heads][rows][dim], rows a multiple of 4)
 * over its `len` packed keys/values (`pack_prefix_bf16`): out [heads][rows][dim] fp32 and
 * log-sum-exp [heads][rows]. Without mask (`causal_group` 0), or causal: row r is token
 * r / causal_group of a chunk whose first token follows key `causal_offset`, and sees the keys up
 * to its own (with `window` > 0, its last `window` keys only). `softcap` > 0: scores are
 * soft-capped (`prefix_rows`). `threads` threads share the blocks of `prefix_tile_rows` rows;
 * `work` holds PREFIX_WORK * padded floats for each. */
void prefix_attention_bf16(const bf16 *q, int64_t heads, int64_t rows, int64_t dim,
                           const bf16 *kp, const bf16 *vp, int64_t len, float scale, float *out,
                           float *lse, float *work, int threads, int64_t causal_group,
                           int64_t causal_offset, int64_t window, float softcap) {
    int64_t padded = (len + 31) / 32 * 32, tile = prefix_tile_rows(dim);
    int64_t tiles = (rows + tile - 1) / tile, taken = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        task_run run = task_run_of(heads, tiles);
        for (int64_t task; (task = take_task(&run, &taken)) >= 0;) {
            int64_t h = task / tiles, r = task % tiles * tile;
            int m = rows - r < tile ? (int)(rows - r) : (int)tile;
            int64_t lows[16], limits[16];
            for (int i = 0; i < m; i++) {
                int64_t limit = causal_group ? causal_offset + (r + i) / causal_group + 1 : len;
                limits[i] = limit < len ? limit : len;
                lows[i] = window > 0 && limit - window > 0 ? limit - window : 0;
            }
            prefix_rows(q + (h * rows + r) * dim, m, tile == 16, kp + h * padded * dim,
                        vp + h * padded * dim, padded, lows, limits, dim, scale, softcap,
                        out + (h * rows + r) * dim, lse + h * rows + r,
                        work + omp_get_thread_num() * PREFIX_WORK * padded);
        }
    }
}
/* A prefill chunk's causal attention, token-major on both sides: the queries of `tokens` tokens,
 * each token's `kv_heads * group` heads packed in a row of q (rows `q_stride` apart), over the
 * `len` packed keys/values of its context then itself (`pack_prefix_bf16`), token t seeing keys
 * up to `offset + t` (with `window` > 0, its last `window` of them); out in bf16, rows
 * `out_stride` apart. The same arithmetic as prefix_attention_bf16 over `_rows_first` rows and a
 * cast of its output to bf16, without those copies. `work` as for prefix_attention_bf16. */
void prefill_attention_bf16(const bf16 *q, int64_t q_stride, int64_t tokens, int64_t kv_heads,
                            int64_t group, int64_t dim, const bf16 *kp, const bf16 *vp,
                            int64_t len, float scale, bf16 *out, int64_t out_stride, float *work,
                            int threads, int64_t offset, int64_t window, float softcap) {
    int64_t padded = (len + 31) / 32 * 32, rows = tokens * group, tile = prefix_tile_rows(dim);
    int64_t tiles = (rows + tile - 1) / tile, taken = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        task_run run = task_run_of(kv_heads, tiles);
        for (int64_t task; (task = take_task(&run, &taken)) >= 0;) {
            int64_t h = task / tiles, r = task % tiles * tile;
            /* rows r .. r + m - 1 of this kv head (4-row tiles repeat the last past the end) */
            int m = tile == 4 ? 4 : rows - r < tile ? (int)(rows - r) : (int)tile;
            bf16 qb[m * dim];
            float ob[m * dim], lb[m];
            int64_t lows[16], limits[16], at[16];
            for (int i = 0; i < m; i++) {
                int64_t row = r + i < rows ? r + i : rows - 1, t = row / group;
                int64_t limit = offset + t + 1;
                limits[i] = limit < len ? limit : len;
                lows[i] = window > 0 && limit - window > 0 ? limit - window : 0;
                at[i] = h * group + row % group; /* the row's query head */
                memcpy(qb + i * dim, q + t * q_stride + at[i] * dim, dim * sizeof(bf16));
            }
            prefix_rows(qb, m, tile == 16, kp + h * padded * dim, vp + h * padded * dim, padded,
                        lows, limits, dim, scale, softcap, ob, lb,
                        work + omp_get_thread_num() * PREFIX_WORK * padded);
            for (int i = 0; i < m && r + i < rows; i++) {
                bf16 *o = out + (r + i) / group * out_stride + at[i] * dim;
                for (int64_t d = 0; d < dim; d++) o[d] = to_bf16(ob[i * dim + d]);
            }
        }
    }
}

#else
int has_bf16_kernels(void) { return 0; }
#endif
