"""Paged-attention test cases drawn by hypothesis, shared by the reference and Triton tests.

A case is a batch of sequences, each with a context `length` of which the last `new` tokens
are this step's queries (new == 1 is a decode, new == length a prefill with no prefix). Every
sequence's K/V are drawn as plain dense tensors, which give the expected output, and then laid
out in a paged cache: pages shuffled through the cache, slots left to right or right to left,
and, for a BROS pair, a real-time and a best-effort sequence sharing their last page from
opposite ends. Every slot no sequence owns holds large noise, so reading a wrong slot shows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st


@dataclass(frozen=True)
class SeqSpec:
    length: int
    new: int
    right_to_left: bool


@dataclass(frozen=True)
class CaseSpec:
    block_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    dtype: torch.dtype
    seqs: tuple[SeqSpec, ...]
    with_directions: bool
    shared_pairs: tuple[tuple[int, int], ...] = ()  # (left-to-right seq, right-to-left seq) sharing a page


@dataclass
class PagedCase:
    spec: CaseSpec
    q: torch.Tensor
    k_cache: torch.Tensor  # holds every prefix; this step's K/V still to be stored
    v_cache: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    directions: torch.Tensor | None
    expected: torch.Tensor  # float64 dense causal attention over each sequence's own K/V

    @property
    def scale(self) -> float:
        return self.spec.head_dim ** -0.5

    def attention_args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        return (self.q, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                self.directions, self.scale)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [n, H, D] for the last n positions; k, v: [L, Hkv, D]; causal; GQA by repetition."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    k = k.double().repeat_interleave(heads // kv_heads, dim=1)
    v = v.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    positions = torch.arange(length - n, length)
    scores = scores.masked_fill(torch.arange(length)[None, None, :] > positions[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _slot(position: int, block_size: int, right_to_left: bool) -> int:
    return block_size - 1 - position % block_size if right_to_left else position % block_size


def build_case(spec: CaseSpec, seed: int, device: str | torch.device = "cpu") -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    size, kv_heads, dim = spec.block_size, spec.num_kv_heads, spec.head_dim
    pages_per_seq = [math.ceil(s.length / size) for s in spec.seqs]
    num_blocks = sum(pages_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(n)] for n in pages_per_seq]
    for left, right in spec.shared_pairs:
        tables[right][-1] = tables[left][-1]

    def rounded(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(spec.dtype)

    k_cache = rounded(num_blocks, size, kv_heads, dim, scale=4.0)
    v_cache = rounded(num_blocks, size, kv_heads, dim, scale=4.0)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    qs, new_ks, new_vs, slots, expected, qsl = [], [], [], [], [], [0]
    for seq, table in zip(spec.seqs, tables):
        rtl = spec.with_directions and seq.right_to_left
        k, v = rounded(seq.length, kv_heads, dim), rounded(seq.length, kv_heads, dim)
        q = rounded(seq.new, kv_heads * spec.group, dim)
        prefix = seq.length - seq.new
        for p in range(seq.length):
            flat = table[p // size] * size + _slot(p, size, rtl)
            if p < prefix:
                flat_k[flat], flat_v[flat] = k[p], v[p]
            else:
                slots.append(flat)
        qs.append(q)
        new_ks.append(k[prefix:])
        new_vs.append(v[prefix:])
        expected.append(dense_attention(q, k, v, dim ** -0.5))
        qsl.append(qsl[-1] + seq.new)

    width = max(pages_per_seq)
    directions = None
    if spec.with_directions:
        directions = torch.tensor([s.right_to_left for s in spec.seqs], device=device)

    def on_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    return PagedCase(
        spec=spec, q=on_device(torch.cat(qs)), k_cache=on_device(k_cache), v_cache=on_device(v_cache),
        new_k=on_device(torch.cat(new_ks)), new_v=on_device(torch.cat(new_vs)),
        slot_mapping=on_device(torch.tensor(slots, dtype=torch.int64)),
        block_tables=on_device(torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)),
        seq_lens=on_device(torch.tensor([s.length for s in spec.seqs], dtype=torch.int32)),
        query_start_loc=on_device(torch.tensor(qsl, dtype=torch.int32)),
        directions=directions, expected=torch.cat(expected),
    )


def context_lengths(block_size: int, max_len: int) -> st.SearchStrategy[int]:
    """Lengths where paging goes wrong first: 1, a whole number of pages, one past it, any."""
    pages = max(1, max_len // block_size)
    return st.one_of(
        st.just(1),
        st.integers(1, pages).map(lambda k: k * block_size),
        st.integers(1, max(1, (max_len - 1) // block_size)).map(lambda k: k * block_size + 1),
        st.integers(1, max_len),
    )


@st.composite
def case_specs(draw, block_sizes=(8, 16, 32, 64), head_dims=(64, 128), dtypes=(torch.float32,),
               groups=(1, 3, 4), max_len: int = 100, max_seqs: int = 4) -> CaseSpec:
    size = draw(st.sampled_from(block_sizes))
    mode = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    with_directions = draw(st.booleans())

    def seq(length: int, right_to_left: bool) -> SeqSpec:
        new = {"decode": 1, "prefill": length}.get(mode) or draw(st.integers(1, length))
        return SeqSpec(length, new, right_to_left)

    seqs = [seq(draw(context_lengths(size, max_len)), draw(st.booleans()))
            for _ in range(draw(st.integers(1, max_seqs)))]
    pairs: tuple[tuple[int, int], ...] = ()
    if with_directions and size > 1 and draw(st.booleans()):
        # BROS: a real-time sequence fills its last page from the left, a best-effort one the
        # same page from the right; together they use at most the page's B slots.
        rt_tail = draw(st.integers(1, size - 1))
        be_tail = draw(st.integers(1, size - rt_tail))
        rt_len = draw(st.integers(0, 1)) * size + rt_tail
        be_len = draw(st.integers(0, 1)) * size + be_tail
        pairs = ((len(seqs), len(seqs) + 1),)
        seqs += [seq(rt_len, False), seq(be_len, True)]
    return CaseSpec(size, draw(st.sampled_from([1, 2])), draw(st.sampled_from(groups)),
                    draw(st.sampled_from(head_dims)), draw(st.sampled_from(dtypes)), tuple(seqs),
                    with_directions, pairs)


TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}
