/* Products with weights kept in GGUF's block formats (see `paged_backend.cpu.quant`): Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and Q4_K, Q5_K, Q6_K (super-blocks of 256), as ggml lays
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
 * A chunk of 256 weights is unpacked once for all rows of a step, so a batch reuses it from
 * registers and L1; with AVX512-VNNI, steps of a few rows on unpack a strip of outputs once
 * into a layout for `vpdpbusd` (see VNNI_GEMM). Without AVX2 a scalar loop computes the same
 * sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

#define CHUNK 256       /* weights unpacked at a time: a K-quant super-block, or 8 blocks of 32 */
#define ROW_TILE 32     /* activation rows served by one unpacking of a chunk */
#define OUT_TILE 8      /* weight rows a thread takes side by side: a chunk of the activations,
                           up to ROW_TILE rows of 256 bytes, is read from L1 for all of them */

/* weight = a[g] * level + b[g] for the 16 weights of group g of a chunk */
typedef struct {
    float a[CHUNK / 16], b[CHUNK / 16];
} group_scales;

typedef struct {
    uint8_t q[CHUNK]; /* levels; Q8_0: signed bytes */
    group_scales s;
    int groups;       /* groups of 32 weights in this chunk (1..8) */
    int is_signed;
} chunk;

static inline void set_pair(group_scales *s, int g32, float a, float b) {
    s->a[2 * g32] = s->a[2 * g32 + 1] = a;
    s->b[2 * g32] = s->b[2 * g32 + 1] = b;
}

/* A legacy block's scale and offset into group `g` (a, b: weight = a * level + b). */
static void block32_scales(int type, const uint8_t *blk, group_scales *s, int g) {
    float d = f16_to_f32(blk);
    if (type == Q4_1 || type == Q5_1)
        set_pair(s, g, d, f16_to_f32(blk + 2));
    else
        set_pair(s, g, d, type == Q8_0 ? 0.0f : (type == Q5_0 ? -16.0f : -8.0f) * d);
}

/* The offset of a legacy block's nibbles, and of its fifth bits (Q5_0, Q5_1). */
static inline int nibbles_at(int type) { return type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8; }

static inline int fifth_bits_at(int type) { return type == Q5_0 ? 2 : 4; }

/* Q4_K / Q5_K: the j-th 6-bit scale and min of a super-block (ggml's get_scale_min_k4). */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* A K-quant super-block's 16 group scales and offsets. */
static void superblock_scales(int type, const uint8_t *blk, group_scales *s) {
    if (type == Q6_K) {
        const int8_t *scales = (const int8_t *)(blk + 192);
        float d = f16_to_f32(blk + 208);
        for (int g = 0; g < 16; g++) {
            s->a[g] = d * scales[g];
            s->b[g] = -32.0f * s->a[g];
        }
        return;
    }
    float d = f16_to_f32(blk), dmin = f16_to_f32(blk + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(j, blk + 4, &sc, &m);
        set_pair(s, j, d * sc, -dmin * m);
    }
}

/* The levels of a legacy block into q[32]. */
static void block32_levels(int type, const uint8_t *blk, uint8_t *q) {
    if (type == Q8_0) {
        memcpy(q, blk + 2, 32);
        return;
    }
    const uint8_t *p = blk + nibbles_at(type);
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) memcpy(&qh, blk + fifth_bits_at(type), 4);
    for (int i = 0; i < 16; i++) {
        q[i] = (p[i] & 15) | (((qh >> i) & 1) << 4);
        q[i + 16] = (p[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
}

/* The levels of a Q4_K / Q5_K / Q6_K super-block into q[256]. */
static void superblock_levels(int type, const uint8_t *blk, uint8_t *q) {
    if (type == Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *l8 = blk + 64 * h, *h8 = blk + 128 + 32 * h;
            uint8_t *o = q + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (l8[l] & 15) | ((h8[l] & 3) << 4);
                o[l + 32] = (l8[l + 32] & 15) | (((h8[l] >> 2) & 3) << 4);
                o[l + 64] = (l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4);
                o[l + 96] = (l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4);
            }
        }
        return;
    }
    const uint8_t *qh = blk + 16, *qs = blk + (type == Q5_K ? 48 : 16);
    for (int i = 0; i < 4; i++) {
        int five = type == Q5_K;
        for (int l = 0; l < 32; l++) {
            q[64 * i + l] = (qs[32 * i + l] & 15) | (five * ((qh[l] >> (2 * i)) & 1) << 4);
            q[64 * i + l + 32] = (qs[32 * i + l] >> 4) | (five * ((qh[l] >> (2 * i + 1)) & 1) << 4);
        }
    }
}

/* Weights [first, first + count) of a row (first a multiple of 256, count <= 256 and a multiple
 * of the block) into `c`; groups past `count` weigh nothing. */
