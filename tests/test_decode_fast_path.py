"""The fused decode path (model/decode_fast_path.py, kernels/decode_layers.cpp): a stage's layers
in one C++ call for decode-only batches, bit-identical to the Python path it replaces there."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pipellm import LLM, SamplingParams
from pipellm.kernels.cpu_kernels import int8_activations_unavailable, why_unavailable
from pipellm.loader.source import load_model_config, resolve_model
from pipellm.loader.weights import iter_weights
from pipellm.model import decode_fast_path
from pipellm.model.decode_fast_path import FAST_PATH_ENV, DecodeFastPath, why_not_fused
from pipellm.model.forward_batch import ForwardBatch, PrefillChunk
from pipellm.model.gguf_linear import QuantizedWeight
from pipellm.model.llama import LlamaStage
from pipellm.model.stage_spec import StageSpec
from pipellm.parallel.comm import GlooComm
from tests.checkpoints import TINY_SLIDING_WINDOW, make_tiny_checkpoint
from tests.test_generate import make_prompts, reference_greedy

pytestmark = pytest.mark.skipif(
    why_unavailable() is not None, reason=f"CPU kernels unavailable: {why_unavailable()}"
)
BLOCK_SIZE, NUM_BLOCKS = 4, 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def skip_without_int8(mode: str) -> None:
    if mode.endswith("int8") and int8_activations_unavailable() is not None:
        pytest.skip(f"int8 activations unavailable: {int8_activations_unavailable()}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fast") / "m", arch="qwen2")


T = GGMLQuantizationType
# A mix as llama.cpp's quantizer writes for widths that are not whole K-quant blocks: a q/k/v
# of Q5_0 and Q8_0 (widened to Q8_0 for the repacked kernel), a Q5_0 o_proj (repacked as
# itself), and a gate/up of different types and a Q5_1 down_proj computed on their stored
# blocks.
MIXED_TYPES = {
    "q_proj": T.Q5_0,
    "k_proj": T.Q5_0,
    "v_proj": T.Q8_0,
    "o_proj": T.Q5_0,
    "gate_proj": T.Q4_0,
    "up_proj": T.Q5_0,
    "down_proj": T.Q5_1,
}


def as_gguf(name: str, weight: torch.Tensor, mixed: bool = False) -> QuantizedWeight:
    """The weight quantized as a GGUF file would store it: Q4_1 for the attention projections,
    Q8_0 for the MLP's, so both kinds run; or with `mixed`, MIXED_TYPES."""
    kind = GGMLQuantizationType.Q4_1 if "self_attn" in name else GGMLQuantizationType.Q8_0
    if mixed:
        kind = MIXED_TYPES[name.split(".")[-2]]
    blocks = np.ascontiguousarray(quants.quantize(weight.numpy(), kind))
    return QuantizedWeight(
        kind, torch.from_numpy(blocks).view(torch.uint8).reshape(len(weight), -1)
    )


def tiny_stage(checkpoint, spec: StageSpec, mode: str) -> LlamaStage:
    """A prepared stage of the tiny Qwen2 checkpoint (q/k/v biases): float32 packed weights,
    or GGUF-quantized ones computed exactly ("gguf") or on int8 activations ("gguf_int8")."""
    source = resolve_model(str(checkpoint))
    config = load_model_config(source)
    weights = dict(iter_weights(source, config, spec, torch.float32))
    stage = LlamaStage(config, spec, torch.float32)
    stage.load_weights(weights.items())
    quantized = {}
    if mode != "float32":
        mixed = mode.startswith("mixed")
        gguf = {n: as_gguf(n, w, mixed) for n, w in weights.items() if n.endswith("proj.weight")}
        quantized = stage.quantized_linears(gguf)
        assert len(quantized) == 4 * stage.config.num_hidden_layers // spec.num_stages
    int8 = mode.endswith("int8")
    stage.prepare_for_inference(True, quantized, int8_activations=int8)
    return stage


