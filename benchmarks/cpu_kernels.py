"""pipellm's own CPU kernels against its PyTorch path, on the built-in SmolLM2-135M.

The same offline workload runs in three configurations, each in a fresh process, taking turns
run by run; the report gives medians and ratios against the PyTorch path:
- gguf: the kernels, the GGUF's Q4_1/Q8_0 weights computed as stored (the default);
- float32: the kernels, the weights dequantized to float32 (`quantization="none"`);
- pytorch: no kernels (PIPELLM_CPU_KERNELS=0), float32 weights.

- prefill: `--num-prompts` prompts of `--input-len` tokens, one new token each;
- decode step: (full run - prefill run) / (output-len - 1), the full run asking for
  `--output-len` tokens of each prompt.

    .venv/bin/python benchmarks/cpu_kernels.py                 # 2 threads, 3 repeats
    .venv/bin/python benchmarks/cpu_kernels.py --threads 1 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name -> (PIPELLM_CPU_KERNELS, quantization)
CONFIGS = {"gguf": ("1", "gguf"), "float32": ("1", "none"), "pytorch": ("0", "none")}


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Runs in the child: times a prefill-only run, then a full run, on fresh prompts."""
    import torch

    from pipellm import LLM, SamplingParams

    llm = LLM(
        None,
        max_num_seqs=args.num_prompts,
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    torch.set_num_threads(args.threads)  # after LLM(), which sets its own count
    generator = torch.Generator().manual_seed(args.seed)

    def prompts() -> list[list[int]]:
        return torch.randint(100, 40000, (args.num_prompts, args.input_len), generator=generator)

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        batch = prompts().tolist()
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    run(2)  # warm-up
    prefill = run(1)
    full = run(args.output_len)
    llm.shutdown()
    return {"prefill_s": prefill, "decode_step_ms": (full - prefill) / (args.output_len - 1) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="gguf", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return

    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for rep in range(args.repeats):
        # Rotate which configuration goes first, so none always runs on a warmer machine.
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            kernels, quantization = CONFIGS[name]
            env = {**os.environ, "PIPELLM_CPU_KERNELS": kernels}
            child = [sys.executable, __file__, "--child"]
            child += ["--quantization", quantization]
            child += sys.argv[1:]
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = results[name][-1]
            print(
                f"  rep {rep} {name:8s} prefill {r['prefill_s']:6.2f} s, "
                f"decode step {r['decode_step_ms']:6.1f} ms"
            )

    print(
        f"\n{args.threads} threads, {args.num_prompts} x {args.input_len} prompt tokens, "
        f"{args.output_len} new tokens each, medians of {args.repeats}"
    )
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    for key, label in (("prefill_s", "prefill (s)"), ("decode_step_ms", "decode step (ms)")):
        base = medians["pytorch"][key]
        cells = "   ".join(
            f"{name} {medians[name][key]:7.2f} ({base / medians[name][key]:4.2f}x)"
            for name in names
        )
        print(f"{label:>18}: {cells}   (x: pytorch / this)")
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
