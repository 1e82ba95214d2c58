/* GEMMs over strips of a quantized weight that each thread unpacks once a step into a buffer
 * its caches hold, then runs every row of the step through: the VNNI GEMM (int8 activations,
 * `vpdpbusd`; steps of a few rows on, from `quant_matmul`) and the dequantized bf16 GEMM
 * (`quant_gemm_bf16`: bf16 activations as they are, on AVX512-BF16).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

#ifdef VNNI_GEMM
/* A strip of 32 outputs (blocks b = 0, 1 of 16) of a K-quant weight, k inputs:
 * - levels: inputs 4q..4q+3 of block b at levels + (2q + b) * 64, output-major (16 x 4 bytes);
 * - scale: group g's (of 32 inputs, 16 for Q2_K, Q3_K and Q6_K) int32 scales at scale + (2g + b) * 16;
 * - mv: super-block s's groups' offset weights, int16 pairs h (groups 2h, 2h + 1) of 16 outputs
 *   at mv + ((8s + h) * 2 + b) * 32;
 * - dm: super-block s's d at dm + (4s + b) * 16, mfac at dm + (4s + 2 + b) * 16. */
typedef struct {
    const uint8_t *levels;
    int32_t *scale;
    int16_t *mv;
    float *dm;
    int64_t levels_step, dm_step; /* bytes, floats from a super-block's to the next's */
} vnni_strip;

/* Strip st of a Q8_256_VNNI weight (w 64-byte aligned), which needs no unpacking: its 32 rows'
 * bytes hold, for each super-block, the levels (plus 128) as the strip's (8,192 bytes), then
 * the 32 outputs' scales as its dm (128 bytes). */
static vnni_strip vnni_strip_of(const uint8_t *w, int64_t row_bytes, int64_t st) {
    vnni_strip s = {0};
    s.levels = w + 32 * st * row_bytes;
    s.levels_step = 32 * block_bytes(Q8_256_VNNI);
    s.dm = (float *)(s.levels + 64 * 128);
    s.dm_step = s.levels_step / 4;
    return s;
}

/* The pack asks for each block this many super-blocks ahead of the one it reads: the hardware
 * prefetcher does not follow 32 interleaved rows (a 4-row Q8_256 product ran up to ~1.25x
 * faster with it, in a noisy A/B). */
#define VNNI_PREFETCH 4

static inline int k_groups(int type) { return has_16_groups(type) ? 16 : 8; }

/* The strip's bytes for k inputs (each part 64-byte aligned). */
static inline int64_t vnni_strip_bytes(int64_t k) { return 32 * k + 8 * k + 4 * k + k + 4 * 64; }

static vnni_strip vnni_strip_at(uint8_t *buf, int64_t k) {
    vnni_strip s;
    s.levels = buf;
    s.levels_step = 64 * 128;
    s.dm_step = 64;
    s.scale = (int32_t *)(buf + 32 * k);
    s.mv = (int16_t *)(buf + 40 * k);
    s.dm = (float *)(buf + 44 * k);
    return s;
}

/* 16 rows' levels of the chunk of inputs at `first` (levels[j]: row j's 256) into block b of the
 * strip: 16 x 16 int32 transposes make each 4 inputs' 16 outputs adjacent. */
static inline __attribute__((always_inline)) void vnni_store_levels(
    const uint8_t levels[16][CHUNK], const vnni_strip *s, int64_t first, int b) {
    for (int seg = 0; seg < 4; seg++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_load_si512(levels[j] + 64 * seg);
        transpose16x16(r);
        for (int p = 0; p < 16; p++)
            _mm512_store_si512((uint8_t *)s->levels + ((first / 4 + seg * 16 + p) * 2 + b) * 64, r[p]);
    }
}

/* A row's super-block header as 16 int32 lanes: the 16-group formats' 16 scales (Q2_K's mins
 * apart); Q4_K / Q5_K's 8 scales, then their 8 mins (`k_header_of`'s bits); its d and mfac into
 * dm. */
static inline __attribute__((always_inline)) __m512i vnni_row_header(int type, const uint8_t *blk,
                                                                     float *d, float *mfac) {
    if (type == Q8_256) {
        *d = q8_256_scale(blk);
        *mfac = 0.0f;
        return _mm512_setzero_si512();
    }
    if (type == Q2_K) { /* its scales; the mins `vnni_pack_of` takes apart */
        *d = f16_to_f32(blk + 80);
        *mfac = f16_to_f32(blk + 82);
        return _mm512_cvtepu8_epi32(q2k_scales_m128(blk));
    }
    if (has_signed_scales(type)) {
        *d = f16_to_f32(blk + signed_d_at(type));
        *mfac = *d * signed_offset(type);
        return _mm512_cvtepi8_epi32(signed_scales_m128(type, blk));
    }
    uint64_t sc, mins;
    k4_scales_mins(blk, &sc, &mins);
    *d = f16_to_f32(blk);
    *mfac = f16_to_f32(blk + 2);
    return _mm512_cvtepu8_epi32(_mm_set_epi64x((int64_t)mins, (int64_t)sc));
}

/* 16 rows' headers (r[j]: row j's `vnni_row_header`) of super-block sb into block b of the
 * strip: transposed, lane j of each vector is output j. */
