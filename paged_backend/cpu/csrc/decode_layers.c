/* A decode step through all of a model's layers in one C call (`paged_backend.attention.
 * fused_decode`), on fp32 rows (the `_f32` ops) or bf16 rows (the `_bf16` ops): the same ops in
 * the same order as the layer modules run them on the C ops, so the same bits, without a Python
 * call per op (~270 a step of the default model, 10-20 us each). Llama-family layers, with what
 * Qwen3 and Gemma 2/3 add: q/k head norms, norms of each sublayer's output (Gemma's sandwich),
 * norm weights stored as offsets from 1, GeGLU, a query scale, local rope tables for the
 * sliding-window layers and soft-capped scores.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* A layer linear of the fused steps, from its descriptor of LINEAR_WORDS words: the number of
 * parts (weights side by side in the output: a fused qkv or gate/up projection), the bias address
 * (0: none; fp32 values whatever the rows' dtype), the most rows its GGUF blocks take the int8
 * product for (`QuantLinear.int8_max_rows`), then each part's (type, address, outputs, row
 * bytes): type 0 a float weight, a negative one an fp32 weight in GGUF blocks of type -type
 * (`linear_blocks_f32`: the bits of `linear_f32` on their values), else a GGUF block type (with
 * the ROW_SCALES bit: activations scaled a row) for `quant_matmul`, on activations quantized
 * into `act` (for the part's block size, once for
 * consecutive parts that share it), or, for more bf16 rows, `quant_gemm_bf16` (the weights
 * dequantized into `dequantized`). x [rows][k] and y [rows][n_total] are fp32 (type 0: an fp32
 * weight [n][k] for `linear_f32`) or, with `bf16_io`, bf16 (type 0: the one part, the packed
 * copy `gemm_bf16` reads, which only AVX512-BF16 builds make), each output rounded once as the
 * modules' are. */
static void fused_linear(const int64_t *d, const void *x, int bf16_io, int64_t rows, int64_t k, void *y,
                         int64_t n_total, float *act, int64_t max_k, void *dequantized,
                         int threads) {
    int64_t kp = act_stride(max_k), block = -1, column = 0, elem = bf16_io ? 2 : 4;
    float *xd = act;
    int16_t *bsum = (int16_t *)(xd + rows * kp / 32);
    int8_t *xq = (int8_t *)(bsum + rows * kp / 16);
    for (int64_t p = 0; p < d[0]; p++) {
        const int64_t *part = d + 3 + 4 * p;
        int row_scales = part[0] > 0 && (part[0] & ROW_SCALES);
        int type = (int)(row_scales ? part[0] & ~(int64_t)ROW_SCALES : part[0]);
        void *out = (char *)y + column * elem;
        if (type < 0) { /* an fp32 linear's GGUF blocks: `linear_f32`'s bits */
            linear_blocks_f32(x, rows, k, -type, (const uint8_t *)part[1], part[2], k, out, n_total,
                              threads);
        } else if (type == 0 && !bf16_io) {
            linear_f32(x, rows, k, (const float *)part[1], part[2], k, out, n_total, threads);
        } else if (type == 0) {
#ifdef __AVX512BF16__
            gemm_bf16(x, rows, k, (const uint16_t *)part[1], part[2], k, out, 1, threads);
        } else if (bf16_io && rows > d[2]) {
            quant_gemm_bf16(type, (const uint8_t *)part[1], part[2], k, part[3], x, rows, k, out,
                            1, n_total, dequantized, threads);
#endif
        } else {
            int64_t need = row_scales ? 0 : is_superblock(type) ? 256 : 32;
            if (block != need)
                quantize_activations(x, bf16_io, rows, k, k, need, xq, xd, bsum, threads);
            block = need;
            quant_matmul(type | (row_scales ? ROW_SCALES : 0), (const uint8_t *)part[1], part[2],
                         k, part[3], xq, xd, bsum, rows, out, bf16_io, n_total, threads);
        }
        column += part[2];
    }
    const float *bias = (const float *)d[1];
    if (bias) /* bf16: added to the rounded product and rounded again, as `out + bias` is */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = 0; i < n_total; i++) {
                if (bf16_io) {
                    bf16 *v = (bf16 *)y + r * n_total + i;
                    *v = to_bf16(to_f32(*v) + bias[i]);
                } else {
                    ((float *)y)[r * n_total + i] += bias[i];
                }
            }
}

/* mlp [rows][intermediate] = act(gate) * up of the gate/up projection d (`fused_linear`'s
 * descriptor) on h: in one pass (`quant_glu_amx`, the same bits) where its two GGUF parts run the
 * dequantized bf16 product, else its outputs into gate_up, then `act_and_mul_*`. */
