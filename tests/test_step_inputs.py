"""A step's small inputs travel in one buffer (nanoserve/model/step_inputs.py): every field reads
back what was packed, the padding is what the graphs expect, every field is 16-byte aligned, and a
graphed step reaches its graph's static buffers with two copies (the inputs, the block table)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.model.step_inputs import StepInputLayout


@st.composite
def steps(draw):
    """A layout and a step that fits it: s sequences of 1-5 tokens each, k <= s of them sampling."""
    lengths = draw(st.lists(st.integers(1, 5), max_size=6))
    n, s = sum(lengths), len(lengths)
    decode = draw(st.booleans())
    if decode:
        lengths = [1] * s
        n = s
        t = seqs = s + draw(st.integers(0, 5))
    else:
        t, seqs = n + draw(st.integers(0, 7)), s + draw(st.integers(0, 4))
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    values = st.integers(-(2**40), 2**40)
    fields = dict(input_ids=draw(st.lists(values, min_size=n, max_size=n)),
                  positions=draw(st.lists(values, min_size=n, max_size=n)),
                  slot_mapping=draw(st.lists(values, min_size=n, max_size=n)),
                  sample_rows=draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=0, max_size=s)),
                  seq_lens=draw(st.lists(st.integers(1, 2**30), min_size=s, max_size=s)),
                  query_start_loc=starts)
    return StepInputLayout(t, seqs, padding_sequences_take_a_token=decode), fields


@given(steps())
def test_every_field_reads_back_what_was_packed_then_the_padding(step):
    layout, f = step
    host = layout.pack(**f, pin_memory=False)
    assert host.dtype == torch.int64 and host.numel() == layout.size
    n, s, k = len(f["input_ids"]), len(f["seq_lens"]), len(f["sample_rows"])
    t, seqs = layout.num_tokens, layout.num_seqs
    cut = layout.views(host, n, s, k)
    assert cut.input_ids.tolist() == f["input_ids"] and cut.positions.tolist() == f["positions"]
    assert cut.slot_mapping.tolist() == f["slot_mapping"] and cut.sample_index.tolist() == f["sample_rows"]
    assert cut.seq_lens.tolist() == f["seq_lens"] and cut.query_start_loc.tolist() == f["query_start_loc"]
    assert cut.seq_lens.dtype == cut.query_start_loc.dtype == torch.int32
    whole = layout.views(host)
    assert whole.input_ids[n:].tolist() == whole.positions[n:].tolist() == [0] * (t - n)
    assert whole.slot_mapping[n:].tolist() == [-1] * (t - n)  # store_kv writes nothing for them
    assert whole.sample_index[k:].tolist() == [0] * (seqs - k)
    assert whole.seq_lens[s:].tolist() == [1] * (seqs - s)
    padding_starts = whole.query_start_loc[s + 1:].tolist()
    if layout.padding_sequences_take_a_token:  # a decode graph: tokens and sequences are its rows
        assert whole.query_start_loc.tolist() == list(range(t + 1))
    else:
        assert padding_starts == [n] * (seqs - s)  # empty sequences; the starts never decrease
    for view in whole:  # Triton specializes on 16-byte-aligned pointers
        assert view.storage_offset() * view.element_size() % 16 == 0
    ends = [v.storage_offset() * v.element_size() + v.numel() * v.element_size() for v in whole]
    starts = [v.storage_offset() * v.element_size() for v in whole]
    assert all(end <= start for end, start in zip(ends, starts[1:])), "fields overlap"
    assert ends[-1] <= layout.size * 8


def test_a_step_larger_than_its_layout_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        StepInputLayout(2, 2).pack([1, 2, 3], [0, 1, 2], [0, 1, 2], [2], [3], [0, 3], pin_memory=False)


def test_a_graphed_step_reaches_its_graphs_buffers_in_two_copies(tiny_llama_dir, monkeypatch):
    """Each decode step the runner sends to a graph: its values and padding are in the graph's
    own buffer before the replay, which copies nothing; the runner made two copies to get them
    there, one into the graph's input buffer and one into the static block table."""
    llm = LLM(str(tiny_llama_dir), device="cpu", kv_cache_tokens=2048, block_size=4, decode_graph_sizes=(1, 2, 4))
    runner = llm.engine.executor
    graphs = runner.graphs
    copies: list[int] = []  # the data_ptr of every tensor copied into during a prepare
    real_copy = torch.Tensor.copy_

    def counted_copy(self, src, non_blocking=False):
        copies.append(self.data_ptr())
        return real_copy(self, src, non_blocking)

    prepare, checked = runner.prepare, []

    def checked_prepare(batch, graph=None):
        copies.clear()
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "copy_", counted_copy)
            prepared = prepare(batch, graph)
        if graph == "decode":
            n = prepared.input_ids.shape[0]
            layout, buffer = graphs.inputs_for("decode", n)
            whole = layout.views(buffer)
            assert sorted(copies) == sorted([buffer.data_ptr(), graphs.block_tables.data_ptr()])
            assert whole.input_ids[:n].tolist() == [c.request.token_ids[c.start] for c in batch.chunks]
            assert whole.seq_lens.tolist() == [c.end for c in batch.chunks] + [1] * (layout.num_seqs - n)
            assert whole.query_start_loc.tolist() == list(range(layout.num_seqs + 1))
            assert prepared.input_ids.data_ptr() == buffer.data_ptr()  # the step reads the graph's buffer
            checked.append(n)
        return prepared

    runner.prepare = checked_prepare
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [5, 5, 5]
    assert checked and graphs.num_replays == len(checked)
