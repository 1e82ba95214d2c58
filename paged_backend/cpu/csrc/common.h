/* Helpers of more than one kernel file (included, not built on its own). */
#ifndef PAGED_BACKEND_COMMON_H
#define PAGED_BACKEND_COMMON_H
#include <stdint.h>
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

/* Row loops of the elementwise ops split over `threads` threads once a step has this many
 * elements: below it, waking the other thread costs more than it saves. A batch-32 decode step
 * of the default model (norms of 18k elements, rotary of 25k) is ~2% faster split than not. */
#define PARALLEL_MIN_ELEMENTS (1 << 12)

/* The row stride of quantized activations (`quantize_activations`), in levels: k rounded up to a
 * super-block, plus one. The extra 256 bytes keep a step's rows off a common L1 set: at strides
 * that are multiples of 2048 (k = 2048, 8192) the rows of a chunk shared 8 ways and were read
 * from L2 (a 32-row Q4_K product ran ~1.3x slower). */
static inline int64_t act_stride(int64_t k) { return (k + 255) / 256 * 256 + 256; }

/* The fused decode steps' weights (`decode_layers_f32`, `decode_layers_bf16`): a layer linear's
 * descriptor (`fused_linear`) and a layer's words: the input norm's address, the qkv
 * projection's descriptor, o's, the post-attention norm's address, then gate_up's and down's. */
#define LINEAR_WORDS 14
#define LAYER_WORDS (2 + 4 * LINEAR_WORDS)
void fused_linear(const int64_t *d, const void *x, int bf16_io, int64_t rows, int64_t k, void *y,
                  int64_t n_total, float *act, int64_t max_k, int threads);

/* The cache slot of token `key` through a block table: block * block_size + offset, without a
 * division where block_size is a power of two (decode attention asks once per key it reads). */
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

#ifdef __AVX2__
/* 8 lanes of fp32 values, from fp32 or (converted exactly) from fp16. */
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
#endif
#endif
