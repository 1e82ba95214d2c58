"""The C kernels for weights in GGUF block formats (`paged_backend.cpu.quant`), against the `gguf`
package's own dequantizer: every format, on random block bytes (every bit pattern of levels,
scales and high bits), rows that end in a partial chunk, any number of activation rows."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from paged_backend import cpu
from paged_backend.cpu import ops as cpu_ops
from paged_backend.cpu.features import cpu_features
from paged_backend.cpu.quant import (
    BLOCK_FORMATS,
    QuantLinear,
    QuantWeight,
    activation_block,
    activation_stride,
    can_dequantize_to_bf16,
    dequantize,
    glu_serves,
    interleave_rows_,
    quant_argmax_bf16,
    quant_gemm_bf16,
    quant_glu_bf16,
    quant_matmul,
    quantize_activations,
    rows8_built,
    vnni_gemm_built,
    vnni_strips,
)
from paged_backend.gguf.quantize import int8_weight, q8_256_blocks

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler")

# Where each format keeps its fp16 scales (d, and dmin / m): set to sane values, the rest random.
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


# The formats whose bytes are rows of blocks (Q8_256_VNNI: Q8_256's, laid out in strips; the
# `_R8` formats: Q4_0's and Q8_0's, 8 rows interleaved)
ROW_FORMATS = [fmt for fmt in BLOCK_FORMATS if fmt != "Q8_256_VNNI" and not fmt.endswith("_R8")]
needs_rows8 = pytest.mark.skipif(
    not cpu.available() or not rows8_built(), reason="no interleaved-row kernels (AVX2 only)"
)
needs_vnni = pytest.mark.skipif(
    not cpu.available() or not vnni_gemm_built(), reason="no AVX512-VNNI GEMM"
)


def random_weight(fmt: str, rows: int, k: int, seed: int = 0) -> QuantWeight:
    _, per_block, size = BLOCK_FORMATS[fmt]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, k // per_block, size), dtype=np.uint8)
    for at in FP16_FIELDS.get(fmt, ()):
        scales = (rng.standard_normal((rows, k // per_block)) * 0.01).astype(np.float16)
        data[..., at : at + 2] = scales.view(np.uint8).reshape(rows, k // per_block, 2)
    if fmt == "Q8_256":  # its fp32 scale after the levels (-128: the level the quantizer avoids)
        scales = (rng.standard_normal((rows, k // per_block)) * 0.01).astype(np.float32)
        data[..., 256:] = scales.view(np.uint8).reshape(rows, k // per_block, 4)
    return QuantWeight(fmt, torch.from_numpy(data.reshape(rows, -1)), k)


def reference_weight(w: QuantWeight) -> np.ndarray:
    if w.format == "Q8_256":  # not a ggml type: its definition, levels times the block's scale
        blocks = w.data.numpy().reshape(w.out_features, -1, 260)
        levels = blocks[..., :256].view(np.int8).astype(np.float32)
        scales = np.ascontiguousarray(blocks[..., 256:]).view(np.float32)
        return (levels * scales).reshape(w.out_features, -1)
    return gguf_dequantize(w.data.numpy(), GGMLQuantizationType[w.format])


def in_features(fmt: str) -> int:
    """Rows of 2.5 chunks for the 32-weight formats (a partial last chunk), 2 super-blocks else."""
    return 512 if BLOCK_FORMATS[fmt][1] == 256 else 640


def dequantized_activations(x: torch.Tensor, fmt: str) -> np.ndarray:
    """x as the kernels see it for weights of `fmt`: int8 levels times their block's scale."""
    xq, xd, _ = quantize_activations(x, activation_block(fmt))
    k = x.shape[1]
    levels = xq[:, :k].double().numpy()
    return levels * np.repeat(xd.double().numpy(), 32, axis=1)[:, :k]


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_dequantized_rows_are_the_gguf_packages(fmt):
    w = random_weight(fmt, 24, in_features(fmt))
    reference = reference_weight(w)
    assert np.array_equal(dequantize(w).numpy(), reference)
    rows = torch.tensor([5, 0, 23, 5])
    assert np.array_equal(dequantize(w, rows).numpy(), reference[rows.numpy()])


def test_row_ids_out_of_range_raise():
    w = random_weight("Q4_0", 4, 64)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        dequantize(w, torch.tensor([4]))


