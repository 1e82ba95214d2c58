/* The int8 GEMM of AVX2 CPUs without AVX512-VNNI (Haswell to Skylake, Zen 1-3): steps of many
 * rows of a K-quant weight (`quant_matmul`, GGUF prefill on such a CPU). The tile kernel of
 * `quant_ops.c` spends ~50 instructions on each 256 inputs of an output and a row: per 32
 * inputs a `vpmaddubsw`, a `vpmaddwd` by the group's scale and an add, then a super-block's
 * horizontal sums and its float work, for one output. Here each thread unpacks a strip of 16
 * outputs once a step into a buffer its L2 holds, 4 inputs of 8 outputs a register (one int32
 * lane an output), and runs the step's rows through it:
 * - `vpmaddubsw` of 8 outputs' 4 levels by 4 broadcast activation bytes gives 8 x 2 int16 sums,
 *   added up in int16 for as many 4-input steps as cannot overflow (levels <= 15: a whole group
 *   of 32 inputs; see `int16_steps`), then weighted by the group's scales in one `vpmaddwd`;
 * - a super-block's integer sums come out a lane an output, so its float work (`k_add`'s
 *   sequence, lane by lane) serves 8 outputs at once, with no horizontal sums.
 * The integer sums are exact, whatever their order, and the float sequence is the one-row
 * kernel's, so a row has the same bits in any step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

#ifdef AVX2_GEMM
/* A strip of 16 outputs, two halves (b) of 8, k inputs, super-block sb:
 * - levels: inputs 4p..4p+3 (p < 64) of half b at levels + ((64 sb + p) * 2 + b) * 32: 8 outputs
 *   x 4 bytes;
 * - scale: group g's int16 scale of each output, twice (an int32 lane an output, for
 *   `vpmaddwd`), at scale + ((16 sb + g) * 2 + b) * 8;
 * - mv: the offset weights of 16s 2t and 2t + 1, an int16 pair an output, at
 *   mv + ((8 sb + t) * 2 + b) * 8;
 * - dm: d at dm + (4 sb + b) * 8, mfac at dm + (4 sb + 2 + b) * 8 (see `k_header`). */
enum { STRIP_LEVELS = 64 * 2 * 32, STRIP_SCALES = 16 * 2 * 32, STRIP_MV = 8 * 2 * 32, STRIP_DM = 4 * 32 };
#define STRIP_BYTES (STRIP_LEVELS + STRIP_SCALES + STRIP_MV + STRIP_DM) /* a super-block's */

typedef struct {
    uint8_t *levels;
    int32_t *scale, *mv;
    float *dm;
} avx2_strip;

static avx2_strip avx2_strip_at(uint8_t *buf, int64_t blocks) {
    avx2_strip s;
    s.levels = buf;
    s.scale = (int32_t *)(buf + blocks * STRIP_LEVELS);
    s.mv = (int32_t *)(buf + blocks * (STRIP_LEVELS + STRIP_SCALES));
    s.dm = (float *)(buf + blocks * (STRIP_LEVELS + STRIP_SCALES + STRIP_MV));
    return s;
}

/* r[j]'s 32-bit word i into word j of r[i], for 8 registers (8 x 8 int32 transpose). */
static inline __attribute__((always_inline)) void transpose8x8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
        r[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
    }
}

/* 8 int16 scales as int32 lanes each holding its scale twice (`vpmaddwd` weighs both int16
 * sums of a lane by it). */
static inline __m256i scale_pairs(__m128i scales) {
    __m256i v = _mm256_cvtepi16_epi32(scales);
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}

/* Super-block sb of weight rows [j0, j0 + 16) into the strip: each group's levels of 8 rows
 * (`k_level`) transposed so that each 4 inputs' 8 outputs are adjacent, and the rows' headers
 * (`k_header_of`'s values) spread an int32 lane an output. */
