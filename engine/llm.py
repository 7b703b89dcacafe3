"""The Python API, in vLLM's shape:

    from engine import LLM, SamplingParams
    llm = LLM(model="tiny", max_model_len=512)
    for out in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8)):
        print(out.prompt, out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].finish_reason)

`model` is a conf/model/ name ("tiny", "qwen3-0.6b": random weights of that shape), else a checkpoint
directory or hub id (model.path). The other keyword arguments set config fields of the model, cache and
scheduler sections by their own names, which are vLLM's where vLLM has one (dtype, max_model_len,
block_size, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, seed =
model.seed, the seed of random weights; a sampling seed is per request, SamplingParams.seed).

generate() and chat() take everything at once and return one RequestOutput per prompt, in input order;
every prompt and its sampling_params are checked before any work, and the first that cannot run (a
value of the wrong type, an unknown key of a dict prompt, a token id outside the vocabulary, ...) raises
RequestError naming the argument and the prompt's index. stream() is the core the batch
job (and a distributed executor) drives: requests come from any iterable and are pulled, tokenized and
queued only while fewer than `window` are in the engine, results are yielded as they finish, and a
request that cannot run yields an error result (RequestOutput.error) instead of raising.
"""
import dataclasses
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from engine.config import (CacheConfig, Config, ConfigError, ModelConfig, NoJob, SchedulerConfig, check_pool,
                           did_you_mean, validate)
from engine.engine import LLMEngine, RequestError
from engine.generation_config import resolve_sampling
from engine.sequence import SamplingParams

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
# engine option -> its config section: every field of the sections but the two that `model` sets
OPTIONS = {f.name: section for section, schema in SECTIONS.items() for f in dataclasses.fields(schema)
           if f.name not in ("name", "path")}
# a dict prompt holds one of these keys, as vLLM's TextPrompt and TokensPrompt: its type, in words
DICT_PROMPTS = {"prompt": (str, "a string"), "prompt_token_ids": ((list, tuple), "a list of token ids")}
PROMPT_KINDS = "a string, a list of token ids, or a dict with 'prompt' (a string) or 'prompt_token_ids'"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 for the most likely token; None for the token drawn when outside the k returned


Logprobs = list[dict[int, Logprob]]  # per token: {the token: its Logprob, then the k most likely, by rank}


@dataclass
class CompletionOutput:
    index: int  # the sample's index among the request's n
    text: str  # cut before the stop string that ended it (unless include_stop_str_in_output)
    token_ids: list[int]  # every token drawn, the one that completed a stop string or a stop id included
    finish_reason: str | None  # stop | length
    logprobs: Logprobs | None = None  # when SamplingParams.logprobs is not None
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it; None for EOS


@dataclass
class RequestOutput:
    request_id: Any
    prompt: str | None  # None for token-id prompts and conversations
    prompt_token_ids: list[int] | None  # None when the request failed before tokenization
    outputs: list[CompletionOutput]  # one per sample (SamplingParams.n), by index; empty when the request failed
    error: str | None = None  # why the request could not run (stream() only; generate() raises)
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # when SamplingParams.prompt_logprobs is not None


@dataclass
class Request:
    """One request for LLM.stream: a text prompt, token ids or a conversation (messages, chat template
    applied when admitted). `error`: known unusable before admission (it is passed through as the result)."""
    request_id: Any
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling_params: SamplingParams | None = None  # None: the LLM's default
    error: str | None = None


def default_groups() -> dict[str, str]:
    """The config groups conf/config.yaml picks by default, e.g. {"model": "tiny", "cache": "default"}."""
    defaults = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml").defaults)
    return {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}


def model_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))


