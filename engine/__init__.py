"""MiniPaged: offline batch generation for Qwen3, Qwen2 and Llama 3 around a paged KV cache.

    from engine import LLM, SamplingParams      # the Python API (engine/llm.py)

The names below are imported when first used, so that `import engine.config` (and `python -m engine.run
--help`) does not load transformers. The engine never imports Hydra, OmegaConf or the batch
layer (jobs/).
"""
import importlib

_EXPORTS = {"LLM": "engine.llm", "Request": "engine.llm", "RequestOutput": "engine.outputs",
            "CompletionOutput": "engine.outputs", "Logprob": "engine.outputs",
            "SamplingParams": "engine.sequence",
            "StructuredOutputsParams": "engine.structured", "RequestError": "engine.errors"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
