"""What vLLM's logits rules and structured outputs cost a decode step: a micro-batch of 16
decodes on the built-in model, plain greedy against greedy with presence, frequency and
repetition penalties and a logit_bias, and against greedy constrained by a JSON schema, run by
run in turns (A B C A B C ...) so load on this shared machine hurts all alike.

Figures: whole generate() runs (16 prompts, --output-len decode steps each; the rules and masks
act on every step); the sampler alone on one step's [16, vocab] logits with and without the
rules; and the grammar masks' own time per step inside the JSON runs (computing 16 bitmasks,
banning the forbidden tokens, advancing the matchers).

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
from pipellm.worker.structured_output import GrammarMasks

BATCH = 16
# A JSON object that cannot be complete within the run (64 strings at least), so that every
# step is masked: keys, punctuation and mostly string contents, where most tokens are allowed.
SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["items"],
}


def rules_settings(output_len: int) -> dict:
    return dict(
        temperature=0,
        max_tokens=output_len,
        ignore_eos=True,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={100: 1.0, 200: -1.0, 250: 2.0},
    )


class MaskTimer:
    """Adds up the time GrammarMasks.apply takes (the uni backend runs it in this process)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._apply = GrammarMasks.apply

    def __enter__(self) -> MaskTimer:
        timer = self

        def timed_apply(masks, *args, **kwargs):
            start = time.perf_counter()
            try:
                return timer._apply(masks, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start
                timer.calls += 1

        GrammarMasks.apply = timed_apply
        return self

    def __exit__(self, *exc: object) -> None:
        GrammarMasks.apply = self._apply


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
        constrained = SamplingParams(
            temperature=0,
            max_tokens=args.output_len,
            ignore_eos=True,
            structured_outputs={"json": SCHEMA},
        )
        times: dict[str, list[float]] = {"plain": [], "rules": [], "json": []}
        mask_ms: list[float] = []
        generator = torch.Generator().manual_seed(1)
        llm.generate([[5] * args.input_len], constrained, use_tqdm=False)  # compile the grammar
        for _ in range(args.repeats):
            # Fresh prompts each repeat: no prefix-cache hits.
            prompts = torch.randint(3, vocab, (BATCH, args.input_len), generator=generator)
            prompts = prompts.tolist()
            times["plain"].append(time_generate(llm, prompts, plain))
            times["rules"].append(time_generate(llm, prompts, penalised))
            with MaskTimer() as timer:
                times["json"].append(time_generate(llm, prompts, constrained))
            mask_ms.append(timer.seconds / timer.calls * 1e3)
        step_ms = {k: statistics.median(v) / args.output_len * 1e3 for k, v in times.items()}
        sampler_plain = time_sampler(vocab, None)
        sampler_rules = time_sampler(vocab, penalised)
    print(f"micro-batch of {BATCH} decodes, {args.output_len} steps, vocab {vocab}")
    print(
        f"generate per decode step: plain {step_ms['plain']:.1f} ms, with rules "
        f"{step_ms['rules']:.1f} ms, ratio {step_ms['rules'] / step_ms['plain']:.3f}"
    )
    print(
        f"generate per decode step: plain {step_ms['plain']:.1f} ms, with a JSON schema "
        f"{step_ms['json']:.1f} ms, ratio {step_ms['json'] / step_ms['plain']:.3f}"
    )
    extra = sampler_rules - sampler_plain
    print(
        f"sampler alone: plain {sampler_plain:.2f} ms, with rules {sampler_rules:.2f} ms; "
        f"the rules add {extra:.2f} ms = {extra / step_ms['plain']:.1%} of a plain step"
    )
    mask = statistics.median(mask_ms)
    print(
        f"grammar masks of {BATCH} rows per step: {mask:.2f} ms = "
        f"{mask / step_ms['plain']:.1%} of a plain step"
    )


if __name__ == "__main__":
    main()
