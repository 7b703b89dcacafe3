"""A checkpoint's generation_config.json: its end-of-sequence ids and its sampling defaults.

The stop ids of a model are the union of config.json's and generation_config.json's eos_token_id (each
an int or a list; Qwen3's config.json names <|im_end|>, its generation_config.json <|endoftext|> too). As in
vLLM, which makes the ids other than the tokenizer's EOS stop ids, only the tokenizer's EOS ends a sample
without a stop_reason; the others report their id (silent_eos).
Sampling settings the user leaves unset (null sampling.* keys) take generation_config.json's values, as
vLLM does by default (its generation_config="auto"), else SamplingParams' defaults; the log names where
each one came from. sampling.use_generation_config=false uses only the config and the defaults.
"""
import logging
from pathlib import Path

from engine.config import set_sampling
from engine.errors import ConfigError
from engine.models.loader import eos_ids, model_spec, read_json_config, resolve_model_path
from engine.sequence import SamplingParams

log = logging.getLogger("minipaged")
FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field: the keys vLLM takes (get_diff_sampling_param)
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(path: Path | None) -> dict:
    """The checkpoint's generation_config.json as a dict; {} without a checkpoint or without the file."""
    file = path / FILE if path else None
    return read_json_config(file) if file is not None and file.is_file() else {}


def stop_ids(config_eos: list[int], generation: dict, logged: bool = True) -> frozenset[int]:
    """The union of config.json's and generation_config.json's end-of-sequence ids, logged."""
    generation_eos = eos_ids(generation.get("eos_token_id"))
    ids = frozenset(config_eos) | frozenset(generation_eos)
    if logged:
        log.info("end of sequence: token ids %s (config.json %s, %s %s)", sorted(ids), config_eos, FILE,
                 generation_eos)
    return ids


def silent_eos(eos_token_ids: frozenset[int], tokenizer_eos: int | None) -> frozenset[int]:
    """The end-of-sequence ids whose stop reports no stop_reason: the tokenizer's EOS where it is one of
    eos_token_ids (the others report their id, as vLLM's stop ids from generation_config.json), else all."""
    return frozenset({tokenizer_eos}) if tokenizer_eos in eos_token_ids else eos_token_ids


def model_stop_ids(model_cfg) -> frozenset[int]:
    """stop_ids of the model that model.* names, from its config files alone (no model built), unlogged."""
    path = resolve_model_path(model_cfg)
    return stop_ids(model_spec(model_cfg, path)[2], read_generation_config(path), logged=False)


def resolve_sampling(sampling_cfg, generation: dict) -> SamplingParams:
    """The run's SamplingParams: each field from the sampling.* key when set (not null), else from
    generation_config.json (when sampling.use_generation_config), else SamplingParams' default; logged."""
    from_config = set_sampling(sampling_cfg)
    from_checkpoint = {}
    if sampling_cfg.use_generation_config:
        from_checkpoint = {field: generation[key] for key, field in SAMPLING_KEYS.items()
                           if generation.get(key) is not None and field not in from_config}
    try:
        params = SamplingParams(**from_config, **from_checkpoint)
    except ValueError as err:
        raise ConfigError(f"sampling: {err} (the config's {from_config} with {FILE}'s {from_checkpoint})") from None
    log.info("sampling: %s from %s; %s from the config; SamplingParams' defaults for the rest",
             _listed(from_checkpoint), FILE if sampling_cfg.use_generation_config else f"{FILE} (sampling.use_generation_config=false)",
             _listed(from_config))
    return params


def _listed(values: dict) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in values.items()) or "nothing"
