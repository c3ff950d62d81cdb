"""Drafts from the answers a runner finished before (RunConfig.draft_memory, `--draft-memory`): an n-gram table of
their tokens, which drafts from the context (runtime/drafts.py) consult where a row's own context has no match.

Requests of one kind share phrases (a GSM8K answer's "<<48/2=24>>", a code edit's unchanged lines), and llama.cpp's
server keeps an n-gram pool across its requests for the same reason (`--spec-type ngram-mod`). The table counts,
for every run of MEMORY_NGRAM..max_ngram tokens in the kept requests (prompt and answer each), the tokens that
followed it; a draft is chained token by token: the longest of the context's last tokens that the table holds picks
the token that most often followed it, while that token followed it at least half the time (MIN_SHARE), up to the
draft's length or a stop token. The latest `capacity` tokens are kept; an older request's counts are taken back
when it goes. The output stays full depth's: verify's deep pass checks every draft.

How the rule was chosen (docs/results/2026-12-07-draft-memory.md, the default int4 model's replay priced by its
costs): the latest occurrence's continuation (as the context's own search takes it) gained 1.05x on GSM8K questions
and 1.02x on code edits; the most frequent continuation, stopping where it is not the majority, 1.07x and 1.09x.

What this module does not do: search the row's own context or decide when to draft (runtime/drafts.py).
"""

from __future__ import annotations

from collections import deque

from eectl.contracts.plan import MAX_NGRAM
from eectl.errors import UsageError

__all__ = ["MEMORY_NGRAM", "MIN_SHARE", "DraftMemory"]

MEMORY_NGRAM = 3  # the shortest run of tokens looked up: a 2-token match in another answer is mostly chance
MIN_SHARE = 0.5  # a drafted token followed its context at least this often in the kept requests


class DraftMemory:
    """The tokens that followed each n-gram (MEMORY_NGRAM..max_ngram tokens) in the latest `capacity` tokens of
    finished requests, counted; `find` drafts from them."""

    def __init__(self, capacity: int, max_ngram: int = MAX_NGRAM) -> None:
        if capacity < 0:
            raise UsageError(f"--draft-memory must be >= 0 tokens, got {capacity}")
        self.capacity = capacity
        self.max_ngram = max_ngram
        self.lengths = range(min(MEMORY_NGRAM, max_ngram), max_ngram + 1)
        self.clear()

    def clear(self) -> None:
        self._requests: deque[list[int]] = deque()
        self._held = 0
        self._next: dict[tuple[int, ...], dict[int, int]] = {}  # n-gram -> token -> times it followed

    def __len__(self) -> int:
        return self._held

    def remember(self, tokens: list[int]) -> None:
        """A finished request's tokens (its prompt and answer); the oldest requests go beyond `capacity`."""
        if not self.capacity or len(tokens) <= self.lengths.start:
            return
        kept = list(tokens[-self.capacity :])
        self._requests.append(kept)
        self._held += len(kept)
        self._count(kept, 1)
        while self._held > self.capacity:
            old = self._requests.popleft()
            self._held -= len(old)
            self._count(old, -1)

    def _count(self, tokens: list[int], sign: int) -> None:
        for n in self.lengths:
            for i in range(n, len(tokens)):
                key, token = tuple(tokens[i - n : i]), tokens[i]
                after = self._next.setdefault(key, {})
                times = after.get(token, 0) + sign
                if times > 0:
                    after[token] = times
                else:
                    del after[token]
                    if not after:
                        del self._next[key]

    def next_token(self, context: list[int]) -> int | None:
        """The token that most often followed the longest run of `context`'s last tokens the table holds, where it
        did at least MIN_SHARE of the time (the first seen of equally frequent ones); None where no run is held or
        the longest one's followers disagree."""
        for n in reversed(self.lengths):
            if len(context) < n:
                continue
            after = self._next.get(tuple(context[len(context) - n :]))
            if after:
                token = max(after, key=after.__getitem__)
                return token if after[token] >= MIN_SHARE * sum(after.values()) else None
        return None

    def find(self, tokens: list[int], limit: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Up to `limit` tokens drafted after `tokens`, one `next_token` at a time, each appended to the context the
        next is drafted from; cut before a stop id. [] where the first cannot be drafted."""
        draft: list[int] = []
        context = list(tokens[-self.max_ngram :])
        while len(draft) < limit and self._next:
            token = self.next_token(context)
            if token is None or token in stop_ids:
                break
            draft.append(token)
            context = [*context, token][-self.max_ngram :]
        return draft
