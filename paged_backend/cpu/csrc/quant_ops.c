/* Products with weights kept in GGUF's block formats (see `paged_backend.cpu.quant`): Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and Q2_K ... Q6_K (super-blocks of 256), as ggml lays
 * them out, read straight from the file's bytes.
 *
 * Every format is read as levels q (0..63, unsigned; Q8_0's are signed bytes) with, for each group
 * of 16 weights, a scale a and an offset b: weight = a * q + b. Activations are quantized per row
 * to int8 with one scale xd per block (as llama.cpp's Q8_0 and Q8_K), and each 16's level sum is
 * kept (bsum). Then
 *   sum_i w_i x_i = sum_g xd_g * (a_g * (q . xq)_g + b_g * bsum_g),
 * where (q . xq)_g are exact integer dot products of 32 bytes at a time (AVX2 `vpmaddubsw`).
 * - Legacy formats (blocks of 32, activations too): the blocks' integer sums of a chunk are
 *   gathered into one vector, scaled in float once a chunk.
 * - K-quants (activations in blocks of 256): a and b are small integers times a super-block
 *   factor, so a super-block sums in integers (`vpmaddwd` by the group's scale) and converts once.
 *   Q8_256 (ours, for `quantization="int8"`: signed levels, one scale a super-block) is read as
 *   a K-quant whose groups all weigh 1 and whose offsets are 0.
 * Steps of 1-3 rows of a 4- or 5-bit legacy format take its blocks apart with byte permutes where
 * the CPU has AVX512-VBMI (`dot_rows_legacy_vbmi`); AVX2 builds without the AVX-512 kernels read
 * Q4_0, Q5_0 and Q8_0 with 8 rows interleaved (`ROWS8`), a lane a row.
 * A chunk of 256 weights is unpacked once for all rows of a step, so a batch reuses it from
 * registers and L1; with AVX512-VNNI, steps of a few rows on unpack a strip of outputs once
 * into a layout for `vpdpbusd` (`quant_gemm.c`), and without it, steps of 6 rows on of a K-quant
 * weight run the AVX2 GEMM (`avx2_gemm.c`). Without AVX2 a scalar loop computes the same sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

#define ROW_TILE 32     /* activation rows served by one unpacking of a chunk */
#define OUT_TILE 8      /* weight rows a thread takes side by side: a chunk of the activations,
                           up to ROW_TILE rows of 256 bytes, is read from L1 for all of them */

/* x[at + i] (fp32, or bf16 where `x_bf16`) for i < block, 0 from i = n on, into v. */
static inline void block_values(const void *x, int x_bf16, int64_t at, int64_t n, int64_t block,
                                float *v) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= n; i += 16) {
        __m512 f = x_bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at + i))), 16))
                          : _mm512_loadu_ps((const float *)x + at + i);
        _mm512_storeu_ps(v + i, f);
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        __m256 f = x_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
                                _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + i))), 16))
                          : _mm256_loadu_ps((const float *)x + at + i);
        _mm256_storeu_ps(v + i, f);
    }
#endif
    for (; i < block; i++) {
        float f = 0.0f;
        if (i < n) {
            if (x_bf16) {
                uint32_t u = (uint32_t)((const uint16_t *)x)[at + i] << 16;
                memcpy(&f, &u, 4);
            } else {
                f = ((const float *)x)[at + i];
            }
        }
        v[i] = f;
    }
}

/* The largest |v[i]| of a block. */
static inline float block_amax(const float *v, int64_t block) {
    int64_t i = 0;
    float amax = 0.0f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 m = _mm512_setzero_ps();
    for (; i < (block & ~15); i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    amax = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
    __m256 m = _mm256_setzero_ps();
    for (; i < (block & ~7); i += 8) /* |v| first: a NaN is passed over, as fmaxf does */
        m = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), _mm256_loadu_ps(v + i)), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#endif
    for (; i < block; i++) amax = fmaxf(amax, fabsf(v[i]));
    return amax;
}

/* The levels of 16 values v * inv, rounded to nearest even, into q[16]; returns their sum. */
static inline int levels16(const float *v, float inv, int8_t *q) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512i l = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), _mm512_set1_ps(inv)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(l));
    return _mm512_reduce_add_epi32(l);
#elif defined(__AVX2__)
    __m256 s = _mm256_set1_ps(inv);
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), s));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), s));
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8); /* int16 in order */
    _mm_storeu_si128((__m128i *)q, _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(a, b)),
                              _mm256_extracti128_si256(_mm256_add_epi32(a, b), 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1)));
#else
    int sum = 0;
    for (int l = 0; l < 16; l++) {
        int level = (int)nearbyintf(v[l] * inv);
        q[l] = (int8_t)level;
        sum += level;
    }
    return sum;
#endif
}

/* Rows of x (fp32, or bf16 where `x_bf16`; rows `x_stride` elements apart) to int8 in blocks of
 * `block` (32, or 256 for the K-quants: one scale a super-block, as llama.cpp's Q8_K; 0: one
 * scale a row, for Q8_256's per-channel weights): xq [rows][kp] (kp = `act_stride(k)`, zero past
 * k), xd [rows][kp/32] the scale of each 32 (its block's; 0 past k) and bsum [rows][kp/16] each
 * 16's level sum.
 * Levels round to nearest even, as `vcvtps2dq` does (with AVX-512 or AVX2, 8-16 values at a
 * time: the scalar loop took ~2 ns a value, a tenth of a 256-row product of a 2048 x 2048 Q4_K
 * weight). */
void quantize_activations(const void *x, int x_bf16, int64_t rows, int64_t k, int64_t x_stride,
                          int64_t block, int8_t *xq, float *xd, int16_t *bsum, int threads) {
    int64_t kp = act_stride(k), size = block > 0 ? block : CHUNK;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * k >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float v[CHUNK];
        int8_t *q = xq + r * kp;
        float row_amax = 0.0f; /* block 0: the row's, over its chunks first */
        for (int64_t first = 0; block <= 0 && first < k; first += CHUNK) {
            int64_t n = k - first < CHUNK ? k - first : CHUNK;
            block_values(x, x_bf16, r * x_stride + first, n, CHUNK, v);
            row_amax = fmaxf(row_amax, block_amax(v, CHUNK));
        }
        for (int64_t b = 0; b < kp / size; b++) {
            int64_t first = size * b, n = k - first < size ? (k - first > 0 ? k - first : 0) : size;
            block_values(x, x_bf16, r * x_stride + first, n, size, v);
            float amax = block > 0 ? block_amax(v, size) : n > 0 ? row_amax : 0.0f;
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int64_t i = 0; i < size; i += 16)
                bsum[r * (kp / 16) + (first + i) / 16] = (int16_t)levels16(v + i, inv, q + first + i);
            for (int64_t i = 0; i < size; i += 32)
                xd[r * (kp / 32) + (first + i) / 32] = block > 0 || first + i < k ? d : 0.0f;
        }
    }
}

