"""The `nanoserve` command: its commands, the engine flags (each default read from EngineArgs),
and each command run once, small."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from nanoserve.cli import COMMANDS, build_parser, main
from nanoserve.config import EngineArgs
from nanoserve.slo import DEFAULT_SLOS, SLO, RequestClass


def test_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "nanoserve", "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "bench", "profile", "simulate"):
        assert command in out.stdout
    assert set(COMMANDS) == {"serve", "bench", "profile", "simulate"}


def _engine_args(argv: list[str]) -> EngineArgs:
    from nanoserve.engine_flags import engine_args_from

    return engine_args_from(build_parser("serve").parse_args(["serve", *argv]))


def test_the_flags_defaults_are_engine_args_defaults():
    args = _engine_args([])
    online = DEFAULT_SLOS[RequestClass.ONLINE]
    assert args == EngineArgs(online_slo=SLO(ttft=online.ttft, tpot=online.tpot))


def test_the_flags_set_engine_args():
    args = _engine_args(["/models/x", "--max-num-seqs", "7", "--tp", "2", "--policy", "conserve", "--host-kv-gb", "0.5",
                         "--online-ttft", "0.25", "--async-scheduling", "--kv-manager", "swap"])
    expected = {"model": "/models/x", "max_num_seqs": 7, "tensor_parallel_size": 2, "policy": "conserve",
                "host_kv_bytes": 2**29, "async_scheduling": True, "kv_manager": "swap"}
    assert {k: getattr(args, k) for k in expected} == expected
    assert args.online_slo == SLO(ttft=0.25, tpot=DEFAULT_SLOS[RequestClass.ONLINE].tpot)
    assert dataclasses.replace(args, **{k: getattr(EngineArgs(), k) for k in expected},
                               online_slo=None) == EngineArgs()  # nothing else moved


def test_two_different_models_are_refused():
    with pytest.raises(SystemExit):
        _engine_args(["/a", "--model", "/b"])
    assert _engine_args(["--model", "/b"]).model == "/b"


def test_an_unknown_policy_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--policy", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_simulate_prints_a_table_per_policy(capsys, tmp_path):
    out = tmp_path / "sim.json"
    assert main(["simulate", "fcfs", "priority", "--requests", "40", "--rate", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| fcfs |" in printed and "| priority |" in printed and "synthetic" in printed
    assert set(json.loads(out.read_text())["results"]) == {"fcfs", "priority"}


def test_bench_runs_a_configuration(tiny_llama_dir, capsys, tmp_path):
    out = tmp_path / "bench.json"
    main(["bench", str(tiny_llama_dir), "--device", "cpu", "--num-prompts", "3", "--input-len", "8",
          "--output-len", "4", "--kv-cache-tokens", "512", "--json", str(out)])
    assert "3 requests (8 in, 4 out)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["requests"] == 3 and result["output_tokens_per_s"] > 0
