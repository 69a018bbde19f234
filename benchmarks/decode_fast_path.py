"""Decode steps on the fused decode path against the Python path, one model, taking turns.

The fused decode path (pipellm/model/decode_fast_path.py) runs a stage's layers for a batch of
decodes in one C++ call; PIPELLM_DECODE_FAST_PATH=0 leaves them to the Python path. Both give
the same bits, so only their time differs. This loads MODEL once (default: the gemma-3-270m
preset, its Q4_K_M GGUF file, with the settings `pipellm serve` uses) and, each round, takes
the two paths in turn (the order rotated), switching the stage's path in place: the same
weights, caches and process, as that setting does at start. A path's decode step is the time
of --sequences prompts of --prompt-len random tokens generating 1 + --decode-tokens tokens,
less the time of generating 1 (the prefill), over --decode-tokens; its layers' share, the time
spent in the stage's forward for decode-only batches, is printed beside it. Prints medians
over the rounds and the ratio unfused / fused.

    .venv/bin/python benchmarks/decode_fast_path.py                       # Gemma 3 270M
    .venv/bin/python benchmarks/decode_fast_path.py --model smollm2 --sequences 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from pipellm import LLM, SamplingParams
from pipellm.model.decode_fast_path import why_not_fused

PATHS = ("fused", "unfused")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m", help="a preset, GGUF file or folder")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=1, help="decoding at once")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def timed_forward(stage: torch.nn.Module, spent: list[float]) -> Callable:
    """stage.forward, adding the time of each decode-only batch to spent[0]."""
    forward = stage.forward

    def forward_timed(inputs, batch, kv_caches):
        if not (batch.prefills or batch.num_decodes == 0):
            started = time.perf_counter()
            out = forward(inputs, batch, kv_caches)
            spent[0] += time.perf_counter() - started
            return out
        return forward(inputs, batch, kv_caches)

    return forward_timed


def main() -> None:
    args = parse_args()
    llm = LLM(args.model, enable_prefix_caching=False)
    torch.set_num_threads(args.threads)  # after LLM(), which sets its own count
    stage = llm.engine.executor.worker.model
    fused = stage.decode_fast_path
    if fused is None:
        raise SystemExit(f"{args.model}: no fused decode path here ({why_not_fused(stage)})")
    spent = [0.0]
    stage.forward = timed_forward(stage, spent)
    vocab = stage.config.vocab_size
    rng = np.random.default_rng(args.seed)

    def run(max_tokens: int) -> float:
        batch = rng.integers(100, vocab, size=(args.sequences, args.prompt_len)).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    run(2)  # warm-up: first calls allocate
    step_ms: dict[str, list[float]] = {path: [] for path in PATHS}
    layers_ms: dict[str, list[float]] = {path: [] for path in PATHS}
    for round_index in range(args.rounds):
        order = PATHS if round_index % 2 == 0 else PATHS[::-1]
        for path in order:
            stage.decode_fast_path = fused if path == "fused" else None
            prefill = run(1)
            spent[0] = 0.0
            whole = run(1 + args.decode_tokens)
            step_ms[path].append((whole - prefill) / args.decode_tokens * 1e3)
            layers_ms[path].append(spent[0] / args.decode_tokens * 1e3)
    stage.decode_fast_path = fused
    llm.shutdown()

    print(
        f"{args.model}: {args.sequences} sequence(s), {args.prompt_len}-token prompts, "
        f"{args.decode_tokens} decode steps, {args.threads} threads, medians of {args.rounds}"
    )
    print(f"{'path':<10}{'decode step':>14}{'stage forward':>16}")
    median = {path: statistics.median(step_ms[path]) for path in PATHS}
    median_layers = {path: statistics.median(layers_ms[path]) for path in PATHS}
    for path in PATHS:
        print(f"{path:<10}{median[path]:>11.2f} ms{median_layers[path]:>13.2f} ms")
    print(
        f"fused speed-up: {median['unfused'] / median['fused']:.2f}x a decode step, "
        f"{median_layers['unfused'] / median_layers['fused']:.2f}x the stage's forward"
    )


if __name__ == "__main__":
    main()
