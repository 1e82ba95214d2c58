/* GEMMs on AMX tiles (Xeons from Sapphire Rapids on). bf16: one `tdpbf16ps` multiplies 16 rows
 * by 32 inputs by 16 outputs, 8x the multiply-adds an AVX512-BF16 `vdpbf16ps` does, so a step of
 * many rows (a prefill chunk) runs several times faster than on the vector units. The weights
 * come packed as `gemm_bf16`'s, [n/16][k/2][16][2]: a block's 16 input pairs at a time are
 * exactly a B tile (16 rows of 64 bytes), so the same packing serves both kernels. Exact bf16
 * products, fp32 sums, as the vector kernel; the order of the sums differs, so the last bits may.
 * int8: `tdpbsud` on Q8_256_VNNI strips, whose 4-input steps are B tiles too (`q8_256_tiles_amx`).
 * Attention's two products over packed keys and values (`attention_scores_amx`,
 * `attention_values_amx`), whose packing is the B layout as well.
 *
 * Linux hands the tiles' 8 KB of state to a process only when it asks (`amx_ready`). A thread's
 * tile configuration is its own, and other libraries' kernels load theirs on the same (OpenMP)
 * threads: oneDNN's at each call, llama.cpp's once a thread. So every call loads ours and, when
 * done, puts back the configuration it found (or releases the tiles if there was none).
 */
#include <math.h>
#include <stdlib.h>

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

/* Tiles for `tile_steps`, which multiplies the other way round: 0-3 accumulate 16 outputs a
 * tile row (fp32 of m0 rows of x in 0 and 2, of m1 in 1 and 3), 4-5 hold 16 weight rows of 32
 * inputs (the A tiles), 6-7 x's rows m0 and m1 as B tiles (16 input pairs of 4 * m bytes). */
static void configure_weight_tiles(int m0, int m1) {
    tile_config cfg = {0};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        int m = (t == 1 || t == 3 || t == 7) ? m1 : m0;
        cfg.colsb[t] = t == 4 || t == 5 ? 64 : 4 * m;
        cfg.rows[t] = 16;
    }
    __asm__ __volatile__("" : : "m"(cfg) : "memory"); /* as in `configure_tiles` */
    _tile_loadconfig(&cfg);
}

/* x's rows as B tiles: row tile t (16 rows, the last zero-filled past `rows`) and step s (32
 * inputs) at xt + (t * k / 32 + s) * 512, input pair p of row r at [p][r][2]. Shared by the
 * threads of the calling parallel region, which wait for all of it. */
static void x_as_b_tiles(const bf16 *x, int64_t rows, int64_t x_stride, int64_t k, bf16 *xt) {
    int64_t steps = k / 32, tiles = (rows + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t ts = 0; ts < tiles * steps; ts++) {
        int64_t t = ts / steps, s = ts % steps;
        __m512i r[16];
        for (int j = 0; j < 16; j++)
            r[j] = 16 * t + j < rows ? _mm512_loadu_si512(x + (16 * t + j) * x_stride + 32 * s)
                                     : _mm512_setzero_si512();
        transpose16x16(r);
        for (int p = 0; p < 16; p++) _mm512_store_si512(xt + ts * 512 + 32 * p, r[p]);
    }
}

