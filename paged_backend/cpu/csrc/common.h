/* Helpers of more than one kernel file (included, not built on its own). */
#ifndef PAGED_BACKEND_COMMON_H
#define PAGED_BACKEND_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif

/* *buffer of at least `need` bytes (64-aligned), grown where smaller (a thread's buffer kept
 * from call to call, *bytes its size); 0 where it could not be. */
static inline int grown(void **buffer, int64_t *bytes, int64_t need) {
    if (need <= *bytes) return 1;
    free(*buffer);
    *buffer = aligned_alloc(64, (size_t)((need + 63) / 64 * 64));
    *bytes = *buffer ? need : 0;
    return *buffer != NULL;
}

/* Row loops of the elementwise ops split over `threads` threads once a step has this many
 * elements: below it, waking the other thread costs more than it saves. A batch-32 decode step
 * of the default model (norms of 18k elements, rotary of 25k) is ~2% faster split than not. */
#define PARALLEL_MIN_ELEMENTS (1 << 12)

/* The row stride of quantized activations (`quantize_activations`), in levels: k rounded up to a
 * super-block, plus one. The extra 256 bytes keep a step's rows off a common L1 set: at strides
 * that are multiples of 2048 (k = 2048, 8192) the rows of a chunk shared 8 ways and were read
 * from L2 (a 32-row Q4_K product ran ~1.3x slower). */
static inline int64_t act_stride(int64_t k) { return (k + 255) / 256 * 256 + 256; }

/* The cache slot of token `key` through a block table: block * block_size + offset, without a
 * division where block_size is a power of two (decode attention asks once per key it reads).
 * Every kernel finds kv head h's row at `slot` at h * cache_head_stride + slot * dim elements of
 * a cache. The torch backend's caches are block-major, [blocks][kv_heads][block_size][dim]: they
 * pass a head stride of block_size * dim and each block id times kv_heads (`ops.kernel_blocks`). */
static inline int64_t slot_of(const int32_t *table, int64_t key, int64_t block_size) {
    if ((block_size & (block_size - 1)) == 0) {
        int shift = __builtin_ctzll((unsigned long long)block_size);
        return ((int64_t)table[key >> shift] << shift) | (key & (block_size - 1));
    }
    return (int64_t)table[key / block_size] * block_size + key % block_size;
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp),
 * written in plain arithmetic so that loops over it vectorise. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round(x / ln 2) */
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return y * two_n;
}

/* `exp_nonpositive` on a vector of W bits (256: AVX2, 512: AVX-512), defined as NAME: the same
 * operations in the same order (the compiler contracts the scalar one's multiply-adds into
 * these fmas), so the same bits. Expanded where the file has included immintrin.h. */
#define EXP_CLAMPED(NAME, W)                                                                       \
    static inline __m##W NAME(__m##W x) {                                                          \
        x = _mm##W##_max_ps(x, _mm##W##_set1_ps(-87.0f));                                          \
        const __m##W magic = _mm##W##_set1_ps(12582912.0f);                                        \
        __m##W n = _mm##W##_sub_ps(_mm##W##_fmadd_ps(x, _mm##W##_set1_ps(1.44269504f), magic),     \
                                   magic);                                                         \
        __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x);                       \
        r = _mm##W##_fmadd_ps(n, _mm##W##_set1_ps(2.12194440e-4f), r);                             \
        __m##W p = _mm##W##_set1_ps(1.9875691500e-4f);                                             \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.3981999507e-3f));                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(8.3334519073e-3f));                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(4.1665795894e-2f));                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.6666665459e-1f));                           \
        p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(5.0000001201e-1f));                           \
        __m##W y = _mm##W##_add_ps(_mm##W##_fmadd_ps(_mm##W##_mul_ps(p, r), r, r),                 \
                                   _mm##W##_set1_ps(1.0f));                                        \
        __m##W##i e = _mm##W##_slli_epi32(                                                         \
            _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23);            \
        return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(e));                                     \
    }

/* fp16 bits at p as fp32 (exact; subnormals normalised, inf and nan kept). */
static inline float f16_to_f32(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
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
#endif
}

/* fp32 to fp16 bits, rounding to nearest even as torch's `.half()` and F16C do (overflow to inf,
 * subnormals kept; a nan becomes a quiet nan). */
static inline uint16_t f32_to_f16(float value) {
#ifdef __F16C__
    return _cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t f, sign, out;
    memcpy(&f, &value, 4);
    sign = (f >> 16) & 0x8000;
    f &= 0x7fffffffu;
    if (f >= 0x47800000u) { /* 2^16 and up, inf, nan */
        out = f > 0x7f800000u ? 0x7e00 : 0x7c00;
    } else if (f < 0x38800000u) { /* below 2^-14: adding 0.5 rounds the subnormal's bits */
        float t;
        memcpy(&t, &f, 4);
        t += 0.5f;
        memcpy(&out, &t, 4);
        out -= 0x3f000000u;
    } else { /* rebias the exponent, round the 13 dropped bits to even */
        out = (f + ((uint32_t)(15 - 127) << 23) + 0xfff + ((f >> 13) & 1)) >> 13;
    }
    return (uint16_t)(sign | out);
#endif
}

