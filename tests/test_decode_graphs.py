"""The decode CUDA graphs' logits and their draw graphs (engine/cuda_graphs.DecodeGraphs): a decode step's tokens
are what the Gumbel-max sampler draws from the same logits, in every bucket a shrinking batch passes through;
steps whose logits are processed, selected or truncated draw eagerly; the whole run draws what an eager
engine draws. CUDA graphs need a GPU."""
import pytest
import torch

import ops
from engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

PROMPTS = [[(7 * i + j) % 200 + 1 for j in range(5 + 3 * i)] for i in range(6)]


def sampling(temperature=0.8, **extra):
    """One request each: max_tokens 4..24, so the batch shrinks through the buckets 8, 4, 2, 1; seeds fixed."""
    return [SamplingParams(temperature=0.0 if i == 2 and temperature else temperature, max_tokens=4 + 4 * i,
                           seed=i, ignore_eos=True, **extra) for i in range(len(PROMPTS))]


def recorded_draws(monkeypatch):
    """Wrap DecodeGraphs.draw for the test (on the class: an instance's own attribute would hold the graphs, and
    their pool, in a cycle past the test): each graph draw checked against ops.gumbel_sample of the same logits
    (a copy, drawn before the next step runs); returns the list of (batch rows, equal)."""
    from engine.cuda_graphs import DecodeGraphs

    seen, inner = [], DecodeGraphs.draw

    def draw(graphs, logits, temperature, seed, step):
        tokens = inner(graphs, logits, temperature, seed, step)
        if tokens is not None:
            expected = ops.gumbel_sample(logits.clone(), temperature, seed, step)
            seen.append((logits.shape[0], torch.equal(tokens, expected)))
            assert inner(graphs, logits.clone(), temperature, seed, step) is None  # only the graph's own logits
        return tokens
    monkeypatch.setattr(DecodeGraphs, "draw", draw)
    return seen


def test_the_draw_graph_draws_what_the_sampler_draws_from_the_same_logits(monkeypatch):
    """Rows at temperature 0.8 and one at 0 (the sampler's argmax row): every decode step draws through a
    graph, in buckets of 8, 4, 2 and 1 rows (padded rows included), each as ops.gumbel_sample would."""
    llm = LLM(model="tiny", device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8, num_scheduler_steps=1)
    seen = recorded_draws(monkeypatch)
    outputs = llm.generate(PROMPTS, sampling())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4 + 4 * i for i in range(len(PROMPTS))]
    assert {rows for rows, _ in seen} == {6, 5, 4, 3, 2, 1} and all(equal for _, equal in seen)
    llm.close()


@pytest.mark.parametrize("extra", [dict(top_p=0.9), dict(repetition_penalty=1.3), dict(temperature=0.0)])
def test_other_samplers_draw_eagerly(extra, monkeypatch):
    """Truncation, a processor (the penalties' copy of the logits) and greedy rows never take the draw graph."""
    llm = LLM(model="tiny", device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8)
    seen = recorded_draws(monkeypatch)
    llm.generate(PROMPTS, sampling(**({"temperature": 0.8} | extra)))
    assert seen == []
    llm.close()


def test_graphs_draw_what_an_eager_engine_draws():
    """The whole run with the decode and draw graphs against enforce_eager, float32: the same tokens."""
    runs = []
    for eager in (True, False):
        llm = LLM(model="tiny", device="cuda", dtype="float32", max_model_len=128, max_num_seqs=8, enforce_eager=eager)
        runs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampling())])
        llm.close()
    assert runs[0] == runs[1]


def _triton_variants() -> int:
    """Kernel variants Triton holds for the kernels of every ops module loaded, on every device."""
    import sys

    import triton
    kernels = [k for name, module in list(sys.modules.items()) if name == "ops" or name.startswith("ops.")
               for k in vars(module).values() if isinstance(k, triton.JITFunction)]
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


@pytest.mark.parametrize("num_scheduler_steps", [1, 8])
def test_no_kernel_compiles_in_a_run_after_the_warm_up(num_scheduler_steps):
    """The warm-up decodes only at each graph bucket and the size below it; a run whose batch then shrinks through
    every size from 40 rows to 1 (request i stops after i + 1 tokens), one step or a run of 8 a scheduling,
    compiles no kernel variant."""
    llm = LLM(model="tiny", device="cuda", max_model_len=128, max_num_seqs=40, num_scheduler_steps=num_scheduler_steps)
    before = _triton_variants()
    assert before > 0
    prompts = [[(3 * i + j) % 200 + 1 for j in range(4)] for i in range(40)]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.7, max_tokens=i + 1, seed=i, ignore_eos=True)
                                     for i in range(40)])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [i + 1 for i in range(40)]
    assert _triton_variants() == before
    llm.close()
