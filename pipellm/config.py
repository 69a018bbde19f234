"""All engine settings in one object, validated before anything is built.

Names follow vLLM's engine arguments, so `LLM(model, max_num_seqs=8, ...)` and
`pipellm serve --max-num-seqs 8` mean what a vLLM user expects.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, field, fields

import torch

from pipellm.loader.source import ModelSource, load_model_config, resolve_model
from pipellm.loader.weights import check_gguf_tensor_parallel
from pipellm.model.cache_groups import CacheGroup, min_budget_blocks, sequence_blocks, split_cache
from pipellm.model.model_config import ModelConfig
from pipellm.model.rope import SUPPORTED as ROPE_TYPES
from pipellm.model.rope import rope_type
from pipellm.model.stage_spec import StageSpec, stage_specs
from pipellm.model.tp_plan import TensorParallelError, plan_tensor_parallel
from pipellm.text.gguf_tokenizer import UnsupportedTokenizerError, check_gguf_tokenizer

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("gguf", "gguf_int8", "none")
BACKENDS = ("uni", "mp", "ray", "sim")
DEFAULT_KV_CACHE_MEMORY = 1 << 30  # 1 GiB of KV cache on CPU unless told otherwise
# The default cap on one prompt's chunk per step. A request arriving while a long prompt
# prefills waits for the step under way and then shares one with it, so a step's length is its
# time to first token; on CPU a 2048-token step takes seconds, 256 tokens a fraction of one
# (docs/benchmarks.md, "Fair admission"). vLLM takes 4% of max_model_len when it splits prompts
# (327 for an 8192-token context), sized for GPUs, whose steps are far shorter.
# NOTE: --long-prefill-token-threshold's help states it as text (the CLI imports no torch);
# tests/test_fair_admission.py checks the two agree.
DEFAULT_LONG_PREFILL_TOKENS = 256


class ConfigError(ValueError):
    """A setting is invalid; the message names it, its value and the fix."""


def _fail(name: str, value: object, fix: str) -> None:
    raise ConfigError(f"invalid setting {name}={value!r}: {fix}")


@dataclass
class EngineConfig:
    model: str | None = None  # local HF dir, .gguf file or built-in preset; None = built-in
    tokenizer: str | None = None
    dtype: str = "auto"  # auto = float32, what the CPU kernels compute in
    load_format: str = "auto"
    # gguf: linear layers compute on a GGUF file's quantized weights as stored (exactly the
    # same results, a 5x smaller weight stream); none: dequantize every weight to `dtype`.
    # gguf_int8 (opt-in, changes numerics): gguf, with activations rounded to int8 per 32
    # values for integer dot products, as llama.cpp does (faster decode; top-1 agreement
    # with float32 in docs/performance.md; AVX-512 VNNI or AVX2 dot products, the same sums).
    # None (auto): gguf for a GGUF model run in float32, else none.
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    # Fair admission (pipellm/engine/scheduler.py): while a short prompt waits, at most
    # max_num_partial_prefills long prompts get a chunk, each at most the micro-batch's budget /
    # (max_num_partial_prefills + 1); long_prefill_token_threshold caps every chunk (0: off;
    # None, auto: DEFAULT_LONG_PREFILL_TOKENS at one stage with chunked prefill, else off).
    long_prefill_token_threshold: int | None = None
    max_num_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes of KV cache over all stages (CPU)
    # vLLM's GPU settings, accepted so vLLM scripts and command lines run unchanged; pipellm
    # runs on CPU, where they do nothing (a warning says so; kv_cache_memory sizes the cache).
    gpu_memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pp_balance: bool = True
    # Balanced pipelines: most tokens in one micro-batch. Small micro-batches fill and drain
    # the pipeline quickly, so a stage idles for less time (docs/pipeline.md). None (auto):
    # 128, or on the sim backend the fewest tokens whose step the fixed cost (weights read,
    # overhead) no longer dominates (engine/microbatch_size.py).
    pp_microbatch_tokens: int | None = None
    # Chunked pipeline parallelism: a prompt's next chunk enters a micro-batch while its earlier
    # chunks are still in flight, so one long prompt fills every stage (docs/pipeline.md).
    enable_chunked_pipeline: bool = True
    # fixed: prompt chunks of the token budget; cost: sized by a fitted chunk-cost model so
    # that chunks deep into a long prompt shrink and all cost about the same (chunk_cost.py).
    pp_chunk_sizing: str = "fixed"
    # Micro-batches kept in flight beyond P (SGLang's --pp-async-batch-depth): a stage then
    # finds its next input waiting when the other stage or the engine's round trip runs late.
    # None (auto): 1 on the ray backend with P > 1, where stages on other hosts jitter more
    # and every result goes through Ray to the driver and back (docs/pipeline.md), else 0.
    pp_async_batch_depth: int | None = None
    # The engine waits for each micro-batch's result before scheduling the next, as vLLM's
    # engine loop did before its PR #28768: one micro-batch in flight, so the stages take
    # turns. For measuring what the non-blocking loop is worth (docs/pipeline.md); off.
    pp_blocking_loop: bool = False
    num_threads: int | None = None  # torch threads per stage; default: cores divided by stages
    max_cudagraph_capture_size: int | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None
    trace_file: str | None = None
    sim_speedup: float = 1.0  # sim backend: modelled stages run this many times faster
    sim_profile: str | None = None  # sim backend: profile JSON of step times (docs/simulation.md)
    # Resolved on construction:
    source: ModelSource = field(init=False)
    model_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        for name in (
            "pipeline_parallel_size",
            "tensor_parallel_size",
            "max_num_seqs",
            "block_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                _fail(name, value, "use a positive integer")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"use one of auto, {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            _fail("load_format", self.load_format, f"use one of {', '.join(LOAD_FORMATS)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            _fail(
                "quantization",
                self.quantization,
                "use gguf, gguf_int8, none, or leave it unset (auto)",
            )
        if self.kv_cache_dtype not in ("auto", *DTYPES):
            _fail("kv_cache_dtype", self.kv_cache_dtype, f"use auto or one of {', '.join(DTYPES)}")
        if self.torch_dtype == torch.float32 and self.cache_dtype == torch.bfloat16:
            _fail(
                "kv_cache_dtype",
                self.kv_cache_dtype,
                "a float32 model keeps its KV cache in float32 or float16 (the CPU kernels' types)",
            )
        if self.distributed_executor_backend is None:
            single = self.pipeline_parallel_size == 1 and self.tensor_parallel_size == 1
            self.distributed_executor_backend = "uni" if single else "mp"
        if self.distributed_executor_backend not in BACKENDS:
            _fail(
                "distributed_executor_backend",
                self.distributed_executor_backend,
                f"use one of {', '.join(BACKENDS)}",
            )
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            _fail("distributed_executor_backend", "ray", "install Ray: pip install 'pipellm[ray]'")
        if self.distributed_executor_backend == "uni" and self.pipeline_parallel_size > 1:
            _fail("distributed_executor_backend", "uni", "pipeline stages need mp, ray or sim")
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend not in ("mp", "ray"):
            _fail(
                "distributed_executor_backend",
                self.distributed_executor_backend,
                "tensor_parallel_size > 1 runs one process per rank: use mp or ray",
            )
        self._check_cores()
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            _fail("kv_cache_memory", self.kv_cache_memory, "use a positive number of bytes")
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                _fail("gpu_memory_utilization", self.gpu_memory_utilization, "use (0, 1]")
            # pipellm runs on the CPU only: accepted for vLLM command lines, and said so.
            logger.warning(
                "gpu_memory_utilization has no effect on CPU; kv_cache_memory (CLI: "
                "--kv-cache-memory) sizes the KV cache"
            )
        if self.max_cudagraph_capture_size is not None:
            logger.warning("max_cudagraph_capture_size has no effect on CPU; ignored")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or threshold < 0):
            _fail(
                "long_prefill_token_threshold",
                self.long_prefill_token_threshold,
                "use a positive integer, or 0 for no cap",
            )
        if not isinstance(self.max_num_partial_prefills, int) or self.max_num_partial_prefills < 1:
            _fail("max_num_partial_prefills", self.max_num_partial_prefills, "use an integer >= 1")
        if self.pp_chunk_sizing not in ("fixed", "cost"):
            _fail("pp_chunk_sizing", self.pp_chunk_sizing, "use 'fixed' or 'cost'")
        tokens = self.pp_microbatch_tokens
        if tokens is not None and (not isinstance(tokens, int) or tokens <= 0):
            _fail("pp_microbatch_tokens", self.pp_microbatch_tokens, "use a positive integer")
        self._resolve_async_batch_depth()
        if self.num_threads is not None and self.num_threads <= 0:
            _fail("num_threads", self.num_threads, "use a positive integer")

        if self.sim_speedup <= 0:
            _fail("sim_speedup", self.sim_speedup, "use a positive factor")
        if self.sim_profile is not None and self.distributed_executor_backend != "sim":
            _fail("sim_profile", self.sim_profile, "it needs distributed_executor_backend=sim")
        needs_weights = self.load_format != "dummy" and self.distributed_executor_backend != "sim"
        self.source = resolve_model(self.model, require_weights=needs_weights)
        wanted = {"safetensors": "hf", "gguf": "gguf"}.get(self.load_format)
        if wanted and wanted != self.source.kind:
            kinds = {"hf": "a Hugging Face safetensors folder", "gguf": "a .gguf file"}
            _fail(
                "load_format", self.load_format, f"{self.source.path} is {kinds[self.source.kind]}"
            )
        self._check_tokenizer()
        self.model_config = load_model_config(self.source)
        self._resolve_quantization()
        self._apply_sim_profile()
        self._check_against_model()

    def _check_tokenizer(self) -> None:
        """A GGUF tokenizer pipellm cannot rebuild fails here, before any process starts."""
        source = resolve_model(self.tokenizer) if self.tokenizer else self.source
        if source.kind == "gguf":
            try:
                check_gguf_tokenizer(source.path)
            except UnsupportedTokenizerError as error:
                raise ConfigError(str(error)) from None

    def _resolve_quantization(self) -> None:
        """Turns auto into gguf or none; gguf needs GGUF weights and float32 compute."""
        has_gguf_weights = self.source.kind == "gguf" and self.load_format != "dummy"
        if self.quantization is None:
            use = has_gguf_weights and self.torch_dtype == torch.float32
            self.quantization = "gguf" if use else "none"
        elif self.quantization.startswith("gguf") and not has_gguf_weights:
            _fail(
                "quantization",
                self.quantization,
                "it needs a .gguf model (and not load_format=dummy)",
            )
        elif self.quantization.startswith("gguf") and self.torch_dtype != torch.float32:
            _fail(
                "quantization",
                self.quantization,
                f"its kernel computes in float32, not {self.dtype}",
            )
        elif self.quantization == "gguf_int8":
            from pipellm.kernels.cpu_kernels import int8_activations_unavailable

            reason = int8_activations_unavailable()
            if reason is not None:
                _fail("quantization", "gguf_int8", f"{reason}; use gguf (exact) instead")
        if self.quantization.startswith("gguf"):
            from pipellm.loader.weights import check_gguf_kernel_types

            check_gguf_kernel_types(self.source, self.model_config)

    def _apply_sim_profile(self) -> None:
        """A profile that states the pipeline's KV capacity sets the cache size, unless
        kv_cache_memory is given."""
        if self.sim_profile is None:
            return
        from pipellm.sim.profile import ProfileError, load_profile

        try:
            profile = load_profile(self.sim_profile)
            capacity = profile.kv_capacity(
                self.model_config.hf_config_kwargs(), self.pipeline_parallel_size
            )
        except ProfileError as error:
            raise ConfigError(f"invalid setting sim_profile: {error}") from None
        if capacity is not None and self.kv_cache_memory is None:
            self.kv_cache_memory = -(-capacity // self.block_size) * self.kv_bytes_per_block

    def _check_against_model(self) -> None:
        context = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = context
        elif not 0 < self.max_model_len <= context:
            _fail("max_model_len", self.max_model_len, f"use a value in [1, {context}]")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = (
                max(2048, self.max_num_seqs) if self.enable_chunked_prefill else self.max_model_len
            )
        if self.max_num_batched_tokens <= 0:
            _fail("max_num_batched_tokens", self.max_num_batched_tokens, "use a positive integer")
        if self.long_prefill_token_threshold is None:
            # One stage only: a balanced pipeline's micro-batches are small already
            # (pp_microbatch_tokens), and --no-pp-balance stands for vLLM's scheduler before
            # its PR #28768, whose default is no cap.
            capped = self.enable_chunked_prefill and self.pipeline_parallel_size == 1
            self.long_prefill_token_threshold = DEFAULT_LONG_PREFILL_TOKENS if capped else 0
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            _fail(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"without chunked prefill it must be >= max_model_len ({self.max_model_len}); "
                "raise it, lower max_model_len, or enable chunked prefill",
            )
        self._check_kv_capacity()
        kind = rope_type(self.model_config.rope_scaling)
        if kind not in ROPE_TYPES:
            raise ConfigError(
                f"model {self.source.path}: its rope_scaling type {kind!r} is not supported; "
                f"pipellm supports {', '.join(ROPE_TYPES)}"
            )
        self._check_tensor_parallel()
        layers = self.model_config.num_hidden_layers
        if self.pipeline_parallel_size > layers:
            _fail(
                "pipeline_parallel_size",
                self.pipeline_parallel_size,
                f"the model has only {layers} layers; use at most {layers} stages",
            )
        try:
            self.stage(0)  # a bad layer partition fails here, before any stage starts
        except ValueError as error:
            raise ConfigError(str(error)) from None

    def _resolve_async_batch_depth(self) -> None:
        depth = self.pp_async_batch_depth
        if depth is None:
            ray_pipeline = self.distributed_executor_backend == "ray"
            spare = ray_pipeline and self.pipeline_parallel_size > 1 and not self.pp_blocking_loop
            self.pp_async_batch_depth = int(spare)
            return
        if depth > 0 and self.pp_blocking_loop:
            _fail(
                "pp_async_batch_depth",
                depth,
                "pp_blocking_loop keeps one micro-batch in flight, so no spare one can wait; "
                "use 0 or drop pp_blocking_loop",
            )
        if not isinstance(depth, int) or depth < 0:
            _fail("pp_async_batch_depth", depth, "use 0 or a positive integer")
        if depth > 0 and self.pipeline_parallel_size == 1:
            _fail(
                "pp_async_batch_depth",
                depth,
                "extra micro-batches in flight need pipeline_parallel_size > 1; use 0",
            )

    @property
    def max_micro_batches_in_flight(self) -> int:
        """P micro-batches, one a stage, plus the extra ones of pp_async_batch_depth; one with
        pp_blocking_loop."""
        if self.pp_blocking_loop:
            return 1
        return self.pipeline_parallel_size + self.pp_async_batch_depth

    def _check_cores(self) -> None:
        """T x P processes, each with its own threads: more of them than cores would make
        the tensor-parallel ranks wait on each other's time slices at every all-reduce."""
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        cores = os.cpu_count() or 1
        if self.tensor_parallel_size > 1 and ranks > cores and self.num_threads is None:
            _fail(
                "tensor_parallel_size",
                self.tensor_parallel_size,
                f"{self.tensor_parallel_size} x {self.pipeline_parallel_size} stages = {ranks} "
                f"processes, more than the {cores} cores; use fewer, or set num_threads "
                "(--num-threads 1) to run them anyway",
            )

    def _check_tensor_parallel(self) -> None:
        """The model must split T ways (heads, MLP, vocabulary), and a GGUF file's row-parallel
        weights on their blocks' boundaries: checked here, before any process starts."""
        size = self.tensor_parallel_size
        if size == 1:
            return
        try:
            plans = [plan_tensor_parallel(self.model_config, size, r) for r in range(size)]
            if self.source.kind == "gguf" and self.load_format != "dummy":
                check_gguf_tensor_parallel(self.source, self.model_config, plans)
        except TensorParallelError as error:
            raise ConfigError(f"invalid setting {error}") from None

    # ---- derived settings ------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32  # the CPU kernels compute in float32
        return DTYPES[self.dtype]

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.torch_dtype if self.kv_cache_dtype == "auto" else DTYPES[self.kv_cache_dtype]

    @property
    def threads_per_stage(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        ranks = self.pipeline_parallel_size * self.tensor_parallel_size
        return max(1, (os.cpu_count() or 1) // ranks)

    def stage(self, index: int) -> StageSpec:
        """Pipeline stage `index`: its layers and its first/last role."""
        return stage_specs(self.model_config.num_hidden_layers, self.pipeline_parallel_size)[index]

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes over *all* layers (keys and values)."""
        mc = self.model_config
        per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
        return per_token * self.block_size * self.cache_dtype.itemsize

    @property
    def num_kv_blocks(self) -> int:
        """Blocks of every layer the KV-cache budget buys: the cache without sliding windows,
        which kv_cache_groups splits between the groups."""
        budget = self.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        return budget // self.kv_bytes_per_block

    def _layers_by_window(self) -> dict[int, int]:
        mc = self.model_config
        windows = [mc.layer_window(i) for i in range(mc.num_hidden_layers)]
        return {w: windows.count(w) for w in mc.cache_group_windows}

    @property
    def kv_cache_groups(self) -> list[CacheGroup]:
        """The KV-cache groups, full attention first, and each one's blocks
        (model/cache_groups.py): one group of num_kv_blocks without sliding windows."""
        return split_cache(
            self.num_kv_blocks,
            self._layers_by_window(),
            self.block_size,
            self.max_model_len,
            self.max_num_batched_tokens,
        )

    def _check_kv_capacity(self) -> None:
        """The cache must hold one max_model_len sequence; with sliding windows, in each
        group's share of the budget (and a window group a prompt chunk besides)."""
        layers = self._layers_by_window()
        if len(layers) == 1 and 0 in layers:
            capacity = self.num_kv_blocks * self.block_size
            if capacity < self.max_model_len:
                _fail(
                    "kv_cache_memory",
                    self.kv_cache_memory,
                    f"it holds {capacity} tokens but max_model_len is {self.max_model_len}; "
                    f"give at least {self.max_model_len // self.block_size + 1} blocks of "
                    f"{self.kv_bytes_per_block} bytes, or lower max_model_len",
                )
            return
        fits = all(
            g.num_blocks - (g.window > 0)
            >= sequence_blocks(
                g.window, self.block_size, self.max_model_len, self.max_num_batched_tokens
            )
            for g in self.kv_cache_groups
        )
        if not fits:
            need = min_budget_blocks(
                layers, self.block_size, self.max_model_len, self.max_num_batched_tokens
            )
            _fail(
                "kv_cache_memory",
                self.kv_cache_memory,
                f"split between the full-attention and sliding-window layers it cannot hold "
                f"one {self.max_model_len}-token sequence; give at least "
                f"{(need + 1) * self.kv_bytes_per_block} bytes, or lower max_model_len or "
                "max_num_batched_tokens",
            )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.source.name

    @property
    def tokenizer_source(self) -> ModelSource:
        """Where the tokenizer comes from: `tokenizer` when given, else the model itself."""
        return resolve_model(self.tokenizer) if self.tokenizer else self.source

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls) if f.init}
