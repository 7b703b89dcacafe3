"""Logit processors: min_tokens and the repetition, presence and frequency penalties.

Oracle: transformers' greedy generate on the same float32 checkpoint, with its own logits processors
(repetition_penalty, min_new_tokens) and, for presence/frequency, a LogitsProcessor written here from
OpenAI's formula. The engine runs one step ahead (a sequence's newest token is a placeholder while its
next one is drawn), so these runs also check that tokens still on the device are counted. The
reference's processed scores keep a top-1/top-2 gap (checked), so a mismatch is a bug, not rounding.
"""
from types import SimpleNamespace

import pytest
import torch
from test_fused import gen  # noqa: F401  (a fixture)
from transformers import LogitsProcessor, LogitsProcessorList

from engine.engine import LLMEngine
from engine.sampler import SamplingTensors, TokenHistory, processed_logits
from engine.sequence import PLACEHOLDER, SamplingParams, Sequence, Status
from ops import sampling_reference

PROMPT_LENGTHS = (1, 4, 13, 30)
MAX_TOKENS = 20


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.presence * (counts > 0) - self.frequency * counts


def hf_greedy(hf_model, prompt, params: SamplingParams, eos_token_ids):
    """transformers' greedy generate with the processors matching params, and its smallest score gap."""
    processors = LogitsProcessorList()
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequency(len(prompt), params.presence_penalty, params.frequency_penalty))
    result = hf_model.generate(
        torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False, output_scores=True,
        return_dict_in_generate=True, repetition_penalty=params.repetition_penalty,
        min_new_tokens=params.min_tokens, eos_token_id=[*eos_token_ids, *params.stop_token_ids],
        logits_processor=processors)
    gaps = [(lambda top2: (top2[0] - top2[1]).item())(s[0].float().topk(2).values) for s in result.scores]
    return result.sequences[0, len(prompt):].tolist(), min(gaps)


