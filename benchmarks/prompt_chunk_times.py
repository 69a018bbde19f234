"""Fits the chunk-cost model (pipellm/engine/chunk_cost.py): how long one prompt chunk of c
tokens after p cached tokens takes on one stage, and how much slower per FLOP the attention
runs than the linear layers.

The whole model on one thread (P = 1, as one stage of P = 2 runs), chunks of each size at each
prefix, best of --repeats; then a least-squares fit of

    t(p, c) = t0 + a * c + b * c * (p + (c + 1) / 2)

and attention_slowdown = (b / a) / (4 q_dim / (2 P_layer)). Prints the table, the fit, its
residuals and what cost-balanced chunks of a 128-token budget look like along a long prompt.

With --whole N it first times one N-token prompt computed whole against the same prompt in
chunks of each --sizes (the chunks' times summed, each after its real prefix), side by side,
and prints chunked / whole: what a prompt pays for being cut into micro-batches, split into
attention (every layer's paged_attention call, timed around it) and the rest (the linear
layers, norms, RoPE and the step's overhead).

--prefixes '' skips the fit (only the comparison).

  .venv/bin/python benchmarks/prompt_chunk_times.py \
      [--prefixes 0,512,1024,1536,1920 --sizes 16,32,64,128,256] [--whole 2048]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

import pipellm.model.llama as llama_module
from pipellm.config import EngineConfig
from pipellm.engine.chunk_cost import ChunkCostModel
from pipellm.executor.uniproc import UniProcExecutor
from pipellm.protocol import ScheduledRequest, SchedulerOutput
from pipellm.sampling_params import SamplingParams


class AttentionClock:
    """Wraps the model's attention call to add up the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._attention: Callable = llama_module.paged_attention
        llama_module.paged_attention = self._timed

    def _timed(self, *args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return self._attention(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started


def time_chunk(executor: UniProcExecutor, config: EngineConfig, prefix: int, size: int) -> float:
    """One forward of a `size`-token chunk whose first `prefix` tokens are taken as cached (the
    KV there is whatever the cache holds: the time does not depend on it)."""
    total = prefix + size
    blocks = list(range(-(-total // config.block_size)))
    item = ScheduledRequest(
        request_id="chunk",
        num_computed_tokens=prefix,
        num_scheduled_tokens=size,
        new_token_ids=[7 + i % 100 for i in range(total)],
        new_block_ids=blocks,
        sampling_params=SamplingParams(max_tokens=1),
        sample=False,
        # Sliding-window groups' smaller pools (0 is their null block): only the time counts.
        new_group_block_ids=[
            [1 + b % (g.num_blocks - 1) for b in blocks] for g in config.kv_cache_groups[1:]
        ],
    )
    started = time.perf_counter()
    executor.submit(SchedulerOutput(0, [item], freed_request_ids=["chunk"])).result()
    return time.perf_counter() - started


def compare_whole(
    executor: UniProcExecutor,
    config: EngineConfig,
    length: int,
    sizes: list[int],
    repeats: int,
    clock: AttentionClock,
) -> None:
    """One prompt whole against the same prompt in chunks, taking turns, best of `repeats`
    (each size's attention time from the same, best, repeat)."""
    best: dict[int, tuple[float, float]] = {}
    for _ in range(repeats):
        for size in [length, *sizes]:
            clock.seconds = 0.0
            took = sum(
                time_chunk(executor, config, prefix, min(size, length - prefix))
                for prefix in range(0, length, size)
            )
            if took < best.get(size, (float("inf"), 0.0))[0]:
                best[size] = (took, clock.seconds)
    whole, whole_attention = best[length]
    print(
        f"one {length}-token prompt: whole {whole * 1e3:.0f} ms "
        f"(attention {whole_attention * 1e3:.0f}, rest {(whole - whole_attention) * 1e3:.0f})"
    )
    for size in sizes:
        took, attention = best[size]
        print(
            f"  in {size:4d}-token chunks: {took * 1e3:7.0f} ms ({took / whole:.2f}x whole); "
            f"attention {attention * 1e3:6.0f} ms ({attention / whole_attention:.2f}x), "
            f"rest {(took - attention) * 1e3:6.0f} ms "
            f"({(took - attention) / (whole - whole_attention):.2f}x)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--prefixes", default="0,512,1024,1536,1920")
    parser.add_argument("--sizes", default="16,32,64,128,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--whole", type=int, default=0, help="prompt length to compare (0: none)")
    args = parser.parse_args()
    prefixes = [int(x) for x in args.prefixes.split(",")] if args.prefixes else []
    sizes = [int(x) for x in args.sizes.split(",")]
    config = EngineConfig(
        model=args.model,
        num_threads=args.threads,
        max_model_len=max([*prefixes, 0]) + max(sizes) + args.whole + 16,
        distributed_executor_backend="uni",
    )
    executor = UniProcExecutor(config)
    clock = AttentionClock()
    time_chunk(executor, config, 0, 64)  # warm-up: first-touch of buffers and the KV cache
    if args.whole:
        compare_whole(executor, config, args.whole, sizes, args.repeats, clock)
    if not prefixes:
        return
    rows = []
    for prefix in prefixes:
        for size in sizes:
            best = min(time_chunk(executor, config, prefix, size) for _ in range(args.repeats))
            rows.append((prefix, size, best))
            print(f"prefix {prefix:5d}  chunk {size:4d}  {best * 1e3:8.1f} ms", flush=True)
    p = np.array([r[0] for r in rows], dtype=float)
    c = np.array([r[1] for r in rows], dtype=float)
    t = np.array([r[2] for r in rows])
    design = np.stack([np.ones_like(c), c, c * (p + (c + 1) / 2)], axis=1)
    (t0, a, b), *_ = np.linalg.lstsq(design, t, rcond=None)
    fitted = design @ np.array([t0, a, b])
    flops_ratio = ChunkCostModel.for_model(config.model_config, 1.0).attention_ratio
    slowdown = (b / a) / flops_ratio
    print(
        f"\nfit: t0 {t0 * 1e3:.2f} ms, a {a * 1e3:.3f} ms/token, b {b * 1e6:.4f} us/(token x ctx)"
    )
    print(f"b/a = {b / a:.3e} per context token; FLOP ratio {flops_ratio:.3e}")
    print(f"attention_slowdown = {slowdown:.2f}")
    rel = np.abs(fitted - t) / t
    print(f"residuals: max {rel.max():.1%}, mean {rel.mean():.1%}")
    model = ChunkCostModel(b / a)
    target, prefix, chunks = model.cost(0, 128), 0, []
    while prefix < 2048:
        size = min(2048 - prefix, model.tokens_for(prefix, target))
        chunks.append(size)
        prefix += size
    print(f"cost-balanced chunks of a 2048-token prompt, 128-token budget: {chunks}")


if __name__ == "__main__":
    main()