def engine_config(model: str, **options) -> DictConfig:
    """The validated config of LLM(model, **options): the structured configs of engine/config.py with the
    same conf/*.yaml defaults as the command line, built without Hydra's global state."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        named = ", ".join(f"{name!r}{did_you_mean(name, OPTIONS, ' (did you mean {}?)')}" for name in unknown)
        raise TypeError(f"LLM() got unknown engine options: {named} (known: {', '.join(sorted(OPTIONS))})")
    groups = default_groups()
    is_name = model in model_names()
    cfg = OmegaConf.structured(Config)
    cfg.job = OmegaConf.structured(NoJob)
    for section in ("model", "cache", "scheduler", "sampling"):
        option = model if section == "model" and is_name else groups[section]
        cfg[section] = OmegaConf.merge(cfg[section], OmegaConf.load(CONF_DIR / section / f"{option}.yaml"))
    if not is_name:  # a checkpoint directory or a hub id
        cfg.model.path, cfg.model.name = model, Path(model).name
    for name, value in options.items():
        try:
            cfg[OPTIONS[name]][name] = value
        except OmegaConfBaseException as err:
            raise ConfigError(f"{name}: {str(err).splitlines()[0]}") from None
    validate(cfg)
    return cfg


def default_sampling(cfg, generation_config: dict | None = None) -> SamplingParams:
    """The run's SamplingParams: the sampling section of the config, with the checkpoint's
    generation_config.json (a dict) for the keys it leaves null."""
    return resolve_sampling(cfg.sampling, generation_config or {})


class LLM:
    def __init__(self, model: str = "tiny", **engine_options):
        self._start(engine_config(model, **engine_options))

    @classmethod
    def from_config(cls, cfg, run_dir=None) -> "LLM":
        """An LLM on an already validated config (the jobs: Hydra composed it); run_dir: where a stalled
        step's inputs are saved (engine/watchdog.py)."""
        llm = cls.__new__(cls)
        llm._start(cfg, run_dir)
        return llm

    def _start(self, cfg, run_dir=None) -> None:
        self.cfg = cfg
        self.engine = LLMEngine(cfg, run_dir)
        check_pool(self.engine.num_blocks, self.engine.block_size, self.engine.max_model_len)
        self.tokenizer = self.engine.tokenizer
        self.default_sampling = default_sampling(cfg, self.engine.generation_config)
        check_run_sampling(self.engine, self.default_sampling)
        self._abandoned = False  # a stream was left before its end: its requests are still in the engine

    # -- everything at once --------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is text, token ids, or vLLM's dict
        prompts {"prompt": text} and {"prompt_token_ids": ids}; `prompts` is one or a list of them.
        RequestError, before any work, when a prompt cannot run (not a prompt, empty, a token id outside
        the vocabulary, too long for max_model_len or for the pool), naming `prompts[index]`."""
        if _is_one_prompt(prompts):
            return self._run_all([prompt_request(0, prompts, "prompts")], sampling_params)
        if not isinstance(prompts, (list, tuple)):
            raise RequestError(f"prompts must be a prompt ({PROMPT_KINDS}) or a list of prompts, got {prompts!r}")
        return self._run_all([prompt_request(i, p, f"prompts[{i}]") for i, p in enumerate(prompts)], sampling_params)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """generate() on conversations (lists of {"role", "content"}), through the tokenizer's chat template
        with the generation prompt added."""
        self.check_chat_template()
        if not isinstance(messages, (list, tuple)):
            raise RequestError(f"messages must be a conversation (a list of {{role, content}}) or a list of them, "
                               f"got {messages!r}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run_all([Request(i, messages=m) for i, m in enumerate(conversations)], sampling_params,
                             chat_template_kwargs)

    def check_chat_template(self) -> None:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"model {self.cfg.model.name!r} has no chat template (its tokenizer sets none), "
                              f"which conversations need")

    def _run_all(self, requests: list[Request], sampling_params, chat_template_kwargs=None) -> list[RequestOutput]:
        for request, params in zip(requests, per_request(sampling_params, len(requests))):
            request.sampling_params = params
        for request in requests:  # every prompt checked before any work, as vLLM does
            try:
                request.prompt_token_ids = self._token_ids(request, chat_template_kwargs)
                self.engine.check_request(len(request.prompt_token_ids), self._sampling(request))
            except RequestError as err:
                raise RequestError(f"prompt {request.request_id}: {err}") from None
        results = sorted(self.stream(requests), key=lambda out: out.request_id)
        failed = next((out for out in results if out.error), None)
        if failed:
            raise RequestError(f"prompt {failed.request_id}: {failed.error}")
        return results

    # -- streaming -----------------------------------------------------------------------------------
    def stream(self, requests: Iterable[Request], window: int | None = None,
               chat_template_kwargs: dict | None = None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput for every request, as each finishes (not in input order).

        At most `window` requests (default 2 * max_num_seqs) are in the engine at once: the next request
        is pulled from `requests` and tokenized only when one leaves, so memory is bounded by the window
        whatever the length of `requests`. A request that cannot run yields an error result at once."""
        window = window or 2 * self.engine.scheduler.max_num_seqs
        if self._abandoned:  # finish what an abandoned stream left queued; its results are dropped
            for _ in self.engine.run():
                pass
        live: dict[str, Request] = {}  # the engine's request id (unique in this stream) -> request
        samples: dict[str, list] = {}  # the finished samples of the live requests
        self._abandoned = True
        for n, request in enumerate(requests):
            result = self._admit(request, str(n), chat_template_kwargs)
            if result is not None:
                yield result
                continue
            live[str(n)] = request
            while len(live) >= window:
                yield from self._results(self.engine.step(), live, samples)
        yield from self._results(self.engine.run(), live, samples)
        self._abandoned = False

    def _results(self, finished: Iterable, live: dict[str, Request],
                 samples: dict[str, list]) -> Iterator[RequestOutput]:
        """The results of the requests whose last sample is among the `finished` sequences."""
        for seq in finished:
            done = samples.setdefault(seq.request_id, [])
            done.append(seq)
            if len(done) == self._sampling(live[seq.request_id]).n:
                del samples[seq.request_id]
                yield self._result(live.pop(seq.request_id), sorted(done, key=lambda s: s.sample_index))

    def _admit(self, request: Request, key: str, chat_template_kwargs) -> RequestOutput | None:
        """Tokenize the request and queue it under `key`; its error result if it cannot run."""
        try:
            if request.error:
                raise RequestError(request.error)
            token_ids = self._token_ids(request, chat_template_kwargs)
            self.engine.add_request(key, token_ids, self._sampling(request))
            return None
        except RequestError as err:
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [], error=str(err))

    def _sampling(self, request: Request) -> SamplingParams:
        return request.sampling_params or self.default_sampling

    def _token_ids(self, request: Request, chat_template_kwargs) -> list[int]:
        """The request's prompt as token ids, each checked to be in the vocabulary; RequestError if not."""
        token_ids = self._tokenize(request, chat_template_kwargs)
        vocab_size = self.engine.model.arch.vocab_size
        tokenized = request.prompt_token_ids is None  # ints from the tokenizer: their range checked in C
        if tokenized and (not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size)):
            return token_ids
        outside = next((i for i, t in enumerate(token_ids) if not (_is_token_id(t) and 0 <= t < vocab_size)), None)
        if outside is not None:
            raise RequestError(f"token id {token_ids[outside]!r} at position {outside} is not in the vocabulary "
                               f"[0, {vocab_size})")
        return token_ids

    def _tokenize(self, request: Request, chat_template_kwargs) -> list[int]:
        if request.prompt_token_ids is not None:
            return request.prompt_token_ids
        if request.messages is not None:
            check_messages(request.messages)
            try:
                return self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False, **(chat_template_kwargs or {}))
            except Exception as err:  # a malformed conversation fails in the template (Jinja, KeyError, ...)
                raise RequestError(f"chat template failed on this conversation: {err}") from None
        if request.prompt is None:
            raise RequestError("prompt is null")
        if not request.prompt:
            raise RequestError("prompt is empty")
        return self.tokenizer.encode(request.prompt, add_special_tokens=False)

    def _result(self, request: Request, samples: list) -> RequestOutput:
        completions = [CompletionOutput(seq.sample_index, self._text(seq), list(seq.output_token_ids),
                                        seq.finish_reason, output_logprobs(seq), seq.stop_reason) for seq in samples]
        first = samples[0]
        return RequestOutput(request.request_id, request.prompt, first.prompt_token_ids, completions,
                             prompt_logprobs=prompt_logprobs(first))

    def _text(self, seq) -> str:
        """The output text: cut at the stop string that ended it, else the tokens decoded, without the
        stop token (EOS or a stop id) that ended it unless include_stop_str_in_output (as vLLM)."""
        if seq.output_text is not None:
            return seq.output_text
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not seq.sampling.include_stop_str_in_output:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def check_run_sampling(engine: LLMEngine, sampling: SamplingParams) -> None:
    """ConfigError naming sampling.<field> when the run's sampling values are beyond what this engine can
    run (logprobs or prompt_logprobs over its vocabulary or the sampler's maximum): no row that keeps them
    could run, so the job stops before any work rather than make every row an error. The engine's request
    check is asked about a one-token prompt, which every other limit admits (validate and check_pool ensure
    max_model_len >= 2 and a pool that holds a sequence of max_model_len), so what it rejects is the
    sampling values."""
    try:
        engine.check_request(1, sampling)
    except RequestError as err:
        raise ConfigError(f"sampling.{err}") from None