static inline __m512 widened_bf16(__m256bh v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

/* A gated MLP's pair of blocks (`weight_rows`) whose sums wait for their activation and store,
 * done a unit at a time (`glu_unit`): where the strip has more pairs, between the next pair's
 * tile steps, so that the vector units work while the tiles do (the activation alone had taken
 * ~20% of the kernel at Qwen2.5-0.5B's k of 896, the tiles idle). Units 5t .. 5t + 3: row tile
 * t's bf16(act(gate) * up) for 4 outputs each, each sum rounded to bf16 first as `store_sums`
 * rounds it, then `act_and_mul16` (the bits of the two passes this replaces), on the tiles'
 * layout (an output's 16 rows a vector); unit 5t + 4: its results transposed into out. */
typedef struct {
    float c[4][16][16] __attribute__((aligned(64))); /* tiles 0-3: gate t0, t1, up t0, t1 */
    int32_t y[16][16] __attribute__((aligned(64)));  /* a row tile's results, an output a row */
    bf16 *out;
    int64_t n, r0, col; /* rows r0 + 16t + r of out (n apart), columns col + [0, 16) */
    int m[2], gelu, unit, units;
} glu_pending;

static void glu_unit(glu_pending *p) {
    int t = p->unit / 5, j = p->unit % 5;
    p->unit++;
    if (j < 4) {
        for (int o = 4 * j; o < 4 * j + 4; o++) {
            __m512 g = widened_bf16(_mm512_cvtneps_pbh(_mm512_load_ps(p->c[t][o])));
            __m512 u = widened_bf16(_mm512_cvtneps_pbh(_mm512_load_ps(p->c[2 + t][o])));
            _mm512_store_si512(p->y[o], bf16_bits16(act_and_mul16(g, u, p->gelu)));
        }
        return;
    }
    __m512i y[16];
    for (int o = 0; o < 16; o++) y[o] = _mm512_load_si512(p->y[o]);
    transpose16x16(y); /* y[r]: row r's 16 outputs */
    for (int r = 0; r < p->m[t]; r++)
        _mm256_storeu_si256((__m256i *)(p->out + (p->r0 + 16 * t + r) * p->n + p->col),
                            _mm512_cvtepi32_epi16(y[r]));
}

static void glu_finish(glu_pending *p) {
    while (p->unit < p->units) glu_unit(p);
}

/* Tiles 0-3 += 32-input step s of nb (1 or 2) blocks of 16 weight rows (A tiles from a0 and
 * a1, rows `stride` bytes apart) times one or `two` row tiles of x (B tiles from x0 and x1, 512
 * bf16 a step): tile 2b + t holds block b's sums of row tile t. */
static inline __attribute__((always_inline)) void tile_step(const bf16 *a0, const bf16 *a1,
                                                            int64_t stride, const bf16 *x0,
                                                            const bf16 *x1, int64_t s, int nb,
                                                            int two) {
    _tile_loadd(4, a0 + 32 * s, stride);
    _tile_loadd(6, x0 + 512 * s, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (nb > 1) {
        _tile_loadd(5, a1 + 32 * s, stride);
        _tile_dpbf16ps(2, 5, 6);
    }
    if (two) {
        _tile_loadd(7, x1 + 512 * s, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (nb > 1) _tile_dpbf16ps(3, 5, 7);
    }
}

/* `steps` of `tile_step`, a unit of `beside`'s work (if any) after each. */
static inline __attribute__((always_inline)) void tile_steps(const bf16 *a0, const bf16 *a1,
                                                             int64_t stride, const bf16 *x0,
                                                             const bf16 *x1, int64_t steps,
                                                             int nb, int two, glu_pending *beside) {
    for (int64_t s = 0; s < steps; s++) {
        tile_step(a0, a1, stride, x0, x1, s, nb, two);
        if (beside && beside->unit < beside->units) glu_unit(beside);
    }
}

static inline void zero_sums(int nb, int two) {
    _tile_zero(0);
    if (two) _tile_zero(1);
    if (nb > 1) _tile_zero(2);
    if (nb > 1 && two) _tile_zero(3);
}

/* Accumulator tile t (0-3) into c (rows 64 bytes apart): a tile's number is part of its
 * instruction, so a number known only at run time takes a switch. */
static inline void store_accumulator(int t, float c[16][16]) {
    switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64);
    }
}

/* Accumulator tile t (0-3) from c: `store_accumulator`'s inverse. */
static inline void load_accumulator(int t, float c[16][16]) {
    switch (t) {
    case 0: _tile_loadd(0, c, 64); break;
    case 1: _tile_loadd(1, c, 64); break;
    case 2: _tile_loadd(2, c, 64); break;
    default: _tile_loadd(3, c, 64);
    }
}

/* The sums of nb blocks (tiles 0 .. 2 nb, row tile 1's only where `two`) into sums[t], held
 * there while the tiles do other work, and back (`load_sums`): the same bits. */
static inline void hold_sums(int nb, int two, float (*sums)[16][16]) {
    for (int t = 0; t < 2 * nb; t++)
        if (two || t % 2 == 0) store_accumulator(t, sums[t]);
}

static inline void load_sums(int nb, int two, float (*sums)[16][16]) {
    for (int t = 0; t < 2 * nb; t++)
        if (two || t % 2 == 0) load_accumulator(t, sums[t]);
}

/* `out_bf16` of the strips' kernels: fp32 outputs (0), bf16 (1), or no outputs but each row's
 * running argmax (`quant_argmax_amx`: out a thread's `running_argmax`). */
enum { OUT_ARGMAX = 2 };

/* A thread's argmax so far over the outputs it computed, in column order (its strips are a run
 * of them): row r's largest output in top[r / 16][r % 16] and its column in at[..], the first
 * of equal values, the first NaN where one came (torch.argmax's). Columns past `columns` are
 * left out. */
typedef struct {
    float (*top)[16];
    int32_t (*at)[16];
    int64_t columns;
} running_argmax;

/* `tile_steps`' sums of nb blocks into the running argmax s (rows r0 + 16t + lane, columns col +
 * 16b + [0, 16)). A tile's row o holds output o for 16 rows, one a lane: no transposes. */
static void argmax_sums(int nb, int m1, running_argmax *s, int64_t r0, int64_t col) {
    float c[16][16] __attribute__((aligned(64)));
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < (m1 ? 2 : 1); t++) {
            store_accumulator(2 * b + t, c);
            float *top = s->top[r0 / 16 + t];
            int32_t *at = s->at[r0 / 16 + t];
            __m512 best = _mm512_load_ps(top);
            __m512i where = _mm512_load_si512(at);
            int64_t first = col + 16 * b, count = s->columns - first < 16 ? s->columns - first : 16;
            for (int o = 0; o < count; o++) {
                __m512 v = _mm512_load_ps(c[o]);
                __mmask16 take = (_mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                                  _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) &
                                 _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q);
                best = _mm512_mask_mov_ps(best, take, v);
                where = _mm512_mask_mov_epi32(where, take, _mm512_set1_epi32((int)(first + o)));
            }
            _mm512_store_ps(top, best);
            _mm512_store_si512(at, where);
        }
}

/* `tile_steps`' sums (16 outputs x m rows a tile) transposed into out: rows r0 + 16t + r (m0 of
 * row tile 0, m1 of 1; `n` apart), columns col + 16b + [0, 16); or into a running argmax. */
static void store_sums(int nb, int m0, int m1, void *out, int64_t n, int64_t r0, int64_t col,
                       int out_bf16) {
    if (out_bf16 == OUT_ARGMAX) {
        argmax_sums(nb, m1, (running_argmax *)out, r0, col);
        return;
    }
    float c[16][16] __attribute__((aligned(64)));
    for (int b = 0; b < nb; b++)
        for (int t = 0; t < (m1 ? 2 : 1); t++) {
            store_accumulator(2 * b + t, c);
            __m512i v[16];
            for (int o = 0; o < 16; o++) v[o] = _mm512_load_si512(c[o]);
            transpose16x16(v); /* v[r]: row r's 16 outputs */
            for (int r = 0; r < (t ? m1 : m0); r++) {
                int64_t at = (r0 + 16 * t + r) * n + col + 16 * b;
                if (out_bf16)
                    _mm256_storeu_si256((__m256i *)((bf16 *)out + at),
                                        (__m256i)_mm512_cvtneps_pbh((__m512)v[r]));
                else
                    _mm512_storeu_ps((float *)out + at, (__m512)v[r]);
            }
        }
}

