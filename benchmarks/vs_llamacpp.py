"""pipellm against llama.cpp on the same GGUF file, same threads, taking turns.

llama.cpp runs through llama-cpp-python (an optional, bench-only install, never a test
dependency; pipellm's `bench` extra names it), in a Python of its own if need be
(`--llamacpp-python`, with LLAMA_CPP_LIB_PATH naming a llama.cpp build where the package has
none): its child process needs only llama_cpp and numpy. Both engines load the same GGUF file
(`--model`, default the built-in SmolLM2-135M Q4_1 file; any type mix pipellm's kernels take,
e.g. a llama.cpp Q4_K_M) and decode greedily; pipellm with the settings `pipellm serve FILE`
uses by default. Every measurement is a fresh process, and the engines take turns
(A B C A B C ..., the order rotated each round). Workloads, prompts of random token ids:

- one sequence: one chat, a 32-token prompt and 128 new tokens, whole time; time to first
  token of a 256-token prompt (prefill + one token), and decode tokens/s over the next
  `--decode-tokens` tokens;
- a batch: 16 prompts of 256 tokens, 64 new tokens each (16 x (256 + 64)), whole run.
  llama.cpp gets the batch the way its `batched` example and server run one: each prompt
  prefilled in its own sequence (up to n_batch = 2048 tokens a llama_decode), then one
  llama_decode per step carrying every sequence's next token.

Configurations: `pipellm` (`pipellm serve FILE`'s defaults), `exact` (GGUF weights as stored,
bit-identical to float32, float32 KV cache), `int8` (the opt-in `quantization="gguf_int8"`:
activations rounded to int8 for integer dot products, as llama.cpp computes), `int8-f16kv`
(`int8` with `kv_cache_dtype="float16"`, llama.cpp's cache type), `pytorch` (pipellm with
PIPELLM_CPU_KERNELS=0: its PyTorch path, float32 weights; one sequence only, the prefill
reference), `int8-unfused` (`int8` with PIPELLM_DECODE_FAST_PATH=0: the decode step's layers
on the Python path, to show what the fused decode path gives) and `llamacpp`. `--configs` runs
a subset (llamacpp is always in: the ratios are against it). Ratios are llama.cpp's time over
each pipellm configuration's.

    .venv/bin/python benchmarks/vs_llamacpp.py         # 2 threads, 3 rounds
    .venv/bin/python benchmarks/vs_llamacpp.py --model Q4_K_M.gguf --rounds 1 --workloads single
    .venv/bin/python benchmarks/vs_llamacpp.py --workloads single --configs int8 int8-unfused
    .venv/bin/python benchmarks/vs_llamacpp.py --llamacpp-python /opt/llamacpp-venv/bin/python
    LLAMA_CPP_LIB_PATH=LLAMA_BUILD/bin .venv/bin/python benchmarks/vs_llamacpp.py \
        --llamacpp-python LLAMA_VENV/bin/python --llamacpp-path llama_cpp_python-0.3.36

Building llama-cpp-python: on a CPU with AMX (Sapphire Rapids and later Xeons) a build with
llama.cpp's default GGML_NATIVE=ON also compiles its AMX matmul, which crashes (SIGSEGV in
ggml_backend_amx_mul_mat) in a VM that lists the amx flags; build it for the CPU's vector
levels with AMX off, e.g. in a venv of its own:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
      -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
      -DGGML_OPENMP=ON" pip install llama-cpp-python==0.3.36
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
CHAT_PROMPT_LEN, CHAT_NEW_TOKENS = 32, 128
# name -> (engine, extra environment, pipellm's settings); the llama.cpp child runs in
# --llamacpp-python.
_KERNELS = {"PIPELLM_CPU_KERNELS": "1", "PIPELLM_DECODE_FAST_PATH": "1"}
CONFIGS: dict[str, tuple[str, dict[str, str], dict[str, str]]] = {
    "pipellm": ("pipellm", _KERNELS, {}),
    "exact": ("pipellm", _KERNELS, {"quantization": "gguf", "kv_cache_dtype": "float32"}),
    "int8": ("pipellm", _KERNELS, {"quantization": "gguf_int8", "kv_cache_dtype": "float32"}),
    "int8-f16kv": (
        "pipellm",
        _KERNELS,
        {"quantization": "gguf_int8", "kv_cache_dtype": "float16"},
    ),
    # int8 without the fused decode path (model/decode_fast_path.py): what it gives.
    "int8-unfused": (
        "pipellm",
        {**_KERNELS, "PIPELLM_DECODE_FAST_PATH": "0"},
        {"quantization": "gguf_int8", "kv_cache_dtype": "float32"},
    ),
    "pytorch": ("pipellm", {"PIPELLM_CPU_KERNELS": "0"}, {"quantization": "none"}),
    "llamacpp": ("llamacpp", {}, {}),
}


def prompts(count: int, seed: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, 40000, size=(count, length)).tolist()


# ---- pipellm ---------------------------------------------------------------------------------


def pipellm_child(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from pipellm import LLM, SamplingParams

    llm = LLM(args.model, enable_prefix_caching=False, **CONFIGS[args.child][2])
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
        result = {"ttft_s": ttft, "decode_step_ms": (full - ttft) / args.decode_tokens * 1e3}
        result["chat_s"] = run(prompts(1, next(seeds), CHAT_PROMPT_LEN), CHAT_NEW_TOKENS)
    else:
        run(prompts(2, next(seeds)), 2)
        result = {"batch_s": run(prompts(BATCH, next(seeds)), BATCH_NEW_TOKENS)}
    llm.shutdown()
    return result


# ---- llama.cpp -------------------------------------------------------------------------------


class LlamaCpp:
    """A llama.cpp context on the low-level API, holding up to BATCH sequences."""

    def __init__(
        self, path: str, threads: int, flash_attention: bool = True, float16_cache: bool = True
    ) -> None:
        """flash_attention and float16_cache: llama.cpp's defaults on a CPU (flash attention
        "auto" resolves to on); False turns either off, as `llama-cli -fa off -ctk f32 -ctv
        f32` would."""
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = BATCH * (PROMPT_LEN + BATCH_NEW_TOKENS)
        params.n_batch, params.n_ubatch = 2048, 512
        params.n_seq_max = BATCH
        params.n_threads = params.n_threads_batch = threads
        if not flash_attention:
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        if not float16_cache:
            params.type_k = params.type_v = llama_cpp.GGML_TYPE_F32
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(2048, 0, 1)

    def system_info(self) -> str:
        return self.lib.llama_print_system_info().decode()

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


def llamacpp_child(args: argparse.Namespace) -> dict[str, float | str]:
    engine = LlamaCpp(args.model, args.threads)
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
        elapsed = time.perf_counter() - started
        engine.clear()
        started = time.perf_counter()
        token = engine.prefill(prompts(1, next(seeds), CHAT_PROMPT_LEN)[0], 0)
        for pos in range(CHAT_PROMPT_LEN, CHAT_PROMPT_LEN + CHAT_NEW_TOKENS - 1):
            token = engine.decode([(token, pos, 0, True)])[0]
        chat = time.perf_counter() - started
        return {
            "ttft_s": ttft,
            "decode_step_ms": elapsed / args.decode_tokens * 1e3,
            "chat_s": chat,
            "system_info": engine.system_info(),
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


def run_child(
    config: str,
    workload: str,
    rnd: int,
    argv: list[str],
    llamacpp_python: str,
    llamacpp_path: str | None,
) -> dict[str, float | str]:
    engine, env, _ = CONFIGS[config]
    python = llamacpp_python if engine == "llamacpp" else sys.executable
    if engine == "llamacpp" and llamacpp_path:
        env = {
            **env,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [llamacpp_path, os.environ.get("PYTHONPATH")])
            ),
        }
    command = [python, __file__, "--child", config, "--workload", workload]
    command += [*argv, "--seed", str(rnd)]
    out = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(
            f"the {config} child failed (exit {out.returncode}): {' '.join(command)}\n"
            + out.stderr[-3000:]
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_llamacpp(python: str, path: str | None) -> None:
    """Fails before any measurement if `python` cannot import llama_cpp."""
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    probe = subprocess.run(
        [python, "-c", "import llama_cpp, numpy"],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if probe.returncode != 0:
        raise SystemExit(
            f"--llamacpp-python {python}: cannot import llama_cpp and numpy there "
            f"({probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no output'}). "
            "Install llama-cpp-python==0.3.36 into that Python (bench-only; it builds "
            "llama.cpp from source, see this script's docstring for the CMake flags)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument(
        "--workloads", nargs="+", choices=("single", "batch"), default=["single", "batch"]
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=[c for c in CONFIGS if c != "llamacpp"],
        default=[c for c in CONFIGS if c != "llamacpp"],
        help="pipellm's configurations to run (default: all); llama.cpp always runs",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("PIPELLM_LLAMACPP_PYTHON", sys.executable),
        help="the Python that has llama-cpp-python (default: $PIPELLM_LLAMACPP_PYTHON, else this "
        "one)",
    )
    parser.add_argument(
        "--llamacpp-path",
        default=os.environ.get("PIPELLM_LLAMACPP_PATH"),
        help="a folder holding the llama_cpp package's sources (e.g. an unpacked "
        "llama-cpp-python sdist), put on the llama.cpp child's PYTHONPATH when the bench extra "
        "is not installed; LLAMA_CPP_LIB_PATH then names the folder with its libllama.so "
        "(default: $PIPELLM_LLAMACPP_PATH)",
    )
    parser.add_argument(
        "--model", default=None, help="the GGUF file both engines load (default: the built-in)"
    )
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child = llamacpp_child if CONFIGS[args.child][0] == "llamacpp" else pipellm_child
        print(json.dumps(child(args)))
        return
    check_llamacpp(args.llamacpp_python, args.llamacpp_path)
    from pipellm.kernels.cpu_kernels import int8_activations_unavailable
    from pipellm.loader.source import resolve_model

    model = str(resolve_model(args.model).path)
    argv = ["--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    argv += ["--model", model]
    print(f"model: {model}")
    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    results: dict[tuple[str, str], list[dict]] = {}
    shown_info = False
    int8 = int8_activations_unavailable() is None

    def configs_for(workload: str) -> list[str]:
        """pytorch is the prefill reference: one sequence only; int8 where the CPU runs it."""
        chosen = [*args.configs, "llamacpp"]
        names = [c for c in CONFIGS if c in chosen and (int8 or not c.startswith("int8"))]
        return names if workload == "single" else [c for c in names if c != "pytorch"]

    for workload in args.workloads:
        configs = configs_for(workload)
        for rnd in range(args.rounds):
            for config in configs[rnd % len(configs) :] + configs[: rnd % len(configs)]:
                r = run_child(
                    config,
                    workload,
                    rnd + args.seed,
                    argv,
                    args.llamacpp_python,
                    args.llamacpp_path,
                )
                info = r.pop("system_info", None)
                if info and not shown_info:
                    print(f"llama.cpp system info: {info}")
                    shown_info = True
                results.setdefault((workload, config), []).append(r)
                print(f"  {workload} round {rnd} {config:12s} " + json.dumps(r), flush=True)

    def median(workload: str, config: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(workload, config)])

    print(f"\n{args.threads} threads, medians of {args.rounds} rounds")

    def table(workload: str, key: str, unit: str, label: str) -> None:
        names = [c for c in configs_for(workload) if (workload, c) in results]
        values = {c: median(workload, c, key) for c in names}
        print(label)
        for c in names:
            ratio = values["llamacpp"] / values[c]
            extra = f"  ({1e3 / values[c]:.0f} tok/s)" if key == "decode_step_ms" else ""
            print(f"    {c:12s} {values[c]:8.3f} {unit}{extra}   llama.cpp / this {ratio:.2f}x")

    if "single" in args.workloads:
        table(
            "single",
            "chat_s",
            "s",
            f"(a) one chat, {CHAT_PROMPT_LEN}-token prompt -> {CHAT_NEW_TOKENS} new tokens",
        )
        table(
            "single",
            "decode_step_ms",
            "ms",
            f"(a') one sequence, decode step after a {PROMPT_LEN}-token prompt "
            f"({args.decode_tokens} tokens)",
        )
        table("single", "ttft_s", "s", f"(c) one {PROMPT_LEN}-token prompt, time to first token")
        if ("single", "pytorch") in results and ("single", "pipellm") in results:
            ours, base = (
                median("single", "pipellm", "ttft_s"),
                median("single", "pytorch", "ttft_s"),
            )
            print(f"    pytorch / pipellm (kernels) {base / ours:.2f}x")
    if "batch" in args.workloads:
        table(
            "batch", "batch_s", "s", f"(b) {BATCH} x ({PROMPT_LEN} + {BATCH_NEW_TOKENS}), whole run"
        )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