#ifdef QUANT_AVX2
typedef __m256 acc_t; /* a row's running sums, 8 lanes */

static inline __m256i dot_bytes(__m256i q, __m256i x, int is_signed) {
    if (is_signed) { /* the first operand is taken unsigned: move the signs to x */
        x = _mm256_sign_epi8(x, q);
        q = _mm256_sign_epi8(q, q);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A row's result from its running sum, kept in lane 0 (`k_add`, `dot_rows`). */
static inline float acc_value(acc_t v) { return _mm256_cvtss_f32(v); }

/* Lane g: the sum of the 8 lanes of p[g]. */
static inline __attribute__((always_inline)) __m256i lane_sums8(const __m256i p[8]) {
    __m256i lo = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    __m256i hi = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* The float sequence of every legacy kernel, lane by lane: blocks' integer sums, their scales d8
 * and offsets off8, the activations' block scales xd8 and level sums (ignored for Q8_0). */
static inline __attribute__((always_inline)) __m256 legacy_scaled(int type, __m256i sums, __m256 d8,
                                                                  __m256 off8, __m256 xd8,
                                                                  __m256i levels) {
    __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d8, xd8));
    if (type == Q8_0) return sum;
    return _mm256_fmadd_ps(off8, _mm256_mul_ps(_mm256_cvtepi32_ps(levels), xd8), sum);
}

static inline __attribute__((always_inline)) __m256 legacy_value(int type, __m256i sums, __m256 d8,
                                                                 __m256 off8, const float *xd,
                                                                 const int16_t *bs) {
    if (type == Q8_0) return legacy_scaled(type, sums, d8, off8, _mm256_loadu_ps(xd), _mm256_setzero_si256());
    __m256i levels = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bs), _mm256_set1_epi16(1));
    return legacy_scaled(type, sums, d8, off8, _mm256_loadu_ps(xd), levels);
}

/* A legacy chunk . one row's activations x at it (their blocks' scales xd, their 16s' level sums
 * bs), lane g block g's: each block's integer products are summed across lanes first, so the
 * float work is one vector a chunk, not one a block. Every path ends a chunk here, with `type`,
 * `groups` and `is_signed` constants where they can be, so a row's result does not depend on
 * the path. */
static inline __attribute__((always_inline)) __m256 legacy_dot(
    int type, const kernel_chunk *c, const int8_t *x, const float *xd, const int16_t *bs,
    const int groups, const int is_signed) {
    __m256i p[8];
    for (int g = 0; g < 8; g++)
        p[g] = g < groups ? dot_bytes(c->q[g], _mm256_loadu_si256((const __m256i *)(x + 32 * g)), is_signed)
                          : _mm256_setzero_si256();
    return legacy_value(type, lane_sums8(p), c->d8, c->off8, xd, bs);
}

/* `legacy_dot` with the block count and signedness constants for whole chunks. */
static inline __attribute__((always_inline)) __m256 legacy_chunk_dot(
    int type, const kernel_chunk *c, const int8_t *x, const float *xd, const int16_t *bs) {
    if (c->groups == 8) return legacy_dot(type, c, x, xd, bs, 8, type == Q8_0);
    return legacy_dot(type, c, x, xd, bs, c->groups, c->is_signed);
}

/* acc[m] (lane 0) += chunk . row m of the step's activations (at this chunk), for `rows` rows:
 * the chunk's 8 block values summed in `hsum8`'s tree, then added to the row's sum, the float
 * sequence of every legacy kernel (the VNNI GEMM's too). */
static inline __attribute__((always_inline)) void dot_rows(
    int type, const kernel_chunk *c, const int8_t *xq, const float *xd, const int16_t *bsum,
    int64_t kp, int64_t rows, acc_t *acc) {
    for (int64_t m = 0; m < rows; m++)
        acc[m] = _mm256_castps128_ps256(_mm_add_ss(
            _mm256_castps256_ps128(acc[m]),
            _mm_set_ss(hsum8(legacy_chunk_dot(type, c, xq + m * kp, xd + m * (kp / 32),
                                              bsum + m * (kp / 16))))));
}

/* A shuffle that spreads int16 lane `lo` of a 128-bit half over the low half and lane `hi` over
 * the high half. */
static inline __m256i spread_lanes(int lo, int hi) {
    return _mm256_blend_epi32(_mm256_set1_epi16((int16_t)(((2 * lo + 1) << 8) | (2 * lo))),
                              _mm256_set1_epi16((int16_t)(((2 * hi + 1) << 8) | (2 * hi))), 0xf0);
}

/* The scales of level register g: int16 lanes 0-7 weigh its first 16 weights, 8-15 the next. */
static inline __attribute__((always_inline)) __m256i k_scale(int type, const k_header *h, int g) {
    if (type == Q8_256) return h->lo;
    if (has_16_groups(type)) return _mm256_shuffle_epi8(g < 4 ? h->lo : h->hi, spread_lanes(2 * g % 8, (2 * g + 1) % 8));
    return _mm256_shuffle_epi8(h->lo, spread_lanes(g, g));
}

/* Level register g's products with the activations x (32 bytes), weighted by its scales
 * (Q8_256's signed levels: weighted by 1). */
static inline __attribute__((always_inline)) __m256i k_group_dot(int type, __m256i q, __m256i scale,
                                                                 const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    if (type == Q8_256) return dot_bytes(q, xv, 1);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale);
}

/* acc (lane 0) + a super-block's value from its integer sums (sumi: 8 lanes of isum's parts),
 * the activations' 16s' sums bs and scale xd: the float sequence of every kernel (see k_header). */
static inline __attribute__((always_inline)) __m128 k_add(__m128 acc, const k_header *h,
                                                          __m256i sumi, const int16_t *bs,
                                                          float xd) {
    __m256i mins = _mm256_madd_epi16(h->mv, _mm256_loadu_si256((const __m256i *)bs));
    __m256i pairs = _mm256_hadd_epi32(sumi, mins); /* isum's and msum's parts, 4 each */
    __m128i both = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
    both = _mm_hadd_epi32(both, both); /* isum, msum */
    __m128 p = _mm_mul_ps(_mm_cvtepi32_ps(both), _mm_mul_ps(h->dm, _mm_set1_ps(xd)));
    return _mm_add_ss(acc, _mm_sub_ss(p, _mm_movehdup_ps(p)));
}