static inline __attribute__((always_inline)) void unpack_chunk(int type, const uint8_t *row,
                                                               int64_t first, int64_t count,
                                                               chunk *c) {
    const uint8_t *blk = row + (first >> (type >= Q4_K ? 8 : 5)) * block_bytes(type); /* no division */
    c->groups = (int)(count / 32);
    c->is_signed = type == Q8_0;
    memset(&c->s, 0, sizeof c->s);
    if (type >= Q4_K) {
        superblock_levels(type, blk, c->q);
        superblock_scales(type, blk, &c->s);
        return;
    }
    for (int g = 0; g < c->groups; g++) {
        block32_levels(type, blk + g * block_bytes(type), c->q + 32 * g);
        block32_scales(type, blk + g * block_bytes(type), &c->s, g);
    }
}

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
    for (; i + 16 <= block; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    amax = _mm512_reduce_max_ps(m);
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
 * `block` (32, or 256 for the K-quants: one scale a super-block, as llama.cpp's Q8_K): xq
 * [rows][kp] (kp = `act_stride(k)`, zero past k), xd [rows][kp/32] the scale of each 32 (its
 * block's) and bsum [rows][kp/16] each 16's level sum.
 * Levels round to nearest even, as `vcvtps2dq` does (with AVX-512, 16 values at a time: the
 * scalar loop took ~2 ns a value, a tenth of a 256-row product of a 2048 x 2048 Q4_K weight). */
void quantize_activations(const void *x, int x_bf16, int64_t rows, int64_t k, int64_t x_stride,
                          int64_t block, int8_t *xq, float *xd, int16_t *bsum, int threads) {
    int64_t kp = act_stride(k);
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * k >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float v[CHUNK];
        int8_t *q = xq + r * kp;
        for (int64_t b = 0; b < kp / block; b++) {
            int64_t first = block * b, n = k - first < block ? (k - first > 0 ? k - first : 0) : block;
            block_values(x, x_bf16, r * x_stride + first, n, block, v);
            float amax = block_amax(v, block);
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int64_t i = 0; i < block; i += 16)
                bsum[r * (kp / 16) + (first + i) / 16] = (int16_t)levels16(v + i, inv, q + first + i);
            for (int64_t i = 0; i < block; i += 32) xd[r * (kp / 32) + (first + i) / 32] = d;
        }
    }
}

/* out[at] = v, fp32, or bf16 rounded to nearest even where `out_bf16`. */
static inline void store_output(void *out, int out_bf16, int64_t at, float v) {
    if (out_bf16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        ((uint16_t *)out)[at] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else {
        ((float *)out)[at] = v;
    }
}

#ifdef QUANT_AVX2
typedef __m256 acc_t; /* a row's running sums, 8 lanes */

/* A chunk of a legacy format in registers: each block's 32 levels, and the blocks' scales and
 * offsets (lane g: block g's; 0 past the row's end). */
typedef struct {
    __m256i q[CHUNK / 32];
    __m256 d8, off8;
    int groups, is_signed;
} kernel_chunk;

static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }

static inline __m256i high_nibbles(__m256i v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }

/* A legacy block's 16 bytes of nibbles: low nibbles (weights 0-15), then high (16-31). */
static inline __m256i nibbles16(const uint8_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* Byte i: 16 where bit i of the 32 bits at p is set, else 0 (Q5_0/Q5_1's fifth bits). */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    __m256i spread = _mm256_shuffle_epi8( /* byte i holds byte i / 8 of the bits */
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    __m256i select = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
    __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* Q5_K's fifth bits of group g (0..7): bit g of each of its 32 bytes, as 16 or 0. */
static inline __m256i q5k_bits(__m256i qh, int g) {
    __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, g), _mm256_set1_epi8(1));
    return _mm256_slli_epi16(bit, 4);
}

/* Q6_K's two high bits at `shift` of each of 32 bytes, moved to bits 4-5. */
static inline __m256i q6k_bits(__m256i qh, int shift) {
    __m256i bits = shift >= 4 ? _mm256_srli_epi16(qh, shift - 4) : _mm256_slli_epi16(qh, 4 - shift);
    return _mm256_and_si256(bits, _mm256_set1_epi8(48));
}

/* Level register g (0..7: weights 32g..32g+31) of a K-quant super-block. With `type` a constant
 * and g unrolled, the loads shared by two or four registers are made once. */
static inline __attribute__((always_inline)) __m256i k_level(int type, const uint8_t *blk, int g) {
    if (type == Q6_K) { /* halves of 128: low nibbles of l0, l1, then high nibbles; 2 bits from qh */
        int h = g / 4, j = g % 4;
        __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (j % 2)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        return _mm256_or_si256(j < 2 ? low_nibbles(l) : high_nibbles(l), q6k_bits(qh, 2 * j));
    }
    __m256i p = _mm256_loadu_si256((const __m256i *)(blk + (type == Q5_K ? 48 : 16) + 32 * (g / 2)));
    __m256i q = g % 2 ? high_nibbles(p) : low_nibbles(p);
    if (type == Q5_K) q = _mm256_or_si256(q, q5k_bits(_mm256_loadu_si256((const __m256i *)(blk + 16)), g));
    return q;
}

static inline short half_bits(const uint8_t *p) {
    short h;
    memcpy(&h, p, 2);
    return h;
}

/* The fp16 bits at `at` bytes into each of a chunk's first `groups` blocks (0 past them), as one
 * vector: built in registers (eight 2-byte stores read back as one 16-byte load stalled the
 * one-row loop: Q4_0 8.9 -> 5.9 ns a chunk, two threads). */
static inline __attribute__((always_inline)) __m128i block_halves(const uint8_t *blk, int64_t bytes,
                                                                  int at, int groups) {
#define HALF(g) (g < groups ? half_bits(blk + (g) * bytes + at) : 0)
    return _mm_setr_epi16(HALF(0), HALF(1), HALF(2), HALF(3), HALF(4), HALF(5), HALF(6), HALF(7));
#undef HALF
}

/* A chunk of a legacy format's row (8 blocks of 32, fewer at the row's end). */
static inline __attribute__((always_inline)) void unpack_kernel_chunk(
    int type, const uint8_t *row, int64_t first, int64_t count, kernel_chunk *c) {
    const uint8_t *blk = row + (first >> 5) * block_bytes(type); /* no division */
    c->groups = (int)(count / 32);
    c->is_signed = type == Q8_0;
    for (int g = 0; g < c->groups; g++) {
        const uint8_t *b = blk + g * block_bytes(type);
        if (type == Q8_0) {
            c->q[g] = _mm256_loadu_si256((const __m256i *)(b + 2));
        } else {
            c->q[g] = nibbles16(b + nibbles_at(type));
            if (type == Q5_0 || type == Q5_1)
                c->q[g] = _mm256_or_si256(c->q[g], fifth_bits(b + fifth_bits_at(type)));
        }
    }
    int with_min = type == Q4_1 || type == Q5_1;
    __m128i d, m = _mm_setzero_si128();
    if (c->groups == 8) { /* whole chunks: the count a constant */
        d = block_halves(blk, block_bytes(type), 0, 8);
        if (with_min) m = block_halves(blk, block_bytes(type), 2, 8);
    } else {
        d = block_halves(blk, block_bytes(type), 0, c->groups);
        if (with_min) m = block_halves(blk, block_bytes(type), 2, c->groups);
    }
    c->d8 = _mm256_cvtph_ps(d);
    c->off8 = with_min ? _mm256_cvtph_ps(m)
                       : _mm256_mul_ps(c->d8, _mm256_set1_ps(type == Q8_0   ? 0.0f
                                                             : type == Q5_0 ? -16.0f
                                                                            : -8.0f));
}

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
    __m256 xd8 = _mm256_loadu_ps(xd);
    __m256 sum = _mm256_mul_ps(_mm256_cvtepi32_ps(lane_sums8(p)), _mm256_mul_ps(c->d8, xd8));
    if (type == Q8_0) return sum;
    __m256i levels = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)bs), _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(c->off8, _mm256_mul_ps(_mm256_cvtepi32_ps(levels), xd8), sum);
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