def _is_token_id(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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


def check_messages(messages) -> None:
    """RequestError naming the message and the field when a conversation is not a list of {role, content}."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}}, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be a {{role, content}} object, got {message!r}")
        for key in ("role", "content"):
            if message.get(key) is None:
                raise RequestError(f"messages[{i}] has no {key}")
            if not isinstance(message[key], str):
                raise RequestError(f"messages[{i}].{key} must be a string, got {message[key]!r}")


def _logprob_dicts(token_ids, logprobs, tops) -> list[dict[int, Logprob] | None]:
    """Per position: {its token: Logprob, the k most likely tokens: theirs, by rank}; None where the
    logprob is None (the first prompt token)."""
    positions = []
    for token, logprob, top in zip(token_ids, logprobs, tops or [None] * len(logprobs)):
        ranked = {t: Logprob(value, rank) for rank, (t, value) in enumerate(top or (), 1)}
        positions.append(None if logprob is None else {token: ranked.get(token, Logprob(logprob)), **ranked})
    return positions


def output_logprobs(seq) -> Logprobs | None:
    if seq.sampling.logprobs is None:
        return None
    return _logprob_dicts(seq.output_token_ids, seq.output_logprobs, seq.top_logprobs)


def prompt_logprobs(seq) -> list[dict[int, Logprob] | None] | None:
    if seq.sampling.prompt_logprobs is None:
        return None
    return _logprob_dicts(seq.prompt_token_ids, seq.prompt_logprobs, seq.prompt_top_logprobs)
