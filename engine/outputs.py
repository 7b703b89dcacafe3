"""The output processor: finished sequences in, RequestOutputs out (vLLM's shapes).

The engine retires each sample of a request (a Sequence) on its own; OutputProcessor holds them until the
request's n-th sample has finished, then makes one RequestOutput: the samples by index, each one's text
(cut before the stop string that ended it, else its tokens decoded), and logprobs as one {token: Logprob}
mapping per position: the token's own, then the k most likely by rank. With a reasoning parser
(engine/reasoning.py) the text is split: `text` is the content (the answer), `reasoning` what the model
thought before it.
"""
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.detokenizer import decode_after


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 for the most likely token: 1 + the tokens more likely (vLLM's)
    decoded_token: str | None = None  # the token decoded alone, as vLLM's (tokenizer.decode([token]))


class TokenTexts(dict):
    """token id -> its text decoded alone (Logprob.decoded_token), each id decoded once: a run with logprobs
    meets the same ids again and again."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token: int) -> str:
        text = self[token] = self.tokenizer.decode([token])
        return text


Logprobs = list[dict[int, Logprob]]  # per token: {the token: its Logprob, then the k most likely, by rank}


@dataclass
class CompletionOutput:
    index: int  # the sample's index among the request's n
    text: str  # cut before the stop string that ended it (unless include_stop_str_in_output); the content with a reasoning parser
    token_ids: list[int]  # every token drawn, the one that completed a stop string or a stop id included
    finish_reason: str | None  # stop | length
    logprobs: Logprobs | None = None  # when SamplingParams.logprobs is not None
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it; None for EOS
    reasoning: str | None = None  # the reasoning parser's reasoning, its tags left out; None without either
    cumulative_logprob: float | None = None  # the sum of its tokens' logprobs, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    request_id: Any
    prompt: str | None  # None for token-id prompts and conversations
    prompt_token_ids: list[int] | None  # None when the request failed before tokenization
    outputs: list[CompletionOutput]  # one per sample (SamplingParams.n), by index; empty when the request failed
    error: str | None = None  # why the request could not run (stream() only; generate() raises)
    finished: bool = True
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # when SamplingParams.prompt_logprobs is not None


class OutputProcessor:
    """Groups the finished samples of the requests in flight and turns each whole request into its
    RequestOutput. Invariant: every key expected and not yet returned is in `_requests`, and `_samples`
    holds its finished samples, fewer than its n. reasoning_parser (engine/reasoning.py's): splits each
    output text into reasoning and content; None: no split."""

    def __init__(self, tokenizer, reasoning_parser=None):
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser
        self._token_texts = TokenTexts(tokenizer)
        self._requests: dict[str, tuple[Any, str | None]] = {}  # engine key -> (request_id, prompt text)
        self._samples: dict[str, list] = {}

    @property
    def num_pending(self) -> int:
        """Requests expected whose output is not out yet."""
        return len(self._requests)

    def expect(self, key: str, request_id, prompt: str | None) -> None:
        """A request queued in the engine under `key` (its sequences' request_id)."""
        self._requests[key] = (request_id, prompt)

    def clear(self) -> None:
        self._requests.clear()
        self._samples.clear()

    def outputs(self, finished: Iterable) -> Iterator[RequestOutput]:
        """The RequestOutputs of the requests whose last sample is among the `finished` sequences."""
        for seq in finished:
            done = self._samples.setdefault(seq.request_id, [])
            done.append(seq)
            if len(done) == seq.sampling.n:
                del self._samples[seq.request_id]
                yield self._output(*self._requests.pop(seq.request_id), sorted(done, key=lambda s: s.sample_index))

    def _output(self, request_id, prompt: str | None, samples: list) -> RequestOutput:
        completions = [self._completion(seq) for seq in samples]
        first = samples[0]
        return RequestOutput(request_id, prompt, list(first.prompt_token_ids), completions,
                             prompt_logprobs=prompt_logprobs(first, self._token_texts))

    def _completion(self, seq) -> CompletionOutput:
        """One sample's CompletionOutput: its text split by the reasoning parser, if there is one."""
        text = self._text(seq)
        parser = self.reasoning_parser
        reasoning, text = (None, text) if parser is None else \
            parser.split(text, parser.prompt_opened_reasoning(seq.prompt_token_ids))
        logprobs = output_logprobs(seq, self._token_texts)
        cumulative = None if logprobs is None else sum(seq.output_logprobs)
        return CompletionOutput(seq.sample_index, text, list(seq.output_token_ids), seq.finish_reason,
                                logprobs, seq.stop_reason, reasoning, cumulative)

    def _text(self, seq) -> str:
        """The output text: cut at the stop string that ended it, else the tokens decoded, without the
        stop token (EOS or a stop id) that ended it unless include_stop_str_in_output (as vLLM)."""
        if seq.output_text is not None:
            return seq.output_text
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and not seq.sampling.include_stop_str_in_output:
            ids = ids[:-1]
        return decode_after(self.tokenizer, seq.prompt_token_ids, ids)


def _logprob_dicts(token_ids, logprobs, ranks, tops, texts=None) -> list[dict[int, Logprob] | None]:
    """Per position: {its token: Logprob with its rank, the k most likely tokens: theirs, ranked by their
    order (a tie keeps the smaller id first)}; None where the logprob is None (the first prompt token).
    texts (TokenTexts): each Logprob's decoded_token; None leaves them None."""
    text = texts.__getitem__ if texts is not None else lambda token: None
    positions = []
    for token, logprob, rank, top in zip(token_ids, logprobs, ranks, tops or [None] * len(logprobs)):
        ranked = {t: Logprob(value, order, text(t)) for order, (t, value) in enumerate(top or (), 1)}
        positions.append(None if logprob is None else
                         {token: ranked.get(token) or Logprob(logprob, rank, text(token)), **ranked})
    return positions


def output_logprobs(seq, texts=None) -> Logprobs | None:
    if seq.sampling.logprobs is None:
        return None
    return _logprob_dicts(seq.output_token_ids, seq.output_logprobs, seq.output_ranks, seq.top_logprobs, texts)


def prompt_logprobs(seq, texts=None) -> list[dict[int, Logprob] | None] | None:
    if seq.sampling.prompt_logprobs is None:
        return None
    return _logprob_dicts(seq.prompt_token_ids, seq.prompt_logprobs, seq.prompt_ranks, seq.prompt_top_logprobs,
                          texts)
