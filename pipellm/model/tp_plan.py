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

Where heads straddle the ranks, q/k/v are computed by rows, not by heads (`q_rows`,
`kv_rows`: an even split of each projection's output rows), and one all-gather per layer
hands each rank the rows of its heads that another rank computed; o_proj's input columns
split evenly too (`o_columns`, on 32-value GGUF blocks), each rank running attention for the
heads its columns cover. SmolLM2's 9 query / 3 KV heads over 2 ranks: rank 0 computes q rows
0-287 and k/v rows 0-95 and attends with heads 0-4, KV heads 0-1; rank 1 q rows 288-575, k/v
rows 96-191, heads 4-8, KV heads 1-2; each multiplies 288 of o_proj's 576 columns. So each
rank streams exactly half of every attention weight (by heads, rank 0 held 5 query heads'
q and o rows and a KV head both ranks held: 4.2% more weights a layer than half, which the
other rank waited out at every all-reduce of a one-sequence decode), at the cost of one
all-gather of the computed rows (480 floats a token here) and attention for the shared
query head on both ranks.
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
    q_heads: tuple[int, int]  # [start, stop) of the query heads this rank attends with
    kv_heads: tuple[int, int]  # the KV heads those use: this rank's KV cache
    intermediate: tuple[int, int]  # MLP columns
    vocab: tuple[int, int]
    head_dim: int
    # Rows of q_proj and of k_proj / v_proj this rank computes, o_proj's input columns it
    # multiplies (all [start, stop)); q_rows and kv_rows are its heads' rows unless
    # `exchanges_qkv`.
    q_rows: tuple[int, int] = (0, 0)
    kv_rows: tuple[int, int] = (0, 0)
    o_columns: tuple[int, int] = (0, 0)
    # Some rank computes rows another rank's heads need: each layer all-gathers the computed
    # q/k/v rows (the same on every rank of the group).
    exchanges_qkv: bool = False
    qkv_width: int = 0  # the widest rank's computed q/k/v rows: the all-gather's part

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
    def computed_qkv_rows(self) -> list[int]:
        """Output rows of this rank's fused qkv_proj: its q, k and v rows."""
        q, kv = self.q_rows[1] - self.q_rows[0], self.kv_rows[1] - self.kv_rows[0]
        return [q, kv, kv]

    @property
    def o_offset(self) -> int:
        """Where o_columns start in this rank's attention output (its heads side by side)."""
        return self.o_columns[0] - self.q_heads[0] * self.head_dim

    def qkv_gather_index(self, plans: list[TensorParallelPlan]) -> list[int]:
        """For each of this rank's heads' q, k and v rows (the layout attention takes), its
        column in the all-gathered computed rows: rank r's part at r * qkv_width, q then k
        then v rows."""
        d, index = self.head_dim, []
        for offset, (lo, hi), rows_of in (
            (0, self.q_heads, lambda p: p.q_rows),
            (1, self.kv_heads, lambda p: p.kv_rows),
            (2, self.kv_heads, lambda p: p.kv_rows),
        ):
            for row in range(lo * d, hi * d):
                owner = next(p for p in plans if rows_of(p)[0] <= row < rows_of(p)[1])
                sizes = owner.computed_qkv_rows
                start = owner.rank * owner.qkv_width + sum(sizes[:offset])
                index.append(start + row - rows_of(owner)[0])
        return index

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
            return WeightShard(0, *self.q_rows, self.q_full * d)
        if projection in _KEY_VALUE:
            return WeightShard(0, *self.kv_rows, self.kv_full * d)
        if projection in _MLP_COLUMNS:
            return WeightShard(0, *self.intermediate, self.intermediate_full)
        if kind == "weight" and projection == _ROW_PARALLEL[0]:
            return WeightShard(1, *self.o_columns, self.q_full * d)
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


# o_proj's input columns split on this many values where an even split allows it: a GGUF
# block (Q4_1, Q8_0) must not be cut (K-quants' 256 are checked, and refused, at load).
_O_COLUMN_ALIGN = 32


def _o_column_ranges(heads: int, head_dim: int, size: int) -> list[tuple[int, int]]:
    """o_proj's input columns per rank: an even split on whole GGUF blocks if there is one,
    else by whole query heads (as even as possible)."""
    columns = heads * head_dim
    if columns % size == 0 and (columns // size) % _O_COLUMN_ALIGN == 0:
        return _even_ranges(columns, size)
    return [(a * head_dim, b * head_dim) for a, b in _even_ranges(heads, size)]


def plan_tensor_parallel(config: ModelConfig, size: int, rank: int) -> TensorParallelPlan:
    """Rank `rank` of `size`'s heads, MLP columns and vocabulary; raises TensorParallelError
    (naming the setting and what would fit) when the model cannot be split `size` ways."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads
    d = config.head_dim
    fix = "use a tensor_parallel_size that divides it"
    if size > heads:
        raise TensorParallelError(
            f"tensor_parallel_size={size} cannot split {heads} query heads: each rank needs "
            f"at least one; use at most {heads}"
        )
    o_columns = _o_column_ranges(heads, d, size)
    # The heads each rank's columns cover, and the KV heads of those query heads.
    q_heads = [(lo // d, -(-hi // d)) for lo, hi in o_columns]
    kv = [(a // group, (b - 1) // group + 1) for a, b in q_heads]
    q_rows, kv_rows = _even_ranges(heads * d, size), _even_ranges(kv_heads * d, size)
    exchanges = any(
        q_rows[r] != (q_heads[r][0] * d, q_heads[r][1] * d)
        or kv_rows[r] != (kv[r][0] * d, kv[r][1] * d)
        for r in range(size)
    )
    if not exchanges:
        q_rows = [(a * d, b * d) for a, b in q_heads]
        kv_rows = [(a * d, b * d) for a, b in kv]
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
    width = max(q[1] - q[0] + 2 * (k[1] - k[0]) for q, k in zip(q_rows, kv_rows, strict=True))
    return TensorParallelPlan(
        size=size,
        rank=rank,
        q_heads=q_heads[rank],
        kv_heads=kv[rank],
        intermediate=(rank * mlp, (rank + 1) * mlp),
        vocab=(rank * vocab, (rank + 1) * vocab),
        head_dim=config.head_dim,
        q_full=heads,
        kv_full=kv_heads,
        intermediate_full=config.intermediate_size,
        vocab_full=config.vocab_size,
        q_rows=q_rows[rank],
        kv_rows=kv_rows[rank],
        o_columns=o_columns[rank],
        exchanges_qkv=exchanges,
        qkv_width=width,
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
