"""What a pipeline stage keeps of a GGUF file's weights, against the file's share for that stage.

pipellm computes every type its kernels take on the stored blocks (Q4_1/Q8_0 repacked at the
same size), so a stage should hold about its share of the file and no float32 copy of a
quantized matrix. For each stage of a `--stages`-way split this loads the stage as the engine
does (EngineConfig + StageWorker, with `pipellm serve`'s default quantization) and prints:
the bytes of the file's tensors the stage uses, the bytes of the distinct tensors the stage's
model holds, and how much the process's anonymous resident memory (its own copies; the mapped
file's pages are the page cache's) grew with the load, less the KV caches.

    .venv/bin/python benchmarks/gguf_memory.py --model smollm2-Q4_K_M.gguf --stages 2
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensor storages the model's modules hold (weights, packed or
    stored blocks, norms), meta tensors aside."""
    from pipellm.model.gguf_linear import GgufEmbedding, QuantizedLinear

    tensors: list[torch.Tensor] = [p for p in model.parameters() if not p.is_meta]
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors += [module.packed_weight] if module.repacked else module.part_blocks
        elif isinstance(module, GgufEmbedding) and module.table is not None:
            tensors.append(module.table.blocks)
        tensors += [t for t in vars(module).values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def anonymous_resident() -> int:
    """The process's resident anonymous memory (RssAnon): its own copies, not the pages of the
    memory-mapped file, which the page cache holds and any process may drop."""
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def file_share(path: str, config, stage) -> int:
    """Bytes of the file's tensors that `stage` reads (a tied embedding counted once)."""
    from pipellm.loader.weights import gguf_tensor_index, stage_weight_names

    tensors = gguf_tensor_index(Path(path), config)
    names = set(stage_weight_names(config, stage, tensors))
    return sum(tensors[name].n_bytes for name in names if name in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--stages", type=int, default=1, help="pipeline stages to split into")
    args = parser.parse_args()
    from pipellm.config import EngineConfig
    from pipellm.kernels.cpu_kernels import cpu_kernels_available
    from pipellm.worker.worker import StageWorker

    cpu_kernels_available()  # the kernels' library is loaded before the first measurement
    config = EngineConfig(model=args.model, pipeline_parallel_size=args.stages)
    print(f"{args.model}: quantization={config.quantization}, {args.stages} stage(s)")
    for index in range(args.stages):
        before = anonymous_resident()
        worker = StageWorker(config, index)
        # Freed load-time copies (unpermuted q/k rows, stacked parts) stay in malloc's heap,
        # which the engine keeps on purpose (worker.keep_freed_memory): give them back first.
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        # The KV caches are allocated (zeroed) with the stage: not weights.
        caches = sum(cache.nbytes for pair in worker.kv_caches for cache in pair)
        after = anonymous_resident() - caches
        share = file_share(args.model, config.model_config, worker.stage)
        held = held_bytes(worker.model)
        print(
            f"  stage {index}: file share {share / 2**20:8.1f} MiB, held {held / 2**20:8.1f} "
            f"MiB ({held / share:.3f}x), anonymous resident +{(after - before) / 2**20:.1f} MiB "
            f"({(after - before) / share:.3f}x)"
        )
        del worker


if __name__ == "__main__":
    main()
