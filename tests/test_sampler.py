import torch

from engine.engine import LLMEngine
from engine.sampler import SamplingTensors, sample
from engine.sequence import SamplingParams


def tensors(params, steps, vocab):
    return SamplingTensors.build(params, steps, vocab, "cpu")


def test_temperature_zero_is_argmax():
    logits = torch.randn(5, 50)
    params = [SamplingParams(temperature=0.0)] * 5
    assert sample(logits, tensors(params, [0] * 5, 50)).tolist() == logits.argmax(-1).tolist()


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    logits = torch.randn(6, 100)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=s) for s in range(6)]
    together = sample(logits, tensors(params, list(range(6)), 100)).tolist()
    alone = [sample(logits[i:i + 1], tensors(params[i:i + 1], [i], 100)).item() for i in range(6)]
    reordered = sample(logits.flip(0), tensors(params[::-1], list(range(6))[::-1], 100)).tolist()[::-1]
    assert together == alone == reordered


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    n, temperature = 20000, 0.7
    draws = sample(logits.expand(n, 4), tensors([SamplingParams(temperature=temperature, seed=3)] * n, list(range(n)), 4))
    freq = torch.bincount(draws, minlength=4).float() / n
    assert torch.allclose(freq, (logits / temperature).softmax(-1), atol=0.015)


def test_top_k_and_top_p_cut_the_tail():
    logits = torch.tensor([3.0, 2.5, 2.0, -5.0, -6.0])
    n = 4000
    top_k = sample(logits.expand(n, 5), tensors([SamplingParams(temperature=1.0, top_k=2, seed=1)] * n, list(range(n)), 5))
    assert set(top_k.tolist()) == {0, 1}
    # probabilities ~ [.50, .30, .18, ...]: top_p 0.6 keeps tokens 0 and 1 (mass before token 1 is .50 < .6)
    top_p = sample(logits.expand(n, 5), tensors([SamplingParams(temperature=1.0, top_p=0.6, seed=1)] * n, list(range(n)), 5))
    assert set(top_p.tolist()) == {0, 1}


def test_seeded_request_is_independent_of_the_batch(make_config):
    config = make_config("model.device=cpu")
    sampling = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=42, ignore_eos=True)
    alone = LLMEngine(config)
    target = alone.add_request("x", [5, 6, 7, 8], sampling)
    list(alone.run())
    crowded = LLMEngine(config)
    for i in range(5):
        crowded.add_request(f"o{i}", list(range(i + 1, i + 9)), SamplingParams(temperature=1.0, max_tokens=20, seed=i))
    same = crowded.add_request("x", [5, 6, 7, 8], sampling)
    list(crowded.run())
    assert same.output_token_ids == target.output_token_ids
