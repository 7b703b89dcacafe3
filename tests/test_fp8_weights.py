"""FP8 weights (engine/models/quantization.py): checkpoints in Qwen's block-scaled format and in
compressed-tensors' per-channel format, and model.quantization=fp8, against transformers running the
weights they round to in float32.

The checkpoints are written here from the session's tiny Qwen3: each projection of its layers quantized to
e4m3 by this file's own rounding (block or row scales = amax / 448), with the scale tensors each format
names. The oracle is transformers' greedy generate with every such weight replaced by q * scale (the
product of an e4m3 value and a float32 scale is exact in float64, so its float32 rounding is the loader's
float32 product); the engine loads the FP8 files and must give the same tokens."""
import importlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import ops
from engine.errors import ConfigError
from engine.llm import LLM, SamplingParams
from test_oracle import MAX_TOKENS, reference_outputs

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = (32, 40)  # not a divisor of the tiny model's sizes (96, 48, 192): partial blocks at the edges
QWEN_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
COMPRESSED_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {"targets": ["Linear"],
                                  "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                              "dynamic": False},
                                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                        "dynamic": True}}}}


def block_quantized(weight: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale float32 [ceil(out / rows), ceil(in / cols)]), block by block, in float64."""
    out, columns = weight.shape
    scale = torch.zeros(-(-out // rows), -(-columns // cols), dtype=torch.float64)
    q = torch.zeros(out, columns, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].double()
            scale[i, j] = block.abs().max() / 448
            q[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = (block / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale.float()


def block_dequantized(q: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    expanded = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            expanded[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = scale[i, j].double()
    return (q.double() * expanded).float()


def row_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q e4m3, scale float32 [out, 1]): one scale per row."""
    scale = (weight.double().abs().amax(dim=1, keepdim=True) / 448).float()
    return (weight.double() / scale.double()).to(torch.float8_e4m3fn), scale


def fp8_checkpoint(base, directory, quantization_config: dict, quantize, dequantize):
    """base's checkpoint with its projections in FP8 (quantize: weight -> (q, scale)), its config.json
    carrying quantization_config; returns (directory, transformers' model on the rounded weights)."""
    path, hf_model = base
    shutil.copytree(path, directory)
    state = {k: v.clone() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    rounded = dict(state)
    suffix = "weight_scale_inv" if quantization_config["quant_method"] == "fp8" else "weight_scale"
    for name in [k for k in state if k.endswith("weight") and k.split(".")[-2] in PROJECTIONS]:
        q, scale = quantize(state[name])
        state[name], state[name.removesuffix("weight") + suffix] = q, scale
        rounded[name] = dequantize(q, scale)
    for file in directory.glob("*.safetensors"):
        file.unlink()
    save_file(state, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return directory, rounded_model(hf_model, rounded)


def rounded_model(hf_model, weights: dict):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(hf_model.config).eval()
    model.load_state_dict(weights, strict=False)  # lm_head is tied to the embedding
    return model


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 6, 19, 33)]