/* A K-quant super-block's integer scales, which each group's products are weighted by before
 * anything is converted to float. Q4_K / Q5_K: w = d * sc_j * q - dmin * m_j (per 32); Q6_K:
 * w = d * sc_g * (q - 32) (per 16). So with one activation scale xd a super-block,
 *   dot = isum * (d * xd) - msum * (mfac * xd),
 * isum = sum_g sc_g (q . x)_g and msum = sum_16 mv_16 * bsum_16 exact integers, mfac = dmin
 * (mv: the mins) or 32 d (mv: the scales). Every kernel (one row, a tile of rows, the VNNI GEMM)
 * adds a row's super-blocks in this one float sequence (`k_add`), in order, so that an output
 * has the same bits whatever kernel and batch computed it. */
typedef struct {
    __m256i lo, hi; /* int16 scales in both 128-bit halves: Q6_K's 0-7 and 8-15; the others' 8 */
    __m256i mv;     /* int16 per 16 weights */
    __m128 dm;      /* d, then mfac */
} k_header;

/* A shuffle that spreads int16 lane `lo` of a 128-bit half over the low half and lane `hi` over
 * the high half. */
static inline __m256i spread_lanes(int lo, int hi) {
    return _mm256_blend_epi32(_mm256_set1_epi16((int16_t)(((2 * lo + 1) << 8) | (2 * lo))),
                              _mm256_set1_epi16((int16_t)(((2 * hi + 1) << 8) | (2 * hi))), 0xf0);
}

static inline __attribute__((always_inline)) void k_header_of(int type, const uint8_t *blk,
                                                              k_header *h) {
    if (type == Q6_K) {
        __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        h->lo = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8));
        h->hi = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)));
        h->mv = _mm256_cvtepi8_epi16(sc8);
        uint16_t d;
        memcpy(&d, blk + 208, 2);
        __m128 d4 = _mm_cvtph_ps(_mm_set1_epi16((short)d));
        h->dm = _mm_mul_ps(d4, _mm_setr_ps(1.0f, 32.0f, 1.0f, 32.0f));
        return;
    }
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    uint64_t sc = (w[0] & 0x3f3f3f3fu) |
                  (uint64_t)((w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4)) << 32;
    uint64_t mins = (w[1] & 0x3f3f3f3fu) |
                    (uint64_t)(((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)) << 32;
    h->lo = h->hi = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)sc)));
    __m128i doubled = _mm_shuffle_epi8(_mm_cvtsi64_si128((int64_t)mins),
                                       _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    h->mv = _mm256_cvtepu8_epi16(doubled);
    uint32_t dm;
    memcpy(&dm, blk, 4);
    h->dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
}

/* The scales of level register g: int16 lanes 0-7 weigh its first 16 weights, 8-15 the next. */
static inline __attribute__((always_inline)) __m256i k_scale(int type, const k_header *h, int g) {
    if (type == Q6_K) return _mm256_shuffle_epi8(g < 4 ? h->lo : h->hi, spread_lanes(2 * g % 8, (2 * g + 1) % 8));
    return _mm256_shuffle_epi8(h->lo, spread_lanes(g, g));
}

/* Level register g's products with the activations x (32 bytes), weighted by its scales. */
static inline __attribute__((always_inline)) __m256i k_group_dot(__m256i q, __m256i scale,
                                                                 const int8_t *x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)x)), scale);
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
            part[g % 2] = _mm256_add_epi32(part[g % 2], k_group_dot(c.q[g], c.sc[g], x + 32 * g));
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
                part[g % 2], k_group_dot(k_level(type, row, g), k_scale(type, &h, g), x + first + 32 * g));
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

/* Outputs [j0, j1) of a weight for one row of activations, in one loop compiled for `type` (a
 * one-stream step is bound by this loop's instructions). */
static inline __attribute__((always_inline)) void row_outputs_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t j1, int64_t k,
    const int8_t *x, const float *xd, const int16_t *bsum, void *out, int out_bf16) {
    for (int64_t j = j0; j < j1; j++) {
        const uint8_t *row = w + j * row_bytes;
        float v = type >= Q4_K ? dot_one_k_of(type, row, k, x, xd, bsum)
                               : dot_one_legacy_of(type, row, k, x, xd, bsum);
        store_output(out, out_bf16, j, v);
    }
}

