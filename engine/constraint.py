"""A sequence's structured-output constraint: its grammar matcher and how far the matcher has read.

The engine runs one step ahead of the host, so a sequence's newest output may still be a placeholder when
the next step is prepared (engine/sequence.py). A matcher must have read every output token before the
mask of the next draw is computed, so it reads lazily: `advance(outputs, end)` feeds it the outputs it
has not read yet; the model runner calls it with the previous step's token once the device has it, and
the engine's resolve again (a no-op for tokens read already). Invariant: the first `read` outputs' ids
are known to the host, and the matcher has consumed exactly the constrained ones among them; `finished`
is the matcher's state after them, taken when they were read, so that it can be asked while a worker
thread fills the matcher's next mask (engine/structured.py's start_fill_bitmasks).

With a reasoning parser (engine/reasoning.py), the constraint starts after the reasoning: outputs up to and
including the reasoning's end token are read but not fed to the matcher, and no mask applies before.
"""
from engine.structured import GrammarMatcher


class Constraint:
    def __init__(self, matcher: GrammarMatcher, active: bool = True, start_token_id: int | None = None):
        """active: whether the constraint applies from the first output on; else it starts after the output
        start_token_id (the reasoning's end)."""
        self.matcher = matcher
        self.active = active
        self.start_token_id = start_token_id
        self.read = 0  # outputs read
        self._finished = active and matcher.is_finished

    def advance(self, outputs: list[int], end: int, newest: int | None = None) -> None:
        """Read outputs[read:end] (copying only those, not the list, which grows with every token); newest: the id
        of outputs[end - 1] when the list still holds its placeholder (drawn in the step in flight)."""
        if end <= self.read:
            return  # read already: the matcher may be a fill's now
        tokens = outputs[self.read:end]  # the unread ones: one, in a step
        if newest is not None:
            tokens[-1] = newest
        accept = self.matcher.accept
        for token in tokens:
            if self.active:
                accept(token)  # a token it refuses stops it (is_finished): the mask leaves only EOS
            else:
                self.active = token == self.start_token_id
        self.read = end
        self._finished = self.active and self.matcher.is_finished

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow the outputs read (the text is complete and cannot go on, or a token
        was refused): the sequence ends there (finish_reason stop), without drawing the EOS."""
        return self._finished
