/* The bf16 GEMM on AMX tiles (Xeons from Sapphire Rapids on): one `tdpbf16ps` multiplies 16 rows
 * by 32 inputs by 16 outputs, 8x the multiply-adds an AVX512-BF16 `vdpbf16ps` does, so a step of
 * many rows (a prefill chunk) runs several times faster than on the vector units. The weights
 * come packed as `gemm_bf16`'s, [n/16][k/2][16][2]: a block's 16 input pairs at a time are
 * exactly a B tile (16 rows of 64 bytes), so the same packing serves both kernels. Exact bf16
 * products, fp32 sums, as the vector kernel; the order of the sums differs, so the last bits may.
 *
 * Linux hands the tiles' 8 KB of state to a process only when it asks (`amx_ready`). A thread's
 * tile configuration is its own and other libraries' kernels (oneDNN's) load theirs on the same
 * threads, so every call loads ours and releases the tiles when done.
 */
#include "common.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
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

/* Tiles 0-3 accumulate (m rows x 16 fp32), 4-5 hold m rows of x (32 bf16 each), 6-7 a block's
 * 16 input pairs. */
static void configure_tiles(int m) {
    tile_config cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 6 ? 16 : m;
    }
    /* GCC does not see `ldtilecfg` read the struct and may drop stores to it (llama.cpp's
     * AMX kernels load a half-zero configuration and fault that way): the barrier keeps them. */
    __asm__ __volatile__("" : : "m"(cfg) : "memory");
    _tile_loadconfig(&cfg);
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

/* `gemm_bf16_strip` on the tiles (`amx_ready` true, k a multiple of 32): out[:, col .. col +
 * 16 * nb) = x [rows] times `nb` packed blocks of 16 outputs, 32 rows by 32 outputs at a time
 * (a last tile of fewer rows runs under a configuration of that many). */
void gemm_bf16_strip_amx(const bf16 *x, int64_t rows, int64_t x_stride, const bf16 *strip,
                         int64_t pairs, int64_t n, int64_t col, int nb, void *out, int out_bf16) {
    float c[2][2][16][16] __attribute__((aligned(64)));
    int64_t elem = out_bf16 ? sizeof(bf16) : sizeof(float);
    configure_tiles(16);
    for (int64_t r = 0; r < rows;) {
        int64_t left = rows - r;
        int m = left < 16 ? (int)left : 16, two_rows = left >= 32;
        if (m < 16) configure_tiles(m);
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
    _tile_release();
}
#endif