/* The weights whose rows `quant_gemm_amx`'s strips dequantize: one weight's (glu 0), or a gated
 * MLP's gate and up projections (part 0 and 1; glu 1: SiLU, 2: GeGLU), whose strips take 16 rows
 * of the gate, then the same 16 of the up projection, and so on, so that each pair of blocks of
 * 16 holds the sums of 16 act(gate) * up outputs: strip row v is row 16 (v / 32) + v % 16 of part
 * (v / 16) % 2. */
typedef struct {
    int type[2];
    const uint8_t *w[2];
    int64_t row_bytes[2];
    int glu;
} weight_rows;

/* Strip rows [v, v + count), within one block of 16, dequantized as `dequantize_rows_bf16`. */
static inline void strip_rows_bf16(const weight_rows *s, int64_t v, int count, int64_t first,
                                   int64_t last, int64_t ks, bf16 *dst) {
    int p = s->glu ? (int)(v / 16 % 2) : 0;
    int64_t j = s->glu ? v / 32 * 16 + v % 16 : v;
    dequantize_rows_bf16(s->type[p], s->w[p], s->row_bytes[p], j, count, first, last, ks, dst);
}

/* Tiles 0-3, a gated MLP's pair of blocks, into p (whose last pair is done) for `glu_unit`. */
static void glu_hold(glu_pending *p, int gelu, int m0, int m1, bf16 *out, int64_t n, int64_t r0,
                     int64_t col) {
    p->out = out;
    p->n = n;
    p->r0 = r0;
    p->col = col;
    p->m[0] = m0;
    p->m[1] = m1;
    p->gelu = gelu;
    p->unit = 0;
    p->units = m1 ? 10 : 5;
    hold_sums(2, m1 > 0, p->c);
}

/* `weight_strip_on_tiles`' outputs of nb blocks from strip row j0 (whole pairs where s->glu). */
static void store_strip(const weight_rows *s, int nb, int m0, int m1, void *out, int64_t n,
                        int64_t r0, int64_t j0, int out_bf16) {
    if (s->glu) {
        glu_pending p;
        glu_hold(&p, s->glu == 2, m0, m1, (bf16 *)out, n, r0, j0 / 2);
        glu_finish(&p);
    } else
        store_sums(nb, m0, m1, out, n, r0, j0, out_bf16);
}

/* The row tiles' sizes at r0 of `rows`, configured where they changed (*m0, *m1: the last). */
static void row_tiles_at(int64_t r0, int64_t rows, int *m0, int *m1) {
    int a = rows - r0 < 16 ? (int)(rows - r0) : 16;
    int b = rows - r0 - 16 < 16 ? (int)(rows - r0 - 16) : 16;
    if (b < 0) b = 0;
    if (a != *m0 || b != *m1) configure_weight_tiles(a, b ? b : a);
    *m0 = a;
    *m1 = b;
}

/* Asks for share `part` of `parts` of the `count` weight rows from j1 (one run of memory), to
 * arrive while the caller computes. Small steps ask for the next strip's while dequantizing this
 * one's (read as they were needed, 32 rows apart, they had stalled the dequantizing: 32-row steps
 * ran ~1.9x slower from memory than from the caches), a share between each 8 rows (a chunk's
 * share asked for at once filled the line fill buffers, and the asking stalled: a 3B model's
 * linears at 32 rows, 28 layers, 227-236 -> 184-199 ms, ~10% at 4-16 rows); large steps ask for
 * each 4 rows two parts ahead and for the next strip's during their last row tiles (asked for
 * while dequantizing, they were gone from the L2 when needed: x's rows stream through it; a
 * 512-row step of a 3B model's weights ran ~3% faster). */
static inline __attribute__((always_inline)) void ask_for_run(const uint8_t *w, int64_t row_bytes,
                                                             int64_t j1, int64_t count, int part,
                                                             int parts) {
    const char *next = (const char *)(w + j1 * row_bytes);
    int64_t lines = count * row_bytes / 64;
    for (int64_t i = lines * part / parts; i < lines * (part + 1) / parts; i++)
        _mm_prefetch(next + 64 * i, _MM_HINT_T1);
}

/* `ask_for_run` of strip rows [j1, j1 + count): within one block of 16, or whole pairs of
 * blocks (two runs where s->glu). Inlined without fail: GCC takes a function whose only effect
 * is a prefetch for a pure one and drops the calls it has not inlined (it had dropped these). */
static inline __attribute__((always_inline)) void ask_for_rows(const weight_rows *s, int64_t j1,
                                                              int64_t count, int part, int parts) {
    if (!s->glu)
        ask_for_run(s->w[0], s->row_bytes[0], j1, count, part, parts);
    else if (count <= 16)
        ask_for_run(s->w[j1 / 16 % 2], s->row_bytes[j1 / 16 % 2], j1 / 32 * 16 + j1 % 16, count,
                    part, parts);
    else
        for (int p = 0; p < 2; p++)
            ask_for_run(s->w[p], s->row_bytes[p], j1 / 2, count / 2, part, parts);
}

enum { CHUNK_STRIDE = 256 + 32 }; /* a chunk's row stride: a line more, off the rows' L1 set */

/* Unit u (of 2 nb + 1) of readying chunk c (256 inputs) of a strip of nb blocks from strip row
 * j0 in buf (rows CHUNK_STRIDE apart): a share of the next strip's rows (from j1) asked for,
 * then 8 rows dequantized (u < 2 nb). */
static inline __attribute__((always_inline)) void chunk_unit(const weight_rows *src, int64_t j0,
                                                             int64_t j1, int nb, int64_t k, int c,
                                                             int u, int parts, bf16 *buf) {
    ask_for_rows(src, j1, 16 * nb, (2 * nb + 1) * c + u, parts);
    if (u < 2 * nb) {
        int64_t first = 256 * (int64_t)c, last = k - first < 256 ? k : first + 256;
        strip_rows_bf16(src, j0 + 8 * u, 8, first, last, CHUNK_STRIDE, buf + 8 * u * CHUNK_STRIDE);
    }
}