static inline __attribute__((always_inline)) void vnni_scales(int type, __m512i r[16],
                                                              __m512i mins[16],
                                                              const vnni_strip *s, int64_t sb,
                                                              int b) {
    transpose16x16(r); /* r[g]: group g's scales of the 16 outputs */
    if (type == Q2_K) transpose16x16(mins); /* mins[g]: group g's mins */
    int groups = k_groups(type);
    for (int g = 0; g < groups; g++)
        _mm512_store_si512(s->scale + ((sb * groups + g) * 2 + b) * 16, r[g]);
    for (int h = 0; h < 8 >> !has_16_groups(type); h++) { /* the int16 pair of groups 2h, 2h + 1 */
        /* offsets of a group: Q2_K's mins, Q3_K's / Q6_K's scales, Q4_K's / Q5_K's mins */
        __m512i *by_group = type == Q2_K ? mins : has_16_groups(type) ? r : r + 8;
        __m512i lo = by_group[2 * h], hi = by_group[2 * h + 1];
        __m512i pair = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)),
                                       _mm512_slli_epi32(hi, 16));
        _mm512_store_si512(s->mv + ((8 * sb + h) * 2 + b) * 32, pair);
    }
}

/* Q4_K's levels of 16 rows (blk[j]: row j's super-block sb) into block b of the strip, from
 * the nibbles as they are: byte 4i + m of a row's 32-byte part c holds inputs 64c + 4i + m (low
 * nibble) and 64c + 32 + 4i + m (high), so a 16 x 16 transpose of 4-byte units gives two 4-input
 * steps a unit (half the shuffles of transposing the levels, and no trip through memory). */
static inline __attribute__((always_inline)) void q4_k_store_levels(const uint8_t *blk[16],
                                                                    const vnni_strip *s,
                                                                    int64_t sb, int b) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int half = 0; half < 2; half++) { /* parts 2 half, 2 half + 1 */
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(blk[j] + 16 + 64 * half);
        transpose16x16(r); /* r[u]: unit u of the 16 rows */
        for (int u = 0; u < 16; u++) {
            int64_t q = sb * 64 + 16 * (2 * half + u / 8) + u % 8; /* the low nibbles' step */
            uint8_t *at = (uint8_t *)s->levels + (q * 2 + b) * 64;
            _mm512_store_si512(at, _mm512_and_si512(r[u], low));
            _mm512_store_si512(at + 8 * 2 * 64, _mm512_and_si512(_mm512_srli_epi16(r[u], 4), low));
        }
    }
}

/* Weight rows [j0, j0 + 32) into the strip: each super-block's levels of 16 rows (8 registers a
 * row, `k_level`; Q4_K's `q4_k_store_levels`) and their headers, then 16 x 16 int32 transposes
 * make each 4 inputs' (and each group's) 16 outputs adjacent. */
static inline __attribute__((always_inline)) void vnni_pack_of(int type, const uint8_t *w,
                                                               int64_t row_bytes, int64_t j0,
                                                               int64_t k, const vnni_strip *s) {
    uint8_t levels[16][CHUNK] __attribute__((aligned(64)));
    for (int64_t sb = 0; sb < k / CHUNK; sb++)
        for (int b = 0; b < 2; b++) {
            __m512i r[16], mins[16];
            const uint8_t *rows[16];
            float *dm = s->dm + 64 * sb + 16 * b;
            for (int j = 0; j < 16; j++) {
                const uint8_t *blk = rows[j] = w + (j0 + 16 * b + j) * row_bytes + sb * block_bytes(type);
                for (int64_t i = 0; i < block_bytes(type); i += 64)
                    _mm_prefetch((const char *)blk + VNNI_PREFETCH * block_bytes(type) + i, _MM_HINT_T0);
                for (int g = 0; g < 8 * (type != Q4_K); g++) {
                    __m256i q = k_level(type, blk, g);
                    if (type == Q8_256) q = _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
                    _mm256_store_si256((__m256i *)(levels[j] + 32 * g), q);
                }
                r[j] = vnni_row_header(type, blk, dm + j, dm + 32 + j);
                if (type == Q2_K) mins[j] = _mm512_cvtepu8_epi32(q2k_mins_m128(blk));
            }
            if (type != Q8_256) vnni_scales(type, r, mins, s, sb, b);
            if (type == Q4_K)
                q4_k_store_levels(rows, s, sb, b);
            else
                vnni_store_levels(levels, s, sb * CHUNK, b);
        }
}

static __attribute__((noinline)) void vnni_pack(int type, const uint8_t *w, int64_t row_bytes,
                                                int64_t j0, int64_t k, const vnni_strip *s) {
    switch (type) {
    case Q2_K: vnni_pack_of(Q2_K, w, row_bytes, j0, k, s); break;
    case Q3_K: vnni_pack_of(Q3_K, w, row_bytes, j0, k, s); break;
    case Q4_K: vnni_pack_of(Q4_K, w, row_bytes, j0, k, s); break;
    case Q5_K: vnni_pack_of(Q5_K, w, row_bytes, j0, k, s); break;
    case Q8_256: vnni_pack_of(Q8_256, w, row_bytes, j0, k, s); break;
    default: vnni_pack_of(Q6_K, w, row_bytes, j0, k, s);
    }
}

/* a * b rounded on its own: GCC's `_mm512_mul_ps` is a plain vector product, which it would
 * contract with the subtraction into one fused (differently rounded) operation. */
