"""model.max_model_len: the value set, or null (the default preset's) for the checkpoint's context, its
config.json's max_position_embeddings, and 2048 for random weights; resolved once, as the engine is built."""
import json
import logging
import shutil

import pytest

from engine import LLM, SamplingParams
from engine.config import engine_config
from engine.engine import LLMEngine
from engine.errors import ConfigError, RequestError
from jobs import JobError
from jobs.bench import run as run_bench
from jobs.config import engine_config_of

OPTIONS = dict(device="cpu", dtype="float32", max_num_seqs=2)


def with_positions(path, positions):
    """The checkpoint at `path` with config.json's max_position_embeddings set to `positions` (...: removed)."""
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return path


@pytest.fixture(scope="module")
def long_checkpoint(qwen3_checkpoint, tmp_path_factory):
    """qwen3_checkpoint saying it holds 4096 positions (above the random weights' 2048)."""
    return with_positions(shutil.copytree(qwen3_checkpoint[0], tmp_path_factory.mktemp("long") / "ckpt"), 4096)


def test_a_checkpoint_takes_its_own_context(long_checkpoint, caplog):
    """LLM(checkpoint) leaves model.max_model_len null (tiny's preset): the engine takes the checkpoint's 4096,
    says so, and runs a prompt longer than 2048 tokens, which the old default (2048) refused."""
    assert engine_config(str(long_checkpoint)).model.max_model_len is None
    with caplog.at_level(logging.INFO, logger="minipaged"):
        llm = LLM(str(long_checkpoint), **OPTIONS)
    assert "model.max_model_len 4096: the checkpoint's max_position_embeddings" in caplog.messages
    assert llm.engine.max_model_len == llm.cfg.model.max_model_len == llm.settings().max_model_len == 4096
    prompt = [(7 * i) % 256 for i in range(3000)]
    [out] = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(RequestError, match=r"prompt has 4096 tokens; model.max_model_len 4096 leaves no room"):
        llm.generate([prompt + prompt[:1096]], SamplingParams(max_tokens=1))


def test_a_set_value_within_the_checkpoints_context_is_kept(long_checkpoint, caplog):
    with caplog.at_level(logging.INFO, logger="minipaged"):
        llm = LLM(str(long_checkpoint), max_model_len=1024, **OPTIONS)
    assert llm.engine.max_model_len == 1024
    assert "model.max_model_len 1024: as set" in caplog.messages


def test_a_set_value_past_the_checkpoints_context_is_refused(long_checkpoint):
    with pytest.raises(ConfigError, match=r"^model.max_model_len 4097 exceeds the checkpoint's max_position_embeddings "
                                          r"4096 \(model.path: .*config.json\): set model.max_model_len to at most 4096$"):
        LLM(str(long_checkpoint), max_model_len=4097, **OPTIONS)


def test_random_weights_take_2048_unless_set(caplog):
    """The tiny preset's null is 2048 for random weights; a real shape's preset keeps its own 4096."""
    with caplog.at_level(logging.INFO, logger="minipaged"):
        assert LLM("tiny", **OPTIONS).engine.max_model_len == 2048
    assert "model.max_model_len 2048: the default for random weights" in caplog.messages
    assert LLM("tiny", max_model_len=4096, **OPTIONS).engine.max_model_len == 4096
    assert engine_config("qwen3-0.6b").model.max_model_len == 4096


@pytest.mark.parametrize("positions, found", [(..., "none"), (0, "0")])
def test_a_checkpoint_without_a_context_needs_a_set_value(qwen3_checkpoint, tmp_path, positions, found):
    """Without a positive max_position_embeddings null has nothing to take: the error names the key to set; a
    set value then loads (nothing to check it against)."""
    path = with_positions(shutil.copytree(qwen3_checkpoint[0], tmp_path / "ckpt"), positions)
    with pytest.raises(ConfigError, match=r"^model.max_model_len is null, which takes the checkpoint's "
                                          rf"max_position_embeddings, but model.path: .*config.json has {found}: "
                                          r"set model.max_model_len$"):
        LLM(str(path), **OPTIONS)
    assert LLM(str(path), max_model_len=64, **OPTIONS).engine.max_model_len == 64


def test_the_command_lines_config_takes_the_checkpoints_context(long_checkpoint, make_config):
    """Composed by Hydra (model.path on the default preset), as the engine and as the batch layer's LLM get it."""
    cfg = make_config(f"model.path={long_checkpoint}", "model.device=cpu", "model.dtype=float32",
                      "scheduler.max_num_seqs=2")
    assert cfg.model.max_model_len is None
    assert LLMEngine(cfg).max_model_len == 4096
    assert cfg.model.max_model_len is None  # the engine resolved a copy
    assert LLM.from_config(engine_config_of(cfg)).settings().max_model_len == 4096


@pytest.mark.parametrize("path", [False, True])
def test_the_bench_checks_its_workload_against_the_context_in_effect(qwen3_checkpoint, make_config, path):
    """Before any engine is built: null is 2048 for random weights and for the checkpoint that holds 2048."""
    overrides = [f"model.path={qwen3_checkpoint[0]}"] if path else []
    with pytest.raises(JobError, match=r"requests of up to 4096 tokens .* need model.max_model_len >= 4096, it is 2048$"):
        run_bench(make_config("job=bench", "job.workload=long", *overrides))
