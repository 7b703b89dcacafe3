"""Layers shared by the decoders: RMSNorm over the fused norm kernels, and PackedLinear, several
checkpoint projections of the same input computed as one matmul."""
import torch
from torch import nn

import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), one kernel (ops.rms_norm).
        With residual: (norm(x + residual), x + residual), the sum in the model dtype."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class PackedLinear(nn.Linear):
    """A Linear whose output rows are several projections side by side (q | k | v, gate | up): shard i
    is rows sum(output_sizes[:i]) .. sum(output_sizes[:i + 1]) of the weight and of the bias. The
    loader copies each checkpoint projection into its shard (a model's packed_modules_mapping says
    which shard), so nothing is inferred from shapes."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def shard(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of shard `index` of this layer's weight or bias (a view)."""
        return tensor.narrow(0, sum(self.output_sizes[:index]), self.output_sizes[index])
