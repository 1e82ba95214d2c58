"""`LLMEngine`: one synchronous step loop. request -> scheduler -> runner -> sampler -> detokenizer.

Not thread-safe: `LLM` drives it directly and `AsyncEngine` from its one background thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from paged_backend import metrics
from paged_backend.chat_template import (
    apply_chat_template,
    check_chat_messages,
    join_text_parts,
)
from paged_backend.config import DISABLE_BY_BATCH_SIZE, EngineConfig
from paged_backend.cpu.memory import release_freed_heap
from paged_backend.detokenizer import IncrementalDetokenizer
from paged_backend.kv_cache_manager import KVCacheManager
from paged_backend.model_loader import model_name, resolve_model_path
from paged_backend.model_runner import ModelRunner, PromptRows
from paged_backend.models.config import ModelConfig
from paged_backend.ngram_proposer import NgramProposer
from paged_backend.outputs import CompletionOutput, RequestOutput
from paged_backend.prompt_dicts import prompt_source, salted
from paged_backend.request import Request, RequestStatus
from paged_backend.sampler import (
    Sampler,
    SamplerOutput,
    takes_argmax,
    to_logprob_dict,
    top_logprobs,
)
from paged_backend.sampling_params import SamplingParams
from paged_backend.scheduler import Scheduler, SchedulerOutput
from paged_backend.spec_decode import verify
from paged_backend.structured_output import GrammarCache
from paged_backend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
PromptType = str | Sequence[int] | Mapping  # a Mapping: a vLLM prompt dict (`prompt_dicts`)


@dataclass
class _Parent:
    """A user request: its prompt and its `n` sequences."""

    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(c.status is RequestStatus.FINISHED for c in self.children)


# Scheduling priority (lower runs first) is a signed 64-bit integer, as in vLLM's OpenAI server.
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1
# A step's greedy rows take their tokens from a head that never holds their logits (`_sample`)
# once those would pass this many bytes (1 MB a row at a 262,144-token vocabulary).
SPLIT_HEAD_BYTES = 8 << 20
# Prompt rows whose logits are held at once for their logprobs (a 151,936-token vocabulary's:
# 156 MB, and their log-softmax as much).
PROMPT_LOGITS_ROWS = 256
_BYTES = (bytes, bytearray, memoryview)  # sequences of ints, but never meant as token ids


def _take_argmax(top: torch.Tensor, rows: list) -> SamplerOutput:
    """`verify`'s sampler for rows whose tokens are their argmax, given as `top` (from
    `ModelRunner.logits_argmax`) in place of their logits."""
    return SamplerOutput(top.tolist(), [None] * len(rows))


def _snapshot(logprobs: list | None) -> list | None:
    """A copy of a request's logprobs for an output, which later steps leave as it is."""
    return None if logprobs is None else list(logprobs)


