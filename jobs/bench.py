"""job=bench: a synthetic workload, timed, with the hardware's floor for it; optionally against
transformers' generate on the same weights.

Workloads (job.workload), all with ignore_eos and token ids uniform in [0, 10000):
    nano           nano-vllm's bench.py: random.seed(0); 256 prompts of randint(100, 1024) token ids
                   randint(0, 10000); max_tokens randint(100, 1024) (142,827 prompt and 133,966 output tokens)
    long           1,024 prompts of [512, 3584] tokens, outputs [32, 512] (fits max_model_len 4096)
    shared_prefix  1,024 prompts: one shared 2,048-token prefix, then a suffix of [16, 256] tokens; outputs [32, 256]
    random         job.num_prompts prompts of job.input_len tokens, outputs job.output_len, from job.seed
Lengths are uniform in the closed ranges. nano, long and shared_prefix use temperature 0.6 and seed 0
(random.Random(0); prefix first, then per request its suffix's length and tokens and its output length);
the other sampling settings are the run's. Token ids are taken modulo the vocabulary size, which
changes nothing for Qwen3's vocabulary and lets the bench run on the tiny model.

The floor (engine/stats.py, workload_floor_s) uses the device's copy and matmul rates (engine/hardware.py)
and the tokens actually generated; with prefix caching, only the prompt tokens not served from the cache.
"""
import dataclasses
import importlib
import logging
import random
import time
from dataclasses import dataclass

import torch

from engine.engine import LLMEngine, resolve_device
from engine.hardware import device_rates
from engine.models.loader import to_hf_model
from engine.stats import FloorModel, spread_prefix_hits, workload_floor_s
from jobs import JobError
from jobs.common import drive, run_dir, run_summary, write_run_stats
from jobs.generate import default_sampling

log = logging.getLogger("minipaged")
TOKEN_ID_RANGE = 10000
FIXED_TEMPERATURE = 0.6


@dataclass(frozen=True)
class Shape:
    """A drawn workload's sizes: prompts of prefix_len shared tokens + input_len (closed range) of their own."""

    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    prefix_len: int = 0


NANO = Shape(256, (100, 1024), (100, 1024))
FIXED = {"long": Shape(1024, (512, 3584), (32, 512)), "shared_prefix": Shape(1024, (16, 256), (32, 256), prefix_len=2048)}


def shape(job) -> Shape:
    if job.workload == "nano":
        return NANO
    return FIXED.get(job.workload) or Shape(job.num_prompts, tuple(job.input_len), tuple(job.output_len))


def workload(job, sampling, vocab_size: int):
    """(prompt token ids, SamplingParams) per request."""
    if job.workload == "nano":
        random.seed(0)
        prompts = [[random.randint(0, TOKEN_ID_RANGE) % vocab_size for _ in range(random.randint(*NANO.input_len))]
                   for _ in range(NANO.num_prompts)]
        params = dataclasses.replace(sampling, temperature=FIXED_TEMPERATURE, ignore_eos=True)
        return [(p, dataclasses.replace(params, max_tokens=random.randint(*NANO.output_len))) for p in prompts]
    fixed = job.workload in FIXED
    rng = random.Random(0 if fixed else job.seed)
    params = dataclasses.replace(sampling, ignore_eos=True, **({"temperature": FIXED_TEMPERATURE} if fixed else {}))
    sizes = shape(job)

    def ids(n: int) -> list[int]:
        return [rng.randrange(TOKEN_ID_RANGE) % vocab_size for _ in range(n)]

    prefix = ids(sizes.prefix_len)
    return [(prefix + ids(rng.randint(*sizes.input_len)), dataclasses.replace(params, max_tokens=rng.randint(*sizes.output_len)))
            for _ in range(sizes.num_prompts)]


def floor_model(model, kv_bytes_per_token: int) -> FloorModel:
    """Parameter counts of the built model; the lm_head may share its weight with the token embedding."""
    embed, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
    total = sum(p.numel() for p in model.parameters())  # a tied weight counts once
    nonembed = total - embed.numel() - (0 if lm_head is embed else lm_head.numel())
    arch = model.arch
    return FloorModel(nonembed_params=nonembed, lm_head_params=lm_head.numel(),
                      weight_bytes_per_step=(nonembed + lm_head.numel()) * lm_head.element_size(),
                      kv_bytes_per_token=kv_bytes_per_token, num_layers=arch.num_hidden_layers,
                      num_q_heads=arch.num_attention_heads, head_dim=arch.head_dim)