static inline __m512 product(__m512 a, __m512 b) {
    return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* out[r][0..32) = rows r < R of the activations times the strip, super-block by super-block in
 * `k_add`'s float sequence; groups of 32 inputs (16 for the 16-group formats). `unit`: Q8_256,
 * whose groups all weigh 1 and whose levels are stored plus 128 (unsigned for `vpdpbusd`), so a
 * super-block's integer sum is less 128 times the activations' sum, and it has no offsets. */
static inline __attribute__((always_inline)) void vnni_tile_of(
    const int groups, const int unit, const int R, const vnni_strip *s, int64_t k, const int8_t *xq,
    const float *xd, const int16_t *bsum, const int16_t *gsum, int64_t kp,
    float out[VNNI_ROWS][32]) {
    const int quads = CHUNK / 4 / groups; /* 4-input steps a group */
    __m512 acc[VNNI_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < k / CHUNK; sb++) {
        __m512i isum[VNNI_ROWS][2], t[VNNI_ROWS][2], odd[2];
        for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm512_setzero_si512();
        for (int g = 0; g < groups; g++) {
            const uint8_t *lv = s->levels + sb * s->levels_step + g * quads * 128;
            const int8_t *x = xq + sb * CHUNK + g * 4 * quads;
            if (!unit || g == 0) {
                for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
                odd[0] = odd[1] = _mm512_setzero_si512();
            }
            for (int q = 0; q < quads; q++) {
                __m512i w0 = _mm512_load_si512(lv + 128 * q), w1 = _mm512_load_si512(lv + 128 * q + 64);
                for (int r = 0; r < R; r++) {
                    int32_t four;
                    memcpy(&four, x + r * kp + 4 * q, 4);
                    __m512i a = _mm512_set1_epi32(four);
                    /* one row: odd steps into their own sums, two more dependency chains (a
                     * one-row Q8_256_VNNI product from L3 ran ~1.25x faster with them) */
                    __m512i *sum = R == 1 && q % 2 ? odd : t[r];
                    sum[0] = _mm512_dpbusd_epi32(sum[0], w0, a);
                    sum[1] = _mm512_dpbusd_epi32(sum[1], w1, a);
                }
            }
            if (R == 1 && (!unit || g == groups - 1)) {
                t[0][0] = _mm512_add_epi32(t[0][0], odd[0]);
                t[0][1] = _mm512_add_epi32(t[0][1], odd[1]);
            }
            if (unit) {
                for (int r = 0; r < R && g == groups - 1; r++) {
                    const int16_t *bs = bsum + r * (kp / 16) + sb * 16;
                    int sum = _mm512_reduce_add_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)bs)));
                    isum[r][0] = _mm512_sub_epi32(t[r][0], _mm512_set1_epi32(sum * 128));
                    isum[r][1] = _mm512_sub_epi32(t[r][1], _mm512_set1_epi32(sum * 128));
                }
                continue;
            }
            const int32_t *sc = s->scale + (sb * groups + g) * 32;
            __m512i sc0 = _mm512_load_si512(sc), sc1 = _mm512_load_si512(sc + 16);
            for (int r = 0; r < R; r++) {
                isum[r][0] = _mm512_add_epi32(isum[r][0], _mm512_mullo_epi32(t[r][0], sc0));
                isum[r][1] = _mm512_add_epi32(isum[r][1], _mm512_mullo_epi32(t[r][1], sc1));
            }
        }
        for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm512_setzero_si512();
        /* the offsets: pairs of groups' sums of activations (`group_sums`) by the strip's */
        const int16_t *sums = groups == 16 ? bsum : gsum;
        for (int h = 0; h < groups / 2 * !unit; h++) {
            const int16_t *mv = s->mv + (8 * sb + h) * 64;
            __m512i mv0 = _mm512_load_si512(mv), mv1 = _mm512_load_si512(mv + 32);
            for (int r = 0; r < R; r++) {
                int32_t pair;
                memcpy(&pair, sums + r * (kp / 256 * groups) + sb * groups + 2 * h, 4);
                __m512i bb = _mm512_set1_epi32(pair);
                t[r][0] = _mm512_dpwssd_epi32(t[r][0], mv0, bb);
                t[r][1] = _mm512_dpwssd_epi32(t[r][1], mv1, bb);
            }
        }
        const float *dm = s->dm + sb * s->dm_step;
        for (int r = 0; r < R; r++) {
            __m512 xs = _mm512_set1_ps(xd[r * (kp / 32) + sb * 8]);
            for (int b = 0; b < 2; b++) {
                __m512 dd = _mm512_mul_ps(_mm512_load_ps(dm + 16 * b), xs);
                __m512 mm = _mm512_mul_ps(_mm512_load_ps(dm + 32 + 16 * b), xs);
                __m512 v = product(_mm512_cvtepi32_ps(isum[r][b]), dd);
                if (!unit) /* Q8_256: k_add's p0 - p1 with p1 = 0 * mfac, +0, is p0 */
                    v = _mm512_sub_ps(v, product(_mm512_cvtepi32_ps(t[r][b]), mm));
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
                                                const int16_t *bsum, const int16_t *gsum,
                                                int64_t kp, float out[VNNI_ROWS][32]) {
#define TILE(G, U, R) vnni_tile_of(G, U, R, s, k, xq, xd, bsum, gsum, kp, out)
#define TILES(G, U) \
    if (rows == 4) TILE(G, U, 4); else if (rows == 3) TILE(G, U, 3); else if (rows == 2) TILE(G, U, 2); else TILE(G, U, 1)
    if (has_16_groups(type)) {
        TILES(16, 0);
    } else if (type == Q8_256) {
        TILES(8, 1); /* the K-quants' loop, its 8 groups' sums added, not scaled */
    } else {
        TILES(8, 0);
    }
#undef TILES
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
            vnni_store_levels(levels, s, first, b);
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

/* Rows [r0, r0 + rows) of a strip's outputs (tile[r][0..32), from column col) into out. */
static void store_tile(void *out, int out_bf16, int64_t out_stride, int64_t r0, int rows,
                       int64_t col, float (*tile)[32]) {
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++)
            store_outputs16(out, out_bf16, (r0 + r) * out_stride + col + 16 * h,
                            _mm512_loadu_ps(tile[r] + 16 * h));
}

/* Each thread's strip buffer, grown to the largest k it has served. */
static __thread uint8_t *vnni_buffer;
static __thread int64_t vnni_buffer_bytes;

static uint8_t *vnni_buffer_for(int64_t k) {
    return grown((void **)&vnni_buffer, &vnni_buffer_bytes, vnni_strip_bytes(k)) ? vnni_buffer
                                                                                : NULL;
}

/* Each row's sums of its int8 activations over groups of 32 inputs, [rows][kp / 32] (`bsum`'s
 * pairs, at most 32 x 127 in magnitude): the 8-group K-quants' offsets then take two groups a
 * `vpdpwssd` (the same integers; half the multiplies of pairs of 16s). The calling thread's
 * buffer; NULL where it could not grow. */
static int16_t *group_sums(const int16_t *bsum, int64_t rows, int64_t kp) {
    static __thread int16_t *buffer;
    static __thread int64_t bytes;
    if (!grown((void **)&buffer, &bytes, rows * (kp / 32) * (int64_t)sizeof *buffer)) return NULL;
    for (int64_t i = 0; i < rows * (kp / 32); i++) buffer[i] = (int16_t)(bsum[2 * i] + bsum[2 * i + 1]);
    return buffer;
}

#ifdef AMX_GEMM
/* Each row's 128 x (the sum of its int8 activations) a super-block, [rows][k / 256], or for
 * `row_scales` (`q8_256_channels_amx`, whose sums run through all of k) a row, [rows][1]: what
 * the tiles' sums over levels stored plus 128 hold in excess, added up once a product rather
 * than once a strip. The calling thread's buffer; NULL where it could not grow. */
static int32_t *superblock_offsets(const int16_t *bsum, int64_t rows, int64_t k, int64_t kp,
                                   int row_scales) {
    static __thread int32_t *buffer;
    static __thread int64_t bytes;
    int64_t blocks = k / 256, need = rows * (row_scales ? 1 : blocks);
    if (!grown((void **)&buffer, &bytes, need * (int64_t)sizeof *buffer)) return NULL;
    for (int64_t r = 0; r < rows; r++) {
        int32_t row = 0;
        for (int64_t sb = 0; sb < blocks; sb++) {
            const int16_t *sums = bsum + r * (kp / 16) + sb * 16;
            int32_t total = 0;
            for (int i = 0; i < 16; i++) total += sums[i];
            if (!row_scales) buffer[r * blocks + sb] = 128 * total;
            row += 128 * total;
        }
        if (row_scales) buffer[r] = row;
    }
    return buffer;
}

/* Strips [first, last) of a Q8_256_VNNI weight on the tiles: as many at a time as make ~1 MiB
 * of weights (which the L2 holds while each 32 rows of x go through all of them), at most
 * AMX_PANEL; through `q8_256_channels_amx` for `row_scales` (one scale a row of w and of x). */
enum { AMX_PANEL = 8 };
static void q8_256_panels_amx(const uint8_t *w, int64_t row_bytes, int64_t first, int64_t last,
                              int64_t k, const int8_t *xq, const float *xd, const int32_t *offsets,
                              int row_scales, int64_t kp, int64_t rows, void *out, int out_bf16,
                              int64_t out_stride) {
    float tiles[AMX_PANEL][32][32] __attribute__((aligned(64)));
    int64_t strip_step = 32 * row_bytes, panel = (1 << 20) / strip_step;
    panel = panel < 1 ? 1 : panel > AMX_PANEL ? AMX_PANEL : panel;
    for (int64_t st = first; st < last; st += panel) {
        int strips = last - st < panel ? (int)(last - st) : (int)panel;
        vnni_strip s = vnni_strip_of(w, row_bytes, st);
        for (int64_t r0 = 0; r0 < rows; r0 += 32) {
            int mt = rows - r0 < 32 ? (int)(rows - r0) : 32;
            const int8_t *x = xq + r0 * kp;
            const float *x_d = xd + r0 * (kp / 32);
            const int32_t *offset = offsets + r0 * (row_scales ? 1 : k / 256);
            if (row_scales) {
                q8_256_channels_amx(s.levels, strip_step, strips, s.levels_step, s.dm, k, x, x_d,
                                    offset, kp, mt, out, out_bf16, out_stride, r0, 32 * st);
                continue;
            }
            q8_256_tiles_amx(s.levels, strip_step, strips, s.levels_step, s.dm, s.dm_step, k, x,
                             x_d, offset, kp, mt, tiles);
            for (int p = 0; p < strips; p++)
                store_tile(out, out_bf16, out_stride, r0, mt, 32 * (st + p), tiles[p]);
        }
    }
}
#endif

/* `quant_matmul` for weights of n a multiple of 32 (K-quants: k of 256) on the VNNI GEMM (see
 * above): the threads split the strips, Q8_256_VNNI's read as they are, the others unpacked.
 * Returns 0 where a thread could not get its buffer (nothing written then is wrong: the
 * caller's kernel recomputes every output). */
int vnni_matmul(int type, int row_scales, const uint8_t *w, int64_t n, int64_t k,
                int64_t row_bytes, const int8_t *xq, const float *xd, const int16_t *bsum,
                int64_t rows, void *out, int out_bf16, int64_t out_stride, int threads) {
    int64_t kp = act_stride(k), strips = n / 32, kc = (k + CHUNK - 1) / CHUNK * CHUNK;
    int legacy = !is_superblock(type), packed = type == Q8_256_VNNI, tile_rows = legacy ? 2 : VNNI_ROWS, ok = 1;
    int by_groups = type == Q4_K || type == Q5_K; /* offsets by `group_sums` */
    const int16_t *gsum = by_groups ? group_sums(bsum, rows, kp) : NULL;
    if (by_groups && !gsum) return 0;
#ifdef AMX_GEMM
    int amx = packed && amx_ready(); /* Q8_256_VNNI's strips are the tiles' B layout */
    int32_t *offsets = amx ? superblock_offsets(bsum, rows, k, kp, row_scales) : NULL;
    if (amx && !offsets) return 0;
#endif
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(&& : ok)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        uint8_t *buf = packed ? NULL : vnni_buffer_for(kc);
        if (!buf && !packed) {
            ok = 0;
        } else {
            vnni_strip s = packed ? vnni_strip_of(w, row_bytes, 0) : vnni_strip_at(buf, kc);
            int64_t last = strips * (t + 1) / parts, tiles = (rows + tile_rows - 1) / tile_rows;
            int64_t first = strips * t / parts;
#ifdef AMX_GEMM
            if (amx) {
                q8_256_panels_amx(w, row_bytes, first, last, k, xq, xd, offsets, row_scales, kp,
                                  rows, out, out_bf16, out_stride);
                first = last;
            }
#endif
            for (int64_t st = first; st < last; st++) {
                if (packed)
                    s = vnni_strip_of(w, row_bytes, st);
                else if (legacy)
                    vnni_pack_legacy(type, w, row_bytes, 32 * st, k, &s);
                else
                    vnni_pack(type, w, row_bytes, 32 * st, k, &s);
                /* The next strip's 32 rows (one run of memory) are asked for a share after each
                 * tile, so that they arrive while this strip computes: read by the pack, 32
                 * rows apart, they had stalled it on memory. Not Q8_256_VNNI's, which the tiles
                 * read in order (asked for, they ran 1.13x slower). */
                const char *next = (const char *)w + 32 * (st + 1) * row_bytes;
                int64_t lines = !packed && st + 1 < last ? 32 * row_bytes / 64 : 0, asked = 0;
                for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
                    for (int64_t upto = lines * (r0 / tile_rows + 1) / tiles; asked < upto; asked++)
                        _mm_prefetch(next + 64 * asked, _MM_HINT_T1);
                    int mt = rows - r0 < tile_rows ? (int)(rows - r0) : tile_rows;
                    float tile[VNNI_ROWS][32];
                    const int8_t *x = xq + r0 * kp;
                    const float *x_d = xd + r0 * (kp / 32);
                    const int16_t *x_sum = bsum + r0 * (kp / 16);
                    if (legacy)
                        vnni_legacy_tile(type, mt, &s, k, x, x_d, x_sum, kp, tile);
                    else
                        vnni_tile(packed ? Q8_256 : type, mt, &s, k, x, x_d, x_sum,
                                  gsum ? gsum + r0 * (kp / 32) : NULL, kp, tile);
                    store_tile(out, out_bf16, out_stride, r0, mt, 32 * st, tile);
                }
            }
        }
    }
    return ok;
}
#endif


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

