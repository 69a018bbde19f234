"""`make demo`: a chat answer and a throughput line from the built-in model."""

from __future__ import annotations

import random
import time

from pipellm.llm import LLM
from pipellm.sampling_params import SamplingParams


def run_demo(num_prompts: int = 16, prompt_len: int = 128, output_len: int = 32) -> None:
    with LLM() as llm:
        print(f"model: {llm.config.model_name} ({llm.config.source.path})")
        question = "What is the capital of France?"
        answer = llm.chat(
            [{"role": "user", "content": question}],
            SamplingParams(temperature=0, max_tokens=48),
            use_tqdm=False,
        )[0]
        print(f"user: {question}\nassistant: {answer.outputs[0].text.strip()}\n")

        rng = random.Random(0)
        vocab = llm.config.model_config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(
            f"throughput: {num_prompts} requests x ({prompt_len} prompt + {output_len} new) "
            f"tokens in {elapsed:.2f} s = {generated / elapsed:.1f} output tok/s, "
            f"{(generated + num_prompts * prompt_len) / elapsed:.1f} total tok/s"
        )
