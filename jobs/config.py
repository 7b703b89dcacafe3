"""The batch layer's config: the Hydra schemas of the whole command line (the engine's sections, the
executor and each job) registered in Hydra's ConfigStore, the checks of a composed config, and its
conversion to the engine's own EngineConfig (engine/config.py, which knows nothing of Hydra).

conf/job/<name>.yaml picks one of the job schemas below, conf/executor/*.yaml fill ExecutorConfig; the
comment beside each field is its description in `--help` (key_help), so keep one there. Every node is
typed, so unknown keys and values of the wrong type are rejected; `validate` checks values and names the
field that is wrong.
"""
import ast
import dataclasses
import functools
import inspect
import io
import json
import tokenize
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from engine.config import (USE_GENERATION_CONFIG_HELP, CacheConfig, EngineConfig, ModelConfig, SamplingConfig,
                           SchedulerConfig, check_engine_config, check_finite, check_value)
from engine.errors import ConfigError, did_you_mean
from engine.reasoning import REASONING_PARSERS
from engine.sequence import SamplingParams


@dataclass
class GenerateJob:
    name: str = "generate"
    input: Optional[str] = None  # a Parquet/JSONL file, directory or glob; None: the sample prompts shipped in jobs/
    prompt_column: str = "prompt"  # text, or a conversation: a list of {role, content} structs (chat template applied)
    chat_template: bool = False  # apply the chat template to a text prompt too, as one user message
    chat_template_kwargs: Any = None  # a mapping passed to the chat template, e.g. {enable_thinking: false}
    reasoning_parser: Optional[str] = None  # qwen3: the output's think block goes to column reasoning (openai: reasoning_content), the answer to output_text; null: no split
    id_column: Optional[str] = None  # None: column "id" when the input has one, else row numbers
    keep_columns: Optional[list[str]] = None  # input columns carried to the output; None: all
    output_format: str = "parquet"  # parquet: generations.parquet | openai: generations.jsonl, OpenAI batch output
    flush_every: int = 256  # finished rows per Parquet part
    flush_interval_s: float = 60.0  # also flush when the oldest unsaved row is this old (0: off)


@dataclass
class BenchJob:
    name: str = "bench"
    workload: str = "random"  # random | nano (nano-vllm's bench.py) | long | shared_prefix | rollout (jobs/bench.py)
    num_prompts: int = 256  # this and the lengths and seed: workload random only
    input_len: list[int] = field(default_factory=lambda: [100, 1024])
    output_len: list[int] = field(default_factory=lambda: [100, 1024])
    seed: int = 0
    json_schemas: int = 0  # 1-4: request i is constrained to JSON schema i % this (jobs/bench.py's JSON_SCHEMAS); 0: none
    baseline: str = "none"  # none | hf
    hf_batch_size: int = 64  # job.baseline=hf: sequences a static batch of transformers' generate (n per request)


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
    per Ray actor, the rows streamed to them in batches). The other keys are the ray executor's."""

    name: str = "local"  # local | ray; set by executor=NAME
    num_engines: Optional[int] = None  # ray: engine actors; null: one per GPU that Ray sees (set it on a CPU machine)
    gpus_per_engine: Optional[float] = None  # ray: GPUs each engine actor holds (0: CPU engines); null: model.tensor_parallel_size
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
        return _field_comments(inspect.getsourcefile(schema))[schema.__name__]
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
        return JOB_SCHEMAS.get(job)
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


def check_keys(cfg) -> None:
    """Reject keys the schemas do not know (a composed config: Hydra lets `+cache.blok_size=3` through)."""
    job = cfg.job.name if OmegaConf.is_dict(cfg.get("job")) else None
    if job is not None:
        check_job_name(cfg.job)
    for key, _ in _leaves(cfg):
        key_field(key, job)


def check_job_name(job) -> None:
    """job.name is the job that job=NAME chose (conf/job/<name>.yaml sets it): set apart (job.name=bench), it
    would name a job whose keys the config does not have."""
    chosen = next((name for name, schema in JOB_SCHEMAS.items() if schema is OmegaConf.get_type(job)), None)
    if chosen is not None and job.name != chosen:
        what = f"write job={job.name} instead" if job.name in JOB_SCHEMAS else \
            f"job has no option {job.name!r}; options: {', '.join(sorted(JOB_SCHEMAS))}"
        raise ConfigError(f"job.name={job.name}: the job is chosen with job=NAME, not job.name; {what}")


