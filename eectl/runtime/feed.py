"""Where a Runner's rows come from between its steps, and which leave before they finish: `Feed`.

`Runner.generate` steps a fixed list of prompts (`Prompts`: every prompt known at the start, none leaving early).
A server steps requests that arrive while the batch runs and clients that go away (eectl/serve's engine subclasses
`Feed`): a new row takes a free slot at the next step, as a prompt waiting in `generate` does, and a dropped row's
slot is free at the next step, as a finished row's is. The runner asks the feed only between steps, on its own
thread.

What this module does not do: tokenise, decide when a row is done (the runner: its stop ids and token budget,
`RowState.max_new_tokens`), or run anything.
"""

from __future__ import annotations

from collections import deque

from eectl.runtime.state import RowState


class Feed:
    """Rows by key (`rows`), handed to free slots in order. The base: a fixed queue, nothing dropped."""

    def __init__(self) -> None:
        self.rows: dict[int, RowState] = {}
        self.queue: deque[int] = deque()

    def waiting(self) -> bool:
        """Whether a row waits for a slot now."""
        return bool(self.queue)

    def take(self) -> int | None:
        """The next waiting row's key (None: none waits)."""
        return self.queue.popleft() if self.queue else None

    def dropped(self, key: int) -> bool:
        """Whether the row `key`, seated, leaves now (its slot free at this step)."""
        return False

    def wait(self) -> bool:
        """No row is seated: block until one waits (True) or the feed ends (False). A fixed queue ends at once."""
        return self.waiting()

    def stepped(self) -> None:
        """After each step of the batch (its rows' `on_step` called, finished rows gone)."""


class Prompts(Feed):
    """`generate`'s prompts: keys 0..n-1 in order."""

    def __init__(self, rows: list[RowState]) -> None:
        super().__init__()
        self.rows = dict(enumerate(rows))
        self.queue.extend(range(len(rows)))
