"""Which drafted tokens a step keeps: verification by the sampler's own rule, row by row.

A drafting sequence's rows follow its last known token and then each draft. Row i is sampled
exactly as plain decoding samples the sequence's next token once drafts[:i] are its tokens
(`DraftRow`): penalties, bias, min_tokens, grammar and budget guard all see drafts[:i]. The
draft at row i is kept while the token sampled there equals it; the first token that differs
(or the one after the last draft) ends the sequence's new tokens for the step.

For ngram drafts, a point mass on the drafted token d, this is the standard rejection-sampling
rule: d is kept with probability p(d) = min(1, p(d)/q(d)), and when it is not, the token drawn
is distributed as p without d, renormalized: the residual max(0, p - q). The output distribution
is the model's. Rows are sampled in rounds (row i only where rows < i were kept), so a sequence
consumes one draw of its generator per token it gains, as plain decoding does: a seeded request
gives the same tokens with and without drafting, and greedy requests too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch

from paged_backend.request import Request


class DraftRow:
    """A drafting request as the sampler sees it at the row after `drafts` (its first drafts),
    as if they were its tokens already. `grammar`: the request's grammar advanced past them."""

    def __init__(self, request: Request, drafts: Sequence[int], grammar) -> None:
        self.request = request
        self.drafts = list(drafts)
        self.params = request.params
        self.bad_words_token_ids = request.bad_words_token_ids
        self.generator = request.generator
        self.budget_guard = request.budget_guard  # advanced once per token kept, as plainly
        self.grammar = grammar
        self.num_tokens_left = request.num_tokens_left - len(self.drafts)

    @functools.cached_property  # built once, and only where the sampler reads it (penalties)
    def output_token_ids(self) -> list[int]:
        return [*self.request.output_token_ids, *self.drafts]

    @functools.cached_property
    def all_token_ids(self) -> list[int]:
        return [*self.request.all_token_ids, *self.drafts]


def grammar_prefix(request: Request, drafts: list[int]) -> list[int]:
    """The longest prefix of `drafts` that the request's grammar accepts (all of them without
    structured output): drafts past it could never be kept, so they are not verified."""
    if request.grammar is None:
        return drafts
    state = request.grammar.fork()
    for i, token in enumerate(drafts):
        if not state.accept_token(token):
            return drafts[:i]
    return drafts


def verify(
    sample: Callable,
    logits: torch.Tensor,
    requests: list[Request],
    drafts: dict[Request, list[int]],
) -> tuple[list[list[int]], list[list]]:
    """Each request's new tokens and their logprobs (None entries where none were asked for).
    `logits` holds each request's rows, consecutively: 1 + its drafts. `sample(logits, rows)`
    is the sampler: rows are requests or `DraftRow`s, and it returns `SamplerOutput`."""
    counts = [1 + len(drafts.get(r, ())) for r in requests]
    firsts = list(itertools.accumulate(counts, initial=0))
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list] = [[] for _ in requests]
    live = list(range(len(requests)))
    rows: list = list(requests)
    grammars = [r.grammar for r in requests]
    for i in range(max(counts)):
        out = sample(logits[[firsts[j] + i for j in live]], rows)
        keep = []
        for j, token, lp in zip(live, out.token_ids, out.logprobs, strict=True):
            tokens[j].append(token)
            logprobs[j].append(lp)
            drafted = drafts.get(requests[j], ())
            if i < len(drafted) and token == drafted[i]:
                keep.append(j)
        live = keep
        if not live:
            break
        for j in live:
            if grammars[j] is not None:
                grammars[j] = grammars[j].fork()
                grammars[j].accept_token(tokens[j][-1])
        rows = [DraftRow(requests[j], tokens[j], grammars[j]) for j in live]
    return tokens, logprobs