static void gated_mlp(const int64_t *d, const void *h, int bf16_io, int64_t rows, int64_t hidden,
                      void *gate_up, void *mlp, int64_t intermediate, int gelu, float *act,
                      int64_t max_k, void *dequantized, int threads) {
#ifdef AMX_GEMM
    const int64_t *g = d + 3, *u = d + 7; /* the parts' (type, address, outputs, row bytes) */
    if (bf16_io && rows > d[2] && d[0] == 2 && !d[1] && g[0] > 0 && u[0] > 0 &&
        !((g[0] | u[0]) & ROW_SCALES) && g[0] != Q8_256_VNNI && u[0] != Q8_256_VNNI &&
        g[2] == intermediate && u[2] == intermediate && intermediate % 32 == 0 &&
        quant_glu_amx((int)g[0], (const uint8_t *)g[1], g[3], (int)u[0], (const uint8_t *)u[1],
                      u[3], intermediate, hidden, (const bf16 *)h, rows, hidden, (bf16 *)mlp,
                      intermediate, gelu, (bf16 *)dequantized, threads))
        return;
#endif
    fused_linear(d, h, bf16_io, rows, hidden, gate_up, 2 * intermediate, act, max_k, dequantized,
                 threads);
    if (bf16_io)
        act_and_mul_bf16((bf16 *)gate_up, (bf16 *)mlp, rows, intermediate, gelu, threads);
    else
        act_and_mul_f32((float *)gate_up, (float *)mlp, rows, intermediate, gelu, threads);
}

/* A layer's words in `decode_layers`' weights: its input norm's address, q_norm's and k_norm's
 * (0: none), the qkv and o projections' descriptors (`fused_linear`), the norm of attention's
 * output (0: none), the MLP's input norm, the gate_up and down projections' descriptors, the
 * norm of the MLP's output (0: none) and the Hadamard block its down projection's inputs take
 * first (0: none; `MLP.down_hadamard`). A Llama layer's post_attention_layernorm is the MLP's
 * input norm; Gemma's is attention's output norm, its pre/post_feedforward_layernorm the MLP's. */
#define LINEAR_WORDS 15
#define LAYER_WORDS (7 + 4 * LINEAR_WORDS)

/* The dtype's ops: bf16 rows with `bf16_io`, else fp32 ones. */
static void norm_rows(int bf16_io, const void *x, const void *residual, const void *weight,
                      void *out, void *new_residual, int64_t rows, int64_t dim, int64_t x_stride,
                      float eps, float offset, int threads) {
    if (bf16_io)
        rms_norm_bf16(x, residual, weight, out, new_residual, rows, dim, x_stride, eps, offset,
                      threads);
    else
        rms_norm_f32(x, residual, weight, out, new_residual, rows, dim, x_stride, eps, offset,
                     threads);
}

/* The q heads (then the k heads) of each qkv row normed in place by their own weights. */
static void head_norms(int bf16_io, char *qkv, int64_t rows, int64_t row_bytes, const void *q_norm,
                       const void *k_norm, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, float eps, float offset, int threads) {
    int64_t k_at = num_heads * head_dim * (bf16_io ? 2 : 4);
    for (int64_t t = 0; t < rows; t++) {
        char *row = qkv + t * row_bytes;
        norm_rows(bf16_io, row, NULL, q_norm, row, NULL, num_heads, head_dim, head_dim, eps,
                  offset, threads);
        norm_rows(bf16_io, row + k_at, NULL, k_norm, row + k_at, NULL, num_kv_heads, head_dim,
                  head_dim, eps, offset, threads);
    }
}

/* The first n values of each row (rows `stride` apart) times s, rounded once (as `q * s`). */
static void scale_rows(int bf16_io, void *x, int64_t rows, int64_t n, int64_t stride, float s) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n; i++) {
            if (bf16_io) {
                bf16 *v = (bf16 *)x + r * stride + i;
                *v = to_bf16(to_f32(*v) * s);
            } else {
                ((float *)x)[r * stride + i] *= s;
            }
        }
}