def engine_tokens(path, prompts, **options) -> list[list[int]]:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=4, **options)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def check_greedy_matches(path, rounded, prompts, original, **options):
    expected, gap = reference_outputs(rounded, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    assert expected != reference_outputs(original, prompts)[0], "FP8 rounding changed no token: a weak oracle"
    assert engine_tokens(path, prompts, **options) == expected


def test_qwen_block_scaled_fp8_checkpoint_matches_transformers_on_its_weights(qwen3_checkpoint, tmp_path, prompts):
    path, rounded = fp8_checkpoint(qwen3_checkpoint, tmp_path / "fp8", QWEN_FP8, lambda w: block_quantized(w, *BLOCK),
                                   lambda q, s: block_dequantized(q, s, *BLOCK))
    check_greedy_matches(path, rounded, prompts, qwen3_checkpoint[1])


def test_compressed_tensors_per_channel_checkpoint_matches_transformers_on_its_weights(qwen3_checkpoint, tmp_path,
                                                                                        prompts):
    path, rounded = fp8_checkpoint(qwen3_checkpoint, tmp_path / "ct", COMPRESSED_FP8, row_quantized,
                                   lambda q, s: (q.double() * s.double()).float())
    check_greedy_matches(path, rounded, prompts, qwen3_checkpoint[1])


def test_quantization_fp8_rounds_the_projections_on_load(qwen3_checkpoint, prompts):
    path, hf_model = qwen3_checkpoint
    weights = dict(hf_model.state_dict())
    for name in [k for k in weights if k.endswith("weight") and k.split(".")[-2] in PROJECTIONS]:
        q, scale = row_quantized(weights[name])
        weights[name] = (q.double() * scale.double()).float()
    check_greedy_matches(path, rounded_model(hf_model, weights), prompts, hf_model, quantization="fp8")


def test_random_weights_take_quantization_fp8():
    plain = LLM(model="tiny", device="cpu", max_model_len=64)
    fp8 = LLM(model="tiny", device="cpu", max_model_len=64, quantization="fp8")
    for ours, theirs in zip(plain.hf_model().model.layers, fp8.hf_model().model.layers):
        weight, rounded = ours.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight
        q, scale = row_quantized(weight)
        assert torch.equal(rounded, (q.double() * scale.double()).float()) and not torch.equal(rounded, weight)


@pytest.mark.parametrize("damage, message", [
    (lambda cfg, state: cfg.update(quantization_config={"quant_method": "awq"}),
     r"quantization_config.quant_method 'awq' is not read here"),
    (lambda cfg, state: state.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2)}),
     r"holds model.layers.0.self_attn.q_proj.weight_scale_inv, which has shape \(2, 2\); a \(32, 40\) block scale "
     r"of a 96 x 96 weight has shape \(3, 3\)"),
    (lambda cfg, state: state.pop("model.layers.1.mlp.down_proj.weight_scale_inv"),
     r"holds model.layers.1.mlp.down_proj.weight in torch.float8_e4m3fn without its scale "
     r"model.layers.1.mlp.down_proj.weight_scale_inv"),
    (lambda cfg, state: cfg.pop("quantization_config"), r"holds model.layers.0.* in torch.float8_e4m3fn, but config.json "
                                                        r"has no quantization_config"),
    (lambda cfg, state: cfg.update(quantization_config={**QWEN_FP8, "weight_block_size": [128]}),
     r"quantization_config.weight_block_size must be \[rows, columns\]"),
])
def test_a_broken_fp8_checkpoint_is_named(qwen3_checkpoint, tmp_path, prompts, damage, message):
    path, _ = fp8_checkpoint(qwen3_checkpoint, tmp_path / "fp8", QWEN_FP8, lambda w: block_quantized(w, *BLOCK),
                             lambda q, s: block_dequantized(q, s, *BLOCK))
    state, config = load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())
    damage(config, state)
    save_file(state, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu")


def test_an_unknown_quantization_is_named():
    with pytest.raises(ConfigError, match=r"model.quantization must be null or one of \(.fp8.,\), got .int4."):
        LLM(model="tiny", device="cpu", quantization="int4")


# -- FP8 GEMMs (W8A8: e4m3 weights with a scale per row, activations quantized per token) ----------------
def cpu_has_row_scaled_fp8_gemms() -> bool:
    """Whether this torch's torch._scaled_mm takes a scale per row on the CPU (2.13 does; 2.11 only one scale
    per tensor there)."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


FP8_GEMM_DEVICES = [pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_has_row_scaled_fp8_gemms(), reason="this torch's CPU _scaled_mm takes one scale per tensor only"))] + (
    ["cuda"] if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9) else [])


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
@pytest.mark.parametrize("with_residual", [False, True])
# 7: unit scales then scale_product; 136: that with a residual, else row-wise scales, padded to 256 rows on CUDA
# (ops.SCALED_MM_PADDED); 300: row-wise scales (ops.UNIT_SCALE_ROWS, UNIT_SCALE_ROWS_WITH_RESIDUAL)
@pytest.mark.parametrize("rows", [7, 136, 300])
def test_fp8_matmul_is_the_float64_product_of_its_quantized_operands(device, with_residual, rows):
    """ops.fp8_matmul against its contract computed here in float64: x' = x * input_weight, per-row scale
    amax / 448, the e4m3 rounding of x' / scale, then the product of the dequantized operands (float32 on
    the CPU; bfloat16 on CUDA, where torch._scaled_mm's row-wise scales give bfloat16 only), added into the
    residual in place when one is given."""
    generator = torch.Generator().manual_seed(11)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, weight = (torch.randn(rows, 96, generator=generator) * 3).to(dtype), torch.randn(64, 96, generator=generator) / 10
    x[3] = 0  # an all-zero row: scale 1
    norm_weight = torch.rand(96, generator=generator) + 0.5
    residual = torch.randn(rows, 64, generator=generator).to(dtype)
    q_w, w_scale = row_quantized(weight)
    summed = residual.clone().to(device) if with_residual else None
    out = ops.fp8_matmul(x.to(device), q_w.to(device), w_scale.reshape(-1).to(device), norm_weight.to(device), summed)
    assert out is summed or not with_residual
    scaled = x.double() * norm_weight.double()
    x_scale = scaled.abs().amax(dim=1, keepdim=True) / 448
    x_scale[x_scale == 0] = 1
    q_x = (scaled / x_scale).to(torch.float8_e4m3fn)
    expected = (q_x.double() * x_scale) @ (q_w.double() * w_scale.double()).T
    expected = expected + residual.double() if with_residual else expected
    out = out.cpu()
    assert out.dtype == x.dtype and out.shape == (rows, 64)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # the output's rounding (and the residual's)
    assert torch.allclose(out.double(), expected, rtol=tolerance, atol=tolerance)
    unrounded = scaled @ weight.double().T + (residual.double() if with_residual else 0)
    assert not torch.allclose(out.double(), unrounded, rtol=1e-3)  # FP8 rounding shows
    assert ops.fp8_matmul(x[:0].to(device), q_w.to(device), w_scale.reshape(-1).to(device)).shape == (0, 64)


@pytest.mark.skipif(len(FP8_GEMM_DEVICES) == 1, reason="needs CUDA of compute capability 8.9 (FP8 GEMMs)")
@pytest.mark.parametrize("inner", [1024, 4096, 12288])
def test_fast_accumulation_stays_near_the_float64_product(inner):
    """The row-scaled path's fast accumulation (ops.FAST_ACCUMULATION) over the inner sizes of Qwen3-8B's
    projections: the relative error of the whole product against float64 of the dequantized operands stays
    within the bfloat16 output's own rounding (2^-8) and each element within 2% of the product's scale."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(300, inner, generator=generator).to(torch.bfloat16)
    q_w, w_scale = row_quantized(torch.randn(256, inner, generator=generator) / inner ** 0.5)
    out = ops.fp8_matmul(x.cuda(), q_w.cuda(), w_scale.reshape(-1).cuda()).cpu().double()
    x_scale = x.double().abs().amax(dim=1, keepdim=True) / 448
    expected = ((x.double() / x_scale).to(torch.float8_e4m3fn).double() * x_scale) @ (q_w.double() * w_scale.double()).T
    assert (out - expected).norm() / expected.norm() < 2 ** -8
    assert (out - expected).abs().max() < 0.02 * expected.abs().max()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rows, cols", [(1, 40), (5, 2500), (0, 16)])
def test_scale_product_scales_rows_and_columns_in_one_rounding(backend, rows, cols):
    """ops.fp8_gemm's scale_product (the scales of fp8_matmul's unit-scale product) against the float64 formula
    raw * row_scale * col_scale, rounded once to the output dtype; with a residual, that added into it in place
    (bfloat16: within one rounding of the float64 sum). Columns past one program's tile, one row and none."""
    generator = torch.Generator().manual_seed(rows * cols + 3)
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    raw = torch.randn(rows, cols, generator=generator) * 1e4
    row_scale, col_scale = torch.rand(rows, 1, generator=generator) / 100, torch.rand(cols, generator=generator) / 50
    residual = torch.randn(rows, cols, generator=generator).to(torch.bfloat16)
    family = importlib.import_module("ops.fp8_gemm" if backend == "triton" else "ops.fp8_gemm_reference")
    expected = raw.double() * row_scale.double() * col_scale.double()
    on = lambda t: t.to(device)  # noqa: E731
    out = family.scale_product(on(raw), on(row_scale), on(col_scale), None, torch.float32).cpu()
    assert out.dtype == torch.float32 and torch.allclose(out.double(), expected, rtol=1e-6, atol=1e-6)
    summed = on(residual.clone())
    assert family.scale_product(on(raw), on(row_scale), on(col_scale), summed, torch.bfloat16) is summed
    total = expected + residual.double()
    # one rounding to bfloat16: half its step, or a whole one where Triton's interpreter truncates (3.9)
    step = 2 ** -7 if backend == "triton" and device == "cpu" else 2 ** -8
    assert torch.allclose(summed.cpu().double(), total, rtol=step, atol=1e-6)
    assert not torch.allclose(summed.cpu().double(), expected, rtol=step, atol=1e-6) or rows == 0


def test_fp8_matmul_names_a_residual_that_does_not_fit():
    q_w, w_scale = row_quantized(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"residual must be \[3, 8\] in torch.float32, got \(3, 9\)"):
        ops.fp8_matmul(torch.randn(3, 16), q_w, w_scale.reshape(-1), residual=torch.zeros(3, 9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's interpreter rounds float32 to e4m3 wrongly where "
                    "the rounding carries into the exponent (tests/test_fused.py)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, cols", [(1, 7), (9, 4096), (3, 12288), (0, 64)])
def test_triton_quantize_rows_is_the_reference_bit_for_bit(dtype, rows, cols):
    """The activations' quantization kernel against the torch reference (float32 math, one division, e4m3 to
    nearest): the same bytes and scales, with and without a folded norm's weight, a zero row included."""
    generator = torch.Generator().manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=generator) * 40).to(dtype).cuda()
    if rows > 2:
        x[2] = 0
    weight = (torch.rand(cols, generator=generator) + 0.5).to(dtype).cuda()
    for w in (None, weight):
        q, scale = ops.quantize_rows_to_e4m3(x, w, backend="triton")
        q_ref, scale_ref = ops.quantize_rows_to_e4m3(x, w, backend="torch")
        assert torch.equal(scale, scale_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter rounds float32 to e4m3 wrongly (tests/test_fused.py)"))])
def test_quantize_rows_pads_to_the_rows_asked(backend):
    """rows beyond x's: q and scale get that many rows and their first R are the unpadded call's, the
    float64 formula's (amax / 448, e4m3 of x / scale) as in test_fp8_matmul; fewer rows than x's is refused."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(5, 48, generator=generator) * 9
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, scale = ops.quantize_rows_to_e4m3(x.to(device), rows=8, backend=backend)
    assert q.shape == (8, 48) and scale.shape == (8, 1)
    expected_scale = x.double().abs().amax(dim=1, keepdim=True) / 448
    assert torch.allclose(scale[:5].cpu().double(), expected_scale, rtol=1e-6)
    dequantized = q[:5].cpu().double() * scale[:5].cpu().double()
    assert torch.allclose(dequantized, x.double(), rtol=2 ** -3, atol=expected_scale.max().item() * 2 ** -6)
    with pytest.raises(ValueError, match="rows must be at least x's 5, got 4"):
        ops.quantize_rows_to_e4m3(x, rows=4, backend=backend)


def is_e4m3_of_rows(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether (q, scale) is quantize_rows_to_e4m3's formula of x's rows, in float64: scale = amax / 448 (1 for a
    zero row) to float32's precision, and q * scale within half an e4m3 step of x (3 mantissa bits: 2^-4 of
    the value; 2^-10 of the scale for the subnormals)."""
    x = x.double()
    expected_scale = x.abs().amax(dim=1, keepdim=True) / 448
    expected_scale[expected_scale == 0] = 1
    q, scale = q.cpu().double(), scale.cpu().double()
    return torch.allclose(scale, expected_scale, rtol=1e-6, atol=0) and \
        bool(((q * scale - x).abs() <= 2 ** -4 * x.abs() + 2 ** -10 * scale).all())


def same_e4m3(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether two (q, scale) pairs hold the same bytes and scales."""
    return torch.equal(a[0].cpu().view(torch.uint8), b[0].cpu().view(torch.uint8)) and torch.equal(a[1].cpu(), b[1].cpu())


GPU_TRITON = pytest.param("triton", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=(
    "Triton's interpreter rounds float32 to e4m3 wrongly (tests/test_fused.py); the GPU runs this case")))


@pytest.mark.parametrize("backend", ["torch", GPU_TRITON])
@pytest.mark.parametrize("rows, cols, scaled, weighted", [(1, 40, False, True), (5, 5000, True, True),
                                                          (3, 9000, False, False), (0, 16, True, True)])
def test_add_and_quantize_rows_is_the_sum_then_its_quantization(backend, rows, cols, scaled, weighted):
    """ops/fused's add_and_quantize_rows (an FP8 projection's sum into the residual stream, its rows then
    rounded for the next FP8 projection): the residual is the sum rounded once (float64 formula, one rounding
    to bfloat16), q and scale are the float64 quantization of that stored sum times the weight; and the
    Triton kernel gives the bytes of the two kernels it replaces (scale_product or the sum, then
    quantize_rows_to_e4m3). Rows longer than one tile (4,096: the kernel reads its own sums back), none."""
    generator = torch.Generator().manual_seed(rows * cols + 1)
    device = "cuda" if backend == "triton" else "cpu"
    residual = (torch.randn(rows, cols, generator=generator) * 4).to(torch.bfloat16)
    if rows > 2:
        residual[2] = 0  # with a zero product below: an all-zero row, scale 1
    product = torch.randn(rows, cols, generator=generator) * (1e3 if scaled else 3)
    product[2:3] = 0
    scales = (torch.rand(rows, 1, generator=generator) / 100, torch.rand(cols, generator=generator) / 50) if scaled else None
    weight = torch.rand(cols, generator=generator) + 0.5 if weighted else None
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    product = product if scaled else product.to(torch.bfloat16)
    family = importlib.import_module("ops.fused" if backend == "triton" else "ops.fused_reference")
    summed = on(residual.clone())
    q, scale = family.add_and_quantize_rows(summed, on(product), scales and tuple(map(on, scales)), on(weight), rows + 3)
    assert q.shape == (rows + 3, cols) and scale.shape == (rows + 3, 1)
    addend = product.double() * (scales[0].double() * scales[1].double() if scaled else 1)
    total = addend + residual.double()
    assert torch.allclose(summed.cpu().double(), total, rtol=2 ** -8, atol=1e-6)
    stored = summed.cpu().double() * (weight.double() if weighted else 1)
    assert is_e4m3_of_rows(q[:rows], scale[:rows], stored)
    if backend == "triton":
        unfused = on(residual.clone())
        if scaled:
            importlib.import_module("ops.fp8_gemm").scale_product(on(product), *map(on, scales), unfused)
        else:
            unfused.add_(on(product))
        assert torch.equal(summed, unfused)
        assert same_e4m3((q[:rows], scale[:rows]), ops.quantize_rows_to_e4m3(unfused, on(weight), backend="triton"))


@pytest.mark.parametrize("backend", ["torch", GPU_TRITON])
@pytest.mark.parametrize("rows, inter, scaled", [(1, 24, False), (6, 5000, True), (0, 8, False)])
def test_silu_and_mul_to_e4m3_is_its_product_quantized(backend, rows, inter, scaled):
    """ops.silu_and_mul(..., to_e4m3=True) (an FP8 down_proj's input, rounded in the SiLU's kernel): E4M3Rows
    whose first rows are the float64 quantization of the product it returns without to_e4m3 (that product is
    checked against float64 in tests/test_fused.py), its count and dtype; on the GPU the same bytes as
    that product's quantize_rows_to_e4m3 (the kernel it saves), the rows of a long row in several tiles, with
    a folded input norm and deferred FP8 scales."""
    generator = torch.Generator().manual_seed(rows + inter)
    device = "cuda" if backend == "triton" else "cpu"
    x = torch.randn(rows, 2 * inter, generator=generator) * 3
    hidden = torch.randn(rows, 64, generator=generator).to(torch.bfloat16).to(device)
    extra = {"input_norm": (hidden, 1e-6)}
    if scaled:
        extra["scales"] = (torch.rand(rows, 1, generator=generator).to(device) / 10,
                           torch.rand(2 * inter, generator=generator).to(device))
    x = (x if scaled else x.to(torch.bfloat16)).to(device)
    rounded = ops.silu_and_mul(x, backend, to_e4m3=True, **extra)
    product = ops.silu_and_mul(x, backend, **extra)
    assert isinstance(rounded, ops.E4M3Rows) and rounded.count == rows and rounded.dtype == torch.bfloat16
    assert rounded.q.shape == (rows, inter) and product.dtype == torch.bfloat16
    assert is_e4m3_of_rows(rounded.q, rounded.scale, product.cpu())
    if backend == "triton":
        assert same_e4m3((rounded.q, rounded.scale), ops.quantize_rows_to_e4m3(product, backend="triton"))


@pytest.mark.parametrize("device", FP8_GEMM_DEVICES)
@pytest.mark.parametrize("rows", [7, 136, 300])  # the paths of test_fp8_matmul's rows
def test_fp8_matmul_rounds_its_sum_for_the_next_projection(device, rows):
    """fp8_matmul's quantize_sum: the residual is what the call without it gives, bit for bit, and the E4M3Rows
    returned are that sum times the next norm's weight quantized as quantize_rows_to_e4m3 does (the same
    bytes and scales), padded to the rows fp8_matmul's row-scaled GEMM takes (256 for 129-255 rows on CUDA);
    fed back into fp8_matmul as its x, they give the product of quantizing the sum there."""
    generator = torch.Generator().manual_seed(rows)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = (torch.randn(rows, 96, generator=generator) * 3).to(dtype).to(device)
    q_w, w_scale = row_quantized(torch.randn(64, 96, generator=generator) / 10)
    q_w, w_scale = q_w.to(device), w_scale.reshape(-1).to(device)
    residual = torch.randn(rows, 64, generator=generator).to(dtype).to(device)
    next_weight = (torch.rand(64, generator=generator) + 0.5).to(device)
    plain = ops.fp8_matmul(x, q_w, w_scale, residual=residual.clone())
    summed, rounded = ops.fp8_matmul(x, q_w, w_scale, residual=residual.clone(), quantize_sum=True,
                                     sum_input_weight=next_weight)
    assert torch.equal(summed, plain) and rounded.count == rows and rounded.dtype == dtype
    assert rounded.q.shape[0] == (256 if device == "cuda" and 128 < rows < 256 else rows)
    assert same_e4m3((rounded.q[:rows], rounded.scale[:rows]), ops.quantize_rows_to_e4m3(plain, next_weight))
    q_next, s_next = row_quantized(torch.randn(32, 64, generator=generator) / 10)
    q_next, s_next = q_next.to(device), s_next.reshape(-1).to(device)
    assert torch.equal(ops.fp8_matmul(rounded, q_next, s_next), ops.fp8_matmul(plain, q_next, s_next, next_weight))
    with pytest.raises(ValueError, match="quantize_sum needs a residual"):
        ops.fp8_matmul(x, q_w, w_scale, quantize_sum=True)


@pytest.mark.skipif(len(FP8_GEMM_DEVICES) == 1, reason="needs CUDA of compute capability 8.9 (FP8 GEMMs)")
def test_quantization_fp8_runs_fp8_gemms_on_such_a_gpu(prompts):
    """bfloat16 on the GPU: the projections stay in e4m3 (a scale per row, a folded norm's weight apart), and
    the greedy tokens agree with the same model computed dequantized for most of the first steps."""
    fp8 = LLM(model="qwen3-0.6b", num_hidden_layers=2, max_model_len=128, quantization="fp8", max_num_seqs=8)
    layer = fp8.engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn and layer.self_attn.qkv_proj.input_weight.numel()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    fp8.close()
    from engine.models import loader

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "fp8_gemms", lambda device, dtype: False)
        plain = LLM(model="qwen3-0.6b", num_hidden_layers=2, max_model_len=128, quantization="fp8", max_num_seqs=8)
    theirs = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert sum(a[0] == b[0] for a, b in zip(ours, theirs)) >= len(prompts) // 2, (ours, theirs)


def per_token_rounded_inputs(model):
    """Forward pre-hooks on every projection of transformers' layers: its input rounded per token to e4m3
    with scale amax / 448 (W8A8's activation rounding, in float64), as the engine's GEMMs see it."""
    def round_input(module, args):
        x = args[0].double()
        scale = x.abs().amax(dim=-1, keepdim=True) / 448
        scale[scale == 0] = 1
        return ((x / scale).to(torch.float8_e4m3fn).double() * scale).to(args[0].dtype),

    return [m.register_forward_pre_hook(round_input) for layer in model.model.layers
            for m in layer.modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.skipif(not cpu_has_row_scaled_fp8_gemms(), reason="this torch's CPU _scaled_mm takes one scale per tensor only")
def test_fp8_gemms_match_transformers_with_the_rounded_weights_and_activations(qwen3_checkpoint, prompts, monkeypatch):
    """Where the device has FP8 GEMMs (forced here on the CPU, where torch._scaled_mm runs too), the
    projections stay in e4m3 and multiply activations rounded per token: transformers on the rounded
    weights, each projection's input rounded the same way, gives the same greedy tokens."""
    from engine.models import loader

    path, hf_model = qwen3_checkpoint
    weights = dict(hf_model.state_dict())
    for name in [k for k in weights if k.endswith("weight") and k.split(".")[-2] in PROJECTIONS]:
        q, scale = row_quantized(weights[name])
        weights[name] = (q.double() * scale.double()).float()
    reference = rounded_model(hf_model, weights)
    hooks = per_token_rounded_inputs(reference)
    expected, gap = reference_outputs(reference, prompts)
    for hook in hooks:
        hook.remove()
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    assert expected != reference_outputs(reference, prompts)[0], "rounding the activations changed no token"
    monkeypatch.setattr(loader, "fp8_gemms", lambda device, dtype: True)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, device="cpu", block_size=4, quantization="fp8")
    layer = llm.engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == expected
