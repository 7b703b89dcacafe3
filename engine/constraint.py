"""A sequence's structured-output constraint: its grammar matcher and how far the matcher has read.

The engine runs one step ahead of the host, so a sequence's newest output may still be a placeholder when
the next step is prepared (engine/sequence.py). A matcher must have read every output token before the
mask of the next draw is computed, so it reads lazily: `advance(outputs, end)` feeds it the outputs it
has not read yet; the model runner calls it with the previous step's token once the device has it, and
the engine's resolve again (a no-op for tokens read already). Invariant: the first `read` outputs' ids
are known to the host, and the matcher has consumed exactly the constrained ones among them, or will have
once a fill thread has made the accept handed to it (`defer`; until then `finished` and `advance` wait for
it); `finished` is the matcher's state after them, taken when they were read, so that it can be asked
while a fill thread fills the matcher's next mask (engine/structured.py's start_fill_bitmasks).

With a reasoning parser (engine/reasoning.py), the constraint starts after the reasoning: outputs up to and
including the reasoning's end token are read but not fed to the matcher, and no mask applies before.
"""
from collections.abc import Callable

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
        self._accepted: Callable[[], None] | None = None  # waits for a deferred accept (defer's)

    def defer(self, end: int, accepted: Callable[[], None]) -> bool:
        """Count output end - 1, the one output not read yet, as read now, and leave its accept to a fill
        thread, which calls record_accepted once the matcher has consumed it; `accepted()` waits for that
        (raising if it takes too long). False, and nothing changes, unless the constraint is active and
        exactly that output is unread: the caller then advances as usual."""
        if not self.active or end != self.read + 1:
            return False
        self.read, self._accepted = end, accepted
        return True

    def record_accepted(self) -> None:
        """The fill thread's part of defer: the matcher has consumed the deferred token."""
        self._finished = self.matcher.is_finished

    def advance(self, outputs: list[int], end: int, newest: int | None = None) -> None:
        """Read outputs[read:end] in place (no copy of the list: it grows with every token); newest: the id
        of outputs[end - 1] when the list still holds its placeholder (drawn in the step in flight)."""
        if end <= self.read:
            return  # read already: the matcher may be a fill's now
        self._wait_for_accept()
        for i in range(self.read, end):
            token = newest if newest is not None and i == end - 1 else outputs[i]
            if self.active:
                self.matcher.accept(token)  # a token it refuses stops it (is_finished): the mask leaves only EOS
            else:
                self.active = token == self.start_token_id
        self.read = end
        self._finished = self.active and self.matcher.is_finished

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow the outputs read (the text is complete and cannot go on, or a token
        was refused): the sequence ends there (finish_reason stop), without drawing the EOS."""
        self._wait_for_accept()
        return self._finished

    def _wait_for_accept(self) -> None:
        if self._accepted is not None:
            self._accepted()
            self._accepted = None