/* A decode step through all `num_layers` layers, as the layer modules run it: x [rows, hidden]
 * in (fp32, or bf16 with `bf16_io`), the last layer's output out, and `residual` the residual
 * stream before it. `weights`: LAYER_WORDS words a layer (above). `norm_offset` 1 for norm
 * weights stored as offsets from 1 (Gemma), else 0; `gelu`: GeGLU, else SiLU; `q_scale`: the
 * queries' factor after rotary (Gemma's query_pre_attn_scalar; 1: none); `scale`: attention's;
 * `softcap` > 0: scores capped (Gemma 2). Sliding-window layers (`windows[l]` > 0) take
 * `local_cos`/`local_sin` (Gemma 3's own rope base; else the global tables). `work`: rows *
 * (hidden + qkv width + heads * head_dim + 3 * intermediate) values of the rows' dtype; `act`:
 * rows * kp * 5 / 16 floats (kp: `act_stride` of the widest input) for quantized activations;
 * `dequantized`: `quant_gemm_bf16`'s work for the widest input (bf16 rows only).
 * The rows of `num_seqs` sequences as the decode attention kernels take them; fp32 caches of
 * fp32 rows, or fp16 with `kv_half`; bf16 ones of bf16 rows.
 *
 * Cascade (bf16 on AVX512-BF16 builds, which have the prefix kernel; a shared prefix, as
 * `TorchAttention` runs it): where `prefix_k[l]` is not 0, layer l attends the `num_shared` rows
 * `shared_rows` over its packed prefix (`pack_prefix_bf16`, `prefix_len` tokens;
 * `prefix_k`/`prefix_v` hold the packs' addresses) with prefix_attention_bf16, and the decode
 * kernel merges that result (`prefix_pos`, by row). `prefix_work` holds kv_heads * rows4 * dim
 * bf16 queries, then kv_heads * rows4 * (dim + 1) floats of output and log-sum-exp, then threads
 * * PREFIX_WORK * padded(prefix_len) floats (rows4: num_shared * group rounded up to 4). */
