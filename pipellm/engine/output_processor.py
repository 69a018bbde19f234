"""Incremental detokenization and stop strings, applied as each token arrives."""

from __future__ import annotations

from pipellm.sampling_params import SamplingParams
from pipellm.text.detokenizer import IncrementalDetokenizer
from pipellm.text.tokenizer import Tokenizer


class TextState:
    """One request's output text. While stop strings are set, the last few characters are
    held back from streaming, since they might turn out to be the start of a stop string."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        self.params = params
        self.text = ""
        self.num_emitted = 0
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1

    def push(self, token_id: int, finished: bool) -> tuple[str, str | None]:
        """Adds a token; returns (text delta to emit, the stop string that hit, if any)."""
        searched_from = max(0, len(self.text) - self.hold_back)
        self.text += self.detokenizer.add_token(token_id)
        if finished:
            self.text += self.detokenizer.flush()
        stop_hit = None
        if self.params.stop:
            stop_hit, cut = self._find_stop(searched_from)
            if stop_hit is not None:
                self.text = self.text[:cut]
                finished = True
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.hold_back)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta, stop_hit

    def _find_stop(self, start: int) -> tuple[str | None, int]:
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self.text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None, len(self.text)
        index, stop = best
        return stop, index + len(stop) if self.params.include_stop_str_in_output else index
