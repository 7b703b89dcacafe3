"""Issue 31's accuracy figure: the mean KL divergence KL(bf16 || FP8) between the next-token distributions of
a model in bf16 and the same weights with FP8 (model.quantization=fp8, or cache.kv_cache_dtype=fp8 alone),
over a fixed teacher-forced set: 64 prompts of 512 random token ids (seed 0), every position's whole
distribution (the engine's prompt_logprobs keep only the top 20). Each prompt is one prefill through the
engine's own model and KV pool (its slots 0..T-1), as the warm-up's sizing step does; log-softmax in float32.
Usage: python3 benchmarks/fp8_kl.py [MODEL [PROMPTS [TOKENS]]]   (default qwen3-8b 64 512; `tiny` on the CPU)
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.attention import AttentionMetadata, PrefillMetadata  # noqa: E402
from engine.llm import LLM  # noqa: E402

VARIANTS = {"fp8 weights": {"quantization": "fp8"}, "fp8 KV": {"kv_cache_dtype": "fp8"},
            "fp8 weights + KV": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}


@torch.inference_mode()
def teacher_forced_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """log p(next token | prefix) at every position of prompt: float32 [T, V], one prefill of the whole
    prompt into the engine's pool (slot = position, so blocks 0..ceil(T / block_size) - 1)."""
    engine = llm.engine
    device, tokens = engine.device, len(prompt)
    blocks = -(-tokens // engine.block_size)
    table = torch.arange(blocks, dtype=torch.int32, device=device)[None]
    no_decodes = torch.zeros(0, dtype=torch.int32, device=device)
    meta = AttentionMetadata(torch.arange(tokens, dtype=torch.int32, device=device), no_decodes.reshape(0, blocks),
                             no_decodes, PrefillMetadata(table, torch.tensor([tokens], dtype=torch.int32, device=device),
                                                         torch.tensor([0, tokens], dtype=torch.int32, device=device)))
    hidden = engine.model(torch.tensor(prompt, device=device), torch.arange(tokens, device=device), engine.kv_cache, meta)
    return torch.log_softmax(engine.model.compute_logits(hidden).float(), dim=-1)


def main(model: str, num_prompts: int, num_tokens: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(0)
    options = dict(device=device, max_model_len=num_tokens + 1, kv_budget_gb=2.0, enforce_eager=True)  # prefills only
    base = LLM(model, **options)
    vocab = base.engine.model.arch.vocab_size
    prompts = [torch.randint(0, min(vocab, 10000), (num_tokens,), generator=generator).tolist() for _ in range(num_prompts)]
    reference = [teacher_forced_logprobs(base, p) for p in prompts]  # on the device: 64 x 512 x 151,936 float32 = 20 GB
    base.close()
    for name, variant in VARIANTS.items():
        if device == "cpu" and "quantization" in variant:
            continue  # the CPU computes with dequantized weights: nothing to compare
        llm = LLM(model, **options, **variant)
        kl = []
        for prompt, ref in zip(prompts, reference):
            ours = teacher_forced_logprobs(llm, prompt)
            kl.append((ref.exp() * (ref - ours)).sum(-1).mean().item())
        llm.close()
        print(f"{model} {name}: mean KL(bf16 || {name}) over {num_prompts} prompts x {num_tokens} positions = "
              f"{sum(kl) / len(kl):.3e} nats (largest prompt mean {max(kl):.3e})", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0] if args else "qwen3-8b", int(args[1]) if len(args) > 1 else 64, int(args[2]) if len(args) > 2 else 512)
