"""Tensor parallelism's processes (model.tensor_parallel_size = W > 1): rank 0 is the engine's own process,
ranks 1 .. W - 1 are worker processes it spawns; each rank holds its share of the model
(engine/models/tensor_parallel.py) and a KV cache of its heads, on its own device (cuda:rank, or the CPU).

Rank 0 runs the scheduler, the block manager and the sampler as with one device. Its model is a
TensorParallelModel: every call the engine makes of the model (a forward, the head's logits) and of the
cache (a copy of blocks) is first broadcast to the workers as a command, so that every rank runs the same
forward, and so the same collectives in the same order; a worker has no scheduler of its own. Commands go
over a gloo group (pickled, their tensors on the CPU); the collectives inside the forward over the compute
group (NCCL on GPUs, gloo on the CPU). Every collective is bounded by the group's timeout (the scheduler's
step_timeout_s), and a worker that exits stops the run with WorkerError, naming it and its exit code.

Not yet here: CUDA graphs with the collectives inside them (a tensor-parallel engine on CUDA runs eagerly),
and loading only a rank's share of a checkpoint (each rank reads it whole, then keeps its share).
"""
import dataclasses
import datetime
import logging
import multiprocessing
import os
import signal
import socket
import sys
import weakref

import torch
import torch.distributed as dist

from engine.config import cpu_threads
from engine.errors import ConfigError, UserError
from engine.kv_cache import PagedKVCache
from engine.models.loader import build_model, model_spec, resolve_model_path
from engine.models.tensor_parallel import Collectives, check_divisible

log = logging.getLogger("minipaged")
JOIN_TIMEOUT_S = 10.0  # a worker that does not stop this long after the stop command is killed
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: on shared hosts it can take the GPUs out of service
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class WorkerError(UserError):
    """A tensor-parallel worker process exited, or a collective with it failed; the message names it."""

    exit_code = 4


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def check_world(world: int, device: torch.device) -> None:
    """ConfigError naming model.tensor_parallel_size unless this machine has its devices (the config's check
    made it >= 1)."""
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ConfigError(f"model.tensor_parallel_size {world} needs {world} GPUs, this machine has "
                          f"{torch.cuda.device_count()}")