/* Weights are read this far ahead of the chunk in use: one thread's stream from memory runs ~15%
 * faster with it (the hardware prefetcher alone leaves a one-row product waiting). */
#define PREFETCH_BYTES 4096

/* Ask for the `bytes` of weights PREFETCH_BYTES past those at `at`. */
static inline __attribute__((always_inline)) void prefetch_ahead(const uint8_t *at, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64)
        _mm_prefetch((const char *)at + PREFETCH_BYTES + i, _MM_HINT_T0);
}

/* A super-block unpacked once for the rows of a step. */
typedef struct {
    __m256i q[8], sc[8];
    k_header h;
} k_chunk;

/* acc[m] (lane 0) += the super-block at blk . row m's activations at it, for `rows` rows. */
static inline __attribute__((always_inline)) void dot_rows_k(
    int type, const uint8_t *blk, const int8_t *xq, const float *xd, const int16_t *bsum,
    int64_t kp, int64_t rows, acc_t *acc) {
    k_chunk c;
    prefetch_ahead(blk, block_bytes(type));
    k_header_of(type, blk, &c.h);
    for (int g = 0; g < 8; g++) {
        c.q[g] = k_level(type, blk, g);
        c.sc[g] = k_scale(type, &c.h, g);
    }
    for (int64_t m = 0; m < rows; m++) {
        const int8_t *x = xq + m * kp;
        __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int g = 0; g < 8; g++)
            part[g % 2] = _mm256_add_epi32(part[g % 2], k_group_dot(type, c.q[g], c.sc[g], x + 32 * g));
        __m256i sumi = _mm256_add_epi32(part[0], part[1]);
        acc[m] = _mm256_castps128_ps256(
            k_add(_mm256_castps256_ps128(acc[m]), &c.h, sumi, bsum + m * (kp / 16), xd[m * (kp / 32)]));
    }
}

/* A row of a K-quant weight . one row of activations, summed in a register: a step of one row
 * unpacks each group just before its product (fewer live registers than a whole chunk), with
 * `type` a constant. The super-blocks add up as in `dot_rows_k`: the same bits alone or in a
 * batch. */
static inline __attribute__((always_inline)) float dot_one_k_of(
    int type, const uint8_t *row, int64_t k, const int8_t *x, const float *xd, const int16_t *bsum) {
    __m128 sum = _mm_setzero_ps();
    for (int64_t first = 0; first < k; first += CHUNK, row += block_bytes(type)) {
        k_header h;
        prefetch_ahead(row, block_bytes(type));
        k_header_of(type, row, &h);
        __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int g = 0; g < 8; g++)
            part[g % 2] = _mm256_add_epi32(
                part[g % 2], k_group_dot(type, k_level(type, row, g), k_scale(type, &h, g), x + first + 32 * g));
        sum = k_add(sum, &h, _mm256_add_epi32(part[0], part[1]), bsum + first / 16, xd[first / 32]);
    }
    return _mm_cvtss_f32(sum);
}

/* A row of a legacy weight . one row of activations, chunk by chunk as `dot_rows` adds them:
 * the same bits alone or in a batch. */
static inline __attribute__((always_inline)) float dot_one_legacy_of(
    int type, const uint8_t *row, int64_t k, const int8_t *x, const float *xd, const int16_t *bsum) {
    float sum = 0.0f;
    for (int64_t first = 0; first < k; first += CHUNK) {
        prefetch_ahead(row + (first >> 5) * block_bytes(type), 8 * block_bytes(type));
        kernel_chunk c;
        unpack_kernel_chunk(type, row, first, k - first < CHUNK ? k - first : CHUNK, &c);
        sum += hsum8(legacy_chunk_dot(type, &c, x + first, xd + first / 32, bsum + first / 16));
    }
    return sum;
}

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__AVX512BITALG__)
/* Steps of 1-3 rows of Q4_0, Q4_1, Q5_0 or Q5_1 on 512-bit registers (Zen 4, Ice Lake on): byte
 * permutes (VBMI) take the nibbles, fifth bits and fp16 scales of a chunk's 8 blocks straight
 * from its bytes, and 4 `vpdpbusd` give the blocks' integer sums, against 8 register-wide
 * unpacks, 8 scale loads and the horizontal adds of `lane_sums8` on 256-bit ones. The row's
 * activations are laid out once (`legacy_x_layout`) so that lane 4d + g of a product register
 * pairs block g's weights 4d..4d+3 (low nibbles; 16 + 4d.. for the high ones) with theirs: each
 * 128-bit quarter holds one d for 4 blocks, and quarters add up into the block sums. Those are
 * the same integers, and `legacy_value` the same floats: the same bits as the other kernels.
 * One-row products of a 16384 x 8192 weight on 2 Zen 4 threads went from 25 to 37 GB/s (Q4_0),
 * 20 to 35 (Q5_0), 22 to 42 (Q4_1), 21 to 41 (Q5_1); Q4_K's runs at ~38. A chunk is taken
 * apart once for a step's rows: 2 and 3 rows of a 4864 x 896 Q5_0 weight took 159 and 203 us
 * against 254 and 301 on 256-bit registers (one: 122); from 4 rows the VNNI GEMM is as fast. */
#define LEGACY_VBMI 1
#define LEGACY_VBMI_ROWS 3 /* steps of up to this many rows run on it */

typedef struct {
    __m512i nibbles[2], fifth[2], select[2], halves[2];
} legacy_perm;

/* The byte permutes of `type`'s chunks: index tables over the chunk's bytes 0-127 (blocks 0-3's
 * parts, register 0) and 64-191 (blocks 4-7's, register 1). */
