"""How many distinct experts a decode step's tokens route to, against the bench floor's count for them
(engine/stats.py expected_experts: uniform routing). Random weights of a MoE shape (default Qwen3-30B-A3B)
run eagerly; every call of ops.moe_route records its token count and, per layer, the distinct experts
picked. 256 short prompts with outputs of 2-40 tokens, so the decode steps run from 256 rows down to 1.
Usage: python3 benchmarks/moe_routing.py [MODEL [KEY=VALUE ...]]   (LLM's keyword arguments)
"""
import collections
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ops  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.stats import expected_experts  # noqa: E402


def main(model: str, **options) -> None:
    llm = LLM(model=model, enforce_eager=True, max_num_seqs=256, **options)
    arch = llm.engine.model.arch
    touched: dict[int, list[int]] = collections.defaultdict(list)  # tokens -> distinct experts per layer call
    route = ops.moe_route

    def recording(logits, top_k, renormalize):
        weights, ids = route(logits, top_k, renormalize)
        if ids.shape[0] <= 512:  # decode steps (prefill chunks touch every expert anyway)
            touched[ids.shape[0]].append(int(ids.unique().numel()))
        return weights, ids

    ops.moe_route = recording
    generator = torch.Generator().manual_seed(0)
    vocab = min(10000, arch.vocab_size)
    prompts = [torch.randint(0, vocab, (int(torch.randint(16, 65, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(256)]
    params = [SamplingParams(temperature=0.6, max_tokens=int(torch.randint(2, 41, (1,), generator=generator)),
                             ignore_eos=True, seed=i) for i in range(256)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ops.moe_route = route
    print(f"{'tokens':>7} {'calls':>6} {'distinct (mean)':>15} {'uniform (mean)':>14} {'ratio':>6}")
    edges = [1, 2, 5, 9, 17, 33, 65, 129, 257, 513]
    for lo, hi in zip(edges, edges[1:]):  # prefill chunks of <= 512 tokens fall in here too, a few calls
        calls = [(t, c) for t in range(lo, hi) for c in touched.get(t, [])]
        if calls:
            seen = statistics.mean(c for _, c in calls)
            uniform = statistics.mean(float(expected_experts(t, arch.num_experts, arch.num_experts_per_tok))
                                      for t, _ in calls)
            print(f"{lo:3d}-{hi - 1:<3d} {len(calls):6d} {seen:15.2f} {uniform:14.2f} {seen / uniform:6.3f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b",
         **{key: int(value) if value.isdigit() else value for key, value in (arg.split("=", 1) for arg in sys.argv[2:])})
