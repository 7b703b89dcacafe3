"""Qwen2 and Qwen2.5: the decoder with biases on the q, k and v projections (not on o_proj), no QK-norm."""
from engine.models.decoder import DecoderForCausalLM


class Qwen2ForCausalLM(DecoderForCausalLM):
    model_type = "qwen2"

    @classmethod
    def arch_options(cls, config: dict, where: str) -> dict:
        return {"qkv_bias": True}
