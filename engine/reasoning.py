"""Reasoning parsers: an output that thinks before it answers, split into its reasoning and its content.

A reasoning model writes its thinking first, between a start and an end tag, then the answer. A parser
knows the model family's tags: split() cuts an output text in two (the job's `reasoning` column and the
OpenAI output's message.reasoning_content, apart from the content), and reasoning_ended() says from
token ids whether the reasoning is over, so that a structured-output constraint can start right after it
(engine/constraint.py). REASONING_PARSERS names them as vLLM's --reasoning-parser does.

Qwen3 (Qwen3ReasoningParser): the tags are <think> and </think>, one token each (added tokens that
decoding keeps). Its chat template, with the generation prompt added, ends the prompt in one of two ways:

    thinking (the default):       ...<|im_start|>assistant\\n
                                  the output: <think>\\n...\\n</think>\\n\\nthe answer
    enable_thinking: false:       ...<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n
                                  the output: the answer, no think block

Templates of other thinking checkpoints open the block in the prompt (...assistant\\n<think>\\n), and the
output is then `...</think>\\n\\nthe answer`, with no <think> of its own.
"""
from engine.errors import ConfigError, did_you_mean


class ReasoningParser:
    """What a parser must say. Invariant of split: content is never None; reasoning is None exactly when the
    output has no reasoning (no tag of the parser's)."""

    end_token_id: int  # the token that ends the reasoning: a constraint starts after it

    def split(self, text: str, opened_in_prompt: bool = False) -> tuple[str | None, str]:
        """(the reasoning, without its tags, or None when there is none; the content, the answer).
        opened_in_prompt: the prompt opened the block (prompt_opened_reasoning), so the output starts in it."""
        raise NotImplementedError

    def prompt_opened_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt ends inside an open think block: its outputs reason first, with no tag of their own."""
        raise NotImplementedError

    def reasoning_ended(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> bool:
        """Whether the reasoning is over after these outputs (all of them known token ids)."""
        raise NotImplementedError


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3's think block: <think> the reasoning </think>, then the answer (the module's docstring shows
    what its chat template puts in the prompt in both modes)."""

    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.start_token_id = _tag_id(tokenizer, self.start_token)
        self.end_token_id = _tag_id(tokenizer, self.end_token)

    def split(self, text: str, opened_in_prompt: bool = False) -> tuple[str | None, str]:
        """A leading <think> opens the block (a <think> elsewhere is text, as are other tags), as does a
        prompt that opened it (opened_in_prompt); the first </think> after it closes it. An output with
        </think> and no leading <think> is reasoning up to the </think> (its template opened the block in
        the prompt). Unclosed, the whole output in the block is reasoning and the content is empty
        (max_tokens ran out while thinking). The content is what follows </think>, its leading whitespace
        stripped; the reasoning keeps its own."""
        leading = text.lstrip().startswith(self.start_token)
        body = text.lstrip().removeprefix(self.start_token) if leading else text
        reasoning, closed, content = body.partition(self.end_token)
        if closed:
            return reasoning, content.lstrip()
        return (body, "") if leading or opened_in_prompt else (None, text)

    def prompt_opened_reasoning(self, prompt_token_ids: list[int]) -> bool:
        last = self._last_tag(prompt_token_ids)
        return last is not None and prompt_token_ids[last] == self.start_token_id

    def reasoning_ended(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> bool:
        """True once </think> is among the outputs, or when the prompt closed the block itself: its last
        think tag is a </think> with nothing but whitespace after it (enable_thinking: false). A </think>
        followed by more prompt, such as an earlier turn's reasoning before a tool's response, closed an
        earlier block: this turn's output thinks anew."""
        return self.end_token_id in output_token_ids or self.prompt_closed_reasoning(prompt_token_ids)

    def prompt_closed_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt ends in a closed think block (then whitespace only): a question about the
        prompt alone, which a caller may ask once per request."""
        last = self._last_tag(prompt_token_ids)
        if last is None or prompt_token_ids[last] != self.end_token_id:
            return False
        return not self.tokenizer.decode(prompt_token_ids[last + 1:]).strip()

    def _last_tag(self, token_ids: list[int]) -> int | None:
        """The position of the last think tag (<think> or </think>) in token_ids, None if there is none."""
        tags = (self.start_token_id, self.end_token_id)
        return next((i for i in range(len(token_ids) - 1, -1, -1) if token_ids[i] in tags), None)


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}  # vLLM's --reasoning-parser names


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    """The parser called `name` for this tokenizer; ConfigError naming reasoning_parser and the known names
    for an unknown one, or the tag the tokenizer cannot keep."""
    if name not in REASONING_PARSERS:
        raise ConfigError(f"reasoning_parser: unknown parser {name!r}{did_you_mean(name, REASONING_PARSERS)} "
                          f"(known: {', '.join(REASONING_PARSERS)})")
    return REASONING_PARSERS[name](tokenizer)


def _tag_id(tokenizer, tag: str) -> int:
    """The id of `tag`, one token that decoding keeps (an added token, not a special one: the output text
    is decoded with skip_special_tokens, and split() must find the tag in it). ConfigError otherwise."""
    token_id = tokenizer.get_vocab().get(tag)
    if token_id is None:
        raise ConfigError(f"reasoning_parser: the tokenizer has no {tag} token (a model that does not think?)")
    if tokenizer.decode([token_id], skip_special_tokens=True) != tag:
        raise ConfigError(f"reasoning_parser: the tokenizer's {tag} token is a special one, which decoding skips, "
                          f"so the output text would not show where the reasoning ends")
    return token_id
