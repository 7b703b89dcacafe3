"""The Python API, in vLLM's shape:

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny", max_model_len=512)
    for out in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8)):
        print(out.prompt, out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason)

`model` is a conf/model/ name ("tiny", "qwen3-0.6b": random weights of that shape), else a checkpoint
directory or hub id (model.path). The other keyword arguments set config fields of the model, cache and
scheduler sections by their own names, which are vLLM's where vLLM has one (dtype, max_model_len,
block_size, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, seed =
model.seed: the seed of random weights, and of the draws of generate()'s requests without a seed of their
own, which continue from call to call as vLLM's do; SamplingParams.seed fixes a request's draws).

generate() and chat() take everything at once and return one RequestOutput per prompt, in input order;
every prompt and its sampling_params are checked before any work, and the first that cannot run (a
value of the wrong type, an unknown key of a dict prompt, a token id outside the vocabulary, ...) raises
RequestError naming the argument and the prompt's index. stream() is the core the batch
job (and a distributed executor) drives: requests come from any iterable and are pulled, tokenized and
queued only while fewer than `window` are in the engine, results are yielded as they finish, and a
request that cannot run yields an error result (RequestOutput.error) instead of raising.
"""
import contextlib
import gc
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from engine.config import engine_config
from engine.engine import LLMEngine
from engine.errors import ConfigError, RequestError, did_you_mean
from engine.generation_config import resolve_sampling
from engine.models.loader import to_hf_model
from engine.outputs import OutputProcessor, RequestOutput
from engine.sequence import SamplingParams
from engine.stats import FloorModel, StepStats, floor_model, steps_table

# a dict prompt holds one of these keys, as vLLM's TextPrompt and TokensPrompt: its type, in words
DICT_PROMPTS = {"prompt": (str, "a string"), "prompt_token_ids": ((list, tuple), "a list of token ids")}
PROMPT_KINDS = "a string, a list of token ids, or a dict with 'prompt' (a string) or 'prompt_token_ids'"


STREAM_SUPERSEDED = ("this stream has stopped: a later generate, chat or stream call on the same LLM took the "
                     "engine (one runs at a time), and the requests it had in flight were dropped")
CLOSED = "this LLM is closed: make a new one"


@dataclass
class Request:
    """One request for LLM.stream: a text prompt, token ids or a conversation (messages, chat template
    applied when admitted; prompt may hold the text it was made from, which the result reports). `error`:
    known unusable before admission (it is passed through as the result)."""
    request_id: Any
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling_params: SamplingParams | None = None  # None: the LLM's default
    error: str | None = None


@dataclass(frozen=True)
class EngineSettings:
    """What the engine's settings came to once it was built (the settings columns of summary.parquet)."""
    model: str  # model.name
    model_path: str  # model.path, "" for random weights
    dtype: str
    device: str  # cuda | cpu
    device_name: str
    block_size: int
    num_blocks: int
    kv_slots: int  # num_blocks * block_size
    kv_budget_bytes: int  # the KV pool's bytes
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class RunStats:
    """What the engine has done since it was built (engine/stats.py): its steps (steps.parquet's rows) and
    the run-level figures over all of them (summary.parquet's: wall_time_s counts from the start of the
    latest stream, generate or chat, so a job's set-up is not in it)."""
    steps: list[StepStats]  # from step `since_step` of stats() on
    figures: dict
    sampler_fallbacks: int  # rows drawn through the truncating sampler's exact fallback

    def table(self):
        """The steps as steps.parquet's table (engine/stats.py's STEPS_SCHEMA)."""
        return steps_table(self.steps)


RUN_GC_THRESHOLD = 50_000  # container allocations between young collections during a run (Python's default: 700)


