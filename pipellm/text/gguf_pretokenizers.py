"""Byte-level BPE pre-tokenizers by the names GGUF files give them (`tokenizer.ggml.pre`).

A GGUF file names its pre-tokenizer instead of storing it; llama.cpp maps each name to the
regular expressions of the model's own tokenizer.json (llama.cpp src/llama-vocab.cpp,
`llm_tokenizer_bpe`). Each expression splits the pieces the previous one left; the text between
two matches stays a piece of its own (tokenizers' `Split(..., "isolated")`).

Where llama.cpp adapted an expression, the adapted form is the one written here, since
llama.cpp's ids are the reference: `(?i:'s|...)` became `(?:'[sS]|...)` (case-insensitive
matching also folds U+017F "ſ" to "s"), and the upper/lower-case letter classes of Tekken and
GPT-4o became "a letter that is not a-z" / "not A-Z", because llama.cpp tells letters apart
by category only.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PORO_SPLIT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_UPPER = r"((?=[\p{L}])([^a-z]))"  # llama.cpp's stand-in for [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]
_LOWER = r"((?=[\p{L}])([^A-Z]))"  # and for [\p{Ll}\p{Lm}\p{Lo}\p{M}]
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ASCII_PUNCT_THEN_LETTERS = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
_DEEPSEEK3 = (
    _ASCII_PUNCT_THEN_LETTERS + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Written with escapes: several of these characters are ones an editor may silently replace
# by their canonical equivalents (U+212A KELVIN SIGN by "K"), which would change the ranges.
_CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letters: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee and kin, as its
# tokenizer.json lists them.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_PUNCTUATION = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"


@dataclass(frozen=True)
class PreTokenizerRule:
    """How llama.cpp tokenizes text for one `tokenizer.ggml.pre` name."""

    regexes: tuple[str, ...]
    # A piece that is a whole vocabulary token is taken as is, not merged (Llama 3's
    # tokenizer.json sets BPE's ignore_merges).
    ignore_merges: bool = False
    # llama.cpp's add_bos when the file has no tokenizer.ggml.add_bos_token key.
    add_bos_default: bool = False
    # ChatGLM: llama.cpp drops the BOS id the file names.
    has_bos: bool = True


_LLAMA3 = PreTokenizerRule((LLAMA3,), ignore_merges=True, add_bos_default=True)
_GPT2 = PreTokenizerRule((GPT2,))
_STARCODER = PreTokenizerRule((r"\p{N}", GPT2))  # digits one by one, then GPT-2's split
_QWEN2 = PreTokenizerRule((QWEN2,))
_DBRX = PreTokenizerRule((LLAMA3,))
_PORO = PreTokenizerRule((_PORO_SPLIT,))
_DEEPSEEK3 = PreTokenizerRule((r"\p{N}{1,3}", _CJK_KANA, _DEEPSEEK3))

RULES: dict[str, PreTokenizerRule] = {
    "default": PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3,
    ),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"),
        _GPT2,
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"),
        _STARCODER,
    ),
    **dict.fromkeys(
        (
            "qwen2",
            "deepseek-r1-qwen",
            "megrez",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "grok-2",
        ),
        _QWEN2,
    ),
    "qwen35": PreTokenizerRule((_QWEN35,)),
    "dbrx": _DBRX,
    "smaug-bpe": _DBRX,
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), _PORO),
    "viking": PreTokenizerRule((_PORO_SPLIT, r"\p{N}")),
    "falcon": PreTokenizerRule((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")),
    "deepseek-llm": PreTokenizerRule(
        (
            "[\r\n]",
            _DEEPSEEK_LETTERS,
            _DEEPSEEK_PUNCTUATION,
            r"\s+$",
            _CJK_HANGUL,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizerRule(
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")
    ),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    "chatglm-bpe": PreTokenizerRule((LLAMA3,), has_bos=False),
    "glm4": PreTokenizerRule((LLAMA3,), ignore_merges=True, has_bos=False),
    "tekken": PreTokenizerRule((_TEKKEN,), ignore_merges=True, add_bos_default=True),
    **dict.fromkeys(("gpt-4o", "llama4"), PreTokenizerRule((_GPT4O,))),
    "seed-coder": PreTokenizerRule(
        (
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    **dict.fromkeys(
        ("bailingmoe", "bailingmoe2", "llada-moe"),
        PreTokenizerRule(
            (
                r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
            )
        ),
    ),
}


def supported_names() -> str:
    return ", ".join(sorted(RULES))