/* The 32 levels of a Q4_0, Q4_1, Q5_0 or Q5_1 block as int16 lanes (level i in lane i): the 16
 * bytes in both halves, shifted by 0 or 4; plus 16 where bit i of qh is set. `block32_levels`'
 * bytes widened to words took two more shuffles a block (Q4_0 1.16x against 1.28x). */
static inline __attribute__((always_inline)) __m512i block32_level_words(int type,
                                                                        const uint8_t *blk) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + nibbles_at(type)));
    __m512i words = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));
    __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i q = _mm512_and_si512(_mm512_srlv_epi16(words, shifts), _mm512_set1_epi16(15));
    if (type == Q5_0 || type == Q5_1) {
        uint32_t qh;
        memcpy(&qh, blk + fifth_bits_at(type), 4);
        q = _mm512_mask_add_epi16(q, (__mmask32)qh, q, _mm512_set1_epi16(16));
    }
    return q;
}

/* `blocks` consecutive Q4_0, Q4_1, Q5_0 or Q5_1 blocks in bf16, `group_values16`'s values
 * rounded, straight from the row's bytes: a block's possible values (a level times its scale
 * plus its offset) computed once, rounded, then looked up by its 32 levels in one `vpermw`; a
 * 4-bit block's 16 share a table with the next block's. */