static legacy_perm legacy_perm_of(int type) {
    int bb = (int)block_bytes(type), at = nibbles_at(type);
    int fifth = type == Q5_0 || type == Q5_1 ? fifth_bits_at(type) : 0;
    uint8_t idx[8][64];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 64; i++) {
            int lane = i / 4, d = lane / 4, b = i % 4, e = lane % 2;
            idx[h][i] = (uint8_t)((4 * h + lane % 4) * bb + at + 4 * d + b - 64 * h);
            /* qword q: the fifth bits of blocks 2 (q % 2) and one more, of this half */
            idx[2 + h][i] = (uint8_t)((4 * h + 2 * (i / 8 % 2) + i / 4 % 2) * bb + fifth + b - 64 * h);
            idx[4 + h][i] = (uint8_t)(32 * e + 16 * h + 4 * d + b); /* bit of that qword */
            /* bytes 0-15: the blocks' d (fp16), 16-31: their minimum (Q4_1, Q5_1) */
            int g = i % 16 / 2, half = i < 32 && g / 4 == h ? 1 : 0;
            idx[6 + h][i] = (uint8_t)(half ? g * bb + 2 * (i / 16) + i % 2 - 64 * h : 0);
        }
    legacy_perm p;
    for (int h = 0; h < 2; h++) {
        p.nibbles[h] = _mm512_loadu_si512(idx[h]);
        p.fifth[h] = _mm512_loadu_si512(idx[2 + h]);
        p.select[h] = _mm512_loadu_si512(idx[4 + h]);
        p.halves[h] = _mm512_loadu_si512(idx[6 + h]);
    }
    return p;
}

/* Activations x (k inputs, zeros after them up to the next chunk) into xt as
 * `dot_rows_legacy_vbmi` reads them: per chunk blocks 0-3's inputs at their low nibbles, at their
 * high nibbles, then 4-7's, each 64 bytes with lane 4d + g holding block g's inputs 4d..4d+3
 * (16 + 4d.. for the high ones). */
static void legacy_x_layout(const int8_t *x, int64_t k, int8_t *xt) {
    int32_t idx[2][16];
    for (int high = 0; high < 2; high++)
        for (int lane = 0; lane < 16; lane++) idx[high][lane] = 8 * (lane % 4) + 4 * high + lane / 4;
    __m512i lo = _mm512_loadu_si512(idx[0]), hi = _mm512_loadu_si512(idx[1]);
    for (int64_t first = 0; first < k; first += CHUNK)
        for (int h = 0; h < 2; h++) {
            __m512i a = _mm512_loadu_si512(x + first + 128 * h), b = _mm512_loadu_si512(x + first + 128 * h + 64);
            _mm512_storeu_si512(xt + first + 128 * h, _mm512_permutex2var_epi32(a, lo, b));
            _mm512_storeu_si512(xt + first + 128 * h + 64, _mm512_permutex2var_epi32(a, hi, b));
        }
}

/* The levels of 4 blocks: lane 4d + g of lo holds block g's weights 4d..4d+3, of hi 16 + 4d..,
 * from their nibble bytes v and, for Q5_0 / Q5_1, the qwords of their fifth bits f. */
static inline __attribute__((always_inline)) void legacy_levels(int type, const legacy_perm *p,
                                                                __m512i v, __m512i f, __m512i *lo,
                                                                __m512i *hi) {
    __m512i m15 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    *lo = _mm512_and_si512(v, m15);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m15);
    if (type == Q5_0 || type == Q5_1) {
        *lo = _mm512_mask_add_epi8(*lo, _mm512_bitshuffle_epi64_mask(f, p->select[0]), *lo, sixteen);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_bitshuffle_epi64_mask(f, p->select[1]), *hi, sixteen);
    }
}

/* Bytes [0, n) of 64 as a load mask (n clamped to 0..64). */
static inline __mmask64 first_bytes(int64_t n) {
    return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : ((__mmask64)1 << n) - 1;
}

/* A legacy chunk taken apart for `vpdpbusd`: lane 4d + g of lo[h] holds block 4h + g's weights
 * 4d..4d+3, of hi[h] its 16 + 4d..; d8, off8 as `kernel_chunk`'s. */
typedef struct {
    __m512i lo[2], hi[2];
    __m256 d8, off8;
} legacy_vbmi_chunk;

/* The chunk of `bytes` at c (fewer than 8 blocks at a row's end: the missing ones read as zeros,
 * as the 256-bit kernel's are). */
static inline __attribute__((always_inline)) void legacy_unpack_vbmi(int type, const legacy_perm *p,
                                                                     const uint8_t *c, int64_t bytes,
                                                                     legacy_vbmi_chunk *u) {
    __m512i r0 = _mm512_maskz_loadu_epi8(first_bytes(bytes), c);
    __m512i r1 = _mm512_maskz_loadu_epi8(first_bytes(bytes - 64), c + 64);
    __m512i r2 = _mm512_maskz_loadu_epi8(first_bytes(bytes - 128), c + 128);
    __m512i f[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if (type == Q5_0 || type == Q5_1) {
        f[0] = _mm512_permutex2var_epi8(r0, p->fifth[0], r1);
        f[1] = _mm512_permutex2var_epi8(r1, p->fifth[1], r2);
    }
    legacy_levels(type, p, _mm512_permutex2var_epi8(r0, p->nibbles[0], r1), f[0], &u->lo[0], &u->hi[0]);
    legacy_levels(type, p, _mm512_permutex2var_epi8(r1, p->nibbles[1], r2), f[1], &u->lo[1], &u->hi[1]);
    __m512i halves = _mm512_or_si512(_mm512_maskz_permutex2var_epi8(0x00ff00ffULL, r0, p->halves[0], r1),
                                     _mm512_maskz_permutex2var_epi8(0xff00ff00ULL, r1, p->halves[1], r2));
    u->d8 = _mm256_cvtph_ps(_mm512_castsi512_si128(halves));
    u->off8 = type == Q4_1 || type == Q5_1
                  ? _mm256_cvtph_ps(_mm512_extracti32x4_epi32(halves, 1))
                  : _mm256_mul_ps(u->d8, _mm256_set1_ps(type == Q5_0 ? -16.0f : -8.0f));
}

/* The chunk's value for one row, as `legacy_chunk_dot` gives it (lane g: block g's), from its
 * activations in `legacy_x_layout`'s order at xc. */
static inline __attribute__((always_inline)) __m256 legacy_chunk_vbmi(int type,
                                                                      const legacy_vbmi_chunk *u,
                                                                      const int8_t *xc,
                                                                      const float *xd,
                                                                      const int16_t *bs) {
    __m512i s[2];
    for (int h = 0; h < 2; h++) {
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u->lo[h], _mm512_loadu_si512(xc + 128 * h));
        s[h] = _mm512_dpbusd_epi32(acc, u->hi[h], _mm512_loadu_si512(xc + 128 * h + 64));
    }
    /* quarters (one d each) of s[0] (blocks 0-3) and s[1] (4-7) added: lane g, block g's sum */
    __m512i v = _mm512_add_epi32(_mm512_shuffle_i64x2(s[0], s[1], 0x44),
                                 _mm512_shuffle_i64x2(s[0], s[1], 0xee));
    __m512i sums = _mm512_add_epi32(_mm512_shuffle_i64x2(v, v, 0x88), _mm512_shuffle_i64x2(v, v, 0xdd));
    return legacy_value(type, _mm512_castsi512_si256(sums), u->d8, u->off8, xd, bs);
}

