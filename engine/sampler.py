"""Sampling on the logits' device: greedy at temperature 0, else temperature, top-k and top-p.

Randomness comes from a counter-based hash of (request seed, output index, token id), not from a
generator's state, so a request's tokens depend only on its own seed and logits: the same seed gives
the same output whatever else is in the batch, and after a preemption the recomputed step draws the
same noise again. Sampling is Gumbel-max: argmax(logits / T + G) with G = -log(-log U) picks token i
with probability softmax(logits / T)_i; with top-k/top-p the argmax runs over the kept set, which
picks a token with its probability renormalised over that set. Ties of logit values are kept or
dropped together (ops/sampling_reference.kept_mask). On CUDA both are Triton kernels that never sort
the vocabulary (ops/sampling.py); on CPU the PyTorch references.
"""
from dataclasses import dataclass

import torch

import ops
from engine.sequence import SamplingParams

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B], vocab size when off
    top_p: torch.Tensor  # float32 [B]
    seed: torch.Tensor  # int64 [B]
    step: torch.Tensor  # int64 [B] index of the token being drawn
    all_greedy: bool
    any_truncation: bool  # some top_k or top_p is active

    @classmethod
    def build(cls, params: list[SamplingParams], steps: list[int], vocab_size: int, device) -> "SamplingTensors":
        """One host-to-device copy, which never waits for the device (every value fits float64 exactly)."""
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        table = torch.tensor([[p.temperature for p in params], top_k, [p.top_p for p in params],
                              [p.seed & _MASK32 for p in params], steps], dtype=torch.float64)
        if torch.device(device).type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        return cls(
            temperature=table[0].float(), top_k=table[1].long(), top_p=table[2].float(),
            seed=table[3].long(), step=table[4].long(),
            all_greedy=all(p.temperature == 0 for p in params),
            any_truncation=any(k < vocab_size for k in top_k) or any(p.top_p < 1 for p in params),
        )


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Token ids [B] from logits [B, V] in the model's dtype (sampling math in float32)."""
    if t.all_greedy:
        return logits.argmax(dim=-1)
    if not t.any_truncation:  # one pass over the logits; rows at temperature 0 take the argmax
        return ops.gumbel_sample(logits, t.temperature, t.seed, t.step)
    return ops.top_k_top_p_sample(logits, t.temperature, t.top_k, t.top_p, t.seed, t.step)
