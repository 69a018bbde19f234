"""Command-line flags for every engine setting, by vLLM's names, mapped onto EngineConfig."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipellm.config import EngineConfig

logger = logging.getLogger(__name__)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", help="tokenizer source if not the model's own")
    g.add_argument(
        "--dtype", default="auto", help="auto (float32, the CPU kernels' type), float32, bfloat16"
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "gguf", "dummy"],
        help="dummy: seeded random weights of the model's shape",
    )
    g.add_argument(
        "--quantization",
        "-q",
        choices=["gguf", "gguf_int8", "none"],
        help="gguf: compute on a GGUF model's quantized weights as stored (same results, "
        "faster decode); gguf_int8: that with activations rounded to int8 for integer dot "
        "products, as llama.cpp computes (opt-in: faster decode, not bit-identical); none: "
        "dequantize them to --dtype (default: gguf for GGUF models)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of sampling and dummy weights")
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, help="most tokens in one micro-batch")
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts over steps and mix them with decodes",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=None,
        help="most tokens of one prompt per step, which bounds the step a new request waits "
        "behind (default 256 at one stage with chunked prefill, else 0: no cap; "
        "while a short prompt waits, long prompts take at most the budget / "
        "(--max-num-partial-prefills + 1) anyway)",
    )
    g.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="while a short prompt waits, at most this many long prompts get a chunk per "
        "micro-batch (default %(default)s)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prompt prefixes",
    )
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument(
        "--kv-cache-memory",
        type=int,
        help="bytes of KV cache of the whole pipeline on CPU (default 1 GiB): each stage "
        "holds its layers' share, logged at start with its weights (docs/multinode.md)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="fraction of GPU memory to use (GPU only; accepted and ignored on CPU)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype), float32, float16 (half the cache memory and of the bytes "
        "a decode step reads; keys and values rounded once as written, llama.cpp's default "
        "cache type) or bfloat16 (bfloat16 models only)",
    )
    g.add_argument(
        "-pp",
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages: the model's layers split into this many processes",
    )
    g.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks per stage: heads, MLP columns and vocabulary split over "
        "this many processes, two all-reduces a layer (shared memory on one host); "
        "see docs/tensor_parallel.md",
    )
    g.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray", "sim"],
        help="how stages run: mp (one process per stage, the default), ray (one actor each), "
        "or sim (modelled stages: real scheduling, no model; see docs/simulation.md)",
    )
    g.add_argument(
        "--no-pp-balance",
        dest="pp_balance",
        action="store_false",
        help="send requests to stages unbalanced, the whole batch in one micro-batch, as vLLM did "
        "before the fix of its issue #27462 (for measuring)",
    )
    g.add_argument(
        "--pp-microbatch-tokens",
        type=int,
        help="balanced pipelines: most tokens in one micro-batch (default 128; sim backend: the "
        "fewest tokens whose modelled step its fixed cost no longer dominates); smaller "
        "micro-batches leave shorter bubbles while the pipeline fills and drains",
    )
    g.add_argument(
        "--enable-chunked-pipeline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let a prompt's next chunk enter the pipeline while its earlier chunks are still "
        "in flight, so one long prompt keeps every stage busy (chunked pipeline parallelism)",
    )
    g.add_argument(
        "--pp-async-batch-depth",
        type=int,
        help="micro-batches kept in flight beyond one a stage, waiting at the first stage so "
        "that a late stage or a slow round trip leaves no stage idle (as SGLang's flag of this "
        "name); default: 1 with --distributed-executor-backend ray and -pp > 1, else 0",
    )
    g.add_argument(
        "--pp-blocking-loop",
        action="store_true",
        help="wait for each micro-batch's result before scheduling the next, as vLLM's engine "
        "loop did before its PR #28768: one micro-batch in flight, stages take turns (for "
        "measuring; off by default)",
    )
    g.add_argument(
        "--pp-chunk-sizing",
        choices=["fixed", "cost"],
        default="fixed",
        help="prompt chunk sizes: fixed (the token budget) or cost (a fitted model of chunk "
        "time from prefix length and size: later chunks of a long prompt shrink so that all "
        "cost the same; docs/pipeline.md)",
    )
    g.add_argument(
        "--num-threads", type=int, help="torch threads per process (default: cores / (TP x PP))"
    )
    g.add_argument(
        "--max-cudagraph-capture-size",
        type=int,
        help="largest batch captured in a CUDA graph (GPU only; unused on CPU)",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for compatibility; pipellm never runs code from a model folder",
    )
    g.add_argument("--trace-file", help="write a Chrome/Perfetto trace of stage activity here")
    g.add_argument(
        "--sim-speedup",
        type=float,
        default=1.0,
        help="sim backend: run the modelled stages this many times faster than real time",
    )
    g.add_argument(
        "--sim-profile",
        metavar="FILE.json",
        help="sim backend: step times from this profile (a hardware roofline or coefficients "
        "measured by `pipellm profile`; docs/simulation.md); default: this CPU's roofline",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Builds and validates the config; reports flags that do nothing on this device."""
    from pipellm.config import EngineConfig  # NOTE: here: `bench serve` needs no torch

    names = EngineConfig.field_names()
    config = EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
    if args.trust_remote_code:
        logger.warning("--trust-remote-code accepted; pipellm never runs code from a model folder")
    return config