static inline __attribute__((always_inline)) void legacy_to_bf16(int type, const uint8_t *blk,
                                                                 int blocks, bf16 *dst) {
    const int five = type == Q5_0 || type == Q5_1, bytes = (int)block_bytes(type);
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 above = _mm512_add_ps(levels, _mm512_set1_ps(16.0f));
    group_scales s; /* block g's at 2g */
    for (int g = 0; g < blocks; g++) block32_scales(type, blk + g * bytes, &s, g);
    __asm__ __volatile__("" : : "m"(s) : "memory"); /* broadcast from memory (`superblock_scales16`) */
    for (int g = 0; g < blocks; g += five ? 1 : 2) {
        int pair = !five && g + 1 < blocks, h = g + pair; /* the table's second block */
        __m512 a = _mm512_set1_ps(s.a[2 * g]), b = _mm512_set1_ps(s.b[2 * g]);
        __m512 second = five ? _mm512_fmadd_ps(above, a, b)
                             : _mm512_fmadd_ps(levels, _mm512_set1_ps(s.a[2 * h]),
                                               _mm512_set1_ps(s.b[2 * h]));
        __m512i table = (__m512i)_mm512_cvtne2ps_pbh(second, _mm512_fmadd_ps(levels, a, b));
        for (int i = 0; i <= pair; i++) { /* the second block's levels index entries 16-31 */
            __m512i q = block32_level_words(type, blk + (g + i) * bytes);
            if (i) q = _mm512_or_si512(q, _mm512_set1_epi16(16));
            _mm512_storeu_si512(dst + 32 * (g + i), _mm512_permutexvar_epi16(q, table));
        }
    }
}