/* Whether a step of `rows` rows of k inputs takes `chunked_strip_on_tiles`: those of up to 32
 * rows, and those whose x (as B tiles) fits in half the L2 (1 MiB; every AMX Xeon so far has 2
 * MiB a core), which reads it once a 32-output strip. Against `weight_strip_on_tiles` (x read
 * once a 128-output strip, the strip dequantized into the L2 before its tile steps, the two not
 * overlapping), alternating in one process (`quant_gemm_bf16`, 2 threads, each shape of the 1B,
 * Qwen2.5-0.5B and Gemma 3 270M Q4_K_M files): x of up to 1 MiB 1.02-1.54x (33-64 rows
 * 1.1-1.5x), 1.5 MiB 0.93-1.25x, 2 MiB or more 0.56-1.01x. A step of 33 rows had taken 1.6x the
 * time of one of 32. */
static int chunked(int64_t rows, int64_t k) {
    return rows <= 32 || rows * k * (int64_t)sizeof(bf16) <= (1 << 20);
}

/* A weight strip's part of `strips_on_tiles` for `chunked` steps: strip rows j0 .. j0 + 16 nb
 * (nb <= 2), dequantized a chunk (256 inputs) at a time into two L1 buffers, each chunk once:
 * the next chunk is readied (`chunk_unit`) between the current one's tile steps, so that the
 * vector units dequantize while the tiles multiply. Each 32 rows of x (a pair of row tiles) go
 * through every chunk; up to 32 rows the sums stay in the tiles, more rows' wait in `held` (4
 * tiles' worth a pair) from one chunk to the next (`hold_sums`, `load_sums`: the same bits). */
static void chunked_strip_on_tiles(const weight_rows *src, int64_t j0, int nb, int64_t k,
                                   const bf16 *xt, int64_t rows, float (*held)[16][16],
                                   void *out, int64_t n, int out_bf16, int *m0, int *m1) {
    enum { CS = CHUNK_STRIDE };
    bf16 chunk[2][32 * CS] __attribute__((aligned(64))); /* chunk c in chunk[c % 2] */
    int64_t steps = k / 32, j1 = j0 + 16 * nb;
    int chunks = (int)((k + 255) / 256), units = 2 * nb + 1, pairs = (int)((rows + 31) / 32);
    int parts = units * chunks; /* of the next strip's bytes: see `ask_for_rows` */
    if (pairs == 1) {
        row_tiles_at(0, rows, m0, m1);
    } else if (*m0 != 16 || *m1 != 16) { /* full row tiles: x's B tiles are zero past its rows */
        configure_weight_tiles(16, 16);
        *m0 = *m1 = 16;
    }
    for (int u = 0; u < units; u++) chunk_unit(src, j0, j1, nb, k, 0, u, parts, chunk[0]);
    for (int c = 0; c < chunks; c++) { /* the next chunk readied between this one's steps */
        int64_t first = 256 * c, last = k - first < 256 ? k : first + 256;
        const bf16 *a = chunk[c % 2];
        bf16 *next = chunk[(c + 1) % 2];
        int u = c + 1 < chunks ? 0 : units, done = 0;
        for (int p = 0; p < pairs; p++) { /* rows r0 .. r0 + 32: top in tile 0, bottom in 1 */
            int64_t r0 = 32 * p, left = rows - r0 - 16;
            int top = rows - r0 < 16 ? (int)(rows - r0) : 16;
            int bottom = left <= 0 ? 0 : left < 16 ? (int)left : 16, two = bottom > 0;
            if (c == 0)
                zero_sums(nb, two);
            else if (pairs > 1)
                load_sums(nb, two, held + 4 * p);
            const bf16 *x0 = xt + (2 * p * steps + first / 32) * 512, *x1 = x0 + steps * 512;
            for (int64_t s = 0; s < (last - first) / 32; s++) {
                tile_step(a, a + 16 * CS, CS * 2, x0, x1, s, nb, two);
                if (++done % pairs == 0 && u < units) /* spread over the pairs' steps */
                    chunk_unit(src, j0, j1, nb, k, c + 1, u++, parts, next);
            }
            if (c + 1 == chunks)
                store_strip(src, nb, top, bottom, out, n, r0, j0, out_bf16);
            else if (pairs > 1)
                hold_sums(nb, two, held + 4 * p);
        }
        while (u < units) chunk_unit(src, j0, j1, nb, k, c + 1, u++, parts, next);
    }
}

/* A weight strip's part of `strips_on_tiles` for steps not `chunked`: strip rows j0 .. j0 +
 * 16 nb, each dequantized once into `strip` (rows ks apart, in L2) kc inputs at a time (all of
 * k but for the longest rows, see `quant_gemm_amx`), then each 32 rows of x run through its
 * 32-output parts in turn, so that those rows' B tiles are read from memory once a strip (a
 * piece); their sums wait in `held` ([row tile][block] of the tiles' layout) from one piece to
 * the next. */