typedef uint16_t bf16;

/* GGUF (ggml) block types, by their type ids, and ours (no ggml types, ids past theirs): for
 * `quantization="int8"`, Q8_256, a super-block of 256 int8 levels, then its fp32 scale, and
 * Q8_256_VNNI, the same bytes for 32 outputs at a time laid out as the VNNI GEMM reads them
 * (quant_gemm.c); Q4_0_R8, Q5_0_R8 and Q8_0_R8, the blocks of Q4_0, Q5_0 and Q8_0 with each 8
 * rows' bytes interleaved (quant_ops.c, `interleave_rows8`). */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14, Q8_256 = 64, Q8_256_VNNI = 65, Q4_0_R8 = 66, Q8_0_R8 = 67,
       Q5_0_R8 = 68 };

/* The K-quants (and Q8_256): super-blocks of 256 weights, against the legacy blocks of 32. */
static inline int is_superblock(int type) { return type >= Q2_K && type <= Q8_256_VNNI; }

/* `quant_matmul`'s type, and a quantized part's type word in the fused steps' descriptors
 * (`fused_linear`), carry this bit where the weight has one scale a row and takes activations
 * with one scale a row (`QuantWeight.row_scales`: `quantize_activations`' block 0). */
#define ROW_SCALES 4096

/* The block format whose bytes an interleaved one lays out (the type itself for the others). */
static inline int rows8_base(int type) {
    return type == Q4_0_R8 ? Q4_0 : type == Q5_0_R8 ? Q5_0 : type == Q8_0_R8 ? Q8_0 : type;
}

/* Q2_K, Q3_K and Q6_K: 16 groups of 16 weights a super-block (the others' groups are 32). Q3_K's
 * and Q6_K's scales are signed and their levels offset by a constant (w = d * sc * (q - offset));
 * Q2_K's, as Q4_K's, unsigned with a min a group (w = d * sc * q - dmin * m). */
static inline int has_16_groups(int type) { return type == Q2_K || type == Q3_K || type == Q6_K; }

static inline int has_signed_scales(int type) { return type == Q3_K || type == Q6_K; }

/* Bytes of one block, by type (0: not a block type the kernels read). */
static inline int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: case Q4_0_R8: return 18;
    case Q4_1: return 20;
    case Q5_0: case Q5_0_R8: return 22;
    case Q5_1: return 24;
    case Q8_0: case Q8_0_R8: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case Q8_256: case Q8_256_VNNI: return 260;
    default: return 0;
    }
}