void decode_layers(void *x, void *residual, int bf16_io, int64_t rows, int64_t hidden,
                   const void *cos, const void *sin, const void *local_cos, const void *local_sin,
                   int64_t num_layers, const int64_t *weights, const int64_t *k_caches,
                   const int64_t *v_caches, int kv_half, int64_t cache_head_stride,
                   const int64_t *windows, const int32_t *block_tables, int64_t max_blocks,
                   const int32_t *seq_lens, const int32_t *query_start, int64_t num_seqs,
                   int64_t block_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t rot_dim, int64_t intermediate, float eps, float norm_offset, int gelu,
                   float q_scale, float scale, float softcap, void *work, float *act,
                   void *dequantized, float *scores, int64_t scores_stride, int threads,
                   const int64_t *prefix_k, const int64_t *prefix_v, int64_t prefix_len,
                   const int64_t *shared_rows, int64_t num_shared, const int32_t *prefix_pos,
                   void *prefix_work) {
    int64_t elem = bf16_io ? 2 : 4, q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    int64_t qkv_width = q_size + 2 * kv_size, group = num_heads / num_kv_heads;
    int64_t max_k = hidden > q_size ? hidden : q_size;
    max_k = max_k > intermediate ? max_k : intermediate;
    char *h = work, *qkv = h + rows * hidden * elem, *attn = qkv + rows * qkv_width * elem;
    char *gate_up = attn + rows * q_size * elem, *mlp = gate_up + rows * 2 * intermediate * elem;
    char *q = qkv, *k = q + q_size * elem, *v = k + kv_size * elem;
    int64_t rows4 = (num_shared * group + 3) / 4 * 4;
    float *p_out = NULL, *p_lse = NULL;
#ifdef __AVX512BF16__
    bf16 *q_rows = prefix_work; /* [kv_heads][rows4][dim], each kv head's shared queries */
    p_out = (float *)(q_rows + num_kv_heads * rows4 * head_dim);
    p_lse = p_out + num_kv_heads * rows4 * head_dim;
    float *p_scratch = p_lse + num_kv_heads * rows4;
    if (num_shared) memset(q_rows, 0, num_kv_heads * rows4 * head_dim * sizeof(bf16));
#else
    (void)prefix_v, (void)shared_rows, (void)prefix_work;
    num_shared = 0; /* no prefix kernel: the engine plans no cascade for this build */
#endif
    for (int64_t l = 0; l < num_layers; l++) {
        const int64_t *w = weights + LAYER_WORDS * l;
        const void *in_norm = (const void *)w[0], *q_norm = (const void *)w[1];
        const void *k_norm = (const void *)w[2];
        const int64_t *qkv_proj = w + 3, *o_proj = qkv_proj + LINEAR_WORDS;
        const void *attn_out_norm = (const void *)o_proj[LINEAR_WORDS];
        const void *mlp_in_norm = (const void *)o_proj[LINEAR_WORDS + 1];
        const int64_t *gate_up_proj = o_proj + LINEAR_WORDS + 2;
        const int64_t *down_proj = gate_up_proj + LINEAR_WORDS;
        const void *mlp_out_norm = (const void *)down_proj[LINEAR_WORDS];
        int64_t down_hadamard = down_proj[LINEAR_WORDS + 1];
        if (l == 0) {
            norm_rows(bf16_io, x, NULL, in_norm, h, NULL, rows, hidden, hidden, eps, norm_offset,
                      threads);
            memcpy(residual, x, rows * hidden * elem);
        } else {
            norm_rows(bf16_io, x, residual, in_norm, h, residual, rows, hidden, hidden, eps,
                      norm_offset, threads);
        }
        fused_linear(qkv_proj, h, bf16_io, rows, hidden, qkv, qkv_width, act, max_k, dequantized,
                     threads);
        if (q_norm)
            head_norms(bf16_io, qkv, rows, qkv_width * elem, q_norm, k_norm, num_heads,
                       num_kv_heads, head_dim, eps, norm_offset, threads);
        const void *c = windows[l] > 0 ? local_cos : cos, *s = windows[l] > 0 ? local_sin : sin;
        if (bf16_io)
            rotary_bf16((bf16 *)qkv, c, s, rows, num_heads + num_kv_heads, head_dim, rot_dim,
                        qkv_width, threads);
        else
            rotary_f32((float *)qkv, c, s, rows, num_heads + num_kv_heads, head_dim, rot_dim,
                       qkv_width, threads);
        if (q_scale != 1.0f) scale_rows(bf16_io, qkv, rows, q_size, qkv_width, q_scale);
        if (bf16_io) {
            int cascade = num_shared && prefix_k[l];
#ifdef __AVX512BF16__
            if (cascade) {
                for (int64_t kh = 0; kh < num_kv_heads; kh++)
                    for (int64_t m = 0; m < num_shared; m++)
                        memcpy(q_rows + (kh * rows4 + m * group) * head_dim,
                               (bf16 *)qkv + shared_rows[m] * qkv_width + kh * group * head_dim,
                               group * head_dim * sizeof(bf16));
                prefix_attention_bf16(q_rows, num_kv_heads, rows4, head_dim,
                                      (const bf16 *)prefix_k[l], (const bf16 *)prefix_v[l],
                                      prefix_len, scale, p_out, p_lse, p_scratch, threads, 0, 0,
                                      0, softcap);
            }
#endif
            decode_attention_bf16((bf16 *)q, (bf16 *)k, (bf16 *)v, qkv_width, qkv_width,
                                  qkv_width, (bf16 *)k_caches[l], (bf16 *)v_caches[l],
                                  cache_head_stride, block_tables, max_blocks, seq_lens,
                                  query_start, block_size, num_seqs, num_heads, num_kv_heads,
                                  head_dim, scale, (bf16 *)attn, scores, scores_stride, threads,
                                  cascade ? prefix_pos : NULL, cascade ? prefix_len : 0, p_out,
                                  p_lse, rows4, windows[l], softcap);
        } else {
            decode_attention_f32((float *)q, (float *)k, (float *)v, qkv_width, qkv_width,
                                 qkv_width, (void *)k_caches[l], (void *)v_caches[l], kv_half,
                                 cache_head_stride, block_tables, max_blocks, seq_lens,
                                 query_start, block_size, num_seqs, num_heads, num_kv_heads,
                                 head_dim, scale, (float *)attn, scores, scores_stride, threads,
                                 windows[l], softcap);
        }
        fused_linear(o_proj, attn, bf16_io, rows, q_size, x, hidden, act, max_k, dequantized,
                     threads);
        if (attn_out_norm)
            norm_rows(bf16_io, x, NULL, attn_out_norm, x, NULL, rows, hidden, hidden, eps,
                      norm_offset, threads);
        norm_rows(bf16_io, x, residual, mlp_in_norm, h, residual, rows, hidden, hidden, eps,
                  norm_offset, threads);
        gated_mlp(gate_up_proj, h, bf16_io, rows, hidden, gate_up, mlp, intermediate, gelu, act,
                  max_k, dequantized, threads);
        if (down_hadamard)
            hadamard_rows(mlp, bf16_io, rows, intermediate, down_hadamard, NULL, threads);
        fused_linear(down_proj, mlp, bf16_io, rows, intermediate, x, hidden, act, max_k,
                     dequantized, threads);
        if (mlp_out_norm)
            norm_rows(bf16_io, x, NULL, mlp_out_norm, x, NULL, rows, hidden, hidden, eps,
                      norm_offset, threads);
    }
}