static __attribute__((noinline)) void row_outputs(int type, const uint8_t *w, int64_t row_bytes,
                                                  int64_t j0, int64_t j1, int64_t k,
                                                  const int8_t *x, const float *xd,
                                                  const int16_t *bsum, void *out, int out_bf16) {
    switch (type) {
    case Q4_K: row_outputs_of(Q4_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q5_K: row_outputs_of(Q5_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q6_K: row_outputs_of(Q6_K, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q4_0: row_outputs_of(Q4_0, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    case Q8_0: row_outputs_of(Q8_0, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16); break;
    default: row_outputs_of(type, w, row_bytes, j0, j1, k, x, xd, bsum, out, out_bf16);
    }
}
#else
typedef struct { float v[8]; } acc_t;
typedef chunk kernel_chunk;
#define unpack_kernel_chunk unpack_chunk

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
            if (type >= Q4_K) {
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
    if (type == Q4_K)
        tile_outputs_of(Q4_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q5_K)
        tile_outputs_of(Q5_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q6_K)
        tile_outputs_of(Q6_K, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q4_0)
        tile_outputs_of(Q4_0, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else if (type == Q8_0)
        tile_outputs_of(Q8_0, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
    else
        tile_outputs_of(type, w, row_bytes, j0, nj, k, xq, xd, bsum, kp, rows, acc);
}

#ifdef __AVX512F__
/* r[i][j] <- r[j][i] for a 16 x 16 block of 32-bit lanes, in registers: 64 shuffles, against a
 * gather a row (of 16 loads). */
static inline __attribute__((always_inline)) void transpose16x16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif

#if defined(QUANT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Steps of at least VNNI_MIN_ROWS rows run a GEMM on the VNNI units: each thread unpacks a
 * strip of 32 outputs (all inputs) into the layout below, a buffer its L2 holds, and runs every
 * row through it, VNNI_ROWS rows at a time (2 for the legacy formats). `vpdpbusd` multiplies 4
 * levels of 16 outputs by 4 broadcast activation bytes and adds them into 16 int32 lanes, so a
 * group's exact integer products come in 4 instructions a 16 inputs, against 2 (`vpmaddubsw` +
 * `vpmaddwd`) a 32 inputs of one output in the other kernels. The float work then follows the
 * one-row kernel's sequence (`k_add`; `dot_rows`' chunk tree), so a row has the same bits in
 * any step. */
#define VNNI_GEMM 1
#define VNNI_MIN_ROWS 4
#define VNNI_ROWS 4

/* A strip of 32 outputs (blocks b = 0, 1 of 16) of a K-quant weight, k inputs:
 * - levels: inputs 4q..4q+3 of block b at levels + (2q + b) * 64, output-major (16 x 4 bytes);
 * - scale: group g's (of 32 inputs, 16 for Q6_K) int32 scales at scale + (2g + b) * 16;
 * - mv: super-block s's 16s' offset weights, int16 pairs h (16s 2h, 2h + 1) of 16 outputs at
 *   mv + ((8s + h) * 2 + b) * 32;
 * - dm: super-block s's d at dm + (4s + b) * 16, mfac at dm + (4s + 2 + b) * 16. */
typedef struct {
    uint8_t *levels;
    int32_t *scale;
    int16_t *mv;
    float *dm;
} vnni_strip;

static inline int k_groups(int type) { return type == Q6_K ? 16 : 8; }

/* The strip's bytes for k inputs (each part 64-byte aligned). */
static inline int64_t vnni_strip_bytes(int64_t k) { return 32 * k + 8 * k + 4 * k + k + 4 * 64; }

static vnni_strip vnni_strip_at(uint8_t *buf, int64_t k) {
    vnni_strip s;
    s.levels = buf;
    s.scale = (int32_t *)(buf + 32 * k);
    s.mv = (int16_t *)(buf + 40 * k);
    s.dm = (float *)(buf + 44 * k);
    return s;
}

/* A row's super-block header as 16 int32 lanes: Q6_K's 16 scales; Q4_K / Q5_K's 8 scales, then
 * their 8 mins (`k_header_of`'s bits); its d and mfac into dm. */
static inline __attribute__((always_inline)) __m512i vnni_row_header(int type, const uint8_t *blk,
                                                                     float *d, float *mfac) {
    if (type == Q6_K) {
        *d = f16_to_f32(blk + 208);
        *mfac = *d * 32.0f;
        return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
    }
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    uint64_t sc = (w[0] & 0x3f3f3f3fu) |
                  (uint64_t)((w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4)) << 32;
    uint64_t mins = (w[1] & 0x3f3f3f3fu) |
                    (uint64_t)(((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)) << 32;
    *d = f16_to_f32(blk);
    *mfac = f16_to_f32(blk + 2);
    return _mm512_cvtepu8_epi32(_mm_set_epi64x((int64_t)mins, (int64_t)sc));
}

/* 16 rows' headers (r[j]: row j's `vnni_row_header`) of super-block sb into block b of the
 * strip: transposed, lane j of each vector is output j. */
static inline __attribute__((always_inline)) void vnni_scales(int type, __m512i r[16],
                                                              const vnni_strip *s, int64_t sb,
                                                              int b) {
    transpose16x16(r); /* r[g]: group g's scales of the 16 outputs */
    int groups = k_groups(type);
    for (int g = 0; g < groups; g++)
        _mm512_store_si512(s->scale + ((sb * groups + g) * 2 + b) * 16, r[g]);
    for (int h = 0; h < 8; h++) { /* the int16 pair of 16s 2h, 2h + 1 */
        __m512i lo = type == Q6_K ? r[2 * h] : r[8 + h], hi = type == Q6_K ? r[2 * h + 1] : r[8 + h];
        __m512i pair = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)),
                                       _mm512_slli_epi32(hi, 16));
        _mm512_store_si512(s->mv + ((8 * sb + h) * 2 + b) * 32, pair);
    }
}

/* Weight rows [j0, j0 + 32) into the strip: each super-block's levels of 16 rows (8 registers a
 * row, `k_level`) and their headers, then 16 x 16 int32 transposes make each 4 inputs' (and
 * each group's) 16 outputs adjacent. */
static inline __attribute__((always_inline)) void vnni_pack_of(int type, const uint8_t *w,
                                                               int64_t row_bytes, int64_t j0,
                                                               int64_t k, const vnni_strip *s) {
    uint8_t levels[16][CHUNK] __attribute__((aligned(64)));
    for (int64_t sb = 0; sb < k / CHUNK; sb++)
        for (int b = 0; b < 2; b++) {
            __m512i r[16];
            float *dm = s->dm + 64 * sb + 16 * b;
            for (int j = 0; j < 16; j++) {
                const uint8_t *blk = w + (j0 + 16 * b + j) * row_bytes + sb * block_bytes(type);
                for (int g = 0; g < 8; g++)
                    _mm256_store_si256((__m256i *)(levels[j] + 32 * g), k_level(type, blk, g));
                r[j] = vnni_row_header(type, blk, dm + j, dm + 32 + j);
            }
            vnni_scales(type, r, s, sb, b);
            for (int seg = 0; seg < 4; seg++) {
                for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512(levels[j] + 64 * seg);
                transpose16x16(r);
                for (int p = 0; p < 16; p++)
                    _mm512_store_si512(s->levels + ((sb * 64 + seg * 16 + p) * 2 + b) * 64, r[p]);
            }
        }
}

static __attribute__((noinline)) void vnni_pack(int type, const uint8_t *w, int64_t row_bytes,
                                                int64_t j0, int64_t k, const vnni_strip *s) {
    switch (type) {
    case Q4_K: vnni_pack_of(Q4_K, w, row_bytes, j0, k, s); break;
    case Q5_K: vnni_pack_of(Q5_K, w, row_bytes, j0, k, s); break;
    default: vnni_pack_of(Q6_K, w, row_bytes, j0, k, s);
    }
}

/* a * b rounded on its own: GCC's `_mm512_mul_ps` is a plain vector product, which it would
 * contract with the subtraction into one fused (differently rounded) operation. */
static inline __m512 product(__m512 a, __m512 b) {
    return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* out[r][0..32) = rows r < R of the activations times the strip, super-block by super-block in
 * `k_add`'s float sequence; groups of 32 inputs (16 for Q6_K: `groups` 16). */
static inline __attribute__((always_inline)) void vnni_tile_of(
    const int groups, const int R, const vnni_strip *s, int64_t k, const int8_t *xq,
    const float *xd, const int16_t *bsum, int64_t kp, float out[VNNI_ROWS][32]) {
    const int quads = CHUNK / 4 / groups; /* 4-input steps a group */
    __m512 acc[VNNI_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < k / CHUNK; sb++) {
        __m512i isum[VNNI_ROWS][2], t[VNNI_ROWS][2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        for (int g = 0; g < groups; g++) {
            const uint8_t *lv = s->levels + (sb * 64 + g * quads) * 128;
            const int8_t *x = xq + sb * CHUNK + g * 4 * quads;
            for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
            for (int q = 0; q < quads; q++) {
                __m512i w0 = _mm512_load_si512(lv + 128 * q), w1 = _mm512_load_si512(lv + 128 * q + 64);
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, x + r * kp + 4 * q, 4);
                    __m512i a = _mm512_set1_epi32(four);
                    t[r][0] = _mm512_dpbusd_epi32(t[r][0], w0, a);
                    t[r][1] = _mm512_dpbusd_epi32(t[r][1], w1, a);
                }
            }
            const int32_t *sc = s->scale + (sb * groups + g) * 32;
            __m512i sc0 = _mm512_load_si512(sc), sc1 = _mm512_load_si512(sc + 16);
            for (int r = 0; r < R; r++) {
                isum[r][0] = _mm512_add_epi32(isum[r][0], _mm512_mullo_epi32(t[r][0], sc0));
                isum[r][1] = _mm512_add_epi32(isum[r][1], _mm512_mullo_epi32(t[r][1], sc1));
            }
        }
        for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
        for (int h = 0; h < 8; h++) {
            const int16_t *mv = s->mv + (8 * sb + h) * 64;
            __m512i mv0 = _mm512_load_si512(mv), mv1 = _mm512_load_si512(mv + 32);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, bsum + r * (kp / 16) + sb * 16 + 2 * h, 4);
                __m512i bb = _mm512_set1_epi32(pair);
                t[r][0] = _mm512_dpwssd_epi32(t[r][0], mv0, bb);
                t[r][1] = _mm512_dpwssd_epi32(t[r][1], mv1, bb);
            }
        }
        const float *dm = s->dm + 64 * sb;
        for (int r = 0; r < R; r++) {
            __m512 xs = _mm512_set1_ps(xd[r * (kp / 32) + sb * 8]);
            for (int b = 0; b < 2; b++) {
                __m512 dd = _mm512_mul_ps(_mm512_load_ps(dm + 16 * b), xs);
                __m512 mm = _mm512_mul_ps(_mm512_load_ps(dm + 32 + 16 * b), xs);
                __m512 v = _mm512_sub_ps(product(_mm512_cvtepi32_ps(isum[r][b]), dd),
                                         product(_mm512_cvtepi32_ps(t[r][b]), mm));
                acc[r][b] = _mm512_add_ps(acc[r][b], v);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}

/* `vnni_tile_of` compiled for each group size and row count. */
static __attribute__((noinline)) void vnni_tile(int type, int rows, const vnni_strip *s,
                                                int64_t k, const int8_t *xq, const float *xd,
                                                const int16_t *bsum, int64_t kp,
                                                float out[VNNI_ROWS][32]) {
#define TILE(G, R) vnni_tile_of(G, R, s, k, xq, xd, bsum, kp, out)
    if (type == Q6_K) {
        if (rows == 4) TILE(16, 4); else if (rows == 3) TILE(16, 3); else if (rows == 2) TILE(16, 2); else TILE(16, 1);
    } else {
        if (rows == 4) TILE(8, 4); else if (rows == 3) TILE(8, 3); else if (rows == 2) TILE(8, 2); else TILE(8, 1);
    }
#undef TILE
}

/* A legacy format's strip (blocks of 32 inputs; k rounded up to a chunk): levels as the
 * K-quants' (Q8_0's signed bytes plus 128, unsigned for `vpdpbusd`), and for block g (of 32
 * inputs) of strip block b its 16 outputs' scales at d + (2g + b) * 16 and offsets (weight =
 * d * level + off) at off + (2g + b) * 16, floats in the K-quants' scale part. */
static inline float *legacy_scales(const vnni_strip *s) { return (float *)s->scale; }

static inline float *legacy_offsets(const vnni_strip *s, int64_t kc) {
    return (float *)s->scale + kc;
}

/* Legacy weight rows [j0, j0 + 32) into the strip, a chunk of 16 rows at a time: levels (zero
 * past k) transposed as the K-quants', and the blocks' scales and offsets (`unpack_kernel_chunk`'s
 * values: 8 of each a row, transposed together). */
static inline __attribute__((always_inline)) void vnni_pack_legacy_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t k, const vnni_strip *s) {
    uint8_t levels[16][CHUNK] __attribute__((aligned(64)));
    int64_t kc = (k + CHUNK - 1) / CHUNK * CHUNK;
    for (int64_t first = 0; first < k; first += CHUNK)
        for (int b = 0; b < 2; b++) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                kernel_chunk c;
                unpack_kernel_chunk(type, w + (j0 + 16 * b + j) * row_bytes, first,
                                    k - first < CHUNK ? k - first : CHUNK, &c);
                for (int g = 0; g < 8; g++) {
                    __m256i q = g < c.groups ? c.q[g] : _mm256_setzero_si256();
                    if (type == Q8_0) q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
                    _mm256_store_si256((__m256i *)(levels[j] + 32 * g), q);
                }
                r[j] = _mm512_castps_si512(_mm512_insertf32x8(_mm512_castps256_ps512(c.d8), c.off8, 1));
            }
            transpose16x16(r); /* r[g]: block g's scales of the 16 outputs, r[8 + g] its offsets */
            for (int g = 0; g < 8; g++) {
                int64_t at = ((first / 32 + g) * 2 + b) * 16;
                _mm512_store_si512(legacy_scales(s) + at, r[g]);
                _mm512_store_si512(legacy_offsets(s, kc) + at, r[8 + g]);
            }
            for (int seg = 0; seg < 4; seg++) {
                for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512(levels[j] + 64 * seg);
                transpose16x16(r);
                for (int p = 0; p < 16; p++)
                    _mm512_store_si512(s->levels + ((first / 4 + seg * 16 + p) * 2 + b) * 64, r[p]);
            }
        }
}

