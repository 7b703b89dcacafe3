"""Qwen2 and Qwen2.5: the decoder with biases on the q, k and v projections (not on o_proj), no QK-norm.
Sliding-window attention (use_sliding_window) is not supported: the released models leave it off."""
from engine.config import ConfigError
from engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    model_type = "qwen2"

    @classmethod
    def arch_options(cls, config: dict, where: str) -> dict:
        if config.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window is not supported (paged attention here is full attention)")
        return {"qkv_bias": True}
