"""A decode step's GEMMs on float32 packed weights against the same weights kept as GGUF blocks.

SmolLM2-135M's shapes: 30 layers of q/k/v (960 x 576), o (576 x 576), gate/up (3072 x 576)
and down (576 x 1536) in Q4_1, and the 49152 x 576 lm_head in Q8_0, as in the built-in GGUF.
Random weights are quantized with `gguf`, then packed both ways (`packed_linear` on the
dequantized float32 weights, `quantized_linear` on the blocks); every layer has its own copy, so
a step streams its weights from memory as a real one does. The two run alternately, and the
report gives medians over `--repeats` steps for each row count.

    .venv/bin/python -m pipellm.bench.gguf_gemm        # 1 2 3 4 6 8 16 rows, 2 threads
    .venv/bin/python -m pipellm.bench.gguf_gemm --rows 1 16 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from pipellm.kernels.cpu_kernels import cpu_kernels_available
from pipellm.model.gguf_linear import QuantizedLinear, QuantizedWeight

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
LM_HEAD = (49152, 576)


def quantized_pair(kind: GGMLQuantizationType, shape: tuple[int, int], seed: int):
    """(QuantizedLinear, float32 packed weight) of one random weight matrix."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(*shape, generator=generator) * 0.05).numpy()
    blocks = np.ascontiguousarray(quants.quantize(weight, kind))
    dequantized = torch.from_numpy(quants.dequantize(blocks, kind).reshape(shape).copy())
    raw = torch.from_numpy(blocks).view(torch.uint8).reshape(shape[0], -1)
    linear = QuantizedLinear(QuantizedWeight(kind, raw), None)
    return linear, torch.ops.pipellm.pack_linear_weight(dequantized)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("pipellm's CPU kernels are not available here; nothing to compare")
    torch.set_num_threads(args.threads)

    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    shapes = [(GGMLQuantizationType.Q4_1, s) for _ in range(args.layers) for s in LAYER_SHAPES]
    shapes.append((GGMLQuantizationType.Q8_0, LM_HEAD))
    pairs = [quantized_pair(kind, shape, seed) for seed, (kind, shape) in enumerate(shapes)]
    quantized_bytes = sum(linear.packed_weight.numel() for linear, _ in pairs)
    float_bytes = sum(packed.numel() * 4 for _, packed in pairs)
    print(
        f"weights streamed per step: float32 {float_bytes / 1e6:.0f} MB, "
        f"GGUF blocks as packed {quantized_bytes / 1e6:.0f} MB"
    )

    def float32_step(x: dict[int, torch.Tensor]) -> None:
        for (_, (out, inp)), (_, packed) in zip(shapes, pairs, strict=True):
            torch.ops.pipellm.packed_linear(x[inp], packed, None, out)

    def gguf_step(x: dict[int, torch.Tensor]) -> None:
        for linear, _ in pairs:
            linear(x[linear.in_features])

    steps = {"float32": float32_step, "gguf": gguf_step}
    times = {(name, m): [] for name in steps for m in args.rows}
    inputs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in args.rows}
    for rep in range(args.repeats):
        for m in args.rows:
            order = list(steps) if rep % 2 == 0 else list(reversed(steps))
            for name in order:
                started = time.perf_counter()
                steps[name](inputs[m])
                times[(name, m)].append(time.perf_counter() - started)

    print(f"\n{args.threads} threads, {args.layers} layers + lm_head, medians of {args.repeats}")
    print(f"{'rows':>4} {'float32 ms':>11} {'gguf ms':>8} {'float32/gguf':>13}")
    for m in args.rows:
        ours = statistics.median(times[("gguf", m)])
        theirs = statistics.median(times[("float32", m)])
        print(f"{m:>4} {theirs * 1e3:>11.1f} {ours * 1e3:>8.1f} {theirs / ours:>12.2f}x")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
