"""The C GEMM / oneDNN choice: timed once per machine and weight shape, then read from the
cache; forced by `cpu_gemm_max_rows`; visible in `stats()`."""

from __future__ import annotations

import os

import pytest
import torch

from paged_backend import LLM, EngineConfig, cpu, file_cache
from paged_backend.cpu import kernel_choice
from paged_backend.cpu.linear import PREFILL_ROW_COUNTS
from paged_backend.cpu.quant import QuantWeight

needs_gemm = pytest.mark.skipif(
    not cpu.has_bf16_kernels() or not torch.backends.mkldnn.is_available(),
    reason="no AVX512-BF16 C kernels or no oneDNN",
)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A cache dir of its own, on a machine nothing else loads (whatever runs beside the tests)."""
    monkeypatch.setenv("PAGED_BACKEND_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_choice, "_others_share", lambda before, after: 0.0)
    return tmp_path / "cache"


@needs_gemm
def test_timings_taken_on_a_busy_machine_are_not_kept(private_cache, monkeypatch):
    timed = []
    monkeypatch.setattr(kernel_choice, "_time_shape", lambda n, k: timed.append(n) or 8)
    monkeypatch.setattr(kernel_choice, "_others_share", lambda before, after: 0.5)
    assert kernel_choice.gemm_max_rows({(64, 96)}) == {(64, 96): 8}
    assert kernel_choice.gemm_max_rows({(64, 96)}) == {(64, 96): 8}
    assert timed == [64, 64]  # timed again: nothing was cached
    monkeypatch.setattr(kernel_choice, "_others_share", lambda before, after: 0.0)
    kernel_choice.gemm_max_rows({(64, 96)})
    kernel_choice.gemm_max_rows({(64, 96)})
    assert timed == [64, 64, 64]


@needs_gemm
def test_a_busy_machine_is_told_once_a_process(
    private_cache, monkeypatch, capsys, tiny_model, one_thread
):
    """Each engine start on a busy machine times again; the user hears why once, as a status
    line like the download and conversion ones."""
    monkeypatch.setattr(kernel_choice, "_time_shape", lambda n, k: 8)
    monkeypatch.setattr(kernel_choice, "_others_share", lambda before, after: 0.52)
    monkeypatch.setattr(file_cache, "_shown", set())  # as in a fresh process
    for _ in range(2):
        LLM(model=str(tiny_model), dtype="bfloat16", num_kv_blocks=32)
    told = [line for line in capsys.readouterr().err.splitlines() if "CPUs busy" in line]
    assert len(told) == 1, told
    assert told[0].startswith("paged-backend: other programs kept 52% of the CPUs busy")


@needs_gemm
def test_the_c_gemm_keeps_the_row_counts_up_to_a_clear_onednn_win(monkeypatch):
    """oneDNN takes a row count only where it needs less than 90% of the C GEMM's time: within
    that the timings' noise would flip the choice (and the one-call decode with it) from run
    to run."""
    onednn_share = {1: 1.2, 2: 1.0, 4: 1.05, 8: 0.95, 16: 0.91, 32: 0.89, 64: 0.5}

    def best_times(*calls, before=None):
        rows = calls[0][1].shape[0]  # each call: (kernel, x, ...)
        return [1.0, onednn_share[rows]]  # the C GEMM's time, then oneDNN's

    monkeypatch.setattr(kernel_choice, "_best_times", best_times)
    assert kernel_choice._time_shape(64, 96) == 16  # 0.89 at 32 rows is a clear win
    onednn_share[32] = 0.92
    assert kernel_choice._time_shape(64, 96) == 32


@needs_gemm
def test_each_prefill_count_goes_to_the_c_gemm_unless_onednn_wins_it_clearly(monkeypatch):
    """At prefill sizes each timed count is decided on its own (oneDNN's rate moves by 2x
    from one count to the next): a clear oneDNN win at one count leaves the others to C."""
    onednn_share = dict.fromkeys(PREFILL_ROW_COUNTS, 1.0) | {256: 0.5, 1024: 0.89, 1536: 0.92}

    def best_times(*calls, before=None):
        return [1.0, onednn_share[calls[0][1].shape[0]]]

    monkeypatch.setattr(kernel_choice, "_best_times", best_times)
    got = kernel_choice._time_prefill_shape(64, 96)
    assert got == tuple(c for c in PREFILL_ROW_COUNTS if c not in (256, 1024))


@needs_gemm
def test_prefill_counts_are_timed_once_per_machine_then_read(private_cache, monkeypatch):
    timed = []
    monkeypatch.setattr(
        kernel_choice, "_time_prefill_shape", lambda n, k: timed.append(n) or (256, 2048)
    )
    for _ in range(2):
        assert kernel_choice.gemm_prefill_counts({(64, 96)}) == {(64, 96): (256, 2048)}
    assert timed == [64]  # read back from the cache file (as a tuple) the second time


@pytest.mark.parametrize("budget, repeats", [(0.0, 3), (60.0, 7)])
def test_long_calls_stop_repeating_past_the_timing_budget(monkeypatch, budget, repeats):
    """Each kernel runs once to warm up, then in turns: `_REPEATS` times, or `_MIN_REPEATS`
    once the turns took `_TIMING_BUDGET_S` (prefill-sized calls take milliseconds each)."""
    monkeypatch.setattr(kernel_choice, "_TIMING_BUDGET_S", budget)
    ran = {"c": 0, "torch": 0}
    calls = [(lambda name=name: ran.__setitem__(name, ran[name] + 1),) for name in ran]
    assert len(kernel_choice._best_times(*calls)) == 2
    assert ran == {"c": 1 + repeats, "torch": 1 + repeats}
    assert (kernel_choice._MIN_REPEATS, kernel_choice._REPEATS) == (3, 7)


def test_a_win_for_torch_must_hold_when_timed_again(monkeypatch):
    """A burst of load while timing must not cost the C kernel a row count for good: a win
    for torch is timed again and only kept when it holds."""
    shares = iter([0.5, 1.0, 0.5, 0.5])  # torch's share of C's time, in timing order

    monkeypatch.setattr(
        kernel_choice, "_best_times", lambda *calls, before=None: [1.0, next(shares)]
    )
    # 1 row: a lucky torch time, then a loss; 2 rows: torch wins both times
    assert kernel_choice._rows_c_serves(8, torch.float32, lambda x: (), lambda x: ()) == 1


def test_a_win_smaller_than_the_one_call_step_leaves_the_rows_to_c(monkeypatch):
    """A clear but small win for torch (the default model's 576x576 at 32 rows on a Zen 1:
    0.39 against 0.45 ms) would take decode steps out of their one C call, worth ~1.6 ms a layer
    there: the rows stay C's until torch saves more than `_TORCH_SAVES_S` a call. Between two
    kernels that both run in the one-call step (GGUF blocks or their fp32 values) the share
    alone decides."""
    c_ms = {1: 0.05, 2: 0.08, 4: 0.1, 8: 0.15, 16: 0.26, 32: 0.45, 64: 3.0}

    def best_times(*calls, before=None):
        c_time = c_ms[calls[0][1].shape[0]] * 1e-3  # each call: (kernel, x, ...)
        return [c_time, 0.85 * c_time]  # a clear share at every count

    monkeypatch.setattr(kernel_choice, "_best_times", best_times)

    def call(x):
        return None, x

    assert kernel_choice._rows_c_serves(8, torch.float32, call, call) == 32  # 64: 0.45 ms saved
    assert kernel_choice._rows_c_serves(8, torch.float32, call, call, fused=False) == 0


def test_the_load_of_other_processes_is_measured():
    """A process that keeps a core busy beside us shows in the share; our own work does not."""
    import subprocess
    import sys
    import time

    before = kernel_choice._cpu_seconds()
    if before is None:
        pytest.skip("no /proc/stat")
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # our own busy loop
        pass
    alone = kernel_choice._others_share(before, kernel_choice._cpu_seconds())
    if alone > 0.5:
        pytest.skip(f"other processes load the machine already ({alone:.0%})")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count())  # every CPU ours: the spinner's core counts
    try:
        time.sleep(0.3)
        before = kernel_choice._cpu_seconds()
        time.sleep(1.0)
        loaded = kernel_choice._others_share(before, kernel_choice._cpu_seconds())
    finally:
        spinner.kill()
        torch.set_num_threads(threads)
    assert loaded > alone + 0.5 / os.cpu_count()


@pytest.mark.parametrize(
    ("threads", "others_cores", "share"),
    [(4, 1.0, 0.25), (2, 2.0, 0.0), (2, 3.0, 0.5), (1, 2.5, 0.0), (1, 3.5, 0.5), (8, 2.0, 0.5)],
)
def test_only_load_on_the_cores_our_threads_need_counts(monkeypatch, threads, others_cores, share):
    """On 4 CPUs, what other processes ran beyond the CPUs our threads leave them (a test
    worker beside a one-thread engine) is the share that counts, of the CPUs we use."""
    monkeypatch.setattr(kernel_choice.os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:  # 2 s: others ran others_cores * 2 CPU seconds, we ran 0.5
        got = kernel_choice._others_share((0.0, 10.0, 1.0), (2.0, 10.5 + others_cores * 2, 1.5))
    finally:
        torch.set_num_threads(before)
    assert got == pytest.approx(share)


@needs_gemm
def test_each_shape_is_timed_once_per_machine_then_read(private_cache, monkeypatch):
    timed = []
    real = kernel_choice._time_shape
    monkeypatch.setattr(
        kernel_choice, "_time_shape", lambda n, k: timed.append((n, k)) or real(n, k)
    )
    first = kernel_choice.gemm_max_rows({(64, 96), (32, 96)})
    assert sorted(timed) == [(32, 96), (64, 96)]
    assert all(rows in (0, *kernel_choice.ROW_COUNTS) for rows in first.values())
    assert kernel_choice.gemm_max_rows({(64, 96)}) == {(64, 96): first[(64, 96)]}
    kernel_choice.gemm_max_rows({(64, 96), (16, 96)})  # only the new shape is timed
    assert sorted(timed) == [(16, 96), (32, 96), (64, 96)]
    assert (private_cache / "kernel_choice.json").exists()


@needs_gemm
def test_another_thread_count_is_another_machine(private_cache, monkeypatch):
    timed = []
    monkeypatch.setattr(kernel_choice, "_time_shape", lambda n, k: timed.append(n) or 8)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            assert kernel_choice.gemm_max_rows({(64, 96)}) == {(64, 96): 8}
    finally:
        torch.set_num_threads(before)
    assert len(timed) == 2  # timed at 1 and at 2 threads, read back the second time at 1


@pytest.mark.parametrize("rows", [-1, 65, 1.5, True, "8"])
def test_cpu_gemm_max_rows_is_checked(rows):
    with pytest.raises(ValueError, match=r"cpu_gemm_max_rows must be .* \[0, 64\]"):
        EngineConfig(cpu_gemm_max_rows=rows)


@needs_gemm
def test_a_forced_choice_is_what_the_engine_runs_and_reports(tiny_model, one_thread):
    llm = LLM(model=str(tiny_model), dtype="bfloat16", num_kv_blocks=32, cpu_gemm_max_rows=4)
    chosen = llm.stats()["cpu_gemm_max_rows"]
    assert chosen and set(chosen.values()) == {4}
    down = llm.engine.runner.model.layers[0].mlp.down_proj  # [64, 128] in the tiny model
    assert chosen["64x128"] == down.gemm_rows == 4 and down.gemm is not None
    # no prefill count is as small as 4 rows: oneDNN serves every prefill step
    assert set(map(tuple, llm.stats()["cpu_gemm_prefill_rows"].values())) == {()}
    assert not down.gemm_prefill


@pytest.mark.parametrize(
    ("dequantized_share", "rows"),
    [(0.5, 4), (1.0, kernel_choice.ALL_ROWS), ({256: 0.8}, 64), ({32: 0.8}, 16)],
)
def test_the_int8_product_keeps_small_steps_and_gives_large_ones_to_a_clear_gemm_win(
    monkeypatch, dequantized_share, rows
):
    """The dequantized GEMM takes the row counts from its first clear win on (timed twice), but
    never steps of up to 4 rows, which run fused; an int8 product that wins at every count up to
    256 rows (the K-quants' VNNI GEMM) serves every step."""

    def best_times(*calls, before=None):
        count = calls[0][1].shape[0]  # each call: (kernel, x, ...)
        share = dequantized_share
        if isinstance(share, dict):
            share = share.get(count, 1.0)
        return [1.0, share]  # the int8 product's time, then the dequantized GEMM's

    monkeypatch.setattr(kernel_choice, "_best_times", best_times)
    weight = QuantWeight("Q8_0", torch.zeros(32, 34 * 2, dtype=torch.uint8), 64)
    assert kernel_choice._time_int8([weight]) == rows


@pytest.mark.parametrize(
    ("torch_share", "rows"),
    [
        (1.0, kernel_choice.ALL_ROWS),
        ({32: 0.8}, kernel_choice.ALL_ROWS),
        ({256: 0.8}, 64),
        ({256: 0.8, 32: 0.8}, 16),
        (0.5, 0),
    ],
)
def test_the_c_fp32_linear_serves_every_step_where_it_keeps_up_at_a_prefill(
    monkeypatch, torch_share, rows
):
    """Where torch does not win clearly at a prefill's 256 rows (timed on at most 4,096 of the
    outputs), the C fp32 linear serves steps of every size, whatever a smaller count's timing:
    a row's bits then never depend on its step. Else it keeps the counts up to torch's first
    clear win."""
    widths = {}

    def best_times(*calls, before=None):
        x, weight = calls[0][1], calls[0][2]  # each call: (kernel, x, weight, ...)
        widths[len(x)] = len(weight)
        share = torch_share.get(len(x), 1.0) if isinstance(torch_share, dict) else torch_share
        return [1.0, share]  # the C linear's time, then torch's

    monkeypatch.setattr(kernel_choice, "_best_times", best_times)
    assert kernel_choice._time_f32_shape(5000, 16) == rows
    assert widths.get(256, 4096) == 4096 and widths.get(1, 5000) == 5000


def test_a_clear_dequantizing_win_counts_however_little_time_it_saves(monkeypatch):
    """Both kernels of a quantized linear run in the one-call decode step, so the dequantized
    GEMM takes the counts from its first clear win on even where that saves less than the
    margin a kernel outside the fused step must save (`_TORCH_SAVES_S`)."""
    int8_time = kernel_choice._TORCH_SAVES_S  # a win of 20% saves a fifth of the margin

    def best_times(*calls, before=None):
        count = calls[0][1].shape[0]
        return [int8_time, int8_time * (0.8 if count >= 16 else 1.0)]

    monkeypatch.setattr(kernel_choice, "_best_times", best_times)
    weight = QuantWeight("Q8_0", torch.zeros(32, 34 * 2, dtype=torch.uint8), 64)
    assert kernel_choice._time_int8([weight]) == 8


def test_a_linears_parts_are_timed_together(private_cache, monkeypatch):
    """A fused linear's parts run in one step together: their choice is timed on all of them
    (a fused qkv's small k and v parts alone can favour the other kernel than the whole)."""
    timed = []

    def rows_c_serves(k, dtype, c_call, torch_call, before=None, counts=None, fused=True):
        timed.append(c_call(torch.zeros(1, k))[2])
        return 8

    monkeypatch.setattr(kernel_choice, "_rows_c_serves", rows_c_serves)
    q = QuantWeight("Q8_0", torch.zeros(64, 34 * 2, dtype=torch.uint8), 64)
    kv = QuantWeight("Q8_0", torch.zeros(32, 34 * 2, dtype=torch.uint8), 64)
    key = ("Q8_0", 64, 64, "Q8_0", 32, 64)
    assert kernel_choice.int8_max_rows({key: [q, kv]}) == {key: 8}
    assert timed == [[q, kv]]


def test_weights_of_a_scale_a_row_are_timed_apart_from_their_formats_others():
    """`row_scales` weights run their own kernel (one rescale a product on AMX): a choice timed
    on Q8_256 weights of a scale a super-block must not serve them, nor theirs the others."""
    from paged_backend.gguf.quantize import int8_weight
    from paged_backend.model_runner import _parts_key

    weight = torch.randn(64, 256)
    plain, rows = int8_weight(weight, strips=False), int8_weight(weight, False, row_scales=True)
    assert plain.format == rows.format and plain.data.shape == rows.data.shape
    assert _parts_key([plain]) != _parts_key([rows])
    assert _parts_key([plain]) == _parts_key([int8_weight(weight * 2, strips=False)])
