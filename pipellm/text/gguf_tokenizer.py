"""A GGUF file's tokenizer, rebuilt from its own metadata so that it gives llama.cpp's ids.

Two kinds (`tokenizer.ggml.model`):
- "llama": SentencePiece (Llama 2, Mistral, Gemma). Spaces become "▁"; a space is put before
  the text and after every special token when the file's add_space_prefix says so (llama.cpp's
  rule, which is SentencePiece's "legacy" behaviour); adjacent pieces merge while their union is
  a token, the best-scored union first; a character outside the vocabulary becomes its UTF-8
  bytes as <0xXX> tokens.
- "gpt2": byte-level BPE with the file's merges and the pre-tokenizer `tokenizer.ggml.pre`
  names (gguf_pretokenizers.py).
Both are expressed as a `tokenizers` BPE model: SentencePiece's "merge the best-scored union"
is BPE whose merge ranks are the unions' scores, best first.

Special tokens follow llama.cpp (src/llama-vocab.cpp): control and unknown tokens are matched
whole in the text (as llama.cpp's parse_special) and skipped by skip_special_tokens;
user-defined tokens are matched whole but are text; byte tokens are never matched.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from pipellm.loader.gguf_file import GGUFFile, open_gguf
from pipellm.text.gguf_pretokenizers import GPT2, RULES, PreTokenizerRule, supported_names
from pipellm.text.tokenizer import Tokenizer

_MODEL_KEY = "tokenizer.ggml.model"
_PRE_KEY = "tokenizer.ggml.pre"
_KINDS = {"llama": "SentencePiece", "gpt2": "byte-level BPE"}
_SPACE = "▁"  # U+2581, SentencePiece's stand-in for a space

# Tokens that end generation, found by their text as llama.cpp does (a GGUF file names one EOS
# only; Gemma's <end_of_turn>, for one, ends a chat turn). llama.cpp marks them control tokens.
_END_OF_GENERATION = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "<end_of_utterance>",
    }
)
_END_OF_GENERATION_KEYS = (
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
)


class UnsupportedTokenizerError(ValueError):
    """The GGUF file's tokenizer kind or pre-tokenizer is one pipellm cannot rebuild."""


def check_gguf_tokenizer(path: Path) -> None:
    """Raises UnsupportedTokenizerError, naming the metadata key and its value, unless the
    file's tokenizer can be rebuilt (cheap: reads two metadata fields)."""
    _pre_tokenizer_rule(open_gguf(path))


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    reader = open_gguf(path)
    rule = _pre_tokenizer_rule(reader)
    # llama.cpp names empty tokens so that every text maps to one id.
    raw = reader.value("tokenizer.ggml.tokens")
    tokens = [text or f"[EMPTY_{i}]" for i, text in enumerate(raw)]
    types = _token_types(reader, tokens)
    if rule is None:
        backend = _sentencepiece(reader, tokens)
        add_bos_default, has_bos = True, True
    else:
        backend = _byte_level_bpe(reader, tokens, rule)
        add_bos_default, has_bos = rule.add_bos_default, rule.has_bos
    # Control (and unknown) tokens are special: skipped by skip_special_tokens, as llama.cpp
    # renders them only when asked to; user-defined ones are text.
    control = (gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN)
    backend.add_special_tokens(_added(tokens, types, control, special=True))
    backend.add_tokens(_added(tokens, types, (gguf.TokenType.USER_DEFINED,), special=False))

    # llama.cpp's defaults when the file names no BOS/EOS: SentencePiece's ids 1 and 2.
    default_bos, default_eos = (1, 2) if rule is None else (None, None)
    bos = reader.value("tokenizer.ggml.bos_token_id", default_bos) if has_bos else None
    eos = reader.value("tokenizer.ggml.eos_token_id", default_eos)
    add_bos = reader.value("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None
    add_eos = reader.value("tokenizer.ggml.add_eos_token", False) and eos is not None
    if add_bos or add_eos:  # NOTE: none at all when nothing is added: a no-op one costs time
        backend.post_processor = _bos_eos_processor(
            tokens, bos if add_bos else None, eos if add_eos else None
        )
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=_end_of_generation_ids(reader, tokens, eos),
        chat_template=reader.value("tokenizer.chat_template", None),
        add_bos_token=False,  # the post-processor adds BOS (and EOS) as the file says
    )


def _token_types(reader: GGUFFile, tokens: list[str]) -> list[int]:
    """The file's token types, with end-of-generation tokens made control tokens (llama.cpp
    overrides them so, as some files mark them normal)."""
    types = reader.value("tokenizer.ggml.token_type", None)
    types = types or [gguf.TokenType.NORMAL] * len(tokens)
    return [
        gguf.TokenType.CONTROL if text in _END_OF_GENERATION else kind
        for text, kind in zip(tokens, types, strict=True)
    ]