def check_executor(e) -> None:
    check_value(e.name in EXECUTORS, "executor.name", f"must be one of {EXECUTORS} (set it with executor=NAME)", e.name)
    check_value(e.num_engines is None or e.num_engines >= 1, "executor.num_engines", "must be >= 1 or null (one per GPU)",
           e.num_engines)
    check_value(e.gpus_per_engine is None or e.gpus_per_engine >= 0, "executor.gpus_per_engine", "must be >= 0 or null",
                e.gpus_per_engine)
    check_value(e.batch_size >= 1, "executor.batch_size", "must be >= 1", e.batch_size)
    check_value(e.address is None or bool(e.address.strip()), "executor.address",
           "must be a Ray address such as auto or ray://host:10001, or null for a local Ray", e.address)


def engine_config_of(cfg) -> EngineConfig:
    """The engine's sections of a composed config as the engine's own EngineConfig (plain dataclasses)."""
    return EngineConfig(**{name: OmegaConf.to_object(cfg[name]) for name in ("model", "cache", "scheduler", "sampling")})


def validate(cfg) -> None:
    """Raise ConfigError naming the first field whose value cannot work: an unknown key, then the engine's
    sections (engine/config.py's check_engine_config), the executor and the job."""
    check_keys(cfg)
    check_engine_config(engine_config_of(cfg))
    for name in ("executor", "job"):
        check_finite(name, OmegaConf.to_container(cfg[name]))
    check_executor(cfg.executor)
    if cfg.job.name == "generate":
        j = cfg.job
        check_value(j.flush_every >= 1, "job.flush_every", "must be >= 1", j.flush_every)
        check_value(j.flush_interval_s >= 0, "job.flush_interval_s", "must be >= 0", j.flush_interval_s)
        check_value(bool(j.prompt_column), "job.prompt_column", "must name a column", j.prompt_column)
        check_value(j.id_column is None or bool(j.id_column), "job.id_column", "must name a column or be null", j.id_column)
        check_value(j.input is None or bool(j.input.strip()), "job.input",
               "is empty: give a Parquet or JSONL file, a directory or a glob (or leave it unset for the sample)", j.input)
        check_value(j.chat_template_kwargs is None or OmegaConf.is_dict(j.chat_template_kwargs), "job.chat_template_kwargs",
               "must be a mapping such as {enable_thinking: false}, or null", j.chat_template_kwargs)
        check_value(j.output_format in ("parquet", "openai"), "job.output_format", "must be 'parquet' or 'openai'", j.output_format)
        check_value(j.reasoning_parser is None or j.reasoning_parser in REASONING_PARSERS, "job.reasoning_parser",
               f"must be null or one of {', '.join(REASONING_PARSERS)}", j.reasoning_parser)
    if cfg.job.name == "analyze":
        j = cfg.job
        if not OmegaConf.is_missing(j, "root"):  # the job itself says how to set it
            check_value(bool(j.root.strip()), "job.root", "is empty: give a sweep directory, e.g. "
                        "job.root=multirun/bench/<time>", j.root)
        check_value(j.out is None or bool(j.out.strip()), "job.out", "must name a directory, or be null (job.root)",
                    j.out)
    if cfg.job.name == "bench":
        for key in ("input_len", "output_len"):
            lo_hi = list(cfg.job[key])
            check_value(len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1], f"job.{key}", "must be [min, max] with 1 <= min <= max", lo_hi)
        workloads = ("random", "nano", "long", "shared_prefix", "rollout")
        check_value(cfg.job.workload in workloads, "job.workload", f"must be one of {workloads}", cfg.job.workload)
        check_value(cfg.job.num_prompts >= 1, "job.num_prompts", "must be >= 1", cfg.job.num_prompts)
        check_value(cfg.job.baseline in ("none", "hf"), "job.baseline", "must be 'none' or 'hf'", cfg.job.baseline)
        check_value(cfg.job.hf_batch_size >= 1, "job.hf_batch_size", "must be >= 1", cfg.job.hf_batch_size)
        check_value(0 <= cfg.job.json_schemas <= 4, "job.json_schemas", "must be 0 (none) to 4", cfg.job.json_schemas)