def check_priority(priority: object) -> None:
    """Every entry that takes a `priority` checks it here, before anything is queued."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(
            f"priority must be in [-2**63, 2**63 - 1] (a signed 64-bit integer), got {priority}"
        )


def check_prompt_text(prompt: str) -> None:
    """A completion prompt must give text to answer (a chat's rule: `check_chat_messages`)."""
    if not prompt:
        raise ValueError("prompt must be a non-empty string or token id list, got ''")


def tokenize_prompt(
    tokenizer: Tokenizer, prompt: PromptType, add_special_tokens: bool = True
) -> list[int]:
    """A prompt's token ids: text tokenized, token ids as given (`LLMEngine.validate`, which
    every entry runs, checks them), a prompt dict's (`prompt_dicts`). Bytes are refused: `b"hi"`
    would read as token ids."""
    prompt = prompt_source(prompt)[0]
    if isinstance(prompt, str):
        check_prompt_text(prompt)
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer can take it
            raise ValueError(
                f"prompt is not valid Unicode text: {exc.reason} at position {exc.start}"
            ) from None
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    if isinstance(prompt, Sequence) and not isinstance(prompt, _BYTES):
        return list(prompt)
    hint = " (decode bytes to a str first)" if isinstance(prompt, _BYTES) else ""
    raise TypeError(
        "prompt must be a str, a list of int token ids or a prompt dict, got "
        f"{type(prompt).__name__}{hint}"
    )


def truncate_prompt(prompt_ids: list[int], params: SamplingParams, max_model_len: int) -> list:
    """The prompt's last `params.truncate_prompt_tokens` token ids (-1: as many as
    `max_model_len` leaves after `max_tokens`, or after one new token): every entry truncates
    here before it validates. Anything else (no truncation asked, ids of the wrong type) is
    returned as it is, for `LLMEngine.validate` to judge."""
    keep = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
    if keep is None or not isinstance(prompt_ids, list | tuple):
        return prompt_ids
    if keep == -1:
        keep = max(max_model_len - (params.max_tokens or 1), 1)
    return list(prompt_ids[-keep:])


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch at `num_threads` intra-op threads inside, at the caller's count again after: the
    count is process-wide, and an embedded engine must leave its host's torch as it was."""
    before = torch.get_num_threads()
    if not num_threads or num_threads == before:
        yield
        return
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        config = config or EngineConfig(**kwargs)
        self.config = config
        self.engine_id = metrics.new_engine_id()  # its Prometheus series' `engine` label
        self.model_path = resolve_model_path(config.model, config.revision)
        self.model_name = model_name(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path, config.model_impl)
        self.tokenizer = Tokenizer(self.model_path, config.chat_template)
        # its parse's freed pages (~50 MB for a 262,144-token vocabulary), before the weights
        # load beside them: the loading peak
        release_freed_heap()
        self.max_model_len = self.model_config.resolve_max_model_len(config.max_model_len)
        with torch_threads(config.num_threads):  # kernel timing and warm-up run as steps do
            self.runner = ModelRunner(
                config, self.model_config, self.model_path, self.max_model_len
            )
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.model_config.kv_window,
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            config.long_prefill_token_threshold,
            self._proposer(),
            self._max_drafting_seqs(),
        )
        self.eos_token_ids = self._eos_ids()
        self.grammars = GrammarCache(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
        )
        self.sampler = Sampler(
            self.model_config.vocab_size,
            self.eos_token_ids,
            config.seed,
            self.grammars,
            c_argmax=self.runner.c_ops,
        )
        self.parents: dict[str, _Parent] = {}
        self._pending: list[RequestOutput] = []  # outputs produced outside a step (aborts)
        self._ids = itertools.count()
        self.max_batch_size = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        self.num_draft_tokens = 0  # drafted tokens verified, of which accepted:
        self.num_accepted_tokens = 0
        self.num_drafting_steps = 0  # (sequence, step) pairs with drafts
        self.fault_hook: Callable[[str, list[str]], None] | None = None  # see _inject_fault
        release_freed_heap()  # what loading freed: not the process's to keep

    def _proposer(self) -> NgramProposer | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        )

    def _max_drafting_seqs(self) -> int:
        """The most running sequences a drafting step may start with: `disable_by_batch_size`,
        or where the config names none, the one measured for the model's dtype on CPU (4 on a
        GPU, where no rule was measured)."""
        spec = self.config.speculative_config
        if spec is None:
            return 0
        if spec.disable_by_batch_size is not None:
            return spec.disable_by_batch_size
        on_cpu = self.runner.device.type == "cpu"
        return DISABLE_BY_BATCH_SIZE.get(self.runner.dtype, 4) if on_cpu else 4

    def _eos_ids(self) -> list[int]:
        ids = list(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(self.tokenizer.eos_token_id)
        return ids

    # ---- input ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        check_chat_messages(messages)
        return apply_chat_template(self.tokenizer, join_text_parts(messages), **kwargs)

    def tokenize(self, prompt: PromptType, *, add_special_tokens: bool = True) -> list[int]:
        return tokenize_prompt(self.tokenizer, prompt, add_special_tokens)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as the tokenizer reads it alone and after a space (where
        that differs), as vLLM reads `bad_words`."""
        sequences: list[list[int]] = []
        for word in words:
            for text in (word, " " + word.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in sequences:
                    sequences.append(ids)
        return sequences

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Reject, before any work, a request that could never be served."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        if (
            not isinstance(prompt_ids, Sequence)
            or isinstance(prompt_ids, _BYTES)
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids)
        ):
            raise TypeError("prompt token ids must be a list of ints")
        if not prompt_ids:
            raise ValueError("prompt must be a non-empty string or token id list, got []")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"n must be <= max_num_seqs ({self.config.max_num_seqs}), got {params.n}: "
                "all of a request's sequences must fit in one batch"
            )
        params.check_vocab(vocab)
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len}) to leave room for at least one new token"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len}); max_tokens must be <= {self.max_model_len - n}"
            )
        total = n + (params.max_tokens or self.max_model_len - n)
        need = self.kv.most_blocks_held(total, self.config.max_num_batched_tokens)
        if need > self.kv.num_blocks:
            raise ValueError(
                f"prompt + max_tokens ({total} tokens) needs {need} KV blocks but the cache has "
                f"{self.kv.num_blocks}; lower max_tokens or raise num_kv_blocks / "
                "kv_cache_memory_bytes"
            )
        if params.structured_outputs is not None:
            self._check_structured_budget(params, n)

    def _check_structured_budget(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Compile the request's grammar (an invalid spec raises here) and reject a budget too
        small for its shortest complete output: such an output could only end cut off."""
        shortest = self.grammars.shortest_output(params.structured_outputs)
        if shortest is None:
            return
        need, text = shortest
        budget = params.max_tokens or self.max_model_len - num_prompt_tokens
        if budget < need:
            given = (
                f"got {budget}"
                if params.max_tokens
                else f"the prompt leaves {budget} of max_model_len ({self.max_model_len})"
            )
            raise ValueError(
                f"max_tokens must be at least {need} for this structured output (its shortest "
                f"complete output, {text!r}, is {need} tokens); {given}"
            )

    def add_request(
        self,
        prompt: PromptType | None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        prompt_token_ids: list[int] | None = None,
    ) -> str:
        """Queue a request (validated first); returns its id. `prompt_token_ids` skips
        tokenizing when the caller already did it (e.g. a chat template)."""
        check_priority(priority)
        source, text, salt = prompt_source(prompt)
        params = salted(params if params is not None else SamplingParams(), salt)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(source)
        ids = truncate_prompt(ids, params, self.max_model_len)
        self.validate(ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        children = []
        bad_words = self.bad_words_token_ids(params.bad_words or [])
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            children.append(
                Request(
                    child_id,
                    ids,
                    params,
                    parent_id=request_id,
                    index=i,
                    priority=priority,
                    seed=seed,
                    max_tokens=params.max_tokens or self.max_model_len - len(ids),
                    detokenizer=detokenizer,
                    grammar=self._new_grammar(params),
                    budget_guard=self._new_budget_guard(params),
                    long_rope=self.model_config.long_rope(len(ids)),
                    bad_words_token_ids=bad_words,
                )
            )
        self.parents[request_id] = _Parent(text, ids, children)
        for req in children:
            self.scheduler.add(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Finish a request now (`finish_reason="abort"`) and free its blocks. Unknown ids are
        ignored: the request may have just finished."""
        parent = self.parents.get(request_id)
        if parent is None:
            return
        for req in parent.children:
            self.scheduler.finish(req, "abort")
        self._pending.append(self._make_output(request_id, parent))

    # ---- the step ------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch, on the engine's `num_threads`. Atomic per
        request: a fault before sampling fails the step's requests; a fault while one request
        takes its token (grammar, stop checks, detokenizer) fails that request alone; every
        other request advances whole."""
        with torch_threads(self.config.num_threads):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.num_scheduled:
            return outputs
        scheduled = list(sched.num_scheduled.items())
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(scheduled))
        try:
            tables = [self.kv.block_ids(r) for r, _ in scheduled]
            self._inject_fault("forward", [r for r, _ in scheduled])
            hidden, sampling, prompt = self.runner.execute(scheduled, tables, sched.drafts)
            sampled_requests = [scheduled[i][0] for i in sampling]
            self._inject_fault("sample", sampled_requests)
            new_tokens, logprobs = self._sample(hidden, sampled_requests, sched.drafts)
            if prompt is not None:
                self._take_prompt_logprobs(prompt, [scheduled[i][0] for i, _, _ in prompt.spans])
            # A step that prefilled hands the heap's freed pages back (glibc keeps them
            # resident): its activations, and its sampling's, freed in another order than the
            # next step asks for them, piled up as heap (Gemma 3 270M Q4_K_M, 32 x ~250
            # tokens: +16 MB a 2,048-token step, 60 MB at the peak). Decode steps keep theirs:
            # they ask again for the same sizes, which a trim would have faulted in again every
            # step.
            del hidden
            if sched.prefills and self.runner.device.type == "cpu":
                release_freed_heap()
        except Exception as exc:  # one bad step fails its requests, never the engine
            logger.exception("engine step failed")
            failed = dict.fromkeys((r.parent_id for r in sched.num_scheduled), exc)
            return outputs + self._fail(failed)
        self.scheduler.update(sched, self._count_rejected(sampled_requests, new_tokens, sched))
        touched: dict[str, _Parent] = {}
        failed: dict[str, Exception] = {}
        for j, request in enumerate(sampled_requests):
            touched[request.parent_id] = self.parents[request.parent_id]
            try:
                # accepted drafts past a stop are discarded
                for token, lp in zip(new_tokens[j], logprobs[j], strict=True):
                    if request.status is RequestStatus.FINISHED:
                        break
                    self._append_token(request, token, lp)
                    self.num_generated_tokens += 1
            except Exception as exc:
                logger.exception("request %s failed taking its token", request.request_id)
                failed.setdefault(request.parent_id, exc)
        for pid, parent in touched.items():
            if pid not in failed:
                outputs.append(self._make_output(pid, parent))
        return outputs + self._fail(failed)

    def _sample(
        self, hidden: torch.Tensor, requests: list[Request], drafts: dict[Request, list[int]]
    ) -> tuple[list[list[int]], list[list]]:
        """Each request's new tokens and their logprobs from its final hidden rows: the sampled
        token, or for a drafting request the drafts its rows keep and the token sampled after
        them (`spec_decode`). Rows whose token is their logits' argmax (`takes_argmax`) take it
        from a head that never holds their whole logits, where the model has one, when every
        row does or theirs would pass `SPLIT_HEAD_BYTES` (a second pass over the head's weights
        for the others); in a drafting step only when every row does (a request that takes the
        argmax does at each of its rows: past min_tokens, it stays past)."""
        vocab = self.sampler.vocab_size
        if drafts:
            top = None
            if all(takes_argmax(r) for r in requests):
                top = self.runner.logits_argmax(hidden, vocab)
            if top is not None:
                return verify(_take_argmax, top, requests, drafts)
            return verify(self.sampler, self.runner.logits(hidden), requests, drafts)
        tokens: list = [None] * len(requests)
        logprobs: list = [None] * len(requests)
        argmax_rows = [i for i, r in enumerate(requests) if takes_argmax(r)]
        if argmax_rows and (
            len(argmax_rows) == len(requests) or len(argmax_rows) * vocab * 4 > SPLIT_HEAD_BYTES
        ):
            top = self.runner.logits_argmax(hidden[argmax_rows], vocab)
            if top is not None:
                for i, token in zip(argmax_rows, top.tolist(), strict=True):
                    tokens[i] = token
        rest = [i for i, t in enumerate(tokens) if t is None]
        if rest:
            logits = self.runner.logits(hidden[rest])
            sampled = self.sampler(logits, [requests[i] for i in rest])
            for i, token, lp in zip(rest, sampled.token_ids, sampled.logprobs, strict=True):
                tokens[i], logprobs[i] = token, lp
        return [[t] for t in tokens], [[lp] for lp in logprobs]

    def _take_prompt_logprobs(self, prompt: PromptRows, requests: list[Request]) -> None:
        """The prompt logprobs of `prompt`'s rows, appended to their requests' (`requests`: one
        a span), their logits `PROMPT_LOGITS_ROWS` rows at a time."""
        tokens, owners, taken = [], [], {}
        for (_, first, count), request in zip(prompt.spans, requests, strict=True):
            # a request's spans follow each other (a chunk cut into several forwards)
            expected = taken.get(request, len(request.prompt_logprobs))
            assert first == expected, "prompt logprobs taken out of order"
            taken[request] = first + count
            tokens.extend(request.prompt_token_ids[first : first + count])
            owners.extend([request] * count)
        for lo in range(0, len(tokens), PROMPT_LOGITS_ROWS):
            hi = lo + PROMPT_LOGITS_ROWS
            logits = self.runner.logits(prompt.hidden[lo:hi])[:, : self.sampler.vocab_size]
            ks = [r.params.prompt_logprobs for r in owners[lo:hi]]
            found = top_logprobs(torch.log_softmax(logits, dim=-1), tokens[lo:hi], ks)
            for request, (_, entries) in zip(owners[lo:hi], found, strict=True):
                request.prompt_logprobs.append(to_logprob_dict(entries, self._decode_one))

    def _count_rejected(
        self, requests: list[Request], new_tokens: list[list[int]], sched: SchedulerOutput
    ) -> dict[Request, int]:
        """Each drafting request's rejected drafts, counted into the acceptance stats."""
        rejected = {}
        for request, tokens in zip(requests, new_tokens, strict=True):
            drafted = len(sched.drafts.get(request, ()))
            if drafted:
                rejected[request] = drafted + 1 - len(tokens)
                self.num_draft_tokens += drafted
                self.num_accepted_tokens += len(tokens) - 1
                self.num_drafting_steps += 1
        return rejected

    def _inject_fault(self, stage: str, requests: list[Request]) -> None:
        """Test hook: `fault_hook(stage, request_ids)` may raise to fail the work of `stage`
        ("forward", "sample" or "detokenize") on those requests, as a real fault would."""
        if self.fault_hook is not None:
            self.fault_hook(stage, [r.request_id for r in requests])

    def _new_grammar(self, params: SamplingParams):
        if params.structured_outputs is None:
            return None
        return self.grammars.matcher(params.structured_outputs, params.stop_token_ids)

    def _new_budget_guard(self, params: SamplingParams):
        if params.structured_outputs is None:
            return None
        return self.grammars.budget_guard(params.structured_outputs)

    def _append_token(self, request: Request, token: int, logprobs) -> None:
        # The grammar advances here only, once per appended token (never on recompute).
        if request.grammar is not None and not request.grammar.accept_token(token):
            # Every token the grammar allowed was banned: min_tokens bans the stop tokens that
            # must end a complete structure. It is complete, so stop without the banned token.
            self.scheduler.finish(request, "stop")
            return
        request.append_output(token)
        if logprobs is not None:
            chosen, entries = logprobs
            request.cumulative_logprob += chosen
            request.logprobs.append(to_logprob_dict(entries, self._decode_one))
        params = request.params
        num_out = len(request.output_token_ids)
        reason = stop_reason = None
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif token in params.stop_token_ids:
                reason, stop_reason = "stop", token
        if reason is None and request.grammar is not None and request.grammar.is_terminated():
            reason = "stop"  # the grammar's EOS with ignore_eos: nothing may follow it
        if reason is None or params.include_stop_str_in_output:
            self._inject_fault("detokenize", [request])
            matched = request.detokenizer.add_token(token, check_stop=num_out >= params.min_tokens)
            if matched is not None and reason is None:
                reason, stop_reason = "stop", matched
        if reason is None and (
            num_out >= request.max_tokens or request.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            request.stop_reason = stop_reason
            self.scheduler.finish(request, reason)

    def _decode_one(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _fail(self, errors: dict[str, Exception]) -> list[RequestOutput]:
        """Fail whole user requests (all `n` sequences) with their error; freeing their blocks
        drops the hashes of blocks a failed step was writing (not valid K/V), while every other
        cached prefix stays."""
        outputs = []
        for pid, exc in errors.items():
            parent = self.parents[pid]
            for child in parent.children:
                self.scheduler.finish(child, "error")
            parent.error = f"engine step failed: {type(exc).__name__}: {exc}"
            outputs.append(self._make_output(pid, parent))
        return outputs

    def _make_output(self, request_id: str, parent: _Parent) -> RequestOutput:
        completions = []
        for req in parent.children:
            done = req.status is RequestStatus.FINISHED
            delta = req.detokenizer.delta(done)
            new_ids = req.output_token_ids[req.num_emitted_tokens :]
            req.num_emitted_tokens = len(req.output_token_ids)
            completions.append(
                CompletionOutput(
                    index=req.index,
                    text=req.detokenizer.text[: req.detokenizer.num_emitted],
                    token_ids=list(req.output_token_ids),
                    cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
                    logprobs=_snapshot(req.logprobs),
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    delta_text=delta,
                    delta_token_ids=new_ids,
                )
            )
        finished = parent.finished
        if finished:
            del self.parents[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(parent.children[0].num_cached_tokens, 0),
            error=parent.error,
            prompt_logprobs=_snapshot(parent.children[0].prompt_logprobs),
        )

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict:
        kv = self.kv
        slots, stored = kv.usage(self.scheduler.running)
        return {
            "engine_id": self.engine_id,
            "kv_slots_allocated": slots,
            "kv_tokens_stored": stored,
            "kv_blocks_total": kv.num_blocks,
            "kv_blocks_free": kv.pool.num_free,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prefix_cache_hit_rate": kv.prefix_hits / kv.prefix_queries
            if kv.prefix_queries
            else 0.0,
            "num_preemptions": self.scheduler.num_preemptions,
            "max_batch_size": self.max_batch_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_generated_tokens": self.num_generated_tokens,
            "num_steps": self.num_steps,
            # Bytes of the weights and of the KV cache, and how many are resident in memory.
            **self.runner.memory(),
            # Speculative decoding (`speculative_config`): the share of drafted tokens accepted,
            # and the tokens a drafting sequence gains per step (accepted drafts + its own one).
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_drafting_steps": self.num_drafting_steps,
            "spec_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            "spec_mean_acceptance_length": 1 + self.num_accepted_tokens / self.num_drafting_steps
            if self.num_drafting_steps
            else 0.0,
            # Up to how many rows a step runs each linear in the C GEMM, by weight shape (empty
            # where it does not run): chosen by timing it against oneDNN on this machine.
            "cpu_gemm_max_rows": {
                f"{n}x{k}": rows for (n, k), rows in sorted((self.runner.gemm_rows or {}).items())
            },
            # The prefill step sizes (`cpu.linear.PREFILL_ROW_COUNTS`) at which a step of more
            # rows than those runs each layer linear in the C GEMM rather than oneDNN, likewise.
            "cpu_gemm_prefill_rows": {
                f"{n}x{k}": list(counts)
                for (n, k), counts in sorted((self.runner.gemm_prefill or {}).items())
            },
            # A bf16 model's quantized linears, by their parts' (format, shape): up to how many
            # rows a step runs the int8 product, past them the weights dequantized for the
            # bf16 GEMM.
            "cpu_int8_max_rows": {
                "x".join(map(str, parts)): rows
                for parts, rows in sorted((self.runner.int8_rows or {}).items())
            },
        }
