"""Log-probabilities of output tokens (logprobs) and of prompt tokens (prompt_logprobs).

Oracles: log_softmax of transformers' float32 logits on the same checkpoint, over the prompt and the
outputs the engine drew (one forward); the raw distribution, before penalties, temperature and
truncation. For the kernel (under the interpreter on CPU): the PyTorch reference, itself checked
against float64 and a stable sort.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_fused import DEVICE, _PoisonedTorch, gen  # noqa: E402,F401  (gen: a fixture)

import ops  # noqa: E402
from engine import model_runner  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.sequence import SamplingParams  # noqa: E402
from ops import sampling_reference  # noqa: E402

TOLERANCE = 1e-4


def hf_log_softmax(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def check_rank(rank, expected, token):
    """rank: 1 + the tokens more likely than `token` in a row of expected log-probabilities, counted where
    the two differ by more than the tolerance (a near tie may count either way)."""
    value = expected[token]
    assert 1 + (expected > value + TOLERANCE).sum().item() <= rank <= 1 + (expected > value - TOLERANCE).sum().item()


def check_top(top, expected, k):
    """top: [(id, logprob)] against a row of expected log-probabilities: the k largest values, and
    their ids where the next value is not within the tolerance (a near tie may order either way)."""
    values, ids = expected.topk(k + 1)
    assert len(top) == k
    assert torch.allclose(torch.tensor([lp for _, lp in top]), values[:k], atol=TOLERANCE)
    for j, (token, _) in enumerate(top):
        if values[j] - values[j + 1] > TOLERANCE and (j == 0 or values[j - 1] - values[j] > TOLERANCE):
            assert token == ids[j].item()


def tiny_engine(make_config, path, *extra):
    return LLMEngine(make_config(f"model.path={path}", "model.max_model_len=128", "model.device=cpu",
                                 "model.dtype=float32", "cache.block_size=4", *extra))


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 2, 9, 23, 40)]


def test_output_logprobs_match_transformers(make_config, qwen3_checkpoint, prompts, one_thread):
    """Greedy, sampled, truncated and penalised rows in one chunked batch: each output token's
    logprob and the k most likely at its step, from the raw distribution."""
    path, hf_model = qwen3_checkpoint
    engine = tiny_engine(make_config, path, "scheduler.max_num_batched_tokens=16")
    settings = [dict(temperature=0.0, logprobs=0), dict(temperature=0.9, seed=4, logprobs=3),
                dict(temperature=1.0, top_k=5, seed=5, logprobs=5), dict(temperature=0.0, repetition_penalty=1.5,
                                                                       logprobs=2), dict(temperature=0.8)]
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=10, **s))
            for i, (p, s) in enumerate(zip(prompts, settings))]
    list(engine.run())
    for seq in seqs:
        k = seq.sampling.logprobs
        if k is None:
            assert seq.output_logprobs == seq.top_logprobs == []
            continue
        whole = [*seq.prompt_token_ids, *seq.output_token_ids]
        expected = hf_log_softmax(hf_model, whole)[len(seq.prompt_token_ids) - 1:]
        assert len(seq.output_logprobs) == len(seq.output_ranks) == len(seq.output_token_ids)
        for j, token in enumerate(seq.output_token_ids):
            assert abs(seq.output_logprobs[j] - expected[j, token].item()) < TOLERANCE
            check_rank(seq.output_ranks[j], expected[j], token)
        assert len(seq.top_logprobs) == (len(seq.output_token_ids) if k else 0)
        for j, top in enumerate(seq.top_logprobs):
            check_top(top, expected[j], k)
        if seq.sampling.temperature == 0 and k:  # greedy with logprobs: the drawn token is the top one
            assert [top[0][0] for top in seq.top_logprobs] == seq.output_token_ids or seq.sampling.repetition_penalty != 1


def test_the_cumulative_logprob_is_the_sum_of_the_tokens_logprobs(qwen3_checkpoint, one_thread):
    """vLLM's CompletionOutput.cumulative_logprob: the sum over the sample's tokens of transformers' log-softmax
    at each (a sampled row and a greedy one); None when no logprobs were asked for."""
    from engine import LLM

    path, hf_model = qwen3_checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    prompt = [5, 17, 99, 3]
    outs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=0),
                                       SamplingParams(max_tokens=8, logprobs=2), SamplingParams(max_tokens=8)])
    llm.close()
    for out in outs[:2]:
        tokens = out.outputs[0].token_ids
        expected = hf_log_softmax(hf_model, prompt + tokens)[len(prompt) - 1:]
        total = sum(expected[j, token].item() for j, token in enumerate(tokens))
        assert abs(out.outputs[0].cumulative_logprob - total) < TOLERANCE * len(tokens)
        for j, token in enumerate(tokens):  # vLLM's Logprob.rank, inside the k returned or not
            check_rank(out.outputs[0].logprobs[j][token].rank, expected[j], token)
    assert any(out.logprobs[j][t].rank > 1 for out in (outs[0].outputs[0],) for j, t in enumerate(out.token_ids))
    assert outs[2].outputs[0].cumulative_logprob is None


def test_each_logprob_carries_its_token_decoded_alone(qwen3_checkpoint, one_thread):
    """vLLM's Logprob.decoded_token: the token's text decoded alone (tokenizer.decode([token])), in the output's
    logprobs (the drawn token and the k most likely) and the prompt's."""
    from engine import LLM

    path, _ = qwen3_checkpoint
    llm = LLM(str(path), dtype="float32", device="cpu", max_model_len=64)
    out = llm.generate([[5, 17, 99, 3]], SamplingParams(max_tokens=6, temperature=1.0, seed=2, logprobs=3,
                                                        prompt_logprobs=2))[0]
    llm.close()
    positions = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    entries = [(token, entry) for position in positions for token, entry in position.items()]
    assert len(entries) >= 6 * 4 + 3 * 3 - 9  # the drawn or prompt token may be among the k most likely
    assert all(entry.decoded_token == llm.tokenizer.decode([token]) for token, entry in entries)
    assert out.prompt_logprobs[0] is None


