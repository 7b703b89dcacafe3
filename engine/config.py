"""The engine's settings: plain dataclasses, their presets in conf/ and their checks.

conf/ mirrors these dataclasses: conf/model/*.yaml fill ModelConfig, conf/cache/*.yaml CacheConfig, and
so on. EngineConfig is what an engine is built from (engine.LLM makes one from a preset name and keyword
options; the batch layer, jobs/config.py, composes the same sections with Hydra and converts them). The
comment beside each field is its description in `python -m engine.run --help`, so keep one there.
check_engine_config names the field whose value cannot work.
"""
import dataclasses
import math
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from engine.errors import ConfigError, did_you_mean
from engine.sequence import FIELD_KINDS, SamplingParams, takes_one_value
from engine.structured import StructuredOutputsParams

# conf/ is installed beside engine/ (pyproject.toml's package data)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("fp8",)  # model.quantization
CASCADE_MODES = ("auto", "on", "off")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # cache.kv_cache_dtype (vLLM's names; fp8 is fp8_e4m3)
THREADED_HIDDEN_SIZE = 1024  # below this a layer's matmuls are too small to share between CPU threads


@dataclass
class ModelConfig:
    name: str = "tiny"  # a label for the model, written to summary.parquet
    path: Optional[str] = None  # a checkpoint directory or a Hugging Face id (org/name); null: random weights of the shape below
    quantization: Optional[str] = None  # fp8: the decoder layers' weights rounded to FP8 on load (e4m3, a scale per output row); an FP8 checkpoint's own format is read from its config.json
    tokenizer: Optional[str] = None  # a tokenizer's directory or Hugging Face id other than model.path's; null: the checkpoint's (random weights: a byte-level one)
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16; auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda; auto: CUDA when present
    cpu_threads: Optional[int] = None  # torch threads on the CPU; null: 1, more only for hidden sizes >= 1024
    max_model_len: Optional[int] = None  # prompt + output tokens per sequence; null: a checkpoint's context, else 2048
    seed: int = 0  # seed of the random weights
    architecture: str = "Qwen3ForCausalLM"  # random weights: LlamaForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM | Qwen3MoeForCausalLM (a checkpoint names its own)
    vocab_size: int = 257  # random weights: tokens in the vocabulary (a checkpoint has its own shape)
    hidden_size: int = 64  # random weights: model width
    intermediate_size: int = 128  # random weights: MLP width
    num_hidden_layers: int = 2  # random weights: decoder layers
    num_attention_heads: int = 4  # random weights: query heads
    num_key_value_heads: int = 2  # random weights: key/value heads (grouped-query attention)
    head_dim: int = 16  # random weights: channels per attention head
    rope_theta: float = 1000000.0  # random weights: RoPE base
    rope_type: str = "default"  # random weights: default | llama3 (Llama 3.1+'s long-context scaling, the rope_* keys below)
    rope_factor: float = 8.0  # random weights, rope_type llama3: how much longer the scaled context is
    rope_low_freq_factor: float = 1.0  # random weights, rope_type llama3: wavelengths above original / this are scaled
    rope_high_freq_factor: float = 4.0  # random weights, rope_type llama3: wavelengths below original / this are kept
    rope_original_max_position_embeddings: int = 8192  # random weights, rope_type llama3: the context trained before scaling
    rms_norm_eps: float = 1e-6  # random weights: RMSNorm epsilon
    tie_word_embeddings: bool = True  # random weights: the LM head is the embedding matrix
    initializer_range: float = 0.02  # random weights: their standard deviation
    eos_token_id: int = 256  # random weights: the end-of-sequence token
    num_experts: int = 0  # random weights, Qwen3MoeForCausalLM: experts in each sparse layer
    num_experts_per_tok: int = 0  # random weights, Qwen3MoeForCausalLM: experts each token is routed to
    moe_intermediate_size: int = 0  # random weights, Qwen3MoeForCausalLM: an expert's MLP width
    norm_topk_prob: bool = True  # random weights, Qwen3MoeForCausalLM: the routed experts' weights sum to 1
    decoder_sparse_step: int = 1  # random weights, Qwen3MoeForCausalLM: every this-many-th layer is sparse
    mlp_only_layers: list[int] = field(default_factory=list)  # random weights, Qwen3MoeForCausalLM: layers kept dense
    tensor_parallel_size: int = 1  # ranks the model is split over (Megatron-style: heads and MLP widths; engine/parallel.py): one process and device each, gloo on the CPU, NCCL on GPUs
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode
    piecewise_graphs: Optional[bool] = None  # steps with prompt chunks replay a graph per layer around an eager attention; null: on for CUDA, off for the CPU (true there runs the same pieces eagerly)


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: Optional[int] = None  # blocks in the KV pool; null: sized by kv_budget_gb, else device memory
    kv_budget_gb: Optional[float] = None  # KV memory for the pool, to compare block sizes at equal memory
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights, activations and KV
    check_invariants: bool = False  # debug: check the block manager's invariants after every step
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks that earlier sequences computed
    cascade_attention: str = "auto"  # auto | on | off: decode reads a prefix that sequences share once per step; auto: on CUDA, where it pays off
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8 (= fp8_e4m3), fp8_e5m2: K and V in 8 bits, unscaled: twice the tokens in the same memory


