"""BlockTableRows (model/block_table.py): the batch's block table kept between steps equals the
one rebuilt from lists, whatever a manager does to the tables between steps."""
from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from nanoserve.model.block_table import BlockTableRows


def rebuilt(chunks: list[tuple[str, list[int]]]) -> torch.Tensor:
    """What the runner built before: each table padded with zeros to the longest."""
    width = max(len(t) for _, t in chunks)
    return torch.tensor([t + [0] * (width - len(t)) for _, t in chunks], dtype=torch.int32)


class BlockTableMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rows = BlockTableRows(pin_memory=False, num_rows=2, width=2)  # tiny: rows and width grow
        self.tables: dict[str, list[int]] = {}  # the manager's tables, edited in place
        self.next_id = 0

    @rule(blocks=st.lists(st.integers(0, 500), min_size=1, max_size=5))
    def admit(self, blocks):
        self.tables[f"r{self.next_id}"] = list(blocks)
        self.next_id += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), blocks=st.lists(st.integers(0, 500), min_size=1, max_size=3))
    def grow(self, data, blocks):
        self.tables[data.draw(st.sampled_from(sorted(self.tables)))].extend(blocks)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), blocks=st.lists(st.integers(0, 500), min_size=1, max_size=6))
    def rewrite(self, data, blocks):
        """A swap-in, a re-key or a preemption and re-admission: the same list object, new contents."""
        table = self.tables[data.draw(st.sampled_from(sorted(self.tables)))]
        table[:] = blocks

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def change_one_block(self, data):
        """Same length, one block different (KunServe's re-keying moves single blocks)."""
        table = self.tables[data.draw(st.sampled_from(sorted(self.tables)))]
        table[data.draw(st.integers(0, len(table) - 1))] += 1

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def finish(self, data):
        del self.tables[data.draw(st.sampled_from(sorted(self.tables)))]

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def step(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tables)), min_size=1, unique=True))
        chunks = [(rid, self.tables[rid]) for rid in ids]
        assert torch.equal(self.rows.table(chunks), rebuilt(chunks))

    @invariant()
    def rows_hold_their_tables(self):
        self.rows.check_invariants()


TestBlockTableRows = BlockTableMachine.TestCase
TestBlockTableRows.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_decode_step_writes_nothing_and_a_new_block_one_entry():
    rows = BlockTableRows(pin_memory=False)
    a, b = [1, 2, 3], [7]
    rows.table([("a", a), ("b", b)])
    assert rows.rows_written == 2
    rows.table([("a", a), ("b", b)])  # nothing changed
    assert (rows.rows_written, rows.entries_appended) == (2, 0)
    b.append(9)
    assert rows.table([("b", b), ("a", a)]).tolist() == [[7, 9, 0], [1, 2, 3]]
    assert (rows.rows_written, rows.entries_appended) == (2, 1)