def _pre_tokenizer_rule(reader: GGUFFile) -> PreTokenizerRule | None:
    """The byte-level BPE rule of the file; None for SentencePiece."""
    model = reader.value(_MODEL_KEY)
    if model not in _KINDS:
        kinds = ", ".join(f"{name!r} ({kind})" for name, kind in _KINDS.items())
        raise UnsupportedTokenizerError(
            f"{reader.path}: GGUF metadata {_MODEL_KEY} = {model!r} is not supported; pipellm "
            f"rebuilds the tokenizer kinds {kinds}. Pass a Hugging Face folder with "
            "tokenizer.json as --tokenizer, or use the model's Hugging Face folder."
        )
    if model == "llama":
        return None
    # llama.cpp reads a file without a pre-tokenizer name as "default" (and warns).
    pre = reader.value(_PRE_KEY, "default")
    if pre not in RULES:
        raise UnsupportedTokenizerError(
            f"{reader.path}: GGUF metadata {_PRE_KEY} = {pre!r} is not supported; pipellm "
            f"knows the byte-level BPE pre-tokenizers {supported_names()}. Pass a Hugging "
            "Face folder with tokenizer.json as --tokenizer, or use the model's Hugging Face "
            "folder."
        )
    return RULES[pre]


def _sentencepiece(reader: GGUFFile, tokens: list[str]) -> tokenizers.Tokenizer:
    scores = reader.value("tokenizer.ggml.scores")
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={text: i for i, text in enumerate(tokens)},
            merges=_merges_by_score(tokens, scores),
            byte_fallback=True,
        )
    )
    add_space_prefix = reader.value("tokenizer.ggml.add_space_prefix", True)
    # NOTE: the normalizer runs on each stretch of text between special tokens, so the prefix
    # space lands after every special token too, as in llama.cpp.
    spaces = normalizers.Replace(" ", _SPACE)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPACE), spaces]) if add_space_prefix else spaces
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # the space the encoder put first
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every token into two tokens, the best-scored token's splits first.

    llama.cpp merges any adjacent pair whose union is a token, best union score first
    (leftmost on a tie); BPE with these ranks does the same.
    """
    ids = {text: i for i, text in enumerate(tokens)}
    splits = [
        (-scores[token_id], token_id, cut)
        for token_id, text in enumerate(tokens)
        for cut in range(1, len(text))
        if text[:cut] in ids and text[cut:] in ids
    ]
    splits.sort()
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in splits]


def _byte_level_bpe(
    reader: GGUFFile, tokens: list[str], rule: PreTokenizerRule
) -> tokenizers.Tokenizer:
    merges = [tuple(merge.split(" ", 1)) for merge in reader.value("tokenizer.ggml.merges")]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={text: i for i, text in enumerate(tokens)},
            merges=merges,
            ignore_merges=rule.ignore_merges,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(_pre_tokenizer_steps(rule.regexes))
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer_steps(regexes: tuple[str, ...]) -> list[pre_tokenizers.PreTokenizer]:
    """The rule's splits, then the byte-level mapping. Two common steps use tokenizers'
    equivalent built-ins, as Hugging Face's own GPT-2-style tokenizers do: single digits
    (Digits splits at Unicode numerics, as \\p{N}) and GPT-2's split (ByteLevel's regex is
    GPT-2's with a final "|\\s+", which only names a piece the split isolates anyway)."""
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Digits(individual_digits=True)
        if regex == r"\p{N}"
        else pre_tokenizers.Split(Regex(regex), "isolated")
        for regex in regexes
    ]
    if regexes[-1] == GPT2:
        return [*steps[:-1], pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    return [*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


def _added(
    tokens: list[str], types: list[int], kinds: tuple[int, ...], special: bool
) -> list[AddedToken]:
    return [
        AddedToken(text, special=special, normalized=False)
        for text, kind in zip(tokens, types, strict=True)
        if kind in kinds
    ]


def _bos_eos_processor(
    tokens: list[str], bos: int | None, eos: int | None
) -> processors.TemplateProcessing:
    """Puts BOS first and EOS last when the file's add_bos_token / add_eos_token ask for them
    (always, as llama.cpp: a text that starts with BOS's text gets two)."""
    first = [tokens[bos]] if bos is not None else []
    last = [tokens[eos]] if eos is not None else []
    special = {tokens[i]: i for i in (bos, eos) if i is not None}
    return processors.TemplateProcessing(
        single=[*first, "$A", *last],
        pair=[*first, "$A", *last, "$B:1"],
        special_tokens=list(special.items()),
    )


def _end_of_generation_ids(reader: GGUFFile, tokens: list[str], eos: int | None) -> tuple[int, ...]:
    """EOS first (chat templates render it as eos_token), then every other token that ends
    generation in llama.cpp: the file's end-of-turn and end-of-message ids, and tokens of
    _END_OF_GENERATION's texts."""
    named = (reader.value(key, None) for key in _END_OF_GENERATION_KEYS)
    by_text = (i for i, text in enumerate(tokens) if text in _END_OF_GENERATION)
    found: Iterable[int | None] = (eos, *named, *sorted(by_text))
    return tuple(dict.fromkeys(i for i in found if i is not None and 0 <= i < len(tokens)))
