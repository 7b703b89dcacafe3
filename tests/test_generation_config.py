"""A checkpoint's generation_config.json: its eos_token_id joins config.json's as stop ids, and its sampling
values are the defaults of the keys the config leaves null (sampling.use_generation_config=false: not), logged."""
import json
import logging
import shutil
from pathlib import Path

import pytest
from test_oracle import MAX_TOKENS

from engine import LLM, SamplingParams
from engine.config import engine_config
from engine.errors import ConfigError


@pytest.fixture
def checkpoint(qwen3_checkpoint, tmp_path):
    """A copy of qwen3_checkpoint whose generation_config.json is replaced by write(**values)."""
    source, _ = qwen3_checkpoint
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)

    def write(**values):
        (tmp_path / "generation_config.json").write_text(json.dumps(values))
        return str(tmp_path)

    return write


def llm(path, **options):
    return LLM(model=path, dtype="float32", max_model_len=128, device="cpu", **options)


def test_eos_ids_are_the_union_of_both_files(checkpoint, qwen3_checkpoint, caplog):
    _, hf_model = qwen3_checkpoint
    prompt = [5, 6, 7, 8]
    full = llm(checkpoint()).generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    ids = full.outputs[0].token_ids
    config_eos = hf_model.config.eos_token_id
    extra = next(t for t in ids[2:] if t != config_eos and t not in ids[:2])  # first drawn at output index >= 2
    absent = next(t for t in range(256) if t not in ids)
    with caplog.at_level(logging.INFO, logger="minipaged"):
        model = llm(checkpoint(eos_token_id=[extra, absent]))
    assert model.engine.eos_token_ids == {config_eos, extra, absent}
    assert f"end of sequence: token ids {sorted({config_eos, extra, absent})} (config.json [{config_eos}], " \
           f"generation_config.json [{extra}, {absent}])" in caplog.text
    out = model.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0].outputs[0]
    # generation_config.json's id beside the tokenizer's EOS is a stop id to vLLM: it reports itself
    assert model.engine.tokenizer.eos_token_id == config_eos and model.engine.silent_eos == {config_eos}
    assert out.token_ids == ids[:ids.index(extra) + 1] and out.finish_reason == "stop" and out.stop_reason == extra
    ignoring = model.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].outputs[0]
    assert ignoring.token_ids == ids and ignoring.finish_reason == "length"
    assert llm(checkpoint(eos_token_id=extra)).engine.eos_token_ids == {config_eos, extra}  # an int, not a list


def test_unset_sampling_keys_take_the_checkpoints_values(checkpoint, caplog):
    path = checkpoint(temperature=0.7, top_k=5, top_p=0.8, max_new_tokens=9, do_sample=True, eos_token_id=256)
    with caplog.at_level(logging.INFO, logger="minipaged"):
        model = llm(path)
    assert model.default_sampling == SamplingParams(temperature=0.7, top_k=5, top_p=0.8, max_tokens=9)
    assert "sampling: temperature=0.7, top_p=0.8, top_k=5, max_tokens=9 from generation_config.json; nothing from " \
           "the config" in caplog.text
    cfg = engine_config(path, dtype="float32", max_model_len=128, device="cpu")
    cfg.sampling.temperature, cfg.sampling.seed = 0.2, 3  # set by the user: the config wins
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="minipaged"):
        chosen = LLM.from_config(cfg).default_sampling
    assert chosen == SamplingParams(temperature=0.2, top_k=5, top_p=0.8, max_tokens=9, seed=3)
    assert "top_p=0.8, top_k=5, max_tokens=9 from generation_config.json; temperature=0.2, seed=3 from the config" \
           in caplog.text
    cfg.sampling.use_generation_config = False
    assert LLM.from_config(cfg).default_sampling == SamplingParams(temperature=0.2, seed=3)
    outputs = llm(path).generate(["abc"])[0].outputs[0]  # the defaults are what generate() uses without params
    assert len(outputs.token_ids) <= 9


def test_a_bad_generation_config_is_named(checkpoint):
    with pytest.raises(ConfigError, match=r"sampling: top_p must be in \(0, 1\], got 1.5 \(the config's \{\} with "
                                          r"generation_config.json's \{'top_p': 1.5\}\)"):
        llm(checkpoint(top_p=1.5))
    path = Path(checkpoint()) / "generation_config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=rf"model.path: {path} is not valid JSON \(Expecting property name"):
        llm(str(path.parent))


def test_only_the_tokenizers_eos_ends_a_sample_without_a_stop_reason():
    from engine.generation_config import silent_eos

    assert silent_eos(frozenset({7, 9}), 9) == {9}
    assert silent_eos(frozenset({7, 9}), 3) == {7, 9}  # the tokenizer's is none of them: all, as before
    assert silent_eos(frozenset({7, 9}), None) == {7, 9}
