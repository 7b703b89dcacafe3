"""Incremental detokenization and stop strings, as vLLM's incremental detokenizer does it.

A sequence with stop strings turns its output tokens into text one token at a time, without decoding the
whole output again each step: it keeps two offsets into its tokens, prefix_offset <= read_offset, and
decodes only the window from prefix_offset. The text of tokens[prefix_offset:read_offset] (the tokens of
the last emission) was emitted already; decoding tokens[prefix_offset:] and taking what it adds to that
is the new text, so that tokenizers whose pieces decode differently at the start of a text
(SentencePiece's leading space) decode the new tokens in context. New text that ends in U+FFFD (an
incomplete UTF-8 sequence: a byte-level token holding part of a character) is held back until the
tokens after it complete the character; the offsets move only when text is emitted.

The output is decoded after the last PROMPT_CONTEXT tokens of its prompt, as vLLM's is: its first token
then decodes as it follows them (a SentencePiece word's leading space kept), and prompt + text reads as the
whole sequence decoded. Invariant: `text` is what decode(tokens[:read_offset]) adds to decode(context)
(skipping special tokens), context being the prompt's tokens the detokenizer started with. The window holds
the tokens of the last emission and those since; it grows only over a run of bytes that make no valid
character (garbage from a random model), until a character completes, as in vLLM.
"""

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens the output is decoded after (vLLM's initial detokenization offset)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int] = ()):
        self.tokenizer = tokenizer
        self.tokens: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, token_id: int) -> int:
        """Append one token; returns how many characters of text it completed (0 while held back)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        window = self._decode(self.tokens[self.prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(REPLACEMENT_CHAR):
            return 0
        new = window[len(prefix):]
        self.text += new
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return len(new)

    def find_stop(self, stop: tuple[str, ...], new_chars: int) -> tuple[str, int] | None:
        """The stop string that occurs first in the text, among occurrences that end in the last
        `new_chars` characters (earlier ones were looked for when their text came), and where it starts."""
        found = None
        for s in stop:
            start = self.text.find(s, max(len(self.text) - new_chars - len(s) + 1, 0))
            if start >= 0 and (found is None or start < found[1]):
                found = (s, start)
        return found


def decode_after(tokenizer, prompt_token_ids: list[int], token_ids: list[int]) -> str:
    """token_ids decoded as they follow the prompt (IncrementalDetokenizer's text for them, in one decode):
    what they add to the decode of its last PROMPT_CONTEXT tokens, or, where they change that text (a
    character split between the two), token_ids decoded alone."""
    context = list(prompt_token_ids[-PROMPT_CONTEXT:])
    head = tokenizer.decode(context, skip_special_tokens=True)
    whole = tokenizer.decode(context + list(token_ids), skip_special_tokens=True)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(token_ids, skip_special_tokens=True)