@dataclass
class SchedulerConfig:
    max_num_seqs: Optional[int] = None  # sequences running at once; null: the device's default (CUDA 1024, CPU 64)
    max_num_batched_tokens: Optional[int] = None  # tokens computed per step (decodes + prompt chunks); null: CUDA 16384, CPU 2048
    step_timeout_s: Optional[float] = 60.0  # a step whose tokens take longer (or 20x the slowest step so far, if more) stops the run, its inputs saved; null: wait forever
    num_scheduler_steps: Optional[int] = None  # device steps a decode-only batch runs at most per scheduling; null: CUDA 8, CPU 1
    admission_headroom: int = 64  # tokens of growth every running sequence keeps room for in the pool when new ones are admitted; 0: none


def _config_type(name: str):
    """The config key's type for SamplingParams field `name`: its type (lists for tuples), or null. A list
    field that also takes one element alone (sampling.stop=QQQ) is untyped here, as OmegaConf has no union
    of a list and a value, and so is structured_outputs (a mapping or its JSON text): SamplingParams checks
    them (sampling_params, in validate)."""
    element, many, _ = FIELD_KINDS[name]
    if takes_one_value(name) or element is StructuredOutputsParams:
        return Any
    return Optional[list[element]] if many else Optional[element]


# sampling.*: one key per SamplingParams field, null meaning "not set" (the checkpoint's
# generation_config.json value, else SamplingParams' default: engine/generation_config.py), and one more.
SamplingConfig = dataclasses.make_dataclass(
    "SamplingConfig", [(f.name, _config_type(f.name), None) for f in dataclasses.fields(SamplingParams)]
    + [("use_generation_config", bool, True)])
SamplingConfig.__module__ = __name__
USE_GENERATION_CONFIG_HELP = "null sampling keys take the checkpoint's generation_config.json values where it has them"


@dataclass
class EngineConfig:
    """Everything an engine is built from: the model, its KV pool, the scheduler's limits and the run's
    default sampling (sampling.* keys; null: the checkpoint's generation_config.json, else SamplingParams')."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


SECTIONS = {f.name: f.type for f in dataclasses.fields(EngineConfig)}  # section name -> its dataclass
KINDS = {int: "Integer", float: "Float", bool: "Boolean", str: "String"}


# -- presets and options -----------------------------------------------------------------------------
def read_yaml(path: Path) -> dict:
    """A conf/ file as a mapping (an empty file: {}); ConfigError naming the file otherwise."""
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path} holds a {type(values).__name__}, not a mapping of keys")
    return values


def default_options() -> dict[str, str]:
    """The option conf/config.yaml's defaults list picks for each config group, e.g. {"model": "tiny"}."""
    return {k: v for entry in read_yaml(CONF_DIR / "config.yaml")["defaults"] if isinstance(entry, dict)
            for k, v in entry.items()}


def preset_names(section: str) -> list[str]:
    """The options of config group `section`: conf/<section>/*.yaml."""
    return sorted(p.stem for p in (CONF_DIR / section).glob("*.yaml"))


def converted(schema: type, name: str, value):
    """`value` for field `name` of `schema`, converted as OmegaConf converts a command line's (so that the
    Python API and the batch layer take the same values): "3" for an int, 1e-6 as YAML's text for a float.
    ConfigError naming the field for a value of the wrong type."""
    kind = schema.__dataclass_fields__[name].type
    args = typing.get_args(kind)
    if value is None and (type(None) in args or kind is Any):
        return None
    if typing.get_origin(kind) is list:  # a list of one kind (model.mlp_only_layers)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{name}: Value {value!r} of type {type(value).__name__!r} is not a list")
        return [_scalar(args[0], name, element) for element in value]
    base = next((a for a in args if a is not type(None)), kind)
    if base is Any or base not in KINDS:
        return list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
    return _scalar(base, name, value)


