"""Llama (Llama 3, 3.1, 3.2; rope_type llama3 for the long-context ones): the plain decoder, without
QK-norm; biases on q/k/v/o when attention_bias is set, on the MLP when mlp_bias is."""
from engine.models.decoder import DecoderArch, DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    model_type = "llama"

    @classmethod
    def arch_options(cls, config: dict, where: str) -> dict:
        bias = config.get("attention_bias", False)
        return {"qkv_bias": bias, "o_proj_bias": bias, "mlp_bias": config.get("mlp_bias", False)}

    @classmethod
    def config_options(cls, arch: DecoderArch) -> dict:
        return {"attention_bias": arch.qkv_bias, "mlp_bias": arch.mlp_bias}
