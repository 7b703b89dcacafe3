"""Build a model of engine/models/registry.py: from a Hugging Face checkpoint (a directory, or a hub id
resolved to its snapshot in the local hub cache), or with seeded random weights of the configured shape
(the embedded default and the benchmarks). Either way a config.json dict describes the model (the
checkpoint's, or one made of the model.* keys): its architectures pick the class, which reads its arch."""
import contextlib
import copy
import functools
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError, \
    RevisionNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open

from engine.errors import ConfigError
from engine.kv_cache import memory_available
from engine.models.decoder import FOLDED_NORMS, DecoderArch, DecoderForCausalLM, DecoderLayer
from engine.models.layers import PackedLinear
from engine.models.moe import StackedExperts
from engine.models.quantization import (ACTIVATION_SCALES, WeightFormat, dequantize, fp8_gemms, fp8_linears,
                                        fp8_projections, round_projections_to_fp8, store_fp8, weight_format)
from engine.models.registry import model_class
from engine.models.tensor_parallel import Collectives, check_divisible, shard_layer, shard_vocab
from engine.models.rope import is_positive
from ops import FP8_DTYPES

# What a hub snapshot needs: config.json, generation_config.json, the weights (and their index), tokenizer files.
TOKENIZER_FILES = ["*.json", "merges.txt", "tokenizer.model", "*.jinja"]
HUB_FILES = [*TOKENIZER_FILES, "*.safetensors"]
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
COUNT_KEYS = (*SHAPE_KEYS, "num_key_value_heads", "head_dim")  # positive integers where present
SCALE_KEYS = ("rms_norm_eps",)  # positive finite numbers where present (rope_theta: engine/models/rope.py)
COMPUTED_BUFFERS = ("rotary_emb.inv_freq",)  # stored by some checkpoints; the model computes its own
SKIPPED_INIT = ("normal_", "uniform_", "kaiming_uniform_")  # torch.nn.init's, as the meta layout is built
VOCAB_PARTS = ("model.embed_tokens", "lm_head")  # the parts a tensor-parallel rank keeps a slice of rows of
HEADER_FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # safetensors' names
RANDOM_WEIGHTS_MAX_MODEL_LEN = 2048  # model.max_model_len null without a checkpoint to take it from


def resolve_model_path(model_cfg) -> Path | None:
    """model.path as a local checkpoint directory (resolve_checkpoint's); None for random weights."""
    return resolve_checkpoint(model_cfg.path, "model.path", HUB_FILES) if model_cfg.path else None


def resolve_checkpoint(value: str, key: str, patterns: list[str]) -> Path:
    """The setting `key`'s value as a local directory. A value that is not a directory but reads as a Hugging
    Face id (org/name) is that repository's snapshot in the hub cache (HF_HUB_CACHE; its files matching
    patterns), downloaded first where the network allows; offline (HF_HUB_OFFLINE=1) or unreachable, the
    cached one. ConfigError naming key otherwise."""
    path = Path(value).expanduser()
    if path.is_dir():
        return path
    if not _is_hub_id(value):
        raise ConfigError(f"{key} {value!r} is not a directory (nor a Hugging Face id, org/name)")
    return _hub_snapshot(value, str(constants.HF_HUB_CACHE), key, tuple(patterns))


def _is_hub_id(text: str) -> bool:
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return text.count("/") == 1


@functools.cache
def _hub_snapshot(repo_id: str, cache_dir: str, key: str, patterns: tuple[str, ...]) -> Path:
    """Once per process and cache: online, each call asks the Hub for the newest commit."""
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=list(patterns)))
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(f"{key} {repo_id!r} is not a directory, and the Hugging Face Hub has no model {repo_id!r} "
                          f"that this machine may read (a gated or private one needs `hf auth login`)") from None
    except LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hugging Face Hub cannot be reached"
        raise ConfigError(f"{key} {repo_id!r} is neither a directory nor in the local Hugging Face cache "
                          f"({cache_dir}), and {reason}: download it first, where the network is reachable, with "
                          f"`hf download {repo_id}`, or set HF_HUB_CACHE to a cache that holds it") from None
    except OSError as err:  # HTTP errors too
        raise ConfigError(f"{key} {repo_id!r}: downloading it from the Hugging Face Hub failed: {err}") from None


