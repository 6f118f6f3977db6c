"""The runner's memory plumbing on a tiny Llama: BROS's right-to-left layout and the memory
managers' KV copies leave the model's output unchanged."""
from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_VOCAB, backend_device, build_tiny_model

from nanoserve import SamplingParams
from nanoserve.memory.host import HostKVStore, KVCopy
from nanoserve.model.attention import get_attention_backend
from nanoserve.model.loader import load_model
from nanoserve.model.runner import ModelRunner
from nanoserve.request import Request
from nanoserve.sched import ScheduledChunk, SchedulerOutput

BLOCK = 4
BACKENDS = ["torch"] + (["triton"] if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" else [])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    build_tiny_model("llama", directory)
    return directory


def make_runner(directory, backend: str) -> ModelRunner:
    device = torch.device(backend_device(backend))
    model, cfg = load_model(directory, device, torch.float32)
    store = HostKVStore(8, BLOCK, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return ModelRunner(model, cfg, 16, BLOCK, device, torch.float32,
                       get_attention_backend(backend, device), host_store=store)


def logits(runner: ModelRunner, batch: SchedulerOutput) -> torch.Tensor:
    with torch.no_grad():
        return runner.model.compute_logits(runner.run_model(runner.prepare(batch)))


PROMPT = torch.randint(0, TINY_VOCAB, (11,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_right_to_left_blocks_give_the_same_logits(llama_dir, backend):
    """Prefill 10 tokens then decode the 11th, once in each layout, on different blocks."""
    runner = make_runner(llama_dir, backend)
    results = []
    for table, rtl in (([3, 7, 1], False), ([9, 2, 14], True)):
        request = Request(f"r{rtl}", PROMPT, SamplingParams())
        prefill = logits(runner, SchedulerOutput([ScheduledChunk(request, 0, 10, table, rtl)]))
        decode = logits(runner, SchedulerOutput([ScheduledChunk(request, 10, 1, table, rtl)]))
        results.append((prefill, decode))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_saved_to_host_and_loaded_elsewhere_decodes_the_same(llama_dir, backend):
    """Swap a prefilled sequence out, load it into other blocks, in one batch's copies."""
    runner = make_runner(llama_dir, backend)
    request = Request("r", PROMPT, SamplingParams())
    logits(runner, SchedulerOutput([ScheduledChunk(request, 0, 10, [3, 7, 1])]))
    expected = logits(runner, SchedulerOutput([ScheduledChunk(request, 10, 1, [3, 7, 1])]))

    store = runner.host_store
    host = store.allocate("r", 3)
    device_slots = tuple(b * BLOCK + i for b in (3, 7, 1) for i in range(BLOCK))
    host_slots = tuple(s for b in host for s in store.slots(b))
    runner.execute(SchedulerOutput(kv_copies=[[KVCopy("save", device_slots, host_slots)]]))
    for k, v in runner.kv_caches:  # the old blocks are gone
        k[[3, 7, 1]] = float("nan")
        v[[3, 7, 1]] = float("nan")
    new_slots = tuple(b * BLOCK + i for b in (12, 0, 5) for i in range(BLOCK))
    runner.execute(SchedulerOutput(kv_copies=[[KVCopy("load", host_slots, new_slots)]]))
    restored = logits(runner, SchedulerOutput([ScheduledChunk(request, 10, 1, [12, 0, 5])]))
    assert torch.equal(restored, expected)
    store.free("r")
    store.check_invariants()
