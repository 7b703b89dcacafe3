"""The generate loop: requests in, finished sequences out (streamed as they finish)."""
import copy
import functools
import gc
import itertools
import logging
import time
from collections.abc import Iterator
from operator import attrgetter
from pathlib import Path

import torch

from engine.block_manager import KVBlockManager, blocks_needed
from engine.config import cpu_threads
from engine.constraint import Constraint
from engine.cuda_graphs import PIECE_MAX_TOKENS, bucket_sizes
from engine.detokenizer import IncrementalDetokenizer, decode_after
from engine.errors import ConfigError, RequestError
from engine.generation_config import read_generation_config, silent_eos, stop_ids
from engine.kernel_compiles import CompilePool, run_compiled_ahead, start_compile_pool
from engine.kv_cache import PagedKVCache, bytes_per_block, cache_dtype, num_blocks_for
from engine.model_runner import InFlight, ModelRunner, kv_bytes_left
from engine.models.loader import build_model, max_model_len_of, resolve_model_path
from engine.parallel import build_parallel_model
from engine.prefix_groups import CascadePolicy
from engine.reasoning import reasoning_parser as make_reasoning_parser
from engine.sampler import MAX_LOGPROBS, start_compiling_samplers
from engine.scheduler import Scheduler
from engine.sequence import PLACEHOLDER, SamplingParams, Sequence, Status
from engine.startup import Laps, process_age_s
from engine.stats import StatsRecorder, run_stats, snapshot
from engine.structured import GrammarCompiler, StructuredOutputsParams
from engine.tokenizer import load_tokenizer
from engine.watchdog import stalled, step_deadline_s, wait_until
from ops.cascade import PrefixPass

log = logging.getLogger("minipaged")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (max_num_seqs, max_num_batched_tokens) when the config leaves them unset: on CUDA what measured best on
# an H200 (1,024 as vLLM on this class of GPU: benchmarks/NOTES.md, session 40); on the CPU small batches,
# where a step's cost grows with its tokens.
SCHEDULER_DEFAULTS = {"cuda": (1024, 16384), "cpu": (64, 2048)}
GRAMMAR_TIMEOUT_S = 60.0  # a constraint's grammar must compile within this
# device steps a decode run takes at most when scheduler.num_scheduler_steps is unset: on CUDA 8 (a small model's
# nano on a host shared with busy processes: 1.9-2.5x faster than one step; no change where the host keeps up:
# benchmarks/NOTES.md, session 38); on the CPU one, where the device is the host
SCHEDULER_STEPS = {"cuda": 8, "cpu": 1}
_DRAWS_AHEAD = attrgetter("draws_ahead")