/* acc[m] = row m's value of a row of a legacy weight, for `rows` rows of activations (their
 * `legacy_x_layout`s kp apart in xt), each chunk taken apart once for all of them: each row's
 * chunks add up in order, as `dot_one_legacy_of` adds them, so a row has its one-row bits. */
static inline __attribute__((always_inline)) void dot_rows_legacy_vbmi(
    int type, const legacy_perm *p, const uint8_t *row, int64_t k, int64_t rows, const int8_t *xt,
    const float *xd, const int16_t *bsum, int64_t kp, float *acc) {
    const int64_t bb = block_bytes(type);
    float sum[LEGACY_VBMI_ROWS] = {0}; /* in registers where `rows` is a constant */
    for (int64_t first = 0; first < k; first += CHUNK) {
        const uint8_t *c = row + (first >> 5) * bb;
        prefetch_ahead(c, 8 * bb);
        legacy_vbmi_chunk u;
        legacy_unpack_vbmi(type, p, c, (k - first < CHUNK ? k - first : CHUNK) / 32 * bb, &u);
        for (int64_t m = 0; m < rows; m++)
            sum[m] += hsum8(legacy_chunk_vbmi(type, &u, xt + m * kp + first, xd + m * (kp / 32) + first / 32,
                                              bsum + m * (kp / 16) + first / 16));
    }
    for (int64_t m = 0; m < rows; m++) acc[m] = sum[m];
}

/* Outputs [j0, j1) of a legacy 4- or 5-bit weight for `rows` rows of activations
 * (`dot_rows_legacy_vbmi`). */
static inline __attribute__((always_inline)) void rows_vbmi_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k, int64_t rows,
    const int8_t *xt, const float *xd, const int16_t *bsum, int64_t kp, void *out, int out_bf16,
    int64_t out_stride) {
    legacy_perm p = legacy_perm_of(type);
    for (int64_t j = j0; j < j1; j++) {
        float acc[LEGACY_VBMI_ROWS];
        if (rows == 1) /* a constant: the one-stream loop without a loop over rows */
            dot_rows_legacy_vbmi(type, &p, w + j * row_bytes, k, 1, xt, xd, bsum, kp, acc);
        else
            dot_rows_legacy_vbmi(type, &p, w + j * row_bytes, k, rows, xt, xd, bsum, kp, acc);
        for (int64_t m = 0; m < rows; m++) store_output(out, out_bf16, m * out_stride + j, acc[m]);
    }
}

static __attribute__((noinline)) void rows_vbmi(int type, const uint8_t *w, int64_t row_bytes,
                                                int64_t j0, int64_t j1, int64_t k, int64_t rows,
                                                const int8_t *xt, const float *xd,
                                                const int16_t *bsum, int64_t kp, void *out,
                                                int out_bf16, int64_t out_stride) {
#define ROWS_VBMI(t) rows_vbmi_of(t, w, row_bytes, j0, j1, k, rows, xt, xd, bsum, kp, out, out_bf16, out_stride)
    switch (type) {
    case Q4_0: ROWS_VBMI(Q4_0); break;
    case Q4_1: ROWS_VBMI(Q4_1); break;
    case Q5_0: ROWS_VBMI(Q5_0); break;
    default: ROWS_VBMI(Q5_1);
    }
#undef ROWS_VBMI
}

/* `quant_matmul` on `rows_vbmi` where it serves the step; 0 where it does not. */
static int legacy_matmul_vbmi(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                              const int8_t *xq, const float *xd, const int16_t *bsum, int64_t rows,
                              void *out, int out_bf16, int64_t out_stride, int threads) {
    if (rows > LEGACY_VBMI_ROWS || !(type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1))
        return 0;
    int64_t kp = act_stride(k);
    int8_t *xt = aligned_alloc(64, (size_t)(rows * kp));
    if (!xt) return 0;
    for (int64_t m = 0; m < rows; m++) legacy_x_layout(xq + m * kp, k, xt + m * kp);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int t = 0; t < threads; t++)
        rows_vbmi(type, w, row_bytes, n * t / threads, n * (t + 1) / threads, k, rows, xt, xd, bsum,
                  kp, out, out_bf16, out_stride);
    free(xt);
    return 1;
}
#endif

#if !defined(LEGACY_VBMI) && !defined(VNNI_GEMM)
/* Q4_0, Q5_0 and Q8_0 with each 8 rows' bytes interleaved (Q4_0_R8, Q5_0_R8, Q8_0_R8; AVX2 builds
 * without the AVX-512 kernels, which read the files' layout). Block b of rows 8i..8i+7 holds
 * the 8 rows' fp16 scales (16 bytes); Q5_0's fifth bits (32 bytes: byte 4r + c, bit j, row r's
 * weight 4j + c for j < 4, 16 + 4(j - 4) + c else); then the levels' bytes 4 (a unit) at a time,
 * unit-major: unit u of row r at 32u + 4r. One 256-bit load holds a unit of all 8 rows, a lane
 * a row, so a block's integer sums come out a lane a row (no horizontal adds, no scale gather)
 * and its float work serves 8 rows; the 4-bit formats' products add up in int16 before
 * `vpmaddwd` (at most 16 * 15 * 127, and 8 * 31 * 127). Each lane runs `legacy_value` and
 * `hsum8`'s chunk tree on its row's numbers: the bits of the other kernels. One-row products
 * on a 2-core Zen 1 (AVX2), one thread: Q4_0 4.6 -> 2.1 ns a 32 weights, Q8_0 4.8 -> 2.8. The
 * same bytes a group of rows (ggml repacks Q4_0 for AVX2 alike). */
#define ROWS8 1

static inline int is_rows8(int type) { return type == Q4_0_R8 || type == Q5_0_R8 || type == Q8_0_R8; }

/* Where the levels of a block of 8 interleaved rows start. */
static inline int rows8_levels_at(int type) { return type == Q5_0_R8 ? 48 : 16; }

/* n bytes between a file block's and an interleaved block's (either way). */
static inline void move_bytes(uint8_t *rows, uint8_t *file, int n, int to_file) {
    if (to_file) memcpy(file, rows, n);
    else memcpy(rows, file, n);
}

