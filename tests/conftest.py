import logging
import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from jobs.config import register_configs  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


@pytest.fixture
def make_config():
    """Compose the project's Hydra config with overrides, as `python -m engine.run` would."""

    def make(*overrides: str):
        with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
            return compose("config", overrides=list(overrides))

    return make


@pytest.fixture(autouse=True)
def no_log_handlers_on_closed_streams():
    """A job run in-process (tests/test_cli.py's run.main()) leaves Hydra's handlers on the root logger, one of
    them on the stdout that test captured, which pytest closes after it: a later test's first log line would
    print a "Logging error" traceback to stderr (a test that asserts a clean stderr failed on it)."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(getattr(h, "stream", None), "closed", False)]:
        root.removeHandler(handler)
    yield


@pytest.fixture(autouse=True, scope="session")
def gpu_shared_by_workers():
    """Under pytest-xdist on CUDA (`-n N`), each worker's engines size their KV pools from its share of the
    device memory, half of 1/N of cache.gpu_memory_utilization: N pools of the whole share cannot fit
    together, nor beside what the workers hold outside their pools (transformers' reference models, the
    kernel tests' operands, N CUDA contexts)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or not torch.cuda.is_available():
        yield
        return
    from engine import engine, model_runner

    def share(model, device, utilization, *args):
        return model_runner.kv_bytes_left(model, device, utilization / (2 * workers), *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "kv_bytes_left", share)
        yield


@pytest.fixture
def one_thread():
    """The tiny model gains nothing from threads, and loses much to OpenMP waits on a busy 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def draw_norm_weights(model, seed: int = 6):
    """Every RMSNorm weight of a transformers model drawn in [0.5, 1.5] (they start at ones, which would
    let a wrong fold of them into the projections pass). The seed is one whose checkpoints give no reference
    near-tied logits (the oracle tests refuse those: seeds 0, 2-5 gave some)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
    return model


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    """A small random Qwen3 saved by transformers (weights, config, byte-level tokenizer), and the model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine.tokenizer import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=2048,
        initializer_range=0.2, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1234)
    model = draw_norm_weights(Qwen3ForCausalLM(config)).eval()
    path = tmp_path_factory.mktemp("qwen3-tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% if brief %}(briefly){% endif %}{% endif %}")


@pytest.fixture(scope="session")
def chat_checkpoint(qwen3_checkpoint, tmp_path_factory):
    """qwen3_checkpoint with a chat template in its tokenizer (one keyword: brief)."""
    import shutil

    from transformers import AutoTokenizer

    source, _ = qwen3_checkpoint
    path = tmp_path_factory.mktemp("qwen3-chat")
    shutil.copytree(source, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path