def decode_batch(context_lens: list[int], prefill: int = 0) -> ForwardBatch:
    """Decodes of sequences with these context lengths (their new token included), then
    optionally a fresh prefill chunk of `prefill` tokens in block 1."""
    tables = torch.tensor([[2, 5], [7, 0]])[: len(context_lens)]
    lens = torch.tensor(context_lens)
    positions = lens - 1
    slots = tables.gather(1, (positions // BLOCK_SIZE).unsqueeze(1)).squeeze(1) * BLOCK_SIZE
    slots += positions % BLOCK_SIZE
    chunks = []
    if prefill:
        chunks = [PrefillChunk(len(context_lens), prefill, None, None)]
        positions = torch.cat([positions, torch.arange(prefill)])
        slots = torch.cat([slots, BLOCK_SIZE + torch.arange(prefill)])
    return ForwardBatch(
        positions=positions,
        slot_mapping=slots,
        num_decodes=len(context_lens),
        decode_block_tables=tables,
        decode_context_lens=lens,
        decode_mask=None,
        prefills=chunks,
        logits_indices=torch.arange(len(positions)),
    )


def random_caches(stage: LlamaStage, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, stage.tp.num_kv_heads, stage.config.head_dim)
    return [
        (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        for _ in stage.layers
    ]


@pytest.fixture
def fast_calls(monkeypatch):
    """How many times the fused path ran."""
    calls = []
    run = DecodeFastPath.__call__

    def counted(self, *args):
        calls.append(1)
        return run(self, *args)

    monkeypatch.setattr(DecodeFastPath, "__call__", counted)
    return calls


@pytest.mark.parametrize("mode", ["float32", "gguf", "gguf_int8", "mixed", "mixed_int8"])
# The whole model, and the last of two stages (hidden states in, not token ids).
@pytest.mark.parametrize("spec", [StageSpec(0, 1, 0, 4), StageSpec(1, 2, 2, 4)], ids=str)
def test_hidden_states_equal_the_python_path(checkpoint, fast_calls, mode, spec):
    skip_without_int8(mode)
    stage = tiny_stage(checkpoint, spec, mode)
    assert stage.decode_fast_path is not None, why_not_fused(stage)
    fused_caches, python_caches = random_caches(stage, 0), random_caches(stage, 0)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for step in range(3):  # each step's token goes into the cache the next reads
            batch = decode_batch([6 + step, 3 + step])
            if spec.is_first:
                inputs = torch.randint(0, stage.config.vocab_size, (2,), generator=generator)
            else:
                inputs = torch.randn(2, stage.config.hidden_size, generator=generator)
            before = inputs.clone()
            fused = stage(inputs, batch, fused_caches)
            assert torch.equal(inputs, before), "the stage's input is left as it was"
            fast_path, stage.decode_fast_path = stage.decode_fast_path, None
            python = stage(inputs, batch, python_caches)
            stage.decode_fast_path = fast_path
            assert torch.equal(fused, python)
            for fused_pair, python_pair in zip(fused_caches, python_caches, strict=True):
                assert all(map(torch.equal, fused_pair, python_pair))
    assert len(fast_calls) == 3


def test_a_batch_with_a_prefill_takes_the_python_path(checkpoint, fast_calls):
    stage = tiny_stage(checkpoint, StageSpec(0, 1, 0, 4), "float32")
    mixed = decode_batch([6, 3], prefill=3)
    assert not DecodeFastPath.applies(mixed)
    with torch.inference_mode():
        out = stage(torch.tensor([5, 6, 7, 8, 9]), mixed, random_caches(stage, 0))
    assert out.shape == (5, stage.config.hidden_size) and not fast_calls


def test_switched_off_or_uncovered_stages_keep_the_python_path(checkpoint, monkeypatch):
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    stage = tiny_stage(checkpoint, StageSpec(0, 1, 0, 4), "float32")
    assert stage.decode_fast_path is None
    assert FAST_PATH_ENV in why_not_fused(stage)
    monkeypatch.delenv(FAST_PATH_ENV)
    assert why_not_fused(stage) is None
    stage.layers[1].mlp.down_proj = torch.nn.Linear(128, 64)  # e.g. a layer left to PyTorch
    assert "Linear" in why_not_fused(stage)
    stage.comm = GlooComm.__new__(GlooComm)  # ranks on several hosts: torch.distributed's
    assert "over GlooComm" in why_not_fused(stage)
    stage.comm = None
    monkeypatch.setattr(decode_fast_path, "cpu_kernels_available", lambda: False)
    assert "kernels are not used" in why_not_fused(stage)


def test_uneven_query_groups_reach_the_attention_kernel(checkpoint):
    """A tensor-parallel rank's runs of query heads per KV head may differ (SmolLM2's 9 and 3
    heads over 2 ranks, model/tp_plan.py): here 1 and 3 of the 4 query heads, set on the
    layers as a rank's plan would. The fused path matches the Python path with them, and
    differs from the even split, so they did reach the kernel."""
    stage = tiny_stage(checkpoint, StageSpec(0, 1, 0, 4), "float32")
    even = stage.decode_fast_path
    for layer in stage.layers:
        layer.self_attn.group_starts = (0, 1, 4)
    assert why_not_fused(stage) is None
    uneven = DecodeFastPath(stage)
    batch = decode_batch([6, 3])
    inputs = torch.tensor([5, 6])
    out = {}
    with torch.inference_mode():
        for name, path in (("python", None), ("uneven", uneven), ("even", even)):
            stage.decode_fast_path = path
            out[name] = stage(inputs, batch, random_caches(stage, 0))
    assert torch.equal(out["uneven"], out["python"])
    assert not torch.allclose(out["even"], out["python"])


def test_generate_gives_the_same_greedy_tokens_without_it(checkpoint, fast_calls, monkeypatch):
    prompts = [[5, 17, 42, 99], [7, 8]]
    with LLM(str(checkpoint), max_num_seqs=2) as llm:
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert len(fast_calls) >= GREEDY.max_tokens - 1  # every decode-only step took it
    monkeypatch.setenv(FAST_PATH_ENV, "0")
    with LLM(str(checkpoint), max_num_seqs=2) as llm:
        assert llm.engine.executor.worker.model.decode_fast_path is None
        python = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert fused == python


class BothPaths:
    """Stands in for a stage's fused path: runs it, then the Python path on the same caches
    (which writes the same keys and values again), and checks that they agree bit for bit."""

    def __init__(self, stage: LlamaStage) -> None:
        self.stage, self.fused, self.steps = stage, stage.decode_fast_path, 0
        self.inputs: torch.Tensor | None = None
        forward = stage.forward

        def keep_inputs(inputs, batch, kv_caches):
            self.inputs = inputs
            return forward(inputs, batch, kv_caches)

        stage.forward = keep_inputs
        stage.decode_fast_path = self

    def applies(self, batch: ForwardBatch) -> bool:
        return self.fused.applies(batch)

    def __call__(self, x, cos_sin, kv_caches, batch):
        fused = self.fused(x, cos_sin, kv_caches, batch)
        self.stage.decode_fast_path = None
        python = LlamaStage.forward(self.stage, self.inputs, batch, kv_caches)
        self.stage.decode_fast_path = self
        assert torch.equal(fused, python)
        self.steps += 1
        return fused


@pytest.mark.parametrize("quantization", ["gguf", "gguf_int8"])
def test_smollm2_decode_steps_equal_the_python_path(quantization):
    """The built-in model (Q4_1 and Q8_0 weights as stored; SmolLM2's 30 layers, 9 heads)."""
    skip_without_int8(quantization)
    prompts = ["The three primary colors are", "def fibonacci(n):"]
    with LLM(quantization=quantization, max_num_seqs=2) as llm:
        stage = llm.engine.executor.worker.model
        both = BothPaths(stage)
        checked = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert both.steps == GREEDY.max_tokens - 1
        stage.decode_fast_path = None
        python = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert checked == python


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_q_k_norm_families_decode_steps_equal_the_python_path_and_transformers(tmp_path, arch):
    """Gemma 3 (a tiny checkpoint): q/k norms, four norms a layer, the tanh-GELU gate, (1 + w)
    norms, the embedding scale, and five sliding-window layers (their own KV-cache group and
    RoPE base) then a global one; Qwen3: its q/k norms alone. Every decode-only step takes the
    fused path, bit-identical to the Python path, with prompts longer than the window and new
    tokens past another one."""
    directory = make_tiny_checkpoint(tmp_path / arch, arch=arch)
    prompts = make_prompts(vocab_size=300, shared_prefix=TINY_SLIDING_WINDOW)[:2]
    params = SamplingParams(temperature=0, max_tokens=2 * TINY_SLIDING_WINDOW, ignore_eos=True)
    with LLM(str(directory), max_num_seqs=2) as llm:
        stage = llm.engine.executor.worker.model
        assert stage.config.qk_norm and stage.decode_fast_path is not None
        assert bool(stage.config.sliding_window_layers) == (arch == "gemma3")
        both = BothPaths(stage)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert both.steps == params.max_tokens - 1
    assert tokens == reference_greedy(directory, prompts, params.max_tokens)