def engine_outputs(config, prompts, params):
    engine = LLMEngine(config)
    seqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    assert len(list(engine.run())) == len(prompts)
    return [s.output_token_ids for s in seqs], engine


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def tiny_config(make_config, path, *extra):
    return make_config(f"model.path={path}", "model.max_model_len=128", "model.device=cpu", "model.dtype=float32",
                       "cache.block_size=4", *extra)


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.8),
    dict(repetition_penalty=0.7),
    dict(presence_penalty=1.5, frequency_penalty=0.8),
    dict(repetition_penalty=1.3, presence_penalty=-0.5, frequency_penalty=0.6),
])
def test_penalties_match_transformers(make_config, qwen3_checkpoint, prompts, penalties, one_thread):
    path, hf_model = qwen3_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **penalties)
    config = tiny_config(make_config, path, "scheduler.max_num_batched_tokens=16")  # chunked prompts
    outputs, engine = engine_outputs(config, prompts, params)
    plain, _ = engine_outputs(config, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert outputs != plain, "the penalties were meant to change the outputs"
    for prompt, output in zip(prompts, outputs):
        expected, gap = hf_greedy(hf_model, prompt, params, engine.eos_token_ids)
        assert gap > 1e-3, f"near-tied reference scores (gap {gap}): a weak oracle"
        assert output == expected


def test_penalties_survive_preemption_and_mix_with_plain_rows(make_config, qwen3_checkpoint, prompts, one_thread):
    """A small pool forces preemption (recompute: the slot of token ids is kept); penalised rows share
    batches with plain ones."""
    path, hf_model = qwen3_checkpoint
    config = tiny_config(make_config, path, "cache.num_blocks=16", "model.max_model_len=64", "scheduler.max_num_seqs=4",
                         "scheduler.max_num_batched_tokens=16", "scheduler.admission_headroom=0",  # admissions fill it
                         "cache.check_invariants=true")
    penalised = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.5, frequency_penalty=0.5)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine = LLMEngine(config)
    params = [penalised if i % 2 == 0 else plain for i in range(2 * len(prompts))]
    seqs = [engine.add_request(str(i), prompts[i // 2], p) for i, p in enumerate(params)]
    list(engine.run())
    assert sum(s.preemptions for s in engine.stats.steps) > 0, "the pool was meant to force preemption"
    for seq in seqs:
        expected, gap = hf_greedy(hf_model, seq.prompt_token_ids, seq.sampling, engine.eos_token_ids)
        assert gap > 1e-3, f"near-tied reference scores (gap {gap}): a weak oracle"
        assert seq.output_token_ids == expected


def test_min_tokens_bans_stop_ids_until_reached(make_config, qwen3_checkpoint, prompts, one_thread):
    """A stop id that greedy decoding reaches early (at output index j) ends the output there with
    min_tokens j (the boundary: outputs 0..j-1 banned), and cannot end it before min_tokens j + 1 or
    j + 6 (then it stops it as usual)."""
    path, hf_model = qwen3_checkpoint
    config = tiny_config(make_config, path)
    free, engine = engine_outputs(config, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    for prompt, output in zip(prompts, free):
        j = next(j for j in range(2, MAX_TOKENS) if output[j] not in output[:j])
        for min_tokens in (j, j + 1, j + 6):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=(output[j],),
                                    min_tokens=min_tokens)
            (banned,), _ = engine_outputs(config, [prompt], params)
            expected, gap = hf_greedy(hf_model, prompt, params, engine.eos_token_ids)
            assert gap > 1e-3, f"near-tied reference scores (gap {gap}): a weak oracle"
            assert banned == expected
            if min_tokens == j:
                assert banned == output[:j + 1]
            else:
                assert len(banned) >= min(min_tokens, MAX_TOKENS) and output[j] not in banned[:min_tokens]


def test_processors_cost_nothing_when_unused():
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(min_tokens=2, ignore_eos=True)]
    t = SamplingTensors.build(params, [0, 5], 50, "cpu", eos_token_ids=(3,))
    assert t.banned is None and t.penalties is None and t.num_logprobs is None
    logits = torch.randn(2, 50)
    assert processed_logits(logits, t) is logits
    ignoring = SamplingTensors.build(params, [0, 1], 50, "cpu", eos_token_ids=(3,))
    assert ignoring.banned is None  # ignore_eos and no stop ids: nothing to ban
    with_stop = SamplingTensors.build([SamplingParams(min_tokens=2, stop_token_ids=(7, 9))], [1], 50, "cpu", (3,))
    processed = processed_logits(logits[:1], with_stop)
    assert processed[0, [3, 7, 9]].tolist() == [float("-inf")] * 3
    assert torch.equal(processed[0, :3], logits[0, :3]) and logits[0, 3] > float("-inf")


def test_apply_penalties_matches_a_per_token_loop(gen):
    """The batched reference against the definitions applied token by token in float64."""
    R, V, W = 5, 40, 30
    logits = torch.randn(R, V, generator=gen) * 3
    token_ids = torch.randint(0, V, (R, W), generator=gen, dtype=torch.int32)
    prompt_lens = torch.randint(0, 12, (R,), generator=gen)
    num_tokens = prompt_lens + torch.randint(0, W - 12, (R,), generator=gen)
    repetition = torch.rand(R, generator=gen) * 2 + 0.2
    presence, frequency = torch.randn(R, generator=gen), torch.randn(R, generator=gen)
    got = sampling_reference.apply_penalties(logits, token_ids, prompt_lens, num_tokens, repetition, presence,
                                             frequency)
    expected = logits.double().clone()
    for r in range(R):
        tokens = token_ids[r, :num_tokens[r]].tolist()
        outputs = tokens[prompt_lens[r]:]
        for t in set(tokens):
            x = expected[r, t]
            expected[r, t] = x / repetition[r].item() if x > 0 else x * repetition[r].item()
        for t in set(outputs):
            expected[r, t] -= presence[r].item() + frequency[r].item() * outputs.count(t)
    assert torch.allclose(got.double(), expected, rtol=1e-6, atol=1e-5), f"seed={gen.initial_seed()}"


def test_token_history_takes_known_tokens_placeholders_and_draws():
    """Slots: a sequence's prompt and known outputs copied at its first penalised draw, its
    placeholder from the step before's device tokens, each draw recorded at its position; finished
    sequences' slots reused, the table grown when full."""
    history = TokenHistory(16, "cpu")
    penalised, plain = SamplingParams(repetition_penalty=1.2), SamplingParams()
    seqs = [Sequence(0, "a", [1, 2, 3], penalised, 16, [4, PLACEHOLDER]), Sequence(1, "b", [5], plain, 16),
            Sequence(2, "c", [6, 7], penalised, 16)]
    previous = SimpleNamespace(rows={0: 1}, device_tokens=torch.tensor([0, 9]))
    rows = history.rows(seqs, previous)
    assert (rows.rows, rows.prompt_lens, rows.num_tokens) == ([0, 2], [3, 2], [5, 2])
    t = SamplingTensors.build([s.sampling for s in seqs], [2, 0, 0], 20, "cpu", penalised=rows)
    history.record(t.penalties, torch.tensor([11, 12, 13]))
    a, c = rows.slots
    assert history.token_ids[a, :6].tolist() == [1, 2, 3, 4, 9, 11]
    assert history.token_ids[c, :3].tolist() == [6, 7, 13]
    seqs[0].status = Status.FINISHED
    late = [Sequence(3 + i, str(i), [20 + i], penalised, 16) for i in range(8)]
    first = history.rows(late[:6], None).slots  # the free slots
    reused = history.rows(late[6:7], None).slots  # none free: the finished sequence's
    grown = history.rows(late[7:], None).slots  # none to reclaim: the table grows
    assert reused == [a] and a not in first and c not in first + grown and history.token_ids.shape[0] > 8
    assert len(set(first + reused + grown)) == 8
    assert history.token_ids[c, :3].tolist() == [6, 7, 13]
    assert [history.token_ids[s, 0].item() for s in first + reused + grown] == [20 + i for i in range(8)]
