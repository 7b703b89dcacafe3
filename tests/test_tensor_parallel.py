"""Tensor parallelism on the CPU (engine/parallel.py, engine/models/tensor_parallel.py): the model split over
two gloo processes gives greedy float32 outputs token-exact with transformers' unsplit model, with prefix
caching, preemption, n > 1 and a mixture of experts; a worker that dies stops the run naming it, and a job
keeps the rows that finished before."""
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import draw_norm_weights
from engine import parallel
from engine.errors import ConfigError
from engine.llm import LLM, SamplingParams
from engine.models import loader
from engine.models.loader import build_model
from engine.models.tensor_parallel import Collectives
from engine.parallel import WorkerError
from jobs.generate import generate_job
from test_moe import moe_checkpoint
from test_oracle import MAX_TOKENS, reference_outputs
from test_resume import ENV, ROOT, job_args, wait_for_parts

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@contextmanager
def split_llm(path, **options):
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=128, tensor_parallel_size=2, **options)
    try:
        yield llm
    finally:
        llm.close()
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def prompts_and_reference(qwen3_checkpoint):
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 5, 17, 40, 63)]
    outputs, gap = reference_outputs(qwen3_checkpoint[1], prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    return prompts, outputs


def token_ids(outputs):
    return [[sample.token_ids for sample in out.outputs] for out in outputs]


def test_two_ranks_match_transformers_with_prefix_caching_and_n_samples(qwen3_checkpoint, prompts_and_reference):
    """Each rank holds 2 of 4 query heads, 1 of 2 KV heads, half the MLP and half the vocabulary (257 tokens:
    the second half padded); the second pass over the same prompts starts from the prefix cache; n = 2
    greedy samples each equal the reference."""
    prompts, expected = prompts_and_reference
    with split_llm(qwen3_checkpoint[0]) as llm:
        assert [w.is_alive() for w in llm.engine.model.workers] == [True]
        assert llm.engine.model.kv_cache_spec.num_kv_heads == 1
        assert token_ids(llm.generate(prompts, GREEDY)) == [[e] for e in expected]
        again = token_ids(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)))
        assert again == [[e, e] for e in expected]
        assert llm.stats().figures["prefix_cache_hit_tokens"] > 0


def test_two_ranks_match_transformers_when_the_pool_preempts(qwen3_checkpoint, prompts_and_reference):
    prompts, expected = prompts_and_reference
    # 128 slots for 1-63 + 24 tokens each, filled by admissions that keep no headroom for growth
    with split_llm(qwen3_checkpoint[0], block_size=4, num_blocks=32, admission_headroom=0) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == [[e] for e in expected]
        assert llm.stats().figures["preemptions"] > 0, "the pool was meant to preempt"


def test_two_ranks_in_decode_runs_match_transformers(qwen3_checkpoint, prompts_and_reference):
    """Runs of 4 device steps a scheduling (scheduler.num_scheduler_steps, on by default on CUDA): each step's
    tokens go to the workers' next forward without the host."""
    prompts, expected = prompts_and_reference
    with split_llm(qwen3_checkpoint[0], num_scheduler_steps=4) as llm:
        assert token_ids(llm.generate(prompts, GREEDY)) == [[e] for e in expected]


def test_two_ranks_of_a_mixture_of_experts_match_transformers(tmp_path):
    """Each rank holds half of every expert's width (48 -> 24), the router whole."""
    path, hf_model = moe_checkpoint(tmp_path / "moe")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (2, 9, 30)]
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    with split_llm(path) as llm:
        assert llm.engine.model.local.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 48, 96)
        assert token_ids(llm.generate(prompts, GREEDY)) == [[e] for e in expected]