def _scalar(base: type, name: str, value):
    try:
        if isinstance(value, bool) != (base is bool) and not isinstance(value, str) or \
                base is int and isinstance(value, float):
            raise ValueError
        if base is bool:
            if isinstance(value, str):
                value = {"true": True, "false": False}[value.lower()]
            return bool(value)
        return base(value)
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{name}: Value {value!r} of type {type(value).__name__!r} could not be converted to "
                          f"{KINDS[base]}") from None


def section_from(schema: type, values: dict, where: str):
    """An instance of section dataclass `schema` from a mapping (a preset file's keys); ConfigError naming an
    unknown key and `where` it came from."""
    known = schema.__dataclass_fields__
    unknown = next((key for key in values if key not in known), None)
    if unknown is not None:
        raise ConfigError(f"{where}: unknown key {unknown!r} (known: {', '.join(known)})")
    return schema(**{key: converted(schema, key, value) for key, value in values.items()})


def preset(section: str, name: str):
    """Section `section`'s dataclass filled from conf/<section>/<name>.yaml."""
    path = CONF_DIR / section / f"{name}.yaml"
    return section_from(SECTIONS[section], read_yaml(path), str(path.relative_to(CONF_DIR.parent)))


# engine option -> its config section: every field of the sections but the two that `model` sets
OPTIONS = {f.name: section for section in ("model", "cache", "scheduler") for f in dataclasses.fields(SECTIONS[section])
           if f.name not in ("name", "path")}


def engine_config(model: str = "tiny", **options) -> EngineConfig:
    """The checked config of LLM(model, **options): the presets conf/config.yaml picks by default (the same
    as the command line's), `model` a conf/model/ name or else a checkpoint directory or hub id, and the
    options by their field names (vLLM's where it has one). TypeError for an unknown option."""
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"LLM() model must be a conf/model/ name, a checkpoint directory or a hub id, got {model!r}")
    model = os.fspath(model)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        named = ", ".join(f"{name!r}{did_you_mean(name, OPTIONS, ' (did you mean {}?)')}" for name in unknown)
        raise TypeError(f"LLM() got unknown engine options: {named} (known: {', '.join(sorted(OPTIONS))})")
    chosen = default_options()
    is_name = model in preset_names("model")
    sections = {section: preset(section, model if section == "model" and is_name else chosen[section])
                for section in SECTIONS}
    if not is_name:  # a checkpoint directory or a hub id
        sections["model"] = dataclasses.replace(sections["model"], path=model, name=Path(model).name)
    for name, value in options.items():
        section = sections[OPTIONS[name]]
        setattr(section, name, converted(type(section), name, value))
    cfg = EngineConfig(**sections)
    check_engine_config(cfg)
    return cfg


