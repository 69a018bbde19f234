"""Text <-> token ids and chat templates, for Hugging Face folders and GGUF files."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers

from pipellm.loader.source import ModelSource
from pipellm.text.chat_template import (
    HOW_TO_GIVE_A_TEMPLATE,
    NoChatTemplateError,
    render_chat_template,
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what serving needs: BOS/EOS ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: tuple[int, ...],
        chat_template: str | None,
        add_bos_token: bool,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, BOS leads when the model wants one.

        Encode a rendered chat template with add_special_tokens=False: the template writes
        its own BOS.
        """
        check_unicode(text)
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer_config.json may ask for a BOS that tokenizer.json's post-processor does not
        # add (usually it has added it already). GGUF tokenizers add theirs in the backend.
        wants_bos = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        if wants_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """Characters of the vocabulary's longest token as stored; a token decodes to at most
        this many (byte-level tokens store one character per byte)."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
    ) -> str:
        """Render `messages` (and the functions the model may call, `tools`, in OpenAI's
        format) with `chat_template`, else the model's own template, as transformers does."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise NoChatTemplateError(
                "this model has no chat template (neither tokenizer_config.json's "
                "'chat_template', chat_template.jinja, nor GGUF 'tokenizer.chat_template'): "
                + HOW_TO_GIVE_A_TEMPLATE
            )
        return render_chat_template(
            template,
            messages,
            add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            tools=tools,
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id)


def check_unicode(text: str) -> None:
    """Raises ValueError if text holds a lone surrogate (JSON allows "\\ud800" alone; UTF-8
    cannot encode it, and the tokenizer would fail with a TypeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the text is not valid Unicode: a lone surrogate U+{ord(text[error.start]):04X} "
            f"at character {error.start}; send UTF-8 text (in JSON, \\ud800-\\udfff escapes "
            "only as high-low pairs)"
        ) from None


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of `source`: tokenizer.json for folders, rebuilt from metadata for GGUF."""
    if source.kind == "hf":
        return _load_hf(source.path)
    # NOTE: imported here: the GGUF rebuild builds on Tokenizer, defined above.
    from pipellm.text.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(source.path)


def _load_hf(folder: Path) -> Tokenizer:
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    # transformers >= 4.43 may save the template as its own file, which then takes precedence.
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        chat_template = template_file.read_text()
    else:
        chat_template = _named_template(config.get("chat_template"))
    bos_token = _token_content(config.get("bos_token"))
    eos_token = _token_content(config.get("eos_token"))
    return Tokenizer(
        backend,
        bos_token_id=None if bos_token is None else backend.token_to_id(bos_token),
        eos_token_ids=() if eos_token is None else (backend.token_to_id(eos_token),),
        chat_template=chat_template,
        add_bos_token=config.get("add_bos_token", False),
    )


def _token_content(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json writes special tokens as text or as a serialized AddedToken."""
    return token["content"] if isinstance(token, dict) else token


def _named_template(template: str | list[dict[str, str]] | None) -> str | None:
    """The default template; configs may hold a list of named ones (e.g. "default", "tool_use")."""
    if isinstance(template, list):
        return next((t["template"] for t in template if t["name"] == "default"), None)
    return template
