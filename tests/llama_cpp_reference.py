"""llama.cpp's greedy tokens and top-5 logprobs on a GGUF file, through llama-cpp-python: the
reference pipellm's GGUF outputs are compared against. Tests read the stored file
(tests/data/); `python -m tests.llama_cpp_reference GGUF OUT.json` writes it again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

NUM_NEW_TOKENS = 32
TOP_LOGPROBS = 5

_PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Books "
    "that had taken scribes months to copy could now be produced by the hundred, and within "
    "fifty years printing shops had opened in more than two hundred European cities. ",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant "
    "cells, chlorophyll absorbs mostly blue and red light, water molecules are split, oxygen "
    "is released, and the energy is stored in the bonds of glucose built from carbon dioxide. ",
    "To make a simple bread dough, mix five hundred grams of flour with ten grams of salt, "
    "seven grams of dried yeast and three hundred and twenty millilitres of warm water. Knead "
    "for ten minutes, let it rise for an hour, shape it, and bake it at two hundred degrees. ",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint([fibonacci(i) for i in range(10)])\n",
]

# The last two prompts are longer than Gemma 3's 512-token sliding window.
PROMPT_TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
    _PARAGRAPHS[3] + "# The output of this program is",
    "".join(_PARAGRAPHS) + "In summary,",
    "".join(_PARAGRAPHS * 2) + "The four passages above describe",
    "".join(_PARAGRAPHS[::-1] * 3) + "The first passage was about",
    "".join(_PARAGRAPHS * 4) + "Translate the first sentence into French:",
]


def why_llama_cpp_unavailable() -> str | None:
    """None if llama-cpp-python imports here (its library loaded), else why not."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError, RuntimeError) as error:
        return f"llama-cpp-python is not importable: {error}"
    return None


def tokenize(path: Path, texts: list[str]) -> list[list[int]]:
    """llama.cpp's token ids of `texts`, BOS first as the file asks."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(text.encode(), add_bos=True, special=False) for text in texts]


def greedy_with_top_logprobs(
    path: Path, prompts: list[list[int]], num_new_tokens: int = NUM_NEW_TOKENS
) -> list[dict]:
    """For each prompt: llama.cpp's greedy tokens and, at each step, its TOP_LOGPROBS most
    likely tokens with their log-probabilities ([[token, logprob], ...], best first)."""
    import llama_cpp

    n_ctx = max(len(p) for p in prompts) + num_new_tokens
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=2, verbose=False)
    cases = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        tokens, tops = [], []
        for _ in range(num_new_tokens):
            # Without logits_all, llama-cpp-python keeps no scores: read the last row itself.
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
            logits = logits.astype(np.float64)
            logprobs = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
            best = np.argsort(-logprobs, kind="stable")[:TOP_LOGPROBS]
            tokens.append(int(best[0]))
            tops.append([[int(t), round(float(logprobs[t]), 5)] for t in best])
            llm.eval([tokens[-1]])
        cases.append({"prompt": prompt, "tokens": tokens, "top_logprobs": tops})
    return cases


def main(gguf_path: str, out_path: str) -> None:
    import llama_cpp

    path = Path(gguf_path)
    prompts = tokenize(path, PROMPT_TEXTS)
    reference = {
        "model": path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "num_new_tokens": NUM_NEW_TOKENS,
        "prompt_texts": PROMPT_TEXTS,
        "cases": greedy_with_top_logprobs(path, prompts),
    }
    Path(out_path).write_text(json.dumps(reference, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
