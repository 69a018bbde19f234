"""Which part of every weight each tensor-parallel rank of a stage holds (Megatron-LM's split).

Megatron-LM (Shoeybi et al., 2019, arXiv:1909.08053) splits a transformer layer so that each
half needs one all-reduce: q/k/v and gate/up are column-parallel (each rank computes its own
output columns: its attention heads, its slice of the MLP), o_proj and down_proj row-parallel
(each rank multiplies its slice of the input and the partial sums are all-reduced). The
embedding and lm_head are split by vocabulary (vLLM's VocabParallelEmbedding).

Query heads split evenly over the ranks (as even as possible: SmolLM2's 9 over 2 ranks give
5 and 4), and each rank holds the key/value heads its query heads use, so a KV head whose
group straddles two ranks is on both (SmolLM2: KV head 1 serves query heads 3-5; rank 0 holds
KV heads 0-1, rank 1 KV heads 1-2). Splitting by whole KV groups instead (6 + 3 query heads)
left one rank with twice the other's attention while the other waited at the all-reduce
(docs/benchmarks.md). A rank's runs of query heads per KV head may then differ
(`kv_group_starts`): the attention kernels take them (pipellm/kernels/query_groups.h).
With T above the KV heads, each KV head is replicated on the ranks that split its group, as
in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipellm.model.model_config import ModelConfig

# Checkpoint projections (Hugging Face names) by how they are split.
_QUERY = "self_attn.q_proj"
_KEY_VALUE = ("self_attn.k_proj", "self_attn.v_proj")
_MLP_COLUMNS = ("mlp.gate_proj", "mlp.up_proj")
_ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


class TensorParallelError(ValueError):
    """The model cannot be split over this many ranks; the message says why and what fits."""


@dataclass(frozen=True)
class WeightShard:
    """A rank's part of a checkpoint tensor: rows (dim 0) or columns (dim 1) [start, stop)
    of the `full` ones."""

    dim: int
    start: int
    stop: int
    full: int


@dataclass(frozen=True)
class TensorParallelPlan:
    size: int
    rank: int
    q_heads: tuple[int, int]  # [start, stop) of the model's query heads
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]  # MLP columns
    vocab: tuple[int, int]
    head_dim: int

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def kv_group_starts(self) -> tuple[int, ...] | None:
        """Offsets of each local KV head's run of local query heads (num_kv_heads + 1), or
        None where every KV head serves the same number of them (plain grouped-query
        attention)."""
        group = self.q_full // self.kv_full
        first, stop = self.q_heads
        starts = [0]
        for kv in range(*self.kv_heads):
            starts.append(min(stop, (kv + 1) * group) - first)
        sizes = {b - a for a, b in zip(starts, starts[1:], strict=False)}
        return None if len(sizes) == 1 else tuple(starts)

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def weight_shard(self, name: str) -> WeightShard | None:
        """This rank's part of the checkpoint tensor `name` (Hugging Face); None: all of it
        (norms, and o_proj's bias, which rank 0 alone adds)."""
        if self.size == 1:
            return None
        if name in _VOCAB:
            return WeightShard(0, *self.vocab, self.vocab_full)
        if not name.startswith("model.layers."):
            return None
        projection, _, kind = name.split(".", 3)[3].rpartition(".")
        d = self.head_dim
        if projection == _QUERY:
            return WeightShard(0, self.q_heads[0] * d, self.q_heads[1] * d, self.q_full * d)
        if projection in _KEY_VALUE:
            return WeightShard(0, self.kv_heads[0] * d, self.kv_heads[1] * d, self.kv_full * d)
        if projection in _MLP_COLUMNS:
            return WeightShard(0, *self.intermediate, self.intermediate_full)
        if kind == "weight" and projection == _ROW_PARALLEL[0]:
            return WeightShard(1, self.q_heads[0] * d, self.q_heads[1] * d, self.q_full * d)
        if kind == "weight" and projection == _ROW_PARALLEL[1]:
            return WeightShard(1, *self.intermediate, self.intermediate_full)
        return None

    # Full sizes, for the shards' `full` (set by plan_tensor_parallel).
    q_full: int = 0
    kv_full: int = 0
    intermediate_full: int = 0
    vocab_full: int = 0


def _even_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        ranges.append((start, start + size))
        start += size
    return ranges


def plan_tensor_parallel(config: ModelConfig, size: int, rank: int) -> TensorParallelPlan:
    """Rank `rank` of `size`'s heads, MLP columns and vocabulary; raises TensorParallelError
    (naming the setting and what would fit) when the model cannot be split `size` ways."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads
    fix = "use a tensor_parallel_size that divides it"
    if size > heads:
        raise TensorParallelError(
            f"tensor_parallel_size={size} cannot split {heads} query heads: each rank needs "
            f"at least one; use at most {heads}"
        )
    q = _even_ranges(heads, size)[rank]
    kv = (q[0] // group, (q[1] - 1) // group + 1)  # the KV heads of its query heads
    if config.intermediate_size % size:
        raise TensorParallelError(
            f"tensor_parallel_size={size}: the MLP's intermediate_size "
            f"{config.intermediate_size} is not divisible by it; {fix}"
        )
    if config.vocab_size % size:
        raise TensorParallelError(
            f"tensor_parallel_size={size}: the vocabulary ({config.vocab_size} tokens) is not "
            f"divisible by it; {fix}"
        )
    mlp = config.intermediate_size // size
    vocab = config.vocab_size // size
    return TensorParallelPlan(
        size=size,
        rank=rank,
        q_heads=q,
        kv_heads=kv,
        intermediate=(rank * mlp, (rank + 1) * mlp),
        vocab=(rank * vocab, (rank + 1) * vocab),
        head_dim=config.head_dim,
        q_full=heads,
        kv_full=kv_heads,
        intermediate_full=config.intermediate_size,
        vocab_full=config.vocab_size,
    )


def check_row_split(plan: TensorParallelPlan, name: str, block: int) -> None:
    """A row-parallel weight stored in blocks of `block` values along its input (GGUF) can only
    be split on block boundaries."""
    shard = plan.weight_shard(name)
    if shard is not None and shard.dim == 1 and (shard.start % block or shard.stop % block):
        raise TensorParallelError(
            f"tensor_parallel_size={plan.size}: {name}'s input columns "
            f"[{shard.start}, {shard.stop}) for rank {plan.rank} do not fall on its quantized "
            f"blocks of {block} values; use another tensor_parallel_size, or a GGUF file whose "
            "row-parallel weights (attn_output, ffn_down) use smaller blocks"
        )
