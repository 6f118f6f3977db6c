"""nanoserve: a compact, readable LLM serving engine.

    from nanoserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)
"""
from nanoserve.llm import LLM
from nanoserve.outputs import RequestMetrics, RequestOutput
from nanoserve.sampling import SamplingParams
from nanoserve.slo import SLO


def default_model() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF directory, converted from its GGUF on first use."""
    # Imported here so that `python -m nanoserve.model.gguf` does not import itself twice.
    from nanoserve.model.gguf import default_model as convert_default

    return convert_default()


__all__ = ["LLM", "SamplingParams", "SLO", "RequestOutput", "RequestMetrics", "default_model"]
__version__ = "0.1.0"
