"""The step's block tables, kept between steps instead of rebuilt (issue 22, "no hidden syncs in
the step"; the idea is vLLM v1's persistent block table, the code ours).

Rebuilding a batch's padded block table as Python lists costs per block every step: 1.9 ms at
128 sequences x 256 blocks on this project's 2-core CPU (the issue measured 4.3 ms at 128 x 4k
tokens), as long as a whole graphed decode forward on the GPUs we measured (0.9-1.9 ms). Yet
between two decode steps a sequence's table rarely changes, and when it does it grows by one
block at the end. So each request keeps a row of one host array, and a step writes only what
changed:

    rows (host, int32, width = the longest table so far)      request -> row
    +---------------------------------------+
    | 17 18 40 41 42  0  0  0 ...           |  r1: unchanged -> nothing written
    | 3  9  12 55 [56] 0  0 ...             |  r2: grew by a block -> one entry written
    | 7  8  0  0 ...                        |  r3: re-keyed / swapped in / preempted and back
    +---------------------------------------+      -> its whole row rewritten
            | index_select(rows of this batch, :width)  into page-locked memory
            v
    [num_seqs, width] int32  --non_blocking copy-->  the device

A change is found by comparing the request's table with the copy the row was written from
(list equality runs in C: tens of microseconds for a whole batch), so any way a manager edits a
table (append, release, swap, KunServe's re-keying) is caught, not only appends. A row belongs to
a request until its row is needed and the request is not in the batch at hand (finished,
waiting or preempted): a request that comes back gets a row again, written whole.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockTableRows:
    def __init__(self, pin_memory: bool, num_rows: int = 64, width: int = 16):
        self.pin_memory = pin_memory
        self.rows = torch.zeros((num_rows, width), dtype=torch.int32)
        self._row_of: dict[str, int] = {}  # request id -> its row
        self._written: list[list[int] | None] = [None] * num_rows  # what each row holds (its table)
        self._free: list[int] = list(range(num_rows - 1, -1, -1))
        self.rows_written = 0  # whole rows written (new, or changed other than by growing)
        self.entries_appended = 0  # entries written because a table grew

    def table(self, chunks: Sequence[tuple[str, list[int]]]) -> torch.Tensor:
        """The padded [len(chunks), longest table] int32 block table of a batch's chunks
        ((request id, block table) pairs, in batch order), on the host (page-locked if asked):
        zeros past each table's end, as the kernels expect."""
        width = max(len(table) for _, table in chunks)
        if width > self.rows.shape[1]:
            self._widen(width)
        batch_ids = None
        index: list[int] = []
        for request_id, table in chunks:
            row = self._row_of.get(request_id)
            if row is None:
                if not self._free:
                    batch_ids = batch_ids if batch_ids is not None else {rid for rid, _ in chunks}
                    self._evict_or_grow(batch_ids)
                row = self._free.pop()
                self._row_of[request_id] = row
            self._update(row, table)
            index.append(row)
        out = torch.empty((len(chunks), width), dtype=torch.int32, pin_memory=self.pin_memory)
        torch.index_select(self.rows[:, :width], 0, torch.tensor(index), out=out)
        return out

    def _update(self, row: int, table: list[int]) -> None:
        written = self._written[row]
        if written is not None and len(table) >= len(written):
            if len(table) == len(written):
                if table == written:
                    return
            elif table[: len(written)] == written:  # grew at the end: write the new blocks only
                known = len(written)
                self.rows[row, known : len(table)] = torch.tensor(table[known:], dtype=torch.int32)
                written.extend(table[known:])
                self.entries_appended += len(table) - known
                return
        old = 0 if written is None else len(written)
        self.rows[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        if old > len(table):
            self.rows[row, len(table) : old] = 0
        self._written[row] = list(table)
        self.rows_written += 1

    def _evict_or_grow(self, batch_ids: set[str]) -> None:
        """Free the rows of requests not in this batch; if every row is in it, double the rows."""
        for request_id in [rid for rid in self._row_of if rid not in batch_ids]:
            row = self._row_of.pop(request_id)
            written = self._written[row]
            self.rows[row, : 0 if written is None else len(written)] = 0
            self._written[row] = None
            self._free.append(row)
        if not self._free:
            old = self.rows.shape[0]
            self.rows = torch.cat([self.rows, torch.zeros_like(self.rows)])
            self._written.extend([None] * old)
            self._free.extend(range(2 * old - 1, old - 1, -1))

    def _widen(self, width: int) -> None:
        new_width = max(width, 2 * self.rows.shape[1])
        wider = torch.zeros((self.rows.shape[0], new_width), dtype=torch.int32)
        wider[:, : self.rows.shape[1]] = self.rows
        self.rows = wider

    def check_invariants(self) -> None:
        """Each held row holds exactly its request's last written table, then zeros; free rows are
        all zeros; rows are held or free, never both."""
        held = set(self._row_of.values())
        assert len(held) == len(self._row_of), "two requests share a row"
        assert held.isdisjoint(self._free) and len(held) + len(self._free) == self.rows.shape[0]
        for row in range(self.rows.shape[0]):
            written = self._written[row] or []
            assert (row in held) or not written, f"free row {row} remembers a table"
            expected = torch.zeros(self.rows.shape[1], dtype=torch.int32)
            expected[: len(written)] = torch.tensor(written, dtype=torch.int32)
            assert torch.equal(self.rows[row], expected), f"row {row} differs from its table"
