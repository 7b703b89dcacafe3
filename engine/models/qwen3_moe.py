"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and a sparse mixture-of-experts MLP
(engine/models/moe.py) in the layers config.json makes sparse: every decoder_sparse_step-th layer (1:
all) but those in mlp_only_layers, which keep a dense MLP of intermediate_size."""
from engine.errors import ConfigError
from engine.models.decoder import DecoderArch
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_type = "qwen3_moe"

    @classmethod
    def arch_options(cls, config: dict, where: str) -> dict:
        # the hub's configs say num_experts; transformers 5 saves num_local_experts
        experts = config.get("num_experts", config.get("num_local_experts", 0))
        top_k, inter = config.get("num_experts_per_tok", 0), config.get("moe_intermediate_size", 0)
        step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
        sizes = (experts, top_k, inter, step)
        if not (all(isinstance(n, int) for n in sizes) and 1 <= top_k <= experts and inter >= 1 and step >= 1):
            raise ConfigError(f"{where}: a mixture of experts needs 1 <= num_experts_per_tok <= num_experts, "
                              f"moe_intermediate_size >= 1 and decoder_sparse_step >= 1, got {top_k}, {experts}, "
                              f"{inter} and {step}")
        layers = tuple(i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        return {**super().arch_options(config, where), "moe_layers": layers, "num_experts": experts,
                "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
                "norm_topk_prob": config.get("norm_topk_prob", True)}

    @classmethod
    def config_options(cls, arch: DecoderArch) -> dict:
        dense = [i for i in range(arch.num_hidden_layers) if i not in arch.moe_layers]
        return {**super().config_options(arch), "num_experts": arch.num_experts,
                "num_experts_per_tok": arch.num_experts_per_tok, "moe_intermediate_size": arch.moe_intermediate_size,
                "norm_topk_prob": arch.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": dense}