static void weight_strip_on_tiles(const weight_rows *src, int64_t j0, int nb, int64_t k,
                                  const bf16 *xt, int64_t rows, bf16 *strip, int64_t ks,
                                  int64_t kc, float (*held)[16][16], void *out, int64_t n,
                                  int out_bf16, int *m0, int *m1) {
    int64_t steps = k / 32, j1 = j0 + 16 * nb;
    glu_pending pending; /* a gated MLP's last pair: done during the next one's tile steps */
    pending.unit = pending.units = 0;
    for (int64_t k0 = 0; k0 < k; k0 += kc) { /* pieces of k (one, but for the longest rows) */
        int64_t k1 = k - k0 < kc ? k : k0 + kc;
        for (int part = 0; part < 4 * nb; part++) { /* 4 rows at a time */
            if (part + 2 < 4 * nb) ask_for_rows(src, j0 + 4 * (part + 2), 4, 0, 1);
            strip_rows_bf16(src, j0 + 4 * part, 4, k0, k1, ks, strip + 4 * part * ks);
        }
        int64_t tiles = (rows + 31) / 32, asking = k1 < k ? 0 : tiles < 4 ? tiles : 4;
        for (int64_t r0 = 0; r0 < rows; r0 += 32) {
            row_tiles_at(r0, rows, m0, m1);
            const bf16 *x0 = xt + (r0 / 16 * steps + k0 / 32) * 512;
            int64_t before_end = tiles - r0 / 32; /* this row tile's place from the last, 1 for it */
            if (before_end <= asking)
                ask_for_rows(src, j1, 16 * nb, (int)(asking - before_end), (int)asking);
            for (int b = 0; b < nb; b += 2) {
                int pair = nb - b < 2 ? 1 : 2, two = *m1 > 0;
                const bf16 *a = strip + 16 * b * ks;
                float(*sums)[16][16] = held + (r0 / 16 * nb + 2 * b); /* [2b' + t]: block b + b' */
                if (k0 == 0)
                    zero_sums(pair, two);
                else
                    load_sums(pair, two, sums);
                tile_steps(a, a + 16 * ks, ks * 2, x0, x0 + steps * 512, (k1 - k0) / 32, pair, two,
                           &pending);
                if (k1 < k) {
                    hold_sums(pair, two, sums);
                } else if (src->glu) {
                    glu_finish(&pending);
                    glu_hold(&pending, src->glu == 2, *m0, *m1, (bf16 *)out, n, r0,
                             (j0 + 16 * b) / 2);
                } else {
                    store_sums(pair, *m0, *m1, out, n, r0, j0 + 16 * b, out_bf16);
                }
            }
        }
    }
    glu_finish(&pending);
}

/* The calling thread's B tiles of x, grown to the largest step it has served. */
static __thread bf16 *b_tiles;
static __thread int64_t b_tiles_bytes;
/* Each thread's sums held between pieces of k (`weight_strip_on_tiles`), grown likewise. */
static __thread float (*held_sums)[16][16];
static __thread int64_t held_sums_bytes;


/* x times the n strip rows of `src` (k a multiple of 32, n of 16, of 32 where src->glu) on the
 * tiles: x laid out as B tiles once, then each thread dequantizes its strip rows
 * (`strip_rows_bf16`) and runs every row of x through them: 32 at a time, a chunk of inputs at
 * a time, where the step is `chunked`; else 32-128 at a time into its part of `work`. Returns 0
 * where it could not get its buffer (nothing written). */
static int strips_on_tiles(const weight_rows *src, int64_t n, int64_t k, const bf16 *x,
                           int64_t rows, int64_t x_stride, void *out, int out_bf16,
                           int64_t out_stride, bf16 *work, int threads) {
    int64_t need = (rows + 15) / 16 * 16 * k * (int64_t)sizeof(bf16), blocks = n / 16;
    if (!grown((void **)&b_tiles, &b_tiles_bytes, need)) return 0;
    bf16 *xt = b_tiles;
    /* The strip's rows a line further apart than its inputs (at k of 2,048 or more a tile's 16
     * rows had shared an L1 set: 4,096 x 512 rows 1.15x slower). Steps of many rows take up to
     * DEQUANTIZED_ROWS of them a strip, as many as keep it within ~1.25 MiB (with a row tile's
     * x, the L2 holds it): 64 outputs a strip instead of 32 read each row's x half as often.
     * Where a step's x is 4 MiB or more (it streams from the L3 once a strip) and 128 rows would
     * not fit, k runs in pieces of whole 256-input chunks that let them: at k = 8,192 (a down
     * projection) strips of 64 outputs had held the tiles to ~0.7 TFLOP/s a core at 512 rows
     * (pieces of 4,096: 1.15-1.2x; 3,072 x 14,336 in three: 1.56x; at 128 rows and fewer, where
     * x stays in the L2, pieces were 0.94-0.99x). Each strip's sums wait in `held` between pieces,
     * stored and loaded as the tiles hold them: the same bits. */
    int64_t kc = k, span = 2;
    int small = chunked(rows, k);
    for (int64_t pieces = 2; !small && rows * k * 2 >= (4 << 20) && kc > 256 &&
                             DEQUANTIZED_ROWS * (kc + 32) * 2 > (5 << 18);
         pieces++)
        kc = (k / pieces + 255) / 256 * 256;
    int64_t ks = kc + 32;
    while (!small && span < DEQUANTIZED_ROWS / 16 && 16 * (span + 2) * ks * 2 <= (5 << 18))
        span += 2;
    int ok = 1;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(&& : ok)
    {
        x_as_b_tiles(x, rows, x_stride, k, xt);
        int64_t parts = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t per = src->glu ? 2 : 1; /* a thread's blocks: whole pairs where glu */
        int64_t nb0 = blocks / per * t / parts * per, nb1 = blocks / per * (t + 1) / parts * per;
        int64_t held_bytes = small && rows > 32 ? (rows + 31) / 32 * 4 * 1024
                             : kc < k          ? (rows + 31) / 32 * 2 * span * 1024
                                               : 0;
        ok = grown((void **)&held_sums, &held_sums_bytes, held_bytes);
        tile_config before = saved_tiles();
        int m0 = -1, m1 = -1; /* the row tiles configured */
        void *dest = out_bf16 == OUT_ARGMAX ? (void *)((running_argmax *)out + t) : out;
        for (int64_t nb = nb0; ok && nb < nb1; nb += span) {
            int count = nb1 - nb < span ? (int)(nb1 - nb) : (int)span;
            if (small)
                chunked_strip_on_tiles(src, 16 * nb, count, k, xt, rows,
                                       held_sums, dest, out_stride, out_bf16, &m0, &m1);
            else
                weight_strip_on_tiles(src, 16 * nb, count, k, xt, rows,
                                      work + t * DEQUANTIZED_ROWS * ks, ks, kc, held_sums, dest,
                                      out_stride, out_bf16, &m0, &m1);
        }
        restore_tiles(before);
    }
    return ok;
}

