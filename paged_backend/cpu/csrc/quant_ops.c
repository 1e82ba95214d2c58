/* Products with weights kept in GGUF's block formats (see `paged_backend.cpu.quant`): Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and Q4_K, Q5_K, Q6_K (super-blocks of 256), as ggml lays
 * them out, read straight from the file's bytes.
 *
 * One scheme serves every format. A chunk of up to 256 weights of a row is unpacked into levels q
 * (0..63, unsigned; Q8_0's are signed bytes) and, for each group of 16 weights, a scale a and an
 * offset b with weight = a * q + b. Activations are quantized per row in blocks of 32 to int8 with
 * a scale xd (as llama.cpp's Q8_0), and each group's level sum is kept, scaled (xsd). Then
 *   sum_i w_i x_i = sum_g xd_g * a_g * (sum_i q_i xq_i) + b_g * xsd_g,
 * where the inner sums are exact integer dot products of 32 bytes at a time (AVX2 `vpmaddubsw`, or
 * AVX512-VNNI `vpdpbusd` where the CPU has it). A chunk is unpacked once for all rows of a step, so
 * a batch reuses it from registers and L1.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

#define CHUNK 256       /* weights unpacked at a time: a K-quant super-block, or 8 blocks of 32 */
#define ROW_TILE 32     /* activation rows served by one unpacking of a chunk */

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

static inline float f16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalize */
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 1023) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Bytes of one block, by type (0: not a supported type), and weights in it. */
static int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

static int64_t block_weights(int type) { return type >= Q4_K ? 256 : 32; }

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
static void unpack_chunk(int type, const uint8_t *row, int64_t first, int64_t count, chunk *c) {
    const uint8_t *blk = row + first / block_weights(type) * block_bytes(type);
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

/* Rows of x (fp32, or bf16 where `x_bf16`; rows `x_stride` elements apart) to int8 in blocks of
 * 32: xq [rows][kp] (kp = k rounded up to 256, zero past k), xd [rows][kp/32] the blocks'
 * scales, xsd [rows][kp/16] each 16's level sum times its block's scale. Levels round to nearest
 * even, as `vcvtps2dq` does. */
void quantize_activations(const void *x, int x_bf16, int64_t rows, int64_t k, int64_t x_stride,
                          int8_t *xq, float *xd, float *xsd, int threads) {
    int64_t kp = (k + CHUNK - 1) / CHUNK * CHUNK;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * k >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float v[32];
        int8_t *q = xq + r * kp;
        for (int64_t b = 0; b < kp / 32; b++) {
            int64_t n = k - 32 * b < 32 ? (k - 32 * b > 0 ? k - 32 * b : 0) : 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) {
                float f = 0.0f;
                if (i < n) {
                    if (x_bf16) {
                        uint32_t u = (uint32_t)((const uint16_t *)x)[r * x_stride + 32 * b + i] << 16;
                        memcpy(&f, &u, 4);
                    } else {
                        f = ((const float *)x)[r * x_stride + 32 * b + i];
                    }
                }
                v[i] = f;
                amax = fmaxf(amax, fabsf(f));
            }
            float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int sums[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                int level = (int)nearbyintf(v[i] * inv);
                q[32 * b + i] = (int8_t)level;
                sums[i / 16] += level;
            }
            xd[r * (kp / 32) + b] = d;
            xsd[r * (kp / 16) + 2 * b] = d * sums[0];
            xsd[r * (kp / 16) + 2 * b + 1] = d * sums[1];
        }
    }
}

#ifdef QUANT_AVX2
typedef __m256 acc_t; /* a row's running sums, 8 lanes */

/* A chunk as `unpack_chunk` gives it, in registers: each group of 32 levels, and the scales and
 * offsets of the 16 groups of 16 (a0: groups 0-7, a1: 8-15; likewise b). */
typedef struct {
    __m256i q[CHUNK / 32];
    __m256 a0, a1, b0, b1;
    int groups, is_signed;
} kernel_chunk;

