"""model.path as a Hugging Face id, resolved from a hub cache laid out in the hub's documented format
(HF_HUB_CACHE/models--{org}--{name}/{blobs, refs/main, snapshots/<commit>/<file>}) with the network off:
no test here touches the network."""
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from huggingface_hub import constants

from engine.errors import ConfigError
from engine.models import loader
from engine.models.loader import build_model, resolve_model_path
from engine.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
REPO_ID = "test-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out_hub_cache(cache: Path, repo_id: str, checkpoint: Path) -> Path:
    """The checkpoint as the hub stores a download: each file's bytes in blobs/<sha256>, the snapshot's files
    symlinks to them (the weights and config) or plain copies (the tokenizer files, as on filesystems
    without symlinks), refs/main naming the commit. Returns the snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for directory in (repo / "blobs", repo / "refs", snapshot):
        directory.mkdir(parents=True)
    for file in checkpoint.iterdir():
        if file.name.startswith("tokenizer"):
            shutil.copyfile(file, snapshot / file.name)
            continue
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty hub cache, with the hub offline; huggingface_hub reads its environment when imported, so
    in this process its constants are patched (the CLI test below sets the environment instead)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_loads_the_same_model_and_tokenizer_as_its_directory(qwen3_checkpoint, offline_cache, make_config):
    path, _ = qwen3_checkpoint
    snapshot = lay_out_hub_cache(offline_cache, REPO_ID, path)
    hub_cfg = make_config(f"model.path={REPO_ID}").model
    dir_cfg = make_config(f"model.path={path}").model
    assert resolve_model_path(hub_cfg) == snapshot
    hub_model, hub_eos = build_model(hub_cfg, torch.device("cpu"), torch.float32)
    dir_model, dir_eos = build_model(dir_cfg, torch.device("cpu"), torch.float32)
    assert hub_eos == dir_eos
    for (name, hub_param), dir_param in zip(hub_model.state_dict().items(), dir_model.state_dict().values()):
        assert torch.equal(hub_param, dir_param), name
    hub_tokenizer, dir_tokenizer = load_tokenizer(hub_cfg), load_tokenizer(dir_cfg)
    assert Path(hub_tokenizer.name_or_path) == snapshot
    text = "Paged attention, offline: ça marche."
    assert hub_tokenizer.encode(text) == dir_tokenizer.encode(text)


def test_a_hub_id_neither_local_nor_cached_says_how_to_get_it(offline_cache, make_config):
    with pytest.raises(ConfigError) as err:
        resolve_model_path(make_config("model.path=test-org/absent").model)
    message = str(err.value)
    assert message.startswith("model.path 'test-org/absent' is neither a directory nor in the local Hugging Face "
                              f"cache ({offline_cache}), and HF_HUB_OFFLINE is set")
    assert "`hf download test-org/absent`" in message and "HF_HUB_CACHE" in message


def test_a_path_that_is_no_directory_and_no_hub_id(make_config, tmp_path):
    with pytest.raises(ConfigError, match=r"model.path '.*/a/b/c' is not a directory \(nor a Hugging Face id"):
        resolve_model_path(make_config(f"model.path={tmp_path / 'a/b/c'}").model)


def test_a_hub_id_is_resolved_once_and_fetches_only_checkpoint_files(qwen3_checkpoint, tmp_path, monkeypatch,
                                                                      make_config):
    path, _ = qwen3_checkpoint
    calls = []

    def snapshot_download(repo_id, cache_dir, allow_patterns):
        calls.append(allow_patterns)
        return str(path)

    monkeypatch.setattr(loader, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # a cache of its own: nothing resolved yet
    cfg = make_config("model.path=test-org/counted").model
    build_model(cfg, torch.device("cpu"), torch.float32)
    load_tokenizer(cfg)
    assert len(calls) == 1

    def fetched(name: str) -> bool:
        return any(fnmatch.fnmatch(name, pattern) for pattern in calls[0])

    assert all(fetched(file.name) for file in path.iterdir())  # what save_pretrained wrote: all of it is needed
    assert all(fetched(name) for name in ("generation_config.json", "model-00001-of-00002.safetensors",
                                          "model.safetensors.index.json", "vocab.json", "merges.txt"))
    assert not any(fetched(name) for name in ("pytorch_model.bin", "model.onnx", "README.md", "original/consolidated.pth"))


def test_the_cli_runs_a_hub_id_offline_as_it_runs_the_directory(qwen3_checkpoint, tmp_path):
    path, _ = qwen3_checkpoint
    lay_out_hub_cache(tmp_path / "hub", REPO_ID, path)
    pq.write_table(pa.table({"prompt": ["hello", "paged attention", "a third prompt"]}), tmp_path / "in.parquet")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    runs = {name: subprocess.Popen(
        [sys.executable, "-m", "engine.run", f"model.path={model}", f"job.input={tmp_path / 'in.parquet'}",
         f"hydra.run.dir={tmp_path / name}", "model.device=cpu", "model.max_model_len=64",
         "sampling.max_tokens=6", "sampling.ignore_eos=true"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, model in (("hub", REPO_ID), ("dir", path))}
    for name, proc in runs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err)
    hub, local = (pq.read_table(tmp_path / name / "generations.parquet").to_pylist() for name in ("hub", "dir"))
    assert [row["output_token_ids"] for row in hub] == [row["output_token_ids"] for row in local]
    assert all(len(row["output_token_ids"]) == 6 for row in hub)
