"""Tensor parallelism, Megatron-LM style (Shoeybi et al., 2019, §3): every rank holds a slice of
each weight matrix and the ranks meet in one all-reduce per attention block and one per MLP.

    x ─► [QKV: column-parallel, by heads] ─► attention over this rank's heads ─► [o_proj: row-
         parallel] ─► all-reduce ─► x ─► [gate/up: column-parallel] ─► act ─► [down: row-
         parallel] ─► all-reduce ─► x

A column-parallel layer splits its output features: rank r computes its own rows of W, and the
next layer consumes them where they are. A row-parallel layer splits its input features: each
rank multiplies its slice and the partial sums are added by an all-reduce. Pairing them
(column then row) costs one collective per block, whatever the width.

Attention splits by heads. Query heads divide evenly. Key/value heads (GQA) divide too while
there are at least as many as ranks; with more ranks than KV heads, each KV head is replicated
on the ranks whose query heads read it (rank r keeps head r * kv_heads // tp), so every rank
still holds the KV of its own query heads and attention needs no communication.

The vocabulary splits by rows (the embedding and the LM head): a rank looks up only the token
ids in its range and the all-reduce fills in the rest; the LM head's logits are all-gathered.

Every layer takes a `TPGroup`; with one rank every collective is skipped, so the single-device
engine runs the same modules at no cost. The weights of a rank are read from the checkpoint as
slices (`narrow`), so no rank holds the whole model in memory, even while loading.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.kernels.cpu_linear import PackedWeight, linear
from nanoserve.model.layers import ShardedWeight, Weight


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its tensor-parallel group (rank 0 of 1 on a single device)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None with one rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any rank of the group (every rank must call this)."""
        if self.size == 1:
            return flag
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        votes = torch.tensor([int(flag)], device=device)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        return bool(votes.item())

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()

def narrow(weight: Weight, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows [start, start + length) of `weight` along `dim`, reading no more than that."""
    return weight.narrow(dim, start, length)


def materialize(weight: Weight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.materialize()


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


# -- how each tensor splits ----------------------------------------------------------------------
def even_shard(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, length) of rank `tp.rank`'s share of `total` rows."""
    size = divide(total, tp.size, what)
    return tp.rank * size, size


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when there are fewer heads
    than ranks."""
    if num_kv_heads >= tp_size:
        return divide(num_kv_heads, tp_size, "the number of KV heads")
    divide(tp_size, num_kv_heads, "a replicated KV head's ranks")  # tp must be a multiple
    return 1


def kv_head_shard(num_kv_heads: int, head_dim: int, tp: TPGroup) -> tuple[int, int]:
    """(start, length) of this rank's K (or V) rows: its heads, or the one it replicates."""
    heads = local_kv_heads(num_kv_heads, tp.size)
    first = tp.rank * heads if num_kv_heads >= tp.size else tp.rank * num_kv_heads // tp.size
    return first * head_dim, heads * head_dim


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> list[tuple[int, int]]:
    divide(num_heads, tp.size, "the number of attention heads")
    kv = kv_head_shard(num_kv_heads, head_dim, tp)
    return [even_shard(num_heads * head_dim, tp, "the query width"), kv, kv]


# -- layers --------------------------------------------------------------------------------------
class ColumnParallelLinear(ShardedWeight, PackedWeight, nn.Linear):
    """y[:, this rank's rows] = x W_r^T + b_r; the output stays split across ranks. On a CPU the
    product may run from a packed copy of W_r (nanoserve/kernels/cpu_linear.py)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        self.shard = even_shard(out_features, tp, "the output width")
        super().__init__(in_features, self.shard[1], bias=bias)

    def load_weight(self, param_name: str, weight: Weight) -> None:
        getattr(self, param_name).data.copy_(narrow(weight, 0, *self.shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class RowParallelLinear(ShardedWeight, PackedWeight, nn.Linear):
    """y = Σ_r x_r W_r^T + b: each rank multiplies its input slice; the all-reduce adds them.
    The bias is added once, after the sum. (On a CPU, maybe from a packed W_r.)"""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup = SINGLE):
        self.tp = tp
        self.shard = even_shard(in_features, tp, "the input width")
        super().__init__(self.shard[1], out_features, bias=bias)

    def load_weight(self, param_name: str, weight: Weight) -> None:
        if param_name == "bias":
            self.bias.data.copy_(materialize(weight))
        else:
            self.weight.data.copy_(narrow(weight, 1, *self.shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed_weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(ShardedWeight, PackedWeight, nn.Embedding):
    """Rank r holds token rows [r·n, (r+1)·n), n = ceil(vocab / tp) (the last rank's tail is
    zero padding). It looks up the ids in its range, zeroes the rest, and the all-reduce sums
    the ranks' rows into the full embedding. Packed (nanoserve/kernels/cpu_linear.py) only as an LM head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE):
        self.tp, self.vocab_size = tp, num_embeddings
        self.rows = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows
        super().__init__(self.rows, embedding_dim)

    def load_weight(self, param_name: str, weight: Weight) -> None:
        length = max(0, min(self.rows, self.vocab_size - self.start))
        self.weight.data.zero_()
        if length:
            self.weight.data[:length].copy_(narrow(weight, 0, self.start, length))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This weight as an LM head: every rank's vocab slice, gathered, padding dropped."""
        logits = self.tp.all_gather_last_dim(linear(hidden, self.weight, None, self.packed_weight))
        return logits[..., : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: split by vocabulary rows like the embedding, used only for `logits`."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an LM head computes logits; it is not an embedding")