/* out[r][0..32) = rows r < 2 of the activations times a legacy strip: each block's value as
 * `legacy_dot` computes it (Q8_0: its integer products less 128 times the activations' sum),
 * a chunk's 8 summed in `hsum8`'s tree ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), then added
 * to the row's sum. Two rows a tile: the tree keeps three partial sums a row and block live. */
static inline __attribute__((always_inline)) void vnni_legacy_tile_of(
    int type, const int R, const vnni_strip *s, int64_t k, const int8_t *xq, const float *xd,
    const int16_t *bsum, int64_t kp, float out[VNNI_ROWS][32]) {
    static const int order[8] = {0, 4, 2, 6, 1, 5, 3, 7};
    int64_t kc = (k + CHUNK - 1) / CHUNK * CHUNK;
    const float *scales = legacy_scales(s), *offsets = legacy_offsets(s, kc);
    __m512 acc[2][2], part[3][2][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t first = 0; first < k; first += CHUNK) {
        int groups = k - first < CHUNK ? (int)((k - first) / 32) : 8;
        for (int i = 0; i < 8; i++) {
            int g = order[i];
            __m512 v[2][2];
            if (g >= groups) {
                for (int r = 0; r < R; r++) v[r][0] = v[r][1] = _mm512_setzero_ps();
            } else {
                int64_t blk = first / 32 + g;
                const uint8_t *lv = s->levels + blk * 8 * 128;
                __m512i t[2][2];
                for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
                for (int q = 0; q < 8; q++) {
                    __m512i w0 = _mm512_load_si512(lv + 128 * q), w1 = _mm512_load_si512(lv + 128 * q + 64);
                    for (int r = 0; r < R; r++) {
                        int32_t four;
                        memcpy(&four, xq + r * kp + blk * 32 + 4 * q, 4);
                        __m512i a = _mm512_set1_epi32(four);
                        t[r][0] = _mm512_dpbusd_epi32(t[r][0], w0, a);
                        t[r][1] = _mm512_dpbusd_epi32(t[r][1], w1, a);
                    }
                }
                for (int r = 0; r < R; r++) {
                    const int16_t *bs = bsum + r * (kp / 16) + 2 * blk;
                    __m512i sum32 = _mm512_set1_epi32(bs[0] + bs[1]);
                    __m512 xs = _mm512_set1_ps(xd[r * (kp / 32) + blk]);
                    for (int b = 0; b < 2; b++) {
                        __m512i isum = type == Q8_0 ? _mm512_sub_epi32(t[r][b], _mm512_slli_epi32(sum32, 7))
                                                    : t[r][b];
                        __m512 dx = product(_mm512_load_ps(scales + (blk * 2 + b) * 16), xs);
                        v[r][b] = product(_mm512_cvtepi32_ps(isum), dx);
                        if (type != Q8_0)
                            v[r][b] = _mm512_fmadd_ps(_mm512_load_ps(offsets + (blk * 2 + b) * 16),
                                                      product(_mm512_cvtepi32_ps(sum32), xs), v[r][b]);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int b = 0; b < 2; b++) {
                    __m512 x = v[r][b];
                    switch (i) { /* the tree, in the order the blocks come */
                    case 0: case 2: part[i / 2][r][b] = x; break;
                    case 4: part[1][r][b] = x; break;
                    case 6: part[2][r][b] = x; break;
                    case 1: case 3: part[i / 2][r][b] = _mm512_add_ps(part[i / 2][r][b], x); break;
                    case 5: part[1][r][b] = _mm512_add_ps(part[1][r][b], x); break;
                    default: part[2][r][b] = _mm512_add_ps(part[2][r][b], x);
                    }
                    if (i == 3) part[0][r][b] = _mm512_add_ps(part[0][r][b], part[1][r][b]);
                    if (i == 7) {
                        __m512 right = _mm512_add_ps(part[1][r][b], part[2][r][b]);
                        acc[r][b] = _mm512_add_ps(acc[r][b], _mm512_add_ps(part[0][r][b], right));
                    }
                }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + 16, acc[r][1]);
    }
}

/* `vnni_pack_legacy_of` and `vnni_legacy_tile_of` compiled for each format (and row count). */
static __attribute__((noinline)) void vnni_pack_legacy(int type, const uint8_t *w,
                                                       int64_t row_bytes, int64_t j0, int64_t k,
                                                       const vnni_strip *s) {
    switch (type) {
    case Q4_0: vnni_pack_legacy_of(Q4_0, w, row_bytes, j0, k, s); break;
    case Q4_1: vnni_pack_legacy_of(Q4_1, w, row_bytes, j0, k, s); break;
    case Q5_0: vnni_pack_legacy_of(Q5_0, w, row_bytes, j0, k, s); break;
    case Q5_1: vnni_pack_legacy_of(Q5_1, w, row_bytes, j0, k, s); break;
    default: vnni_pack_legacy_of(Q8_0, w, row_bytes, j0, k, s);
    }
}

static __attribute__((noinline)) void vnni_legacy_tile(int type, int rows, const vnni_strip *s,
                                                       int64_t k, const int8_t *xq,
                                                       const float *xd, const int16_t *bsum,
                                                       int64_t kp, float out[VNNI_ROWS][32]) {
#define TILE(T) (rows == 2 ? vnni_legacy_tile_of(T, 2, s, k, xq, xd, bsum, kp, out) \
                           : vnni_legacy_tile_of(T, 1, s, k, xq, xd, bsum, kp, out))
    switch (type) {
    case Q8_0: TILE(Q8_0); break;
    case Q4_0: TILE(Q4_0); break;
    case Q4_1: TILE(Q4_1); break;
    default: TILE(type); /* Q5_0, Q5_1 */
    }
#undef TILE
}

/* Each thread's strip buffer, grown to the largest k it has served. */
static __thread uint8_t *vnni_buffer;
static __thread int64_t vnni_buffer_bytes;

static uint8_t *vnni_buffer_for(int64_t k) {
    int64_t need = vnni_strip_bytes(k);
    if (need > vnni_buffer_bytes) {
        free(vnni_buffer);
        vnni_buffer = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
        vnni_buffer_bytes = vnni_buffer ? need : 0;
    }
    return vnni_buffer;
}

/* `quant_matmul` for weights of n a multiple of 32 (K-quants: k of 256) on the VNNI GEMM (see
 * above): the threads split the strips. Returns 0 where a thread could not get its buffer
 * (nothing written then is wrong: the caller's kernel recomputes every output). */
static int vnni_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                       const int8_t *xq, const float *xd, const int16_t *bsum, int64_t rows,
                       void *out, int out_bf16, int64_t out_stride, int threads) {
    int64_t kp = act_stride(k), strips = n / 32, kc = (k + CHUNK - 1) / CHUNK * CHUNK;
    int legacy = type < Q4_K, tile_rows = legacy ? 2 : VNNI_ROWS, ok = 1;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(&& : ok)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        uint8_t *buf = vnni_buffer_for(kc);
        if (!buf) {
            ok = 0;
        } else {
            vnni_strip s = vnni_strip_at(buf, kc);
            for (int64_t st = strips * t / parts; st < strips * (t + 1) / parts; st++) {
                if (legacy)
                    vnni_pack_legacy(type, w, row_bytes, 32 * st, k, &s);
                else
                    vnni_pack(type, w, row_bytes, 32 * st, k, &s);
                for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
                    int mt = rows - r0 < tile_rows ? (int)(rows - r0) : tile_rows;
                    float tile[VNNI_ROWS][32];
                    const int8_t *x = xq + r0 * kp;
                    const float *x_d = xd + r0 * (kp / 32);
                    const int16_t *x_sum = bsum + r0 * (kp / 16);
                    if (legacy)
                        vnni_legacy_tile(type, mt, &s, k, x, x_d, x_sum, kp, tile);
                    else
                        vnni_tile(type, mt, &s, k, x, x_d, x_sum, kp, tile);
                    for (int r = 0; r < mt; r++)
                        for (int j = 0; j < 32; j++)
                            store_output(out, out_bf16, (r0 + r) * out_stride + 32 * st + j, tile[r][j]);
                }
            }
        }
    }
    return ok;
}
#endif

