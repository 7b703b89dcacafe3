"""The step watchdog: a launched step whose tokens do not come back in time stops the run.

The host reads a step's sampled tokens when the device has computed them (LLMEngine._tokens). On CUDA it
waits against a deadline instead of blocking: `scheduler.step_timeout_s` (60 s by default; null: no limit)
or 20 times the slowest step so far, whichever is larger. When the deadline passes, the step's inputs are
written to `stalled-step-<N>.pt` (torch.save of a dict) in the run directory, and StepTimeout names the step,
its phase, its rows and the file: the command line prints it on one line, after the job has saved its
finished rows; the Python API raises it. The file holds the batch's metadata (request ids, the tokens
computed before and in the step, the slots written) and, when the device got as far as the sampler, its
logits and parameters, so that `replay_sampler` can draw the step again with the kernels of the day.

Nothing here touches the stream the step runs on: the device is still running it (and may never finish),
so reads go through a stream of their own, in a thread that is abandoned if they do not end in time.
"""
import tempfile
import threading
import time
import typing
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import UserError

if typing.TYPE_CHECKING:
    from engine.sampler import SamplingTensors
    from engine.scheduler import ScheduledBatch

SLOWEST_STEP_FACTOR = 20
_SPIN_S = 0.05  # how long the wait polls without sleeping: a step's tokens usually come within it
_POLL_S = 0.001
_READ_TIMEOUT_S = 10.0  # for the device reads that save a stalled step's inputs
_NAMED_ROWS = 8  # request ids named in the message


class StepTimeout(UserError):
    """A step did not finish within its deadline; the message names it and where its inputs were saved."""

    exit_code = 3


@dataclass
class StepInputs:
    """What the watchdog reports and saves of a launched step, by reference (nothing is copied per step).
    The device tensors are complete once `logits_ready` has passed (None on the CPU, where every launch
    has run by the time it returns)."""

    step: int
    batch: "ScheduledBatch"  # the scheduler's, its own for this step
    starts: np.ndarray  # int64 [S]: tokens each of batch.seqs had computed before the step
    drawing: list  # the sequence of each row of logits
    logits: torch.Tensor  # [B, V]: the sampler's input (after min_tokens bans and penalties)
    sampling: "SamplingTensors"
    logits_ready: "torch.cuda.Event | None"


def step_deadline_s(timeout_s: float | None, slowest_step_s: float) -> float | None:
    """The time a step may take: timeout_s or SLOWEST_STEP_FACTOR x the slowest step so far, the larger;
    None (no limit) when timeout_s is None."""
    return None if timeout_s is None else max(timeout_s, SLOWEST_STEP_FACTOR * slowest_step_s)


def wait_until(done, deadline_s: float | None) -> bool:
    """Poll done() until it is true (True) or deadline_s seconds have passed (False). Polls without
    sleeping for _SPIN_S, then every _POLL_S: waking late would leave the device idle between steps."""
    start = time.perf_counter()
    while not done():
        waited = time.perf_counter() - start
        if deadline_s is not None and waited > deadline_s:
            return done()
        if waited > _SPIN_S:
            time.sleep(_POLL_S)
    return True


def stalled(inputs: StepInputs, deadline_s: float, directory: Path | None) -> StepTimeout:
    """Save the stalled step's inputs (stall_record) in `directory` (None: a new temporary directory)
    and return the error that names the step and the file."""
    directory = Path(tempfile.mkdtemp(prefix="minipaged-")) if directory is None else directory
    path = directory / f"stalled-step-{inputs.step}.pt"
    record = stall_record(inputs)
    torch.save(record, path)
    ids = record["request_ids"]
    named = ", ".join(ids[:_NAMED_ROWS]) + (", ..." if len(ids) > _NAMED_ROWS else "")
    saved = "its logits and sampling parameters and " if "logits" in record else ""
    return StepTimeout(f"step {inputs.step} ({record['phase']}, {len(ids)} rows: requests {named}) did not finish "
                       f"within {deadline_s:.3g} s (scheduler.step_timeout_s, or {SLOWEST_STEP_FACTOR}x the slowest "
                       f"step so far if more); {saved}its batch's metadata are saved in {path}")


def stall_record(inputs: StepInputs) -> dict:
    """The saved form of a step's inputs: the host metadata, and the device tensors copied to the CPU when
    the device got past the logits and the copy ends within _READ_TIMEOUT_S."""
    batch = inputs.batch
    record = {"step": inputs.step, "phase": batch.phase, "request_ids": [seq.request_id for seq in batch.seqs],
              "sample_indexes": [seq.sample_index for seq in batch.seqs], "starts": torch.from_numpy(inputs.starts),
              "counts": torch.tensor(batch.num_new_tokens), "slot_mapping": torch.from_numpy(batch.slot_mapping)}
    ready = inputs.logits_ready is None or inputs.logits_ready.query()
    tensors = _read_back({"logits": inputs.logits, **inputs.sampling.rows()}) if ready else None
    if tensors is not None:
        record.update(tensors, drawing_ids=[seq.request_id for seq in inputs.drawing])
    return record


def _read_back(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The tensors on the CPU, read on a stream of their own in a thread; None if that does not end in time."""
    device = next(iter(tensors.values())).device
    if device.type != "cuda":
        return {name: t.clone() for name, t in tensors.items()}
    result = {}

    def read() -> None:
        torch.cuda.set_device(device)
        with torch.cuda.stream(torch.cuda.Stream(device)):
            copies = {name: t.to("cpu") for name, t in tensors.items()}
        result.update(copies)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(_READ_TIMEOUT_S)
    return result if not reader.is_alive() and len(result) == len(tensors) else None


def replay_sampler(path: Path, device: str = "cpu") -> torch.Tensor:
    """Draw a saved stalled step's tokens again (int64 [B]) from its logits and sampling parameters, on
    `device` with the kernels of the day (on the CPU: the references)."""
    import ops

    record = torch.load(path, weights_only=True)
    if "logits" not in record:
        raise ValueError(f"{path} holds no logits: step {record['step']} stalled before its sampler")
    t = {name: record[name].to(device) for name in ("logits", "temperature", "top_k", "top_p", "min_p", "seed", "output_index")}
    if (t["top_k"] < t["logits"].shape[1]).any() or (t["top_p"] < 1).any() or (t["min_p"] > 0).any():
        return ops.top_k_top_p_sample(t["logits"], t["temperature"], t["top_k"], t["top_p"], t["seed"],
                                      t["output_index"], min_p=t["min_p"])
    return ops.gumbel_sample(t["logits"], t["temperature"], t["seed"], t["output_index"])