def read_json_config(file: Path) -> dict:
    """A checkpoint's JSON file (config.json, generation_config.json) as a dict; ConfigError naming the file
    and what is wrong with it if it cannot be read or holds no JSON object."""
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"model.path: {file} is not valid JSON ({err})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"model.path: cannot read {file} ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.path: {file} holds a JSON {type(config).__name__}, not an object")
    return config


def check_shape_values(config: dict, where: str) -> None:
    """The shape keys of a config.json dict are present, and positive where present."""
    missing = [key for key in SHAPE_KEYS if key not in config]
    if missing:
        raise ConfigError(f"{where} lacks {', '.join(missing)}")
    bad = [f"{key}={config[key]!r}" for key in (*COUNT_KEYS, *SCALE_KEYS)
           if config.get(key) is not None and not is_positive(config[key], int if key in COUNT_KEYS else float)]
    if bad:
        raise ConfigError(f"{where} has impossible values: {', '.join(bad)}")


def random_weights_config(model_cfg) -> dict:
    """The config.json that model.* describes (random weights)."""
    m = model_cfg
    return {"architectures": [m.architecture], "vocab_size": m.vocab_size, "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size, "num_hidden_layers": m.num_hidden_layers,
            "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
            "head_dim": m.head_dim, "rms_norm_eps": m.rms_norm_eps, "tie_word_embeddings": m.tie_word_embeddings,
            "rope_parameters": {"rope_type": m.rope_type, "rope_theta": m.rope_theta, "factor": m.rope_factor,
                                "low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                                "original_max_position_embeddings": m.rope_original_max_position_embeddings},
            "num_experts": m.num_experts, "num_experts_per_tok": m.num_experts_per_tok,
            "moe_intermediate_size": m.moe_intermediate_size, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": m.decoder_sparse_step, "mlp_only_layers": list(m.mlp_only_layers)}


def model_spec(model_cfg, path: Path | None) -> tuple[type[DecoderForCausalLM], DecoderArch, list[int]]:
    """The model's class, arch and EOS token ids: from the config.json of the checkpoint at `path`, or,
    path None, from model.* (random weights)."""
    if path:
        config, where = read_json_config(path / "config.json"), f"model.path: {path / 'config.json'}"
        eos = eos_ids(config.get("eos_token_id"))
    else:
        config, where, eos = random_weights_config(model_cfg), "model", [model_cfg.eos_token_id]
    check_shape_values(config, where)
    cls = model_class(config, where)
    arch = cls.arch_from_config(config, where)
    if arch.head_dim % 2:
        key = f"{where} head_dim" if path else "model.head_dim"
        raise ConfigError(f"{key} {arch.head_dim} is odd: RoPE rotates pairs of dimensions")
    return cls, arch, eos


def eos_ids(value) -> list[int]:
    """An eos_token_id entry (absent, an int or a list) as a list."""
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def check_checkpoint(path: Path, own_tokenizer: bool = True) -> None:
    """ConfigError naming what the checkpoint directory lacks; own_tokenizer: its tokenizer is read from it
    (False: model.tokenizer names another)."""
    missing = [what for what, ok in (
        ("config.json", (path / "config.json").is_file()),
        ("*.safetensors weights", any(path.glob("*.safetensors"))),
        ("tokenizer files (tokenizer.json or tokenizer_config.json)",
         not own_tokenizer or (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()),
    ) if not ok]
    if missing:
        raise ConfigError(f"model.path {str(path)!r} lacks {', '.join(missing)}")


def checkpoint_target(name: str, model: DecoderForCausalLM) -> tuple[str, object]:
    """The model parameter a checkpoint tensor goes into, and its shard there (None: all of it): an expert's
    projection (<mlp>.experts.<e>.<projection>.weight) goes into its StackedExperts parameter at (e, part),
    a packed projection into its PackedLinear at its index."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, module = module_path.rpartition(".")
    mlp, _, expert = parent.rpartition(".experts.")
    if mlp and expert.isdigit() and module in model.expert_modules_mapping:
        stacked, part = model.expert_modules_mapping[module]
        return f"{mlp}.experts.{stacked}", (int(expert), part)
    if module not in model.packed_modules_mapping:
        return name, None
    packed, shard = model.packed_modules_mapping[module]
    return f"{parent}.{packed}.{leaf}", shard


def checkpoint_parts(model: DecoderForCausalLM, path: Path, fmt: WeightFormat | None) -> "CheckpointParts":
    """The checkpoint's tensors grouped by the model part (model_parts) that holds their parameters, read from
    the safetensors headers only; ConfigError, naming the file and tensor, for a tensor that has no place in
    the model."""
    params, files = dict(model.named_parameters()), sorted(path.glob("*.safetensors"))
    prefixes = [prefix for prefix, _ in model_parts(model)]
    scales = _scale_tensors(files, fmt) if fmt else {}
    by_part = {prefix: [] for prefix in prefixes}
    for file in files:
        for name, dtype in _tensor_dtypes(file):
            if dtype in FP8_DTYPES and fmt is None:
                raise ConfigError(f"model.path: {file} holds {name} in {dtype}, but config.json has no "
                                  f"quantization_config to say how it is scaled")
            if name.endswith(COMPUTED_BUFFERS) or (name == "lm_head.weight" and model.arch.tie_word_embeddings) \
                    or name in scales or name.endswith(ACTIVATION_SCALES):
                continue
            target, shard = checkpoint_target(name, model)
            prefix = next((p for p in prefixes if target.startswith(p + ".")), None)
            if target not in params or prefix is None:
                raise ConfigError(f"model.path: {file} holds {name}, which {type(model).__name__} as "
                                  f"config.json describes it has no parameter for")
            by_part[prefix].append((file, name, target, shard))
    return CheckpointParts(path, fmt, scales, by_part)


@dataclass
class CheckpointParts:
    """A checkpoint's tensors by model part: (file, tensor name, target parameter, shard) for each part's
    prefix; load copies a part's tensors in once the part has its storage."""

    path: Path
    fmt: WeightFormat | None
    scales: dict
    by_part: dict

    def load(self, prefix: str, part: nn.Module) -> None:
        """Copy each tensor of part `prefix` into its parameter, or its shard of a PackedLinear
        (model.packed_modules_mapping), an FP8 weight dequantized by its scale (self.fmt:
        engine/models/quantization.py). ConfigError, naming the file and tensor, for a tensor that does not fit
        its parameter, an FP8 weight without its scale or with one of the wrong shape, and for parameters of
        the part that no tensor filled."""
        params, modules = dict(part.named_parameters()), dict(part.named_modules())
        needed = {(name, shard) for name in params for shard in _shards(modules[name.rpartition(".")[0]], name)}
        loaded = set()
        for file, entries in itertools.groupby(self.by_part[prefix], key=lambda entry: entry[0]):
            with _opened(file) as f:
                for _, name, target, shard in entries:
                    loaded.add(self._copy(f.get_tensor(name), name, file, part, target.removeprefix(prefix + "."),
                                          shard))
        missing = sorted({f"{prefix}.{name}" for name, _ in needed - loaded})
        if missing:
            raise ConfigError(f"model.path {str(self.path)!r}: weights missing for {missing[:5]}")

    def _copy(self, tensor, name, file, part, target, shard):
        param = part.get_parameter(target)
        if shard is not None:
            param = part.get_submodule(target.rpartition(".")[0]).shard(param, shard)
        if param.shape != tensor.shape:
            raise ConfigError(f"model.path: {file} holds {name} of shape {tuple(tensor.shape)}, which "
                              f"does not fit the shape config.json gives the model")
        if tensor.dtype in FP8_DTYPES:
            tensor = _dequantized(tensor, name, file, self.fmt, self.scales)
        with torch.no_grad():
            param.copy_(tensor)
        return target, shard


def _tensor_dtypes(file: Path) -> list[tuple[str, object]]:
    """(name, dtype) of each tensor of a safetensors file, from its header: a torch dtype for FP8, else the
    header's name of the dtype."""
    with _opened(file) as f:
        dtypes = [(name, f.get_slice(name).get_dtype()) for name in f.keys()]
    return [(name, HEADER_FP8_DTYPES.get(dtype, dtype)) for name, dtype in dtypes]


def _scale_tensors(files: list[Path], fmt: WeightFormat) -> dict[str, tuple[torch.Tensor, Path]]:
    """Every weight scale of the checkpoint (fmt's scale tensors: small), by name, with its file: a weight
    and its scale may lie in different files."""
    scales = {}
    for file in files:
        with _opened(file) as f:
            scales.update({name: (f.get_tensor(name), file) for name in f.keys() if name.endswith(fmt.scale_suffix)})
    return scales


@contextlib.contextmanager
def _opened(file: Path):
    """safe_open(file); ConfigError naming the file for a file that cannot be read."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as err:
        raise ConfigError(f"model.path: cannot read the weights in {file} ({err})") from None


def _dequantized(tensor: torch.Tensor, name: str, file: Path, fmt: WeightFormat,
                 scales: dict[str, tuple[torch.Tensor, Path]]) -> torch.Tensor:
    scale_name = fmt.scale_name(name)
    if scale_name not in scales:
        raise ConfigError(f"model.path: {file} holds {name} in {tensor.dtype} without its scale {scale_name}")
    scale, scale_file = scales[scale_name]
    return dequantize(tensor, scale, fmt, f"model.path: {scale_file} holds {scale_name}, which")


def _shards(module, name: str) -> list:
    """The shards a checkpoint fills of parameter `name` of module: each projection of a PackedLinear, each
    expert's part of a StackedExperts parameter, else the whole (None)."""
    if isinstance(module, PackedLinear):
        return list(range(len(module.output_sizes)))
    if isinstance(module, StackedExperts):
        return module.shard_ids(name.rpartition(".")[2])
    return [None]


def model_parts(model: DecoderForCausalLM) -> list[tuple[str, nn.Module]]:
    """The parts build_model gives storage one at a time, with their parameters' name prefix: the embedding,
    each decoder layer, the final norm and the head (not a tied one: it is the embedding)."""
    decoder = model.model
    parts = [("model.embed_tokens", decoder.embed_tokens),
             *((f"model.layers.{i}", layer) for i, layer in enumerate(decoder.layers)), ("model.norm", decoder.norm)]
    return parts if model.arch.tie_word_embeddings else [*parts, ("lm_head", model.lm_head)]


def init_random_weights(part: nn.Module, prefix: str, generator: torch.Generator, std: float) -> None:
    """N(0, std) weights of one model part (norms 1, biases 0), drawn on its device from `generator`: the
    parts drawn in model_parts' order from one seeded generator get the weights of one draw over the whole
    model's parameters in order (the same seed on another device draws others)."""
    with torch.no_grad():
        for name, param in part.named_parameters(prefix=prefix):
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:  # drawn into the parameter: no temporaries of its size beside the part (weight_bytes' peak)
                param.normal_(generator=generator).mul_(std)


def max_model_len_of(model_cfg) -> tuple[int, str]:
    """model.max_model_len in effect, and where it comes from: the value set; null: a checkpoint's
    max_position_embeddings, random weights' RANDOM_WEIGHTS_MAX_MODEL_LEN. A checkpoint's directory is
    checked first (check_checkpoint), then a set value against its positions (check_context)."""
    path = resolve_model_path(model_cfg)
    if path is None:
        if model_cfg.max_model_len is None:
            return RANDOM_WEIGHTS_MAX_MODEL_LEN, "the default for random weights"
        return model_cfg.max_model_len, "as set"
    check_checkpoint(path, own_tokenizer=not model_cfg.tokenizer)
    file = path / "config.json"
    positions = read_json_config(file).get("max_position_embeddings")
    if model_cfg.max_model_len is not None:
        check_context(positions, model_cfg.max_model_len, f"model.path: {file}")
        return model_cfg.max_model_len, "as set"
    if not is_positive(positions, int):
        found = "none" if positions is None else f"{positions!r}"
        raise ConfigError(f"model.max_model_len is null, which takes the checkpoint's max_position_embeddings, but "
                          f"model.path: {file} has {found}: set model.max_model_len")
    return positions, "the checkpoint's max_position_embeddings"


def check_context(max_positions, max_model_len: int, where: str) -> None:
    """A checkpoint's positions cover model.max_model_len: past its max_position_embeddings (the context it was
    trained for, its RoPE scaling included) its outputs are not its own (vLLM refuses them too)."""
    if isinstance(max_positions, int) and not isinstance(max_positions, bool) and 0 < max_positions < max_model_len:
        raise ConfigError(f"model.max_model_len {max_model_len} exceeds the checkpoint's max_position_embeddings "
                          f"{max_positions} ({where}): set model.max_model_len to at most {max_positions}")


def check_rope_tables_fit(max_model_len: int, head_dim: int, device: torch.device) -> None:
    """ConfigError where the RoPE tables of max_model_len positions (cos and sin, head_dim float32 each, and
    the half-width angles while they are computed: RotaryEmbedding.reset_buffers' peak) would not fit in the
    memory available on device: a build would fail allocating them, or be killed filling them."""
    need, (available, where) = 11 * max_model_len * head_dim, memory_available(device)  # 10, and the positions
    if need > available:
        raise ConfigError(f"model.max_model_len {max_model_len}: its RoPE tables alone need {need / 1e9:.2f} GB "
                          f"(cos and sin of head_dim {head_dim} in float32 a position, and their angles), but only "
                          f"{available / 1e9:.2f} GB is {where}; lower model.max_model_len")


def weight_bytes(model: DecoderForCausalLM, dtype: torch.dtype, keep_fp8: bool,
                 group: Collectives | None = None) -> tuple[int, int]:
    """(the bytes of the weights build_model makes of the meta-device layout `model`, the most it holds
    beside them while it builds). The weights: each part (model_parts) in dtype, a decoder layer's per-row
    FP8 projections (keep_fp8) in one byte a weight and a float32 scale a row, a tensor-parallel rank's share
    of what it splits (a folded norm counts as the weights it was). Beside them: one part in float32, the part
    being built, and on a rank the embedding and head beyond its share, which it holds whole until the model
    is built (shard_vocab)."""
    finished = whole_vocab = largest = 0
    for prefix, part in model_parts(model):
        largest = max(largest, sum(p.numel() for p in part.parameters()) * 4)
        share = _finished_bytes(prefix, part, dtype, keep_fp8, group)
        if group and prefix in VOCAB_PARTS:
            whole_vocab += _finished_bytes(prefix, part, dtype, keep_fp8, None) - share
        finished += share
    return finished, largest + whole_vocab


def _finished_bytes(prefix: str, part: nn.Module, dtype: torch.dtype, keep_fp8: bool,
                    group: Collectives | None) -> int:
    """One part's bytes as build_model finishes it (weight_bytes'); a rank's share of a decoder layer is
    shard_layer's own, made of a copy of its meta layout, of the embedding and head ceil(V / W) rows."""
    if not isinstance(part, DecoderLayer):
        world = group.world if group and prefix in VOCAB_PARTS else 1
        return sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) * dtype.itemsize for p in part.parameters())
    linears = fp8_linears(part) if keep_fp8 else []
    fp8 = {name for name, module in part.named_modules() if module in linears}
    if group:
        part = copy.deepcopy(part)
        shard_layer(part, group)
    return sum(p.numel() + 4 * p.shape[0] if name.removesuffix(".weight") in fp8 else p.numel() * dtype.itemsize
               for name, p in part.named_parameters())


def check_weights_fit(model_cfg, model: DecoderForCausalLM, dtype: torch.dtype, keep_fp8: bool,
                      device: torch.device, group: Collectives | None) -> None:
    """ConfigError, naming the model and its dtype, where its weights and the build's own peak beside them
    (weight_bytes) would not fit in the memory available on device: a build would fail allocating them part
    way (CUDA), or be killed by the kernel with no message (the host). The ranks of a CPU run share the host."""
    finished, building = weight_bytes(model, dtype, keep_fp8, group)
    ranks = group.world if group and device.type == "cpu" else 1
    need, (available, where) = ranks * (finished + building), memory_available(device)
    if need <= available:
        return
    model_key = f"model.path={model_cfg.path}" if model_cfg.path else f"model={model_cfg.name}"
    dtype_name = str(dtype).removeprefix("torch.")
    what = f"the {ranks} ranks' shares of its weights" if ranks > 1 else "its weights"
    held = "a part in float32, and the whole embedding and head" if group else "a part in float32"
    fixes = ["a smaller model", *(["model.dtype=bfloat16 (half the bytes)"] if dtype.itemsize == 4 else []),
             *(["more GPUs (model.tensor_parallel_size)"] if device.type == "cuda" else []),
             *(["model.tensor_parallel_size=1 (the ranks share this host's memory)"] if ranks > 1 else [])]
    raise ConfigError(f"{model_key} in {dtype_name} (model.dtype={model_cfg.dtype}): building {what} needs "
                      f"{need / 1e9:.2f} GB ({ranks * finished / 1e9:.2f} GB, and {ranks * building / 1e9:.2f} GB "
                      f"more while they are built: {held}), but only {available / 1e9:.2f} GB is {where}; "
                      f"choose {', or '.join(fixes)}")


def build_model(model_cfg, device: torch.device, dtype: torch.dtype,
                group: Collectives | None = None) -> tuple[DecoderForCausalLM, list[int]]:
    """The model on `device` in `dtype`, its FP8 weights dequantized (a checkpoint's) or its projections
    rounded to FP8 (model.quantization=fp8), its norm weights folded (in float32, before the cast), and its
    EOS token ids. Where the device has FP8 GEMMs, per-row FP8 projections stay in FP8 (quantization.py).
    The model is laid out on the meta device, then each part (model_parts) in turn gets its storage, its
    weights in float32 and its final form: the memory a build needs beyond the finished model is one part's
    in float32 (a 70B model in FP8 never exists in bfloat16). group: a tensor-parallel rank's Collectives:
    each layer keeps only the rank's share as soon as it is finished, the embedding and the head once the
    model is built (engine/models/tensor_parallel.py), so a rank holds its share, one part beyond it and, until
    the end, the whole embedding and head. Its RoPE tables cover max_model_len_of's positions (an engine's
    config has it resolved already). A model that would not fit in the memory available is refused before any
    storage is given (check_weights_fit)."""
    path = resolve_model_path(model_cfg)
    max_model_len, _ = max_model_len_of(model_cfg)  # the checkpoint's directory checked first
    cls, arch, eos = model_spec(model_cfg, path)
    check_rope_tables_fit(max_model_len, arch.head_dim, device)
    if group:
        check_divisible(arch, group.world)
    fmt = weight_format(read_json_config(path / "config.json"), f"model.path: {path / 'config.json'}") if path else None
    with torch.device("meta"), _skipped_init():
        model = cls(arch, max_model_len)
    checkpoint = checkpoint_parts(model, path, fmt) if path else None
    generator = None if path else torch.Generator(device).manual_seed(model_cfg.seed)
    round_to_fp8 = model_cfg.quantization == "fp8" and fmt is None  # an FP8 checkpoint is rounded already
    keep_fp8 = (model_cfg.quantization == "fp8" or (fmt is not None and fmt.strategy != "block")) \
        and fp8_gemms(device, dtype)
    check_weights_fit(model_cfg, model, dtype, keep_fp8, device, group)
    for prefix, part in model_parts(model):
        _give_storage(part, device)
        if checkpoint:
            checkpoint.load(prefix, part)
        else:
            init_random_weights(part, prefix, generator, model_cfg.initializer_range)
        if isinstance(part, DecoderLayer):
            _finish_layer(part, round_to_fp8, keep_fp8, dtype)
            if group:
                shard_layer(part, group)
        else:
            part.to(dtype)
    if arch.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _give_storage(model.model.rotary, device).reset_buffers()
    model.model.rotary.to(dtype)
    if group:
        shard_vocab(model, group)
    return model.requires_grad_(False).eval(), eos


def _give_storage(module: nn.Module, device: torch.device) -> nn.Module:
    """module.to_empty(device=device) by torch.empty of each tensor's shape and dtype: to_empty's empty_like
    of a meta tensor runs torch's Python reference, whose first call imports sympy (0.47 s on a CPU)."""
    return module._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


@contextlib.contextmanager
def _skipped_init():
    """torch.nn.init's functions that nn.Linear's and nn.Embedding's reset_parameters call, as no-ops while
    the layout is built on the meta device: there they run as Python references, whose first call imports
    torch._dynamo (about 4.6 s of a job's start-up on the H200's host), for values nothing reads (every
    weight is drawn or loaded afterwards)."""
    saved = {name: getattr(torch.nn.init, name) for name in SKIPPED_INIT}
    for name in SKIPPED_INIT:
        setattr(torch.nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _unchanged(tensor, *args, **kwargs):
    return tensor


@torch.no_grad()
def _finish_layer(layer: DecoderLayer, round_to_fp8: bool, keep_fp8: bool, dtype: torch.dtype) -> None:
    """A layer with its float32 weights -> its projections rounded to FP8 (round_to_fp8), its norms folded,
    cast to dtype, and its per-row FP8 projections stored in FP8 (keep_fp8)."""
    if round_to_fp8:
        round_projections_to_fp8(layer)
    fp8 = fp8_projections(layer) if keep_fp8 else {}
    layer.fold_norm_weights(apart=fp8.keys())
    layer.to(dtype)
    store_fp8(fp8)


def to_hf_model(model: DecoderForCausalLM):
    """transformers' model of the same architecture with this model's weights (unpacked), on its device
    and dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    weight = model.lm_head.weight
    config = AutoConfig.for_model(model.model_type, **model.hf_config())
    hf_model = AutoModelForCausalLM.from_config(config).to(device=weight.device, dtype=weight.dtype).eval()
    hf_model.load_state_dict(unpacked_state_dict(model))
    return hf_model


def unpacked_state_dict(model: DecoderForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face's names, each PackedLinear split back into its projections, and the
    folded norms as the ones they are now (their weights live in the projections after them; those of
    projections kept in FP8, dequantized here, beside them as input_weight)."""
    projection = {packed: name for name, packed in model.packed_modules_mapping.items()}  # (packed, shard) -> name
    modules, state = dict(model.named_modules()), {}
    ones = torch.ones(model.arch.hidden_size, dtype=model.dtype, device=model.lm_head.weight.device)
    for name, module in modules.items():
        if isinstance(module, DecoderLayer):
            readers = (module.self_attn.qkv_proj, module.mlp.norm_reader)  # FOLDED_NORMS' projections
            state.update({f"{name}.{norm}.weight": getattr(reader, "input_weight", ones)
                          for norm, reader in zip(FOLDED_NORMS, readers)})
    for name, tensor in model.state_dict().items():
        module_path, _, leaf = name.rpartition(".")
        module = modules[module_path]
        if leaf in ("weight_scale", "input_weight"):
            continue
        if leaf == "weight" and tensor.dtype in FP8_DTYPES:
            tensor = (tensor.float() * module.weight_scale.float()[:, None]).to(model.dtype)
        if not isinstance(module, PackedLinear):
            state[name] = tensor
            continue
        parent, _, packed = module_path.rpartition(".")
        for shard in range(len(module.output_sizes)):
            state[f"{parent}.{projection[packed, shard]}.{leaf}"] = module.shard(tensor, shard)
    return state
