"""How often `quantization="gguf_int8"` (int8 activations, integer dot products) picks the same next
token as the exact path (`gguf`, bit-identical to float32), on the built-in SmolLM2-135M.

The exact path writes greedy continuations of a set of prompts; then both settings read each
prompt + continuation in one pass (prompt logprobs, top 1) and the top-1 tokens are compared at
every position (teacher-forced agreement: each position sees the same context in both). Also
reported: how many free-running greedy continuations of the int8 path equal the exact ones,
and where the first differing token falls. Each row's int8 arithmetic does not depend on the
other rows of its batch, so the prefill pass computes what a decode step would.

    .venv/bin/python benchmarks/int8_agreement.py                       # 16 prompts x 128 tokens
"""

from __future__ import annotations

import argparse
import statistics

from pipellm import LLM, SamplingParams

PROMPTS = [
    "The three primary colors are",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The capital of France is",
    "Photosynthesis is the process by which",
    "To make a cup of tea, first",
    "import numpy as np\n\ndef normalize(x):",
    "The French Revolution began in 1789 when",
    "Here is a list of fruits: apple, banana,",
    "In mathematics, a prime number is",
    "Dear hiring manager, I am writing to apply for",
    "The quick brown fox",
    "SELECT name, email FROM users WHERE",
    "Water boils at 100 degrees Celsius because",
    "The best way to learn a new language is",
    "Q: What is 12 times 12?\nA:",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = parser.parse_args()
    prompts = PROMPTS[: args.prompts]
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    read = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)

    def top1(llm: LLM, token_lists: list[list[int]]) -> list[list[int]]:
        outputs = llm.generate(token_lists, read, use_tqdm=False)
        return [[entry[1][0][0] for entry in o.prompt_logprobs[1:]] for o in outputs]

    with LLM(quantization="gguf", enable_prefix_caching=False) as exact:
        runs = exact.generate(prompts, greedy, use_tqdm=False)
        texts = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in runs]
        continuations = [list(o.outputs[0].token_ids) for o in runs]
        exact_top = top1(exact, texts)
    with LLM(quantization="gguf_int8", enable_prefix_caching=False) as int8:
        int8_top = top1(int8, texts)
        free_runs = int8.generate(prompts, greedy, use_tqdm=False)
        free = [list(o.outputs[0].token_ids) for o in free_runs]

    positions = sum(len(t) for t in exact_top)
    pairs = zip(exact_top, int8_top, strict=True)
    same = sum(a == b for e, i in pairs for a, b in zip(e, i, strict=True))
    firsts = []
    for e, i in zip(continuations, free, strict=True):
        differ = [n for n, (a, b) in enumerate(zip(e, i, strict=True)) if a != b]
        firsts.append(differ[0] if differ else len(e))
    identical = sum(first == args.tokens for first in firsts)
    print(f"{len(prompts)} prompts, {args.tokens} greedy tokens each (the exact path's)")
    print(
        f"teacher-forced top-1 agreement, int8 vs exact: {same}/{positions} = "
        f"{same / positions:.2%} of positions"
    )
    print(
        f"free-running greedy: {identical}/{len(prompts)} continuations identical; first "
        f"differing token at median {statistics.median(firsts):.0f} (of {args.tokens}), "
        f"min {min(firsts)}"
    )


if __name__ == "__main__":
    main()
