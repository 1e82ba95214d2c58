/* GGUF block formats as the quantized kernels read them (`quant_ops.c`: the int8 products;
 * `quant_gemm.c`: GEMMs over strips of weights unpacked per thread): unpacking a chunk of a row,
 * in plain C and in AVX2 registers, and what the files share. Included, not built on its own. */
#ifndef PAGED_BACKEND_QUANT_BLOCKS_H
#define PAGED_BACKEND_QUANT_BLOCKS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

#define CHUNK 256 /* weights unpacked at a time: a K-quant super-block, or 8 blocks of 32 */

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
static inline void block32_scales(int type, const uint8_t *blk, group_scales *s, int g) {
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

/* Q4_K / Q5_K: a super-block's 8 6-bit scales and 8 mins, a byte each (`scale_min_k4`'s values
 * all at once). */
static inline void k4_scales_mins(const uint8_t *blk, uint64_t *sc, uint64_t *mins) {
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    *sc = (w[0] & 0x3f3f3f3fu) |
          (uint64_t)((w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4)) << 32;
    *mins = (w[1] & 0x3f3f3f3fu) |
            (uint64_t)(((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4)) << 32;
}

/* Q3_K: a super-block's 16 6-bit scales less 32 (ggml's unpacking in dequantize_row_q3_K: scale
 * g's low 4 bits are byte g % 8's low (g < 8) or high nibble, its top 2 bits at 2 * (g / 4) of
 * byte 8 + g % 4). */
static inline void q3k_scales(const uint8_t *blk, int8_t sc[16]) {
    uint32_t a[4], top;
    memcpy(a, blk + 96, 12);
    top = a[2];
    a[2] = ((a[0] >> 4) & 0x0f0f0f0fu) | (((top >> 4) & 0x03030303u) << 4);
    a[3] = ((a[1] >> 4) & 0x0f0f0f0fu) | (((top >> 6) & 0x03030303u) << 4);
    a[0] = (a[0] & 0x0f0f0f0fu) | ((top & 0x03030303u) << 4);
    a[1] = (a[1] & 0x0f0f0f0fu) | (((top >> 2) & 0x03030303u) << 4);
    memcpy(sc, a, 16);
    for (int g = 0; g < 16; g++) sc[g] = (int8_t)(sc[g] - 32);
}

/* Q3_K's and Q6_K's group scales (int8), their d's offset in the block, and their levels'
 * offset (w = d * sc * (q - offset)). */
static inline const int8_t *signed_scales(int type, const uint8_t *blk, int8_t q3k[16]) {
    if (type == Q6_K) return (const int8_t *)(blk + 192);
    q3k_scales(blk, q3k);
    return q3k;
}

static inline int signed_d_at(int type) { return type == Q6_K ? 208 : 108; }

static inline float signed_offset(int type) { return type == Q6_K ? 32.0f : 4.0f; }

/* Q8_256's scale, after its levels. */
static inline float q8_256_scale(const uint8_t *blk) {
    float d;
    memcpy(&d, blk + 256, 4);
    return d;
}

/* A super-block's 16 group scales and offsets. */
static inline void superblock_scales(int type, const uint8_t *blk, group_scales *s) {
    if (type == Q8_256) {
        for (int g = 0; g < 16; g++) s->a[g] = q8_256_scale(blk);
        return;
    }
    if (type == Q2_K) { /* a byte a group: its scale (low nibble) and min (high) */
        float d = f16_to_f32(blk + 80), dmin = f16_to_f32(blk + 82);
        for (int g = 0; g < 16; g++) {
            s->a[g] = d * (blk[g] & 15);
            s->b[g] = -dmin * (blk[g] >> 4);
        }
        return;
    }
    if (has_signed_scales(type)) {
        int8_t q3k[16];
        const int8_t *scales = signed_scales(type, blk, q3k);
        float d = f16_to_f32(blk + signed_d_at(type));
        for (int g = 0; g < 16; g++) {
            s->a[g] = d * scales[g];
            s->b[g] = -signed_offset(type) * s->a[g];
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
static inline void block32_levels(int type, const uint8_t *blk, uint8_t *q) {
    if (type == Q8_0) {
        memcpy(q, blk + 2, 32);
        return;
    }
    const uint8_t *p = blk + nibbles_at(type);
    uint32_t qh = 0;
    if (type == Q5_0 || type == Q5_1) memcpy(&qh, blk + fifth_bits_at(type), 4);
#ifdef QUANT_AVX2
    { /* the loop below compiled to a byte at a time: 4-7x slower */
        __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
        __m256i levels = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
        if (type == Q5_0 || type == Q5_1) { /* bit i of qh into level i's bit 4 */
            __m256i spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32((int)qh),
                _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
            __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201);
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
            levels = _mm256_or_si256(levels, _mm256_and_si256(set, _mm256_set1_epi8(16)));
        }
        _mm256_storeu_si256((__m256i *)q, levels);
        return;
    }
#endif
    for (int i = 0; i < 16; i++) {
        q[i] = (p[i] & 15) | (((qh >> i) & 1) << 4);
        q[i + 16] = (p[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
}

/* The levels of a K-quant super-block into q[256]; Q8_256's signed bytes. */
static inline void superblock_levels(int type, const uint8_t *blk, uint8_t *q) {
    if (type == Q8_256) {
        memcpy(q, blk, CHUNK);
        return;
    }
    if (type == Q2_K || type == Q3_K) { /* rows of 32: two bits at 2j of half h's qs; Q3_K's
                                          * third at 4h + j of hmask */
        const uint8_t *hmask = blk, *qs = blk + (type == Q2_K ? 16 : 32);
        for (int g = 0; g < 8; g++) {
            int h = g / 4, j = g % 4;
            for (int l = 0; l < 32; l++)
                q[32 * g + l] = ((qs[32 * h + l] >> (2 * j)) & 3) |
                                (type == Q3_K) * (((hmask[l] >> (4 * h + j)) & 1) << 2);
        }
        return;
    }
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
    const uint8_t *blk = row + (first >> (is_superblock(type) ? 8 : 5)) * block_bytes(type); /* no division */
    c->groups = (int)(count / 32);
    c->is_signed = type == Q8_0 || type == Q8_256;
    memset(&c->s, 0, sizeof c->s);
    if (is_superblock(type)) {
        superblock_levels(type, blk, c->q);
        superblock_scales(type, blk, &c->s);
        return;
    }
    for (int g = 0; g < c->groups; g++) {
        block32_levels(type, blk + g * block_bytes(type), c->q + 32 * g);
        block32_scales(type, blk + g * block_bytes(type), &c->s, g);
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
/* A chunk of a legacy format in registers: each block's 32 levels, and the blocks' scales and
 * offsets (lane g: block g's; 0 past the row's end). */
typedef struct {
    __m256i q[CHUNK / 32];
    __m256 d8, off8;
    int groups, is_signed;
} kernel_chunk;

/* The 4 bytes at p in every 32-bit lane. */
static inline __m256i broadcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
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

/* Level register g (0..7: weights 32g..32g+31) of a K-quant super-block. With `type` a constant
 * and g unrolled, the loads shared by two or four registers are made once. */
static inline __attribute__((always_inline)) __m256i k_level(int type, const uint8_t *blk, int g) {
    if (type == Q8_256) return _mm256_loadu_si256((const __m256i *)(blk + 32 * g)); /* signed */
    if (type == Q2_K || type == Q3_K) { /* as `superblock_levels` */
        int h = g / 4, j = g % 4;
        __m256i qs = _mm256_loadu_si256((const __m256i *)(blk + (type == Q2_K ? 16 : 32) + 32 * h));
        __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), _mm256_set1_epi8(3));
        if (type == Q2_K) return low;
        __m256i hmask = _mm256_loadu_si256((const __m256i *)blk);
        int bit = 4 * h + j; /* moved to bit 2 in one shift */
        __m256i third = bit >= 2 ? _mm256_srli_epi16(hmask, bit - 2) : _mm256_slli_epi16(hmask, 2 - bit);
        return _mm256_or_si256(low, _mm256_and_si256(third, _mm256_set1_epi8(4)));
    }
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

/* `signed_scales` in a register, built there: stored to memory and read back as one vector,
 * Q3_K's scales stalled the load (store forwarding) in every super-block (a one-row product
 * 1.6x Q4_K's time a weight). */
static inline __m128i signed_scales_m128(int type, const uint8_t *blk) {
    if (type == Q6_K) return _mm_loadu_si128((const __m128i *)(blk + 192));
    uint64_t low_bytes;
    uint32_t top;
    memcpy(&low_bytes, blk + 96, 8);
    memcpy(&top, blk + 104, 4);
    __m128i b = _mm_cvtsi64_si128((int64_t)low_bytes), m4 = _mm_set1_epi8(15);
    __m128i low = _mm_unpacklo_epi64(_mm_and_si128(b, m4), _mm_and_si128(_mm_srli_epi16(b, 4), m4));
    __m128i top2 = _mm_setr_epi32((int)(top & 0x03030303u), (int)((top >> 2) & 0x03030303u),
                                  (int)((top >> 4) & 0x03030303u), (int)((top >> 6) & 0x03030303u));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top2, 4)), _mm_set1_epi8(32));
}

/* Q2_K's 16 group scales (low nibbles of its first 16 bytes) and mins (high nibbles), in a
 * register each. */
static inline __m128i q2k_scales_m128(const uint8_t *blk) {
    return _mm_and_si128(_mm_loadu_si128((const __m128i *)blk), _mm_set1_epi8(15));
}

static inline __m128i q2k_mins_m128(const uint8_t *blk) {
    return _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)blk), 4), _mm_set1_epi8(15));
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

/* A K-quant super-block's integer scales, which each group's products are weighted by before
 * anything is converted to float. Q4_K / Q5_K: w = d * sc_j * q - dmin * m_j (per 32); Q6_K:
 * w = d * sc_g * (q - 32) (per 16), Q3_K the same with q - 4; Q2_K: Q4_K's per 16. So with one
 * activation scale xd a super-block,
 *   dot = isum * (d * xd) - msum * (mfac * xd),
 * isum = sum_g sc_g (q . x)_g and msum = sum_16 mv_16 * bsum_16 exact integers, mfac = dmin
 * (mv: the mins) or 32 d / 4 d (mv: the scales). Every kernel (one row, a tile of rows, the VNNI
 * and AVX2 GEMMs) adds a row's super-blocks in this one float sequence (`k_add`), in order, so
 * that an output has the same bits whatever kernel and batch computed it. */
typedef struct {
    __m256i lo, hi; /* int16 scales in both 128-bit halves: 16-group formats' 0-7 and 8-15; the others' 8 */
    __m256i mv;     /* int16 per 16 weights */
    __m128 dm;      /* d, then mfac */
} k_header;

static inline __attribute__((always_inline)) void k_header_of(int type, const uint8_t *blk,
                                                              k_header *h) {
    if (type == Q8_256) { /* no group scales, no offsets: msum is 0 */
        h->lo = h->hi = h->mv = _mm256_setzero_si256();
        h->dm = _mm_setr_ps(q8_256_scale(blk), 0.0f, 0.0f, 0.0f);
        return;
    }
    if (type == Q2_K) { /* Q4_K's scheme on 16 groups: 16 scales and 16 mins */
        __m128i sc8 = q2k_scales_m128(blk);
        h->lo = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc8));
        h->hi = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_srli_si128(sc8, 8)));
        h->mv = _mm256_cvtepu8_epi16(q2k_mins_m128(blk));
        uint32_t dm;
        memcpy(&dm, blk + 80, 4);
        h->dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        return;
    }
    if (has_signed_scales(type)) {
        __m128i sc8 = signed_scales_m128(type, blk);
        h->lo = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc8));
        h->hi = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc8, 8)));
        h->mv = _mm256_cvtepi8_epi16(sc8);
        uint16_t d;
        memcpy(&d, blk + signed_d_at(type), 2);
        __m128 d4 = _mm_cvtph_ps(_mm_set1_epi16((short)d));
        float off = signed_offset(type);
        h->dm = _mm_mul_ps(d4, _mm_setr_ps(1.0f, off, 1.0f, off));
        return;
    }
    uint64_t sc, mins;
    k4_scales_mins(blk, &sc, &mins);
    h->lo = h->hi = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((int64_t)sc)));
    __m128i doubled = _mm_shuffle_epi8(_mm_cvtsi64_si128((int64_t)mins),
                                       _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
    h->mv = _mm256_cvtepu8_epi16(doubled);
    uint32_t dm;
    memcpy(&dm, blk, 4);
    h->dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
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
#else
typedef chunk kernel_chunk;
#define unpack_kernel_chunk unpack_chunk
#endif

#if defined(QUANT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Steps of at least VNNI_MIN_ROWS rows run a GEMM on the VNNI units: each thread unpacks a
 * strip of 32 outputs (all inputs) into `vnni_strip`'s layout (quant_gemm.c), a buffer its L2
 * holds, and runs every row through it, VNNI_ROWS rows at a time (2 for the legacy formats).
 * `vpdpbusd` multiplies 4 levels of 16 outputs by 4 broadcast activation bytes and adds them
 * into 16 int32 lanes, so a group's exact integer products come in 4 instructions a 16 inputs,
 * against 2 (`vpmaddubsw` + `vpmaddwd`) a 32 inputs of one output in the other kernels. The
 * float work then follows the one-row kernel's sequence (`k_add`; `dot_rows`' chunk tree), so a
 * row has the same bits in any step. */
