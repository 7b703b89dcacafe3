"""Which model runs a checkpoint, keyed by the `architectures` entry of its config.json (transformers'
class name). A new architecture is a file in engine/models/ and its class in MODELS."""
from engine.errors import ConfigError
from engine.models.decoder import DecoderForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[DecoderForCausalLM]] = {
    cls.__name__: cls for cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)}


def model_class(config: dict, where: str) -> type[DecoderForCausalLM]:
    """The class of a config.json dict: its first `architectures` entry in MODELS, or, without
    `architectures`, the one of its model_type. ConfigError, prefixed with `where`, naming the
    architecture and the supported ones, otherwise."""
    names = config.get("architectures") or []
    names = [names] if isinstance(names, str) else names
    known = [MODELS[name] for name in names if isinstance(name, str) and name in MODELS]
    if known:
        return known[0]
    if names:
        what = f"architecture {' / '.join(map(repr, names))}"
    else:
        by_type = {cls.model_type: cls for cls in MODELS.values()}
        model_type = config.get("model_type")
        if isinstance(model_type, str) and model_type in by_type:
            return by_type[model_type]
        what = f"model_type {config.get('model_type')!r} (and no architectures)"
    raise ConfigError(f"{where}: {what} is not supported (supported architectures: {', '.join(MODELS)})")