/* `quant_gemm_bf16` on the tiles for weights in rows of GGUF blocks (k a multiple of 32, n of
 * 16), with its arguments. */
int quant_gemm_amx(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                   const bf16 *x, int64_t rows, int64_t x_stride, void *out, int out_bf16,
                   int64_t out_stride, bf16 *work, int threads) {
    weight_rows src = {{type, type}, {w, w}, {row_bytes, row_bytes}, 0};
    return strips_on_tiles(&src, n, k, x, rows, x_stride, out, out_bf16, out_stride, work, threads);
}

/* top[r], at[r]: the largest of row r's first `columns` outputs of `quant_gemm_amx` (fp32, the
 * same bits) and its column, the first of equal values, the first NaN where there is one, as
 * torch.argmax of those outputs gives them, without writing them: each thread keeps its strips'
 * running argmax (`argmax_sums`), then the threads' are merged in column order. A greedy step's
 * head writes no logits (32 rows of a 262,144-token vocabulary: 32 MB, written and read back).
 * Returns 0 where the tiles or a buffer were not to be had (nothing written). */
int quant_argmax_amx(int type, const uint8_t *w, int64_t n, int64_t k, int64_t row_bytes,
                     const bf16 *x, int64_t rows, int64_t x_stride, int64_t columns, float *top,
                     int64_t *at, bf16 *work, int threads) {
    int64_t tiles = (rows + 15) / 16, lanes = threads * tiles * 16;
    if (!amx_ready() || type == Q8_256_VNNI) return 0;
    running_argmax *runs = calloc(threads, sizeof *runs);
    float (*tops)[16] = aligned_alloc(64, lanes * sizeof(float));
    int32_t (*ats)[16] = aligned_alloc(64, lanes * sizeof(int32_t));
    int ok = runs && tops && ats;
    for (int64_t i = 0; ok && i < lanes; i++) {
        tops[i / 16][i % 16] = -INFINITY;
        ats[i / 16][i % 16] = 0;
    }
    for (int p = 0; ok && p < threads; p++)
        runs[p] = (running_argmax){tops + p * tiles, ats + p * tiles, columns};
    weight_rows src = {{type, type}, {w, w}, {row_bytes, row_bytes}, 0};
    ok = ok && strips_on_tiles(&src, n, k, x, rows, x_stride, runs, OUT_ARGMAX, 0, work, threads);
    for (int64_t r = 0; ok && r < rows; r++) { /* in column order: a thread without strips never wins */
        float best = -INFINITY;
        int64_t where = 0;
        for (int p = 0; p < threads; p++) {
            float v = runs[p].top[r / 16][r % 16];
            if (best == best && (v > best || v != v)) {
                best = v;
                where = runs[p].at[r / 16][r % 16];
            }
        }
        top[r] = best;
        at[r] = where;
    }
    free(runs);
    free(tops);
    free(ats);
    return ok;
}

/* out [rows][n] (bf16, rows `out_stride` apart) = act(x gate^T) * (x up^T) for a gated MLP's
 * gate and up projections (n rows each, n a multiple of 16; SiLU, or GeGLU where `gelu`), as
 * `quant_gemm_amx` and `act_and_mul_bf16` would give them (the same bits) in one pass: each strip
 * dequantizes the gate's and the up projection's rows of the same 16 outputs in turn
 * (`weight_rows`), and a pair's sums leave the tiles as their outputs (`glu_pending`), so the 2n
 * products a row are never written to memory and read back (Qwen2.5-0.5B's 512-token prefill
 * wrote and read 10 MB of them a layer). Returns 0 where the tiles or the buffer were not to be
 * had (nothing written). */
int quant_glu_amx(int gate_type, const uint8_t *gate, int64_t gate_row_bytes, int up_type,
                  const uint8_t *up, int64_t up_row_bytes, int64_t n, int64_t k, const bf16 *x,
                  int64_t rows, int64_t x_stride, bf16 *out, int64_t out_stride, int gelu,
                  bf16 *work, int threads) {
    weight_rows src = {{gate_type, up_type}, {gate, up}, {gate_row_bytes, up_row_bytes},
                       gelu ? 2 : 1};
    return amx_ready() &&
           strips_on_tiles(&src, 2 * n, k, x, rows, x_stride, out, 1, out_stride, work, threads);
}

/* Tiles 0-3 += inputs [64q, 64q + 64) of a super-block: rows x (and x1, 16 rows on, where m1)
 * of int8 activations (kp bytes apart) times a Q8_256_VNNI strip's levels lv (both blocks of
 * 16 outputs): 16 4-input steps a tile product. */
static inline __attribute__((always_inline)) void inputs_on_tiles(const int8_t *x, const int8_t *x1,
                                                                  int64_t kp, const uint8_t *lv,
                                                                  int q, int m1) {
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

/* Tiles 0-3 = `start` (row tile t's at start[t], for both blocks; tiles 2-3 where m1). */
static inline void sums_from(int32_t start[2][16][16], int m1) {
    _tile_loadd(0, start[0], 64);
    _tile_loadd(1, start[0], 64);
    if (m1) {
        _tile_loadd(2, start[1], 64);
        _tile_loadd(3, start[1], 64);
    }
}

/* Tiles 0-3 into c[row tile][block] (tiles 2-3 where m1). */
static inline void sums_to(int32_t c[2][2][16][16], int m1) {
    _tile_stored(0, c[0][0], 64);
    _tile_stored(1, c[0][1], 64);
    if (m1) {
        _tile_stored(2, c[1][0], 64);
        _tile_stored(3, c[1][1], 64);
    }
}

/* 16 outputs' integer sums times their scales d times the row's activation scale xs, in
 * `vnni_tile_of`'s float sequence (the scales' product first, then one rounded product). */
static inline __m512 rescaled(const int32_t sums[16], const float d[16], __m512 xs) {
    return _mm512_mul_round_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums)),
                               _mm512_mul_ps(_mm512_load_ps(d), xs),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

