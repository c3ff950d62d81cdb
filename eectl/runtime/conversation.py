"""A conversation on one cache row: each turn feeds only what is new on top of what the cache already holds.

A turn is given the whole conversation as token ids (the chat template's rendering with a generation prompt).
When the cache's tokens are a prefix of it (the usual case: the previous reply ended with the template's end-of-turn
token), only the rest is fed, as one multi-position chunk on top of the past (a prompt on the bound chain fed after
what its cache holds), then the reply decodes as `Runner.generate` does, on the bound chain. When
they are not (a reply cut at the token budget, which the template then closes differently), the row is forgotten and
the whole conversation is fed again: slower, never wrong. KV policies keep their state across turns (defer's pending
positions are carried by the next turn's chunk); a reply stopped early has its unchecked drafts (verify) checked
before the turn returns, so the cache always holds exactly what the tokens say.

What this module does not do: render chat templates, tokenise, or read input (run/chat.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from eectl.errors import UsageError
from eectl.runtime.batch import new_batch_kv
from eectl.runtime.chain_steps import chain_prompt, chain_step
from eectl.runtime.runner import Runner
from eectl.runtime.state import Generation, RowState


class Conversation:
    def __init__(self, runner: Runner, capacity: int) -> None:
        self.runner = runner
        self.kv = new_batch_kv(runner.rt, 1, capacity)
        # the bound chain, its states on the host (a turn runs outside generate's placement)
        self.chain = runner._chain(self.kv, 1, host=True)
        self.state: RowState | None = None
        self.reused = 0  # tokens of the last turn's input that the cache already held (not fed again)

    def _chunk(self, ids: list[int]) -> tuple[RowState, list[int]]:
        """The row state for this turn and the tokens to feed."""
        st, segments = self.state, len(self.runner.m.segments)
        held = 0 if st is None else int(self.kv.filled[0, 0])  # positions the cache holds (layer 0 runs every one)
        if st is not None and len(ids) > len(st.tokens) and ids[: len(st.tokens)] == st.tokens:
            # a new turn's row state; what the policy keeps in the cache's name (defer's pending positions) goes on
            self.state = RowState(list(ids), len(ids), st.pending, drafts=st.drafts)
            self.reused = held
            return self.state, ids[held:]  # the previous reply's last token when it was never fed, then the new part
        self.kv.rollback(0, 0)
        self.state = RowState(list(ids), len(ids), [None] * segments)
        self.reused = 0
        return self.state, list(ids)

    def turn(
        self,
        ids: list[int],
        on_step: Callable[[list[int]], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> Generation:
        """Generate the reply to the conversation `ids`; `on_step(confirmed reply tokens)` after every step, `stop()`
        checked between steps (True: the reply ends there, e.g. on Ctrl-C)."""
        r = self.runner
        if len(ids) + r.cfg.max_new_tokens + 1 > self.kv.max_len:
            raise UsageError(
                f"the conversation reached {len(ids)} tokens: with {r.cfg.max_new_tokens} new ones it exceeds the "
                f"context of {self.kv.max_len}",
                hint="start a new conversation, or lower --max-new-tokens",
            )
        st, chunk = self._chunk(ids)
        feed = chunk
        while not st.done:
            t0 = time.perf_counter()
            if len(feed) == 1:
                token = chain_step(r, self.chain, st, self.kv)
            else:  # a turn's new tokens after what the cache holds, as a prompt on the chain
                st.reused = len(st.tokens) - len(feed)
                token = chain_prompt(r, self.chain, st, self.kv)
            st.emit(token, time.perf_counter() - t0)
            st.done = r._finished(0, st, self.kv, self.chain)
            if on_step is not None:
                on_step(r._confirmed(st))
            if not st.done and stop is not None and stop():
                r._settled(0, st, self.kv, self.chain)  # what the policy left unchecked is checked: the cache is exact
                st.done = True
            feed = [st.tokens[-1]]
        return st.generation()
