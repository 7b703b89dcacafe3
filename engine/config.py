"""Structured configs (registered in Hydra's ConfigStore) and their up-front validation.

conf/ mirrors these dataclasses: conf/model/*.yaml fill ModelConfig, conf/cache/*.yaml CacheConfig, and
so on; conf/job/<name>.yaml picks one of the job schemas below. The comment beside each field is its
description in `python -m engine.run --help` (`key_help`), so keep one there. Every node is typed, so
unknown keys and values of the wrong type are rejected; `validate` checks values and names the field
that is wrong.
"""
import ast
import dataclasses
import difflib
import functools
import inspect
import io
import json
import math
import os
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.nodes import FloatNode

from engine.sequence import FIELD_KINDS, SamplingParams, takes_one_value

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
CASCADE_MODES = ("auto", "on", "off")
THREADED_HIDDEN_SIZE = 1024  # below this a layer's matmuls are too small to share between CPU threads


class UserError(Exception):
    """A problem of the input or the settings, not of the program: `python -m engine.run` prints the
    message on one line, without a traceback, and exits with `exit_code`."""

    exit_code = 1


class ConfigError(UserError, ValueError):
    """A setting that cannot work; the message names the field."""


@dataclass
class ModelConfig:
    name: str = "tiny"  # a label for the model, written to summary.parquet
    path: Optional[str] = None  # a checkpoint directory or a Hugging Face id (org/name); null: random weights of the shape below
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16; auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda; auto: CUDA when present
    cpu_threads: Optional[int] = None  # torch threads on the CPU; null: 1, more only for hidden sizes >= 1024
    max_model_len: int = 512  # prompt + output tokens of one sequence
    seed: int = 0  # seed of the random weights
    architecture: str = "Qwen3ForCausalLM"  # random weights: LlamaForCausalLM | Qwen2ForCausalLM | Qwen3ForCausalLM (a checkpoint names its own)
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


@dataclass
class SchedulerConfig:
    max_num_seqs: Optional[int] = None  # sequences running at once; null: the device's default (CUDA 512, CPU 64)
    max_num_batched_tokens: Optional[int] = None  # tokens computed per step (decodes + prompt chunks); null: CUDA 16384, CPU 2048
    step_timeout_s: Optional[float] = 60.0  # a step whose tokens take longer (or 20x the slowest step so far, if more) stops the run, its inputs saved; null: wait forever


def _config_type(name: str):
    """The config key's type for SamplingParams field `name`: its type (lists for tuples), or null. A list
    field that also takes one element alone (sampling.stop=QQQ) is untyped here, as OmegaConf has no union
    of a list and a value: SamplingParams checks it (sampling_params, in validate)."""
    element, many, _ = FIELD_KINDS[name]
    if takes_one_value(name):
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
class GenerateJob:
    name: str = "generate"
    input: Optional[str] = None  # a Parquet/JSONL file, directory or glob; None: the sample prompts shipped in jobs/
    prompt_column: str = "prompt"  # text, or a conversation: a list of {role, content} structs (chat template applied)
    chat_template: bool = False  # apply the chat template to a text prompt too, as one user message
    chat_template_kwargs: Any = None  # a mapping passed to the chat template, e.g. {enable_thinking: false}
    id_column: Optional[str] = None  # None: column "id" when the input has one, else row numbers
    keep_columns: Optional[list[str]] = None  # input columns carried to the output; None: all
    output_format: str = "parquet"  # parquet: generations.parquet | openai: generations.jsonl, OpenAI batch output
    flush_every: int = 256  # finished rows per Parquet part
    flush_interval_s: float = 60.0  # also flush when the oldest unsaved row is this old (0: off)


@dataclass
class BenchJob:
    name: str = "bench"
    workload: str = "random"  # random | nano (nano-vllm's bench.py) | long | shared_prefix (jobs/bench.py)
    num_prompts: int = 256  # this and the lengths and seed: workload random only
    input_len: list[int] = field(default_factory=lambda: [100, 1024])
    output_len: list[int] = field(default_factory=lambda: [100, 1024])
    seed: int = 0
    baseline: str = "none"  # none | hf
    hf_batch_size: int = 64


