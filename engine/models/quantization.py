"""FP8 weights: the checkpoint formats the loader reads, and FP8 rounding on load (model.quantization=fp8).

A checkpoint says its format in config.json's quantization_config (WeightFormat, from weight_format):
- quant_method "fp8" (Qwen's Qwen3-*-FP8, vLLM's Fp8Config): each quantized weight W [out, in] is stored
  in float8_e4m3fn with `<name>_scale_inv` float32 [ceil(out / bo), ceil(in / bi)] for weight_block_size
  [bo, bi]: W = q * scale over each bo x bi block (the last ones may be partial).
- quant_method "compressed-tensors", format float-quantized, 8-bit float weights (llm-compressor's FP8 and
  FP8_DYNAMIC): `<name>_scale` [out, 1] (strategy channel) or [1] (strategy tensor): W = q * scale per row.
Which weights are quantized is read from their dtype (a format's ignore list, lm_head for one, keeps bf16).
Activation scales (`input_scale`: static activation quantization) are not read.

model.quantization=fp8 rounds the decoder layers' projections of any weights to e4m3 on load, one scale per
output row (amax / 448: ops.quantize_rows_to_e4m3), as vLLM's quantization="fp8" does.

Where the device multiplies FP8 in hardware (fp8_gemms: CUDA of compute capability 8.9, Ada and Hopper, in
bfloat16) the projections of per-row formats (channel, tensor, model.quantization=fp8) stay in e4m3 with a
scale per output row (fp8_projections, then store_fp8) and run W8A8 (ops.fp8_matmul: activations rounded
per token; engine/models/layers.py's project); their norms fold apart
(RMSNorm.fold_into). Elsewhere, and for block-scaled checkpoints until a
block-scaled GEMM exists, the model computes with the dequantized weights (q * scale in float32, then the
norm fold and the cast to the run's dtype): an FP8 checkpoint runs as the model its FP8 weights round to.
"""
from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.kv_cache import FP8_CAPABILITY
from ops import quantize_rows_to_e4m3

ACTIVATION_SCALES = ("input_scale",)  # tensors of a format that the dequantized model does not use
ROUNDED_ELEMENTS = 1 << 20  # weights of a projection that model.quantization=fp8 rounds at a time (whole rows)


@dataclass(frozen=True)
class WeightFormat:
    """How a checkpoint's FP8 weights are scaled: strategy block (block = (rows, columns) per scale),
    channel (a scale per output row) or tensor (one scale); each weight's scale is the tensor named
    `<weight name>` + scale_suffix[len("weight"):], e.g. q_proj.weight -> q_proj.weight_scale_inv."""

    strategy: str
    scale_suffix: str
    block: tuple[int, int] | None = None

    def scale_name(self, weight_name: str) -> str:
        return weight_name.removesuffix("weight") + self.scale_suffix


def weight_format(config: dict, where: str) -> WeightFormat | None:
    """The WeightFormat of a config.json dict (None: no quantization_config); ConfigError naming
    quantization_config's key for a format the loader does not read."""
    spec = config.get("quantization_config")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ConfigError(f"{where}: quantization_config must be an object, got {spec!r}")
    method = spec.get("quant_method")
    if method == "fp8":
        block = spec.get("weight_block_size")
        if block is None:
            return WeightFormat("tensor", "weight_scale_inv")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b >= 1 for b in block)):
            raise ConfigError(f"{where}: quantization_config.weight_block_size must be [rows, columns] of positive "
                              f"integers, got {block!r}")
        return WeightFormat("block", "weight_scale_inv", tuple(block))
    if method == "compressed-tensors":
        return _compressed_tensors_format(spec, where)
    raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not read here (supported: 'fp8', "
                      f"and 'compressed-tensors' with FP8 weights)")


