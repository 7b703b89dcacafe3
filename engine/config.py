"""Structured configs (registered in Hydra's ConfigStore) and their up-front validation.

conf/ mirrors these dataclasses: conf/model/*.yaml fill ModelConfig, conf/cache/*.yaml CacheConfig, and
so on; conf/job/<name>.yaml picks one of the job schemas below. Unknown keys are rejected by Hydra
because every node is typed; `validate` checks values and names the field that is wrong.
"""
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the field."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    path: Optional[str] = None  # a Hugging Face checkpoint directory; None: random weights of the shape below
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto: CUDA when present
    max_model_len: int = 512  # prompt + output tokens of one sequence
    seed: int = 0  # random weights
    vocab_size: int = 257
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    eos_token_id: int = 256
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: Optional[int] = None  # overrides the sizing below
    kv_budget_gb: Optional[float] = None  # KV memory for the pool, to compare block sizes at equal memory
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory for weights, activations and KV
    check_invariants: bool = False  # debug: check the block manager's invariants after every step


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class GenerateJob:
    name: str = "generate"
    input: Optional[str] = None  # a Parquet/JSONL file, directory or glob; None: the sample prompts shipped in jobs/
    prompt_column: str = "prompt"
    id_column: Optional[str] = None  # None: column "id" when the input has one, else row numbers
    keep_columns: Optional[list[str]] = None  # input columns carried to the output; None: all
    output_format: str = "parquet"  # parquet: generations.parquet | openai: generations.jsonl, OpenAI batch output
    flush_every: int = 256  # finished rows per Parquet part
    flush_interval_s: float = 60.0  # also flush when the oldest unsaved row is this old (0: off)


@dataclass
class BenchJob:
    name: str = "bench"
    workload: str = "random"  # random | nano (nano-vllm's bench.py)
    num_prompts: int = 256
    input_len: list[int] = field(default_factory=lambda: [100, 1024])
    output_len: list[int] = field(default_factory=lambda: [100, 1024])
    seed: int = 0
    baseline: str = "none"  # none | hf
    hf_batch_size: int = 64


@dataclass
class AnalyzeJob:
    name: str = "analyze"
    root: str = MISSING  # a sweep directory: every summary.parquet below it is one run
    out: Optional[str] = None  # where sweep.parquet and the plots go; None: job.root
    plots: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    job: Any = MISSING


def register_configs() -> None:
    store = ConfigStore.instance()
    store.store(name="base_config", node=Config)
    for name, node in (("generate", GenerateJob), ("bench", BenchJob), ("analyze", AnalyzeJob)):
        store.store(group="job", name=f"{name}_schema", node=node)


def _check(ok: bool, field_name: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{field_name} {message}, got {value!r}")


def check_keys(cfg) -> None:
    """Reject keys the schemas do not know: Hydra rejects `cache.blok_size=3` itself, but lets
    `+cache.blok_size=3` (append) through."""
    import dataclasses

    from omegaconf import OmegaConf

    def walk(node, schema, prefix: str) -> None:
        known = {f.name: f for f in dataclasses.fields(schema)}
        for key in node.keys():
            if key not in known:
                where = f"{prefix}.{key}" if prefix else key
                raise ConfigError(f"unknown config key {where!r}; {prefix or 'top-level'} keys: {sorted(known)}")
            child = node._get_node(key)
            child_type = OmegaConf.get_type(child) if OmegaConf.is_config(child) else None
            if OmegaConf.is_dict(child) and child_type is not None and dataclasses.is_dataclass(child_type):
                walk(child, child_type, f"{prefix}.{key}" if prefix else key)

    schema = OmegaConf.get_type(cfg)
    walk(cfg, schema if schema is not None and dataclasses.is_dataclass(schema) else Config, "")


def check_pool(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """A pool must hold at least one sequence of max_model_len, or a request could never finish."""
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise ConfigError(
            f"cache: a pool of {num_blocks} blocks of {block_size} tokens ({num_blocks * block_size} tokens) cannot "
            f"hold one sequence of model.max_model_len {max_model_len} ({need} blocks); raise cache.num_blocks "
            f"(or cache.kv_budget_gb, cache.gpu_memory_utilization) or lower model.max_model_len")


def validate(cfg) -> None:
    """Raise ConfigError naming the first field whose value cannot work."""
    check_keys(cfg)
    m, c, s, p = cfg.model, cfg.cache, cfg.scheduler, cfg.sampling
    _check(m.dtype in DTYPES, "model.dtype", f"must be one of {DTYPES}", m.dtype)
    _check(m.device in DEVICES, "model.device", f"must be one of {DEVICES}", m.device)
    _check(m.max_model_len >= 2, "model.max_model_len", "must be >= 2", m.max_model_len)
    _check(c.block_size >= 1, "cache.block_size", "must be >= 1", c.block_size)
    _check(c.num_blocks is None or c.num_blocks >= 1, "cache.num_blocks", "must be >= 1", c.num_blocks)
    _check(c.kv_budget_gb is None or c.kv_budget_gb > 0, "cache.kv_budget_gb", "must be > 0", c.kv_budget_gb)
    _check(0 < c.gpu_memory_utilization <= 1, "cache.gpu_memory_utilization", "must be in (0, 1]", c.gpu_memory_utilization)
    _check(s.max_num_seqs >= 1, "scheduler.max_num_seqs", "must be >= 1", s.max_num_seqs)
    _check(s.max_num_batched_tokens >= 1, "scheduler.max_num_batched_tokens", "must be >= 1", s.max_num_batched_tokens)
    _check(p.temperature >= 0, "sampling.temperature", "must be >= 0", p.temperature)
    _check(0 < p.top_p <= 1, "sampling.top_p", "must be in (0, 1]", p.top_p)
    _check(p.max_tokens >= 1, "sampling.max_tokens", "must be >= 1", p.max_tokens)
    if c.num_blocks is not None:
        check_pool(c.num_blocks, c.block_size, m.max_model_len)
    if cfg.job.name == "generate":
        j = cfg.job
        _check(j.flush_every >= 1, "job.flush_every", "must be >= 1", j.flush_every)
        _check(j.flush_interval_s >= 0, "job.flush_interval_s", "must be >= 0", j.flush_interval_s)
        _check(bool(j.prompt_column), "job.prompt_column", "must name a column", j.prompt_column)
        _check(j.id_column is None or bool(j.id_column), "job.id_column", "must name a column or be null", j.id_column)
        _check(j.input is None or bool(j.input.strip()), "job.input",
               "is empty: give a Parquet or JSONL file, a directory or a glob (or leave it unset for the sample)", j.input)
        _check(j.output_format in ("parquet", "openai"), "job.output_format", "must be 'parquet' or 'openai'", j.output_format)
    if cfg.job.name == "bench":
        for key in ("input_len", "output_len"):
            lo_hi = list(cfg.job[key])
            _check(len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1], f"job.{key}", "must be [min, max] with 1 <= min <= max", lo_hi)
        _check(cfg.job.workload in ("random", "nano"), "job.workload", "must be 'random' or 'nano'", cfg.job.workload)
        _check(cfg.job.baseline in ("none", "hf"), "job.baseline", "must be 'none' or 'hf'", cfg.job.baseline)
