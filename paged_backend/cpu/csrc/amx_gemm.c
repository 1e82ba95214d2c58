/* GEMMs on AMX tiles (Xeons from Sapphire Rapids on). bf16: one `tdpbf16ps` multiplies 16 rows
 * by 32 inputs by 16 outputs, 8x the multiply-adds an AVX512-BF16 `vdpbf16ps` does, so a step of
 * many rows (a prefill chunk) runs several times faster than on the vector units. The weights
 * come packed as `gemm_bf16`'s, [n/16][k/2][16][2]: a block's 16 input pairs at a time are
 * exactly a B tile (16 rows of 64 bytes), so the same packing serves both kernels. Exact bf16
 * products, fp32 sums, as the vector kernel; the order of the sums differs, so the last bits may.
 * int8: `tdpbsud` on Q8_256_VNNI strips, whose 4-input steps are B tiles too (`q8_256_tile_amx`).
 *
 * Linux hands the tiles' 8 KB of state to a process only when it asks (`amx_ready`). A thread's
 * tile configuration is its own, and other libraries' kernels load theirs on the same (OpenMP)
 * threads: oneDNN's at each call, llama.cpp's once a thread. So every call loads ours and, when
 * done, puts back the configuration it found (or releases the tiles if there was none).
 */
#include "common.h"

#ifdef AMX_GEMM
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

/* Whether this process may use the tiles, asking Linux once (from the calling thread, before
 * any parallel region: the grant covers every thread of the process). */
int amx_ready(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state > 0;
}

/* Tiles 0-3 accumulate (16 fp32 or int32 a row), 4-5 hold rows of x (32 bf16 or 64 int8 each),
 * 6-7 a block of weights (16 rows of 64 bytes); tiles 0, 1 and 4 have m0 rows (the first row
 * tile), 2, 3 and 5 have m1 (the second). */