/* out[p][r][0..32) for rows r < rows (at most 32) of int8 activations (`quantize_activations`:
 * rows kp bytes apart, scales xd; `offsets`: `superblock_offsets`') times `strips` Q8_256_VNNI
 * strips (32 outputs each, `strip_step` bytes apart): a super-block's integer sums on `tdpbsud`
 * (signed activations, levels plus 128: the sums start at -offset), the rest in `vnni_tile_of`'s
 * integer and float sequence, so the bits of the VNNI GEMM. Super-blocks outside, strips inside:
 * a super-block's 8 KB of x stay in the L1 while the strips' weights (which the caller's next
 * rows read again) come from the L2. One strip a call, x read from the L3 for each, had held the
 * tiles to ~1.2-1.5 T-ops/s a core at 512 rows (8 strips: 1.6-1.8). The rescaling of a pair's
 * sums runs a quarter between each of the next pair's tile steps, so that the vector units work
 * while the tiles do (32 rows of a 1B model's linears from memory: 70 -> 64 ms). */
void q8_256_tiles_amx(const uint8_t *levels, int64_t strip_step, int strips, int64_t levels_step,
                      const float *dm, int64_t dm_step, int64_t k, const int8_t *xq,
                      const float *xd, const int32_t *offsets, int64_t kp, int rows,
                      float out[][32][32]) {
    int32_t c[2][2][2][16][16] __attribute__((aligned(64))); /* two strips' sums in turn */
    int32_t start[2][16][16] __attribute__((aligned(64)));   /* -offset, each row's 16 times */
    int m0 = rows < 16 ? rows : 16, m1 = rows - m0;
    int64_t blocks = k / 256, items = blocks * strips; /* (super-block, strip) pairs */
    tile_config before = saved_tiles();
    configure_tiles(m0, m1 ? m1 : 16);
    for (int p = 0; p < strips; p++)
        for (int r = 0; r < rows; r++) memset(out[p][r], 0, sizeof out[p][r]);
    for (int64_t i = 0; i <= items; i++) {
        int64_t sb = i / strips, was = (i - 1) / strips; /* this pair's super-block, the last's */
        const uint8_t *lv = levels + (i % strips) * strip_step + sb * levels_step;
        const int8_t *x = xq + sb * 256, *x1 = x + 16 * kp;
        int last = (int)((i + strips - 1) % strips); /* the previous pair's strip */
        int32_t(*sums)[2][16][16] = c[(i + 1) % 2];  /* its sums */
        const float *d = (const float *)((const uint8_t *)dm + last * strip_step) + was * dm_step;
        if (i < items) {
            if (i % strips == 0) /* the sums start at -offset: the tiles subtract it */
                for (int r = 0; r < rows; r++)
                    _mm512_store_si512(start[r / 16][r % 16],
                                       _mm512_set1_epi32(-offsets[r * blocks + sb]));
            sums_from(start, m1);
        }
        for (int q = 0; q < 4; q++) { /* 64 inputs: 16 4-input steps of both blocks */
            if (i < items) inputs_on_tiles(x, x1, kp, lv, q, m1);
            /* a quarter of the previous pair's rescaling between the tiles' steps, so that the
             * vector units and the tiles work at once */
            for (int r = 8 * q; i > 0 && r < rows && r < 8 * q + 8; r++) {
                __m512 xs = _mm512_set1_ps(xd[r * (kp / 32) + was * 8]);
                float *o = out[last][r];
                for (int b = 0; b < 2; b++) {
                    __m512 v = rescaled(sums[r / 16][b][r % 16], d + 16 * b, xs);
                    _mm512_store_ps(o + 16 * b, _mm512_add_ps(_mm512_load_ps(o + 16 * b), v));
                }
            }
        }
        if (i < items) sums_to(c[i % 2], m1);
    }
    restore_tiles(before);
}

/* Row r's 32 outputs of a strip (its integer sums in c) times the strip's scales d and the row's
 * scale xs, into out at `at`: `rescaled` and the VNNI GEMM's store, so its bits. */
static inline void store_rescaled(int32_t c[2][2][16][16], const float *d, float xs, int r,
                                  void *out, int out_bf16, int64_t at) {
    __m512 s = _mm512_set1_ps(xs);
    for (int b = 0; b < 2; b++)
        store_outputs16(out, out_bf16, at + 16 * b, rescaled(c[r / 16][b][r % 16], d + 16 * b, s));
}

/* `q8_256_tiles_amx` for strips whose outputs each have one scale (every super-block's the
 * same: `int8_weight`'s per-channel scales) and rows of activations with one scale each
 * (`quantize_activations` of whole rows; `offsets`: a row's one total): a strip's integer sums
 * run through all of k in the tiles, starting at -offset, and are rescaled once, so the tiles
 * never wait for a super-block's vector work (1B shapes at 512 rows: 1.15-1.7x the
 * per-super-block kernel). The rows' x (32 x k bytes) stay in the L2 beside the strips' weights.
 * Each strip's outputs go straight to out (rows r0.., columns col + 32 p), rescaled a share of
 * its rows after each super-block of the next strip's tile steps, so that the vector work and
 * its stores (a line of each of 32 output rows) run while the tiles do: rescaled after the strip,
 * into a buffer the caller then stored, they had taken ~20% of a 512-row product at k = 2,048. */