/* out [rows][n] (rows `out_stride` apart; fp32, or bf16 where `out_bf16`) = activations (from
 * `quantize_activations`, in blocks of 256 for the K-quants and 32 for the others) times the
 * weight w [n][row_bytes] of `type`, k inputs a row. `threads` threads split the outputs; each
 * unpacks a chunk of a weight row once for up to ROW_TILE rows, so at a few rows the step
 * streams the weight from memory once. */
void quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                  const int8_t *xq, const float *xd, const int16_t *bsum,
                  int64_t rows, void *out, int out_bf16, int64_t out_stride, int threads) {
    int64_t kp = act_stride(k);
#ifdef VNNI_GEMM
    if (rows >= VNNI_MIN_ROWS && n % 32 == 0 && (type < Q4_K || k % CHUNK == 0) &&
        vnni_matmul(type, w, n, k, row_bytes, xq, xd, bsum, rows, out, out_bf16, out_stride, threads))
        return;
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
        const uint8_t *row = w + (ids ? ids[r] : r) * row_bytes;
        for (int64_t first = 0; first < k; first += CHUNK) {
            int64_t count_here = k - first < CHUNK ? k - first : CHUNK;
            unpack_chunk(type, row, first, count_here, &c);
            float *o = out + r * k + first;
            for (int i = 0; i < count_here; i++) {
                float level = c.is_signed ? (float)(int8_t)c.q[i] : (float)c.q[i];
                o[i] = c.s.a[i / 16] * level + c.s.b[i / 16];
            }
        }
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
void gemm_bf16_strip(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *strip,
                     int64_t pairs, int64_t n, int64_t col, int nb, void *out, int out_bf16);

/* The 16 weights of group g of an unpacked chunk, in fp32 (`dequantize_rows`' values). */
static inline __m512 group_values16(const chunk *c, int g) {
    __m128i q = _mm_loadu_si128((const __m128i *)(c->q + 16 * g));
    __m512i levels = c->is_signed ? _mm512_cvtepi8_epi32(q) : _mm512_cvtepu8_epi32(q);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(levels), _mm512_set1_ps(c->s.a[g]),
                           _mm512_set1_ps(c->s.b[g]));
}