static inline __attribute__((always_inline)) void avx2_pack_of(int type, const uint8_t *w,
                                                               int64_t row_bytes, int64_t j0,
                                                               int64_t sb, const avx2_strip *s) {
    int groups = has_16_groups(type) ? 16 : 8;
    for (int b = 0; b < 2; b++) {
        const uint8_t *blk[8];
        for (int j = 0; j < 8; j++) {
            blk[j] = w + (j0 + 8 * b + j) * row_bytes + sb * block_bytes(type);
            for (int64_t i = 0; i < block_bytes(type); i += 64)
                _mm_prefetch((const char *)blk[j] + 2 * block_bytes(type) + i, _MM_HINT_T0);
        }
        for (int g = 0; g < 8; g++) {
            __m256i r[8];
            for (int j = 0; j < 8; j++) r[j] = k_level(type, blk[j], g);
            transpose8x8(r);
            for (int p = 0; p < 8; p++)
                _mm256_store_si256((__m256i *)(s->levels + ((64 * sb + 8 * g + p) * 2 + b) * 32), r[p]);
        }
        __m256i lo[8], hi[8], mv[8]; /* row j's scales of groups 0-7, 8-15, its offset pairs */
        float d[8], mfac[8];
        for (int j = 0; j < 8; j++) {
            k_header h;
            k_header_of(type, blk[j], &h);
            lo[j] = scale_pairs(_mm256_castsi256_si128(h.lo));
            hi[j] = scale_pairs(_mm256_castsi256_si128(h.hi));
            mv[j] = h.mv; /* int16 lanes 2t, 2t + 1: int32 lane t is the pair of 16s */
            d[j] = _mm_cvtss_f32(h.dm);
            mfac[j] = _mm_cvtss_f32(_mm_movehdup_ps(h.dm));
        }
        transpose8x8(lo);
        transpose8x8(mv);
        for (int g = 0; g < 8; g++) {
            _mm256_store_si256((__m256i *)(s->scale + ((16 * sb + g) * 2 + b) * 8), lo[g]);
            _mm256_store_si256((__m256i *)(s->mv + ((8 * sb + g) * 2 + b) * 8), mv[g]);
        }
        if (groups == 16) {
            transpose8x8(hi);
            for (int g = 0; g < 8; g++)
                _mm256_store_si256((__m256i *)(s->scale + ((16 * sb + 8 + g) * 2 + b) * 8), hi[g]);
        }
        memcpy(s->dm + (4 * sb + b) * 8, d, sizeof d);
        memcpy(s->dm + (4 * sb + 2 + b) * 8, mfac, sizeof mfac);
    }
}

static __attribute__((noinline)) void avx2_pack(int type, const uint8_t *w, int64_t row_bytes,
                                                int64_t j0, int64_t k, const avx2_strip *s) {
#define PACK(T) for (int64_t sb = 0; sb < k / CHUNK; sb++) avx2_pack_of(T, w, row_bytes, j0, sb, s)
    switch (type) {
    case Q2_K: PACK(Q2_K); break;
    case Q3_K: PACK(Q3_K); break;
    case Q4_K: PACK(Q4_K); break;
    case Q5_K: PACK(Q5_K); break;
    default: PACK(Q6_K);
    }
#undef PACK
}

/* 4-input steps whose `vpmaddubsw` sums add up in int16: each adds at most 2 * 127 * the
 * largest level to a lane, which must stay within 32,767 (Q4_K: 8 steps, a whole group). */
static inline int int16_steps(int type) {
    return type == Q4_K ? 8 : type == Q6_K ? 2 : 4; /* levels <= 15, 63; Q5_K 31, Q3_K 7, Q2_K 3 */
}

/* v as it is, never fused with the operation that reads it (GCC contracts a vector product
 * and a sum into one differently rounded instruction). */
