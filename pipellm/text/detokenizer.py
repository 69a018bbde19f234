"""Streaming detokenization: one token id in, the new piece of text out."""

from __future__ import annotations

from collections.abc import Sequence

from pipellm.text.tokenizer import Tokenizer

# How many prompt tokens give the first generated token its context (vLLM uses as many).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    Each step decodes a short window, never the whole output. A token that ends in the middle
    of a multi-byte character yields nothing until a later token completes it. With no prompt
    context, the deltas joined (after `flush`) equal `tokenizer.decode(all ids)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # NOTE: the window holds already-emitted context tokens, then pending ones. Context
        # matters because decoders treat text starts specially: SentencePiece drops the space
        # of a first "▁word", which must stay when that word follows earlier text.
        self._window = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._num_context = len(self._window)
        self._context_text = self._decode(self._window)

    def add_token(self, token_id: int) -> str:
        """Take the next generated token; return the text it completes (maybe "")."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete UTF-8 sequence: wait for the bytes that finish it
        return self._emit(text)

    def flush(self) -> str:
        """Text still held back at the end of the stream (an unfinished character as U+FFFD)."""
        if len(self._window) == self._num_context:
            return ""
        return self._emit(self._decode(self._window))

    def _emit(self, text: str) -> str:
        delta = text[len(self._context_text) :]
        # The tokens just emitted are the context of the next ones.
        self._window = self._window[self._num_context :]
        self._num_context = len(self._window)
        self._context_text = self._decode(self._window)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