/* Weight rows [j0, j0 + 16) dequantized to bf16 (rounded to nearest even) in `gemm_bf16`'s
 * packing of a block of 16 outputs: input pair p of row j at [p][j][2]. A chunk of 256 inputs at
 * a time: each row's pairs into `pairs`, then the 16 rows' pair p side by side. */
static inline __attribute__((always_inline)) void pack_block16_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t k, bf16 *dst) {
    uint32_t pairs[16][CHUNK / 2];
    for (int64_t first = 0; first < k; first += CHUNK) {
        int64_t count = k - first < CHUNK ? k - first : CHUNK;
        for (int64_t j = 0; j < 16; j++) {
            chunk c;
            unpack_chunk(type, w + (j0 + j) * row_bytes, first, count, &c);
            for (int g = 0; g < count / 16; g += 2)
                _mm512_storeu_si512(pairs[j] + 8 * g,
                                    (__m512i)_mm512_cvtne2ps_pbh(group_values16(&c, g + 1),
                                                                 group_values16(&c, g)));
        }
        uint32_t *out = (uint32_t *)dst + first / 2 * 16;
        for (int64_t p0 = 0; p0 < count / 2; p0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(pairs[j] + p0);
            transpose16x16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + 16 * (p0 + p), r[p]);
        }
    }
}

