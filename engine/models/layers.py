"""Layers shared by the decoders: RMSNorm over the fused norm kernel (and its weight folded into a linear
layer), project (a linear layer's matmul, FP8 or not; project_scaled_by_reader, one whose FP8 scales the next
kernel applies), add_linear_ (a residual sum inside a matmul, which can round the sum for the FP8 projection
after it), and PackedLinear, several checkpoint projections of the same input computed as one matmul."""
import torch
from torch import nn

import ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor):
        """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), one kernel (ops.rms_norm)."""
        return ops.rms_norm(x, self.weight, self.eps)

    def fold_into(self, linear: nn.Linear, apart: bool = False) -> None:
        """Multiplies this norm's weight into the columns of the linear layer that reads the norm's output (W ->
        W * weight): linear(norm(x)) = linear'(x) * rsqrt(mean(x^2) + eps), plus the bias. apart: the
        linear's weight stays as it is (it goes to FP8 with a scale per row, which a scale per column would
        not fold into) and the norm's weight is kept beside it, as its input_weight, which its matmul
        multiplies into the activations (project). The norm is spent: its owner removes it."""
        if apart:
            linear.register_buffer("input_weight", self.weight.detach().clone())
        else:
            linear.weight.mul_(self.weight)


def is_fp8(module: nn.Module | None) -> bool:
    """Whether module is a linear layer whose weight is stored in FP8 (it runs W8A8: project)."""
    return isinstance(module, nn.Linear) and module.weight.dtype == torch.float8_e4m3fn


def project(x: torch.Tensor | ops.E4M3Rows, linear: nn.Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x @ linear's weight^T, without its bias: an FP8 weight (weight_scale per row, the input_weight of a
    norm folded apart) through ops.fp8_matmul (W8A8), which adds the product into residual, if given, in
    place, and takes x already rounded to e4m3 (ops.E4M3Rows, the kernel before's); else one matmul
    (residual: unused, see add_linear_)."""
    if not is_fp8(linear):
        return torch.nn.functional.linear(x, linear.weight)
    input_weight = getattr(linear, "input_weight", None)
    return ops.fp8_matmul(x, linear.weight, linear.weight_scale, input_weight, residual)


def project_scaled_by_reader(x: torch.Tensor, linear: nn.Linear,
                             x_e4m3: ops.E4M3Rows | None = None) -> tuple[torch.Tensor, tuple | None]:
    """project's product for a kernel that reads it elementwise (the RoPE and SiLU kernels: their scales=):
    (product, scales), where an FP8 weight's product of a few rows comes unscaled, float32, with its (row,
    column) scales for that kernel to apply, which saves a kernel (ops.fp8_product); else project's and None.
    x_e4m3: x's rows already rounded for this FP8 linear (add_linear_'s), used in x's place."""
    if not is_fp8(linear):
        return project(x, linear), None
    return ops.fp8_product(x if x_e4m3 is None else x_e4m3, linear.weight, linear.weight_scale,
                           getattr(linear, "input_weight", None))


def add_linear_(residual: torch.Tensor, x: torch.Tensor | ops.E4M3Rows, linear: nn.Linear, all_reduce=None,
                reader: nn.Module | None = None) -> ops.E4M3Rows | None:
    """residual += linear(x), in place: the matmul adds into residual as it writes (addmm's beta = 1), so
    the sum takes no kernel of its own (an FP8 weight's: project's residual, summed inside fp8_matmul's
    scaling kernel, or after a GEMM of more rows). all_reduce: a
    row-parallel linear's (engine/models/tensor_parallel.py): x @ W^T is this rank's partial sum, summed
    over the ranks before it joins residual. reader: the module that reads residual next. Where it and
    linear are FP8 and nothing comes between (no all_reduce, no bias), the kernel of the sum also rounds
    residual's rows for reader (ops.fp8_matmul's quantize_sum), and returns them (reader's x_e4m3), which saves
    reader's quantization kernel; else None."""
    if all_reduce is not None:
        partial = project(x, linear)
        all_reduce(partial)
        residual.add_(partial)
    elif is_fp8(linear) and linear.bias is None and is_fp8(reader):
        return ops.fp8_matmul(x, linear.weight, linear.weight_scale, getattr(linear, "input_weight", None), residual,
                              quantize_sum=True, sum_input_weight=getattr(reader, "input_weight", None))[1]
    elif is_fp8(linear):
        project(x, linear, residual)
    else:
        residual.addmm_(x, linear.weight.t())
    if linear.bias is not None:
        residual.add_(linear.bias)
    return None


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

    def shards(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.shard(tensor, index) for index in range(len(self.output_sizes)))