def warm_up_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes of the warm-up, largest first: each decode graph bucket and the size below it,
    so that every graph is replayed once and every kernel sees a batch of each kind Triton specialises an
    integer on (1, a multiple of 16, any other) and of each power of two it is rounded up to."""
    sizes = {size for bucket in bucket_sizes(max_num_seqs) for size in (bucket, bucket - 1)}
    return sorted(sizes - {0}, reverse=True)


def drawn_tokens(step: InFlight, tokens: list, rows: list[int] | None = None
                 ) -> Iterator[tuple[int, Sequence, int, int]]:
    """(row, sequence, output index, token) of each token a step drew (tokens: one a row), or of a decode run's
    `rows` with their tokens in order (tokens: a run's per row, row i's first step.steps[i] valid)."""
    if step.steps is None:
        return zip(itertools.count(), step.seqs, step.output_index, tokens)
    return ((row, step.seqs[row], step.output_index[row] + j, tokens[row][j]) for row in rows
            for j in range(step.steps[row]))


def runs_on_cuda(model_cfg) -> bool:
    """Whether the model runs on CUDA: model.device cuda, or auto with a CUDA device present."""
    return model_cfg.device == "cuda" or (model_cfg.device == "auto" and torch.cuda.is_available())


def dtype_name(model_cfg) -> str:
    """model.dtype in effect: auto is bfloat16 where the model runs on CUDA, float32 on the CPU."""
    return model_cfg.dtype if model_cfg.dtype != "auto" else ("bfloat16" if runs_on_cuda(model_cfg) else "float32")


def resolve_device(model_cfg) -> tuple[torch.device, torch.dtype]:
    if model_cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("model.device is 'cuda' but no CUDA device is available")
    device = torch.device("cuda" if runs_on_cuda(model_cfg) else "cpu")
    name = dtype_name(model_cfg)
    if device.type == "cuda" and name == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise ConfigError("model.dtype bfloat16 is not supported by this CUDA device; use float16")
    try:  # a dtype the device cannot compute in fails here, with its name, not in the first step
        probe = torch.ones(2, 2, dtype=DTYPES[name], device=device)
        torch.nn.functional.silu(probe @ probe).softmax(-1).sum().item()
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"model.dtype {name} cannot run on {device.type}: {err}") from None
    return device, DTYPES[name]


def scheduler_limits(scheduler_cfg, device: torch.device, max_sequences: int | None = None) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): the config's, or the device's defaults where unset; max_num_seqs
    at most max_sequences (LLMEngine's)."""
    defaults = SCHEDULER_DEFAULTS[device.type]
    max_num_seqs = scheduler_cfg.max_num_seqs or defaults[0]
    capped = max_sequences is not None and max_sequences < max_num_seqs
    chosen = (max(1, max_sequences) if capped else max_num_seqs, scheduler_cfg.max_num_batched_tokens or defaults[1])
    log.info("scheduler: max_num_seqs %d%s, max_num_batched_tokens %d%s", chosen[0],
             " (the run's sequences)" if capped else "" if scheduler_cfg.max_num_seqs else f" ({device.type} default)",
             chosen[1], "" if scheduler_cfg.max_num_batched_tokens else f" ({device.type} default)")
    return chosen


def piecewise_graphs_on(model_cfg, device: torch.device) -> bool:
    """model.piecewise_graphs, or where unset the device's default: on for CUDA, off for the CPU (whose
    pieces run eagerly, so they would only pad its steps); model.enforce_eager turns them off."""
    if model_cfg.enforce_eager:
        return False
    return device.type == "cuda" if model_cfg.piecewise_graphs is None else model_cfg.piecewise_graphs


def with_max_model_len(cfg):
    """A copy of cfg whose model.max_model_len is the one in effect (the loader's max_model_len_of: null is the
    checkpoint's context), logged with where it came from: the engine, its ranks and its callers read one int."""
    value, source = max_model_len_of(cfg.model)
    log.info("model.max_model_len %d: %s", value, source)
    resolved = copy.deepcopy(cfg)  # not dataclasses.replace: a composed (Hydra) config serves as well
    resolved.model.max_model_len = value
    return resolved


def sized_by_trial(cache_cfg) -> bool:
    """Whether a CUDA pool is sized from the memory a trial step leaves (kv_bytes_left), not set in blocks or GB."""
    return cache_cfg.num_blocks is None and cache_cfg.kv_budget_gb is None


