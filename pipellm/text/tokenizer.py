"""Text <-> token ids and chat templates, for Hugging Face folders and GGUF files."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import gguf
import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from pipellm.loader.gguf_file import gguf_eos_token_ids, gguf_value, open_gguf
from pipellm.loader.source import ModelSource

# llama.cpp's `tokenizer.ggml.pre` names whose Hugging Face tokenizers split every digit apart
# before the GPT-2 byte-level regex (llama.cpp: LLAMA_VOCAB_PRE_TYPE_SMOLLM and kin).
_GGUF_PRE_SPLITS_DIGITS = {"gpt-2": False, "smollm": True}


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
        # GGUF files state add_bos_token instead of a post-processor that adds it; in Hugging
        # Face folders tokenizer.json's post-processor has usually added it already.
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
    ) -> str:
        """Render `messages` (and the functions the model may call, `tools`, in OpenAI's
        format) with the model's Jinja chat template, as transformers does."""
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (neither tokenizer_config.json's "
                "'chat_template', chat_template.jinja, nor GGUF 'tokenizer.chat_template'): "
                "use the completions API with a plain prompt instead"
            )
        try:
            return _compile_template(self.chat_template).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.bos_token_id),
                eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template rejected the messages: {error}") from error

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


@functools.cache
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers gives templates."""
    # Templates are data from the checkpoint: a sandbox keeps them from reaching Python.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3 templates
    return env.from_string(source)


def _tojson(value: Any, indent: int | None = None) -> str:
    # jinja2's own tojson escapes HTML characters; transformers' keeps text as written.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The tokenizer of `source`: tokenizer.json for folders, rebuilt from metadata for GGUF."""
    if source.kind == "hf":
        return _load_hf(source.path)
    return _load_gguf(source.path)


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


def _load_gguf(path: Path) -> Tokenizer:
    reader = open_gguf(path)
    model = gguf_value(reader, "tokenizer.ggml.model")
    pre = gguf_value(reader, "tokenizer.ggml.pre", "gpt-2")
    if model != "gpt2" or pre not in _GGUF_PRE_SPLITS_DIGITS:
        raise ValueError(
            f"{path}: the GGUF tokenizer (model {model!r}, pre-tokenizer {pre!r}) is not "
            "supported; pipellm rebuilds byte-level BPE tokenizers (model 'gpt2', pre-tokenizer "
            f"one of {', '.join(_GGUF_PRE_SPLITS_DIGITS)}). Use the model's Hugging Face "
            "directory instead."
        )
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in gguf_value(reader, "tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _GGUF_PRE_SPLITS_DIGITS[pre]:
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole, never pass through BPE, and be
    # skippable on decode; user-defined tokens match whole but are ordinary text.
    token_types = gguf_value(reader, "tokenizer.ggml.token_type")
    backend.add_special_tokens(_added_tokens(tokens, token_types, gguf.TokenType.CONTROL, True))
    backend.add_tokens(_added_tokens(tokens, token_types, gguf.TokenType.USER_DEFINED, False))
    return Tokenizer(
        backend,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=gguf_eos_token_ids(reader),
        chat_template=gguf_value(reader, "tokenizer.chat_template", None),
        add_bos_token=gguf_value(reader, "tokenizer.ggml.add_bos_token", False),
    )


def _added_tokens(
    tokens: list[str], token_types: list[int], kind: gguf.TokenType, special: bool
) -> list[AddedToken]:
    return [
        AddedToken(token, special=special, normalized=False)
        for token, token_type in zip(tokens, token_types, strict=True)
        if token_type == kind
    ]
