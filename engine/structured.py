"""Structured outputs: a request's output constrained to a JSON schema, a regex, a list of choices, a
grammar, or any JSON object (vLLM's StructuredOutputsParams), through llguidance.

Three pieces, in the order the engine meets them:

- StructuredOutputsParams: what a request asks for, checked when made (ValueError naming the field).
- GrammarCompiler: one per engine. submit() compiles a request's grammar on a worker thread (a Future,
  one per distinct StructuredOutputsParams.key); new_matcher() waits for it and gives the sequence its
  own GrammarMatcher, a copy of the compiled start state.
- Per step: a bitmask (allocate_bitmask's shape), GrammarMatcher.fill_bitmask or fill_bitmasks (parallel)
  on the host, or start_fill_bitmasks (the same on a worker thread, while the caller goes on), then
  ops.apply_token_bitmask on the logits' device; after the draw, accept(token).

The bitmask: int32 [rows, ceil(vocab / 32)]; token t is allowed iff bit t % 32 of word t // 32 is 1
(llguidance's layout). Ids the tokenizer does not have (a model's padded vocabulary) are never
allowed. EOS: llguidance sets the EOS token's bit whenever the text so far is complete (the grammar
accepts it); once nothing but EOS can follow (is_finished), EOS is the only allowed token; EOS while
the text is incomplete is rejected.
"""
import concurrent.futures
import functools
import itertools
import json
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

from engine.errors import did_you_mean

KINDS = ("json", "regex", "choice", "grammar", "json_object")  # exactly one is set
ANY_JSON_OBJECT = '{"type":"object"}'  # the schema json_object compiles
# No whitespace between JSON tokens but llguidance's one separator: a model that may put any whitespace
# there can, and a small one does, fill max_tokens with it (a random-weights Qwen3 did in every row).
JSON_DEFAULTS = {"whitespace_flexible": False}
FILL_THREADS = 4  # start_fill_bitmasks' fills under way at once


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output: exactly one field is set (json_object: True).

    json: a JSON schema, given as a dict or its JSON text, stored as compact JSON text in the given
    key order (a schema's property order is the order the output must follow, so keys are not
    sorted); regex: a regular expression the whole output matches (Rust regex syntax); choice: the
    output is exactly one of these strings (a list becomes a tuple); grammar: GBNF (llama.cpp's
    EBNF) or Lark text; json_object: any JSON object. Frozen and hashable."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        object.__setattr__(self, "json", _schema_text(self.json))
        object.__setattr__(self, "choice", _choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)}, got {_in_words(chosen)}")

    @classmethod
    def from_value(cls, value) -> "StructuredOutputsParams | None":
        """None, an instance (returned as is), a mapping of KINDS to values (a None value: unset), or the
        JSON text of such a mapping; ValueError naming an unknown key or anything else."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"structured_outputs: not valid JSON ({err})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a mapping with one of {', '.join(KINDS)} (or its JSON "
                             f"text), got {value!r}")
        unknown = next((key for key in value if key not in KINDS), None)
        if unknown is not None:
            raise ValueError(f"structured_outputs has unknown key {unknown!r}{did_you_mean(str(unknown), KINDS)} "
                             f"(it takes {', '.join(KINDS)})")
        return cls(**{key: v for key, v in value.items() if v is not None})

    @property
    def kind(self) -> str:
        """The field that is set: one of KINDS."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @functools.cached_property
    def key(self) -> str:
        """The canonical text of the constraint, {"<kind>": value} as compact JSON: equal constraints (a
        schema given as a dict or as text, choices as a list or a tuple) have one key, the compiled
        grammar's cache key."""
        value = list(self.choice) if self.kind == "choice" else getattr(self, self.kind)
        return json.dumps({self.kind: value}, separators=(",", ":"))


def _in_words(names: list[str]) -> str:
    """The names in words: "none", "a", "a and b", "a, b and c"."""
    return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names) or "none"


def _schema_text(schema) -> str | None:
    """A JSON schema (a dict or bool, or the JSON text of one) as compact JSON text, key order kept."""
    if schema is None:
        return None
    try:
        value = json.loads(schema) if isinstance(schema, str) else schema
        if isinstance(value, (dict, bool)):
            return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError):  # not JSON text, or a dict holding a value JSON has not
        pass
    raise ValueError(f"structured_outputs.json must be a JSON schema (an object, or its JSON text), got {schema!r}")