def check_prompt_logprobs(seq, hf_model):
    prompt, k = seq.prompt_token_ids, seq.sampling.prompt_logprobs
    expected = hf_log_softmax(hf_model, prompt)
    assert len(seq.prompt_logprobs) == len(prompt) and seq.prompt_logprobs[0] is None
    assert len(seq.prompt_ranks) == len(prompt) and seq.prompt_ranks[0] is None
    for i in range(1, len(prompt)):
        assert abs(seq.prompt_logprobs[i] - expected[i - 1, prompt[i]].item()) < TOLERANCE
        check_rank(seq.prompt_ranks[i], expected[i - 1], prompt[i])
    if not k:
        assert seq.prompt_top_logprobs == []
        return
    assert len(seq.prompt_top_logprobs) == len(prompt) and seq.prompt_top_logprobs[0] is None
    for i in range(1, len(prompt)):
        check_top(seq.prompt_top_logprobs[i], expected[i - 1], k)


@pytest.mark.parametrize("pieces", [False, True], ids=["eager", "piecewise"])
def test_prompt_logprobs_match_transformers(make_config, qwen3_checkpoint, prompts, monkeypatch, one_thread, pieces):
    """Prompts cut into chunks of up to 16 tokens, their logits made 5 rows at a time; with the piecewise
    forward too (the prompt rows' hidden states come from its static buffer)."""
    path, hf_model = qwen3_checkpoint
    monkeypatch.setattr(model_runner, "PROMPT_ROWS", 5)
    engine = tiny_engine(make_config, path, "scheduler.max_num_batched_tokens=16", f"model.piecewise_graphs={pieces}")
    ks = [2, 0, 3, None, 1]
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=3, prompt_logprobs=k))
            for i, (p, k) in enumerate(zip(prompts, ks))]
    list(engine.run())
    for seq in seqs:
        if seq.sampling.prompt_logprobs is None:
            assert seq.prompt_logprobs == seq.prompt_top_logprobs == []
        else:
            check_prompt_logprobs(seq, hf_model)


