"""A one-sequence decode step's layers: the Python path against the fused decode path.

Runs the built-in SmolLM2-135M on one 256-token prompt, captures a decode step's inputs, and
re-runs that step's stage forward in a loop, the two paths taking turns (A B A B): the Python
path (`LlamaStage.decode_fast_path = None`, model/llama.py) and the fused one
(model/decode_fast_path.py, kernels/decode_layers.cpp), plus DecodeLayers.forward alone. The
difference per layer is the Python glue the fused path removes (docs/performance.md).

    cpulock bench .venv/bin/python -m pipellm.bench.decode_layer_costs --quantization gguf_int8
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from pipellm import LLM, SamplingParams


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 5):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="gguf_int8", choices=("gguf", "gguf_int8"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100, help="calls per timing")
    args = parser.parse_args()
    llm = LLM(None, max_num_seqs=1, enable_prefix_caching=False, quantization=args.quantization)
    torch.set_num_threads(args.threads)
    model = llm.engine.executor.worker.model
    fused = model.decode_fast_path
    if fused is None:
        raise SystemExit("the fused decode path is off here (PIPELLM_DECODE_FAST_PATH=0?)")
    captured = {}
    forward = model.forward

    def capture(inputs, batch, kv_caches):
        if not batch.prefills:
            captured["args"] = (inputs, batch, kv_caches)
        return forward(inputs, batch, kv_caches)

    model.forward = capture
    prompt = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm.generate([prompt.tolist()], params, use_tqdm=False)
    model.forward = forward
    inputs, batch, kv_caches = captured["args"]

    def python_path() -> torch.Tensor:
        model.decode_fast_path = None
        try:
            return model(inputs, batch, kv_caches)
        finally:
            model.decode_fast_path = fused

    runs = {
        "Python path, stage forward": python_path,
        "fused path, stage forward": lambda: model(inputs, batch, kv_caches),
        "fused path, DecodeFastPath call": lambda: fused(
            model.embed(inputs), model.rope.tables(batch.positions), kv_caches, batch
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, fn in runs.items():
                times[name].append(per_call_us(fn, args.calls))
    layers = len(model.layers)
    context = int(batch.decode_context_lens[0])
    print(f"{args.quantization}, {args.threads} threads, {layers} layers, context {context}")
    for name, values in times.items():
        us = statistics.median(values)
        print(f"  {name:32s} {us / 1e3:7.2f} ms   {us / layers:6.1f} us a layer")
    python = statistics.median(times["Python path, stage forward"])
    fused_us = statistics.median(times["fused path, stage forward"])
    print(f"  Python / fused: {python / fused_us:.2f}x")
    llm.shutdown()


if __name__ == "__main__":
    main()