def _collectives(rank: int, world: int, group) -> Collectives:
    def all_reduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=group)

    def all_gather(tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(parts, tensor, group=group)
        return torch.cat(parts, dim=-1)
    return Collectives(rank, world, all_reduce, all_gather)


def _join_group(rank: int, world: int, address: str, device: torch.device, timeout_s: float):
    """The compute group (the default one) and the gloo group that carries the commands."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=world, timeout=timeout)
    commands = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return _collectives(rank, world, dist.group.WORLD), commands


def _moved(value, device: torch.device):
    """value with every tensor inside it (in tuples, lists and dataclasses) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value


def _worker(rank: int, world: int, address: str, model_cfg, device_type: str, dtype: torch.dtype,
            timeout_s: float) -> None:
    """A worker's life: join the groups, build its share of the model, then run the commands until stop. Ctrl-C
    ends it at once and in silence (_exit_interrupted): rank 0 reports it and saves what finished. A model it
    cannot build (a UserError: its share does not fit) ends it with that one line, not a traceback."""
    signal.signal(signal.SIGINT, _exit_interrupted)
    device = rank_device(torch.device(device_type), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    collectives, commands = _join_group(rank, world, address, device, timeout_s)
    try:
        model, _ = build_model(model_cfg, device, dtype, collectives)
    except UserError as err:
        print(f"error: tensor parallel rank {rank}: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(model_cfg, model.arch.hidden_size))
    kv_cache = None
    with torch.inference_mode():
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0, group=commands)
            command, *args = _moved(message[0], device)
            if command == "forward":
                model(*args[:2], kv_cache, args[2])
            elif command == "logits":
                model.compute_logits(args[0])
            elif command == "copy":
                kv_cache.copy_blocks(*args)
            elif command == "cache":
                kv_cache = PagedKVCache(model.kv_cache_spec, *args, device)
            else:
                break
    dist.destroy_process_group()


def _exit_interrupted(signum, frame) -> None:
    """A worker's SIGINT handler. A terminal's Ctrl-C reaches every process of its group: the worker, spawned
    from the main module, would otherwise run that module's handler (which says nothing was saved) or raise a
    KeyboardInterrupt (a traceback), and one that ignored it would leave rank 0 waiting on a collective it
    will not finish (the group's timeout)."""
    os._exit(128 + signum)


class TensorParallelModel:
    """Rank 0's model: its own share (a DecoderForCausalLM), each call also sent to the workers first.
    What the engine reads of a model (arch, dtype, kv_cache_spec: this rank's heads, weight_footprint:
    this rank's share) comes from rank 0's share."""

    def __init__(self, model_cfg, device: torch.device, dtype: torch.dtype, timeout_s: float):
        world = model_cfg.tensor_parallel_size
        with socket.socket() as probe:  # a free port for the rendezvous
            probe.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        context = multiprocessing.get_context("spawn")
        self.workers = [context.Process(target=_worker, daemon=True, name=f"minipaged-tp-rank{rank}",
                                        args=(rank, world, address, model_cfg, device.type, dtype, timeout_s))
                        for rank in range(1, world)]
        for worker in self.workers:
            worker.start()
        groups = {}  # the command group, once joined: what _shutdown needs, without a reference to self
        self._stop = weakref.finalize(self, _shutdown, self.workers, groups)
        try:
            collectives, self._commands = self._guarded(_join_group, 0, world, address, device, timeout_s)
            groups["commands"] = self._commands
            self.local, self.eos_token_ids = build_model(model_cfg, device, dtype, collectives)
        except BaseException:
            self.close()
            raise
        self.arch, self.kv_cache_spec = self.local.arch, self.local.kv_cache_spec
        log.info("tensor parallel: %d ranks (workers' pids %s)", world, [w.pid for w in self.workers])

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def weight_footprint(self):
        return self.local.weight_footprint()

    def __call__(self, input_ids, positions, kv_cache, meta):
        self._send("forward", input_ids, positions, meta)
        return self._guarded(self.local, input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden):
        self._send("logits", hidden)
        return self._guarded(self.local.compute_logits, hidden)

    def attach(self, kv_cache: PagedKVCache) -> PagedKVCache:
        """Give each worker a pool of kv_cache's blocks (of its own heads); kv_cache's copies reach them too."""
        self._send("cache", kv_cache.num_blocks, kv_cache.block_size, kv_cache.key_caches[0].dtype)
        local_copy = kv_cache.copy_blocks

        def copy_blocks(src, dst):
            self._send("copy", src, dst)
            local_copy(src, dst)
        kv_cache.copy_blocks = copy_blocks
        return kv_cache

    def close(self) -> None:
        """Stop the workers (killed if they do not stop) and leave the groups; also done when this object is
        collected (an engine whose construction failed after its model) and at the interpreter's exit."""
        self._stop()

    def _send(self, command: str, *args) -> None:
        self._raise_if_a_worker_exited()
        self._guarded(dist.broadcast_object_list, [(command, *_moved(args, torch.device("cpu")))], src=0,
                      group=self._commands)

    def _guarded(self, call, *args, **kwargs):
        """call(*args), a failed collective (a worker gone, or past the timeout) as WorkerError."""
        try:
            return call(*args, **kwargs)
        except RuntimeError as err:
            for worker in self.workers:
                worker.join(1.0)  # a worker that died is why: give its exit code time to show
            self._raise_if_a_worker_exited()
            raise WorkerError(f"tensor parallel: a collective with the workers failed ({err})") from None

    def _raise_if_a_worker_exited(self) -> None:
        for rank, worker in enumerate(self.workers, start=1):
            if worker.exitcode is not None:
                raise WorkerError(f"tensor parallel: the worker of rank {rank} (pid {worker.pid}) exited with "
                                  f"code {worker.exitcode}; the run stops")


def _shutdown(workers: list, groups: dict) -> None:
    if dist.is_initialized():
        try:
            if "commands" in groups and all(w.is_alive() for w in workers):
                dist.broadcast_object_list([("stop",)], src=0, group=groups["commands"])
        except RuntimeError:
            pass  # a worker gone meanwhile: it is joined or killed below
        dist.destroy_process_group()
    for worker in workers:
        worker.join(JOIN_TIMEOUT_S)
        if worker.is_alive():
            worker.kill()
            worker.join()


def build_parallel_model(model_cfg, device: torch.device, dtype: torch.dtype, timeout_s: float | None
                         ) -> TensorParallelModel:
    """The model split over model.tensor_parallel_size ranks, its workers started; timeout_s bounds each
    collective (None: 30 minutes)."""
    check_world(model_cfg.tensor_parallel_size, device)
    # here, from the config files, so that a split that cannot be is one message, not a traceback per rank
    check_divisible(model_spec(model_cfg, resolve_model_path(model_cfg))[1], model_cfg.tensor_parallel_size)
    if dist.is_initialized():
        raise ConfigError("model.tensor_parallel_size: another tensor-parallel engine of this process is still "
                          "open; close it first (LLM.close)")
    for name, off in NO_MULTICAST.items():  # the workers inherit them
        os.environ.setdefault(name, off)
    return TensorParallelModel(model_cfg, device, dtype, timeout_s or 1800.0)