@pytest.mark.parametrize("block", [256, 32])
def test_k_quant_activations_share_a_scale_per_super_block(block):
    x = torch.randn(2, 512)
    x[0, 300] = 50.0  # an outlier sets the scale of its whole block
    xq, xd, bsum = quantize_activations(x, block)
    per_block = x.view(2, -1, block).abs().amax(-1) / 127
    assert torch.equal(xd[:, :16], per_block.repeat_interleave(block // 32, dim=1))
    assert not xq[:, 512:].any() and not xd[:, 16:].any()  # the rows' padding weighs nothing
    assert torch.equal(bsum.float(), xq.view(2, -1, 16).float().sum(-1))


def test_activations_are_int8_blocks_of_32_with_level_sums():
    x = torch.randn(3, 300)
    x[1, 40:72] = 0.0  # a block of zeros: scale 0, levels 0
    xq, xd, bsum = quantize_activations(x)
    kp = activation_stride(300)  # 300 rounded up to 256, and a super-block more
    assert kp == 768 and xq.shape == (3, kp) and xd.shape == (3, kp // 32)
    assert bsum.shape == (3, kp // 16)
    assert not xq[:, 300:].any() and not xd[:, 10:].any()
    blocks = x[:, :288].view(3, 9, 32)
    scale = blocks.abs().amax(-1) / 127
    assert torch.equal(xd[:, :9], scale)
    expected = torch.round(blocks / scale[..., None]).nan_to_num(0.0)
    assert torch.equal(xq[:, :288].view(3, 9, 32).float(), expected)
    assert torch.equal(bsum[:, :18], xq[:, :288].view(3, 18, 16).sum(-1, dtype=torch.int16))
    assert not bsum[:, 19:].any()  # past k = 300
    assert xq.abs().max() <= 127


def test_activations_of_one_scale_a_row():
    """Block 0 (`row_scales` weights' activations): each row's largest |x| / 127 scales all of
    it, in each 32's slot up to k (0 past it: the padding weighs nothing), levels and 16s' level
    sums as for blocks."""
    x = torch.randn(3, 600)
    x[1, 500] = 40.0  # an outlier coarsens its whole row
    x[2] = 0.0
    xq, xd, bsum = quantize_activations(x, 0)
    scale = x.abs().amax(-1, keepdim=True) / 127
    assert torch.equal(xd[:, :19], scale.expand(3, 19))  # slot 18 holds inputs 576-599
    assert not xd[:, 19:].any() and not xq[:, 600:].any() and not xq[2].any()
    expected = torch.round(x * torch.where(scale > 0, 127 / (scale * 127), 0.0))
    assert (xq[:, :600].float() - expected).abs().max() <= 1  # x * (127 / amax), rounded
    assert xq[1, 500] == 127 and xq[1, :500].abs().max() < 32
    assert torch.equal(bsum[:, :38], xq[:, :608].view(3, 38, 16).sum(-1, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"block must be 0 \(a row\), 32 or 256, got 64"):
        quantize_activations(x, 64)


@needs_vnni
@pytest.mark.parametrize("k", [256, 768])
def test_q8_256_of_one_scale_a_row_is_its_integer_sums_scaled_once_in_any_step(k):
    """`row_scales` Q8_256 (VNNI strips) times activations of one scale a row: every step (1 to
    70 rows, 1 or 2 threads, 10 strips; the head's argmax slices) gives the same bits, the exact
    integer sums of levels times the product of the two scales, fp32 (on AMX,
    `q8_256_channels_amx`: bit for bit; elsewhere the VNNI GEMM adds a super-block's products
    at a time), and in bf16 those rounded once. One super-block (k = 256): a strip's rows are
    all rescaled within the next strip's one step."""
    weight = torch.randn(320, k)
    w = int8_weight(weight, row_scales=True)
    assert w.format == "Q8_256_VNNI" and w.row_scales
    blocks = q8_256_blocks(weight, row_scales=True).data.view(320, k // 256, 260)
    levels = blocks[..., :256].contiguous().view(torch.int8).reshape(320, k).long()
    d = blocks[:, 0, 256:].contiguous().view(torch.float32).view(320)
    x = torch.randn(70, k)
    xq, xd, _ = quantize_activations(x, 0)
    expected = (xq[:, :k].long() @ levels.T).float() * (d[None, :] * xd[:, :1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = quant_matmul(x, [w])
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 3, 16, 40, 70):
                assert torch.equal(quant_matmul(x[:rows], [w]), full[:rows])
        bf16 = quant_matmul(x, [w], torch.bfloat16)
        assert torch.equal(bf16, full.to(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)
    for first, out in QuantLinear([w])._slices(x, 320, 64):  # the head's argmax: its bits too
        assert torch.equal(out, full[:, first : first + 64])
    if can_dequantize_to_bf16([w]):  # past the int8 rows: the same blocks, dequantized
        xb = x.to(torch.bfloat16)
        plain = dataclasses.replace(w, row_scales=False)
        assert torch.equal(quant_gemm_bf16(xb, [w]), quant_gemm_bf16(xb, [plain]))
    amx = cpu.library.load_library().has("q8_256_channels_amx") and "amx_tile" in cpu_features()
    if amx:
        assert torch.equal(full, expected)
    else:
        torch.testing.assert_close(full, expected, rtol=1e-5, atol=1e-5 * expected.abs().max())


@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_matmul_is_the_product_with_the_dequantized_weight(fmt, rows):
    """Exact but for float rounding: the kernels' integer dot products of levels, scaled, are
    the dequantized weight times the dequantized activations (37 rows: past a tile of 32; 64
    outputs: steps of 4 rows on take the VNNI GEMM where it is built)."""
    k = in_features(fmt)
    w = random_weight(fmt, 64, k, seed=rows)
    x = torch.randn(rows, k)
    xs = dequantized_activations(x, fmt)
    expected = xs @ reference_weight(w).astype(np.float64).T
    got = quant_matmul(x, [w]).double().numpy()
    scale = np.abs(xs) @ np.abs(reference_weight(w)).astype(np.float64).T
    assert np.all(np.abs(got - expected) <= 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("rows", [1, 5])
def test_bf16_in_and_out_and_fused_parts_in_adjacent_columns(rows):
    q4, q6 = random_weight("Q4_K", 16, 256, seed=1), random_weight("Q6_K", 8, 256, seed=2)
    x = torch.randn(rows, 256).to(torch.bfloat16)
    both = quant_matmul(x, [q4, q6])
    assert both.shape == (rows, 24)
    assert torch.equal(both[:, :16], quant_matmul(x, [q4])) and torch.equal(
        both[:, 16:], quant_matmul(x, [q6])
    )
    rounded = quant_matmul(x, [q4, q6], torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, both.to(torch.bfloat16))
    bias = torch.randn(24)
    linear = QuantLinear([q4, q6], bias)
    assert torch.allclose(linear(x.float()), both + bias)


needs_bf16_gemm = pytest.mark.skipif(
    not cpu.available() or not cpu.load_library().has("quant_gemm_bf16"),
    reason="no AVX512-BF16 GEMM",
)


@needs_bf16_gemm
@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize(
    ("rows", "threads"), [(1, 1), (9, 2), (32, 2), (33, 1), (70, 2), (300, 1), (900, 2)]
)
def test_dequantized_gemm_is_the_bf16_product_with_the_dequantized_weight(fmt, rows, threads):
    """Each weight rounded to bf16 (nearest even), exact bf16 products, fp32 sums: the bits of
    the bf16 GEMM (`gemm_bf16`) on the dequantized weight, whatever the rows (on AMX tiles a
    chunk of inputs at a time through every row while x fits in 1 MiB, the sums of each 32 rows
    held between chunks past 32, as at 33, 70 and 300; a whole strip at a time past that, as at
    900; partial row tiles and pairs of them) or threads
    (which split the outputs: 160 outputs leave a partial last strip); bf16 out is the fp32
    result rounded once."""
    k = in_features(fmt)
    w = random_weight(fmt, 160, k, seed=rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    assert can_dequantize_to_bf16([w]) and not can_dequantize_to_bf16([random_weight(fmt, 40, k)])
    expected = x.double() @ dequantize(w).to(torch.bfloat16).double().T
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = quant_gemm_bf16(x, [w])
        rounded = quant_gemm_bf16(x, [w], torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    scale = x.double().abs() @ dequantize(w).double().abs().T
    assert torch.all((got.double() - expected).abs() <= 1e-5 * scale + 1e-30)
    assert torch.equal(rounded, got.to(torch.bfloat16))
    packed = cpu_ops.pack_gemm_weight(dequantize(w).to(torch.bfloat16))
    assert torch.equal(got, cpu_ops.gemm(x, packed, torch.float32))


@needs_bf16_gemm
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_dequantized_gemm_of_rows_ending_on_an_odd_block_keeps_the_bf16_gemms_bits(fmt):
    """The 4-bit formats' values are looked up in a table two blocks share: rows of 19 blocks (2
    chunks and 3 blocks) end on a block of their own. The bits of the bf16 GEMM on the
    dequantized weight, at one row and 70 (a chunk at a time on AMX) and at 1,800 (a strip at a
    time)."""
    w = random_weight(fmt, 32, 19 * 32, seed=5)
    packed = cpu_ops.pack_gemm_weight(dequantize(w).to(torch.bfloat16))
    for rows in (1, 70, 1800):
        x = torch.randn(rows, 19 * 32).to(torch.bfloat16)
        assert torch.equal(quant_gemm_bf16(x, [w]), cpu_ops.gemm(x, packed, torch.float32))


@needs_bf16_gemm
@pytest.mark.parametrize(
    ("fmt", "n", "rows", "k"),
    [
        ("Q4_K", 160, 300, 8448),
        ("Q6_K", 160, 300, 8448),
        ("Q8_0", 160, 300, 8448),
        ("Q8_0", 16, 33, 262144),
    ],
)
def test_dequantized_gemm_of_long_rows_in_pieces_keeps_the_bf16_gemms_bits(fmt, n, rows, k):
    """A step whose x is 4 MiB or more at k past ~5,000 runs k in pieces on AMX (the sums held
    between them, `quant_gemm_amx`): 300 rows of 8,448 inputs take pieces of 4,352 and 4,096
    inputs, a partial last row tile, 160 outputs split by 1 or 2 threads; 262,144 inputs take 54
    pieces (where a piece's rounding up to 256 inputs once kept their count, choosing them had
    not ended). The same bits as the bf16 GEMM on the dequantized weight, which sums k in one
    run."""
    w = random_weight(fmt, n, k, seed=3)
    x = torch.randn(rows, k).to(torch.bfloat16)
    packed = cpu_ops.pack_gemm_weight(dequantize(w).to(torch.bfloat16))
    expected = cpu_ops.gemm(x, packed, torch.float32)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(quant_gemm_bf16(x, [w]), expected)
            assert torch.equal(quant_gemm_bf16(x, [w], torch.bfloat16), expected.bfloat16())
    finally:
        torch.set_num_threads(before)


@needs_bf16_gemm
def test_dequantized_gemms_of_two_threads_at_once_keep_their_own_results():
    """Two engines in one process step from two Python threads: each thread's dequantized GEMM
    has buffers of its own (a shared one mixed their weights)."""
    weights = [random_weight("Q4_K", 256, 1024, seed=s) for s in (1, 2)]
    xs = [torch.randn(48, 1024).to(torch.bfloat16) for _ in weights]
    expected = [quant_gemm_bf16(x, [w]) for x, w in zip(xs, weights, strict=True)]
    wrong = []

    def run(i: int) -> None:
        for _ in range(30):
            if not torch.equal(quant_gemm_bf16(xs[i], [weights[i]]), expected[i]):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


needs_glu = pytest.mark.skipif(
    not cpu.available() or not cpu.load_library().has("quant_glu_amx"), reason="no AMX tiles"
)


@needs_glu
@pytest.mark.parametrize(
    ("gate_fmt", "up_fmt", "n", "k"),
    [("Q4_K", "Q4_K", 96, 512), ("Q5_0", "Q8_0", 64, 896), ("Q6_K", "Q4_K", 32, 8448)],
)
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_product_has_the_bits_of_the_dequantized_gemm_and_its_activation(
    gate_fmt, up_fmt, n, k, gelu
):
    """`quant_glu_bf16` (AMX) applies act(gate) * up to each pair of blocks' sums as they leave
    the tiles: the bits of `quant_gemm_bf16` of both weights, then `silu_and_mul` (or
    `gelu_tanh_and_mul`), whatever the formats of the two, the rows (a chunk at a time while x
    fits in 1 MiB, a strip at a time past it, k in pieces for 300 x 8,448) and the threads
    (which split the pairs of blocks: 3 pairs unevenly, 1 pair to one thread)."""
    gate, up = random_weight(gate_fmt, n, k, seed=1), random_weight(up_fmt, n, k, seed=2)
    act = cpu_ops.gelu_tanh_and_mul if gelu else cpu_ops.silu_and_mul
    before = torch.get_num_threads()
    try:
        for rows, threads in [(1, 1), (17, 2), (32, 1), (33, 2), (300, 1), (300, 2), (1100, 2)]:
            torch.set_num_threads(threads)
            x = torch.randn(rows, k).to(torch.bfloat16)
            assert glu_serves(x, gate, up)
            expected = act(quant_gemm_bf16(x, [gate, up], torch.bfloat16))
            assert torch.equal(quant_glu_bf16(x, gate, up, gelu), expected)
    finally:
        torch.set_num_threads(before)


@needs_glu
def test_gated_product_serves_bf16_rows_of_equal_halves_in_pairs_of_blocks():
    x = torch.randn(40, 256).to(torch.bfloat16)
    gate, up = random_weight("Q4_K", 64, 256, seed=1), random_weight("Q4_K", 64, 256, seed=2)
    assert glu_serves(x, gate, up)
    assert not glu_serves(x.float(), gate, up)
    assert not glu_serves(x, gate, random_weight("Q4_K", 32, 256))  # halves of unequal size
    assert not glu_serves(x, *(random_weight("Q4_K", 48, 256, seed=s) for s in (1, 2)))
    assert not glu_serves(x, gate, vnni_strips(random_weight("Q8_256", 64, 256)))


needs_argmax_tiles = pytest.mark.skipif(
    not cpu.available() or not cpu.load_library().has("quant_argmax_amx"), reason="no AMX tiles"
)


def scale_row_(w: QuantWeight, row: int, factor: float) -> None:
    """Weight row `row`'s blocks' first fp16 scale times `factor` (NaN: a row of NaN values)."""
    at, size = FP16_FIELDS[w.format][0], BLOCK_FORMATS[w.format][2]
    blocks = w.data[row].view(-1, size)
    scales = blocks[:, at : at + 2].contiguous().view(torch.float16)
    blocks[:, at : at + 2] = (scales * factor).view(torch.uint8)


@needs_argmax_tiles
@pytest.mark.parametrize(("fmt", "k"), [("Q8_0", 640), ("Q4_K", 512), ("Q6_K", 8448)])
@pytest.mark.parametrize("case", ["random", "tie", "nan"])
def test_argmax_on_the_tiles_is_the_dequantized_gemms_argmax(fmt, k, case):
    """`quant_argmax_bf16` (AMX, no outputs written) gives each row's largest of its first
    `columns` outputs of `quant_gemm_bf16` (the same bits) and the column torch.argmax gives: the
    first of equal values (weight rows 20 and 90 the same, and the largest), the first NaN (NaN
    scales in rows 30 and 70), where two threads split the blocks between those columns,
    whatever the rows (a chunk at a time while x fits in 1 MiB, a strip past it, k in pieces at
    300 x 8,448)
    and where `columns` cuts."""
    n = 96
    w = random_weight(fmt, n, k, seed=k)
    if case == "tie":
        scale_row_(w, 20, 1000.0)
        w.data[90] = w.data[20]
    if case == "nan":
        scale_row_(w, 30, float("nan"))
        scale_row_(w, 70, float("nan"))
    before = torch.get_num_threads()
    try:
        for rows, threads in [(1, 1), (17, 2), (32, 2), (33, 1), (300, 2), (1100, 1)]:
            torch.set_num_threads(threads)
            x = torch.randn(rows, k)
            if case == "tie":  # x near weight row 20 (1000x the others'): its output the largest
                x = dequantize(w)[20] * (1 + 0.1 * x)
            x = x.to(torch.bfloat16)
            outputs = quant_gemm_bf16(x, [w])
            for columns in (n, n - 5, 80):
                top, column = quant_argmax_bf16(x, w, columns)
                expected = outputs[:, :columns].argmax(dim=-1)
                assert torch.equal(column, expected)
                largest = outputs.gather(1, expected[:, None]).squeeze(1)
                torch.testing.assert_close(top, largest, rtol=0, atol=0, equal_nan=True)
            if case != "random":
                assert set(expected.tolist()) == {20 if case == "tie" else 30}
    finally:
        torch.set_num_threads(before)


@needs_argmax_tiles
def test_argmax_on_the_tiles_serves_bf16_rows_of_weights_it_dequantizes():
    x = torch.randn(8, 256).to(torch.bfloat16)
    w = random_weight("Q4_K", 64, 256)
    assert quant_argmax_bf16(x, w, 64) is not None
    assert quant_argmax_bf16(x.float(), w, 64) is None
    assert quant_argmax_bf16(x, vnni_strips(random_weight("Q8_256", 64, 256)), 64) is None


@pytest.mark.parametrize("rows", [3, 40])
def test_a_linears_argmax_past_the_int8_rows_writes_no_outputs_where_the_tiles_serve(
    rows, monkeypatch
):
    """`QuantLinear.argmax` on steps the dequantized GEMM serves takes each part's argmax from
    the tiles (`quant_argmax_bf16`; no slices of outputs) where AMX serves, slices otherwise:
    the argmax of its outputs' first `columns` either way, parts side by side."""
    a, b = random_weight("Q4_K", 64, 512, seed=1), random_weight("Q6_K", 32, 512, seed=2)
    linear = QuantLinear([a, b])
    linear.int8_max_rows = 2
    tiles = cpu.load_library().has("quant_argmax_amx")
    if tiles:
        monkeypatch.setattr(cpu_ops, "argmax_of_slices", None)  # called: a TypeError
    x = torch.randn(rows, 512).to(torch.bfloat16)
    outputs = linear(x, torch.float32)
    for columns in (96, 90, 64, 30):
        assert torch.equal(linear.argmax(x, columns), outputs[:, :columns].argmax(dim=-1))


@pytest.mark.parametrize("one_weight", [False, True])
def test_gate_up_linears_act_and_mul_is_the_two_passes_whatever_serves_it(one_weight):
    """`QuantLinear.act_and_mul` is `silu_and_mul` of the linear's outputs, bit for bit: in one
    kernel where AMX serves a step of bf16 rows past the int8 product's (`fuses_act_and_mul`),
    as the two passes on steps of fewer rows, fp32 rows, a linear with a bias, or a CPU without
    AMX; gate and up as two weights or the halves of one."""
    gate, up = random_weight("Q4_K", 64, 512, seed=1), random_weight("Q4_K", 64, 512, seed=2)
    weights = [gate, up]
    if one_weight:
        weights = [QuantWeight("Q4_K", torch.cat([gate.data, up.data]), 512)]
    linear = QuantLinear(weights)
    if can_dequantize_to_bf16(weights):
        linear.int8_max_rows = 4
    fused = cpu.load_library().has("quant_glu_amx")

    def two_passes(linear: QuantLinear, x: torch.Tensor, act) -> torch.Tensor:
        return act(linear(x).view(-1, 128)).view(*x.shape[:-1], 64)

    for rows in (2, 20):  # 4 and 40 rows in all
        x = torch.randn(2, rows, 512).to(torch.bfloat16)
        assert linear.fuses_act_and_mul(x) == (fused and rows > 2)
        for gelu, act in ((False, cpu_ops.silu_and_mul), (True, cpu_ops.gelu_tanh_and_mul)):
            assert torch.equal(linear.act_and_mul(x, gelu), two_passes(linear, x, act))
        assert not linear.fuses_act_and_mul(x.float())
    biased = QuantLinear(weights, torch.randn(128))
    biased.int8_max_rows = linear.int8_max_rows
    assert not biased.fuses_act_and_mul(x)
    assert torch.equal(biased.act_and_mul(x, False), two_passes(biased, x, cpu_ops.silu_and_mul))


@needs_bf16_gemm
@needs_vnni
@pytest.mark.parametrize("rows", [5, 70])
def test_dequantized_gemm_reads_int8_weights_in_their_vnni_strips(rows):
    """`quantization="int8"`'s weights, laid out for the VNNI GEMM (Q8_256_VNNI), dequantize
    from their strips to the values of the same weight row-major: the same bits out."""
    row_major = random_weight("Q8_256", 96, 768, seed=rows)
    strips = vnni_strips(row_major)
    x = torch.randn(rows, 768).to(torch.bfloat16)
    assert can_dequantize_to_bf16([strips])
    got = quant_gemm_bf16(x, [strips])
    assert torch.equal(got, quant_gemm_bf16(x, [row_major]))
    expected = x.double() @ dequantize(row_major).to(torch.bfloat16).double().T
    scale = x.double().abs() @ dequantize(row_major).double().abs().T
    assert torch.all((got.double() - expected).abs() <= 1e-5 * scale + 1e-30)


@needs_bf16_gemm
def test_a_linear_dequantizes_steps_of_more_rows_than_the_int8_product_serves():
    """`int8_max_rows`: up to it the int8 product (int8 activations), past it the dequantized
    GEMM (bf16 activations as they are), fused parts side by side either way; None: always
    int8."""
    q4, q6 = random_weight("Q4_K", 32, 512, seed=1), random_weight("Q6_K", 16, 512, seed=2)
    linear = QuantLinear([q4, q6])
    x = torch.randn(12, 512).to(torch.bfloat16)
    assert torch.equal(linear(x), quant_matmul(x, [q4, q6], torch.bfloat16))
    linear.int8_max_rows = 12
    assert torch.equal(linear(x), quant_matmul(x, [q4, q6], torch.bfloat16))
    linear.int8_max_rows = 11
    both = quant_gemm_bf16(x, [q4, q6], torch.bfloat16)
    assert torch.equal(linear(x), both)
    assert torch.equal(both[:, 32:], quant_gemm_bf16(x, [q6], torch.bfloat16))
    assert not torch.equal(both, quant_matmul(x, [q4, q6], torch.bfloat16))
    assert torch.equal(linear(x.float()), quant_matmul(x.float(), [q4, q6]))  # fp32: int8


@pytest.mark.parametrize("fmt", ROW_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 6, 40])
@pytest.mark.parametrize("case", ["random", "tie", "nan"])
def test_a_linears_argmax_is_its_outputs_argmax_a_slice_at_a_time(fmt, rows, case, monkeypatch):
    """`QuantLinear.argmax`: the argmax of its fp32 outputs' first `columns` (the first of equal
    maxima, the first NaN), from slices of 64 outputs across fused parts, each slice's outputs
    the whole product's bits, on either kernel (int8, and the dequantized bf16 GEMM past
    `int8_max_rows`)."""
    monkeypatch.setattr(cpu_ops, "ARGMAX_SLICE_BYTES", 4 * rows * 64)
    k = in_features(fmt)
    a, b = random_weight(fmt, 160, k, seed=rows), random_weight(fmt, 96, k, seed=rows + 1)
    bias = torch.randn(256)
    if case == "tie":  # outputs 40 and 200 equal, and the largest: the first wins
        b.data[200 - 160] = a.data[40]
        bias[40] = bias[200] = 1e6
    if case == "nan":  # NaN at 150 and 230, past the largest at 20: the first NaN wins
        bias[20], bias[150], bias[230] = 1e6, float("nan"), float("nan")
    linear = QuantLinear([a, b], bias)
    x = torch.randn(rows, k).to(torch.bfloat16)
    for most in (None, 0) if can_dequantize_to_bf16([a, b]) else (None,):
        linear.int8_max_rows = most
        outputs, product = linear(x, torch.float32), linear._product(x)
        whole = product(x, [a])
        for first in range(0, 160, 32):
            part = QuantWeight(fmt, a.data[first : first + 32], k)
            assert torch.equal(product(x, [part]), whole[:, first : first + 32])
        for columns in (256, 251, 170):
            expected = outputs[:, :columns].argmax(dim=-1)
            assert torch.equal(linear.argmax(x, columns), expected)
    if case == "tie":
        assert set(expected.tolist()) == {40}
    if case == "nan":
        assert set(expected.tolist()) == {150}
    with pytest.raises(ValueError, match="columns must lie in"):
        linear.argmax(x, 257)


@pytest.mark.parametrize(
    ("fmt", "k"),
    [
        ("Q5_K", 512),
        ("Q4_K", 1536),
        ("Q6_K", 768),
        ("Q3_K", 1024),
        ("Q4_1", 1536),
        ("Q8_0", 800),
        ("Q5_0", 352),
    ],
)
def test_outputs_do_not_depend_on_threads_or_batching(fmt, k):
    """A row's result is the same alone (the one-row path) or in a batch, on any thread count:
    several super-blocks a row, so that a different summation order would show, the last one
    part-filled where k is not a multiple of 256; an odd number of outputs, which the threads
    split unevenly."""
    w = random_weight(fmt, 61, k, seed=3)
    x = torch.randn(9, k)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = quant_matmul(x, [w])
        torch.set_num_threads(2)
        two = quant_matmul(x, [w])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    alone = torch.cat([quant_matmul(x[i : i + 1], [w]) for i in range(9)])
    assert torch.equal(one, alone)


@pytest.mark.parametrize("fmt", ROW_FORMATS)
def test_rows_have_the_bits_of_one_row_in_steps_of_any_size(fmt):
    """Outputs a multiple of 32, as the VNNI GEMM takes them (where it is built; steps of 4 rows
    on): each row's result has the one-row kernel's bits in every step size (2: below the GEMM;
    11: a partial last tile; 40: with AMX, a full tile of 32 and a partial one) and thread
    count (96 outputs: 3 strips of 32, which two threads split unevenly), in fp32 and bf16; 800
    inputs end the 32-weight formats' rows in a partial chunk of 256."""
    k = 768 if BLOCK_FORMATS[fmt][1] == 256 else 800
    w = random_weight(fmt, 96, k, seed=5)
    x = torch.randn(40, k)
    alone = torch.cat([quant_matmul(x[i : i + 1], [w]) for i in range(40)])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (2, 4, 11, 40):
                assert torch.equal(quant_matmul(x[:rows], [w]), alone[:rows])
            rounded = quant_matmul(x, [w], torch.bfloat16)
            assert torch.equal(rounded, alone.to(torch.bfloat16))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("outputs", [80, 96])
def test_largest_levels_by_largest_activations_keep_exact_sums(fmt, sign, outputs):
    """Every level at its largest and every activation level at +-127 (constant rows): the
    sums a GEMM keeps in int16 (AVX2's, over as many 4-input steps as fit; the VNNI GEMM's
    activation sums of a group) reach their bound and must not wrap. Each row has the one-row
    kernel's bits in steps of 6-40 rows (80 outputs: 5 strips of 16 for AVX2's GEMM; 96: 3
    strips of 32 for the VNNI GEMM; both split unevenly over two threads), and is the
    dequantized product."""
    w = random_weight(fmt, outputs, 512, seed=11)
    blocks = w.data.view(outputs, 2, BLOCK_FORMATS[fmt][2])
    scales = {at: blocks[..., at : at + 2].clone() for at in FP16_FIELDS[fmt]}
    blocks.fill_(255)  # every level, scale and high bit set
    for at, value in scales.items():
        blocks[..., at : at + 2] = value
    x = torch.full((40, 512), sign)
    alone = torch.cat([quant_matmul(x[i : i + 1], [w]) for i in range(40)])
    expected = dequantized_activations(x, fmt) @ reference_weight(w).astype(np.float64).T
    torch.testing.assert_close(alone.double(), torch.from_numpy(expected), rtol=1e-5, atol=0)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (6, 7, 40):
                assert torch.equal(quant_matmul(x[:rows], [w]), alone[:rows])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.skipif(
    "avx512f" not in cpu_features(), reason="no AVX-512 here: the tests above run as capped"
)
def test_capped_at_avx2_the_gemms_keep_the_bits_of_one_row():
    """Under ATEN_CPU_CAPABILITY=avx2 (kernels built without AVX-512), the bit-exactness tests of
    the steps of many rows run again: on an AVX-512 machine they would not reach the AVX2 GEMM
    and the interleaved-row kernels otherwise."""
    tests = "rows_have_the_bits or largest_levels or interleaved_by_8 or interleaved_heads"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", tests],
        env=dict(os.environ, ATEN_CPU_CAPABILITY="avx2"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]


@pytest.mark.parametrize(
    "fmt, k, data, match",
    [
        ("IQ4_NL", 32, torch.zeros(2, 18, dtype=torch.uint8), "not one the CPU kernels read"),
        ("Q4_0", 48, torch.zeros(2, 27, dtype=torch.uint8), "multiple of 32"),
        ("Q4_0", 64, torch.zeros(2, 40, dtype=torch.uint8), "take 36 bytes"),
        ("Q8_0", 32, torch.zeros(2, 34), "uint8"),
        ("Q4_0_R8", 64, torch.zeros(12, 36, dtype=torch.uint8), "multiple of 8 rows"),
    ],
)
def test_malformed_weights_are_refused(fmt, k, data, match):
    with pytest.raises(ValueError, match=match):
        QuantWeight(fmt, data, k)


@pytest.mark.parametrize("row_scales", [False, True])
def test_q8_256_blocks_round_each_weight_to_its_grid(row_scales):
    """`quantization="int8"`'s Q8_256: each 256 inputs of a row on the grid of their largest
    |w| / 127, or with `row_scales` (a rotated model's) each row on its own, that scale stored
    with each super-block (levels within +-127, a block or row of zeros all zeros), read back by
    the kernels' dequantizer; inputs not whole super-blocks take Q8_0."""
    w = torch.randn(5, 768)
    w[1, 256:512] = 0.0
    w[3] = 0.0
    w[2, 10] = 40.0  # an outlier coarsens its own block only, or its row
    q = q8_256_blocks(w, row_scales)
    assert q.format == "Q8_256" and q.data.shape == (5, 3 * 260) and q.row_scales == row_scales
    amax = w.view(5, 3, 256).abs().amax(-1, keepdim=True)
    step = (amax.amax(1, keepdim=True) if row_scales else amax) / 127
    error = (dequantize(q) - w).view(5, 3, 256).abs()
    assert torch.all(error <= step / 2 * (1 + 1e-5))
    assert not dequantize(q)[1, 256:512].any() and not dequantize(q)[3].any()
    blocks = q.data.view(5, 3, 260)
    assert torch.equal(blocks[..., 256:].contiguous().view(torch.float32), step.expand(5, 3, 1))
    levels = blocks[..., :256].view(torch.int8).abs().amax(-1).tolist()
    assert levels[1][1] == 0 and max(levels[1]) == 127 and levels[3] == [0, 0, 0]
    if row_scales:  # one block a row reaches 127; the outlier's row: its other blocks coarsened
        assert max(levels[0]) == 127 and levels[2][0] == 127 and max(levels[2][1:]) < 32
    else:
        assert levels[0] == levels[2] == [127] * 3
    strips = int8_weight(w[:4].repeat(8, 1), row_scales=row_scales)  # 32 rows: VNNI strips
    assert strips.row_scales == row_scales
    with pytest.raises(ValueError, match="row_scales is for Q8_256 weights, not Q4_0"):
        QuantWeight("Q4_0", random_weight("Q4_0", 4, 256).data, 256, row_scales=True)
    assert int8_weight(w[:, :96]).format == "Q8_0"
    assert int8_weight(w).format == "Q8_256"  # 5 outputs: not whole strips of 32
    strips = "Q8_256_VNNI" if vnni_gemm_built() else "Q8_256"
    assert int8_weight(torch.randn(64, 256)).format == strips
    with pytest.raises(ValueError, match="multiple of 256"):
        q8_256_blocks(w[:, :96])


@needs_vnni
def test_q8_256_in_vnni_strips_gives_the_bits_of_its_rows_in_any_step():
    """Q8_256_VNNI (`vnni_strips`: Q8_256's bytes as the VNNI GEMM reads them, no unpacking a
    step) is the same weight, and every step of it (one row included, which it also serves;
    on AMX tiles of up to 32 rows, 8 strips at a time) gives the row-major blocks' bits, on one
    or two threads (10 strips), fp32 and bf16 out."""
    rows_major = random_weight("Q8_256", 320, 768, seed=6)
    strips = vnni_strips(rows_major)
    assert strips.format == "Q8_256_VNNI" and strips.data.shape == rows_major.data.shape
    assert torch.equal(dequantize(strips), dequantize(rows_major))
    ids = torch.tensor([95, 0, 33, 319])
    assert torch.equal(dequantize(strips, ids), dequantize(rows_major)[ids])
    x = torch.randn(70, 768)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 3, 4, 11, 16, 40, 70):
                for dtype in (torch.float32, torch.bfloat16):
                    expected = quant_matmul(x[:rows], [rows_major], dtype)
                    assert torch.equal(quant_matmul(x[:rows], [strips], dtype), expected)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="multiple of 32 rows"):
        QuantWeight("Q8_256_VNNI", rows_major.data[:48], 768)
    with pytest.raises(ValueError, match="Q8_256 weights of 32k rows"):
        vnni_strips(random_weight("Q8_256", 48, 768))


@needs_rows8
@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_0", "Q8_0"])
def test_rows_interleaved_by_8_give_the_bits_of_the_files_layout_in_any_step(fmt):
    """`interleave_rows_` lays out 8 rows at a time in place (same bytes a group of rows): the
    same weight row by row, and every step of it (one row; 40, past a tile of 32; a fused linear
    whose other part keeps the file's layout; the head's argmax a slice at a time) gives the
    file layout's bits, on one or two threads (12 groups of 8 rows, split unevenly), fp32 and
    bf16 out; 800 inputs end a row in a partial chunk of 256."""
    file_rows = random_weight(fmt, 96, 800, seed=7)
    weight = QuantWeight(fmt, file_rows.data.clone(), 800)
    assert interleave_rows_(weight)
    assert weight.format == f"{fmt}_R8" and not torch.equal(weight.data, file_rows.data)
    assert torch.equal(dequantize(weight), dequantize(file_rows))
    ids = torch.tensor([95, 0, 33, 8, 7])
    assert torch.equal(dequantize(weight, ids), dequantize(file_rows)[ids])
    other = random_weight("Q6_K", 32, 800 // 256 * 256, seed=8)
    x = torch.randn(40, 800)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (1, 3, 40):
                for dtype in (torch.float32, torch.bfloat16):
                    expected = quant_matmul(x[:rows], [file_rows], dtype)
                    assert torch.equal(quant_matmul(x[:rows], [weight], dtype), expected)
    finally:
        torch.set_num_threads(threads)
    fused = QuantLinear([weight, QuantWeight(fmt, file_rows.data[:32], 800)])
    expected = QuantLinear([file_rows, QuantWeight(fmt, file_rows.data[:32], 800)])(x[:5])
    assert torch.equal(fused(x[:5]), expected)
    assert other.format == "Q6_K"  # no interleaved layout: left as it is
    assert not interleave_rows_(other)
    odd = random_weight(fmt, 12, 800, seed=9)
    assert not interleave_rows_(odd) and odd.format == fmt  # rows not a multiple of 8


@needs_rows8
def test_an_interleaved_heads_argmax_a_slice_at_a_time_is_its_outputs_argmax(monkeypatch):
    """Slices of the head start at multiples of 32 outputs: whole groups of 8 rows."""
    monkeypatch.setattr(cpu_ops, "ARGMAX_SLICE_BYTES", 4 * 3 * 64)
    file_rows = random_weight("Q4_0", 320, 640, seed=10)
    weight = QuantWeight("Q4_0", file_rows.data.clone(), 640)
    assert interleave_rows_(weight)
    head, x = QuantLinear([weight]), torch.randn(3, 640)
    expected = QuantLinear([file_rows])(x, torch.float32)[:, :300].argmax(-1)
    assert torch.equal(head.argmax(x, 300), expected)
