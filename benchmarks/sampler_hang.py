"""Issue 28's top-p job, which hung the GPU before the truncating sampler's rounds were bounded, with every
truncated draw checked (GPU).

    python3 benchmarks/sampler_hang.py OUT_DIR [bench overrides ...]
    python3 benchmarks/sampler_hang.py --kernels OLD_SAMPLING_PY OUT_DIR [bench overrides ...]

Runs `python -m engine.run job=bench model=qwen3-0.6b job.num_prompts=4096 'job.input_len=[100,2000]'
'job.output_len=[16,512]' job.seed=7 sampling.temperature=0.8 sampling.top_p=0.95` (plus the overrides)
with the runner's draw wrapped: after each truncated draw the device is synchronised and the fallback
counter read (slower than the job, which never waits). A draw that took the exact fallback is drawn again
row by row to find its rows; each is drawn once more with max_rounds 1000 (did it only need more rounds,
or did a round not move: the old kernels' endless loop?) and saved, logits and parameters, to
OUT_DIR/fallback_rows.pt for the interpreter on the CPU. Prints the rows found and why.
"""
import copy
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import model_runner, run  # noqa: E402
from ops import sampling, sampling_reference  # noqa: E402

OLD = None
if sys.argv[1] == "--kernels":
    import importlib.util
    spec = importlib.util.spec_from_file_location("old_sampling", sys.argv[2])
    OLD = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(OLD)
    del sys.argv[1:3]
OUT = Path(sys.argv[1])
COMMAND = ["job=bench", "model=qwen3-0.6b", "job.num_prompts=4096", "job.input_len=[100,2000]",
           "job.output_len=[16,512]", "job.seed=7", "sampling.temperature=0.8", "sampling.top_p=0.95",
           "hydra.run.dir=/tmp/minipaged_sampler_hang"]
MAX_SAVED = 32
found = {"draws": 0, "fallback_draws": 0, "rows": []}


def row_args(logits, t, r):
    return (logits[r:r + 1], t.temperature[r:r + 1], t.top_k[r:r + 1], t.top_p[r:r + 1], t.seed[r:r + 1],
            t.step[r:r + 1])


def fallback_rows(logits, t) -> list[int]:
    rows = []
    for r in range(logits.shape[0]):
        counter = torch.zeros(1, dtype=torch.int32, device=logits.device)
        sampling.top_k_top_p_sample(*row_args(logits, t, r), min_p=t.min_p[r:r + 1], fallbacks=counter)
        if counter.item():
            rows.append(r)
    return rows


def checked_draw(logits, t, fallbacks=None):
    tokens = draw(logits, t, fallbacks)
    if t.all_greedy or not t.any_truncation:
        return tokens
    before = int(fallbacks.item())  # synchronises: the draw above has run
    found["draws"] += 1
    if before == found.get("count", 0):
        return tokens
    found["count"] = before
    found["fallback_draws"] += 1
    patient = copy.deepcopy(sampling.TOP_K_TOP_P_CFG["gpu"])
    patient["finish"]["max_rounds"] = 1000
    for r in fallback_rows(logits, t):
        counter = torch.zeros(1, dtype=torch.int32, device=logits.device)
        args = row_args(logits, t, r)
        sampling.top_k_top_p_sample(*args, min_p=t.min_p[r:r + 1], cfg=patient, fallbacks=counter)
        expected = sampling_reference.top_k_top_p_sample(*(a.float() if a.is_floating_point() else a for a in args),
                                                         min_p=t.min_p[r:r + 1])
        row = {"token": int(tokens[r]), "reference": int(expected), "needs_more_than_1000": bool(counter.item()),
               **{k: v.cpu() for k, v in zip(("logits", "temperature", "top_k", "top_p", "seed", "step"), args)},
               "min_p": t.min_p[r:r + 1].cpu()}
        print(f"draw {found['draws']}: row {r} took the fallback; token {row['token']} (reference "
              f"{row['reference']}); with 1000 rounds still the fallback: {row['needs_more_than_1000']}", flush=True)
        if len(found["rows"]) < MAX_SAVED:
            found["rows"].append(row)
    torch.save(found, OUT / "fallback_rows.pt")
    return tokens


def ends_within(seconds: float) -> bool:
    event = torch.cuda.Event()
    event.record()
    deadline = time.perf_counter() + seconds
    while not event.query():
        if time.perf_counter() > deadline:
            return False
        time.sleep(0.001)
    return True


def old_draw(logits, t, fallbacks=None):
    """A truncated draw through the old kernels; on a hang, find and save the rows that hang, then exit."""
    if t.all_greedy or not t.any_truncation:
        return draw(logits, t, fallbacks)
    found["draws"] += 1
    tokens = OLD.top_k_top_p_sample(logits, t.temperature, t.top_k, t.top_p, t.seed, t.step, min_p=t.min_p)
    if ends_within(10.0):
        return tokens
    print(f"draw {found['draws']} ({logits.shape[0]} rows) did not end within 10 s: drawing its rows one by one",
          flush=True)
    hung = []
    for r in range(logits.shape[0]):
        with torch.cuda.stream(torch.cuda.Stream()):
            OLD.top_k_top_p_sample(*row_args(logits, t, r), min_p=t.min_p[r:r + 1])
            if not ends_within(2.0):
                hung.append(r)
    print(f"rows that hang: {hung}", flush=True)
    rows = []
    with torch.cuda.stream(torch.cuda.Stream()):
        for r in hung[:MAX_SAVED]:
            args = row_args(logits, t, r)
            bounded = sampling.top_k_top_p_sample(*args, min_p=t.min_p[r:r + 1])
            expected = sampling_reference.top_k_top_p_sample(*(a.float() if a.is_floating_point() else a for a in args),
                                                             min_p=t.min_p[r:r + 1])
            ok = ends_within(10.0)
            rows.append({"bounded": int(bounded) if ok else None, "reference": int(expected) if ok else None,
                         **{k: v.cpu() for k, v in zip(("logits", "temperature", "top_k", "top_p", "seed", "step"), args)},
                         "min_p": t.min_p[r:r + 1].cpu()})
            print(f"row {r}: bounded kernels {rows[-1]['bounded']}, reference {rows[-1]['reference']}", flush=True)
    torch.save(rows, OUT / "hang_rows.pt")
    os._exit(3)


OUT.mkdir(parents=True, exist_ok=True)
draw = model_runner.draw
model_runner.draw = old_draw if OLD else checked_draw
sys.argv = ["engine.run", *COMMAND, *sys.argv[2:]]
try:
    run.main()
finally:
    print(f"truncated draws checked: {found['draws']}; draws that took the fallback: {found['fallback_draws']}; "
          f"rows saved: {len(found['rows'])}", flush=True)
