"""Prompt-lookup drafts (vLLM's `ngram` method): a sequence's last n tokens, found earlier in its
prompt or output, predict that what followed them there comes next. A RAG answer quoting its
context drafts whole phrases this way, for the price of a scan over its token ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to min(k, `max_drafts`) tokens that followed the most recent earlier occurrence of
        the longest suffix of `token_ids` (between lookup_min and lookup_max tokens long); none
        where no such suffix occurs earlier."""
        num = min(self.k, max_drafts)
        if num <= 0 or len(token_ids) <= self.lookup_min:
            return []
        tokens = np.asarray(token_ids)
        # Candidate ends: earlier positions holding the last token (the suffix itself excluded).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        matched = ends
        n = 1
        while n < self.lookup_max and matched.size:
            # Extend every surviving match by one more token backwards.
            keep = matched[(matched >= n) & (tokens[np.maximum(matched - n, 0)] == tokens[-1 - n])]
            if n + 1 > self.lookup_min and not keep.size:
                break  # the longest suffix found is `n` tokens: use its matches
            matched = keep
            n += 1
        if n < self.lookup_min or not matched.size:
            return []
        start = int(matched[-1]) + 1  # the most recent match
        return tokens[start : start + num].tolist()
