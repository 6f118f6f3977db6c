"""KunServe's cluster under torchrun (nanoserve/cluster/torchrun_instances.py): two torchrun
"nodes" on this machine, one instance a rank, rank 0 the front and the HTTP server
(`torchrun --nnodes 2 --node-rank R ... -m nanoserve serve --instances 2 --drop`).

Rank 1 finds the front through torchrun's store and serves over the control channel; a burst
into pools of 8 blocks (eight prompts in one call) throttles both instances, so they drop layers and serve as a pipeline
across the two ranks (activations and KV over their gloo world). Greedy answers must be a single
engine's (near ties aside, as tests/test_server_cluster.py), and a SIGTERM to rank 0 must stop
rank 1 too: both torchrun agents exit 0.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch.distributed as dist
from conftest import build_tiny_model, write_byte_tokenizer
from serve_process import free_port
from server_fixtures import live_server, near_tie_equal

from nanoserve.cli import main
from nanoserve.cluster.torchrun_instances import HOST_ENV, advertised_host

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 16
POOL_TOKENS = 8 * BLOCK  # per instance: also the longest request (prompt + max_tokens)
ENGINE = dict(dtype="float32", block_size=BLOCK, kv_cache_tokens=POOL_TOKENS, max_model_len=POOL_TOKENS)
DEADLINE_S = 150  # hang guards, not speed assertions
BODY = dict(max_tokens=20, ignore_eos=True, logprobs=5, temperature=0)


def torchrun_available() -> bool:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("torchrun-cluster-llama")
    build_tiny_model("llama", directory, vocab_size=259)  # write_byte_tokenizer's 256 bytes and 3 specials
    write_byte_tokenizer(directory)
    return directory


def child_pids(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if match and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or "")).items():
            return float(match.group(2))
    return None


def complete(url: str, prompt: list[int] | list[list[int]]) -> dict:
    reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, **BODY}, timeout=DEADLINE_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.slow
@pytest.mark.skipif(not torchrun_available() or not Path("/proc/self/stat").exists(),
                    reason="needs torchrun (torch.distributed with gloo) and Linux's /proc")
def test_two_torchrun_nodes_serve_as_one_engine_and_drop_across_ranks(model_dir, tmp_path):
    prompts = [[20 + i] * 40 for i in range(8)]  # four a pool of 8 blocks, 4 blocks each: throttled
    with live_server(model=str(model_dir), **ENGINE) as single:
        refs = [complete(single.url, p)["choices"][0]["logprobs"] for p in prompts]

    port, master_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop(HOST_ENV, None)
    flags = ["--model", str(model_dir), "--instances", "2", "--drop", "--device", "cpu", "--port", str(port),
             "--no-request-log", "--log-stats-interval", "0",
             *(f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items())]
    logs = [tmp_path / f"node{r}.log" for r in (0, 1)]
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
                                "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                                str(master_port), "-m", "nanoserve", "serve", *flags],
                               cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
              for r, log in zip((0, 1), logs)]

    def tails() -> str:
        return "\n".join(f"--- node {r}:\n{log.read_text(errors='replace')[-2500:]}" for r, log in enumerate(logs))

    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + DEADLINE_S
        while True:
            assert all(a.poll() is None for a in agents), f"a torchrun node exited:\n{tails()}"
            assert time.monotonic() < deadline, f"the cluster did not come up:\n{tails()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        # One at a time (no throttling), then the burst (a drop across the two ranks).
        for prompt, ref in zip(prompts[:2], refs):
            out = complete(url, prompt)["choices"][0]["logprobs"]
            assert out["tokens"] == ref["tokens"], prompt[0]
        burst = complete(url, prompts)  # one call: every prompt arrives in the same step
        assert burst["usage"]["completion_tokens"] == len(prompts) * BODY["max_tokens"]
        outs = {choice["index"]: choice["logprobs"] for choice in burst["choices"]}
        for i, (prompt, ref) in enumerate(zip(prompts, refs)):
            assert near_tie_equal(ref, outs[i]), prompt[0]
        text = httpx.get(url + "/metrics", timeout=30).text
        assert metric(text, "nanoserve_cluster_instances") == 2
        assert metric(text, "nanoserve_cluster_layout_changes_total", kind="drop") >= 1, tails()
        for instance in ("0", "1"):
            assert metric(text, "nanoserve_cluster_instance_kv_blocks_total", instance=instance) >= 8

        # SIGTERM to rank 0 (the server, not its agent): it drains, stops the instances, and
        # both nodes end cleanly (torchrun's exit barrier needs both).
        (rank0,) = child_pids(agents[0].pid)  # the agent's worker
        os.kill(rank0, signal.SIGTERM)
        codes = [a.wait(60) for a in agents]
        assert codes == [0, 0], f"exit codes {codes}:\n{tails()}"
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait(30)


def test_instances_must_match_the_torchrun_world(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match=r"--instances 3 needs 3 ranks .* this world has 2"):
        main(["serve", "--model", "/nonexistent", "--instances", "3"])


def test_rank_0_advertises_the_address_the_other_nodes_reach_it_at(monkeypatch):
    monkeypatch.delenv(HOST_ENV, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert advertised_host() == "127.0.0.1"  # every node reached the rendezvous over loopback
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert advertised_host() == "localhost"  # a name of this machine: the other nodes use it too
    monkeypatch.setenv(HOST_ENV, "10.1.2.3")
    assert advertised_host() == "10.1.2.3"