void q8_256_channels_amx(const uint8_t *levels, int64_t strip_step, int strips,
                         int64_t levels_step, const float *dm, int64_t k, const int8_t *xq,
                         const float *xd, const int32_t *offsets, int64_t kp, int rows, void *out,
                         int out_bf16, int64_t out_stride, int64_t r0, int64_t col) {
    int32_t c[2][2][2][16][16] __attribute__((aligned(64))); /* two strips' sums in turn */
    int32_t start[2][16][16] __attribute__((aligned(64)));   /* -offset, each row's 16 times */
    int m0 = rows < 16 ? rows : 16, m1 = rows - m0;
    int64_t blocks = k / 256;
    tile_config before = saved_tiles();
    configure_tiles(m0, m1 ? m1 : 16);
    for (int r = 0; r < rows; r++)
        _mm512_store_si512(start[r / 16][r % 16], _mm512_set1_epi32(-offsets[r]));
    for (int p = 0; p <= strips; p++) {
        const float *d = p ? (const float *)((const uint8_t *)dm + (p - 1) * strip_step) : NULL;
        if (p < strips) {
            const uint8_t *strip = levels + p * strip_step;
            sums_from(start, m1);
            for (int64_t sb = 0; sb < blocks; sb++) {
                const int8_t *x = xq + sb * 256;
                for (int q = 0; q < 4; q++)
                    inputs_on_tiles(x, x + 16 * kp, kp, strip + sb * levels_step, q, m1);
                for (int r = (int)(rows * sb / blocks); p > 0 && r < rows * (sb + 1) / blocks; r++)
                    store_rescaled(c[(p - 1) % 2], d, xd[r * (kp / 32)], r, out, out_bf16,
                                   (r0 + r) * out_stride + col + 32 * (p - 1));
            }
            sums_to(c[p % 2], m1);
        } else {
            for (int r = 0; r < rows; r++)
                store_rescaled(c[(p - 1) % 2], d, xd[r * (kp / 32)], r, out, out_bf16,
                               (r0 + r) * out_stride + col + 32 * (p - 1));
        }
    }
    restore_tiles(before);
}

/* s[i][t] = q_i . k_t for m (<= 16) bf16 query rows (`dim` apart, dim a multiple of 32) and the
 * keys [0, keys) (keys a multiple of 32) packed as `pack_prefix_bf16` does, [keys/16][dim/2][16]
 * [2]: a block of 16 keys' 16 input pairs is a B tile. Rows of s are `s_stride` floats apart.
 * Exact bf16 products and fp32 sums, as `prefix_attention_bf16`'s vector kernel; the order of the
 * sums differs, so the last bits may. */
void attention_scores_amx(const bf16 *q, int m, int64_t dim, const bf16 *kp, int64_t keys,
                          float *s, int64_t s_stride) {
    int64_t block = dim * 16, steps = dim / 32; /* a block's bf16; 32 inputs a step */
    tile_config before = saved_tiles();
    configure_tiles(m, m); /* 0-3 sums, 4 queries or probabilities, 6-7 keys or values */
    for (int64_t b = 0; b < keys / 16; b += 4) { /* 64 keys (the last time 32) a pass */
        const bf16 *kb = kp + b * block;
        int four = keys / 16 - b >= 4;
        _tile_zero(0);
        _tile_zero(1);
        if (four) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t d = 0; d < steps; d++) {
            _tile_loadd(4, q + 32 * d, dim * (int64_t)sizeof(bf16));
            _tile_loadd(6, kb + 512 * d, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, kb + block + 512 * d, 64);
            _tile_dpbf16ps(1, 4, 7);
            if (four) {
                _tile_loadd(6, kb + 2 * block + 512 * d, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_loadd(7, kb + 3 * block + 512 * d, 64);
                _tile_dpbf16ps(3, 4, 7);
            }
        }
        int64_t stride = s_stride * (int64_t)sizeof(float);
        _tile_stored(0, s + 16 * b, stride);
        _tile_stored(1, s + 16 * b + 16, stride);
        if (four) {
            _tile_stored(2, s + 16 * b + 32, stride);
            _tile_stored(3, s + 16 * b + 48, stride);
        }
    }
    restore_tiles(before);
}

/* out[i][d] = inv[i] * sum over t < keys of p[i][t] v_t[d], for m (<= 16) rows of bf16
 * probabilities (`p_stride` apart; keys a multiple of 32) and values packed as
 * `pack_prefix_bf16` does, [keys/2][dim][2] (dim a multiple of 16): 16 key pairs of 16 dims are a
 * B tile. out: fp32 rows `dim` apart. */
void attention_values_amx(const bf16 *p, int m, int64_t p_stride, const bf16 *vp, int64_t dim,
                          int64_t keys, const float *inv, float *out) {
    float c[16][16] __attribute__((aligned(64)));
    int64_t stride = dim * 2 * (int64_t)sizeof(bf16); /* a key pair's row */
    tile_config before = saved_tiles();
    configure_tiles(m, m); /* 0-3 sums, 4 queries or probabilities, 6-7 keys or values */
    for (int64_t d0 = 0; d0 < dim; d0 += 64) { /* 16 rows x 64 dims a pass */
        int nb = dim - d0 < 64 ? (int)(dim - d0) / 16 : 4;
        _tile_zero(0);
        if (nb > 1) _tile_zero(1);
        if (nb > 2) _tile_zero(2);
        if (nb > 3) _tile_zero(3);
        for (int64_t t = 0; t < keys; t += 32) {
            const bf16 *v = vp + t * dim + 2 * d0; /* pair t / 2, dims d0 .. */
            _tile_loadd(4, p + t, p_stride * (int64_t)sizeof(bf16));
            _tile_loadd(6, v, stride);
            _tile_dpbf16ps(0, 4, 6);
            if (nb > 1) {
                _tile_loadd(7, v + 32, stride);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (nb > 2) {
                _tile_loadd(6, v + 64, stride);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (nb > 3) {
                _tile_loadd(7, v + 96, stride);
                _tile_dpbf16ps(3, 4, 7);
            }
        }
        for (int j = 0; j < nb; j++) {
            store_accumulator(j, c);
            for (int i = 0; i < m; i++)
                _mm512_storeu_ps(out + i * dim + d0 + 16 * j,
                                 _mm512_mul_ps(_mm512_load_ps(c[i]), _mm512_set1_ps(inv[i])));
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
