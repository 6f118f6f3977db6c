"""`EngineArgs` as command-line flags: what `nanoserve serve`, `nanoserve bench` and
`nanoserve profile` share. Each flag's default is read from `EngineArgs` (config.py), the one
place it is written; this module only names the flags and says what they do.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

from nanoserve.config import EngineArgs
from nanoserve.memory import KV_MANAGER_NAMES
from nanoserve.model.attention import ATTENTION_BACKENDS
from nanoserve.sched import SCHEDULERS
from nanoserve.slo import DEFAULT_SLOS, SLO, RequestClass

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)}

# (flags, EngineArgs field, type, "switch" (store_true) or "on-off" (--x / --no-x), help, choices);
# the default comes from the field.
_FLAGS: list[tuple[tuple[str, ...], str, Callable[[str], Any] | str, str, tuple[str, ...] | None]] = [
    (("--policy",), "policy", str, "scheduling policy (see nanoserve/sched/__init__.py)", tuple(sorted(SCHEDULERS))),
    (("--kv-manager",), "kv_manager", str, "KV memory manager (default: the policy's own; see "
                                           "nanoserve/memory/__init__.py)", tuple(sorted(KV_MANAGER_NAMES))),
    (("--enable-prefix-caching",), "enable_prefix_caching", "on-off",
     "share the cached K/V of prompt prefixes between requests (default: on where the KV manager supports it: "
     "paged, swap, checkpoint); --no-enable-prefix-caching turns it off", None),
    (("--prefix-cache-host-tokens",), "prefix_cache_host_tokens", int,
     "keep cached prefix blocks evicted from the device in this many tokens of host RAM, loaded back on a hit "
     "(paged KV manager; 0: off)", None),
    (("--download",), "download", "switch",
     "fetch a hub model id that is not in the local Hugging Face cache (also NANOSERVE_ALLOW_DOWNLOAD=1)", None),
    (("--cost-model",), "cost_model", str, "iteration cost model JSON from `nanoserve profile`", None),
    (("--dtype",), "dtype", str, "float32 | float16 | bfloat16 (default: per device)", None),
    (("--device",), "device", str, "cpu | cuda | cuda:N (default: cuda if available)", None),
    (("--kv-cache-tokens",), "kv_cache_tokens", int, "KV cache size in tokens (default on CUDA: what the weights "
                                                     "and a profiling forward leave under --gpu-memory-utilization)",
     None),
    (("--gpu-memory-utilization",), "gpu_memory_utilization", float,
     "share of the GPU's memory the engine may use: weights, activations and KV cache", None),
    (("--block-size",), "block_size", int, "tokens per KV block", None),
    (("--max-num-seqs",), "max_num_seqs", int, "requests one step may run", None),
    (("--max-num-batched-tokens",), "max_num_batched_tokens", int, "tokens one step may run (the token budget)",
     None),
    (("--max-model-len",), "max_model_len", int, "prompt + output tokens of one request (default: the model's)",
     None),
    (("--seed",), "seed", int, "the sampler's seed for requests without their own", None),
    (("--host-kv-tokens",), "host_kv_tokens", int, "host KV store size in tokens, for managers that checkpoint "
                                                   "or swap", None),
    (("--attention-backend",), "attention_backend", str, "attention kernels (default: triton on CUDA, torch on "
                                                         "CPU)", ATTENTION_BACKENDS),
    (("--preempt-every-layers",), "preempt_every_layers", int,
     "conserve: a pure-offline forward checks for an online arrival every k layers", None),
    (("--layerwise-kv-copies",), "layerwise_kv_copies", "switch",
     "stream each step's KV copies layer by layer; a forward waits per layer (BROS §4.1)", None),
    (("--tensor-parallel-size", "--tp"), "tensor_parallel_size", int,
     "shard the model over this many processes (under torchrun: the world size)", None),
    (("--pipeline-parallel-size", "--pp"), "pipeline_parallel_size", int,
     "split the layers into this many pipeline stages, one process (group) each", None),
    (("--async-pipeline",), "async_pipeline", "switch",
     "with --pp: keep one micro-batch per stage in flight across steps (fcfs, kunserve); with --instances N "
     "--drop: the same in a drop's pipeline groups", None),
    (("--async-scheduling",), "async_scheduling", "switch",
     "one device: schedule and prepare the next step while the device runs this one (fcfs)", None),
    (("--output-thread",), "output_thread", "on-off",
     "make outputs (detokenize, stop strings) on a thread of their own, off the engine's; "
     "--no-output-thread keeps them on the engine's thread", None),
    (("--enforce-eager",), "enforce_eager", "switch", "on a GPU: no CUDA graphs", None),
    (("--mixed-graphs",), "mixed_graphs", "switch",
     "on a GPU: CUDA graphs for steps that mix prompt chunks with decodes too", None),
    (("--reasoning-parser",), "reasoning_parser", str,
     "the model's reasoning format: split <think>...</think> into reasoning_content; structured outputs start "
     "after it", ("qwen3", "deepseek_r1")),
    (("--structured-outputs-backend",), "structured_outputs_backend", str,
     "the grammar library for structured outputs", ("llguidance",)),
    (("--chat-template",), "chat_template", str,
     "a chat template that replaces the model's: a Jinja file, or the template's text", None),
    (("--generation-config",), "generation_config", str,
     "default sampling: 'auto' (the model's generation_config.json), 'vllm' (nanoserve's own), or a directory",
     None),
    (("--override-generation-config",), "override_generation_config", json.loads,
     "JSON of default sampling fields that win over generation_config.json, e.g. '{\"temperature\": 0.5}'", None),
]


def add_engine_arguments(parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
    """The engine's flags on `parser`: the model (a positional argument or `--model`, one of
    them; default the embedded SmolLM2), every flag above, `--host-kv-gb` and the online class's
    SLO targets."""
    help_model = "HF model directory or cached hub id (default: the embedded SmolLM2-135M-Instruct)"
    if model_positional:
        parser.add_argument("model_arg", nargs="?", metavar="MODEL", help=help_model)
    else:
        parser.set_defaults(model_arg=None)
    parser.add_argument("--model", default=None, help=help_model)
    for flags, name, kind, help_text, choices in _FLAGS:
        if kind == "switch":
            parser.add_argument(*flags, dest=name, action="store_true", help=help_text)
        elif kind == "on-off":  # --flag / --no-flag, default None (the field's)
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=_DEFAULTS[name],
                                help=help_text)
        else:
            default = _DEFAULTS[name]
            shown = f" (default: {default})" if default is not None else ""
            parser.add_argument(*flags, dest=name, type=kind, default=default, choices=choices,
                                help=help_text + shown)
    parser.add_argument("--host-kv-gb", type=float, default=None,
                        help="the host KV store in GiB of host RAM (default: the device cache's tokens, at most a "
                             "quarter of RAM)")
    online = DEFAULT_SLOS[RequestClass.ONLINE]
    parser.add_argument("--online-ttft", type=float, default=online.ttft,
                        help=f"seconds to the first token an online request is promised (default: {online.ttft})")
    parser.add_argument("--online-tpot", type=float, default=online.tpot,
                        help=f"seconds per later output token an online request is promised (default: {online.tpot})")


def engine_args_from(namespace: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """The `EngineArgs` the flags of `add_engine_arguments` describe (`overrides` win)."""
    positional = namespace.model_arg
    if positional is not None and namespace.model is not None and positional != namespace.model:
        raise SystemExit(f"two models given: {positional!r} and --model {namespace.model!r}")
    values: dict[str, Any] = {name: getattr(namespace, name) for _, name, _, _, _ in _FLAGS}
    values["model"] = positional or namespace.model
    if namespace.host_kv_gb is not None:
        values["host_kv_bytes"] = int(namespace.host_kv_gb * 2**30)
    values["online_slo"] = SLO(ttft=namespace.online_ttft, tpot=namespace.online_tpot)
    return EngineArgs(**{**values, **overrides})
