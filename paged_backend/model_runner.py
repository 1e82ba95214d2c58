"""Owns the model weights and the KV cache; turns a scheduled step into one forward pass."""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paged_backend import cpu
from paged_backend.attention import AttentionMetadata, check_block_tables, get_backend
from paged_backend.block_pool import FREED_BLOCK
from paged_backend.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from paged_backend.cpu import kernel_choice
from paged_backend.cpu.linear import (
    EVERY_STEP,
    PREFILL_ROW_COUNTS,
    GemmPrefill,
    GemmRows,
    can_pack,
    linear_shapes,
    quantize_linears_int4,
)
from paged_backend.cpu.memory import (
    advise_huge_pages,
    huge_page_tokens,
    move_to_huge_pages_,
    resident_bytes,
)
from paged_backend.cpu.quant import (
    QuantLinear,
    QuantWeight,
    can_dequantize_to_bf16,
    interleave_model_rows_,
)
from paged_backend.gguf import ARCHITECTURES as GGUF_ARCHITECTURES
from paged_backend.int4_checkpoint import int4_scheme, load_int4_checkpoint
from paged_backend.model_loader import (
    convert_gguf,
    converted_from,
    gguf_source,
    load_safetensors,
    stored_dtypes,
)
from paged_backend.models import LlamaForCausalLM, native_model_class
from paged_backend.models.config import ModelConfig
from paged_backend.models.llama import MLP_SLICE_BYTES
from paged_backend.models.transformers_impl import TransformersForCausalLM
from paged_backend.request import Request

FP16_COPY_MAX_BYTES = 1 << 30  # the default small-step copy is kept for models this small

_DEFAULT_KV_FRACTION = 0.1
_DEFAULT_KV_CAP = 2 << 30
HUGE_PAGES_A_REGION = 4  # the KV cache's 2 MiB pages wait for this much use (see `__init__`)
# On CPU a step runs as forwards of at most `forward_tokens` tokens: a forward's activations are
# a peak of resident memory, widest in its MLP (4 x intermediate bytes a token: the bf16 gate/up
# product, or on AMX the gated output and the down projection's input as B tiles). As many as
# keep those within one MLP slice (`MLP_SLICE_BYTES`), from llama.cpp's physical batch (its
# n_ubatch, 512) to the default step budget (a whole step in one forward). Each forward runs its
# Python, and dequantizes every quantized weight, once: on an AMX Xeon 2,048-token forwards
# prefilled 32 distinct prompts 1.27x faster than 512 for the default model (+5 MB of peak RSS)
# and 1.1x for Gemma 3 270M's shape (+40 MB); Qwen2.5-0.5B's, Llama-3.2 1B's and 3B's 1.02-1.05x
# for +47 to +109 MB (they keep 512-768).
FORWARD_TOKENS = (512, 2048)


def forward_tokens(intermediate_size: int) -> int:
    """The most tokens of a CPU forward for a model of this MLP width (see FORWARD_TOKENS)."""
    fit = MLP_SLICE_BYTES // (4 * intermediate_size) // 256 * 256
    return min(max(fit, FORWARD_TOKENS[0]), FORWARD_TOKENS[1])


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