static inline __m256 kept(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

#define AVX2_ROWS 2 /* activation rows a tile: 4 int16 and 4 int32 sums, 2 level registers */

/* out[r][0..16) = rows r < R of the activations times the strip, super-block by super-block in
 * `k_add`'s float sequence. */
static inline __attribute__((always_inline)) void avx2_tile_of(
    int type, const int R, const avx2_strip *s, int64_t k, const int8_t *xq, const float *xd,
    const int16_t *bsum, int64_t kp, float out[AVX2_ROWS][16]) {
    const int groups = has_16_groups(type) ? 16 : 8, steps = 64 / groups, flush = int16_steps(type);
    __m256 acc[AVX2_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < k / CHUNK; sb++) {
        __m256i isum[AVX2_ROWS][2], t[AVX2_ROWS][2];
        for (int r = 0; r < R; r++) /* t: each step's first sums replace them */
            isum[r][0] = isum[r][1] = t[r][0] = t[r][1] = _mm256_setzero_si256();
        for (int g = 0; g < groups; g++) {
            const uint8_t *lv = s->levels + (64 * sb + steps * g) * 64;
            const int8_t *x = xq + sb * CHUNK + 4 * steps * g;
            const int32_t *sc = s->scale + (16 * sb + g) * 16;
            for (int q = 0; q < steps; q++) {
                __m256i w0 = _mm256_load_si256((const __m256i *)(lv + 64 * q));
                __m256i w1 = _mm256_load_si256((const __m256i *)(lv + 64 * q + 32));
                for (int r = 0; r < R; r++) {
                    __m256i a = broadcast4(x + r * kp + 4 * q);
                    __m256i p0 = _mm256_maddubs_epi16(w0, a), p1 = _mm256_maddubs_epi16(w1, a);
                    t[r][0] = q % flush ? _mm256_add_epi16(t[r][0], p0) : p0;
                    t[r][1] = q % flush ? _mm256_add_epi16(t[r][1], p1) : p1;
                    /* kept as one chain of adds: GCC made a tree of the unrolled steps' sums,
                     * whose live registers spilled (Q4_K at 512 rows ran 1.2x faster this way) */
                    __asm__("" : "+x"(t[r][0]), "+x"(t[r][1]));
                }
                if (q % flush == flush - 1)
                    for (int r = 0; r < R; r++)
                        for (int b = 0; b < 2; b++)
                            isum[r][b] = _mm256_add_epi32(
                                isum[r][b], _mm256_madd_epi16(t[r][b], _mm256_load_si256((const __m256i *)(sc + 8 * b))));
            }
        }
        for (int h = 0; h < 8; h++) { /* msum: the offsets, by the activations' 16s' sums */
            const int32_t *mv = s->mv + (8 * sb + h) * 16;
            __m256i mv0 = _mm256_load_si256((const __m256i *)mv), mv1 = _mm256_load_si256((const __m256i *)(mv + 8));
            for (int r = 0; r < R; r++) {
                __m256i bb = broadcast4(bsum + r * (kp / 16) + sb * 16 + 2 * h); /* a 16s pair */
                __m256i m0 = _mm256_madd_epi16(mv0, bb), m1 = _mm256_madd_epi16(mv1, bb);
                t[r][0] = h ? _mm256_add_epi32(t[r][0], m0) : m0;
                t[r][1] = h ? _mm256_add_epi32(t[r][1], m1) : m1;
            }
        }
        const float *dm = s->dm + 32 * sb;
        for (int r = 0; r < R; r++) {
            __m256 xs = _mm256_set1_ps(xd[r * (kp / 32) + sb * 8]);
            for (int b = 0; b < 2; b++) {
                __m256 dd = _mm256_mul_ps(_mm256_load_ps(dm + 8 * b), xs);
                __m256 mm = _mm256_mul_ps(_mm256_load_ps(dm + 16 + 8 * b), xs);
                __m256 p0 = kept(_mm256_mul_ps(_mm256_cvtepi32_ps(isum[r][b]), dd));
                __m256 p1 = kept(_mm256_mul_ps(_mm256_cvtepi32_ps(t[r][b]), mm));
                acc[r][b] = _mm256_add_ps(acc[r][b], _mm256_sub_ps(p0, p1));
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(out[r], acc[r][0]);
        _mm256_storeu_ps(out[r] + 8, acc[r][1]);
    }
}

/* `avx2_tile_of` compiled for each format and row count. */
static __attribute__((noinline)) void avx2_tile(int type, int rows, const avx2_strip *s, int64_t k,
                                                const int8_t *xq, const float *xd,
                                                const int16_t *bsum, int64_t kp,
                                                float out[AVX2_ROWS][16]) {
#define TILE(T) (rows == 2 ? avx2_tile_of(T, 2, s, k, xq, xd, bsum, kp, out) \
                           : avx2_tile_of(T, 1, s, k, xq, xd, bsum, kp, out))
    switch (type) {
    case Q2_K: TILE(Q2_K); break;
    case Q3_K: TILE(Q3_K); break;
    case Q4_K: TILE(Q4_K); break;
    case Q5_K: TILE(Q5_K); break;
    default: TILE(Q6_K);
    }
#undef TILE
}

/* Each thread's strip buffer, grown to the largest k it has served. */
static __thread uint8_t *avx2_buffer;
static __thread int64_t avx2_buffer_bytes;

/* Strips [first, last) of the weight into out, each packed once for every row of the step. */
static void avx2_strips(int type, const uint8_t *w, int64_t row_bytes, int64_t first, int64_t last,
                        int64_t k, const int8_t *xq, const float *xd, const int16_t *bsum,
                        int64_t kp, int64_t rows, void *out, int out_bf16, int64_t out_stride) {
    avx2_strip s = avx2_strip_at(avx2_buffer, k / CHUNK);
    for (int64_t st = first; st < last; st++) {
        avx2_pack(type, w, row_bytes, 16 * st, k, &s);
        for (int64_t r0 = 0; r0 < rows; r0 += AVX2_ROWS) {
            int mt = rows - r0 < AVX2_ROWS ? (int)(rows - r0) : AVX2_ROWS;
            float tile[AVX2_ROWS][16];
            avx2_tile(type, mt, &s, k, xq + r0 * kp, xd + r0 * (kp / 32), bsum + r0 * (kp / 16),
                      kp, tile);
            for (int r = 0; r < mt; r++)
                for (int j = 0; j < 16; j++)
                    store_output(out, out_bf16, (r0 + r) * out_stride + 16 * st + j, tile[r][j]);
        }
    }
}

int avx2_matmul(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                const int8_t *xq, const float *xd, const int16_t *bsum, int64_t rows, void *out,
                int out_bf16, int64_t out_stride, int threads) {
    int64_t strips = n / 16;
    int ok = 1;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(&& : ok)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        if (!grown((void **)&avx2_buffer, &avx2_buffer_bytes, k / CHUNK * STRIP_BYTES))
            ok = 0;
        else
            avx2_strips(type, w, row_bytes, strips * t / parts, strips * (t + 1) / parts, k, xq,
                        xd, bsum, act_stride(k), rows, out, out_bf16, out_stride);
    }
    return ok;
}
#endif