/* Eight per-32 values as per-16 pairs: lanes 0-3 doubled (low), 4-7 doubled (high). */
static inline __m256 pairs_low(__m256 v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

static inline __m256 pairs_high(__m256 v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

static inline __m256 bytes8_to_ps(uint64_t bytes, int is_signed) {
    __m128i v = _mm_cvtsi64_si128((int64_t)bytes);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* Q4_K / Q5_K: a super-block's eight 6-bit scales and mins (`scale_min_k4`), four at a time. */
static inline void k4_scales(const uint8_t *blk, kernel_chunk *c) {
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    uint32_t sc_lo = w[0] & 0x3f3f3f3fu, m_lo = w[1] & 0x3f3f3f3fu;
    uint32_t sc_hi = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);
    uint32_t m_hi = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4);
    __m256 d = _mm256_set1_ps(f16_to_f32(blk)), dmin = _mm256_set1_ps(-f16_to_f32(blk + 2));
    __m256 a = _mm256_mul_ps(bytes8_to_ps(sc_lo | (uint64_t)sc_hi << 32, 0), d);
    __m256 b = _mm256_mul_ps(bytes8_to_ps(m_lo | (uint64_t)m_hi << 32, 0), dmin);
    c->a0 = pairs_low(a), c->a1 = pairs_high(a), c->b0 = pairs_low(b), c->b1 = pairs_high(b);
}

static inline void q6k_scales(const uint8_t *blk, kernel_chunk *c) {
    uint64_t sc[2];
    memcpy(sc, blk + 192, 16);
    __m256 d = _mm256_set1_ps(f16_to_f32(blk + 208)), offset = _mm256_set1_ps(-32.0f);
    c->a0 = _mm256_mul_ps(bytes8_to_ps(sc[0], 1), d);
    c->a1 = _mm256_mul_ps(bytes8_to_ps(sc[1], 1), d);
    c->b0 = _mm256_mul_ps(c->a0, offset), c->b1 = _mm256_mul_ps(c->a1, offset);
}

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

static void unpack_kernel_chunk(int type, const uint8_t *row, int64_t first, int64_t count,
                                kernel_chunk *c) {
    const uint8_t *blk = row + first / block_weights(type) * block_bytes(type);
    c->groups = (int)(count / 32);
    c->is_signed = type == Q8_0;
    if (type == Q6_K) {
        for (int h = 0; h < 2; h++) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            c->q[4 * h] = _mm256_or_si256(low_nibbles(l0), q6k_bits(qh, 0));
            c->q[4 * h + 1] = _mm256_or_si256(low_nibbles(l1), q6k_bits(qh, 2));
            c->q[4 * h + 2] = _mm256_or_si256(high_nibbles(l0), q6k_bits(qh, 4));
            c->q[4 * h + 3] = _mm256_or_si256(high_nibbles(l1), q6k_bits(qh, 6));
        }
        q6k_scales(blk, c);
    } else if (type >= Q4_K) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const uint8_t *qs = blk + (type == Q5_K ? 48 : 16);
        for (int i = 0; i < 4; i++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
            c->q[2 * i] = low_nibbles(p);
            c->q[2 * i + 1] = high_nibbles(p);
            if (type == Q5_K) {
                c->q[2 * i] = _mm256_or_si256(c->q[2 * i], q5k_bits(qh, 2 * i));
                c->q[2 * i + 1] = _mm256_or_si256(c->q[2 * i + 1], q5k_bits(qh, 2 * i + 1));
            }
        }
        k4_scales(blk, c);
    } else {
        group_scales s;
        memset(&s, 0, sizeof s);
        for (int g = 0; g < c->groups; g++, blk += block_bytes(type)) {
            if (type == Q8_0) {
                c->q[g] = _mm256_loadu_si256((const __m256i *)(blk + 2));
            } else {
                c->q[g] = nibbles16(blk + nibbles_at(type));
                if (type == Q5_0 || type == Q5_1)
                    c->q[g] = _mm256_or_si256(c->q[g], fifth_bits(blk + fifth_bits_at(type)));
            }
            block32_scales(type, blk, &s, g);
        }
        c->a0 = _mm256_loadu_ps(s.a), c->a1 = _mm256_loadu_ps(s.a + 8);
        c->b0 = _mm256_loadu_ps(s.b), c->b1 = _mm256_loadu_ps(s.b + 8);
    }
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

/* acc[m] += chunk . row m of the step's activations (at this chunk), for `rows` rows. Lanes 0-3
 * of a 32-byte product sum its first 16 bytes, lanes 4-7 the next 16: groups 2g and 2g + 1. */
