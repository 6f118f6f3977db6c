"""benchmarks/memory.py keeps running: its CPU smoke mode, in a subprocess as a user runs it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_memory_benchmark_smoke(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "benchmarks/memory.py", "--smoke", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "== 1. Bookkeeping per step" in proc.stdout
    assert "== 2. Checkpoint copy throughput" in proc.stdout
    assert "== 3. Arena capacity" in proc.stdout
    for name in ("paged (BlockPool)", "exact", "bidirectional", "checkpoint", "arena"):
        assert f"| {name}" in proc.stdout
    results = json.loads(out.read_text())
    assert {"bookkeeping", "copy", "arena"} <= results.keys()
    assert results["copy"]["identical"]
    # Every allocator ran the same trace without running out of room.
    assert all(row["same_work_as_paged"] and not row["stalls"] for row in results["bookkeeping"]["rows"])


def test_host_store_copies_long_runs_bit_identical():
    """The benchmark's case, small: whole contiguous blocks (the slice path of
    `HostKVStore._copy`) saved and loaded back elsewhere, next to a scattered copy (index path)."""
    import torch

    from nanoserve.memory.host import HostKVStore, KVCopy

    B, blocks, layers = 16, 12, 2
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(32, B, 2, 4, generator=g), torch.randn(32, B, 2, 4, generator=g)) for _ in range(layers)]
    store = HostKVStore(blocks, B, layers, 2, 4, torch.float32, pin_memory=False)
    host = [s for b in store.allocate("r", blocks) for s in store.slots(b)]
    device = list(range(3 * B, (3 + blocks) * B))  # device blocks 3..14, one run of 192 slots
    store.execute([KVCopy("save", tuple(device), tuple(host))], caches)
    for layer, (k, v) in enumerate(caches):
        assert torch.equal(store.k[layer, host], k.view(-1, 2, 4)[device])
        assert torch.equal(store.v[layer, host], v.view(-1, 2, 4)[device])
    expected = [(k.view(-1, 2, 4)[device].clone(), v.view(-1, 2, 4)[device].clone()) for k, v in caches]
    target = list(range(17 * B, (17 + blocks) * B))  # load the run into device blocks 17..28
    store.execute([KVCopy("load", tuple(host), tuple(target))], caches)
    scattered = (5, 1, 30)  # three single slots: the index path
    store.execute([KVCopy("load", (0, 7, 9), scattered)], caches)
    for (k, v), (k_want, v_want) in zip(caches, expected):
        assert torch.equal(k.view(-1, 2, 4)[target], k_want) and torch.equal(v.view(-1, 2, 4)[target], v_want)
        assert torch.equal(k.view(-1, 2, 4)[list(scattered)], k_want[[0, 7, 9]])