#define VNNI_GEMM 1
#define VNNI_MIN_ROWS 4
#define VNNI_ROWS 4

/* `quant_matmul`'s product on the VNNI GEMM (`quant_gemm.c`); 0 where it could not run. */
int vnni_matmul(int type, int row_scales, const uint8_t *w, int64_t n, int64_t k,
                int64_t row_bytes, const int8_t *xq, const float *xd, const int16_t *bsum,
                int64_t rows, void *out, int out_bf16, int64_t out_stride, int threads);
#endif

#if defined(QUANT_AVX2) && !defined(VNNI_GEMM)
/* Steps of at least AVX2_MIN_ROWS rows of a K-quant weight (16 outputs a strip, whole
 * super-blocks) run the AVX2 GEMM (`avx2_gemm.c`): `vpmaddubsw` sums of 4 inputs of 8 outputs,
 * added in int16, weighted by a group's scales once; the float work a lane an output. */
#define AVX2_GEMM 1
#define AVX2_MIN_ROWS 6

/* `quant_matmul`'s product on the AVX2 GEMM; 0 where it could not run. */
int avx2_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                const int8_t *xq, const float *xd, const int16_t *bsum, int64_t rows, void *out,
                int out_bf16, int64_t out_stride, int threads);
#endif
#endif
