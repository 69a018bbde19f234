"""The exact GGUF kernels on one matrix per type: repacked at load (quantized_linear.cpp's
panels of 16 interleaved rows) against the file's own row-major blocks (gguf_linear.cpp), and
the int8-activation kernel on the same repacked panels (int8_linear.cpp, `gguf_int8`).

Random blocks in each type that has a repacked layout (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K), at
SmolLM2-135M's gate/up (3072 x 576) and down (576 x 1536) shapes, K-quants only where the
depth is whole 256-value blocks. Both kernels give the same bits (tests/test_gguf_types.py);
they take turns with the int8 one (not the same bits), and the report gives each one's median
over `--repeats` calls and the ratios: stored / repacked, and repacked (exact) / int8.

    .venv/bin/python benchmarks/gguf_repacked.py                 # 1, 16 and 256 rows, 2 threads
    .venv/bin/python benchmarks/gguf_repacked.py --rows 1 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from pipellm.kernels.cpu_kernels import cpu_kernels_available, ops
from pipellm.model.gguf_linear import EXACT_KERNEL_KINDS, QuantizedLinear, QuantizedWeight

T = GGMLQuantizationType
SHAPES = [(3072, 576), (576, 1536)]  # (out, in)


def random_weight(kind: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """Random blocks: `gguf` quantizes the legacy types; K-quant blocks get random bytes with
    small float16 scales (its Python quantizer has none for them)."""
    rng = np.random.default_rng(0)
    out_features, in_features = shape
    if kind in (T.Q4_K, T.Q6_K):
        values, size = quants.GGML_QUANT_SIZES[kind]
        blocks = rng.integers(0, 256, (out_features, in_features // values, size), np.uint8)
        scale = np.full((out_features, in_features // values, 1), 0.001, np.float16)
        offset = 0 if kind == T.Q4_K else size - 2
        blocks[..., offset : offset + 2] = scale.view(np.uint8)
        if kind == T.Q4_K:
            blocks[..., 2:4] = scale.view(np.uint8)
        raw = blocks.reshape(out_features, -1)
    else:
        weight = rng.normal(0, 0.05, shape).astype(np.float32)
        raw = np.ascontiguousarray(quants.quantize(weight, kind)).view(np.uint8)
    return QuantizedWeight(kind, torch.from_numpy(raw.reshape(out_features, -1).copy()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    if not cpu_kernels_available():
        raise SystemExit("pipellm's CPU kernels are not available here")
    torch.set_num_threads(args.threads)
    kernels = ops()
    print(f"{args.threads} threads; microseconds a call (median); ratios stored / repacked")
    print("and exact / int8 (>1: int8 faster)")
    header = f"{'type':6} {'shape':>11} {'rows':>5} {'repacked':>9} {'stored':>9} {'ratio':>6}"
    print(f"{header} {'int8':>9} {'exact/int8':>10}")
    for kind in EXACT_KERNEL_KINDS:
        for shape in SHAPES:
            if shape[1] % quants.GGML_QUANT_SIZES[kind][0]:
                continue
            weight = random_weight(kind, shape)
            layer = QuantizedLinear(weight, None)
            int8 = QuantizedLinear(weight, None, int8_activations=True)
            assert layer.repacked and int8.repacked and int8.int8_activations

            def stored(x: torch.Tensor, weight: QuantizedWeight = weight) -> torch.Tensor:
                parts, types = [weight.blocks], [int(weight.kind)]
                return kernels.gguf_linear(x, parts, types, None, weight.out_features)

            for rows in args.rows:
                x = torch.randn(rows, shape[1])
                assert torch.equal(layer(x), stored(x))
                runs = {"repacked": layer, "stored": stored, "int8": int8}
                times: dict[str, list[float]] = {name: [] for name in runs}
                for _ in range(args.repeats):  # taking turns
                    for name, run in runs.items():
                        started = time.perf_counter()
                        run(x)
                        times[name].append(time.perf_counter() - started)
                a, b, c = (statistics.median(times[n]) * 1e6 for n in runs)
                size = f"{shape[0]}x{shape[1]}"
                line = f"{kind.name:6} {size:>11} {rows:>5} {a:9.0f} {b:9.0f} {b / a:6.2f}"
                print(f"{line} {c:9.0f} {a / c:10.2f}")


if __name__ == "__main__":
    main()
