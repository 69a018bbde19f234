"""Where a one-sequence decode step spends its time, by linear layer and GGUF type.

Loads a GGUF file (default the built-in SmolLM2 Q4_1) with the settings `pipellm serve FILE`
uses (or `--quantization gguf_int8`), decodes one sequence greedily under torch's profiler and
prints, for the kernel calls of one-row decode steps, each (kernel, type, out x in) group's
calls per step, microseconds a call and milliseconds a step, then what the step spends outside
the linear layers ("everything else": attention, norms, the engine, sampling). The type comes
from the repacked record's size (quantized_linear.cpp, int8_linear.cpp); a kernel on the
stored blocks (gguf_linear.cpp) shows its depth only. Per-call times include the profiler's
own cost (a few microseconds a call): read it for the split, and benchmarks/vs_llamacpp.py for
speed.

    .venv/bin/python benchmarks/decode_profile.py --threads 1
    .venv/bin/python benchmarks/decode_profile.py --model Q4_K_M.gguf --quantization gguf_int8
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from pipellm import LLM, SamplingParams

# Record bytes per 16 columns -> type, per repacked kernel (their headers' layouts).
EXACT_RECORDS = {320: "Q4_1", 544: "Q8_0", 352: "Q5_0", 3360: "Q6_K", 2368: "Q4_K"}
INT8_RECORDS = {320: "Q4_1", 544: "Q8_0", 352: "Q5_0"}
LINEAR_OPS = ("quantized_linear", "quantized_linear_int8", "gguf_linear", "gguf_linear_int8")


def describe(name: str, shapes: list) -> tuple[str, str, str] | None:
    """(kernel, type, out x in) of a one-row linear call, else None."""
    kernel = name.split("::")[-1]
    if kernel not in LINEAR_OPS or not shapes or shapes[0][:1] != [1]:
        return None
    depth = shapes[0][1]
    if kernel.startswith("quantized_linear"):
        panels, _, record = shapes[1]
        records = INT8_RECORDS if kernel.endswith("int8") else EXACT_RECORDS
        return kernel, records.get(record, f"{record} B"), f"{16 * panels} x {depth}"
    return kernel, "stored blocks", f"? x {depth}"  # the profiler keeps no list's shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: built-in)")
    parser.add_argument("--quantization", default=None, choices=["gguf", "gguf_int8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens profiled")
    args = parser.parse_args()

    llm = LLM(args.model, enable_prefix_caching=False, quantization=args.quantization)
    torch.set_num_threads(args.threads)  # after LLM(), which sets its own count
    prompt = np.random.default_rng(0).integers(100, 40000, args.prompt_len).tolist()

    def generate(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - started

    generate(4)  # warm-up
    first = generate(1)  # prefill and the first token, without the profiler
    whole = generate(args.tokens + 1)
    step_ms = (whole - first) / args.tokens * 1e3
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        profiled_ms = (generate(args.tokens + 1) - first) / args.tokens * 1e3
    llm.shutdown()

    groups: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    for event in prof.events():
        key = describe(event.name, event.input_shapes)
        if key is not None:
            groups[key].append(event.cpu_time_total)
    steps = args.tokens
    print(f"model {args.model or 'built-in'}, quantization {args.quantization or 'default'},")
    print(
        f"{args.threads} threads; decode step {step_ms:.2f} ms, {profiled_ms:.2f} ms profiled "
        f"(shares are of the profiled step; {steps} steps)"
    )
    print(f"{'kernel':24s} {'type':13s} {'out x in':>13s} {'calls':>6s} {'us/call':>8s} "
          f"{'ms/step':>8s} {'share':>6s}")  # fmt: skip
    linears_ms = 0.0
    for (kernel, kind, shape), times in sorted(groups.items(), key=lambda g: -sum(g[1])):
        per_step = sum(times) / steps / 1e3
        linears_ms += per_step
        print(
            f"{kernel:24s} {kind:13s} {shape:>13s} {len(times) / steps:6.1f} "
            f"{np.median(times):8.1f} {per_step:8.2f} {per_step / profiled_ms:6.1%}"
        )
    rest = profiled_ms - linears_ms
    for label, ms in (("all linear layers", linears_ms), ("everything else", rest)):
        print(f"{label:67s} {ms:8.2f} {ms / profiled_ms:6.1%}")


if __name__ == "__main__":
    main()
