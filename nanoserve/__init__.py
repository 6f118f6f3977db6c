"""nanoserve: a compact, readable LLM serving engine.

    from nanoserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)

`import nanoserve` stays light: `LLM` (which brings torch and the model code) is imported on
first use, so a tool that needs only the parameter types, the scheduler or the simulator does
not load the engine.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nanoserve.outputs import RequestMetrics, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.slo import SLO

if TYPE_CHECKING:
    from nanoserve.llm import LLM


def __getattr__(name: str) -> Any:
    """PEP 562's lazy attribute: `nanoserve.LLM` imports the engine on first use."""
    if name == "LLM":
        from nanoserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'nanoserve' has no attribute {name!r}")


def default_model() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF directory, converted from its GGUF on first use."""
    # Imported here so that `python -m nanoserve.model.gguf` does not import itself twice.
    from nanoserve.model.gguf import default_model as convert_default

    return convert_default()


__all__ = ["LLM", "SamplingParams", "SLO", "RequestOutput", "RequestMetrics", "default_model"]
__version__ = "0.1.0"
