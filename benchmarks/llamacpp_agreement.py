"""How often pipellm's greedy tokens agree with llama.cpp's on the same GGUF file, for the exact
path (`quantization="gguf"`, bit-identical to float32) and int8 activations (`gguf_int8`, which
rounds activations to 8 bits per 32 values as llama.cpp's own dot products do).

llama.cpp (llama-cpp-python, in `--llamacpp-python`, as benchmarks/vs_llamacpp.py runs it)
writes a greedy continuation of each prompt (the prompts' token ids are pipellm's tokenizer's,
given to both engines). Then each pipellm setting reads every prompt + continuation in one pass
(prompt logprobs, top 1): teacher-forced agreement is the share of continuation positions where
pipellm's top token is llama.cpp's, each position seeing the same context in both. Also
reported: how many of pipellm's own free-running greedy continuations equal llama.cpp's, and
the median position of the first differing token. `--llamacpp-variants` measures llama.cpp
itself in the same way with its attention's rounding changed (flash attention off, a float32
cache), fed the reference token by token as it generated it: the size of the differences that
rounding alone makes. Not a timing: run it on any machine.

    .venv/bin/python benchmarks/llamacpp_agreement.py --model Q4_K_M.gguf \\
        --llamacpp-python LLAMA_VENV/bin/python          # 32 prompts x 64 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# With int8_agreement.py's 16: 32 prompts (imported in the parent only: the llama.cpp child's
# Python has no pipellm).
MORE_PROMPTS = [
    "The largest planet in our solar system is",
    "A good night's sleep helps because",
    "class Stack:\n    def __init__(self):",
    "The history of the printing press",
    "My favourite season of the year is",
    "In economics, inflation means",
    "Steps to change a flat tyre:",
    "The Great Wall of China was built",
    "for i in range(10):",
    "Rainbows appear when",
    "The recipe calls for two eggs,",
    "An apple a day",
    "The first person to walk on the moon",
    "Volcanoes erupt when",
    "Translate to French: Good morning",
    "The main parts of a computer are",
]
SETTINGS = ("gguf", "gguf_int8")


# llama.cpp's own settings to compare with its default (flash attention, float16 KV cache):
# how far llama.cpp moves from itself when only its attention's rounding changes, the scale
# against which pipellm's differences from it can be read.
LLAMACPP_VARIANTS = {
    "no-flash-attention": {"flash_attention": False},
    "no-flash-attention-float32-cache": {"flash_attention": False, "float16_cache": False},
}


def llamacpp_child(args: argparse.Namespace) -> None:
    """Reads {"prompts", "reference"} (token ids; reference: continuations or null) on stdin;
    writes {"continuations": greedy continuations of the prompts, "tops": with a reference,
    the top token at each of its positions given the prompt and the reference before it}."""
    from vs_llamacpp import LlamaCpp

    engine = LlamaCpp(args.model, args.threads, **LLAMACPP_VARIANTS.get(args.variant, {}))
    job = json.loads(sys.stdin.read())

    def run(prompt: list[int], forced: list[int] | None) -> list[int]:
        engine.clear()
        token = engine.prefill(prompt, 0)
        tokens = [token]
        for pos in range(len(prompt), len(prompt) + args.tokens - 1):
            fed = forced[pos - len(prompt)] if forced else token
            token = engine.decode([(fed, pos, 0, True)])[0]
            tokens.append(token)
        return tokens

    continuations = [run(prompt, None) for prompt in job["prompts"]]
    tops = None
    if job["reference"] is not None:
        tops = [run(p, r) for p, r in zip(job["prompts"], job["reference"], strict=True)]
    print(json.dumps({"continuations": continuations, "tops": tops}))


def llamacpp_run(
    args: argparse.Namespace,
    prompts: list[list[int]],
    variant: str = "default",
    reference: list[list[int]] | None = None,
) -> dict:
    env = dict(os.environ)
    if args.llamacpp_path:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [args.llamacpp_path, env.get("PYTHONPATH")])
        )
    command = [args.llamacpp_python, __file__, "--child", "--model", args.model]
    command += ["--tokens", str(args.tokens), "--threads", str(args.threads)]
    command += ["--variant", variant]
    job = json.dumps({"prompts": prompts, "reference": reference})
    out = subprocess.run(command, input=job, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the llama.cpp child failed: {' '.join(command)}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def reference_continuations(args: argparse.Namespace, prompts: list[list[int]]) -> list[list[int]]:
    """llama.cpp's continuations: from --reference if given (checked against the prompts and
    tokens), else by running llama.cpp (and saved to --save-reference if given)."""
    if args.reference:
        with open(args.reference) as f:
            saved = json.load(f)
        if saved["prompts"] != prompts or saved["tokens"] != args.tokens:
            raise SystemExit(f"{args.reference} holds other prompts or token counts than this run")
        return saved["continuations"]
    continuations = llamacpp_run(args, prompts)["continuations"]
    if args.save_reference:
        with open(args.save_reference, "w") as f:
            saved = {"prompts": prompts, "tokens": args.tokens, "continuations": continuations}
            json.dump(saved, f)
    return continuations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the GGUF file both engines load")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llamacpp-python",
        default=os.environ.get("PIPELLM_LLAMACPP_PYTHON", sys.executable),
        help="the Python that has llama-cpp-python (default: $PIPELLM_LLAMACPP_PYTHON, else this)",
    )
    parser.add_argument(
        "--llamacpp-path",
        default=os.environ.get("PIPELLM_LLAMACPP_PATH"),
        help="a directory put on that Python's PYTHONPATH (default: $PIPELLM_LLAMACPP_PATH)",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=SETTINGS,
        default=list(SETTINGS),
        help="the pipellm quantization settings to compare (default: both)",
    )
    parser.add_argument(
        "--kv-cache-dtypes",
        nargs="+",
        default=["auto"],
        help="the KV-cache dtypes to run each setting with (auto: the engine's default)",
    )
    parser.add_argument(
        "--save-reference",
        help="write llama.cpp's continuations (JSON) here, to reuse with --reference",
    )
    parser.add_argument(
        "--reference",
        help="llama.cpp's continuations written by --save-reference for the same file, "
        "prompts and tokens, instead of running llama.cpp again",
    )
    parser.add_argument(
        "--llamacpp-variants",
        nargs="*",
        choices=list(LLAMACPP_VARIANTS),
        default=[],
        help="llama.cpp settings to compare with llama.cpp's default in the same way",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="default", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        llamacpp_child(args)
        return

    from int8_agreement import PROMPTS as FIRST_PROMPTS

    from pipellm import LLM, SamplingParams

    texts_in = (FIRST_PROMPTS + MORE_PROMPTS)[: args.prompts]

    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    read = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    prompts: list[list[int]] | None = None
    reference: list[list[int]] = []
    runs = [(setting, kv) for setting in args.settings for kv in args.kv_cache_dtypes]
    hits_by_run: dict[tuple[str, str], list[bool]] = {}
    for setting, kv_cache_dtype in runs:
        engine_args = {"quantization": setting, "kv_cache_dtype": kv_cache_dtype}
        with LLM(args.model, enable_prefix_caching=False, **engine_args) as llm:
            if prompts is None:
                prompts = [llm.tokenizer.encode(text) for text in texts_in]
                reference = reference_continuations(args, prompts)
            texts = [p + c for p, c in zip(prompts, reference, strict=True)]
            outputs = llm.generate(texts, read, use_tqdm=False)
            own = llm.generate(prompts, greedy, use_tqdm=False)
        tops = [
            [entry[1][0][0] for entry in out.prompt_logprobs[len(prompt) :]]
            for prompt, out in zip(prompts, outputs, strict=True)
        ]
        own_tokens = [run.outputs[0].token_ids for run in own]
        name = f"{setting:10s} kv {kv_cache_dtype:8s}"
        hits_by_run[(setting, kv_cache_dtype)] = report(name, tops, own_tokens, reference)
    for variant in args.llamacpp_variants:
        out = llamacpp_run(args, prompts, variant, reference)
        name = f"llama.cpp {variant}"
        hits_by_run[("llama.cpp", variant)] = report(
            name, out["tops"], out["continuations"], reference
        )
    print_discordant(hits_by_run)


def report(
    name: str, tops: list[list[int]], own: list[list[int]], reference: list[list[int]]
) -> list[bool]:
    """Prints one run's agreement with llama.cpp's default and returns its per-position hits.
    tops: the run's top token at each reference position given the reference before it;
    own: its free-running greedy continuations."""
    hits = [  # per continuation position: the run's top-1 is llama.cpp's
        a == b
        for top, ref in zip(tops, reference, strict=True)
        for a, b in zip(top, ref, strict=True)
    ]
    firsts = []
    for continuation, run in zip(reference, own, strict=True):
        differ = [n for n, (a, b) in enumerate(zip(continuation, run, strict=True)) if a != b]
        firsts.append(differ[0] if differ else len(continuation))
    identical = sum(first == len(c) for first, c in zip(firsts, reference, strict=True))
    same, positions = sum(hits), len(hits)
    print(
        f"{name} teacher-forced top-1 = llama.cpp's: {same}/{positions} = "
        f"{same / positions:.2%}; free-running: {identical}/{len(own)} continuations "
        f"identical, first differing token at median {statistics.median(firsts):.0f}"
    )
    return hits


def print_discordant(hits_by_run: dict[tuple[str, str], list[bool]]) -> None:
    """For each pair of runs, the positions where exactly one of them agrees with llama.cpp:
    how far apart their agreement counts are, against how many positions decide it. McNemar's
    test on those positions: |b - c| / sqrt(b + c) under about 2 is within chance."""
    runs = list(hits_by_run)
    for i, first in enumerate(runs):
        for second in runs[i + 1 :]:
            pairs = list(zip(hits_by_run[first], hits_by_run[second], strict=True))
            only_first = sum(a and not b for a, b in pairs)
            only_second = sum(b and not a for a, b in pairs)
            decided = only_first + only_second
            z = (only_first - only_second) / decided**0.5 if decided else 0.0
            print(
                f"{' '.join(first)} vs {' '.join(second)}: agrees alone at {only_first} "
                f"positions against {only_second} (McNemar z = {z:+.2f})"
            )


if __name__ == "__main__":
    main()