/* Row r's block in the file's layout (`file`) to its place in a block of 8 interleaved rows
 * (`rows`), or back where `to_file`: the one definition of the layout. */
static void rows8_block(int type, uint8_t *rows, int r, uint8_t *file, int to_file) {
    int levels = type == Q5_0_R8 ? 6 : 2; /* where the file's levels start */
    move_bytes(rows + 2 * r, file, 2, to_file);
    for (int u = 0; u < (block_bytes(type) - levels) / 4; u++)
        move_bytes(rows + rows8_levels_at(type) + 32 * u + 4 * r, file + levels + 4 * u, 4, to_file);
    if (type != Q5_0_R8) return;
    uint32_t qh = 0;
    if (!to_file) memcpy(&qh, file + 2, 4);
    for (int c = 0; c < 4; c++) {
        uint8_t *byte = rows + 16 + 4 * r + c;
        if (!to_file) *byte = 0;
        for (int j = 0; j < 8; j++) {
            int bit = j < 4 ? 4 * j + c : 16 + 4 * (j - 4) + c;
            if (to_file) qh |= (uint32_t)((*byte >> j) & 1) << bit;
            else *byte |= (uint8_t)(((qh >> bit) & 1) << j);
        }
    }
    if (to_file) memcpy(file + 2, &qh, 4);
}

/* Q5_0's fifth bits of unit-half j (0-3: low nibbles of unit j, 4-7: high of unit j - 4) as 16
 * or 0 a byte, from the interleaved fifth-bit bytes: bit j moved to bit 4 within each byte. */
static inline __m256i fifth_of(__m256i bits, int j) {
    __m256i at4 = j <= 4 ? _mm256_slli_epi16(bits, 4 - j) : _mm256_srli_epi16(bits, j - 4);
    return _mm256_and_si256(at4, _mm256_set1_epi8(16));
}

/* Block `blk` of 8 interleaved rows . R rows of activations (row r's at x + r * kp, its block's
 * scale xd[r * xd_step], 16s' level sums at bs + r * bs_step): v[r] lane j output j's
 * `legacy_value`. The levels are taken apart once for the R rows. */
static inline __attribute__((always_inline)) void block_values8(
    int type, const int R, const uint8_t *blk, const int8_t *x, int64_t kp, const float *xd,
    int64_t xd_step, const int16_t *bs, int64_t bs_step, __m256 v[2]) {
    __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk));
    __m256 off8 = _mm256_mul_ps(d8, _mm256_set1_ps(type == Q5_0_R8 ? -16.0f : -8.0f));
    const uint8_t *levels = blk + rows8_levels_at(type);
    __m256i bits = type == Q5_0_R8 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
    __m256i part[2][2]; /* [row][half of the units] */
    for (int r = 0; r < R; r++) part[r][0] = part[r][1] = _mm256_setzero_si256();
    for (int u = 0; u < (type == Q8_0_R8 ? 8 : 4); u++) { /* unit u taken apart once */
        __m256i l = _mm256_loadu_si256((const __m256i *)(levels + 32 * u));
        if (type == Q8_0_R8) {
            for (int r = 0; r < R; r++)
                part[r][u % 2] = _mm256_add_epi32(part[r][u % 2], dot_bytes(l, broadcast4(x + r * kp + 4 * u), 1));
            continue;
        }
        __m256i lo = low_nibbles(l), hi = high_nibbles(l); /* inputs 4u.., 16 + 4u.. */
        if (type == Q5_0_R8) {
            lo = _mm256_or_si256(lo, fifth_of(bits, u));
            hi = _mm256_or_si256(hi, fifth_of(bits, 4 + u));
        }
        for (int r = 0; r < R; r++) {
            const int8_t *xr = x + r * kp;
            __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xr + 4 * u)),
                                         _mm256_maddubs_epi16(hi, broadcast4(xr + 16 + 4 * u)));
            part[r][u / 2] = _mm256_add_epi16(part[r][u / 2], p);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256i ones = _mm256_set1_epi16(1); /* 4- and 5-bit parts are int16 sums */
        __m256i sums = type == Q8_0_R8 ? _mm256_add_epi32(part[r][0], part[r][1])
                                       : _mm256_add_epi32(_mm256_madd_epi16(part[r][0], ones),
                                                          _mm256_madd_epi16(part[r][1], ones));
        const int16_t *b = bs + r * bs_step;
        v[r] = legacy_scaled(rows8_base(type), sums, d8, off8, _mm256_set1_ps(xd[r * xd_step]),
                             _mm256_set1_epi32(b[0] + b[1]));
    }
}

/* The chunk of 8 interleaved rows at blk (`groups` blocks) . R rows of activations there
 * (`block_values8`'s): acc[r] + lane j output j's chunk, in `hsum8`'s tree. */
static inline __attribute__((always_inline)) void chunk_values8(
    int type, const int R, const uint8_t *blk, int groups, const int8_t *x, int64_t kp,
    const float *xd, const int16_t *bs, __m256 acc[2]) {
    __m256 v[8][2];
    for (int g = 0; g < 8; g++) {
        if (g < groups)
            block_values8(type, R, blk + 8 * g * block_bytes(type), x + 32 * g, kp, xd + g, kp / 32,
                          bs + 2 * g, kp / 16, v[g]);
        else
            v[g][0] = v[g][1] = _mm256_setzero_ps();
    }
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_add_ps(
            acc[r], _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0][r], v[4][r]), _mm256_add_ps(v[2][r], v[6][r])),
                                  _mm256_add_ps(_mm256_add_ps(v[1][r], v[5][r]), _mm256_add_ps(v[3][r], v[7][r]))));
}

/* Rows [8 i0, 8 i1) of an interleaved weight for activation rows [m0, m0 + mt), two at a time,
 * each output's chunks added in order, with `type` a constant. */