# -- checks ------------------------------------------------------------------------------------------
def check_value(ok: bool, field_name: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{field_name} {message}, got {value!r}")


def check_finite(section_name: str, values: dict) -> None:
    """No float setting has a use for inf or nan (not a temperature, a share of memory, a budget, an
    interval); `values`: a section's keys and values."""
    for key, value in values.items():
        if isinstance(value, float):
            check_value(math.isfinite(value), f"{section_name}.{key}", "must be a finite number", value)


def check_engine_config(cfg) -> None:
    """Raise ConfigError naming the first engine setting (model, cache, scheduler, sampling) whose value
    cannot work. A pool too small for one sequence of max_model_len is found where the pool is sized
    (engine/kv_cache.py's num_blocks_for), as it may depend on the device's memory."""
    for name in SECTIONS:
        check_finite(name, vars(getattr(cfg, name)))
    m, c, s = cfg.model, cfg.cache, cfg.scheduler
    check_value(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}", m.dtype)
    check_value(m.device in DEVICES, "model.device", f"must be one of {DEVICES}", m.device)
    check_value(m.quantization is None or m.quantization in QUANTIZATIONS, "model.quantization",
                f"must be null or one of {QUANTIZATIONS}", m.quantization)
    check_value(m.cpu_threads is None or m.cpu_threads >= 1, "model.cpu_threads", "must be >= 1 or null", m.cpu_threads)
    check_value(m.max_model_len is None or m.max_model_len >= 2, "model.max_model_len", "must be >= 2 or null",
                m.max_model_len)
    check_value(-2**63 <= m.seed < 2**64, "model.seed", "must fit in 64 bits (-2^63 to 2^64 - 1)", m.seed)
    check_value(m.tensor_parallel_size >= 1, "model.tensor_parallel_size", "must be >= 1", m.tensor_parallel_size)
    check_value(0 <= m.eos_token_id < m.vocab_size, "model.eos_token_id",
                f"must be a token id below model.vocab_size ({m.vocab_size}), or EOS could never end a sequence",
                m.eos_token_id)
    check_value(c.block_size >= 1, "cache.block_size", "must be >= 1", c.block_size)
    check_value(c.num_blocks is None or c.num_blocks >= 1, "cache.num_blocks", "must be >= 1", c.num_blocks)
    check_value(c.kv_budget_gb is None or c.kv_budget_gb > 0, "cache.kv_budget_gb", "must be > 0", c.kv_budget_gb)
    check_value(0 < c.gpu_memory_utilization <= 1, "cache.gpu_memory_utilization", "must be in (0, 1]", c.gpu_memory_utilization)
    modes = ", ".join(CASCADE_MODES)
    if str(c.cascade_attention) in ("True", "False"):  # YAML reads unquoted on and off as booleans
        modes += " (quote on and off in YAML files)"
    check_value(c.cascade_attention in CASCADE_MODES, "cache.cascade_attention", f"must be one of {modes}", c.cascade_attention)
    check_value(c.kv_cache_dtype in KV_CACHE_DTYPES, "cache.kv_cache_dtype",
                f"must be one of {KV_CACHE_DTYPES}{did_you_mean(str(c.kv_cache_dtype), KV_CACHE_DTYPES, ' (did you mean {}?)')}",
                c.kv_cache_dtype)
    check_value(s.max_num_seqs is None or s.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1", s.max_num_seqs)
    check_value(s.step_timeout_s is None or s.step_timeout_s > 0, "scheduler.step_timeout_s", "must be > 0 or null",
           s.step_timeout_s)
    check_value(s.max_num_batched_tokens is None or s.max_num_batched_tokens >= 1, "scheduler.max_num_batched_tokens",
           "must be >= 1", s.max_num_batched_tokens)
    check_value(s.num_scheduler_steps is None or s.num_scheduler_steps >= 1, "scheduler.num_scheduler_steps",
           "must be >= 1 or null", s.num_scheduler_steps)
    check_value(s.admission_headroom >= 0, "scheduler.admission_headroom", "must be >= 0", s.admission_headroom)
    sampling_params(cfg.sampling)


def cpu_threads(model_cfg, hidden_size: int) -> int:
    """Torch threads for a model of `hidden_size` on the CPU: model.cpu_threads when set, else 1 below
    THREADED_HIDDEN_SIZE (on the tiny default, OpenMP's fork/join and spin-waits cost more than its small
    matmuls gain: with 2 threads on a busy 2-core machine the default job took 0.2 s to 25 s, with 1 about
    0.4 s), else about one per 256 channels (Qwen3-0.6B: 4), never more than the cores this process may use."""
    if model_cfg.cpu_threads is not None:
        return model_cfg.cpu_threads
    if hidden_size < THREADED_HIDDEN_SIZE:
        return 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(usable, hidden_size // 256))


def set_sampling(sampling_cfg) -> dict:
    """The sampling.* keys that are set (not null), by SamplingParams field, as plain values (a list for
    any sequence of values, a dict for any mapping, inside them too)."""
    values = {f.name: getattr(sampling_cfg, f.name) for f in dataclasses.fields(SamplingParams)}
    return {name: plain(value) for name, value in values.items() if value is not None}


def plain(value):
    """`value` with every mapping a dict and every sequence but text a list (a composed config's nodes)."""
    if isinstance(value, Mapping):
        return {key: plain(v) for key, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [plain(v) for v in value]
    return value


def sampling_params(sampling_cfg) -> SamplingParams:
    """SamplingParams from the set sampling.* keys; ConfigError naming the key if one is bad."""
    try:
        return SamplingParams(**set_sampling(sampling_cfg))
    except ValueError as err:
        raise ConfigError(f"sampling.{err}") from None