@contextlib.contextmanager
def frozen_heap():
    """Within, the objects alive on entry (the model's modules, the tokenizer's tables: ~250k) are left out
    of the garbage collections that a run's allocations trigger, each of which would traverse them all:
    the full collection of a 4,096-request CPU run took 136 ms with them, 41 ms without (benchmarks/NOTES.md).
    They are collectable again on exit (nested uses unfreeze at the innermost exit, which costs only speed).
    The young generation is collected every RUN_GC_THRESHOLD allocations instead of 700: a run makes no cyclic
    garbage (tests/test_api.py), so those collections free nothing and only traverse the run's live requests
    (736 collections, 93 ms, over 600 steps of the rollout workload on the CPU; 1 collection, 4 ms, at 50,000)."""
    thresholds = gc.get_threshold()
    gc.freeze()
    if thresholds[0]:  # 0: the caller has turned automatic collection off
        gc.set_threshold(max(thresholds[0], RUN_GC_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


class LLM:
    def __init__(self, model: str = "tiny", reasoning_parser: str | None = None, **engine_options):
        """reasoning_parser: "qwen3" splits each output's reasoning (<think>...</think>) into
        CompletionOutput.reasoning, and a structured-output constraint applies after it (engine/reasoning.py)."""
        self._start(engine_config(model, **engine_options), None, reasoning_parser)

    @classmethod
    def from_config(cls, cfg, run_dir=None, reasoning_parser: str | None = None,
                    max_sequences: int | None = None) -> "LLM":
        """An LLM on a checked EngineConfig (engine/config.py; the batch layer converts what Hydra
        composed); run_dir: where a stalled step's inputs are saved (engine/watchdog.py); max_sequences:
        the most sequences (requests times samples) it will run, where known (LLMEngine's)."""
        llm = cls.__new__(cls)
        llm._start(cfg, run_dir, reasoning_parser, max_sequences)
        return llm

    def _start(self, cfg, run_dir, reasoning_parser: str | None, max_sequences: int | None = None) -> None:
        self.engine = LLMEngine(cfg, run_dir, reasoning_parser, max_sequences)
        self.cfg = self.engine.cfg  # model.max_model_len resolved
        self.tokenizer = self.engine.tokenizer
        self.default_sampling = resolve_sampling(cfg.sampling, self.engine.generation_config)
        check_run_sampling(self.engine, self.default_sampling)
        self._outputs = OutputProcessor(self.tokenizer, self.engine.reasoning_parser)
        self._stream: object | None = None  # the stream whose requests are in the engine (one at a time)
        self._requests_run = 0  # by generate() and chat(): a request's number seeds it (_seed_by_number)

    # -- what a run needs to know of the engine ------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.engine.model.arch.vocab_size

    def get_tokenizer(self):
        """The tokenizer (vLLM's name for it; also the attribute `tokenizer`)."""
        return self.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The end-of-sequence ids (config.json's and generation_config.json's together)."""
        return self.engine.eos_token_ids

    def _open_engine(self) -> LLMEngine:
        """The engine, or RuntimeError once close() has freed it."""
        if self.engine.closed:
            raise RuntimeError(CLOSED)
        return self.engine

    def settings(self) -> EngineSettings:
        engine = self._open_engine()
        device = engine.device
        return EngineSettings(
            model=self.cfg.model.name, model_path=self.cfg.model.path or "", dtype=str(engine.dtype).removeprefix("torch."),
            device=device.type, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            block_size=engine.block_size, num_blocks=engine.num_blocks, kv_slots=engine.num_blocks * engine.block_size,
            kv_budget_bytes=engine.kv_cache.bytes, max_model_len=engine.max_model_len,
            max_num_seqs=engine.scheduler.max_num_seqs, max_num_batched_tokens=engine.scheduler.max_num_batched_tokens)

    @property
    def startup_s(self) -> dict:
        """Where the engine's start-up went, in seconds (LLMEngine.startup_s: before_engine, model, tokenizer,
        kv_pool, graphs, warm_up)."""
        return dict(self.engine.startup_s)

    def stats(self, since_step: int = 0) -> RunStats:
        """The steps from `since_step` on and the figures of the whole run (waits for the device)."""
        engine = self._open_engine()
        return RunStats(engine.stats.steps[since_step:],
                        engine.stats.summary(engine.num_blocks, engine.block_size, engine.max_model_len),
                        engine.sampler_fallbacks)

    def floor_model(self) -> FloorModel:
        """The model's sizes that engine/stats.py's workload floor is computed from."""
        engine = self._open_engine()
        return floor_model(engine.model, engine.kv_cache.bytes // (engine.num_blocks * engine.block_size))

    def hf_model(self):
        """transformers' model with this engine's weights (a baseline to compare with); after close() too, which
        frees the KV cache and the graphs, not the weights."""
        return to_hf_model(self.engine.model)

    def prepare_structured_outputs(self) -> None:
        """Build the grammar compiler now: a job whose rows may carry constraints calls it before its rows
        come, so that the first constrained request does not wait for the grammar library to take the
        tokenizer (~2 s for 150k tokens, once)."""
        self._open_engine().grammars  # noqa: B018 (a cached_property: reading it builds it)

    def close(self) -> None:
        """Free the KV cache and the CUDA graphs; every call that needs them afterwards is a RuntimeError, an
        open stream's next result too (its requests are aborted first). hf_model() still works."""
        self._drop_stream()
        self.engine.close()

    # -- everything at once --------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is text, token ids, or vLLM's dict
        prompts {"prompt": text} and {"prompt_token_ids": ids}; `prompts` is one or a list of them.
        RequestError, before any work, when a prompt cannot run (not a prompt, empty, a token id outside
        the vocabulary, too long for max_model_len or for the pool), naming `prompts[index]`. use_tqdm: a
        progress bar of the requests finished (vLLM's keyword)."""
        if _is_one_prompt(prompts):
            return self._run_all([prompt_request(0, prompts, "prompts")], sampling_params, use_tqdm=use_tqdm)
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a prompt ({PROMPT_KINDS}) or a list of prompts, got {prompts!r}")
        return self._run_all([prompt_request(i, p, f"prompts[{i}]") for i, p in enumerate(prompts)], sampling_params,
                             use_tqdm=use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None, *, use_tqdm: bool = False) -> list[RequestOutput]:
        """generate() on conversations (lists of {"role", "content"}), through the tokenizer's chat template
        with the generation prompt added."""
        check_chat_template_kwargs(chat_template_kwargs)
        self.check_chat_template()
        if not isinstance(messages, (list, tuple)):
            raise RequestError(f"messages must be a conversation (a list of {{role, content}}) or a list of them, "
                               f"got {messages!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run_all([Request(i, messages=m) for i, m in enumerate(conversations)], sampling_params,
                             chat_template_kwargs, use_tqdm)

    def check_chat_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            m = self.cfg.model
            raise ConfigError(f"model {m.tokenizer or m.path or m.name!r} has no chat template (its tokenizer sets "
                              f"none), which conversations need")

    def _run_all(self, requests: list[Request], sampling_params, chat_template_kwargs=None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        for request, params in zip(requests, per_request(sampling_params, len(requests))):
            request.sampling_params = params
        with frozen_heap():
            checked = [self._checked(request, chat_template_kwargs) for request in requests]
            failed = next(((request, error) for request, _, error in checked if error), None)
            if failed:  # every prompt checked before any work, as vLLM does
                raise RequestError(f"prompt {failed[0].request_id}: {failed[1]}")
            self._seed_by_number(requests)
            with tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm) as bar:
                outputs = [bar.update(1) or out for out in self._serve(checked, None)]
            return sorted(outputs, key=lambda out: out.request_id)

    # -- streaming -----------------------------------------------------------------------------------
    def stream(self, requests: Iterable[Request], window: int | None = None,
               chat_template_kwargs: dict | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput for every request, as each finishes (not in input order).

        At most `window` requests (default 2 * max_num_seqs) are in the engine at once: the next request
        is pulled from `requests` and tokenized only when one leaves, so memory is bounded by the window
        whatever the length of `requests`. A request that cannot run yields an error result at once; an item
        that is not a Request stops the stream with a TypeError naming it."""
        check_chat_template_kwargs(chat_template_kwargs)
        return self._serve((self._checked(stream_request(i, request), chat_template_kwargs)
                            for i, request in enumerate(requests)), window)

    def _serve(self, checked: Iterable[tuple[Request, list[int] | None, str | None]],
               window: int | None) -> Iterator[RequestOutput]:
        """Queue each checked request (an error result for one that cannot run) while fewer than `window`
        are in the engine and the scheduler is not saturated, stepping it meanwhile, so the intake
        overlaps the device's steps; yield the outputs as their requests finish."""
        self._open_engine()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a whole number >= 1, got {window!r}")
        window = window or 2 * self.engine.scheduler.max_num_seqs
        self._drop_stream()  # one left before its end, or still open around this call: its requests go
        stream = self._stream = object()
        self.engine.stats.restart_clock()  # time the generate loop, not the set-up before it
        try:
            with frozen_heap():
                for output in self._outputs_of(checked, window):
                    yield output
                    if self._stream is not stream:
                        raise RuntimeError(CLOSED if self.engine.closed else STREAM_SUPERSEDED)
        finally:  # the end, an error, an interrupt, or the caller closing the stream
            if self._stream is stream:
                self._drop_stream()

    def _outputs_of(self, checked, window: int) -> Iterator[RequestOutput]:
        for n, (request, token_ids, error) in enumerate(checked):
            if error:
                yield RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [], error=error)
                continue
            self.engine.add_request(str(n), token_ids, self._sampling(request).for_request(request.request_id))
            self._outputs.expect(str(n), request.request_id, request.prompt)
            while self._outputs.num_pending >= window or self.engine.scheduler.is_saturated():
                yield from self._outputs.outputs(self.engine.step())
        yield from self._outputs.outputs(self.engine.run())

    def _drop_stream(self) -> None:
        """Abort whatever the current stream left in the engine (nothing once it has ended)."""
        if self._stream is not None and not self.engine.closed and self.engine.has_work:
            self.engine.abort_all()
        self._outputs.clear()
        self._stream = None

    def _checked(self, request: Request, chat_template_kwargs) -> tuple[Request, list[int] | None, str | None]:
        """(request, its prompt's token ids, None) when it can run, else (request, None, why not): the one
        check of a request (its prompt, its token ids against the vocabulary, the engine's limits)."""
        try:
            if request.error:
                raise RequestError(request.error)
            check_request_fields(request)
            token_ids, sampling = self._token_ids(request, chat_template_kwargs), self._sampling(request)
            self.engine.check_request(len(token_ids), sampling)
            if sampling.structured_outputs is not None:
                self.engine.check_grammar(sampling.structured_outputs)
            return request, token_ids, None
        except RequestError as err:
            return request, None, str(err)

    def _seed_by_number(self, requests: list[Request]) -> None:
        """Give each request without a seed request_seed of its number among the requests this LLM has run
        in generate() and chat() (0, 1, ... over the calls), offset by 2^64 x the LLM's seed: as in vLLM, a
        second call with the same prompts draws new samples (an RL loop's rollouts), a new LLM with the same
        seed draws the same sequence of them, and another seed draws others."""
        first, self._requests_run = self._requests_run, self._requests_run + len(requests)
        offset = self.cfg.model.seed << 64
        for number, request in enumerate(requests, first):
            request.sampling_params = self._sampling(request).for_request(offset + number)

    def _sampling(self, request: Request) -> SamplingParams:
        return request.sampling_params or self.default_sampling

    def _token_ids(self, request: Request, chat_template_kwargs) -> list[int]:
        """The request's prompt as token ids, each checked to be in the vocabulary; RequestError if not."""
        token_ids = self._tokenize(request, chat_template_kwargs)
        vocab_size = self.vocab_size
        if token_ids and set(map(type, token_ids)) == {int}:  # the common case, checked in C: no Python step a token
            with contextlib.suppress(OverflowError):  # an id beyond int64: the message below
                ids = np.fromiter(token_ids, np.int64, len(token_ids))  # numpy's min and max: half the builtins' time
                if ids.min() >= 0 and ids.max() < vocab_size:
                    return token_ids
        outside = next((i for i, t in enumerate(token_ids) if not (_is_token_id(t) and 0 <= t < vocab_size)), None)
        if outside is not None and not _is_token_id(token_ids[outside]):
            raise RequestError(f"prompt_token_ids[{outside}] must be a token id (an int), got {token_ids[outside]!r}")
        if outside is not None:
            raise RequestError(f"token id {token_ids[outside]!r} at position {outside} is not in the vocabulary "
                               f"[0, {vocab_size})")
        return token_ids

    def _tokenize(self, request: Request, chat_template_kwargs) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        if request.messages is not None:
            messages = text_messages(request.messages)
            kwargs = chat_template_kwargs or {}
            # vLLM's defaults, which the kwargs may override (continue_final_message: no generation prompt)
            options = {"add_generation_prompt": not kwargs.get("continue_final_message"), **kwargs,
                       "tokenize": True, "return_dict": False}
            try:
                return self.tokenizer.apply_chat_template(messages, **options)
            except Exception as err:  # a malformed conversation fails in the template (Jinja, KeyError, ...)
                raise RequestError(f"chat template failed on this conversation: {err}") from None
        if request.prompt is None:
            raise RequestError("prompt is null")
        if not request.prompt:
            raise RequestError("prompt is empty")
        return self.tokenizer.encode(request.prompt)  # with its special tokens (a BOS), as vLLM


def check_chat_template_kwargs(kwargs) -> None:
    """TypeError unless chat_template_kwargs is None or a dict (the template's keyword arguments)."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"chat_template_kwargs must be a dict of the chat template's keyword arguments or None, "
                        f"got {kwargs!r:.60}")


def stream_request(index: int, item) -> Request:
    """Item `index` of a stream, which must be a Request (it has no request id to report an error result under)."""
    if not isinstance(item, Request):
        raise TypeError(f"stream: item {index} is {type(item).__name__} {item!r:.60}, not a Request (generate takes "
                        f"prompts: text, token ids or dicts)")
    return item


def check_run_sampling(engine: LLMEngine, sampling: SamplingParams) -> None:
    """ConfigError naming sampling.<field> when the run's sampling values are beyond what this engine can
    run (logprobs or prompt_logprobs over its vocabulary or the sampler's maximum, a structured_outputs
    grammar that does not compile): no row that keeps them could run, so the job stops before any work
    rather than make every row an error. The engine's request check is asked about a one-token prompt,
    which every other limit admits (validate and the pool's sizing ensure max_model_len >= 2 and a pool
    that holds a sequence of max_model_len), so what it rejects is the sampling values."""
    try:
        engine.check_request(1, sampling)
        if sampling.structured_outputs is not None:
            engine.check_grammar(sampling.structured_outputs)
    except RequestError as err:
        raise ConfigError(f"sampling.{err}") from None


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_request_fields(request: Request) -> None:
    """RequestError naming the field when a Request's fields are of the wrong kind: prompt a string,
    prompt_token_ids a list that comes alone (a conversation may carry the prompt text it was made from, which
    its result reports), sampling_params a SamplingParams or None."""
    if request.prompt_token_ids is not None and (request.prompt is not None or request.messages is not None):
        other = "prompt" if request.prompt is not None else "messages"
        raise RequestError(f"a request takes prompt_token_ids or {other}, not both")
    if request.prompt is not None and not isinstance(request.prompt, str):
        raise RequestError(f"prompt must be a string, got {request.prompt!r}")
    if request.prompt_token_ids is not None and not isinstance(request.prompt_token_ids, (list, tuple)):
        raise RequestError(f"prompt_token_ids must be a list of token ids, got {request.prompt_token_ids!r}")
    if request.sampling_params is not None and not isinstance(request.sampling_params, SamplingParams):
        raise RequestError(f"sampling_params must be a SamplingParams or None, got "
                           f"{type(request.sampling_params).__name__}")


def _is_one_prompt(prompts) -> bool:
    """Whether generate()'s `prompts` is one prompt (text, a dict, token ids) rather than a list of them."""
    return isinstance(prompts, (str, dict)) or \
        isinstance(prompts, (list, tuple)) and len(prompts) > 0 and _is_token_id(prompts[0])


def prompt_request(index: int, prompt, name: str) -> Request:
    """The Request of generate()'s prompt `index` (called `name` in messages); RequestError naming it
    when it is not a prompt (PROMPT_KINDS)."""
    if isinstance(prompt, dict):
        key = _dict_prompt_key(prompt, name)
        value, name = prompt[key], f"{name}[{key!r}]"
        kind, described = DICT_PROMPTS[key]
        if not isinstance(value, kind):
            raise RequestError(f"{name} must be {described}, got {value!r}")
        return prompt_request(index, value, name)
    if isinstance(prompt, str):
        return Request(index, prompt=prompt)
    if isinstance(prompt, (list, tuple)):
        if set(map(type, prompt)) == {int}:  # the common case, checked in C (a Python step per token: ~10x)
            return Request(index, prompt_token_ids=list(prompt))
        bad = next((i for i, token in enumerate(prompt) if not _is_token_id(token)), None)
        if bad is not None:
            raise RequestError(f"{name}[{bad}] must be a token id (an int), got {prompt[bad]!r}")
        return Request(index, prompt_token_ids=[int(token) for token in prompt])
    raise RequestError(f"{name} must be {PROMPT_KINDS}; got {prompt!r}")


def _dict_prompt_key(prompt: dict, name: str) -> str:
    """The one key of DICT_PROMPTS that dict prompt `name` holds; RequestError naming any other key."""
    unknown = next((key for key in prompt if key not in DICT_PROMPTS), None)
    if unknown is not None:
        raise RequestError(f"{name} has unknown key {unknown!r}{did_you_mean(str(unknown), DICT_PROMPTS)} (a dict "
                           f"prompt holds 'prompt' or 'prompt_token_ids')")
    if len(prompt) != 1:
        raise RequestError(f"{name} must hold one of 'prompt' and 'prompt_token_ids', got {prompt!r}")
    return next(iter(prompt))


def per_request(sampling_params, num_requests: int) -> list[SamplingParams | None]:
    """generate()'s and chat()'s sampling_params (None, one, or one per prompt) for each of the requests;
    ValueError for a list of another length, RequestError naming an entry that is not a SamplingParams."""
    if not isinstance(sampling_params, (list, tuple)):
        _check_sampling_params(sampling_params, "sampling_params")
        return [sampling_params] * num_requests
    if len(sampling_params) != num_requests:
        raise ValueError(f"{len(sampling_params)} sampling_params for {num_requests} prompts")
    for i, params in enumerate(sampling_params):
        _check_sampling_params(params, f"sampling_params[{i}]")
    return list(sampling_params)


def _check_sampling_params(params, name: str) -> None:
    if params is not None and not isinstance(params, SamplingParams):
        raise RequestError(f"{name} must be a SamplingParams or None, got {params!r}")


def text_messages(messages) -> list[dict]:
    """The conversation with each content a string (OpenAI's text parts joined, as vLLM joins them);
    RequestError naming the message and the field when it is not a list of {role, content}."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}}, got {messages!r}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be a {{role, content}} object, got {message!r}")
        if isinstance(message.get("content"), (list, tuple)):
            try:
                message = {**message, "content": joined_text(message["content"])}
            except ValueError as err:
                raise RequestError(f"messages[{i}].{err}") from None
        for key in ("role", "content"):
            if message.get(key) is None:
                raise RequestError(f"messages[{i}] has no {key}")
            if not isinstance(message[key], str):
                raise RequestError(f"messages[{i}].{key} must be a string, got {message[key]!r}")
        checked.append(message)
    return checked


def joined_text(parts: list) -> str:
    """A content given as a list of parts, as one string: the texts of its text parts joined with newlines,
    as vLLM joins them. ValueError naming the part (content[j]) that is not a text part."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ValueError(f"content[{j}] is a part of type {kind!r}: only text parts are supported"
                             if kind is not None else f"content[{j}] is not a part with a type, got {part!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"content[{j}] is a text part without text")
        texts.append(part["text"])
    return "\n".join(texts)