static inline __attribute__((always_inline)) void rows8_outputs_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t i0, int64_t i1, int64_t k,
    const int8_t *xq, const float *xd, const int16_t *bsum, int64_t kp, int64_t m0, int64_t mt,
    void *out, int out_bf16, int64_t out_stride) {
    int64_t group_bytes = 8 * block_bytes(type);
    for (int64_t i = i0; i < i1; i++) {
        const uint8_t *rows = w + 8 * i * row_bytes;
        __m256 acc[ROW_TILE];
        for (int64_t m = 0; m < mt; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t first = 0; first < k; first += CHUNK) {
            const uint8_t *blk = rows + (first / 32) * group_bytes;
            int groups = k - first < CHUNK ? (int)((k - first) / 32) : 8;
            prefetch_ahead(blk, groups * group_bytes);
            for (int64_t m = 0; m < mt; m += 2) {
                int64_t row = m0 + m;
                const int8_t *x = xq + row * kp + first;
                const float *x_d = xd + row * (kp / 32) + first / 32;
                const int16_t *bs = bsum + row * (kp / 16) + first / 16;
                if (mt - m >= 2)
                    chunk_values8(type, 2, blk, groups, x, kp, x_d, bs, acc + m);
                else
                    chunk_values8(type, 1, blk, groups, x, kp, x_d, bs, acc + m);
            }
        }
        for (int64_t m = 0; m < mt; m++) {
            float v[8];
            _mm256_storeu_ps(v, acc[m]);
            for (int r = 0; r < 8; r++) store_output(out, out_bf16, (m0 + m) * out_stride + 8 * i + r, v[r]);
        }
    }
}

static __attribute__((noinline)) void rows8_outputs(int type, const uint8_t *w, int64_t row_bytes,
                                                    int64_t i0, int64_t i1, int64_t k,
                                                    const int8_t *xq, const float *xd,
                                                    const int16_t *bsum, int64_t kp, int64_t m0,
                                                    int64_t mt, void *out, int out_bf16,
                                                    int64_t out_stride) {
#define ROWS8_OUTPUTS(t) rows8_outputs_of(t, w, row_bytes, i0, i1, k, xq, xd, bsum, kp, m0, mt, out, out_bf16, out_stride)
    if (type == Q4_0_R8) ROWS8_OUTPUTS(Q4_0_R8);
    else if (type == Q5_0_R8) ROWS8_OUTPUTS(Q5_0_R8);
    else ROWS8_OUTPUTS(Q8_0_R8);
#undef ROWS8_OUTPUTS
}

/* `quant_matmul` on an interleaved weight (n a multiple of 8): each thread a share of the row
 * groups, ROW_TILE activation rows at a time. */
static void rows8_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                         const int8_t *xq, const float *xd, const int16_t *bsum, int64_t rows,
                         void *out, int out_bf16, int64_t out_stride, int threads) {
    int64_t kp = act_stride(k), groups = n / 8;
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_TILE) {
        int64_t mt = rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int t = 0; t < threads; t++)
            rows8_outputs(type, w, row_bytes, groups * t / threads, groups * (t + 1) / threads, k,
                          xq, xd, bsum, kp, m0, mt, out, out_bf16, out_stride);
    }
}

/* The file's bytes of row r of the 8 interleaved rows at `rows` into `row` (row_bytes). */
static void row_of_rows8(int type, const uint8_t *rows, int64_t row_bytes, int r, uint8_t *row) {
    int64_t bb = block_bytes(type);
    for (int64_t b = 0; b < row_bytes / bb; b++)
        rows8_block(type, (uint8_t *)rows + 8 * b * bb, r, row + b * bb, 1);
}

/* In place: w [n][row_bytes] of Q4_0, Q5_0 or Q8_0 (n a multiple of 8) to its interleaved type
 * `type`, a group of 8 rows at a time through a copy of theirs. */
void interleave_rows8(int type, uint8_t *w, int64_t n, int64_t row_bytes, int threads) {
    int64_t bb = block_bytes(type);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint8_t *copy = malloc(8 * row_bytes);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n / 8; i++) {
            uint8_t *rows = w + 8 * i * row_bytes;
            memcpy(copy, rows, 8 * row_bytes);
            memset(rows, 0, 8 * row_bytes);
            for (int r = 0; r < 8; r++)
                for (int64_t b = 0; b < row_bytes / bb; b++)
                    rows8_block(type, rows + 8 * b * bb, r, copy + r * row_bytes + b * bb, 0);
        }
        free(copy);
    }
}
#endif

/* Outputs [j0, j1) of a weight for one row of activations, in one loop compiled for `type` (a
 * one-stream step is bound by this loop's instructions). */
static inline __attribute__((always_inline)) void row_outputs_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k,
    const int8_t *x, const float *xd, const int16_t *bsum, void *out, int out_bf16) {
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * row_bytes;
        float v = is_superblock(type) ? dot_one_k_of(type, row, k, x, xd, bsum)
                               : dot_one_legacy_of(type, row, k, x, xd, bsum);
        store_output(out, out_bf16, j, v);
    }
}