def floor_summary(engine: LLMEngine, seqs, summary: dict, rates: tuple[float, float]) -> dict:
    """The summary's floor columns for the finished sequences (their actual outputs)."""
    prompt_lens = [len(s.prompt_token_ids) for s in seqs]
    cached = spread_prefix_hits(prompt_lens, summary.get("prefix_cache_hit_tokens", 0))
    model = floor_model(engine.model, summary["kv_budget_bytes"] // summary["kv_slots"])
    floor = workload_floor_s([(p, c, len(s.output_token_ids)) for p, c, s in zip(prompt_lens, cached, seqs)],
                             model, *rates)
    wall = summary["wall_time_s"]
    return {**floor, "pct_of_floor": 100.0 * floor["floor_s"] / wall if wall else 0.0,
            "copy_gb_per_s": rates[0] / 1e9, "matmul_tflop_per_s": rates[1] / 1e12}


@torch.inference_mode()
def hf_generate(engine: LLMEngine, requests, batch_size: int) -> tuple[float, list[list[int]]]:
    """transformers' generate over padded static batches (left padding, greedy or sampled as asked);
    returns output tokens per second (requested tokens) and the outputs."""
    hf_model = to_hf_model(engine.model)
    pad = 0
    outputs, tokens, start = [], 0, time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width, new = max(len(p) for p, _ in batch), max(s.max_tokens for _, s in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=engine.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=engine.device)
        greedy = batch[0][1].temperature == 0
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=not greedy, temperature=None if greedy else batch[0][1].temperature,
                                top_p=None, top_k=None, pad_token_id=pad)
        outputs += [row[width:width + s.max_tokens].tolist() for row, (_, s) in zip(out, batch)]
        tokens += sum(s.max_tokens for _, s in batch)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start), outputs


def match_share(ours: list[list[int]], theirs: list[list[int]], prefix: int = 32) -> float:
    return 100.0 * sum(a[:prefix] == b[:prefix] for a, b in zip(ours, theirs)) / max(len(ours), 1)


def run(cfg) -> None:
    sizes = shape(cfg.job)
    longest = sizes.prefix_len + sizes.input_len[1] + sizes.output_len[1]
    if longest > cfg.model.max_model_len:
        raise JobError(f"job.workload={cfg.job.workload}: requests of up to {longest} tokens (prompt and output) "
                       f"need model.max_model_len >= {longest}, it is {cfg.model.max_model_len}")
    if cfg.executor.name == "ray":  # imported only where asked for
        return importlib.import_module("jobs.ray_executor").run_bench(cfg)
    rates = device_rates(*resolve_device(cfg.model))  # before the KV pool takes the device's memory
    engine = LLMEngine(cfg)
    requests = workload(cfg.job, default_sampling(cfg), engine.model.arch.vocab_size)
    seqs = [engine.add_request(str(i), p, s) for i, (p, s) in enumerate(requests)]
    output_tokens = drive(engine, len(seqs), lambda seq: None)
    summary = run_summary(engine, cfg, len(seqs), 0, sum(len(p) for p, _ in requests), output_tokens)
    summary["workload"] = cfg.job.workload
    summary.update(floor_summary(engine, seqs, summary, rates))
    log.info("floor %.3f s (prefill %.3f s + decode max(bytes %.3f s, FLOPs %.3f s)) = %.1f%% of the wall time",
             summary["floor_s"], summary["floor_prefill_s"], summary["floor_decode_bytes_s"],
             summary["floor_decode_flops_s"], summary["pct_of_floor"])
    if cfg.job.baseline == "hf":
        engine.close()  # transformers needs the memory of our KV cache
        hf_rate, hf_outputs = hf_generate(engine, requests, cfg.job.hf_batch_size)
        summary.update(hf_output_tok_per_s=hf_rate, speedup_vs_hf=summary["output_tok_per_s"] / hf_rate)
        if all(s.temperature == 0 for _, s in requests):
            summary["hf_match_first32_pct"] = match_share([s.output_token_ids for s in seqs], hf_outputs)
        log.info("transformers generate: %.1f output tok/s; MiniPaged is %.1fx", hf_rate, summary["speedup_vs_hf"])
    write_run_stats(engine, cfg, run_dir(), summary)