/* `pack_block16_of` compiled for each common format (`type` a constant in the unpacking). */
static __attribute__((noinline)) void pack_block16(int type, const uint8_t *w, int64_t row_bytes,
                                                   int64_t j0, int64_t k, bf16 *dst) {
    switch (type) {
    case Q4_K: pack_block16_of(Q4_K, w, row_bytes, j0, k, dst); break;
    case Q6_K: pack_block16_of(Q6_K, w, row_bytes, j0, k, dst); break;
    case Q4_0: pack_block16_of(Q4_0, w, row_bytes, j0, k, dst); break;
    case Q8_0: pack_block16_of(Q8_0, w, row_bytes, j0, k, dst); break;
    default: pack_block16_of(type, w, row_bytes, j0, k, dst);
    }
}

/* out [rows][n] (rows `out_stride` apart; fp32, or bf16 where `out_bf16`) = x (bf16 [rows][k],
 * rows `x_stride` apart) times a quantized weight w [n][row_bytes] (n a multiple of 16, k of
 * 32): each thread dequantizes 48 outputs' weight rows at a time to bf16 into its part of `work`
 * (threads x 48 x k), a buffer the caches hold, and runs them through every row in the bf16
 * GEMM: a prefill's speed at the weight's quantized bytes. */
void quant_gemm_bf16(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                     const bf16 *x, int64_t rows, int64_t x_stride, void *out, int out_bf16,
                     int64_t out_stride, bf16 *work, int threads) {
    int64_t blocks = n / 16, pairs = k / 2;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t nb0 = blocks * t / parts, nb1 = blocks * (t + 1) / parts;
        bf16 *strip = work + t * 48 * k;
        for (int64_t nb = nb0; nb < nb1; nb += 3) {
            int nbs = nb1 - nb < 3 ? (int)(nb1 - nb) : 3;
            for (int b = 0; b < nbs; b++)
                pack_block16(type, w, row_bytes, (nb + b) * 16, k, strip + b * pairs * 32);
            gemm_bf16_strip(x, rows, x_stride, strip, pairs, out_stride, nb * 16, nbs, out,
                            out_bf16);
        }
    }
}
#endif