static void configure_tiles(int m0, int m1) {
    tile_config cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 6 ? 16 : (t == 2 || t == 3 || t == 5) ? m1 : m0;
    }
    /* GCC does not see `ldtilecfg` read the struct and may drop stores to it (llama.cpp's
     * AMX kernels load a half-zero configuration and fault that way): the barrier keeps them. */
    __asm__ __volatile__("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* The thread's tile configuration before a call (zeros where none was loaded). */
static inline tile_config saved_tiles(void) {
    tile_config cfg;
    _tile_storeconfig(&cfg);
    __asm__ __volatile__("" : "=m"(cfg) : : "memory"); /* GCC does not see `sttilecfg` write it */
    return cfg;
}

/* Puts back what `saved_tiles` found. */
static inline void restore_tiles(tile_config cfg) {
    if (cfg.palette_id) {
        __asm__ __volatile__("" : : "m"(cfg) : "memory");
        _tile_loadconfig(&cfg);
    } else {
        _tile_release();
    }
}

/* Rows [0, RT * m) of x times blocks [0, CT) at w (`pairs * 32` apart), into c[row tile][block]
 * [m][16]: RT x CT accumulators, each x tile feeding CT products and each weight tile RT. */
static inline __attribute__((always_inline)) void tile_product(const bf16 *x, int64_t x_stride,
                                                               const bf16 *w, int64_t pairs,
                                                               float c[2][2][16][16], const int RT,
                                                               const int CT) {
    int64_t stride = x_stride * (int64_t)sizeof(bf16);
    const bf16 *w1 = w + pairs * 32, *x1 = x + 16 * x_stride;
    _tile_zero(0);
    if (CT > 1) _tile_zero(1);
    if (RT > 1) _tile_zero(2);
    if (RT > 1 && CT > 1) _tile_zero(3);
    for (int64_t p = 0; p < pairs; p += 16) {
        _tile_loadd(4, x + 2 * p, stride);
        _tile_loadd(6, w + p * 32, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (CT > 1) {
            _tile_loadd(7, w1 + p * 32, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (RT > 1) {
            _tile_loadd(5, x1 + 2 * p, stride);
            _tile_dpbf16ps(2, 5, 6);
            if (CT > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0][0], 64);
    if (CT > 1) _tile_stored(1, c[0][1], 64);
    if (RT > 1) _tile_stored(2, c[1][0], 64);
    if (RT > 1 && CT > 1) _tile_stored(3, c[1][1], 64);
}

/* c's rows [0, m) of RT row tiles and CT blocks into out (rows `n` apart, from column col). */
static void store_tiles(float c[2][2][16][16], int m, const int RT, const int CT, void *out,
                        int64_t n, int64_t col, int out_bf16) {
    for (int i = 0; i < RT; i++)
        for (int r = 0; r < m; r++)
            for (int j = 0; j < CT; j++) {
                __m512 v = _mm512_load_ps(c[i][j][r]);
                int64_t at = (16 * i + r) * n + col + 16 * j;
                if (out_bf16)
                    _mm256_storeu_si256((__m256i *)((bf16 *)out + at), (__m256i)_mm512_cvtneps_pbh(v));
                else
                    _mm512_storeu_ps((float *)out + at, v);
            }
}

#define TILE_PRODUCT(RT, CT)                                                                   \
    do {                                                                                       \
        tile_product(xr, x_stride, w, pairs, c, RT, CT);                                       \
        store_tiles(c, m, RT, CT, o, n, col + 16 * b, out_bf16);                               \
    } while (0)

/* out[:, col .. col + 16 * nb) = x [rows] times `nb` packed blocks of 16 outputs, 32 rows by 32
 * outputs at a time (a last tile of fewer rows runs under a configuration of that many), on a
 * thread whose tile configuration the caller saved. */
static void strip_on_tiles(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *strip,
                           int64_t pairs, int64_t n, int64_t col, int nb, void *out, int out_bf16) {
    float c[2][2][16][16] __attribute__((aligned(64)));
    int64_t elem = out_bf16 ? sizeof(bf16) : sizeof(float);
    configure_tiles(16, 16);
    for (int64_t r = 0; r < rows;) {
        int64_t left = rows - r;
        int m = left < 16 ? (int)left : 16, two_rows = left >= 32;
        if (m < 16) configure_tiles(m, m);
        const bf16 *xr = x + r * x_stride;
        void *o = (char *)out + r * n * elem;
        for (int b = 0; b < nb; b += 2) {
            const bf16 *w = strip + b * pairs * 32;
            if (two_rows && b + 1 < nb)
                TILE_PRODUCT(2, 2);
            else if (two_rows)
                TILE_PRODUCT(2, 1);
            else if (b + 1 < nb)
                TILE_PRODUCT(1, 2);
            else
                TILE_PRODUCT(1, 1);
        }
        r += two_rows ? 32 : m;
    }
}

/* `gemm_bf16_strip` on the tiles (`amx_ready` true, k a multiple of 32). */
void gemm_bf16_strip_amx(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *strip,
                         int64_t pairs, int64_t n, int64_t col, int nb, void *out, int out_bf16) {
    tile_config before = saved_tiles();
    strip_on_tiles(x, rows, x_stride, strip, pairs, n, col, nb, out, out_bf16);
    restore_tiles(before);
}

/* out[r][0..32) for rows r < rows (at most 32) of int8 activations (`quantize_activations`: rows
 * kp bytes apart, scales xd, 16-input sums bsum) times a Q8_256_VNNI strip (32 outputs): a
 * super-block's integer sums on `tdpbsud` (signed activations, levels plus 128), the rest in
 * `vnni_tile_of`'s integer and float sequence, so the bits of the VNNI GEMM. */
void q8_256_tile_amx(const uint8_t *levels, int64_t levels_step, const float *dm, int64_t dm_step,
                     int64_t k, const int8_t *xq, const float *xd, const int16_t *bsum, int64_t kp,
                     int rows, float out[32][32]) {
    int32_t c[2][2][16][16] __attribute__((aligned(64)));
    int m0 = rows < 16 ? rows : 16, m1 = rows - m0;
    tile_config before = saved_tiles();
    configure_tiles(m0, m1 ? m1 : 16);
    for (int r = 0; r < rows; r++) memset(out[r], 0, sizeof out[r]);
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *lv = levels + sb * levels_step;
        const int8_t *x = xq + sb * 256, *x1 = x + 16 * kp;
        _tile_zero(0);
        _tile_zero(1);
        if (m1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int q = 0; q < 4; q++) { /* 64 inputs: 16 4-input steps of both blocks */
            _tile_loadd(4, x + 64 * q, kp);
            _tile_loadd(6, lv + 16 * 128 * q, 128);
            _tile_loadd(7, lv + 16 * 128 * q + 64, 128);
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            if (m1) {
                _tile_loadd(5, x1 + 64 * q, kp);
                _tile_dpbsud(2, 5, 6);
                _tile_dpbsud(3, 5, 7);
            }
        }
        _tile_stored(0, c[0][0], 64);
        _tile_stored(1, c[0][1], 64);
        if (m1) {
            _tile_stored(2, c[1][0], 64);
            _tile_stored(3, c[1][1], 64);
        }
        const float *d = dm + sb * dm_step;
        for (int r = 0; r < rows; r++) {
            const int16_t *bs = bsum + r * (kp / 16) + sb * 16;
            int sum = _mm512_reduce_add_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)bs)));
            __m512 xs = _mm512_set1_ps(xd[r * (kp / 32) + sb * 8]);
            for (int b = 0; b < 2; b++) {
                __m512i isum = _mm512_sub_epi32(_mm512_load_si512(c[r / 16][b][r % 16]),
                                                _mm512_set1_epi32(sum * 128));
                __m512 dd = _mm512_mul_ps(_mm512_load_ps(d + 16 * b), xs);
                __m512 v = _mm512_mul_round_ps(_mm512_cvtepi32_ps(isum), dd,
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                _mm512_storeu_ps(out[r] + 16 * b, _mm512_add_ps(_mm512_loadu_ps(out[r] + 16 * b), v));
            }
        }
    }
    restore_tiles(before);
}

/* `gemm_bf16` on the tiles (`amx_ready` true, k a multiple of 32): the threads split the blocks
 * of 16 outputs, and each runs every row through 4 blocks at a time (a weight piece its L2
 * holds while the rows stream through). */
void gemm_bf16_amx(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *wp, int64_t n,
                   int64_t k, void *out, int out_bf16, int threads) {
    int64_t pairs = k / 2, blocks = n / 16;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t nb0 = blocks * t / parts, nb1 = blocks * (t + 1) / parts;
        tile_config before = saved_tiles(); /* once a thread, not once a strip */
        for (int64_t nb = nb0; nb < nb1; nb += 4) {
            int nbs = nb1 - nb < 4 ? (int)(nb1 - nb) : 4;
            strip_on_tiles(x, rows, x_stride, wp + nb * pairs * 32, pairs, n, nb * 16, nbs, out,
                           out_bf16);
        }
        restore_tiles(before);
    }
}
#endif