def _compressed_tensors_format(spec: dict, where: str) -> WeightFormat:
    groups = spec.get("config_groups") or {}
    schemes = [(name, group.get("weights") or {}) for name, group in groups.items()]
    if spec.get("format") not in (None, "float-quantized") or not schemes:
        raise ConfigError(f"{where}: quantization_config (compressed-tensors) format {spec.get('format')!r} is not "
                          f"read here: only FP8 weights (format float-quantized)")
    strategies = set()
    for name, weights in schemes:
        if weights.get("num_bits") != 8 or weights.get("type") != "float" or weights.get("strategy") not in ("channel", "tensor"):
            raise ConfigError(f"{where}: quantization_config.config_groups.{name}.weights {weights!r} is not read here: "
                              f"only 8-bit float weights with strategy channel or tensor")
        strategies.add(weights["strategy"])
    if len(strategies) > 1:
        raise ConfigError(f"{where}: quantization_config.config_groups mix weight strategies {sorted(strategies)}")
    return WeightFormat(strategies.pop(), "weight_scale")


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: WeightFormat, what: str) -> torch.Tensor:
    """weight (FP8, [out, in]) times its scale, in float32; ConfigError naming `what` (the scale tensor
    and its file) when the scale's shape does not fit the weight under fmt."""
    out, columns = weight.shape
    if fmt.strategy == "block":
        rows, cols = fmt.block
        expected = (-(-out // rows), -(-columns // cols))
        if tuple(scale.shape) != expected:
            raise ConfigError(f"{what} has shape {tuple(scale.shape)}; a {fmt.block} block scale of a "
                              f"{out} x {columns} weight has shape {expected}")
        scale = scale.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :columns]
    elif fmt.strategy == "channel":
        if scale.numel() != out or scale.dim() not in (1, 2) or scale.shape[0] != out:
            raise ConfigError(f"{what} has shape {tuple(scale.shape)}; a per-channel scale of a {out} x {columns} "
                              f"weight has shape ({out}, 1)")
        scale = scale.float().reshape(out, 1)
    else:
        if scale.numel() != 1:
            raise ConfigError(f"{what} has shape {tuple(scale.shape)}; a per-tensor scale has one element")
        scale = scale.float().reshape(1, 1)
    return weight.float() * scale


def round_projections_to_fp8(layer) -> None:
    """model.quantization=fp8: every projection of a decoder layer (the Linear modules inside it) becomes
    the dequantized value of its per-channel e4m3 quantization, in place, rows of ROUNDED_ELEMENTS weights at
    a time: the quantization's temporaries (three float32 copies of its input in Triton's interpreter, on the
    CPU) stay small beside the layer being built."""
    with torch.no_grad():
        for module in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
            for rows in module.weight.detach().split(max(1, ROUNDED_ELEMENTS // module.in_features)):
                q, scale = quantize_rows_to_e4m3(rows)
                rows.copy_(q).mul_(scale)


def fp8_gemms(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections stored in FP8 run as FP8 GEMMs on `device` for a model in `dtype` (bfloat16:
    torch._scaled_mm's row-wise scales give bfloat16 outputs only, on CUDA)."""
    return device.type == "cuda" and dtype == torch.bfloat16 and \
        torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def fp8_linears(layer) -> list[torch.nn.Linear]:
    """The Linear modules of a decoder layer whose sizes torch._scaled_mm takes (multiples of 16): those that
    fp8_projections rounds, and the loader's memory check counts in FP8."""
    return [m for m in layer.modules()
            if isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0]


def fp8_projections(layer) -> dict:
    """{projection: (q e4m3 [out, in], scale float32 [out])} of every Linear of fp8_linears(layer), from its
    weights as they are (float32, before the norm fold): quantize_rows_to_e4m3's, which gives back a per-row
    FP8 weight's own values."""
    projections = {}
    for module in fp8_linears(layer):
        q, scale = quantize_rows_to_e4m3(module.weight.detach())
        projections[module] = (q, scale.reshape(-1))
    return projections


def store_fp8(projections: dict) -> None:
    """Each projection's weight replaced by its FP8 q, its scale as the buffer weight_scale (after the cast to
    the run's dtype, which would widen them), on the device of the weight it replaces."""
    for module, (q, scale) in projections.items():
        device = module.weight.device
        module.weight = torch.nn.Parameter(q.to(device), requires_grad=False)
        module.register_buffer("weight_scale", scale.to(device))