class LLMEngine:
    def __init__(self, cfg, run_dir: Path | None = None, reasoning_parser: str | None = None,
                 max_sequences: int | None = None):
        """run_dir: where a stalled step's inputs are saved (engine/watchdog.py), None: a temporary directory;
        reasoning_parser: engine/reasoning.py's name of the model's reasoning format, whose end is where a
        structured-output constraint starts; max_sequences: the most sequences the caller will ever add (a
        job that knows its rows and samples), None: unknown. Fewer than max_num_seqs caps it: no sequence
        more can run anyway, and the decode graphs and the warm-up then cover only the batch sizes that can
        occur (a 64-row job's start-up captured and warmed 36 batch sizes up to 512). startup_s: where its
        start-up went, in seconds: before_engine, the process's age when it began (None where unknown:
        engine/startup.py), then its phases in order (model: build and weights; tokenizer; kv_pool: sizing
        and allocation; graphs: the end of the samplers' compilation, begun after the model, then the runner's
        CUDA graph captures; warm_up), which add up to its construction."""
        laps, started_s = Laps(), process_age_s()
        self.run_dir = run_dir
        self.device, self.dtype = resolve_device(cfg.model)
        self.cfg = cfg = with_max_model_len(cfg)
        self.max_model_len = cfg.model.max_model_len
        self.parallel = cfg.model.tensor_parallel_size > 1
        if self.parallel and self.device.type == "cuda" and sized_by_trial(cfg.cache):  # the workers take no part in it
            raise ConfigError("model.tensor_parallel_size > 1 on CUDA needs cache.kv_budget_gb (each rank's) "
                              "or cache.num_blocks")
        # the start-up's kernels compile side by side in these (engine/kernel_compiles.py), which begin now
        compiles = start_compile_pool(self.device) if not self.parallel else None
        try:
            self._start(laps, compiles, reasoning_parser, max_sequences)
        finally:
            if compiles is not None:
                compiles.close()
                if compiles.sent:
                    log.info("start-up: %d kernel variants compiled in %d worker processes (%d failed), %.2f s waited "
                             "for them", compiles.sent, compiles.num_workers, compiles.failed, compiles.wait_s)
        self.startup_s = {"before_engine": started_s, **laps.phases}

    def _start(self, laps: Laps, compiles: CompilePool | None, reasoning_parser: str | None,
               max_sequences: int | None) -> None:
        """__init__'s phases (see there), each closed by a lap; compiles: where the kernels of the KV pool's trial
        step, the samplers' first draws, the graphs' captures and the experts' launches compile side by side
        first (engine/kernel_compiles.py), None: each at its launch."""
        cfg = self.cfg
        if self.parallel:  # its ranks' shares, the workers started (engine/parallel.py)
            self.model = build_parallel_model(cfg.model, self.device, self.dtype, cfg.scheduler.step_timeout_s)
            config_eos = self.model.eos_token_ids
        else:
            self.model, config_eos = build_model(cfg.model, self.device, self.dtype)
        self.generation_config = read_generation_config(resolve_model_path(cfg.model))
        self.eos_token_ids = stop_ids(config_eos, self.generation_config)
        if self.device.type == "cpu":  # the hidden size decides, so after the checkpoint's config is read
            torch.set_num_threads(cpu_threads(cfg.model, self.model.arch.hidden_size))
        laps.lap("model")
        # the samplers' kernels compile while the tokenizer loads and the KV pool is sized
        compiling = start_compiling_samplers(self.model.arch.vocab_size, self.dtype, self.device, compiles) \
            if self.device.type == "cuda" else []
        self.tokenizer = load_tokenizer(cfg.model)
        if cfg.model.tokenizer and len(self.tokenizer) > self.model.arch.vocab_size:
            raise ConfigError(f"model.tokenizer: its {len(self.tokenizer)} tokens do not fit the model's vocabulary "
                              f"of {self.model.arch.vocab_size}")
        self.reasoning_parser = make_reasoning_parser(reasoning_parser, self.tokenizer) if reasoning_parser else None
        self.silent_eos = silent_eos(self.eos_token_ids, self.tokenizer.eos_token_id)
        laps.lap("tokenizer")
        self.block_size = cfg.cache.block_size
        self.prefix_caching = cfg.cache.enable_prefix_caching
        max_num_seqs, max_num_batched_tokens = scheduler_limits(cfg.scheduler, self.device, max_sequences)
        max_blocks_per_seq = blocks_needed(self.max_model_len, self.block_size)
        kv_dtype = cache_dtype(cfg.cache.kv_cache_dtype, self.dtype, self.device)
        free_bytes = None
        if self.device.type == "cuda" and sized_by_trial(cfg.cache):
            free_bytes = kv_bytes_left(self.model, self.device, cfg.cache.gpu_memory_utilization,
                                       max_num_batched_tokens, max_num_seqs, self.block_size, kv_dtype, compiles)
        per_block = bytes_per_block(self.model.kv_cache_spec, self.block_size, kv_dtype)
        num_blocks = num_blocks_for(cfg.cache, per_block, self.device, self.max_model_len, max_num_seqs, free_bytes)
        self.kv_cache = PagedKVCache(self.model.kv_cache_spec, num_blocks, self.block_size, kv_dtype, self.device)
        if self.parallel:
            self.kv_cache = self.model.attach(self.kv_cache)
        log.info("KV cache: %d blocks of %d tokens = %d tokens, %.2f GB of %s; %.1f sequences of max_model_len %d at once",
                 num_blocks, self.block_size, num_blocks * self.block_size, self.kv_cache.bytes / 1e9,
                 str(kv_dtype).removeprefix("torch."), num_blocks / max_blocks_per_seq, self.max_model_len)
        self.block_manager = KVBlockManager(num_blocks, self.block_size, self.prefix_caching)
        laps.lap("kv_pool")
        for future in compiling:  # before the graphs' capture, which takes the whole device
            future.result()
        spec = self.model.kv_cache_spec
        cascade = CascadePolicy.for_mode(cfg.cache.cascade_attention, self.device,
                                         per_block // (self.block_size * spec.num_layers), self._prefix_pass(kv_dtype),
                                         max_num_seqs)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, cascade is not None,
                                   cfg.scheduler.admission_headroom)
        self.num_scheduler_steps = cfg.scheduler.num_scheduler_steps or SCHEDULER_STEPS[self.device.type]
        eager = cfg.model.enforce_eager or self.parallel  # graphs do not hold the workers' commands yet
        graph_batch = 0 if eager else max_num_seqs
        piece_tokens = min(max_num_batched_tokens, PIECE_MAX_TOKENS) if piecewise_graphs_on(cfg.model, self.device) \
            and not eager else 0
        if compiles is not None and not compiles.started:  # a dry pass costs a forward a graph: not for a warm cache
            compiles = None
        self.runner = ModelRunner(self.model, self.kv_cache, self.block_manager, self.device, max_blocks_per_seq, graph_batch,
                                  self.eos_token_ids, cascade, piece_tokens, cfg.scheduler.step_timeout_s, compiles)
        if self.runner.pieces is not None:
            log.info("piecewise graphs: %d token counts up to %d, %d pieces each, captured in %.1f s",
                     len(self.runner.pieces.buckets), piece_tokens, self.runner.pieces.num_pieces,
                     self.runner.pieces.capture_s)
        self.stats = StatsRecorder()
        self._seq_ids = itertools.count()
        self._in_flight: InFlight | None = None
        self._slowest_step_s = 0.0
        self._fallbacks_reported = 0
        laps.lap("graphs")
        if self.device.type == "cuda":
            self._warm_up(compiles)
        gc.collect()  # start-up's objects leave the young generations now, not in the first run's intake
        laps.lap("warm_up")

    def _prefix_pass(self, kv_dtype: torch.dtype) -> PrefixPass | None:
        """How the cascade's Triton prefix pass plans a step on this model's heads (None on the CPU, whose
        reference needs no plan); per rank under tensor parallelism the plan is the whole model's, which
        only changes its balance."""
        if self.device.type != "cuda":
            return None
        spec = self.model.kv_cache_spec
        group = self.model.arch.num_attention_heads // spec.num_kv_heads
        key_cache_like = torch.empty(1, spec.num_kv_heads, self.block_size, spec.head_dim, dtype=kv_dtype,
                                     device=self.device)
        q_like = torch.empty(1, group * spec.num_kv_heads, spec.head_dim, dtype=self.dtype, device=self.device)
        return PrefixPass.of(q_like, key_cache_like)

    def _warm_up(self, compiles: CompilePool | None = None) -> None:
        """A small run of the real loop before the timed one: a prefill step at the full token budget,
        then one decode step at each of warm_up_batch_sizes (every decode graph's bucket and the size below
        it). Whatever is paid the first time a shape occurs (kernel compilation, cuBLAS's choice of
        kernel for a new matmul shape, a CUDA graph's first replay, pinned buffers of a new size) is
        paid here: inside a run it stalled the host long enough for the GPU to idle (NOTES, version 7). A
        decode step of another size replays the same graphs and kernel variants (an eager one, under
        enforce_eager, may still meet cuBLAS's choice for its row count: ~84 us a matmul, NOTES session 7). The
        steps between (prefill chunks of other token counts) can pick launches of their own: the model
        compiles those first (compile_launches; with compiles, side by side first)."""
        if not self.parallel:  # a rank's share of the experts has a width of its own, which no table holds
            run_compiled_ahead(compiles, self.model.compile_launches, self.scheduler.max_num_batched_tokens)
        num_seqs = self.scheduler.max_num_seqs
        room = min(self.max_model_len, self.num_blocks * self.block_size // num_seqs)  # tokens per request
        prompt = max(1, min(self.scheduler.max_num_batched_tokens // num_seqs, room // 2))
        vocab = self.model.arch.vocab_size
        sizes = warm_up_batch_sizes(num_seqs)
        for i in range(num_seqs):  # distinct prompts: prefix-cache hits would shrink the prefill step
            # request i decodes in the steps whose batch is larger than i: the t-th step then has sizes[t] rows
            tokens = max(1, min(1 + sum(size > i for size in sizes), room - prompt))
            self.add_request(f"warm-up-{i}", [i % vocab] * prompt,  # logprobs: their path at each size
                             SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=MAX_LOGPROBS))
        list(self.run())
        self.block_manager.reset_prefix_cache()
        self.stats = StatsRecorder()  # the warm-up is not part of the run

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_physical_blocks

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> Sequence:
        """Queue a request's n samples; returns sample 0. The caller has checked the request (LLM does,
        once: check_request, and its token ids against the vocabulary). Samples 1..n-1 are held by sample
        0 and forked from it in the step that computes its last prompt chunk (the scheduler's Fork), so
        the prompt is computed once; where they cannot be forked they are queued first in line then, to
        take its full blocks from the prefix cache. A request for prompt logprobs takes nothing from the
        cache nor forks: each sample computes its prompt to have them."""
        sampling = sampling.for_request(request_id)  # LLM has given it its request's own; this for direct callers
        max_num_tokens = min(len(prompt_token_ids) + sampling.max_tokens, self.max_model_len)
        prompt = tuple(prompt_token_ids)  # the samples' one copy, which the garbage collector leaves alone (Sequence)
        samples = [Sequence(next(self._seq_ids), request_id, prompt, sampling.sample(i), max_num_tokens, sample_index=i)
                   for i in range(sampling.n)]
        if sampling.structured_outputs is not None:  # each sample its own matcher
            for seq in samples:
                seq.constraint = self._constraint(sampling.structured_outputs, seq.prompt_token_ids)
        first, rest = samples[0], samples[1:]
        if sampling.stop:
            for seq in samples:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        self.scheduler.add(first)
        if first.scores_prompt:
            for seq in rest:
                self.scheduler.add(seq)
        else:
            first.held_samples = rest
        return first

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler of this engine's tokenizer, built when the first constrained request comes
        (or LLM.prepare_structured_outputs asks): ~2 s for a vocabulary of 150k tokens, holding the GIL."""
        start = time.perf_counter()
        compiler = GrammarCompiler(self.tokenizer, self.model.arch.vocab_size, eos_token_ids=self.eos_token_ids)
        log.info("structured outputs: the grammar library took the tokenizer's %d tokens in %.2f s",
                 len(self.tokenizer), time.perf_counter() - start)
        return compiler

    def check_grammar(self, params: StructuredOutputsParams) -> None:
        """RequestError naming the field when the constraint's grammar does not compile (compiled once per
        text, on the compiler's threads; this waits for it)."""
        try:
            self.grammars.wait(params, GRAMMAR_TIMEOUT_S)
        except (ValueError, TimeoutError) as err:
            raise RequestError(str(err)) from None

    def _constraint(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> Constraint:
        """A fresh matcher of the (checked) grammar; with a reasoning parser, active only once the prompt or
        the outputs have closed the reasoning."""
        matcher, parser = self.grammars.new_matcher(params, GRAMMAR_TIMEOUT_S), self.reasoning_parser
        if parser is None:
            return Constraint(matcher)
        return Constraint(matcher, parser.reasoning_ended(prompt_token_ids, []), parser.end_token_id)

    def check_request(self, prompt_len: int, sampling: SamplingParams) -> None:
        if prompt_len == 0:
            raise RequestError("prompt is empty")
        if prompt_len >= self.max_model_len:
            raise RequestError(f"prompt has {prompt_len} tokens; model.max_model_len {self.max_model_len} leaves no room for output")
        if sampling.max_tokens < 1:
            raise RequestError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        vocab = self.model.arch.vocab_size
        outside = next((t for t in sampling.stop_token_ids if t >= vocab), None)
        if outside is not None:  # never drawn, and the min_tokens ban would index past the logits
            raise RequestError(f"stop_token_ids must be token ids < {vocab} (the vocabulary size), got {outside}")
        most = min(vocab, MAX_LOGPROBS)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(sampling, name) or 0) > most:
                raise RequestError(f"{name} must be <= {most} (the vocabulary size or {MAX_LOGPROBS}, "
                                   f"the most the sampler returns), got {getattr(sampling, name)}")
        need = blocks_needed(min(prompt_len + sampling.max_tokens, self.max_model_len), self.block_size)
        if need > self.num_blocks:
            raise RequestError(f"needs {need} blocks of {self.block_size} tokens; the pool has {self.num_blocks}")

    def step(self) -> list[Sequence]:
        """Schedule and launch one step (or a decode run of several: _run_steps), then resolve the step
        before it (whose tokens the device has computed meanwhile); returns the sequences that finished. The
        host prepares step N + 1 while the device still runs step N."""
        batch = self.scheduler.schedule()
        run_steps = self._run_steps(batch)
        if run_steps > 1:
            self.scheduler.extend_decodes(batch, run_steps)
        stats = snapshot(len(self.stats.steps), batch, self.scheduler, self.block_manager, self.max_model_len)
        launched = self.runner.launch(batch, self._in_flight, stats.step, self._tokens) if batch.seqs else None
        stats.cascade_rows = self.runner.cascade_rows if batch.seqs else 0
        self._account(batch)
        finished = self._resolve(self._in_flight) if self._in_flight else []
        self._in_flight = launched
        stats.finished, stats.step_time_s = len(finished), self.stats.lap()
        self._slowest_step_s = max(self._slowest_step_s, stats.step_time_s)
        if batch.num_steps > 1:
            self.stats.steps += run_stats(stats, batch.num_new_tokens)
        elif batch.seqs:
            self.stats.add(stats)
        elif self.stats.steps:  # only resolved the step before: its time and finishes belong to that one
            self.stats.steps[-1].step_time_s += stats.step_time_s
            self.stats.steps[-1].finished += stats.finished
        if self.cfg.cache.check_invariants and not self.block_manager.invariants_ok():
            raise AssertionError(f"block manager invariants broken after step {stats.step}")
        return finished

    def _run_steps(self, batch) -> int:
        """How many device steps the batch may run as one (scheduler.num_scheduler_steps): a decode-only batch
        without forks whose rows all draw ahead (Sequence.draws_ahead), while no request waits (a run would hold
        back its admission), else 1."""
        if (self.num_scheduler_steps == 1 or batch.num_decode_seqs < len(batch.seqs) or batch.forks
                or self.scheduler.waiting):
            return 1
        return self.num_scheduler_steps if all(map(_DRAWS_AHEAD, batch.seqs)) else 1

    def _account(self, batch) -> None:
        """A launched chunk that ends its sequence's prefill drew a token, as did the samples forked from
        it, which stays a placeholder until resolved (the chunks' tokens counted as computed when the
        scheduler allocated their slots); a decode run's rows drew one a step."""
        if batch.num_steps > 1:
            for seq, count in zip(batch.seqs, batch.num_new_tokens):
                seq.output_token_ids += [PLACEHOLDER] * count
            return
        for seq in itertools.compress(batch.seqs, batch.draws):
            seq.output_token_ids.append(PLACEHOLDER)
        for fork in batch.forks:
            for child in fork.children:
                child.output_token_ids.append(PLACEHOLDER)

    def _resolve(self, step: InFlight) -> list[Sequence]:
        """Fill in the tokens of a finished step and retire the sequences they end."""
        finished, tokens, logprobs = [], self._tokens(step), step.logprobs
        if tokens:
            self.stats.token_resolved()
        if logprobs is not None:
            logprobs.add_prompts()
        eos, caching, block_size = self.eos_token_ids, self.prefix_caching, self.block_size
        rows = None
        if step.steps is not None:  # a decode run's tokens, a row at a time
            tokens = list(zip(*tokens))
            rows = self._fill_quiet_rows(step, tokens)
        for row, seq, index, token in drawn_tokens(step, tokens, rows):
            if seq.status is Status.FINISHED:
                continue  # stopped by a token before: this one was drawn past the end
            seq.output_token_ids[index] = token
            if logprobs is not None:
                logprobs.add_output(seq, row)
            if seq.constraint is not None:
                seq.constraint.advance(seq.output_token_ids, index + 1)
            num_tokens = len(seq.prompt_token_ids) + index + 1
            # what can end a sequence, tested first: most rows of a step end nothing (one pass a row a step)
            if (num_tokens >= seq.max_num_tokens or token in eos or seq.sampling.stop_token_ids
                    or seq.detokenizer is not None or seq.constraint is not None):
                reason = self._finish_reason(seq, token, index)
                if reason:
                    seq.truncate_outputs(index + 1)  # a token drawn after the stop, still in flight
                    self.scheduler.finish(seq, reason)
                    finished.append(seq)
                    continue
            if caching and num_tokens % block_size == 0:
                self.block_manager.register_known_blocks(seq)
        return finished

    def _fill_quiet_rows(self, step: InFlight, tokens: list) -> list[int]:
        """Fill in the tokens of a decode run's rows that none of them can end (no EOS or stop id among them, no
        stop strings or grammar, the length limit not reached: _resolve's test for each), a slice a row,
        offering the blocks they complete to the prefix cache; returns the other rows, which _resolve takes
        token by token. tokens: the run's per row."""
        eos, block_size, others = self.eos_token_ids, self.block_size, []
        for row, (seq, index, count) in enumerate(zip(step.seqs, step.output_index, step.steps)):
            if seq.status is Status.FINISHED:
                continue  # stopped by a token of the step before: all of these were drawn past the end
            start, drawn = len(seq.prompt_token_ids) + index, tokens[row][:count]  # start: tokens before the run's
            if (start + count >= seq.max_num_tokens or not eos.isdisjoint(drawn) or seq.sampling.stop_token_ids
                    or seq.detokenizer is not None or seq.constraint is not None):
                others.append(row)
                continue
            seq.output_token_ids[index:index + count] = drawn
            if self.prefix_caching and start // block_size != (start + count) // block_size:
                self.block_manager.register_known_blocks(seq)
        return others

    def _tokens(self, step: InFlight) -> list:
        """The step's sampled tokens (a decode run's, a list a step), once the device has them; StepTimeout
        (its inputs saved in run_dir) if that takes longer than the watchdog's deadline."""
        deadline = step_deadline_s(self.cfg.scheduler.step_timeout_s, self._slowest_step_s)
        if not wait_until(step.drawn().done, deadline):
            raise stalled(step.inputs, deadline, self.run_dir)
        return step.host_tokens.tolist()

    def _finish_reason(self, seq: Sequence, token: int, index: int) -> str | None:
        """stop, length or None for output `index` (= token) of seq; sets seq.stop_reason and, for a stop
        string, seq.output_text. EOS and stop ids end nothing before min_tokens outputs, a stop string only
        once a token after the first min_tokens completes it (vLLM's rule: the text of the first min_tokens
        outputs is never cut); it is looked for in the text the token completed (a string may span tokens).
        _resolve calls it only for rows that one of its conditions could end: a new condition goes into that
        test too."""
        p = seq.sampling
        stopping = index + 1 >= p.min_tokens
        if stopping and token in self.eos_token_ids and not p.ignore_eos:  # first, as vLLM
            seq.stop_reason = None if token in self.silent_eos else token
            return "stop"
        if stopping and token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if seq.detokenizer is not None and self._stop_string(seq, token, index >= p.min_tokens):
            return "stop"
        if seq.constraint is not None and seq.constraint.finished:  # the grammar is complete: all of it is text
            seq.output_text = decode_after(self.tokenizer, seq.prompt_token_ids, seq.output_token_ids[:index + 1])
            return "stop"
        if len(seq.prompt_token_ids) + index + 1 >= seq.max_num_tokens:
            return "length"
        return None

    @staticmethod
    def _stop_string(seq: Sequence, token: int, stopping: bool) -> bool:
        """Detokenize the token; True if the text it completed ends a stop string (when `stopping`), with
        seq.stop_reason the string and seq.output_text the text cut before it (after it when
        include_stop_str_in_output)."""
        new_chars = seq.detokenizer.add(token)
        found = seq.detokenizer.find_stop(seq.sampling.stop, new_chars) if stopping and new_chars else None
        if found:
            seq.stop_reason, start = found
            end = start + len(seq.stop_reason) if seq.sampling.include_stop_str_in_output else start
            seq.output_text = seq.detokenizer.text[:end]
        return found is not None

    def abort_all(self) -> None:
        """Drop every request (a run interrupted or abandoned): the step in flight, whose tokens nobody will
        take; every sequence and its blocks; and the prefix cache, whose newest blocks a step stopped before
        its launch never wrote. The engine can run new requests afterwards."""
        self._in_flight = None
        self.scheduler.abort_all()
        self.block_manager.reset_prefix_cache()
        if not self.block_manager.invariants_ok():  # stopped inside the block manager itself: not to be trusted
            self.close()
            raise RuntimeError("the KV pool could not be restored after the run was stopped; the LLM is closed: "
                               "make a new one")

    @property
    def has_work(self) -> bool:
        """Requests queued or running, or a step's tokens still to take."""
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def closed(self) -> bool:
        return self.runner is None

    def close(self) -> None:
        """Free the KV cache and the CUDA graphs, and stop the grammar compiler's threads; the engine cannot
        step afterwards."""
        self.runner = self.kv_cache = None
        if self.parallel:
            self.model.close()
        if "grammars" in self.__dict__:  # built (a cached_property) by a constrained request
            self.grammars.close()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self) -> Iterator[Sequence]:
        """Step until every queued request has finished, yielding each as it finishes."""
        while self.has_work:
            yield from self.step()
        fallbacks = self.sampler_fallbacks
        if fallbacks > self._fallbacks_reported:
            log.warning("%d draws so far took the truncating sampler's exact fallback (its rounds ran out: "
                        "ops/sampling.py)", fallbacks)
            self._fallbacks_reported = fallbacks

    @property
    def sampler_fallbacks(self) -> int:
        """Rows drawn through the truncating sampler's exact fallback since the engine started (waits for
        the device)."""
        return int(self.runner.sampler_fallbacks.item())