/* `blocks` consecutive Q8_0 blocks in bf16, `group_values16`'s values (level times scale, plus
 * an offset of 0) straight from the row's bytes, without `unpack_chunk`'s copy of the levels
 * and scales. */
static inline __attribute__((always_inline)) void q8_0_to_bf16(const uint8_t *blk, int blocks,
                                                               bf16 *dst) {
    for (int g = 0; g < blocks; g++, blk += block_bytes(Q8_0)) {
        __m512 d = _mm512_set1_ps(f16_to_f32(blk)), zero = _mm512_setzero_ps(), v[2];
        for (int h = 0; h < 2; h++) { /* levels 16h .. 16h + 15 */
            __m128i levels = _mm_loadu_si128((const __m128i *)(blk + 2 + 16 * h));
            v[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(levels)), d, zero);
        }
        _mm512_storeu_si512(dst + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(v[1], v[0]));
    }
}

/* A row's weights [first, first + count) (`unpack_chunk`'s) in bf16, rounded to nearest even,
 * at dst. */
static inline __attribute__((always_inline)) void chunk_to_bf16(int type, const uint8_t *row,
                                                                int64_t first, int64_t count,
                                                                bf16 *dst) {
    if (type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1) {
        legacy_to_bf16(type, row + (first >> 5) * block_bytes(type), (int)(count / 32), dst);
        return;
    }
    if (type == Q8_0) {
        q8_0_to_bf16(row + (first >> 5) * block_bytes(type), (int)(count / 32), dst);
        return;
    }
    chunk c;
    unpack_chunk(type, row, first, count, &c);
    for (int g = 0; g < count / 16; g += 2)
        _mm512_storeu_si512(dst + 16 * g, (__m512i)_mm512_cvtne2ps_pbh(group_values16(&c, g + 1),
                                                                        group_values16(&c, g)));
}

/* Weight rows [j0, j0 + 16) dequantized to bf16 (rounded to nearest even) in `gemm_bf16`'s
 * packing of a block of 16 outputs: input pair p of row j at [p][j][2]. A chunk of 256 inputs at
 * a time: each row's pairs into `pairs`, then the 16 rows' pair p side by side. */
static inline __attribute__((always_inline)) void pack_block16_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t k, bf16 *dst) {
    uint32_t pairs[16][CHUNK / 2];
    for (int64_t first = 0; first < k; first += CHUNK) {
        int64_t count = k - first < CHUNK ? k - first : CHUNK;
        for (int64_t j = 0; j < 16; j++)
            chunk_to_bf16(type, w + (j0 + j) * row_bytes, first, count, (bf16 *)pairs[j]);
        uint32_t *out = (uint32_t *)dst + first / 2 * 16;
        for (int64_t p0 = 0; p0 < count / 2; p0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(pairs[j] + p0);
            transpose16x16(r);
            for (int p = 0; p < 16; p++) _mm512_storeu_si512(out + 16 * (p0 + p), r[p]);
        }
    }
}

#ifdef VNNI_GEMM
/* `pack_block16_of` for a Q8_256_VNNI weight: a super-block's 4-input step q of block b (16
 * outputs x 4 levels plus 128, one 64-byte row of the strip) holds input pairs 2q and 2q + 1 of
 * the packing, each level times its output's scale as `dequantize_rows` computes it. */