static void dot_rows(const kernel_chunk *c, const int8_t *xq, const float *xd, const float *xsd,
                     int64_t kp, int64_t rows, acc_t *acc) {
    __m256 av[CHUNK / 32];
    for (int g = 0; g < c->groups; g++) { /* lanes 0-3: group 2g's scale, 4-7: 2g + 1's */
        __m256i at = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        at = _mm256_add_epi32(at, _mm256_set1_epi32(2 * g % 8));
        av[g] = _mm256_permutevar8x32_ps(g < 4 ? c->a0 : c->a1, at);
    }
    __m256 b0 = c->b0, b1 = c->b1;
    for (int64_t m = 0; m < rows; m++) {
        const int8_t *x = xq + m * kp;
        const float *d = xd + m * (kp / 32), *sd = xsd + m * (kp / 16);
        __m256 s = acc[m];
        for (int g = 0; g < c->groups; g++) {
            __m256i p = dot_bytes(c->q[g], _mm256_loadu_si256((const __m256i *)(x + 32 * g)), c->is_signed);
            s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(av[g], _mm256_set1_ps(d[g])), s);
        }
        s = _mm256_fmadd_ps(b0, _mm256_loadu_ps(sd), s);
        acc[m] = _mm256_fmadd_ps(b1, _mm256_loadu_ps(sd + 8), s);
    }
}
#else
typedef struct { float v[8]; } acc_t;
typedef chunk kernel_chunk;
#define unpack_kernel_chunk unpack_chunk

static void dot_rows(const chunk *c, const int8_t *xq, const float *xd, const float *xsd,
                     int64_t kp, int64_t rows, acc_t *acc) {
    for (int64_t m = 0; m < rows; m++) {
        const int8_t *x = xq + m * kp;
        float s = 0.0f;
        for (int g = 0; g < 2 * c->groups; g++) {
            int sum = 0;
            for (int i = 16 * g; i < 16 * g + 16; i++)
                sum += (c->is_signed ? (int8_t)c->q[i] : c->q[i]) * x[i];
            s += c->s.a[g] * xd[m * (kp / 32) + g / 2] * sum + c->s.b[g] * xsd[m * (kp / 16) + g];
        }
        acc[m].v[0] += s;
    }
}

static inline float hsum8(acc_t v) {
    float s = 0.0f;
    for (int i = 0; i < 8; i++) s += v.v[i];
    return s;
}
#endif

/* out [rows][n] (rows `out_stride` apart; fp32, or bf16 where `out_bf16`) = activations (from
 * `quantize_activations`, kp = k rounded up to 256) times the weight w [n][row_bytes] of `type`,
 * k inputs a row. `threads` threads split the outputs; each unpacks a chunk of a weight row once
 * for up to ROW_TILE rows, so at a few rows the step streams the weight from memory once. */
void quant_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                  const int8_t *xq, const float *xd, const float *xsd, int64_t rows, void *out,
                  int out_bf16, int64_t out_stride, int threads) {
    int64_t kp = (k + CHUNK - 1) / CHUNK * CHUNK;
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_TILE) {
        int64_t mt = rows - m0 < ROW_TILE ? rows - m0 : ROW_TILE;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
        for (int64_t j = 0; j < n; j++) {
            acc_t acc[ROW_TILE];
            kernel_chunk c;
            memset(acc, 0, sizeof acc);
            for (int64_t first = 0; first < k; first += CHUNK) {
                unpack_kernel_chunk(type, w + j * row_bytes, first, k - first < CHUNK ? k - first : CHUNK, &c);
                dot_rows(&c, xq + m0 * kp + first, xd + m0 * (kp / 32) + first / 32,
                         xsd + m0 * (kp / 16) + first / 16, kp, mt, acc);
            }
            for (int64_t m = 0; m < mt; m++) {
                float v = hsum8(acc[m]);
                int64_t at = (m0 + m) * out_stride + j;
                if (out_bf16) { /* round to nearest even */
                    uint32_t u;
                    memcpy(&u, &v, 4);
                    ((uint16_t *)out)[at] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                } else {
                    ((float *)out)[at] = v;
                }
            }
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
