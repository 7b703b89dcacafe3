"""job=bench: a synthetic workload, timed; optionally against transformers' generate on the same weights.

job.workload=nano reproduces nano-vllm's bench.py: random.seed(0); 256 prompts of randint(100, 1024)
token ids randint(0, 10000); max_tokens randint(100, 1024); temperature 0.6; ignore_eos
(142,827 prompt and 133,966 output tokens). job.workload=random draws job.num_prompts prompts with
lengths uniform in job.input_len, outputs in job.output_len, token ids uniform in [0, 10000), from
job.seed, with the run's sampling settings and ignore_eos. Token ids are taken modulo the vocabulary
size, which changes nothing for Qwen3's vocabulary and lets the bench run on the tiny model.
"""
import dataclasses
import logging
import random
import time

import torch

from engine.engine import LLMEngine
from engine.models.loader import to_hf_model
from jobs import JobError
from jobs.common import drive, run_dir, run_summary, write_run_stats
from jobs.generate import default_sampling

log = logging.getLogger("minipaged")
TOKEN_ID_RANGE = 10000


def workload(job, sampling, vocab_size: int):
    """(prompt token ids, SamplingParams) per request."""
    if job.workload == "nano":
        random.seed(0)
        prompts = [[random.randint(0, TOKEN_ID_RANGE) % vocab_size for _ in range(random.randint(100, 1024))]
                   for _ in range(256)]
        params = dataclasses.replace(sampling, temperature=0.6, ignore_eos=True)
        return [(p, dataclasses.replace(params, max_tokens=random.randint(100, 1024))) for p in prompts]
    rng = random.Random(job.seed)
    params = dataclasses.replace(sampling, ignore_eos=True)
    return [([rng.randrange(TOKEN_ID_RANGE) % vocab_size for _ in range(rng.randint(*job.input_len))],
             dataclasses.replace(params, max_tokens=rng.randint(*job.output_len))) for _ in range(job.num_prompts)]


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
    longest = 1024 if cfg.job.workload == "nano" else cfg.job.input_len[1]
    if longest >= cfg.model.max_model_len:
        raise JobError(f"job.input_len: prompts of up to {longest} tokens need model.max_model_len > {longest}, "
                       f"it is {cfg.model.max_model_len}")
    engine = LLMEngine(cfg)
    requests = workload(cfg.job, default_sampling(cfg), engine.model.arch.vocab_size)
    seqs = [engine.add_request(str(i), p, s) for i, (p, s) in enumerate(requests)]
    output_tokens = drive(engine, len(seqs), lambda seq: None)
    summary = run_summary(engine, cfg, len(seqs), 0, sum(len(p) for p, _ in requests), output_tokens)
    summary["workload"] = cfg.job.workload
    if cfg.job.baseline == "hf":
        engine.close()  # transformers needs the memory of our KV cache
        hf_rate, hf_outputs = hf_generate(engine, requests, cfg.job.hf_batch_size)
        summary.update(hf_output_tok_per_s=hf_rate, speedup_vs_hf=summary["output_tok_per_s"] / hf_rate)
        if all(s.temperature == 0 for _, s in requests):
            summary["hf_match_first32_pct"] = match_share([s.output_token_ids for s in seqs], hf_outputs)
        log.info("transformers generate: %.1f output tok/s; MiniPaged is %.1fx", hf_rate, summary["speedup_vs_hf"])
    write_run_stats(engine, cfg, run_dir(), summary)
