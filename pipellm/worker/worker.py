"""One pipeline stage: its layers' weights, their KV cache, and the step function."""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

from pipellm.config import EngineConfig
from pipellm.kernels.cpu_kernels import cpu_kernels_available
from pipellm.loader.weights import iter_quantized_weights, iter_weights
from pipellm.model.gguf_linear import GgufEmbedding
from pipellm.model.llama import LlamaStage
from pipellm.model.logits_rules import OutputTokenCounts, RowRules
from pipellm.model.sampler import sample
from pipellm.model.tp_plan import plan_tensor_parallel
from pipellm.parallel.comm import TensorParallelComm
from pipellm.protocol import ModelOutput, ScheduledRequest, SchedulerOutput
from pipellm.sampling_params import SamplingParams
from pipellm.text.tokenizer import Tokenizer, load_tokenizer
from pipellm.worker.input_builder import InputBuilder
from pipellm.worker.kv_cache_allocation import zeroed_kv_caches
from pipellm.worker.prompt_logprobs import prompt_logprobs
from pipellm.worker.stage_memory import (
    LoadedStage,
    check_host_fits,
    host_limit,
    loaded_weight_bytes,
    plan_stage_memory,
    resident_bytes,
)
from pipellm.worker.structured_output import GrammarMasks

logger = logging.getLogger(__name__)

# glibc mallopt parameters, and the values that keep freed activations in the heap.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> None:
    """Stops glibc from returning freed activation memory to the OS after every step.

    By default each step's large activations are mmapped or trimmed off the heap top when
    freed, so the next step page-faults them in again: measured ~600k faults per 16x(256+64)
    workload, and prefill ~12% slower. The process keeps at most its peak working set instead.
    """
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc (e.g. musl): leave its allocator alone
            return
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def release_freed_memory() -> None:
    """Returns the heap's free memory to the OS once: loading frees more than a step ever
    needs (the quantized weights' raw bytes after packing, dequantized copies), and with
    keep_freed_memory's thresholds glibc would keep all of it (156 MB for half of SmolLM2)."""
    if sys.platform == "linux":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