@dataclass
class AnalyzeJob:
    name: str = "analyze"
    root: str = MISSING  # a sweep directory: every summary.parquet below it is one run
    out: Optional[str] = None  # where sweep.parquet and the plots go; null: job.root
    plots: bool = True  # write the PNG plots


EXECUTORS = ("local", "ray")


@dataclass
class ExecutorConfig:
    """Where the engines run: local (one engine in this process) or ray (jobs/ray_executor.py: one engine
    per Ray actor, the rows spread over them with Ray Data). The other keys are the ray executor's."""

    name: str = "local"  # local | ray; set by executor=NAME
    num_engines: Optional[int] = None  # ray: engine actors; null: one per GPU that Ray sees (set it on a CPU machine)
    gpus_per_engine: float = 1.0  # ray: GPUs each engine actor holds (0: CPU engines)
    address: Optional[str] = None  # ray: a cluster to attach to (e.g. auto); null: start a local Ray
    batch_size: int = 512  # ray: input rows handed to an engine at a time, each run to completion


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    job: Any = MISSING


@dataclass
class NoJob:
    """The job node of a config that no job runs (engine.LLM builds one)."""

    name: str = "llm"


JOB_SCHEMAS = {"generate": GenerateJob, "bench": BenchJob, "analyze": AnalyzeJob}  # job=<name> -> its keys


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for name, node in JOB_SCHEMAS.items():
        store.store(group="job", name=f"{name}_schema", node=node)


@functools.cache
def _field_comments(path: str) -> dict[str, dict[str, str]]:
    """class name -> field -> the comment on the field's line(s) in the Python file at `path`."""
    source = Path(path).read_text()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    return {cls.name: {stmt.target.id: next((comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1)
                                             if n in comments), "")
                       for stmt in cls.body if isinstance(stmt, ast.AnnAssign)}
            for cls in ast.parse(source).body if isinstance(cls, ast.ClassDef)}


def key_help(schema: type) -> dict[str, str]:
    """Each field of a config dataclass -> its description ("" where it has none). The sampling keys are
    described by SamplingParams' comments, with what null means."""
    if schema is not SamplingConfig:
        return _field_comments(__file__)[schema.__name__]
    from engine.generation_config import SAMPLING_KEYS

    described = _field_comments(inspect.getsourcefile(SamplingParams))[SamplingParams.__name__]
    help_text = {}
    for f in dataclasses.fields(SamplingParams):
        default = json.dumps(list(f.default) if isinstance(f.default, tuple) else f.default)
        checkpoint = "generation_config.json's value, else " if f.name in SAMPLING_KEYS.values() else ""
        help_text[f.name] = described[f.name] + ("" if f.default is None else f" (null: {checkpoint}{default})")
    return {**help_text, "use_generation_config": USE_GENERATION_CONFIG_HELP}


def _schema_of(owner: type, name: str, job: str | None) -> type | None:
    """The dataclass under key `name` of `owner` (job: the schema of job=`job`); None for a leaf."""
    if owner is Config and name == "job":
        return JOB_SCHEMAS.get(job, NoJob)
    kind = owner.__dataclass_fields__[name].type
    return kind if dataclasses.is_dataclass(kind) else None


