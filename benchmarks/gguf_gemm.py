"""A decode step's GEMMs on float32 packed weights against the same weights kept as GGUF blocks.

SmolLM2-135M's shapes: 30 layers of q/k/v (960 x 576), o (576 x 576), gate/up (3072 x 576)
and down (576 x 1536) in Q4_1, and the 49152 x 576 lm_head in Q8_0, as in the built-in GGUF.
Random weights are quantized with `gguf`, then packed both ways (`packed_linear` on the
dequantized float32 weights, `quantized_linear` on the blocks); every layer has its own copy, so
a step streams its weights from memory as a real one does. Both run at every kernel level the
CPU supports (AVX2, AVX-512: pipellm/kernels/cpu_kernels.py), all taking turns, and the report
gives medians over `--repeats` steps for each row count, and each against float32 at the
lowest level. The GEMMs' weight bytes over the median time give the achieved read bandwidth,
printed against the machine's read bandwidth at the same threads (`torch.sum` over 512 MB of
float32, median of 5: a pure read stream).

    .venv/bin/python benchmarks/gguf_gemm.py             # 1 2 3 4 6 8 16 rows, 2 threads
    .venv/bin/python benchmarks/gguf_gemm.py --rows 1 16 --threads 1 --levels avx512 --no-int8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from pipellm.kernels.cpu_kernels import (
    cpu_kernels_available,
    int8_activations_unavailable,
    ops,
    supported_levels,
)
from pipellm.model.gguf_linear import QuantizedLinear, QuantizedWeight, pack_int8_weight

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer
LM_HEAD = (49152, 576)


def quantized_pair(kind: GGMLQuantizationType, shape: tuple[int, int], seed: int):
    """(QuantizedLinear, float32 packed weight, int8 kernel's packed weight or None) of one
    random weight matrix."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(*shape, generator=generator) * 0.05).numpy()
    blocks = np.ascontiguousarray(quants.quantize(weight, kind))
    dequantized = torch.from_numpy(quants.dequantize(blocks, kind).reshape(shape).copy())
    raw = torch.from_numpy(blocks).view(torch.uint8).reshape(shape[0], -1)
    weight = QuantizedWeight(kind, raw)
    int8 = pack_int8_weight(weight) if int8_activations_unavailable() is None else None
    return QuantizedLinear(weight, None), ops().pack_linear_weight(dequantized), int8


def read_bandwidth() -> float:
    """GB/s of a plain read stream at the current thread count."""
    data = torch.ones(128 * 1024 * 1024)  # 512 MB: far beyond any cache
    times = []
    for _ in range(5):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    return data.numel() * 4 / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--levels", nargs="+", default=None, help="default: all the CPU runs")
    parser.add_argument(
        "--no-int8", action="store_true", help="leave out the int8-activation GEMM (gguf_int8)"
    )
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("pipellm's CPU kernels are not available here; nothing to compare")
    torch.set_num_threads(args.threads)

    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    shapes = [(GGMLQuantizationType.Q4_1, s) for _ in range(args.layers) for s in LAYER_SHAPES]
    shapes.append((GGMLQuantizationType.Q8_0, LM_HEAD))
    pairs = [quantized_pair(kind, shape, seed) for seed, (kind, shape) in enumerate(shapes)]
    quantized_bytes = sum(linear.packed_weight.numel() for linear, _, _ in pairs)
    float_bytes = sum(packed.numel() * 4 for _, packed, _ in pairs)
    int8_bytes = sum(int8.numel() for _, _, int8 in pairs if int8 is not None)
    print(
        f"weights streamed per step: float32 {float_bytes / 1e6:.0f} MB, "
        f"GGUF blocks as packed {quantized_bytes / 1e6:.0f} MB, "
        f"as the int8 kernel packs them {int8_bytes / 1e6:.0f} MB"
    )

    levels = args.levels or supported_levels()

    def float32_step(level: str, x: dict[int, torch.Tensor]) -> None:
        op = ops(level).packed_linear
        for (_, (out, inp)), (_, packed, _) in zip(shapes, pairs, strict=True):
            op(x[inp], packed, None, out)

    def gguf_step(level: str, x: dict[int, torch.Tensor]) -> None:
        op = ops(level).quantized_linear
        for linear, _, _ in pairs:
            op(
                x[linear.in_features],
                linear.packed_weight,
                linear.kernel_kind,
                None,
                linear.out_features,
            )

    def int8_step(level: str, x: dict[int, torch.Tensor]) -> None:
        op = ops(level).quantized_linear_int8
        for linear, _, packed in pairs:
            op(x[linear.in_features], packed, linear.kernel_kind, None, linear.out_features)

    kinds = [("float32", float32_step), ("gguf", gguf_step)]
    if int8_activations_unavailable() is None and not args.no_int8:
        kinds.append(("gguf_int8", int8_step))
    steps = {f"{kind} {level}": (step, level) for kind, step in kinds for level in levels}
    times = {(name, m): [] for name in steps for m in args.rows}
    inputs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in args.rows}
    for rep in range(args.repeats):
        for m in args.rows:
            order = list(steps) if rep % 2 == 0 else list(reversed(steps))
            for name in order:
                step, level = steps[name]
                started = time.perf_counter()
                step(level, inputs[m])
                times[(name, m)].append(time.perf_counter() - started)

    bandwidth = read_bandwidth()
    print(f"\nread bandwidth, {args.threads} threads: {bandwidth:.1f} GB/s (torch.sum, 512 MB)")
    print(f"{args.threads} threads, {args.layers} layers + lm_head, medians of {args.repeats}")
    base = next(iter(steps))
    print(f"{'rows':>4} " + " ".join(f"{name:>22}" for name in steps) + f"   (x: {base} / this)")
    for m in args.rows:
        medians = {name: statistics.median(times[(name, m)]) for name in steps}
        cells = []
        for name, t in medians.items():
            stream = (float_bytes if name.startswith("float32") else quantized_bytes) / t / 1e9
            if name.startswith("gguf_int8"):
                stream = int8_bytes / t / 1e9
            cells.append(f"{t * 1e3:6.1f}ms {medians[base] / t:4.2f}x {stream / bandwidth:4.0%}bw")
        print(f"{m:>4} " + " ".join(f"{cell:>22}" for cell in cells))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