class StageWorker:
    """One stage, or with tensor parallelism one rank of it: `comm` joins the stage's ranks,
    each of which holds and loads only its share of the weights and KV heads."""

    def __init__(
        self,
        config: EngineConfig,
        stage_index: int,
        tp_rank: int = 0,
        comm: TensorParallelComm | None = None,
        check_host: str | None = None,
    ) -> None:
        """check_host: the host's name, to check before loading that the stage fits in the
        memory this process's host allows (executors that check a whole host pass None)."""
        keep_freed_memory()
        cpu_kernels_available()  # build or load them now, not in the first step
        name = f"pipeline stage {stage_index}"
        if config.tensor_parallel_size > 1:
            name += f" (tensor-parallel rank {tp_rank})"
        planned = plan_stage_memory(config, stage_index, tp_rank)  # its runtime: measured now
        if check_host is not None:  # before loading: a clear error, not the OOM killer
            check_host_fits(check_host, {name: planned}, host_limit())
        self.config = config
        self.stage = stage = config.stage(stage_index)
        self.is_first, self.is_last = stage.is_first, stage.is_last
        self.samples = self.is_last and tp_rank == 0  # one rank of the last stage samples
        mc = config.model_config
        tp = plan_tensor_parallel(mc, config.tensor_parallel_size, tp_rank)
        shard_of = tp.weight_shard
        self.model = LlamaStage(mc, stage, config.torch_dtype, tp, comm)
        # GGUF weights the kernel takes as stored are never dequantized: the load's peak
        # memory is then the quantized model, not the float32 one.
        checkpoint, quantized = {}, {}
        if config.quantization.startswith("gguf") and cpu_kernels_available():
            checkpoint = dict(iter_quantized_weights(config.source, mc, stage, shard_of))
            quantized = self.model.quantized_linears(checkpoint)
        # The token embedding is looked up on its stored rows where the kernels take its type.
        embedding = checkpoint.pop("model.embed_tokens.weight", None)
        del checkpoint  # the stage keeps its weights in its modules, not this dict
        if config.load_format == "dummy":
            self.model.init_dummy_weights(config.seed)
        else:
            skip = {shard for module in quantized for shard, _ in self.model.weight_shards(module)}
            if embedding is not None:
                skip.add("model.embed_tokens.weight")
            elif self.is_first:
                skip.discard("model.embed_tokens.weight")  # the lookup needs its float32 rows
            self.model.load_weights(
                iter_weights(config.source, mc, stage, config.torch_dtype, skip, shard_of),
                skipped=skip,
            )
            if embedding is not None and self.model.embed_tokens is not None:
                meta_weight = self.model.embed_tokens.weight
                self.model.embed_tokens = GgufEmbedding(embedding, meta_weight)
        self.model.prepare_for_inference(
            prepack=True,
            quantized=quantized,
            int8_activations=config.quantization == "gguf_int8",
        )
        self.model.eval()
        if isinstance(self.model.embed_tokens, GgufEmbedding) and mc.tie_word_embeddings:
            self.model.embed_tokens.share_head(self.model.lm_head)  # one copy of the table
        # Each layer's cache has its KV-cache group's blocks (model/cache_groups.py).
        groups = config.kv_cache_groups
        shapes = [
            (groups[layer.cache_group].num_blocks, config.block_size, tp.num_kv_heads, mc.head_dim)
            for layer in self.model.layers
        ]
        self.kv_caches = zeroed_kv_caches(shapes, config.cache_dtype)
        release_freed_memory()
        self.memory = LoadedStage(name, planned, loaded_weight_bytes(self.model), resident_bytes())
        logger.info("%s", self.memory.describe())
        self.input_builder = InputBuilder(config.block_size, len(groups))
        self.token_counts = OutputTokenCounts(mc.vocab_size) if self.is_last else None
        self.grammar_masks = GrammarMasks(self._tokenizer, mc.vocab_size, mc.eos_token_ids)
        self.generator = torch.Generator().manual_seed(config.seed)

    @torch.inference_mode()
    def execute(
        self, scheduler_output: SchedulerOutput, hidden_in: torch.Tensor | None = None
    ) -> torch.Tensor | ModelOutput | None:
        """Runs this stage's layers; the last stage samples and returns a ModelOutput (with
        tensor parallelism, its rank 0; the other ranks return None)."""
        self.input_builder.update_states(scheduler_output)
        if self.token_counts is not None:
            self.token_counts.update(scheduler_output)
        if self.samples:
            self.grammar_masks.update(scheduler_output)
        input_ids, batch = self.input_builder.prepare(scheduler_output)
        hidden = self.model(input_ids if self.is_first else hidden_in, batch, self.kv_caches)
        if not self.is_last:
            return hidden
        prompt = prompt_logprobs(
            scheduler_output, batch, hidden, self.input_builder.requests, self.model.compute_logits
        )
        sampled = [i for i, item in enumerate(scheduler_output.requests) if item.sample]
        tokens, logprobs, failed = [], None, {}
        items = [scheduler_output.requests[i] for i in sampled]
        params = [self.input_builder.requests[item.request_id].sampling_params for item in items]
        if sampled and self.model.comm is not None and all(map(_plain_greedy, params)):
            # Every rank decides alike (from the requests' parameters): all take this path.
            tokens = self.model.greedy_tokens(hidden[batch.logits_indices])
        elif sampled:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # all TP ranks
            if not self.samples:
                return None
            positions = [item.num_output_tokens for item in items]
            rules = [self._row_rules(item, p) for item, p in zip(items, params, strict=True)]
            banned = self.grammar_masks.apply(logits, items, params, self._token_ids)
            tokens, logprobs, failed = sample(logits, params, positions, self.generator, rules)
            failed.update(banned)
            if all(lp is None for lp in logprobs):
                logprobs = None
        if not self.samples:
            return None
        return ModelOutput(
            scheduler_output.micro_batch_id, tokens, logprobs, prompt_logprobs=prompt, failed=failed
        )

    def _token_ids(self, request_id: str) -> list[int]:
        return self.input_builder.requests[request_id].token_ids

    def _tokenizer(self) -> Tokenizer:
        """The engine's tokenizer (the grammar masks map text to its tokens)."""
        return load_tokenizer(self.config.tokenizer_source)

    def _row_rules(self, item: ScheduledRequest, params: SamplingParams) -> RowRules | None:
        if not params.has_logits_rules:
            return None
        token_ids = self.input_builder.requests[item.request_id].token_ids
        counts = self.token_counts.requests.get(item.request_id)
        return RowRules(params, item.num_output_tokens, token_ids, counts)


def _plain_greedy(params: SamplingParams) -> bool:
    """The token is the logits' argmax, and nothing else is read from them."""
    return (
        params.greedy
        and params.logprobs is None
        and not params.has_logits_rules
        and params.structured_outputs is None
    )
