"""Default sampling parameters from a model's `generation_config.json` (vLLM's
`--generation-config auto`, its default since v0.8).

A model's authors write the sampling they recommend there (Qwen3: temperature 0.6, top_p 0.95,
top_k 20); a request that leaves a parameter out gets theirs, then nanoserve's own default. As
in vLLM, only the sampling fields are taken (`do_sample` is not: a request's temperature says
whether it samples), and `max_new_tokens` becomes the default `max_tokens`.

    "auto"     the model's generation_config.json (no file: no defaults)
    "vllm"     nanoserve's own defaults only (vLLM's name for "ignore the file")
    <dir>      the generation_config.json in that directory
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# generation_config.json's name -> SamplingParams' name (vLLM's list).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str | Path, setting: str = "auto",
                      overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments a request's unset fields default to. `overrides` (vLLM's
    --override-generation-config) take precedence over the file, in either name."""
    if setting == "vllm":
        found: dict[str, Any] = {}
    else:
        path = Path(model_dir if setting == "auto" else setting) / "generation_config.json"
        if setting != "auto" and not path.is_file():
            raise ValueError(f"generation_config {setting!r}: no generation_config.json there")
        config = json.loads(path.read_text()) if path.is_file() else {}
        found = {ours: config[theirs] for theirs, ours in FIELDS.items() if config.get(theirs) is not None}
    for name, value in (overrides or {}).items():
        ours = FIELDS.get(name, name)
        if ours not in FIELDS.values():
            raise ValueError(f"override_generation_config: unknown sampling field {name!r} "
                             f"(known: {', '.join(FIELDS)})")
        found[ours] = value
    return found