def test_prompt_logprobs_are_computed_despite_the_prefix_cache_and_preemption(
    make_config, qwen3_checkpoint, prompts, one_thread
):
    """A prompt whose head is in the prefix cache is computed whole for its prompt_logprobs (a plain
    request with the same head hits the cache); a pool too small for the batch preempts sequences
    scoring their prompt, whose recomputed chunks fill nothing twice."""
    path, hf_model = qwen3_checkpoint
    engine = tiny_engine(make_config, path, "cache.enable_prefix_caching=true", "cache.num_blocks=24", "model.max_model_len=96",
                         "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=12",
                         "scheduler.admission_headroom=0", "cache.check_invariants=true")  # admissions fill the pool
    head = prompts[4]
    engine.add_request("head", head, SamplingParams(max_tokens=2))
    list(engine.run())
    seqs = [engine.add_request(f"score{i}", head + prompts[2][:i], SamplingParams(max_tokens=12, prompt_logprobs=2))
            for i in range(1, 4)]
    engine.add_request("plain", head + prompts[3][:5], SamplingParams(max_tokens=12))
    list(engine.run())
    steps = engine.stats.steps
    assert sum(s.prefix_cache_hit_tokens for s in steps) >= 36, "the plain request was meant to hit the cache"
    assert any(s.num_preemptions for s in seqs), "the pool was meant to preempt a scoring sequence"
    for seq in seqs:
        check_prompt_logprobs(seq, hf_model)


# --- the kernel ----------------------------------------------------------------------------
@pytest.fixture
def poisoned_outputs(monkeypatch):
    from ops import logprob_kernels

    monkeypatch.setattr(logprob_kernels, "torch", _PoisonedTorch())


def tied_logits(gen, B, V, pad):
    """bf16-valued N(0, 2^2) logits (ties common) as a view of a wider +inf buffer, with a constant
    row and a row whose largest values tie."""
    buf = torch.full((B, V + pad), float("inf"))
    buf[:, :V] = (torch.randn(B, V, generator=gen) * 2).bfloat16().float()
    buf[1, :V] = 0.5
    buf[2, torch.randperm(V, generator=gen)[:7]] = 9.0
    return buf.to(DEVICE)[:, :V]


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_kernel_matches_reference(gen, poisoned_outputs, k):
    from ops import logprob_kernels

    B, V = 5, 600
    logits = tied_logits(gen, B, V, pad=3)
    targets = torch.randint(0, V, (B,), generator=gen).to(DEVICE)
    expected = sampling_reference.logprobs(logits, targets, k)
    tight = dict(num_splits=4, block=16, num_warps=1)  # many tiles and ranges per row
    for cfg in (None, tight):
        got = logprob_kernels.logprobs(logits, targets, k, cfg=cfg)
        msg = f"seed={gen.initial_seed()} cfg={cfg}"
        assert got.shape == (B, 2 + 2 * k), msg
        for a, b in zip(ops.unpack_logprobs(got), ops.unpack_logprobs(expected)):
            assert torch.equal(a, b) if a.dtype == torch.int32 else torch.allclose(a, b, atol=1e-5), msg


def test_logprobs_reference_matches_float64_and_a_stable_sort(gen):
    B, V, k = 5, 600, 7
    logits = tied_logits(gen, B, V, pad=0)
    targets = torch.randint(0, V, (B,), generator=gen).to(DEVICE)
    target, rank, top, ids = ops.unpack_logprobs(sampling_reference.logprobs(logits, targets, k))
    exact = logits.double().log_softmax(-1)
    values, order = exact.sort(dim=-1, descending=True, stable=True)  # ties: the smaller id first
    assert torch.allclose(target.double(), exact.gather(1, targets[:, None])[:, 0], atol=1e-5)
    for b, t in enumerate(targets.tolist()):  # ties share the better rank
        row = logits[b].double().tolist()
        assert rank[b].item() == 1 + sum(value > row[t] for value in row)
    assert torch.allclose(top.double(), values[:, :k], atol=1e-5)
    assert torch.equal(ids.long(), order[:, :k])


def test_logprobs_rows_without_enough_finite_logits():
    logits = torch.full((2, 50), float("-inf"))
    logits[0, [4, 9]] = torch.tensor([1.0, 2.0])
    target, rank, top, ids = ops.unpack_logprobs(ops.logprobs(logits, torch.tensor([9, 0]), 3, backend="torch"))
    assert ids.tolist() == [[9, 4, -1], [-1, -1, -1]] and rank.tolist() == [1, 1]
    assert top[0, 2].item() == float("-inf") and abs(target[0].item() - (2 - torch.tensor([1.0, 2.0]).logsumexp(0))) < 1e-6
