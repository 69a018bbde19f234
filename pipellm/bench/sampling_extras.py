"""What vLLM's logits rules cost a decode step: a micro-batch of 16 decodes on the built-in
model, plain greedy against greedy with presence, frequency and repetition penalties and a
logit_bias, run by run in turns (A B A B ...) so load on this shared machine hurts both alike.

Two figures: whole generate() runs (16 prompts, --output-len decode steps each; the rules act on
every step), and the sampler alone on one step's [16, vocab] logits with and without the rules.

    .venv/bin/python -m pipellm.bench.sampling_extras                 # 3 repeats, 16 x 32 tokens
    .venv/bin/python -m pipellm.bench.sampling_extras --repeats 1 --output-len 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipellm import LLM, SamplingParams
from pipellm.model.logits_rules import RowRules, TokenCounts
from pipellm.model.sampler import sample

BATCH = 16


def rules_settings(output_len: int) -> dict:
    return dict(
        temperature=0,
        max_tokens=output_len,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={100: 1.0, 200: -1.0, 300: 2.0},
    )


def time_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def time_sampler(vocab: int, params: SamplingParams | None, iterations: int = 50) -> float:
    """ms per call of sample() on [16, vocab] logits; params None: plain greedy rows."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(BATCH, vocab, generator=generator)
    plain = SamplingParams(temperature=0)
    rows, rules = [plain] * BATCH, None
    if params is not None:
        rows = [params] * BATCH
        tokens = torch.randint(0, vocab, (64,), generator=generator).tolist()
        rules = [RowRules(params, 32, tokens, TokenCounts.of(tokens, 32, vocab))] * BATCH
    positions = [32] * BATCH
    sample(logits, rows, positions, generator, rules)  # warm-up
    start = time.perf_counter()
    for _ in range(iterations):
        sample(logits, rows, positions, generator, rules)
    return (time.perf_counter() - start) / iterations * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    with LLM(args.model, max_num_seqs=BATCH) as llm:
        vocab = llm.config.model_config.vocab_size
        plain = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        penalised = SamplingParams(**rules_settings(args.output_len)).resolve(
            (), lambda text: [], vocab
        )
        times: dict[str, list[float]] = {"plain": [], "rules": []}
        generator = torch.Generator().manual_seed(1)
        for _ in range(args.repeats):
            # Fresh prompts each repeat: no prefix-cache hits.
            prompts = torch.randint(3, vocab, (BATCH, args.input_len), generator=generator)
            prompts = prompts.tolist()
            times["plain"].append(time_generate(llm, prompts, plain))
            times["rules"].append(time_generate(llm, prompts, penalised))
        step_ms = {k: statistics.median(v) / args.output_len * 1e3 for k, v in times.items()}
        sampler_plain = time_sampler(vocab, None)
        sampler_rules = time_sampler(vocab, penalised)
    print(f"micro-batch of {BATCH} decodes, {args.output_len} steps, vocab {vocab}")
    print(
        f"generate per decode step: plain {step_ms['plain']:.1f} ms, with rules "
        f"{step_ms['rules']:.1f} ms, ratio {step_ms['rules'] / step_ms['plain']:.3f}"
    )
    extra = sampler_rules - sampler_plain
    print(
        f"sampler alone: plain {sampler_plain:.2f} ms, with rules {sampler_rules:.2f} ms; "
        f"the rules add {extra:.2f} ms = {extra / step_ms['plain']:.1%} of a plain step"
    )


if __name__ == "__main__":
    main()
