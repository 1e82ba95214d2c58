"""Which sequences draft, and which drafted tokens a step keeps.

Verification here is greedy: a draft is kept while it equals the model's argmax at its row, so
the output is the one plain greedy decoding gives. A sequence drafts only where its next tokens
are exactly the argmax of its rows, i.e. where the sampler does nothing else (`why_no_drafts`).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_backend.request import Request


def why_no_drafts(request: Request) -> str | None:
    """Why `request` does not draft in this step, or None where it may. Each rule keeps a
    sampler feature that drafted rows would bypass: they are argmax rows and nothing else."""
    params = request.params
    if not params.greedy:
        return "temperature > 0 (rejection sampling is not implemented yet)"
    if request.grammar is not None:
        return "structured output (drafts are not checked against the grammar yet)"
    if params.logprobs is not None:
        return "logprobs (drafted rows compute none)"
    if len(request.output_token_ids) < params.min_tokens:
        return "min_tokens not reached (stop tokens are banned on its next rows)"
    if (
        params.logit_bias
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
    ):
        return "logit_bias or penalties (they depend on the tokens before each row)"
    return None


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a drafting sequence gains: its drafts up to the first one that differs from the
    model's argmax at its row (`targets[i]` follows the sequence plus `drafts[:i]`), then the
    model's own token there (the bonus token after a fully accepted draft)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return [*drafts[:accepted], targets[accepted]]