def test_two_ranks_of_a_llama_with_biases_and_an_untied_head_match_transformers(tmp_path):
    """Llama 3's RoPE, an untied head, and every projection with a bias drawn non-zero: q/k/v's and gate/up's
    split with their rows, o's and down's added once, after the sum."""
    from test_models import llama, save

    torch.manual_seed(99)
    hf_model = draw_norm_weights(llama(attention_bias=True, mlp_bias=True)).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
    path = save(hf_model, tmp_path / "llama")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (3, 12, 33)]
    expected, gap = reference_outputs(hf_model, prompts)
    assert gap > 1e-3, f"the reference has near-tied logits (gap {gap}): a weak oracle"
    with split_llm(path) as llm:
        attn = llm.engine.model.local.model.layers[0].self_attn
        assert attn.qkv_proj.output_sizes == [32, 16, 16] and attn.o_proj.bias is not None
        assert token_ids(llm.generate(prompts, GREEDY)) == [[e] for e in expected]


def test_a_rank_builds_only_its_share(make_config, monkeypatch):
    """build_model for rank 1 of 2 (no collective runs while building): every layer keeps its share as soon
    as it is finished, before the next is drawn, and the shares are the unsplit model's slices, cut here by
    hand: q, k and v by heads and gate and up by columns (the second half of each), o and down by input
    columns, the embedding and the head by vocabulary (257 rows: rank 1's 129 padded with one zero row)."""
    cfg = make_config("model.num_hidden_layers=3").model
    whole, _ = build_model(cfg, torch.device("cpu"), torch.float32)
    parts_of, draw, shards_seen, built = loader.model_parts, loader.init_random_weights, [], {}

    def recording_parts(model):
        built["layers"] = model.model.layers
        return parts_of(model)

    def recording_draw(part, *args):
        shards_seen.append([layer.self_attn.qkv_proj.out_features for layer in built["layers"]])
        draw(part, *args)

    monkeypatch.setattr(loader, "model_parts", recording_parts)
    monkeypatch.setattr(loader, "init_random_weights", recording_draw)
    group = Collectives(1, 2, all_reduce=lambda t: None, all_gather=lambda t: t)
    share, _ = build_model(cfg, torch.device("cpu"), torch.float32, group)
    full = whole.model.layers[0].self_attn.qkv_proj.out_features
    assert shards_seen[1:4] == [[full] * 3, [full // 2] + [full] * 2, [full // 2] * 2 + [full]]
    arch = whole.arch
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    for mine, theirs in zip(share.model.layers, whole.model.layers):
        w = theirs.self_attn.qkv_proj.weight
        expected = torch.cat([w[q // 2:q], w[q + kv // 2:q + kv], w[q + kv + kv // 2:]])
        assert torch.equal(mine.self_attn.qkv_proj.weight, expected)
        assert torch.equal(mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight[:, q // 2:])
        i = arch.intermediate_size
        gate_up = theirs.mlp.gate_up_proj.weight
        assert torch.equal(mine.mlp.gate_up_proj.weight, torch.cat([gate_up[i // 2:i], gate_up[i + i // 2:]]))
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight[:, i // 2:])
        assert mine.all_reduce is group.all_reduce
    embedding = share.model.embed_tokens.weight
    assert embedding.shape == (129, arch.hidden_size) and share.model.embed_tokens.start == 129
    assert torch.equal(embedding[:128], whole.model.embed_tokens.weight[129:]) and not embedding[128].any()
    assert torch.equal(share.lm_head.weight[:128], whole.lm_head.weight[129:])
    assert share.kv_cache_spec.num_kv_heads == arch.num_key_value_heads // 2


def test_a_size_that_does_not_divide_the_heads_is_named(qwen3_checkpoint, capfd):
    with pytest.raises(ConfigError, match=r"^model.tensor_parallel_size 3 must divide the model's "
                                          r"num_attention_heads \(4\), num_key_value_heads \(2\)"):
        LLM(str(qwen3_checkpoint[0]), dtype="float32", device="cpu", tensor_parallel_size=3)
    assert not torch.distributed.is_initialized()  # the workers stopped: another engine can start
    assert "Traceback" not in capfd.readouterr().err  # found before any rank started, which printed one each
    with pytest.raises(ConfigError, match=r"model.tensor_parallel_size must be >= 1, got 0"):
        LLM(str(qwen3_checkpoint[0]), device="cpu", tensor_parallel_size=0)


def test_an_engine_that_fails_after_its_model_stops_its_workers(qwen3_checkpoint, tmp_path):
    """The tokenizer is loaded after the model's ranks started: its error leaves no group or worker behind."""
    with pytest.raises(ConfigError, match="model.tokenizer"):
        LLM(str(qwen3_checkpoint[0]), dtype="float32", device="cpu", tensor_parallel_size=2,
            tokenizer=str(tmp_path / "missing"))
    gc.collect()
    assert not torch.distributed.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minipaged-tp-")]


def test_a_worker_that_dies_stops_the_run_naming_it(qwen3_checkpoint, prompts_and_reference):
    prompts, _ = prompts_and_reference
    with split_llm(qwen3_checkpoint[0]) as llm:
        worker = llm.engine.model.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        with pytest.raises(WorkerError, match=rf"^tensor parallel: the worker of rank 1 \(pid {worker.pid}\) exited "
                                              rf"with code -9; the run stops$"):
            llm.generate(prompts, GREEDY)


def test_a_job_whose_worker_dies_keeps_its_finished_rows(make_config, tmp_path, monkeypatch):
    """Requests of 2, 4, ... 12 output tokens; the worker is killed before the 8th forward: the rows that
    finished before are saved, each as the same job on one rank writes it."""
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(6)], "max_tokens": [2 * (i + 1) for i in range(6)]}),
                   source)
    overrides = [f"job.input={source}", "model.device=cpu", "job.flush_every=1", "sampling.temperature=0"]
    for run in ("whole", "split"):
        (tmp_path / run).mkdir()
    generate_job(make_config(*overrides), tmp_path / "whole")
    whole = pq.read_table(tmp_path / "whole" / "generations.parquet").to_pylist()
    forward, calls = parallel.TensorParallelModel.__call__, []

    def forward_then_die(model, *args):
        calls.append(1)
        if len(calls) == 8:
            os.kill(model.workers[0].pid, signal.SIGKILL)
            model.workers[0].join(30)
        return forward(model, *args)

    monkeypatch.setattr(parallel.TensorParallelModel, "__call__", forward_then_die)
    with pytest.raises(WorkerError, match=r"^tensor parallel: the worker of rank 1 \(pid \d+\) exited with code -9"):
        generate_job(make_config(*overrides, "model.tensor_parallel_size=2"), tmp_path / "split")
    assert not torch.distributed.is_initialized()
    saved = pq.read_table(tmp_path / "split" / "generations.parts").to_pylist()
    assert 1 <= len(saved) < 6
    for row in saved:
        assert row["output_token_ids"] == whole[row["row"]]["output_token_ids"]


def test_a_terminals_ctrl_c_stops_a_split_job_once_with_its_rows_saved(tmp_path):
    """A terminal sends Ctrl-C to the whole process group, workers included: rank 0 saves the finished rows and
    says so, the workers leave it to rank 0 (they ran the start-up's handler of it: "nothing was saved")."""
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"prompt number {i}" for i in range(120)]}), prompts)
    proc = subprocess.Popen([*job_args(prompts, run_dir, 60), "model.tensor_parallel_size=2"], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_parts(run_dir, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        f"error: interrupted by SIGINT: finished rows are saved in {run_dir / 'generations.parts'}; run again with "
        f"hydra.run.dir={run_dir} to resume"], err
    assert "Traceback" not in out + err


def test_a_split_model_that_does_not_fit_is_one_line_a_rank(tmp_path):
    """Each rank checks its share before it builds: a refusal is its one line (the worker's names its rank), not a
    worker's traceback."""
    result = subprocess.run([sys.executable, "-m", "engine.run", "model=llama-3.3-70b", "model.device=cpu",
                             "model.dtype=float32", "model.tensor_parallel_size=2", f"hydra.run.dir={tmp_path}"],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(errors) == 2, errors
    assert errors[0].startswith("error: tensor parallel rank 1: model=llama-3.3-70b in float32"), errors
    assert errors[1].startswith("error: model=llama-3.3-70b in float32") and "model.tensor_parallel_size=1" in errors[1]