static inline float to_f32(bf16 h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 to_bf16(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return to_f32(to_bf16(f)); }

/* The kernels one file calls from another (`decode_layers` calls them all), declared once here
 * where their definitions also see them, so that the compiler checks each against its calls. */
void rms_norm_f32(const float *, const float *, const float *, float *, float *, int64_t, int64_t,
                  int64_t, float, float, int);
void rms_norm_bf16(const bf16 *, const bf16 *, const bf16 *, bf16 *, bf16 *, int64_t, int64_t,
                   int64_t, float, float, int);
void rotary_f32(float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t, int64_t,
                int);
void rotary_bf16(bf16 *, const bf16 *, const bf16 *, int64_t, int64_t, int64_t, int64_t, int64_t,
                 int);
void act_and_mul_f32(const float *, float *, int64_t, int64_t, int, int);
void act_and_mul_bf16(const bf16 *, bf16 *, int64_t, int64_t, int, int);
void hadamard_rows(void *, int, int64_t, int64_t, int64_t, const float *, int);
void decode_attention_f32(const float *, const float *, const float *, int64_t, int64_t, int64_t,
                          void *, void *, int, int64_t, const int32_t *, int64_t, const int32_t *,
                          const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                          float *, float *, int64_t, int, int64_t, float);
void decode_attention_bf16(const bf16 *, const bf16 *, const bf16 *, int64_t, int64_t, int64_t,
                           bf16 *, bf16 *, int64_t, const int32_t *, int64_t, const int32_t *,
                           const int32_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                           bf16 *, float *, int64_t, int, const int32_t *, int64_t, const float *,
                           const float *, int64_t, int64_t, float);
void linear_f32(const float *, int64_t, int64_t, const float *, int64_t, int64_t, float *, int64_t,
                int);
void linear_blocks_f32(const float *, int64_t, int64_t, int, const uint8_t *, int64_t, int64_t,
                       float *, int64_t, int);
void quantize_activations(const void *, int, int64_t, int64_t, int64_t, int64_t, int8_t *, float *,
                          int16_t *, int);
void quant_matmul(int, const uint8_t *, int64_t, int64_t, int64_t, const int8_t *, const float *,
                  const int16_t *, int64_t, void *, int, int64_t, int);
#ifdef __AVX512BF16__
void gemm_bf16(const bf16 *, int64_t, int64_t, const bf16 *, int64_t, int64_t, void *, int, int);
/* `quant_gemm_bf16`'s `work`: DEQUANTIZED_ROWS weight rows of k + 32 bf16 a thread (the most it
 * dequantizes at a time; `quant.dequantize_work` allocates it). */
#define DEQUANTIZED_ROWS 128
void quant_gemm_bf16(int, const uint8_t *, int64_t, int64_t, int64_t, const bf16 *, int64_t,
                     int64_t, void *, int, int64_t, bf16 *, int);
void prefix_attention_bf16(const bf16 *, int64_t, int64_t, int64_t, const bf16 *, const bf16 *,
                           int64_t, float, float *, float *, float *, int, int64_t, int64_t,
                           int64_t, float);
#endif
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
/* A thread's floats of `prefix_attention_bf16`'s work for each padded key: 16 rows of fp32 scores
 * and of bf16 probabilities (cpu/ops.py's PREFIX_WORK). */
#define PREFIX_WORK 24
#if defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define AMX_GEMM 1
int amx_ready(void);
void gemm_bf16_strip_amx(const bf16 *, int64_t, int64_t, const bf16 *, int64_t, int64_t, int64_t,
                         int, void *, int);
void gemm_bf16_amx(const bf16 *, int64_t, int64_t, const bf16 *, int64_t, int64_t, void *, int, int);
void q8_256_tiles_amx(const uint8_t *, int64_t, int, int64_t, const float *, int64_t, int64_t,
                      const int8_t *, const float *, const int32_t *, int64_t, int, float[][32][32]);
void q8_256_channels_amx(const uint8_t *, int64_t, int, int64_t, const float *, int64_t,
                         const int8_t *, const float *, const int32_t *, int64_t, int, void *, int,
                         int64_t, int64_t, int64_t);
void dequantize_rows_bf16(int, const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, bf16 *);
int quant_gemm_amx(int, const uint8_t *, int64_t, int64_t, int64_t, const bf16 *, int64_t, int64_t,
                   void *, int, int64_t, bf16 *, int);
int quant_glu_amx(int, const uint8_t *, int64_t, int, const uint8_t *, int64_t, int64_t, int64_t,
                  const bf16 *, int64_t, int64_t, bf16 *, int64_t, int, bf16 *, int);
void attention_scores_amx(const bf16 *, int, int64_t, const bf16 *, int64_t, float *, int64_t);
void attention_values_amx(const bf16 *, int, int64_t, const bf16 *, int64_t, int64_t, const float *,
                          float *);
#endif

#ifdef __AVX512F__
/* out[at..at + 16) = v, as `store_output` stores each (its rounding to bf16, in 16 lanes). */
static inline void store_outputs16(void *out, int out_bf16, int64_t at, __m512 v) {
    if (!out_bf16) {
        _mm512_storeu_ps((float *)out + at, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + at), _mm512_cvtepi32_epi16(_mm512_srli_epi32(up, 16)));
}
#endif

/* GeGLU's gelu (tanh approximation) as g * sigmoid(z): 0.5 (1 + tanh(u)) = sigmoid(2u), so
 * z = 2 sqrt(2 / pi) (g + 0.044715 g^3). The vector kernels run these operations in this order
 * (explicit fma: the same bits whatever the compiler contracts). */
#define GELU_SCALE 1.5957691216057308f
#define GELU_CUBIC 0.044715f
static inline float gelu_arg(float g) { return GELU_SCALE * fmaf(GELU_CUBIC * g * g, g, g); }

#ifdef __AVX512BF16__
EXP_CLAMPED(exp_clamped16, 512) /* exp_nonpositive on 16 lanes, the same bits */

static inline __m512 load_bf16x16(const bf16 *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* to_bf16 on 16 lanes, each result in the low half of its 32-bit lane: round to nearest even
 * with denormals kept and NaN made 0x7fc0, as c10::BFloat16 (vcvtneps2bf16 flushes denormals). */
static inline __m512i bf16_bits16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

static inline __m512 round_bf16x16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits16(x), 16));
}

/* bf16(act(g)) * up on 16 lanes, g and up bf16 values (`act_and_mul_bf16`: act(g) = g *
 * sigmoid(z), z = g or `gelu_arg(g)`), before the last rounding: the arithmetic of that kernel's
 * vector loop, whose bits the GEMM that applies it as it stores (`quant_glu_amx`) keeps. */
static inline __m512 act_and_mul16(__m512 g, __m512 up, int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 z = g;
    if (gelu)
        z = _mm512_mul_ps(_mm512_set1_ps(GELU_SCALE),
                          _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(GELU_CUBIC), g), g), g, g));
    __m512 e = exp_clamped16(_mm512_or_ps(z, _mm512_set1_ps(-0.0f))); /* exp(-|z|) */
    __mmask16 positive = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ);
    __m512 sigmoid = _mm512_div_ps(_mm512_mask_blend_ps(positive, e, one), _mm512_add_ps(one, e));
    return _mm512_mul_ps(round_bf16x16(_mm512_mul_ps(g, sigmoid)), up);
}
#endif

#ifdef __AVX2__
/* 8 lanes of fp32 values, from fp32 or (converted exactly) from fp16. */
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif
#endif