@dataclass
class PromptRows:
    """A step's final hidden rows whose logits give prompt logprobs (`Request.prompt_logprobs`):
    `hidden`, and `spans` (index into `scheduled`, the prompt token its first row predicts, how
    many rows) in the order of those rows."""

    hidden: torch.Tensor
    spans: list[tuple[int, int, int]]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, model_path: Path, max_model_len: int
    ) -> None:
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        self.bf16_cpu = self.device.type == "cpu" and self.dtype == torch.bfloat16
        # the dtypes the C elementwise ops and decode attention run (`cpu.ops`)
        self.c_ops_dtype = self.device.type == "cpu" and self.dtype in (
            torch.bfloat16,
            torch.float32,
        )
        self.block_size = config.block_size
        backend = config.resolve_backend(self.device)
        ops = self._ops(config, backend)
        self.c_ops = ops == "cpu"  # the layers' elementwise ops and decode attention run in C
        # the AVX512-BF16 kernels (GEMM, prefix and prefill attention) read bf16 only
        bf16_kernels = self.c_ops and self.bf16_cpu and cpu.has_bf16_kernels()
        self.backend = get_backend(
            backend,
            model_config.num_heads,
            model_config.num_kv_heads,
            c_decode=self.c_ops and model_config.head_dim % 16 == 0,
            c_prefix=bf16_kernels and model_config.head_dim % 64 == 0,
            windows=model_config.layer_windows or (None,),
        )
        self.model_config = model_config
        self.gemm_rows = None
        self.gemm_prefill = None
        self.int8_rows: dict[tuple, int] | None = None  # `_dequantize_large_steps`
        if model_config.impl == "transformers" and config.quantization in ("int4", "int8"):
            raise ValueError(
                f"quantization={config.quantization!r} needs our native modules; "
                f"{model_config.architecture} runs on transformers' (model_impl)"
            )
        gguf = gguf_source(model_path)
        if gguf is not None and (
            gguf["architecture"] not in GGUF_ARCHITECTURES or model_config.impl == "transformers"
        ):
            # names we do not map, or transformers' modeling code (which loads safetensors):
            # transformers' conversion (dequantized, cached) reads them
            model_path, gguf = convert_gguf(Path(gguf["gguf"])), None
        if model_config.impl == "transformers":
            model = TransformersForCausalLM(model_path, self.dtype, self.device)
        else:
            model = self._native_model(
                config, model_config, model_path, gguf, max_model_len, ops, bf16_kernels
            )
        self.model = model.eval().requires_grad_(False)
        if self.device.type == "cpu" and model_config.impl != "transformers":
            # one-row steps stream the weights: from 2 MiB pages (`move_to_huge_pages_`)
            move_to_huge_pages_(_weight_tensors(model))
            interleave_model_rows_(model)  # in place, in the region just written
            if getattr(model, "fused_decode", None) is not None:  # a table of old addresses
                model.fuse_decode_()
        quantized = any(isinstance(m, QuantLinear) for m in model.modules())
        self.kv_dtype = config.resolve_kv_cache_dtype(self.dtype, self.device, quantized)
        self.num_blocks = self._num_blocks(config, max_model_len)
        mc = model_config
        self.kv_caches = self.backend.allocate_kv_cache(
            mc.num_layers,
            self.num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            self.kv_dtype,
            self.device,
        )
        # The KV cache goes on 2 MiB pages once a step's tables name this many blocks: below,
        # 4 KiB pages commit only what is written (`cpu.memory.zeros_on_huge_pages`). Each region
        # (a layer's K or V: the cache is block-major, `TorchAttention`) then commits whole 2 MiB
        # pages, so the switch waits until the sequences would fill four a region: at most 1.25x
        # the bytes 4 KiB pages hold. A 2 MiB page backs only a range nothing touched before: a
        # pool whose free blocks lie scattered stays on 4 KiB pages (advised from the start, a 1B
        # batch of 32 x ~280 tokens over a shuffled pool committed all 2,048 MB of the cache).
        self.huge_pages_from_blocks = self.forward_tokens = None
        if self.device.type == "cpu":
            a_page = huge_page_tokens(mc.num_kv_heads, mc.head_dim, self.kv_dtype)
            tokens = HUGE_PAGES_A_REGION * a_page
            self.huge_pages_from_blocks = -(-tokens // config.block_size)
            self.forward_tokens = forward_tokens(mc.intermediate_size)

    def _c_decode_rows(self, rows: list[tuple[Request, int]], drafts: dict) -> int:
        """The most rows a sequence may have for the C decode kernel to run a forward of these
        (request, rows) pairs. fp32's kernel takes every row (decodes, drafts, prompt chunks of
        any length): a row's bits then do not depend on the step, so a prefix-cache hit, a
        chunk boundary or a batch gives the tokens of the prompt computed alone (exactly, where
        the linears are exact per row: int8 activations). bf16's reads the keys again for each
        row (a chunk of a few rows over a long context runs faster in the prefill kernel), so it
        takes a decode and the drafts it verifies, and only in a forward whose every multi-row
        sequence verifies drafts: a forward without drafts then runs the kernels it runs
        without speculative decoding, for the same bits."""
        if self.dtype == torch.float32:
            return sys.maxsize
        if all(r in drafts for r, n in rows if n > 1):
            return 1 + MAX_SPECULATIVE_TOKENS
        return 1

    def _ops(self, config: EngineConfig, backend: str) -> str:
        """Who runs the layers' elementwise ops (`paged_backend.models.llama.make_ops`): fused
        Triton kernels on a GPU (on CPU, under the interpreter, they are for tests only); the
        fused C ops for bf16 and fp32 on CPU by default wherever they build (the torch attention
        backend then also runs decode steps in C); else torch."""
        if config.cpu_kernels and not (self.c_ops_dtype and cpu.available()):
            raise ValueError(
                "cpu_kernels=True needs a bfloat16 or float32 model on CPU and a C compiler to "
                "build "
                f"{', '.join(p.name for p in cpu.library.SOURCES)}; "
                f"got {self.dtype} on {self.device.type}"
                + ("" if cpu.available() else ", and the build failed (see the log)")
            )
        if backend == "triton" and self.device.type == "cuda":
            return "triton"
        if config.cpu_kernels is False or not self.c_ops_dtype:
            return "torch"
        return "cpu" if cpu.available() else "torch"

    def memory(self) -> dict[str, int]:
        """Bytes of the weights (every copy the linears keep) and of the KV cache, and how many of
        them are resident: the KV cache commits memory as blocks are first written."""
        weights, weights_resident = resident_bytes(_weight_tensors(self.model))
        kv, kv_resident = resident_bytes(t for layer in self.kv_caches for t in layer)
        return {
            "weights_bytes": weights,
            "weights_resident_bytes": weights_resident,
            "kv_cache_bytes": kv,
            "kv_cache_resident_bytes": kv_resident,
        }

    def _native_model(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_path: Path,
        gguf: dict | None,
        max_model_len: int,
        ops: str,
        bf16_kernels: bool,
    ) -> LlamaForCausalLM:
        """Our own modules for the architecture, loaded (from the GGUF file `gguf` describes,
        `model_loader.gguf_source`, where given), cast, and on CPU with the linears of
        `cpu.linear` (the C GEMM's copies where `bf16_kernels`)."""
        with torch.device(self.device):
            model = native_model_class(model_config.architecture)(
                model_config, max_model_len, ops=ops
            )
        if gguf is not None:  # `gguf` takes ~40 ms to import: only for GGUF files
            from paged_backend.gguf.weights import load_gguf

            file, arch, table = Path(gguf["gguf"]), gguf["architecture"], gguf["tensors"]
        # A GGUF file's weights stay in its block formats (the CPU kernels read them), unless
        # dequantized weights or int4 / int8 copies are asked for.
        if gguf is not None and config.quantization is None and self.device.type == "cpu":
            load_gguf(model, file, self.dtype, arch, table)
            return self._blocks_model(config, model, ops)
        scheme = int4_scheme(model_path) if gguf is None else None
        if scheme is not None:  # GPTQ / AWQ: their 4-bit levels as blocks, nothing else
            if self.device.type != "cpu" or config.quantization is not None:
                raise ValueError(
                    f"a {scheme.method} checkpoint runs on CPU with quantization=None (its "
                    f"4-bit weights as they are), not on {self.device.type} with "
                    f"quantization={config.quantization!r}"
                )
            load_int4_checkpoint(model, model_path, scheme)
            return self._blocks_model(config, model, ops)
        if config.quantization == "int8" and self.device.type != "cpu":
            raise ValueError(f"quantization='int8' runs on CPU only, not {self.device.type}")
        pack, fp16_copy, every_step = self._cpu_linears(config, model, bf16_kernels)
        if gguf is not None:
            load_gguf(model, file, self.dtype, arch, table, quantized=False)
        else:
            # int4 and int8 quantize from the checkpoint's values: read in the model's dtype
            # only where that is theirs (a 1B bf16 checkpoint read into fp32 for int8 peaked
            # at +6.2 GB).
            if config.quantization != "int4" and (
                config.quantization != "int8" or stored_dtypes(model_path) == {self.dtype}
            ):
                _parameters_in_(model, self.dtype)
            load_safetensors(model, model_path, model.checkpoint_name_map)
        if config.quantization == "int8":
            from paged_backend.gguf.quantize import quantize_linears_int8_
            from paged_backend.models.rotation import rotate_

            rotated = rotate_(model)  # int8 activations lose less of rotated outliers
            quantize_linears_int8_(model, row_scales=rotated)
            return self._blocks_model(config, model, ops)
        # From the full-precision weights: a Q4 grid survives only until the cast.
        int4 = quantize_linears_int4(model.layers) if config.quantization == "int4" else None
        model.to(self.dtype)
        if pack or fp16_copy or int4:
            if every_step:
                self.gemm_rows = dict.fromkeys(model.linear_shapes(), EVERY_STEP)
            elif bf16_kernels and fp16_copy:
                self.gemm_rows = self._gemm_rows(config, model, kernel_choice.gemm_max_rows)
                if pack and not int4:
                    self.gemm_prefill = self._gemm_prefill(config, model)
            model.use_cpu_linears_(pack, fp16_copy, int4, self.gemm_rows, self.gemm_prefill)
        elif self._c_f32_linears(config, ops):
            self.gemm_rows = self._gemm_rows(config, model, kernel_choice.f32_max_rows)
            model.use_f32_linears_(self.gemm_rows)
            self._use_f32_blocks(model, gguf or converted_from(model_path))
        return model

    @staticmethod
    def _use_f32_blocks(model: LlamaForCausalLM, gguf: dict | None) -> None:
        """Small steps of an fp32 model dequantized from GGUF file `gguf` (`gguf_source`) read
        the blocks its weights came from, where their values are the weights' bits."""
        if gguf is None:
            return
        from paged_backend.gguf.weights import exact_f32_blocks

        blocks = exact_f32_blocks(model, Path(gguf["gguf"]), gguf["architecture"], gguf["tensors"])
        model.use_f32_blocks_(blocks, kernel_choice.f32_block_max_rows)

    def _blocks_model(self, config: EngineConfig, model, ops: str) -> LlamaForCausalLM:
        """A model whose linears hold quantized blocks, cast: its float linears left (a float
        head, a GGUF file's F16 tensors) run the C fp32 linear for small steps as an fp32
        model's do, a head of fp16 values kept in fp16 (`half_head_`); a bf16 model's steps of
        many rows dequantize to bf16 (`_dequantize_large_steps`); the one-call decode step
        takes every layer."""
        model.to(self.dtype)
        if self._c_f32_linears(config, ops):
            model.half_head_()
            self.gemm_rows = self._gemm_rows(config, model, kernel_choice.f32_max_rows)
            model.use_f32_linears_(self.gemm_rows)
            return model
        if self.dtype == torch.bfloat16 and ops == "cpu" and cpu.has_bf16_kernels():
            self._dequantize_large_steps(config, model)
        model.fuse_decode_()
        return model

    def _dequantize_large_steps(self, config: EngineConfig, model: LlamaForCausalLM) -> None:
        """Steps of more rows than the int8 product serves best (`config.cpu_gemm_max_rows`
        where given, else timed on this machine: `kernel_choice.int8_max_rows`) run a quantized
        linear's weights dequantized to bf16 through the bf16 GEMM, a cache-sized piece at a
        time (`quant.quant_gemm_bf16`)."""
        linears = [
            m
            for m in model.modules()
            if isinstance(m, QuantLinear) and can_dequantize_to_bf16(m.weights)
        ]
        parts = {_parts_key(m.weights): m.weights for m in linears}
        forced = config.cpu_gemm_max_rows
        rows = self.int8_rows = (
            kernel_choice.int8_max_rows(parts) if forced is None else dict.fromkeys(parts, forced)
        )
        for linear in linears:
            linear.int8_max_rows = rows[_parts_key(linear.weights)]

    def _c_f32_linears(self, config: EngineConfig, ops: str) -> bool:
        """Whether an fp32 model's linears run `cpu_ops.linear_f32` for steps of few rows
        (`cpu_kernels=False` keeps every op in torch)."""
        return (
            self.dtype == torch.float32
            and self.device.type == "cpu"
            and ops != "triton"
            and config.cpu_kernels is not False
            and cpu.available()
        )

    @staticmethod
    def _gemm_rows(config: EngineConfig, model, timed) -> GemmRows:
        """Up to how many rows a step runs each weight shape in C rather than torch:
        `config.cpu_gemm_max_rows` where given, else `timed(shapes)` on this machine
        (`kernel_choice`)."""
        shapes = model.linear_shapes()
        if config.cpu_gemm_max_rows is not None:
            return dict.fromkeys(shapes, config.cpu_gemm_max_rows)
        return timed(shapes)

    @staticmethod
    def _gemm_prefill(config: EngineConfig, model) -> GemmPrefill:
        """The prefill step sizes at which each layer weight shape runs the C GEMM rather than
        oneDNN: those up to `config.cpu_gemm_max_rows` where given, else timed on this machine
        (`kernel_choice.gemm_prefill_counts`)."""
        shapes = linear_shapes(model.layers)
        forced = config.cpu_gemm_max_rows
        if forced is not None:
            return dict.fromkeys(shapes, tuple(c for c in PREFILL_ROW_COUNTS if c <= forced))
        return kernel_choice.gemm_prefill_counts(shapes)

    def _cpu_linears(
        self, config: EngineConfig, model: torch.nn.Module, bf16_kernels: bool
    ) -> tuple[bool, bool, bool]:
        """(pack the weights, keep a copy for small steps: bf16 for the C GEMM where the C
        kernels have AVX512-BF16, else fp16; that copy serves every step), see
        `paged_backend.cpu.linear`. By default packed wherever that works, since it gives the
        same outputs faster, and the copy kept for bf16 models on CPU with at most
        `FP16_COPY_MAX_BYTES` of weights, since it costs that much memory again. Past it, with
        the C kernels and nothing asked of the copies, the C GEMM's copy is the only one: the
        one-call decode step runs on it and it goes on 2 MiB pages (oneDNN's opaque packing
        does not move), and oneDNN's GEMM was 3-13% faster only at 128-512 rows (Zen 4; on a Xeon
        with AMX both run on the tiles, the C GEMM within ~10% of oneDNN or faster)."""
        packable = can_pack(self.dtype, self.device)
        if config.pack_weights and not packable:
            raise ValueError(
                "pack_weights=True needs a bfloat16 model on a CPU with oneDNN bf16 support; "
                f"got {self.dtype} on {self.device.type}"
            )
        int4 = config.quantization == "int4"
        for name, asked in (
            ("fp16_decode_weights", config.fp16_decode_weights),
            ("quantization", int4),
        ):
            if asked and not self.bf16_cpu:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} needs a bfloat16 model on CPU; "
                    f"got {self.dtype} on {self.device.type}"
                )
        pack = packable if config.pack_weights is None else config.pack_weights
        if config.fp16_decode_weights is not None:
            return pack, config.fp16_decode_weights, False
        size = sum(p.numel() for p in model.parameters()) * torch.finfo(self.dtype).bits // 8
        if size <= FP16_COPY_MAX_BYTES:
            return pack, self.bf16_cpu, False
        one_copy = (
            bf16_kernels
            and config.pack_weights is None
            and config.cpu_gemm_max_rows is None
            and config.quantization in (None, "none")
        )
        return (False, True, True) if one_copy else (pack, False, False)

    def _num_blocks(self, config: EngineConfig, max_model_len: int) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        mc = self.model_config
        per_block = (
            2
            * mc.num_layers
            * config.block_size
            * mc.num_kv_heads
            * mc.head_dim
            * torch.finfo(self.kv_dtype).bits
            // 8
        )
        budget = config.kv_cache_memory_bytes
        if budget is None:
            budget = min(
                int(_available_memory(self.device) * _DEFAULT_KV_FRACTION), _DEFAULT_KV_CAP
            )
            # Never more than every sequence at full length could hold at once (with windows on
            # every layer: its window and a step's tokens).
            held = max_model_len
            if mc.kv_window is not None:
                held = min(held, mc.kv_window + config.max_num_batched_tokens)
            budget = min(budget, config.max_num_seqs * -(-held // config.block_size) * per_block)
        num = budget // per_block
        if num < 2:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} holds fewer than 2 blocks of {per_block} bytes"
            )
        return num

    @torch.inference_mode()
    def execute(
        self,
        scheduled: list[tuple[Request, int]],
        block_tables: list[list[int]],
        drafts: dict[Request, list[int]] | None = None,
    ) -> tuple[torch.Tensor, list[int], PromptRows | None]:
        """Run the new tokens of every scheduled request, decodes (one token) first; a request
        with `drafts` runs them after its known tokens (counted in its scheduled number). On CPU
        a step of more tokens than `forward_tokens` runs as several forwards (`_pieces`).

        Returns the final hidden rows (`logits` and `logits_argmax` take them) of the requests
        that reach the end of their known tokens (those sample), one row each and one more per
        draft (a request's rows consecutive), and their indices into `scheduled`, in the order
        of their rows; then the rows that give prompt logprobs, if any."""
        drafts = drafts or {}
        held = self.huge_pages_from_blocks
        if (
            held is not None
            and sum(map(len, block_tables)) >= held
            and _distinct(block_tables) >= held
        ):
            advise_huge_pages([t for layer in self.kv_caches for t in layer])
            self.huge_pages_from_blocks = None
        # The head runs once for the step's rows of every forward: once a forward, it read its
        # weights again for each (a 262,144-token vocabulary's: 135 MB), and concatenating the
        # forwards' logits held them twice.
        hidden, sampling, prompt_hidden, spans = [], [], [], []
        for piece in self._pieces(scheduled, drafts):
            rows, piece_sampling, piece_spans = self._forward(
                scheduled, block_tables, drafts, piece
            )
            num_sampled = len(rows) - sum(count for _, _, count in piece_spans)
            hidden.append(rows[:num_sampled])
            prompt_hidden.append(rows[num_sampled:])
            sampling.extend(piece_sampling)
            spans.extend(piece_spans)
        prompt = PromptRows(torch.cat(prompt_hidden), spans) if spans else None
        return (hidden[0] if len(hidden) == 1 else torch.cat(hidden)), sampling, prompt

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 logits of `execute`'s hidden rows, on the CPU."""
        return self.model.logits(hidden).cpu()

    def logits_argmax(self, hidden: torch.Tensor, columns: int) -> torch.Tensor | None:
        """Each hidden row's `logits(hidden)[:, :columns].argmax(-1)` where the model's head
        gives it without the whole logits (`logits_argmax`); else None."""
        return self.model.logits_argmax(hidden, columns)

    def _pieces(
        self, scheduled: list[tuple[Request, int]], drafts: dict[Request, list[int]]
    ) -> list[list[tuple[int, int, int]]]:
        """The step's forwards: each a list of (index into `scheduled`, first of its new tokens,
        how many), of at most `forward_tokens` tokens, decodes first. A long chunk is cut where
        a forward fills up (its later piece reads the earlier's K/V from the cache, as a chunked
        prefill does); a drafting request's rows are never cut."""
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i][1] != 1)
        limit = self.forward_tokens
        if limit is None or sum(n for _, n in scheduled) <= limit:
            return [[(i, 0, scheduled[i][1]) for i in order]]
        pieces, current, room = [], [], limit
        for i in order:
            request, num_new = scheduled[i]
            if request in drafts and num_new > room and current:
                pieces.append(current)
                current, room = [], limit
            start = 0
            while start < num_new:
                take = min(num_new - start, room)
                current.append((i, start, take))
                start, room = start + take, room - take
                if room == 0:
                    pieces.append(current)
                    current, room = [], limit
        pieces.append(current)
        return [sorted(p, key=lambda row: row[2] != 1) for p in pieces if p]

    def _forward(
        self,
        scheduled: list[tuple[Request, int]],
        block_tables: list[list[int]],
        drafts: dict[Request, list[int]],
        piece: list[tuple[int, int, int]],
    ) -> tuple[torch.Tensor, list[int], list[tuple[int, int, int]]]:
        """One forward over a piece of the step (`_pieces`): the final hidden rows it samples
        from, then those that give prompt logprobs; the former's indices into `scheduled`, and
        the latter's `PromptRows.spans`."""
        bs = self.block_size
        ids, positions, qsl, seq_lens, logit_rows, sampling = [], [], [0], [], [], []
        prompt_rows, spans = [], []
        max_blocks = max(len(block_tables[i]) for i, _, _ in piece)
        tables = np.full((len(piece), max_blocks), FREED_BLOCK, dtype=np.int32)
        for row, (i, offset, count) in enumerate(piece):
            request = scheduled[i][0]
            drafted = drafts.get(request, ())  # a drafting request's piece is all its rows
            start = request.num_computed_tokens + offset
            end = start + count
            ids.extend(request.all_token_ids[start : end - len(drafted)])
            ids.extend(drafted)
            positions.append(np.arange(start, end))
            qsl.append(qsl[-1] + count)
            seq_lens.append(end)
            tables[row, : len(block_tables[i])] = block_tables[i]
            if end == request.num_tokens + len(drafted):
                logit_rows.extend(range(qsl[-1] - 1 - len(drafted), qsl[-1]))
                sampling.append(i)
            first = request.prompt_logprob_row
            if first is not None:  # rows first .. num_prompt_tokens - 2, as far as this runs
                lo, hi = max(start, first), min(end, request.num_prompt_tokens - 1)
                if lo < hi:
                    prompt_rows.extend(range(qsl[-2] + lo - start, qsl[-2] + hi - start))
                    spans.append((i, lo + 1, hi - lo))
        pos = np.concatenate(positions)
        rope_rows = pos
        if any(scheduled[i][0].long_rope for i, _, _ in piece):
            long = np.repeat([scheduled[i][0].long_rope for i, _, _ in piece], np.diff(qsl))
            rope_rows = self.model.rotary.rows(pos, long)
        lens = np.array(seq_lens)
        first_keys = lens - np.diff(qsl)  # each sequence's first query position
        if self.model_config.kv_window is not None:
            first_keys = np.maximum(first_keys - self.model_config.kv_window + 1, 0)
        check_block_tables(tables, first_keys, lens, bs, self.num_blocks)
        tables_t = torch.from_numpy(tables)
        flat_rows = torch.from_numpy(
            tables[np.repeat(np.arange(len(piece)), np.diff(qsl)), pos // bs]
        )
        slots = flat_rows.long() * bs + torch.from_numpy(pos % bs)
        meta = AttentionMetadata(
            num_decodes=sum(1 for _, _, count in piece if count == 1),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_tables=tables_t.to(self.device),
            slot_mapping=slots.to(self.device),
            block_size=bs,
            block_tables_cpu=tables,
            c_decode_rows=self._c_decode_rows(
                [(scheduled[i][0], count) for i, _, count in piece], drafts
            ),
        )
        self.backend.prepare(meta)
        hidden = self.model(
            torch.tensor(ids, device=self.device),
            torch.from_numpy(rope_rows).to(self.device),
            self.kv_caches,
            self.backend,
            meta,
            torch.tensor(logit_rows + prompt_rows, dtype=torch.long, device=self.device),
        )
        return hidden, sampling, spans


def _distinct(block_tables: list[list[int]]) -> int:
    """Blocks the tables name, a shared prefix's once (a RAG batch's 32 tables name its ~900
    tokens 32 times)."""
    return len(set(itertools.chain.from_iterable(block_tables)))


def _parameters_in_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Give every parameter fresh, unwritten storage in `dtype` before the checkpoint is read
    into it: reading rounds as the later cast would (nearest even), and the float32 storage the
    modules were built with, never written, is never resident. Read into float32 and cast, a
    1B bf16 checkpoint peaked at +6.3 GB for its 2.1 GB of weights."""
    for param in model.parameters():
        if param.dtype != dtype and param.is_floating_point():
            param.data = torch.empty_like(param.data, dtype=dtype)


def _parts_key(weights: list[QuantWeight]) -> tuple:
    """A quantized linear's parts, (format, out, in) each, flat: the kernel choice times a
    linear's parts together, as a step runs them (a fused qkv's small k and v parts alone can
    favour another kernel than the whole). Weights of one scale a row (`row_scales`) run other
    kernels than the format's own: their format is named apart."""
    return tuple(
        x
        for w in weights
        for x in (w.format + ("-row-scales" if w.row_scales else ""), w.out_features, w.in_features)
    )


def _weight_tensors(model: torch.nn.Module):
    """Every tensor the model's modules hold: parameters, buffers, and the copies kept as plain
    attributes (packed, fp16, int4 or C GEMM copies; quantized blocks)."""
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        for value in vars(module).values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.Tensor):
                    yield item
                elif isinstance(item, QuantWeight):
                    yield item.data