def _choices(choice) -> tuple[str, ...] | None:
    if choice is None:
        return None
    if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) for c in choice):
        raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {choice!r}")
    return tuple(choice)


class GrammarMatcher:
    """One sequence's place in its grammar. Not thread-safe: one thread drives a matcher (the engine's);
    distinct matchers may be filled in parallel (fill_bitmasks)."""

    __slots__ = ("_matcher", "vocab_size", "accept")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        """vocab_size: the width its bitmask rows cover (its compiler's, allocate_bitmask's).

        accept(token_id) -> bool: advance by one drawn token; False if the grammar rejects it (the matcher
        then stays in an error state, rejects everything after, and its mask allows only EOS). EOS is
        accepted when the text so far is complete, and again after it. The library's method itself, bound
        here: a step calls it for every constrained row, on the host's critical path (benchmarks/NOTES.md)."""
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.accept = matcher.consume_token

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow: the grammar has stopped (the text cannot be extended, or EOS
        was accepted), or a token was rejected."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the grammar rejected a token (the library's text), None while none was."""
        return self._matcher.get_error() or None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this matcher's allowed next tokens into row `row` of bitmask (allocate_bitmask's)."""
        words = _checked(bitmask)[row]
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), 4 * words.numel())


class GrammarCompiler:
    """Compiles constraints for one tokenizer, each once (by StructuredOutputsParams.key), on a pool of
    max_threads worker threads. tokenizer: a transformers PreTrainedTokenizerFast; vocab_size: the
    model's (the logits' width); eos_token_ids: the ids that end the output, each allowed whenever
    the text is complete (None or empty: the tokenizer's eos_token_id). submit and new_matcher are
    thread-safe. The cache keeps every key it has seen."""

    def __init__(self, tokenizer, vocab_size: int, max_threads: int = 4, eos_token_ids: Iterable[int] | None = None):
        eos = list(eos_token_ids or ()) or None  # llguidance refuses an empty list
        # llguidance refuses a vocabulary smaller than the tokenizer's; ids beyond vocab_size are then cut
        # from the logits by ops.apply_token_bitmask
        self.vocab_size = max(vocab_size, len(tokenizer))  # the bitmask's vocabulary: allocate_bitmask's
        import llguidance.hf  # transformers with it: only once a constrained request comes, not at import

        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="grammar")
        self._compiled: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compilation of params' grammar, started if new (the same Future for the same key). Its
        result is the grammar's start state (an llguidance LLMatcher never advanced, for new_matcher to
        copy); result() raises ValueError "structured_outputs.<field>: <the library's reason>" for a
        grammar that does not compile."""
        with self._lock:
            future = self._compiled.get(params.key)
            if future is None:
                future = self._compiled[params.key] = self._pool.submit(self._compile, params)
            return future

    def wait(self, params: StructuredOutputsParams, timeout_s: float | None) -> llguidance.LLMatcher:
        """The compiled start state of params' grammar (submitted if it was not), waited for at most
        timeout_s seconds (None: no bound), else TimeoutError; ValueError as submit's."""
        try:
            return self.submit(params).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            raise TimeoutError(f"structured_outputs.{params.kind}: the grammar did not compile within "
                               f"{timeout_s} s") from None

    def new_matcher(self, params: StructuredOutputsParams, timeout_s: float | None) -> GrammarMatcher:
        """A fresh matcher at the start of params' grammar, once compiled (wait's): a copy of the compiled
        state, ~10 us whatever the grammar."""
        return GrammarMatcher(self.wait(params, timeout_s).deep_copy(), self.vocab_size)

    def close(self) -> None:
        """Stop the workers; compilations not yet started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The start state of params' grammar, its first mask computed (that builds the lexer's start
        states, shared by every copy: here on the worker rather than in a step)."""
        try:
            grammar = _grammar_text(params)
        except Exception as err:  # the GBNF converter raises bare Exception (e.g. for a rule it cannot find)
            raise ValueError(f"structured_outputs.{params.kind}: {_one_line(str(err))}") from None
        start = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if start.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {_one_line(start.get_error())}")
        start.compute_bitmask()
        return start


def _one_line(reason: str) -> str:
    """The library's reason on one line (it draws the grammar's text over several, with a caret under the
    fault): an error row's message, and the job's error line, are one line."""
    return " ".join(reason.split())


def _grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of params, not yet checked (GrammarCompiler builds and checks it). choice:
    a Lark alternation of string literals, which take JSON's escapes; grammar: Lark text as it is,
    GBNF converted to Lark."""
    if params.json is not None or params.json_object:  # compact JSON unless the schema's x-guidance says otherwise
        return llguidance.LLMatcher.grammar_from_json_schema(params.json or ANY_JSON_OBJECT, defaults=JSON_DEFAULTS)
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, params.choice)))
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))


@functools.cache
def _executor() -> llguidance.LLExecutor:
    """The one pool of fill_bitmasks (llguidance's threads: 80% of the CPUs, at most 32)."""
    return llguidance.LLExecutor()


def fill_bitmasks(matchers_rows: Iterable[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
    """fill_bitmask of every (matcher, row) pair, in parallel on llguidance's threads, without the GIL.
    Rows must be distinct; rows not named keep their values."""
    _fill_call(matchers_rows, bitmask)()


def start_fill_bitmasks(matchers_rows: Iterable[tuple[GrammarMatcher, int]], bitmask: torch.Tensor,
                        timeout_s: float | None = None) -> concurrent.futures.Future:
    """fill_bitmasks on a worker thread; returns once the fill holds the matchers, without the GIL, so the
    caller runs on beside it (the Future's result() waits for it). Until then the matchers are the fill's:
    reading one from another thread (is_finished, error) raises "Already mutably borrowed". Up to
    FILL_THREADS fills (of distinct matchers) may be under way at once; one more waits for the oldest, at
    most timeout_s (None: no bound), else TimeoutError."""
    return next(_fill_threads()).start(_fill_call(matchers_rows, bitmask), timeout_s)


def _fill_call(matchers_rows: Iterable[tuple[GrammarMatcher, int]], bitmask: torch.Tensor):
    """The library's call that fills bitmask's rows for the pairs, checked and ready to make; it holds the
    bitmask, whose memory the library writes through a pointer, until it is done."""
    pairs = [(matcher._matcher, row) for matcher, row in matchers_rows]
    rows, width = _checked(bitmask).shape

    def fill() -> None:
        if pairs:
            _executor().unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), 4 * width, rows)
    return fill


class _FillThread:
    """One daemon thread that makes fills one after another: a fill that never ends (a fault in the
    library) leaves the step to the caller's timeout and does not hold the process at exit, as a
    ThreadPoolExecutor's worker would."""

    def __init__(self):
        self._fills = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="mask-fill", daemon=True).start()

    def start(self, fill, timeout_s: float | None) -> concurrent.futures.Future:
        """fill() on the thread; returns once it has begun (the caller wakes as the library releases the
        GIL, rather than after the interpreter's switch interval); TimeoutError if the thread is still on
        an earlier fill after timeout_s (that fill then never ran this one: it is cancelled)."""
        future, started = concurrent.futures.Future(), threading.Event()
        self._fills.put((fill, future, started))
        if not started.wait(timeout_s):
            future.cancel()
            raise TimeoutError(f"the mask-fill thread is still on an earlier fill after {timeout_s} s")
        return future

    def _serve(self) -> None:
        while True:
            fill, future, started = self._fills.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up waiting
            started.set()
            try:
                fill()
            except BaseException as err:  # noqa: BLE001 (handed to the caller, who raises it)
                future.set_exception(err)
            else:
                future.set_result(None)


@functools.cache
def _fill_threads() -> Iterator[_FillThread]:
    """FILL_THREADS threads in turn: up to that many fills run at once (on _executor's threads), each on
    matchers of its own."""
    return itertools.cycle([_FillThread() for _ in range(FILL_THREADS)])


def _checked(bitmask: torch.Tensor) -> torch.Tensor:
    """bitmask itself, once known to be what the library writes through its pointer: int32 [R, W], C
    order, in host memory (llguidance checks W against the vocabulary and the rows against R)."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or not bitmask.is_contiguous() \
            or bitmask.device.type != "cpu":
        raise ValueError(f"a bitmask is a contiguous int32 [rows, words] tensor on the CPU, got "
                         f"{bitmask.dtype} {list(bitmask.shape)} on {bitmask.device}")
    return bitmask


def bitmask_words(vocab_size: int) -> int:
    """Words of a bitmask row for vocab_size tokens (GrammarCompiler.vocab_size): ceil(vocab_size / 32)."""
    return -(-vocab_size // 32)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """int32 [rows, bitmask_words(vocab_size)] on the CPU, every bit 1 (all allowed) until filled.
    vocab_size: GrammarCompiler.vocab_size (a fill takes rows of exactly that many words)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
