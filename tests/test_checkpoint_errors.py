"""A broken checkpoint directory stops the job with a message naming the file and what is wrong with it."""
import json
import re
import shutil

import pytest
import torch

from engine.errors import ConfigError
from engine.models.loader import build_model
from engine.models.registry import MODELS
from engine.tokenizer import load_tokenizer


def edit_config(**changes):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        config.update(changes)
        (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not ...}))
    return edit


def write(name: str, data: bytes):
    return lambda path: (path / name).write_bytes(data)


def truncate(name: str):
    return lambda path: (path / name).write_bytes((path / name).read_bytes()[:1000])


@pytest.mark.parametrize("damage, message", [
    (write("config.json", b'{"hidden_size": 96,, }'), r"config.json is not valid JSON \(Expecting property name"),
    (write("config.json", b"[96, 192]"), r"config.json holds a JSON list, not an object"),
    (edit_config(hidden_size=..., num_hidden_layers=...), r"config.json lacks hidden_size, num_hidden_layers$"),
    (edit_config(hidden_size="96", head_dim=0, rms_norm_eps=float("inf")),
     r"config.json has impossible values: hidden_size='96', head_dim=0, rms_norm_eps=inf$"),
    (edit_config(head_dim=23), r"config.json head_dim 23 is odd: RoPE rotates pairs of dimensions$"),
    (edit_config(architectures=["GPT2LMHeadModel"]), r"config.json: architecture 'GPT2LMHeadModel' is not supported "
                                                     + re.escape(f"(supported architectures: {', '.join(MODELS)})") + "$"),
    (edit_config(intermediate_size=128), r"model.safetensors holds model.layers.0.mlp.down_proj.weight of shape "
                                         r"\(96, 192\), which does not fit the shape config.json gives the model"),
    (write("model.safetensors", b"\x00" * 64), r"cannot read the weights in .*model.safetensors \(.*\)"),
    (truncate("model.safetensors"), r"cannot read the weights in .*model.safetensors \(.*\)"),
])
def test_a_broken_checkpoint_is_named(qwen3_checkpoint, tmp_path, make_config, damage, message):
    path = shutil.copytree(qwen3_checkpoint[0], tmp_path / "ckpt")
    damage(path)
    with pytest.raises(ConfigError, match=r"^model.path: .*" + message):
        build_model(make_config(f"model.path={path}").model, torch.device("cpu"), torch.float32)


def test_a_broken_tokenizer_is_named(qwen3_checkpoint, tmp_path, make_config):
    path = shutil.copytree(qwen3_checkpoint[0], tmp_path / "ckpt")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"}}')
    with pytest.raises(ConfigError, match=r"^model.path: cannot load the tokenizer in .*ckpt \("):
        load_tokenizer(make_config(f"model.path={path}").model)


def test_an_odd_head_dim_of_random_weights_is_named(make_config):
    with pytest.raises(ConfigError, match=r"^model.head_dim 3 is odd: RoPE rotates pairs of dimensions$"):
        build_model(make_config("model.head_dim=3").model, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("max_model_len, refused", [(257, True), (256, False)])
def test_a_max_model_len_past_the_checkpoints_positions_is_named(qwen3_checkpoint, tmp_path, make_config,
                                                                 max_model_len, refused):
    """The checkpoint says it holds 256 positions (max_position_embeddings): one more is refused up front, with
    the field and the bound; exactly its positions load, with a RoPE table of as many."""
    path = shutil.copytree(qwen3_checkpoint[0], tmp_path / "ckpt")
    edit_config(max_position_embeddings=256)(path)
    model_cfg = make_config(f"model.path={path}", f"model.max_model_len={max_model_len}").model
    if refused:
        with pytest.raises(ConfigError, match=r"^model.max_model_len 257 exceeds the checkpoint's "
                                              r"max_position_embeddings 256 \(model.path: .*config.json\): set "
                                              r"model.max_model_len to at most 256$"):
            build_model(model_cfg, torch.device("cpu"), torch.float32)
    else:
        model, _ = build_model(model_cfg, torch.device("cpu"), torch.float32)
        assert model.model.rotary.cos.shape[0] == 256
