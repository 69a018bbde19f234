"""pipellm against llama.cpp on the same GGUF file, same threads, taking turns.

llama.cpp runs through llama-cpp-python (an optional, bench-only install: `pip install
llama-cpp-python==0.3.36`, which builds llama.cpp from source for this CPU; pipellm's `bench`
extra names it). Both engines load the built-in SmolLM2-135M GGUF (Q4_1 projections, Q8_0
embedding) and decode greedily; every measurement is a fresh process, and the engines take
turns (A B C A B C ..., the order rotated each round). Workloads, prompts of random token ids:

- one sequence: time to first token of a 256-token prompt (prefill + one token), and decode
  tokens/s over the next `--decode-tokens` tokens;
- a batch: 16 prompts of 256 tokens, 64 new tokens each (16 x (256 + 64)), whole run.
  llama.cpp gets the batch the way its `batched` example and server run one: each prompt
  prefilled in its own sequence (up to n_batch = 2048 tokens a llama_decode), then one
  llama_decode per step carrying every sequence's next token.

Configurations: `pipellm` (its kernels, GGUF weights as stored: the defaults), `pytorch`
(pipellm with PIPELLM_CPU_KERNELS=0: its PyTorch path, float32 weights; one sequence only, the
prefill reference) and `llamacpp`.

    cpulock bench .venv/bin/python -m pipellm.bench.vs_llamacpp               # 2 threads, 3 rounds
    .venv/bin/python -m pipellm.bench.vs_llamacpp --threads 1 --rounds 1 --workloads single
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

PROMPT_LEN, BATCH, BATCH_NEW_TOKENS = 256, 16, 64
CONFIGS = ("pipellm", "pytorch", "llamacpp")


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, 40000, size=(count, PROMPT_LEN)).tolist()


# ---- pipellm ---------------------------------------------------------------------------------


def pipellm_child(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from pipellm import LLM, SamplingParams

    llm = LLM(None, max_num_seqs=BATCH, enable_prefix_caching=False)
    torch.set_num_threads(args.threads)  # after LLM(), which sets its own count

    def run(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - started

    seeds = iter(range(args.seed * 1000, args.seed * 1000 + 1000))  # fresh prompts each run
    result = {}
    if args.workload == "single":
        run(prompts(1, next(seeds)), 2)  # warm-up
        ttft = statistics.median(run(prompts(1, next(seeds)), 1) for _ in range(3))
        full = run(prompts(1, next(seeds)), args.decode_tokens + 1)
        result = {"ttft_s": ttft, "decode_tok_s": args.decode_tokens / (full - ttft)}
    else:
        run(prompts(2, next(seeds)), 2)
        result = {"batch_s": run(prompts(BATCH, next(seeds)), BATCH_NEW_TOKENS)}
    llm.shutdown()
    return result


# ---- llama.cpp -------------------------------------------------------------------------------


class LlamaCpp:
    """A llama.cpp context on the low-level API, holding up to BATCH sequences."""

    def __init__(self, path: str, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = BATCH * (PROMPT_LEN + BATCH_NEW_TOKENS)
        params.n_batch, params.n_ubatch = 2048, 512
        params.n_seq_max = BATCH
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(2048, 0, 1)

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits). Returns the greedy next token of
        each item that wants logits."""
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = logits
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        picks = []
        for i, item in enumerate(items):
            if item[3]:
                row = self.lib.llama_get_logits_ith(self.ctx, i)
                picks.append(int(np.ctypeslib.as_array(row, shape=(self.vocab,)).argmax()))
        return picks

    def prefill(self, prompt: list[int], seq: int) -> int:
        return self.decode([(t, p, seq, p == len(prompt) - 1) for p, t in enumerate(prompt)])[0]