static void pack_block16_vnni(const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t k,
                              bf16 *dst) {
    vnni_strip s = vnni_strip_of(w, row_bytes, j0 / 32);
    int b = (int)(j0 / 16 % 2);
    uint32_t *out = (uint32_t *)dst;
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *levels = s.levels + sb * s.levels_step;
        __m512 d = _mm512_loadu_ps(s.dm + sb * s.dm_step + 16 * b);
        for (int q = 0; q < 64; q++) {
            __m512i v = _mm512_load_si512(levels + (2 * q + b) * 64), bits[4];
            for (int e = 0; e < 4; e++) {
                __m512i level = _mm512_sub_epi32(
                    _mm512_and_si512(_mm512_srli_epi32(v, 8 * e), _mm512_set1_epi32(255)),
                    _mm512_set1_epi32(128));
                __m512 value = _mm512_fmadd_ps(_mm512_cvtepi32_ps(level), d, _mm512_setzero_ps());
                bits[e] = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(value));
            }
            uint32_t *pair = out + 16 * (sb * 128 + 2 * q);
            _mm512_storeu_si512(pair, _mm512_or_si512(bits[0], _mm512_slli_epi32(bits[1], 16)));
            _mm512_storeu_si512(pair + 16, _mm512_or_si512(bits[2], _mm512_slli_epi32(bits[3], 16)));
        }
    }
}
#endif

/* `pack_block16_of` compiled for each common format (`type` a constant in the unpacking). */
static __attribute__((noinline)) void pack_block16(int type, const uint8_t *w, int64_t row_bytes,
                                                   int64_t j0, int64_t k, bf16 *dst) {
    switch (type) {
#ifdef VNNI_GEMM
    case Q8_256_VNNI: pack_block16_vnni(w, row_bytes, j0, k, dst); break;
#endif
    case Q4_K: pack_block16_of(Q4_K, w, row_bytes, j0, k, dst); break;
    case Q6_K: pack_block16_of(Q6_K, w, row_bytes, j0, k, dst); break;
    case Q4_0: pack_block16_of(Q4_0, w, row_bytes, j0, k, dst); break;
    case Q4_1: pack_block16_of(Q4_1, w, row_bytes, j0, k, dst); break;
    case Q5_0: pack_block16_of(Q5_0, w, row_bytes, j0, k, dst); break;
    case Q8_0: pack_block16_of(Q8_0, w, row_bytes, j0, k, dst); break;
    default: pack_block16_of(type, w, row_bytes, j0, k, dst);
    }
}

#ifdef AMX_GEMM
/* `superblock_scales` (the same values into the same struct) computed 16 at a time and left in
 * memory: broadcast from there, not from scalar registers, they stay off the shuffle port the
 * dequantizer's unpacking needs (2x faster a weight). */
static inline __attribute__((always_inline)) void superblock_scales16(int type, const uint8_t *blk,
                                                                      group_scales *s) {
    __m512 a, b;
    if (type == Q8_256) {
        a = _mm512_set1_ps(q8_256_scale(blk));
        b = _mm512_setzero_ps();
    } else if (type == Q2_K) {
        a = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(blk + 80)),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q2k_scales_m128(blk))));
        b = _mm512_mul_ps(_mm512_set1_ps(-f16_to_f32(blk + 82)),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q2k_mins_m128(blk))));
    } else if (has_signed_scales(type)) {
        a = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(blk + signed_d_at(type))),
                          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(signed_scales_m128(type, blk))));
        b = _mm512_mul_ps(_mm512_set1_ps(-signed_offset(type)), a);
    } else { /* Q4_K, Q5_K: 8 scales and mins, each taken by two groups of 16 */
        uint64_t sc, mins;
        k4_scales_mins(blk, &sc, &mins);
        __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        a = _mm512_mul_ps(_mm512_set1_ps(f16_to_f32(blk)),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                              _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)sc), pairs))));
        b = _mm512_mul_ps(_mm512_set1_ps(-f16_to_f32(blk + 2)),
                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                              _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mins), pairs))));
    }
    _mm512_storeu_ps(s->a, a);
    _mm512_storeu_ps(s->b, b);
    __asm__ __volatile__("" : : "m"(*s) : "memory"); /* read back from memory */
}

/* A Q4_K super-block in bf16, `chunk_to_bf16`'s values: a group's 16 possible values (a level
 * times its scale plus its offset, rounded) computed once, then looked up by each of its 32
 * levels, two groups' tables in one `vpermw`. */
static inline __attribute__((always_inline)) void q4_k_to_bf16(const uint8_t *blk, bf16 *dst) {
    group_scales s;
    superblock_scales16(Q4_K, blk, &s);
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int g = 0; g < 8; g += 2) { /* groups of 32 g (low nibbles) and g + 1 (high) */
        __m512i table = (__m512i)_mm512_cvtne2ps_pbh(
            _mm512_fmadd_ps(levels, _mm512_set1_ps(s.a[2 * g + 2]), _mm512_set1_ps(s.b[2 * g + 2])),
            _mm512_fmadd_ps(levels, _mm512_set1_ps(s.a[2 * g]), _mm512_set1_ps(s.b[2 * g])));
        __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blk + 16 + 16 * g)));
        __m512i low = _mm512_and_si512(q, _mm512_set1_epi16(15));
        __m512i high = _mm512_or_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi16(16));
        _mm512_storeu_si512(dst + 32 * g, _mm512_permutexvar_epi16(low, table));
        _mm512_storeu_si512(dst + 32 * g + 32, _mm512_permutexvar_epi16(high, table));
    }
}

