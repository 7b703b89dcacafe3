"""Request-level state: what a sequence asks for (SamplingParams) and how far it has got (Sequence).

The block-level state of a live sequence (its length in stored tokens and its block table) is the
block manager's SequenceState; a Sequence here tracks tokens: the prompt and the outputs so far. How many
of them have K/V in the cache is the block manager's count, which num_computed_tokens reads through
block_state: the SequenceState of a running sequence, None while it waits and once it has finished. A
step's tokens count as computed once the scheduler has allocated their slots, before the device writes
them: steps run in stream order, so every later step reads them.

The engine runs one step ahead of the host: a sampled token is known on the device before the host
reads it, so the newest outputs may be PLACEHOLDER until the step that drew them is resolved: the outputs
of the launched steps not yet resolved, always a trailing run (one a step; a decode run's several).
"""
import functools
import hashlib
import math
import numbers
import typing
from dataclasses import dataclass, field, replace
from enum import Enum

from engine.structured import StructuredOutputsParams
from ops.sampling_reference import mix32

if typing.TYPE_CHECKING:
    from engine.block_manager import SequenceState
    from engine.constraint import Constraint
    from engine.detokenizer import IncrementalDetokenizer


PLACEHOLDER = -1
_MASK32 = 0xFFFFFFFF


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. The one schema of sampling settings: the sampling.* config keys
    (engine/config.py's SamplingConfig), the per-row input columns (jobs/inputs.py) and their checks all
    come from these fields, their types and `problem()`, so a new parameter is added here only.

    Values are converted and checked when made: a list becomes a tuple, a whole float an int (JSON and
    Parquet hand over 2.0 for 2), one stop string a tuple of one; ValueError names the field of any other."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # sample from the most likely tokens whose probabilities sum to top_p; 1: off
    top_k: int = -1  # sample from the k most likely tokens; -1 or 0: off
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's; 0: off
    max_tokens: int = 64  # output tokens per request, at most
    min_tokens: int = 0  # EOS, stop ids and stop strings cannot end the output before this many tokens
    ignore_eos: bool = False  # go on past the end-of-sequence token, up to max_tokens
    seed: int | None = None  # a request's draws depend only on its seed and its logits; None: request_seed of its id
    stop_token_ids: tuple[int, ...] = ()  # more token ids that end the output (kept in it)
    stop: tuple[str, ...] = ()  # stop strings: the output text ends before the first one it contains
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) at the end of the text
    n: int = 1  # samples per prompt; sample i draws with seed sample_seed(seed, i)
    logprobs: int | None = None  # k: the log-probability of each output token, and k > 0: the k most likely
    prompt_logprobs: int | None = None  # the same for the prompt tokens
    repetition_penalty: float = 1.0  # transformers' definition, over prompt and output tokens; 1: off
    presence_penalty: float = 0.0  # OpenAI's definition, over output tokens; 0: off
    frequency_penalty: float = 0.0  # OpenAI's definition, over output tokens; 0: off
    structured_outputs: StructuredOutputsParams | None = None  # an output constraint: json, regex, choice, grammar or json_object

    def __post_init__(self):
        if self.max_tokens is None:
            object.__setattr__(self, "max_tokens", UNLIMITED_TOKENS)
        for name, kind in FIELD_KINDS.items():
            object.__setattr__(self, name, _convert(name, getattr(self, name), kind))
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these (converted) values, naming the field; None if nothing is."""
        checks = (
            (self.temperature >= 0, "temperature", "must be >= 0", self.temperature),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p),
            (self.top_k >= -1, "top_k", "must be >= 1, or -1 or 0 (off)", self.top_k),
            (self.top_k < 2**63, "top_k", "must be < 2^63", self.top_k),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", f"must be in [0, max_tokens={self.max_tokens}]",
             self.min_tokens),
            (self.min_tokens < 2**63, "min_tokens", "must be < 2^63", self.min_tokens),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be token ids >= 0", self.stop_token_ids),
            (all(self.stop), "stop", "must not hold an empty string", self.stop),
            (self.seed is None or -2**63 <= self.seed < 2**64, "seed", "must fit in 64 bits (-2^63 to 2^64 - 1)",
             self.seed),
            (self.n >= 1, "n", "must be >= 1", self.n),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0 or null", self.logprobs),
            (self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", "must be >= 0 or null",
             self.prompt_logprobs),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty),
        )
        return next((f"{name} {rule}, got {value!r}" for ok, name, rule, value in checks if not ok), None)

    def for_request(self, request_id) -> "SamplingParams":
        """These settings for the request `request_id`: the same, with request_seed(request_id) where the seed
        is None (so repeated prompts draw apart, and a request draws the same in any run)."""
        return self if self.seed is not None else self._seeded(request_seed(request_id))

    def clone(self) -> "SamplingParams":
        """A copy (vLLM's method). SamplingParams is frozen: to change a field, dataclasses.replace(params, ...)."""
        return replace(self)

    def sample(self, index: int) -> "SamplingParams":
        """The settings sample `index` of n draws with: the same, with seed sample_seed(seed, index)."""
        return self if index == 0 else self._seeded(sample_seed(self.seed, index))

    def _seeded(self, seed: int) -> "SamplingParams":
        """A copy with this seed, one of request_seed's or sample_seed's (in [0, 2^63): valid), made without
        replace(), whose check of every field again took ~40 us a copy (a rollout's 8,192 samples: 0.3 s); the
        fields only, not the cached properties (noise_seed is the seed's)."""
        params = object.__new__(SamplingParams)
        params.__dict__.update({name: getattr(self, name) for name in FIELD_KINDS}, seed=seed)
        return params

    @functools.cached_property
    def penalised(self) -> bool:
        """Whether a repetition, presence or frequency penalty applies (made once: read per row per step)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @functools.cached_property
    def noise_seed(self) -> int:
        """The 32-bit seed of the sampling noise (ops/sampling_reference.uniform_noise): the seed's low 32 bits
        XOR mix32 of its next 32, so that every bit of a 64-bit seed counts (mix32 is a bijection, so seeds
        that differ only above bit 31 draw differently) and a seed below 2^32 is its own (mix32(0) = 0).
        Made once per SamplingParams: the sampler reads it for every row of every step. A seed still None
        (settings drawn from directly, not through a request's for_request) draws as seed 0."""
        seed = self.seed or 0
        return (seed & _MASK32) ^ mix32((seed >> 32) & _MASK32)


def request_seed(request_id) -> int:
    """The seed of a request without one of its own: the first 8 bytes of BLAKE2b("request:<request_id>"),
    little-endian, shifted right by one. Its id is its input row in a job, its prompt's index in generate()."""
    return int.from_bytes(hashlib.blake2b(f"request:{request_id}".encode(), digest_size=8).digest(), "little") >> 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: the seed itself for sample 0 (so n=1 is
    unchanged), else the first 8 bytes of BLAKE2b("<seed>:<index>"), little-endian, shifted right by one
    (a non-negative int64)."""
    if index == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest(), "little") >> 1


def _kind(annotation) -> tuple[type, bool, bool]:
    """(element type, is a tuple of them, may be None) of a SamplingParams field's annotation."""
    args = [a for a in typing.get_args(annotation) if a is not type(None) and a is not Ellipsis]
    if typing.get_origin(annotation) is tuple:
        return args[0], True, False
    if args:  # X | None
        return args[0], False, True
    return annotation, False, False


def _scalar(name: str, value, kind: type):
    """`value` as `kind`: no bool for a number (nor a number for a bool), a float only if finite, an int
    from a float only if whole and below 2^53 in size (a JSON reader makes a column of floats when one of its
    ints exceeds 64 bits, rounding the others)."""
    if kind is int and isinstance(value, float) and value.is_integer() and abs(value) >= 2**53:
        raise ValueError(f"{name} {value!r} is a float of 2^53 or more, which holds only some ints (the one "
                         f"written may have been rounded): give it as an int (in JSONL, a column of ints "
                         f"becomes floats when one of them does not fit 64 bits)")
    try:
        if isinstance(value, bool) != (kind is bool) or isinstance(value, str) != (kind is str):
            raise ValueError
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        converted = kind(value)
        if kind is float and not math.isfinite(converted):
            raise ValueError
        return converted
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{name} {value!r} is not a valid {kind.__name__}") from None


def _convert(name: str, value, kind: tuple[type, bool, bool]):
    element, many, optional = kind
    if value is None and (optional or many):  # a list field's None: none (vLLM's stop=None)
        return None if optional else ()
    if element is StructuredOutputsParams:  # an instance, a mapping or its JSON text
        return StructuredOutputsParams.from_value(value)
    if not many:
        return _scalar(name, value, element)
    if takes_one_value(name) and isinstance(value, element):  # one stop string, as vLLM takes it
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(map(_ELEMENT_OK[element], value)):
        wanted = "a string or a list of strings" if takes_one_value(name) else \
            f"a list of {'strings' if element is str else 'token ids'}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return tuple(element(v) for v in value)


_ELEMENT_OK = {str: lambda v: isinstance(v, str),
               int: lambda v: not isinstance(v, bool) and (isinstance(v, numbers.Integral) or
                                                          isinstance(v, float) and v.is_integer())}
FIELD_KINDS = {name: _kind(kind) for name, kind in typing.get_type_hints(SamplingParams).items()}
# max_tokens None (vLLM's): as many as max_model_len leaves room for (the engine caps prompt + outputs at it)
UNLIMITED_TOKENS = 2**31 - 1


def takes_one_value(name: str) -> bool:
    """Whether list field `name` also takes one element alone (stop: one string, as vLLM's does; a single
    token id for stop_token_ids is not vLLM's, so not ours)."""
    element, many, _ = FIELD_KINDS[name]
    return many and element is str


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    # A tuple, shared by a request's samples: a tuple of ints leaves the garbage collector's tracking at its
    # first collection, where each sample's list was traversed token by token in every full collection (a
    # rollout's 8,192 copies of 256-1,536 tokens: ~40 ms a collection on the CPU, benchmarks/NOTES.md)
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    max_num_tokens: int  # prompt + outputs at most: min(prompt + max_tokens, max_model_len)
    output_token_ids: list[int] = field(default_factory=list)
    block_state: "SequenceState | None" = None  # the block manager's, while running (set by the scheduler)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of its known full blocks
    sample_index: int = 0  # which of the request's n samples this is
    held_samples: list["Sequence"] = field(default_factory=list)  # samples 1..n-1, forked when this one's prompt is
    stop_reason: int | str | None = None  # the stop string or stop_token_ids entry that ended it (None for EOS)
    detokenizer: "IncrementalDetokenizer | None" = None  # only when sampling.stop is set
    constraint: "Constraint | None" = None  # only when sampling.structured_outputs is set
    output_text: str | None = None  # set when a stop string ended it: the text, cut; else decode the token ids
    # filled by the sampler (engine/sampler.py) when sampling.logprobs / prompt_logprobs is set:
    output_logprobs: list[float] = field(default_factory=list)  # logprob of each output token (logprobs=k)
    output_ranks: list[int] = field(default_factory=list)  # and its rank: 1 + the tokens more likely
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # k most likely (k > 0)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # per prompt token, None first
    prompt_ranks: list[int | None] = field(default_factory=list)  # their ranks, None first
    prompt_top_logprobs: list[tuple[tuple[int, float], ...] | None] = field(default_factory=list)  # k > 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose K/V slots are allocated: block_state.sequence_length, 0 while waiting."""
        state = self.block_state
        return 0 if state is None else state.sequence_length

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether it still needs logits at its prompt positions (prompt_logprobs asked, not all filled):
        such a sequence must not take blocks from the prefix cache, whose positions are never computed."""
        return self.sampling.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_capped(self) -> bool:
        """No more tokens to draw (max_tokens or max_model_len reached, counting one in flight)."""
        return self.num_tokens >= self.max_num_tokens

    @property
    def has_placeholder(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but the trailing placeholders)."""
        outputs = self.output_token_ids
        known = len(outputs)
        while known and outputs[known - 1] == PLACEHOLDER:
            known -= 1
        return len(self.prompt_token_ids) + known

    @property
    def draws_ahead(self) -> bool:
        """Whether its next draws need nothing from the host between them (a decode run may take it): no
        grammar, penalty or logprobs, and no min_tokens ban left."""
        p = self.sampling
        return (self.constraint is None and p.logprobs is None and not p.penalised
                and len(self.output_token_ids) >= p.min_tokens)

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + outputs, without concatenating the two."""
        prompt_len = len(self.prompt_token_ids)
        head = list(self.prompt_token_ids[start:stop])
        return head + self.output_token_ids[max(start - prompt_len, 0):stop - prompt_len] if stop > prompt_len else head

    def truncate_outputs(self, num_outputs: int) -> None:
        """Drop the outputs after the first num_outputs (a token drawn past the stop), with their logprobs."""
        for values in (self.output_token_ids, self.output_logprobs, self.output_ranks, self.top_logprobs):
            del values[num_outputs:]
