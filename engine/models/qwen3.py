"""Qwen3 (Qwen3-0.6B ... 32B dense): the decoder with QK-norm, a per-head RMSNorm of q and k before RoPE
(fused with it, and with the cache write, in ops.rope_and_write_kv_cache); biases on q/k/v/o only when
attention_bias is set."""
from engine.models.decoder import DecoderArch, DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    model_type = "qwen3"

    @classmethod
    def arch_options(cls, config: dict, where: str) -> dict:
        bias = config.get("attention_bias", False)
        return {"qk_norm": True, "qkv_bias": bias, "o_proj_bias": bias}

    @classmethod
    def config_options(cls, arch: DecoderArch) -> dict:
        return {"attention_bias": arch.qkv_bias}