/* A super-block of another K-quant (or Q8_256) in bf16, `chunk_to_bf16`'s values, from its
 * levels in registers (`k_level`). */
static inline __attribute__((always_inline)) void superblock_to_bf16(int type, const uint8_t *blk,
                                                                     bf16 *dst) {
    group_scales s;
    superblock_scales16(type, blk, &s);
#pragma GCC unroll 8 /* `k_level` shares its loads and branches on g: both gone once g is constant */
    for (int g = 0; g < 8; g++) { /* groups 2g and 2g + 1 of 16 */
        __m256i q = k_level(type, blk, g);
        __m512i lo = type == Q8_256 ? _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))
                                    : _mm512_cvtepu8_epi32(_mm256_castsi256_si128(q));
        __m512i hi = type == Q8_256 ? _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))
                                    : _mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1));
        __m512 v0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s.a[2 * g]),
                                    _mm512_set1_ps(s.b[2 * g]));
        __m512 v1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s.a[2 * g + 1]),
                                    _mm512_set1_ps(s.b[2 * g + 1]));
        _mm512_storeu_si512(dst + 32 * g, (__m512i)_mm512_cvtne2ps_pbh(v1, v0));
    }
}

/* Inputs [first, last) of weight rows [j0, j0 + n) (first a multiple of 256) in bf16, as
 * `pack_block16_of` dequantizes them, row-major at dst (rows ks apart): `quant_gemm_amx`'s A
 * tiles. */
static inline __attribute__((always_inline)) void dequantize_rows_bf16_of(
    int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t n, int64_t first,
    int64_t last, int64_t ks, bf16 *dst) {
    int64_t chunk_bytes = block_bytes(type) * (is_superblock(type) ? 1 : CHUNK / 32);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *row = w + (j0 + j) * row_bytes;
        for (int64_t at = first; at < last; at += CHUNK) {
            bf16 *out = dst + j * ks + (at - first);
            if (type == Q4_K)
                q4_k_to_bf16(row + at / CHUNK * chunk_bytes, out);
            else if (is_superblock(type))
                superblock_to_bf16(type, row + at / CHUNK * chunk_bytes, out);
            else
                chunk_to_bf16(type, row, at, last - at < CHUNK ? last - at : CHUNK, out);
        }
    }
}

void dequantize_rows_bf16(int type, const uint8_t *w, int64_t row_bytes, int64_t j0, int64_t n,
                          int64_t first, int64_t last, int64_t ks, bf16 *dst) {
#define DEQUANTIZE(T) dequantize_rows_bf16_of(T, w, row_bytes, j0, n, first, last, ks, dst)
    switch (type) {
    case Q4_K: DEQUANTIZE(Q4_K); break;
    case Q5_K: DEQUANTIZE(Q5_K); break;
    case Q6_K: DEQUANTIZE(Q6_K); break;
    case Q4_0: DEQUANTIZE(Q4_0); break;
    case Q4_1: DEQUANTIZE(Q4_1); break;
    case Q5_0: DEQUANTIZE(Q5_0); break;
    case Q8_0: DEQUANTIZE(Q8_0); break;
    default: DEQUANTIZE(type);
    }
#undef DEQUANTIZE
}
#endif

/* out [rows][n] (rows `out_stride` apart; fp32, or bf16 where `out_bf16`) = x (bf16 [rows][k],
 * rows `x_stride` apart) times a quantized weight w [n][row_bytes] (n a multiple of 16, k of
 * 32): each thread dequantizes 48 outputs' weight rows at a time to bf16 into its part of `work`
 * (DEQUANTIZED_ROWS rows of k + 32 a thread), a buffer the caches hold, and runs them through
 * every row in the bf16 GEMM: a prefill's speed at the weight's quantized bytes. On AMX, weights
 * in rows of blocks go to `quant_gemm_amx` instead (dequantized row-major, with no transposes:
 * the tiles' A). */
void quant_gemm_bf16(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                     const bf16 *x, int64_t rows, int64_t x_stride, void *out, int out_bf16,
                     int64_t out_stride, bf16 *work, int threads) {
    int64_t blocks = n / 16, pairs = k / 2;
#ifdef AMX_GEMM
    int amx = amx_ready();
    if (amx && type != Q8_256_VNNI &&
        quant_gemm_amx(type, w, n, k, row_bytes, x, rows, x_stride, out, out_bf16, out_stride, work,
                       threads))
        return;
#endif
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t nb0 = blocks * t / parts, nb1 = blocks * (t + 1) / parts;
        bf16 *strip = work + t * DEQUANTIZED_ROWS * (k + 32);
        for (int64_t nb = nb0; nb < nb1; nb += 3) {
            int nbs = nb1 - nb < 3 ? (int)(nb1 - nb) : 3;
            for (int b = 0; b < nbs; b++)
                pack_block16(type, w, row_bytes, (nb + b) * 16, k, strip + b * pairs * 32);
#ifdef AMX_GEMM
            if (amx) {
                gemm_bf16_strip_amx(x, rows, x_stride, strip, pairs, out_stride, nb * 16, nbs,
                                    out, out_bf16);
                continue;
            }
#endif
            gemm_bf16_strip(x, rows, x_stride, strip, pairs, out_stride, nb * 16, nbs, out,
                            out_bf16);
        }
    }
}
#endif
