"""`bench serve`'s workload as the requests the server would hand the engine."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

from pipellm.bench.datasets import length_range
from pipellm.bench.serve import sample_requests
from pipellm.sampling_params import SamplingParams
from pipellm.sim.simulate.client import EngineRequest

# (prompt ids, max_tokens, ignore_eos) -> the SamplingParams the server makes of a streamed,
# greedy completions request with them (the entrypoint knows the request schema).
ServedParams = Callable[[list[int], int, bool], SamplingParams]


def workload(
    args: argparse.Namespace, tokenizer: Any, served_params: ServedParams
) -> list[EngineRequest]:
    """The requests of `bench serve`'s workload as the server would hand them to the engine.

    The random dataset is drawn as token ids directly, by `bench serve`'s length rule (a
    shared random prefix, then lengths uniform in [floor(L(1-r)), ceil(L(1+r))]): only the
    number of tokens matters to modelled stages, and fitting random text to exact token
    counts would take longer than the simulation. ShareGPT prompts are tokenized as served.
    """
    count = args.num_prompts + args.num_warmups
    ignore_eos = args.ignore_eos or args.dataset_name == "random"
    if args.dataset_name == "random":
        rng = np.random.default_rng(args.seed)
        vocab = tokenizer.vocab_size
        input_low, input_high = length_range(args.random_input_len, args.random_range_ratio)
        output_low, output_high = length_range(args.random_output_len, args.random_range_ratio)
        prefix = rng.integers(0, vocab, args.random_prefix_len).tolist()
        prompts = []
        for _ in range(count):
            body_len = int(rng.integers(input_low, input_high + 1))
            num_output = int(rng.integers(output_low, output_high + 1))
            prompts.append((prefix + rng.integers(0, vocab, body_len).tolist(), num_output))
    else:
        samples = sample_requests(args, tokenizer, count)
        prompts = [(tokenizer.encode(s.prompt), s.output_len) for s in samples]
    return [
        (str(i), prompt_ids, served_params(prompt_ids, num_output, ignore_eos), len(prompt_ids))
        for i, (prompt_ids, num_output) in enumerate(prompts)
    ]
