"""Incremental detokenization and stop strings.

Text is emitted only once a token window decodes without a trailing U+FFFD, so a multi-byte
character split over byte-fallback tokens never shows up half-done. Text that might be the start
of a stop string is held back from streaming deltas until it is known not to be one.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside, so the first word gets its leading space


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop = include_stop_str_in_output
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # all output text so far (cut at a matched stop string)
        self.num_emitted = 0  # characters of `text` already handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token; returns the stop string it completed, if any (and `check_stop`)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # incomplete character: wait for the next token
        new = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = len(self.text)
        self.text += new
        return self._match_stop(start) if check_stop else None

    def _match_stop(self, new_start: int) -> str | None:
        best = None
        for s in self.stop:
            idx = self.text.find(s, max(0, new_start - len(s) + 1))
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s) if self.include_stop else idx]
        return s

    def delta(self, finished: bool) -> str:
        """New text since the last call, minus a tail that could still become a stop string."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        end = max(end, self.num_emitted)
        out = self.text[self.num_emitted : end]
        self.num_emitted = end
        return out

    def _held_back(self) -> int:
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
