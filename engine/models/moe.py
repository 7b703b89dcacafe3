"""A mixture-of-experts MLP (Qwen3-MoE's sparse block): a router picks num_experts_per_tok of num_experts
SwiGLU experts per token (ops.moe_route), their outputs are weighted and summed into the residual stream
(ops.moe_experts: on CUDA two grouped GEMMs over the pairs sorted by expert, ops/moe.py).

The experts' weights are stacked, as transformers holds them: experts.gate_up_proj [E, 2I, H] (expert e's
gate rows, then its up rows) and experts.down_proj [E, H, I]; a checkpoint's per-expert tensors
(mlp.experts.<e>.{gate,up,down}_proj.weight) each go into their shard (e, part) through
DecoderForCausalLM.expert_modules_mapping. The layer's post-attention RMSNorm feeds both the router and
the experts, so its weight is kept here (input_weight, fold_norm) rather than folded into a projection.
"""
import torch
from torch import nn

import ops


class StackedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def shard_ids(self, leaf: str) -> list[tuple[int, int | None]]:
        """The shards (expert, part) a checkpoint fills of parameter `leaf`: gate (0) and up (1) of each
        expert's gate_up_proj, each expert's whole down_proj (None)."""
        parts = (0, 1) if leaf == "gate_up_proj" else (None,)
        return [(e, part) for e in range(self.gate_up_proj.shape[0]) for part in parts]

    def shard(self, tensor: torch.Tensor, index: tuple[int, int | None]) -> torch.Tensor:
        """Shard (expert, part) of gate_up_proj or down_proj (a view)."""
        expert, part = index
        rows = tensor[expert]
        return rows if part is None else rows.narrow(0, part * self.intermediate_size, self.intermediate_size)


class SparseMoeMLP(nn.Module):
    def __init__(self, arch):
        super().__init__()
        self.top_k, self.renormalize = arch.num_experts_per_tok, arch.norm_topk_prob
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router
        self.experts = StackedExperts(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size)

    def add_to(self, hidden, input_norm_eps, all_reduce=None, hidden_e4m3=None, reader=None):
        """hidden += the routed experts' sum of the RMSNorm of hidden, in place; all_reduce: tensor
        parallelism's, which sums the ranks' partial sums (each holds a slice of every expert's width).
        DecoderMLP.add_to's other arguments are unused: the router reads hidden itself (this module is no FP8
        linear, so none comes rounded), and the sum rounds nothing for the next layer (returns None)."""
        normed = ops.rms_norm(hidden, self.input_weight, input_norm_eps)
        weights, ids = ops.moe_route(self.gate(normed), self.top_k, self.renormalize)
        routed = ops.moe_experts(normed, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if all_reduce is not None:
            all_reduce(routed)
        hidden.add_(routed)

    def compile_launches(self, max_tokens: int) -> int:
        """Compile the experts' launches for steps of up to max_tokens tokens (ops.moe_compile_launches)."""
        return ops.moe_compile_launches(self.experts.gate_up_proj, self.experts.down_proj, self.top_k, max_tokens)

    def fold_norm(self, norm, apart=frozenset()) -> None:
        """Keep the post-attention norm's weight (the router and the experts both read its output)."""
        self.register_buffer("input_weight", norm.weight.detach().clone())

    @property
    def norm_reader(self) -> nn.Module:
        """The module holding the folded norm's weight as input_weight (loader.unpacked_state_dict)."""
        return self