def known_keys(job: str | None, owner: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config of job=`job`, e.g. cache.block_size."""
    keys = []
    for f in dataclasses.fields(owner):
        key, inner = f"{prefix}{f.name}", _schema_of(owner, f.name, job)
        keys += known_keys(job, inner, f"{key}.") if inner else [key]
    return keys


def key_field(key: str, job: str | None) -> tuple[type, dataclasses.Field]:
    """The dataclass holding dotted `key` and its field, in the config of job=`job`. ConfigError for a
    key the schemas do not know, naming the closest known key and the keys beside it."""
    owner, parts = Config, key.split(".")
    for depth, part in enumerate(parts):
        parent = ".".join(parts[:depth])
        if owner is None:
            raise ConfigError(f"unknown config key {key!r}: {parent} is a value, not a group of keys")
        if part not in owner.__dataclass_fields__:
            raise _unknown_key(key, parent, job)
        if depth == len(parts) - 1:
            return owner, owner.__dataclass_fields__[part]
        owner = _schema_of(owner, part, job)


def did_you_mean(name: str, known, form: str = "; did you mean {}?") -> str:
    """`form` filled with the name in `known` closest to `name` (a misspelt key or option), or "" when
    none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return form.format(close[0]) if close else ""


def _unknown_key(key: str, parent: str, job: str | None) -> ConfigError:
    everything = known_keys(job)
    elsewhere = [name for name in JOB_SCHEMAS if parent == "job" and key in known_keys(name)]
    hint = f"; it is a key of job={' and job='.join(elsewhere)}" if elsewhere else did_you_mean(key, everything)
    if parent:
        names = [k.removeprefix(f"{parent}.") for k in everything if k.startswith(f"{parent}.")]
        where = f"{parent} keys of job={job}" if parent == "job" else f"{parent} keys"
    else:
        names, where = list(dict.fromkeys(k.split(".")[0] for k in everything)), "top-level keys"
    return ConfigError(f"unknown config key {key!r}{hint} ({where}: {', '.join(names)})")


def _leaves(node: DictConfig, prefix: str = ""):
    """(dotted key, value node) of every leaf below `node`; lists are leaves, and so are mappings that are
    values (job.chat_template_kwargs={enable_thinking: false}) rather than groups of keys (a structured
    config: its dataclass is its type)."""
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child)):
            yield from _leaves(child, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", child


def _check(ok: bool, field_name: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{field_name} {message}, got {value!r}")


def check_keys(cfg) -> None:
    """Reject keys the schemas do not know (a composed config: Hydra lets `+cache.blok_size=3` through)."""
    job = cfg.job.name if OmegaConf.is_dict(cfg.get("job")) else None
    for key, _ in _leaves(cfg):
        key_field(key, job)


def check_finite(cfg) -> None:
    """No float key has a use for inf or nan (not a temperature, a share of memory, a budget, an interval)."""
    for key, node in _leaves(cfg):
        value = OmegaConf.select(cfg, key) if isinstance(node, FloatNode) else None
        if value is not None:
            _check(math.isfinite(value), key, "must be a finite number", value)


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


def check_pool(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """A pool must hold at least one sequence of max_model_len, or a request could never finish."""
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ConfigError(
            f"cache: a pool of {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens) cannot "
            f"hold one sequence of model.max_model_len {max_model_len} ({need} blocks); raise cache.num_blocks "
            f"(or cache.kv_budget_gb, cache.gpu_memory_utilization) or lower model.max_model_len")


def set_sampling(sampling_cfg) -> dict:
    """The sampling.* keys that are set (not null), by SamplingParams field, as plain values."""
    values = OmegaConf.to_container(sampling_cfg) if OmegaConf.is_config(sampling_cfg) else dict(sampling_cfg)
    return {f.name: values[f.name] for f in dataclasses.fields(SamplingParams) if values.get(f.name) is not None}


def sampling_params(sampling_cfg) -> SamplingParams:
    """SamplingParams from the set sampling.* keys; ConfigError naming the key if one is bad."""
    try:
        return SamplingParams(**set_sampling(sampling_cfg))
    except ValueError as err:
        raise ConfigError(f"sampling.{err}") from None


def check_executor(e) -> None:
    _check(e.name in EXECUTORS, "executor.name", f"must be one of {EXECUTORS} (set it with executor=NAME)", e.name)
    _check(e.num_engines is None or e.num_engines >= 1, "executor.num_engines", "must be >= 1 or null (one per GPU)",
           e.num_engines)
    _check(e.gpus_per_engine >= 0, "executor.gpus_per_engine", "must be >= 0", e.gpus_per_engine)
    _check(e.batch_size >= 1, "executor.batch_size", "must be >= 1", e.batch_size)
    _check(e.address is None or bool(e.address.strip()), "executor.address",
           "must be a Ray address such as auto or ray://host:10001, or null for a local Ray", e.address)


def validate(cfg) -> None:
    """Raise ConfigError naming the first field whose value cannot work."""
    check_keys(cfg)
    check_finite(cfg)
    m, c, s, p = cfg.model, cfg.cache, cfg.scheduler, cfg.sampling
    _check(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}", m.dtype)
    _check(m.device in DEVICES, "model.device", f"must be one of {DEVICES}", m.device)
    _check(m.cpu_threads is None or m.cpu_threads >= 1, "model.cpu_threads", "must be >= 1 or null", m.cpu_threads)
    _check(m.max_model_len >= 2, "model.max_model_len", "must be >= 2", m.max_model_len)
    _check(c.block_size >= 1, "cache.block_size", "must be >= 1", c.block_size)
    _check(c.num_blocks is None or c.num_blocks >= 1, "cache.num_blocks", "must be >= 1", c.num_blocks)
    _check(c.kv_budget_gb is None or c.kv_budget_gb > 0, "cache.kv_budget_gb", "must be > 0", c.kv_budget_gb)
    _check(0 < c.gpu_memory_utilization <= 1, "cache.gpu_memory_utilization", "must be in (0, 1]", c.gpu_memory_utilization)
    modes = ", ".join(CASCADE_MODES)
    if c.cascade_attention in ("True", "False"):  # YAML reads unquoted on and off as booleans
        modes += " (quote on and off in YAML files)"
    _check(c.cascade_attention in CASCADE_MODES, "cache.cascade_attention", f"must be one of {modes}", c.cascade_attention)
    _check(s.max_num_seqs is None or s.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1", s.max_num_seqs)
    _check(s.step_timeout_s is None or s.step_timeout_s > 0, "scheduler.step_timeout_s", "must be > 0 or null",
           s.step_timeout_s)
    _check(s.max_num_batched_tokens is None or s.max_num_batched_tokens >= 1, "scheduler.max_num_batched_tokens",
           "must be >= 1", s.max_num_batched_tokens)
    sampling_params(p)
    if c.num_blocks is not None:
        check_pool(c.num_blocks, c.block_size, m.max_model_len)
    check_executor(cfg.executor)
    if cfg.job.name == "generate":
        j = cfg.job
        _check(j.flush_every >= 1, "job.flush_every", "must be >= 1", j.flush_every)
        _check(j.flush_interval_s >= 0, "job.flush_interval_s", "must be >= 0", j.flush_interval_s)
        _check(bool(j.prompt_column), "job.prompt_column", "must name a column", j.prompt_column)
        _check(j.id_column is None or bool(j.id_column), "job.id_column", "must name a column or be null", j.id_column)
        _check(j.input is None or bool(j.input.strip()), "job.input",
               "is empty: give a Parquet or JSONL file, a directory or a glob (or leave it unset for the sample)", j.input)
        _check(j.chat_template_kwargs is None or OmegaConf.is_dict(j.chat_template_kwargs), "job.chat_template_kwargs",
               "must be a mapping such as {enable_thinking: false}, or null", j.chat_template_kwargs)
        _check(j.output_format in ("parquet", "openai"), "job.output_format", "must be 'parquet' or 'openai'", j.output_format)
    if cfg.job.name == "bench":
        for key in ("input_len", "output_len"):
            lo_hi = list(cfg.job[key])
            _check(len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1], f"job.{key}", "must be [min, max] with 1 <= min <= max", lo_hi)
        workloads = ("random", "nano", "long", "shared_prefix")
        _check(cfg.job.workload in workloads, "job.workload", f"must be one of {workloads}", cfg.job.workload)
        _check(cfg.job.num_prompts >= 1, "job.num_prompts", "must be >= 1", cfg.job.num_prompts)
        _check(cfg.job.baseline in ("none", "hf"), "job.baseline", "must be 'none' or 'hf'", cfg.job.baseline)