def llamacpp_child(args: argparse.Namespace) -> dict[str, float]:
    from pipellm.loader.source import resolve_model

    engine = LlamaCpp(str(resolve_model(None).path), args.threads)
    seeds = iter(range(args.seed * 1000, args.seed * 1000 + 1000))
    if args.workload == "single":

        def first_token(prompt: list[int]) -> tuple[float, int]:
            engine.clear()
            started = time.perf_counter()
            token = engine.prefill(prompt, 0)
            return time.perf_counter() - started, token

        first_token(prompts(1, next(seeds))[0])  # warm-up
        ttft = statistics.median(first_token(prompts(1, next(seeds))[0])[0] for _ in range(3))
        _, token = first_token(prompts(1, next(seeds))[0])
        started = time.perf_counter()
        for pos in range(PROMPT_LEN, PROMPT_LEN + args.decode_tokens):
            token = engine.decode([(token, pos, 0, True)])[0]
        return {
            "ttft_s": ttft,
            "decode_tok_s": args.decode_tokens / (time.perf_counter() - started),
        }

    def batch_run(batch: list[list[int]], new_tokens: int) -> float:
        engine.clear()
        started = time.perf_counter()
        tokens = [engine.prefill(prompt, seq) for seq, prompt in enumerate(batch)]
        for step in range(1, new_tokens):
            pos = PROMPT_LEN + step - 1
            tokens = engine.decode([(t, pos, seq, True) for seq, t in enumerate(tokens)])
        return time.perf_counter() - started

    batch_run(prompts(2, next(seeds)), 2)
    return {"batch_s": batch_run(prompts(BATCH, next(seeds)), BATCH_NEW_TOKENS)}


# ---- the parent: turns, medians, ratios -------------------------------------------------------


def run_child(config: str, workload: str, rnd: int, argv: list[str]) -> dict[str, float]:
    env = {**os.environ, "PIPELLM_CPU_KERNELS": "0" if config == "pytorch" else "1"}
    command = [sys.executable, __file__, "--child", config, "--workload", workload]
    command += [*argv, "--seed", str(rnd)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--workloads", nargs="+", default=["single", "batch"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = llamacpp_child if args.child == "llamacpp" else pipellm_child
        print(json.dumps(child(args)))
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36 "
            "(bench-only; it builds llama.cpp from source, a few minutes)"
        ) from None

    argv = ["--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for workload in args.workloads:
        configs = list(CONFIGS) if workload == "single" else ["pipellm", "llamacpp"]
        for rnd in range(args.rounds):
            for config in configs[rnd % len(configs) :] + configs[: rnd % len(configs)]:
                r = run_child(config, workload, rnd + args.seed, argv)
                results.setdefault((workload, config), []).append(r)
                print(f"  {workload} round {rnd} {config:8s} " + json.dumps(r), flush=True)

    def median(workload: str, config: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(workload, config)])

    print(f"\n{args.threads} threads, medians of {args.rounds} rounds")
    if "single" in args.workloads:
        tok_s = {c: median("single", c, "decode_tok_s") for c in CONFIGS}
        ttft = {c: median("single", c, "ttft_s") for c in CONFIGS}
        print(
            "one sequence, decode tok/s: "
            + "  ".join(f"{c} {tok_s[c]:.1f}" for c in CONFIGS)
            + f"   pipellm/llama.cpp {tok_s['pipellm'] / tok_s['llamacpp']:.2f}x"
        )
        print(
            f"one {PROMPT_LEN}-token prompt, time to first token (s): "
            + "  ".join(f"{c} {ttft[c]:.3f}" for c in CONFIGS)
            + f"   llama.cpp/pipellm {ttft['llamacpp'] / ttft['pipellm']:.2f}x,"
            f" pytorch/pipellm {ttft['pytorch'] / ttft['pipellm']:.2f}x"
        )
    if "batch" in args.workloads:
        ours, theirs = median("batch", "pipellm", "batch_s"), median("batch", "llamacpp", "batch_s")
        print(
            f"{BATCH} x ({PROMPT_LEN} + {BATCH_NEW_TOKENS}), whole run (s): pipellm {ours:.2f}  "
            f"llamacpp {theirs:.2f}   llama.cpp/pipellm {theirs / ours:.2f}x"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