static __attribute__((noinline)) void row_outputs(int type, const uint8_t *w, int64_t row_bytes,
                                                  int64_t j0, int64_t j1, int64_t k,
                                                  const int8_t *x, const float *xd,
                                                  const int16_t *bsum, void *out, int out_bf16) {
    switch (type) {
    case Q2_K: row_outputs_of(Q2_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q3_K: row_outputs_of(Q3_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q4_K: row_outputs_of(Q4_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q5_K: row_outputs_of(Q5_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q6_K: row_outputs_of(Q6_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q8_256: row_outputs_of(Q8_256, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q4_0: row_outputs_of(Q4_0, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q8_0: row_outputs_of(Q8_0, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    default: row_outputs_of(type, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16);
    }
}
#else
typedef struct { float v[8]; } acc_t;

static void dot_rows(int type, const chunk *c, const int8_t *xq, const float *xd,
                     const int16_t *bsum, int64_t kp, int64_t rows, acc_t *acc) {
    (void)type;
    for (int64_t m = 0; m < rows; m++) {
        const int8_t *x = xq + m * kp;
        float s = 0.0f;
        for (int g = 0; g < 2 * c->groups; g++) {
            int sum = 0;
            for (int i = 16 * g; i < 16 * g + 16; i++)
                sum += (c->is_signed ? (int8_t)c->q[i] : c->q[i]) * x[i];
            float d = xd[m * (kp / 32) + g / 2];
            s += c->s.a[g] * d * sum + c->s.b[g] * (d * bsum[m * (kp / 16) + g]);
        }
        acc[m].v[0] += s;
    }
}

static inline float hsum8(acc_t v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v.v[i];
    return s;
}

static inline float acc_value(acc_t v) { return hsum8(v); }
#endif

/* acc[jj][m] += weight row j0 + jj . activation row m, for jj < nj and m < rows (up to
 * OUT_TILE and ROW_TILE), a chunk of 256 inputs at a time for all nj weight rows, with `type` a
 * constant where it is a K-quant. */
static inline __attribute__((always_inline)) void tile_outputs_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t nj, int64_t k,
    const int8_t *xq, const float *xd, const int16_t *bsum, int64_t kp,
    int64_t rows, acc_t acc[OUT_TILE][ROW_TILE]) {
    for (int64_t first = 0; first < k; first += CHUNK)
        for (int64_t jj = 0; jj < nj; jj++) {
            const uint8_t *row = w + (j0 + jj) * row_bytes;
#ifdef QUANT_AVX2
            if (is_superblock(type)) {
                dot_rows_k(type, row + (first >> 8) * block_bytes(type), xq + first,
                           xd + first / 32, bsum + first / 16, kp, rows, acc[jj]);
                continue;
            }
#endif
            kernel_chunk c;
            unpack_kernel_chunk(type, row, first, k - first < CHUNK ? k - first : CHUNK, &c);
            dot_rows(type, &c, xq + first, xd + first / 32, bsum + first / 16, kp, rows, acc[jj]);
        }
}

static __attribute__((noinline)) void tile_outputs(int type, const uint8_t *w, int64_t row_bytes,
                                                   int64_t j0, int64_t nj, int64_t k,
                                                   const int8_t *xq, const float *xd,
                                                   const int16_t *bsum,
                                                   int64_t kp, int64_t rows,
                                                   acc_t acc[OUT_TILE][ROW_TILE]) {
    if (type == Q2_K)
        tile_outputs_of(Q2_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q3_K)
        tile_outputs_of(Q3_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q4_K)
        tile_outputs_of(Q4_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q5_K)
        tile_outputs_of(Q5_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q6_K)
        tile_outputs_of(Q6_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q8_256)
        tile_outputs_of(Q8_256, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q4_0)
        tile_outputs_of(Q4_0, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q8_0)
        tile_outputs_of(Q8_0, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else
        tile_outputs_of(type, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
}

/* out [rows][n] (rows `out_stride` apart; fp32, or bf16 where `out_bf16`) = activations (from
 * `quantize_activations`, in blocks of 256 for the K-quants and 32 for the others) times the
 * weight w [n][row_bytes] of `type`, k inputs a row (Q8_256_VNNI: VNNI builds only, every step
 * on the VNNI GEMM; with the ROW_SCALES bit, one scale a row of w and of x, which AMX tiles
 * then sum through all of k). `threads` threads split the outputs; each
 * unpacks a chunk of a weight row once for up to ROW_TILE rows, so at a few rows the step
 * streams the weight from memory once. */
void quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                  const int8_t *xq, const float *xd, const int16_t *bsum,
                  int64_t rows, void *out, int out_bf16, int64_t out_stride, int threads) {
    int64_t kp = act_stride(k);
#ifdef VNNI_GEMM
    int row_scales = (type & ROW_SCALES) != 0; /* only the VNNI GEMM tells them apart */
#endif
    type &= ~ROW_SCALES;
#ifdef LEGACY_VBMI
    if (legacy_matmul_vbmi(type, w, n, k, row_bytes, xq, xd, bsum, rows, out, out_bf16, out_stride,
                           threads))
        return;
#endif
#ifdef VNNI_GEMM
    if ((type == Q8_256_VNNI || (rows >= VNNI_MIN_ROWS && n % 32 == 0 && (!is_superblock(type) || k % CHUNK == 0))) &&
        vnni_matmul(type, row_scales, w, n, k, row_bytes, xq, xd, bsum, rows, out, out_bf16,
                    out_stride, threads))
        return;
#endif
#ifdef AVX2_GEMM
    if (rows >= AVX2_MIN_ROWS && type >= Q2_K && type <= Q6_K && n % 16 == 0 && k % CHUNK == 0 &&
        avx2_matmul(type, w, n, k, row_bytes, xq, xd, bsum, rows, out, out_bf16, out_stride, threads))
        return;
#endif
#ifdef ROWS8
    if (is_rows8(type)) {
        rows8_matmul(type, w, n, k, row_bytes, xq, xd, bsum, rows, out, out_bf16, out_stride, threads);
        return;
    }
#endif
#ifdef QUANT_AVX2
    if (rows == 1) { /* each thread's outputs in one call */
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int t = 0; t < threads; t++)
            row_outputs(type, w, row_bytes, n * t / threads, n * (t + 1) / threads, k, xq, xd,
                        bsum, out, out_bf16);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_TILE) {
        int64_t mt = rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t j0 = 0; j0 < n; j0 += OUT_TILE) {
            int64_t nj = n - j0 < OUT_TILE ? n - j0 : OUT_TILE;
            acc_t acc[OUT_TILE][ROW_TILE];
            for (int64_t jj = 0; jj < nj; jj++) memset(acc[jj], 0, mt * sizeof(acc_t));
            tile_outputs(type, w, row_bytes, j0, nj, k, xq + m0 * kp, xd + m0 * (kp / 32),
                         bsum + m0 * (kp / 16), kp, mt, acc);
            for (int64_t jj = 0; jj < nj; jj++)
                for (int64_t m = 0; m < mt; m++)
                    store_output(out, out_bf16, (m0 + m) * out_stride + j0 + jj,
                                 acc_value(acc[jj][m]));
        }
    }
}

/* Rows `ids` (or, with ids NULL, rows 0..count-1) of the weight w [.][row_bytes] of `type`, k
 * weights a row, dequantized into out [count][k] (fp32). */
void dequantize_rows(int type, const uint8_t *w, int64_t k, int64_t row_bytes, const int64_t *ids,
                     int64_t count, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && count * k >= 65536)
    for (int64_t r = 0; r < count; r++) {
        chunk c;
        int64_t id = ids ? ids[r] : r;
        const uint8_t *row = w + id * row_bytes;
#ifdef ROWS8
        uint8_t file_row[is_rows8(type) ? row_bytes : 1];
        if (is_rows8(type)) {
            row_of_rows8(type, w + (id - id % 8) * row_bytes, row_bytes, (int)(id % 8), file_row);
            row = file_row;
        }
#endif
        for (int64_t first = 0; first < k; first += CHUNK) {
            int64_t count_here = k - first < CHUNK ? k - first : CHUNK;
            unpack_chunk(rows8_base(type), row, first, count_here, &c);
            float *o = out + r * k + first;
            for (int i = 0; i < count_here; i++) {
                float level = c.is_signed ? (float)(int8_t)c.q[i] : (float)c.q[i];
                o[i] = c.s.a[i / 16] * level + c.s.b[i / 16];
            }
        }
    }
}
