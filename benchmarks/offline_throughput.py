"""Offline throughput: pipellm against transformers `generate` on the same weights and threads.

Both engines get the same prompts (random token ids), greedy decoding, ignore_eos, fp32. Two
workloads: equal lengths (every prompt `--input-len` tokens, `--output-len` new tokens) and
mixed lengths (each drawn uniformly in [floor(L(1-r)), ceil(L(1+r))] with r = --range-ratio).
transformers gets a left-padded batch and must run every row to the longest output; throughput
counts only the tokens asked for, so both engines are credited the same work.

The engines take turns run by run (A B C, B C A, ...) and the report gives medians, so a burst of
load on this shared machine hurts both sides alike. Each repetition draws fresh prompts of the
same lengths, so pipellm's prefix cache never turns a repeat into a cache hit.

    .venv/bin/python benchmarks/offline_throughput.py       # 1 and 2 threads, 3 repeats
    .venv/bin/python benchmarks/offline_throughput.py --threads 2 --repeats 1 --num-prompts 4
    .venv/bin/python benchmarks/offline_throughput.py --threads 2 --quantization gguf none

The built-in model is a GGUF file: by default pipellm computes on its Q4_1/Q8_0 weights as
stored (bit-identical results, see pipellm/model/gguf_linear.py); `--quantization none` runs
the float32 weights transformers gets, and several settings run side by side.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

from pipellm import LLM, SamplingParams
from pipellm.loader.weights import iter_weights
from pipellm.model.model_config import ModelConfig
from pipellm.model.stage_spec import StageSpec


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def uniform_lengths(
    mean: int, range_ratio: float, count: int, generator: torch.Generator
) -> list[int]:
    low, high = math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
    return torch.randint(max(1, low), high + 1, (count,), generator=generator).tolist()


def make_workload(
    args: argparse.Namespace, vocab_size: int, mixed: bool, repetition: int
) -> Workload:
    """The lengths depend on the seed only; the token ids change with each repetition."""
    generator = torch.Generator().manual_seed(args.seed)
    ratio = args.range_ratio if mixed else 0.0
    input_lens = uniform_lengths(args.input_len, ratio, args.num_prompts, generator)
    output_lens = uniform_lengths(args.output_len, ratio, args.num_prompts, generator)
    generator.manual_seed(args.seed * 1_000_003 + repetition + 1)
    # Ids from 100 up skip the special tokens at the start of the vocabulary.
    prompts = [
        torch.randint(100, vocab_size, (n,), generator=generator).tolist() for n in input_lens
    ]
    return Workload(prompts, output_lens)


def load_transformers_model(llm: LLM) -> transformers.PreTrainedModel:
    """transformers' own model class with pipellm's weights (dequantized the same way)."""
    config: ModelConfig = llm.config.model_config
    config_class = getattr(transformers, config.architecture.replace("ForCausalLM", "Config"))
    hf_config = config_class(**config.hf_config_kwargs())
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    stage = StageSpec.whole_model(config.num_hidden_layers)
    weights = dict(iter_weights(llm.config.source, config, stage, torch.float32))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if config.tie_word_embeddings:
        missing = [name for name in missing if name != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit transformers' model: {missing} {unexpected}")
    return model.eval()


def run_pipellm(llm: LLM, workload: Workload) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    outputs = llm.generate(workload.prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_transformers(
    model: transformers.PreTrainedModel, workload: Workload, cache: str
) -> list[list[int]]:
    longest = max(map(len, workload.prompts))
    pad = 0
    input_ids = torch.full((len(workload.prompts), longest), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(workload.prompts):  # left padding, as batched generate wants
        input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, longest - len(prompt) :] = 1
    new_tokens = max(workload.output_lens)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
            cache_implementation=cache,
        )
    return [out[row, longest : longest + n].tolist() for row, n in enumerate(workload.output_lens)]


def timed(
    run: Callable[[Workload], list[list[int]]], workload: Workload
) -> tuple[float, list[list[int]]]:
    started = time.perf_counter()
    tokens = run(workload)
    return time.perf_counter() - started, tokens


def pick_transformers_cache(model: transformers.PreTrainedModel, workload: Workload) -> str:
    """The static cache when this transformers version runs it, else the dynamic one."""
    try:
        run_transformers(model, workload, "static")
        return "static"
    except Exception as error:  # noqa: BLE001 - any failure means: use the other cache
        print(f"transformers static cache unavailable ({error}); using the dynamic cache")
        return "dynamic"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--range-ratio", type=float, default=0.5)
    parser.add_argument(
        "--workloads", nargs="+", choices=("equal", "mixed"), default=["equal", "mixed"]
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        choices=("auto", "gguf", "none"),
        default=["auto"],
        help="pipellm's quantization setting(s); several run side by side, e.g. gguf none",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores: above ~0.5 means noise)")
    llms = {}
    for setting in args.quantization:
        llm = LLM(args.model, quantization=None if setting == "auto" else setting)
        llms[f"pipellm ({llm.config.quantization})"] = llm
    llm = next(iter(llms.values()))
    vocab = llm.config.model_config.vocab_size
    model = load_transformers_model(llm)
    warmup = make_workload(argparse.Namespace(**{**vars(args), "num_prompts": 2}), vocab, True, -1)
    cache = pick_transformers_cache(model, warmup)
    engines: dict[str, Callable[[Workload], list[list[int]]]] = {
        name: functools.partial(run_pipellm, each) for name, each in llms.items()
    }
    engines["transformers"] = lambda w: run_transformers(model, w, cache)

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for run in engines.values():
            run(warmup)
        for name in args.workloads:
            times: dict[str, list[float]] = {engine: [] for engine in engines}
            matches: dict[str, list[float]] = {engine: [] for engine in llms}
            for rep in range(args.repeats):
                workload = make_workload(args, vocab, name == "mixed", rep)
                # Rotate which engine goes first, so none always runs on a warmer machine.
                order = list(engines)[rep % len(engines) :] + list(engines)[: rep % len(engines)]
                tokens = {}
                for engine in order:
                    seconds, tokens[engine] = timed(engines[engine], workload)
                    times[engine].append(seconds)
                    print(f"  {threads}t {name} rep {rep} {engine:18s} {seconds:7.2f} s")
                for engine in llms:
                    same = sum(
                        a == b for a, b in zip(tokens[engine], tokens["transformers"], strict=True)
                    )
                    matches[engine].append(same / len(workload.prompts))
            out_tokens = workload.num_output_tokens
            medians = {engine: statistics.median(t) for engine, t in times.items()}
            rows.append((threads, name, out_tokens, medians, matches))

    print(f"\ntransformers {transformers.__version__} ({cache} cache), torch {torch.__version__}")
    print(
        f"{args.num_prompts} prompts, input {args.input_len}, output {args.output_len}, "
        f"mixed range ratio {args.range_ratio}, medians of {args.repeats}"
    )
    print(
        f"{'threads':>7} {'workload':>8} {'engine':>18} {'tok/s':>7} {'transformers tok/s':>19} "
        f"{'ratio':>6} {'same tokens':>12}"
    )
    for threads, name, out_tokens, medians, matches in rows:
        theirs = out_tokens / medians["transformers"]
        for engine in llms:
            ours = out_tokens / medians[engine]
            print(
                f"{threads:>7} {name:>8} {engine:>18} {ours:>7.1f} {theirs:>19.1f} "
                f"{ours / theirs:>5.2f}x {statistics.mean(matches[engine]):>11.0%}"
            )
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    for each in llms.values():
        each.shutdown()


if __name__ == "__main__":
    main()
