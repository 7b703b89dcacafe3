"""Request-level state: what a sequence asks for (SamplingParams) and how far it has got (Sequence).

The block-level state of a live sequence (its length in stored tokens and its block table) is the
block manager's SequenceState; a Sequence here tracks tokens: the prompt, the outputs so far and how
many of them already have K/V in the cache (num_computed_tokens).

The engine runs one step ahead of the host: a sampled token is known on the device before the host
reads it, so the newest output may be PLACEHOLDER until the step that drew it is resolved. At most the
last output is a placeholder.
"""
from dataclasses import dataclass, field
from enum import Enum


PLACEHOLDER = -1


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks for. The one schema of sampling settings: the sampling.* config keys and the
    per-row input columns are these fields."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    min_p: float = 0.0  # keep tokens with probability >= min_p * the most likely one's; 0: off
    max_tokens: int = 64
    min_tokens: int = 0  # EOS and stop ids cannot end the output before this many tokens
    ignore_eos: bool = False
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one it contains
    include_stop_str_in_output: bool = False
    n: int = 1  # samples per prompt; sample i draws with a seed derived from (seed, i)
    logprobs: int | None = None  # k: the log-probability of each output token, and k > 0: the k most likely
    prompt_logprobs: int | None = None  # the same for the prompt tokens
    repetition_penalty: float = 1.0  # transformers' definition, over prompt and output tokens; 1: off
    presence_penalty: float = 0.0  # OpenAI's definition, over output tokens; 0: off
    frequency_penalty: float = 0.0  # OpenAI's definition, over output tokens; 0: off


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_num_tokens: int  # prompt + outputs at most: min(prompt + max_tokens, max_model_len)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: Status = Status.WAITING
    finish_reason: str | None = None  # stop | length
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hashes of its known full blocks
    output_logprobs: list[float] = field(default_factory=list)  # logprob of each output token (logprobs=k)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # k most likely (k > 0)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # per prompt token, None first
    prompt_top_logprobs: list[tuple[tuple[int, float], ...] | None] = field(default_factory=list)  # k > 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_capped(self) -> bool:
        """No more tokens to draw (max_tokens or max_model_len reached, counting one in flight)."""
        return self.num_tokens >= self.max_num_tokens

    @property
    def has_placeholder(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PLACEHOLDER

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host knows (all but a trailing placeholder)."""
        return self.num_tokens - self.has_placeholder

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + outputs, without concatenating the two."""
        prompt_len = len(self.prompt_token_ids)
        head = self.prompt_token_ids[start:stop]
        return head + self.output_token_ids[max(start - prompt_len, 0):stop - prompt_len] if stop > prompt_len else head
