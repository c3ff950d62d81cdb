"""Drafts from the context: prompt lookup (n-gram) proposals that verify's deep pass checks beside exit drafts.

Where an answer copies its input (code edits, extraction, summaries, RAG answers), the tokens after the latest
earlier occurrence of the context's last n tokens are a good guess at what comes next, and the guess costs nothing
to make. `PromptLookup.propose` finds that occurrence (longest match first, from `max_ngram` down to `min_ngram`
tokens, in the prompt and the generated text alike) and returns up to `span` tokens after it; the runner feeds the
row's last token and those drafts through every layer in one wide pass, and verify's final check (policies.py,
`Verify.on_final`) accepts the longest prefix the full model agrees with, rolls back the rest and emits the full
model's token after it: the output is full depth's whatever the drafts were.

When to try: a wide pass costs more than a one-position step, so a row that keeps being wrong stops paying for it.
Each row keeps its own draft length: it grows after a draft run accepted whole and shrinks to what was accepted (plus
one, and never below `min_draft`, the shortest run the costs let pay; the plan chooses it) otherwise; after `patience`
attempts in a row that accepted nothing, the row drafts again only once its context gains a longer match (`backoff`
steps later at the earliest).

Across requests: where a row's own context has no match, the drafts come from the answers the runner finished before
it (runtime/draft_memory.py `DraftMemory`, RunConfig.draft_memory), as llama.cpp's server keeps its n-gram pool.
Calibration prices drafts without them (each prompt alone): a run of one prompt has nothing remembered.

What this module does not do: run graphs or check drafts (runner.py, policies.py).
"""

from __future__ import annotations

import numpy as np

from eectl.contracts.plan import DEFAULT_DRAFTS, MAX_DRAFTS, MAX_NGRAM, LookupStats
from eectl.errors import UsageError
from eectl.runtime.draft_memory import DraftMemory
from eectl.runtime.state import LookupState, RowState

__all__ = [
    "DEFAULT_DRAFTS",
    "LONGEST_RUNS",
    "MAX_DRAFTS",
    "MAX_NGRAM",
    "SHORTEST_RUNS",
    "PromptLookup",
    "cut_at_stop",
    "lookup_stats",
    "replay",
    "suffix_matches",
]

# measured defaults (docs/results/2026-12-01-prompt-drafts.md): suffixes of MAX_NGRAM = 5 tokens down to 2, runs of
# up to DEFAULT_DRAFTS = 12 (eectl.contracts.plan)
MIN_NGRAM = 2
# the shortest runs calibration replays besides 1 (the plan keeps the one its costs price fastest)
SHORTEST_RUNS = (2, 3, 4)
# ... and the longest runs besides DEFAULT_DRAFTS: where a wide pass's positions cost much (int4 segments: ~20% of a
# step each) and the workload's drafts are right for a few tokens at a time (GSM8K answers), runs of 4 price faster
# than runs of 12 (docs/results/2026-12-08-draft-lengths.md); copying workloads (code edits) keep the long runs
LONGEST_RUNS = (4, 8)


class PromptLookup:
    def __init__(
        self,
        max_draft: int,
        max_ngram: int = MAX_NGRAM,
        min_ngram: int = MIN_NGRAM,
        patience: int = 3,
        backoff: int = 8,
        min_draft: int = 1,
        memory: DraftMemory | None = None,
    ) -> None:
        if not 1 <= max_draft <= MAX_DRAFTS:
            raise UsageError(f"--prompt-drafts must be in 1..{MAX_DRAFTS} (0 turns it off), got {max_draft}")
        if not 1 <= min_ngram <= max_ngram:
            raise UsageError(f"--draft-ngram must be >= 1 and >= the minimum match ({min_ngram}), got {max_ngram}")
        self.max_draft = max_draft
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.patience = patience
        self.backoff = backoff
        # fewer drafts than this are not proposed: where a pass over 1 + d positions costs more than d + 1 one-position
        # steps (int4 segments: a second position costs about a step), a run of d drafts cannot pay even when accepted
        self.min_draft = max(1, min(min_draft, max_draft))
        self.memory = memory  # earlier requests' n-gram table, drafted from where the context has no match

    def new_state(self) -> LookupState:
        return LookupState(span=self.max_draft)

    def propose(self, tokens: list[int], limit: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Up to `limit` tokens following the latest earlier occurrence of the longest suffix of `tokens` (between
        max_ngram and min_ngram tokens long) that occurs earlier; cut before a stop id (a stop token ends the answer:
        the step's own token may be one, a draft after it would be past the end). [] when nothing matches."""
        n_tok = len(tokens)
        if limit < 1 or n_tok < self.min_ngram + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_ngram, n_tok - 1), self.min_ngram - 1, -1):
            found = suffix_matches(arr, n)
            if found.size == 0:
                continue
            start = int(found[-1]) + n
            draft = cut_at_stop(arr[start : start + limit].tolist(), stop_ids)
            if draft:
                return draft
        return []

    def drafts_for(self, ls: LookupState, tokens: list[int], limit: int, stop_ids: tuple[int, ...]) -> list[int]:
        """This step's drafts for a row (possibly none), honouring its draft length and back-off."""
        if len(tokens) < ls.resume_at or min(limit, ls.span) < self.min_draft:
            return []
        drafts = self.propose(tokens, min(limit, ls.span), stop_ids)
        if not drafts and self.memory is not None:
            drafts = self.memory.find(tokens, min(limit, ls.span), stop_ids)
        if len(drafts) < self.min_draft:  # none found, or a run too short to pay
            return []
        ls.attempts += 1
        ls.drafted += len(drafts)
        return drafts

    def attach(self, st: RowState, layer: int, max_new_tokens: int, stop_ids: tuple[int, ...]) -> int:
        """A row's drafts for its next step, appended to its tokens as unchecked drafts that the step's final pass
        checks (verify's `on_final`), each counted at `layer` (the final one) with no latency of its own; returns
        how many (0: the row does not draft now). Room is left for the step's own token within max_new_tokens."""
        ls = st.lookup
        assert ls is not None
        room = max_new_tokens - (len(st.tokens) - st.prompt_len) - 1
        drafts = self.drafts_for(ls, st.tokens, room, stop_ids)
        ls.step = (len(st.tokens), len(drafts))
        for t in drafts:
            st.drafts.append((len(st.tokens), t))
            st.tokens.append(t)
            st.exit_layers.append(layer)
            st.latencies.append(0.0)
        return len(drafts)

    def close(self, st: RowState) -> None:
        """After the step that carried the row's drafts: those still in its tokens were accepted (a rollback cut
        the tokens at the first wrong position, perhaps an exit draft's before them)."""
        ls = st.lookup
        assert ls is not None
        start, n = ls.step
        ls.step = (0, 0)
        if n:
            self.settle(ls, n, min(max(len(st.tokens) - start, 0), n), len(st.tokens))

    def settle(self, ls: LookupState, drafted: int, accepted: int, length: int) -> None:
        """After an attempt of `drafted` tokens of which `accepted` were right; `length`: the row's tokens now."""
        ls.accepted += accepted
        if accepted == drafted:
            ls.span = min(self.max_draft, max(ls.span, 2 * drafted))
        else:
            ls.span = max(self.min_draft, accepted + 1)
        ls.misses = ls.misses + 1 if accepted == 0 else 0
        if ls.misses >= self.patience:
            ls.resume_at = length + self.backoff
            ls.misses = 0


def suffix_matches(arr: np.ndarray, n: int) -> np.ndarray:
    """The starts i < len(arr) - n of the earlier windows arr[i : i + n] equal to arr's last n tokens (each followed
    by a token), ascending."""
    span = len(arr) - n
    hit = np.ones(span, dtype=bool)
    for j in range(n):
        hit &= arr[j : j + span] == arr[span + j]
    return np.flatnonzero(hit)


def cut_at_stop(draft: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """`draft` up to its first stop id (a stop token ends the answer: nothing after it is drafted)."""
    return draft[: next((k for k, t in enumerate(draft) if t in stop_ids), len(draft))]


def replay(lookup: PromptLookup, prompt: list[int], answer: list[int], stop_ids: tuple[int, ...] = ()) -> list[int]:
    """The widths of the decode steps that verify with drafts from the context takes to emit `answer` (the greedy
    full-depth answer to `prompt`, which is what verify emits) when `answer` is all it may emit: 1 for a step with no
    drafts, d + 1 for a step carrying d. Exact, with no model run: the drafts depend only on the tokens, and a draft
    is accepted exactly where it equals the answer. The first answer token comes from the prefill (no step)."""
    ls = lookup.new_state()
    tokens = [*prompt, *answer[:1]]
    widths: list[int] = []
    while len(tokens) - len(prompt) < len(answer):
        done = len(tokens) - len(prompt)
        drafts = lookup.drafts_for(ls, tokens, len(answer) - done - 1, stop_ids)
        if drafts:
            truth = answer[done : done + len(drafts)]
            accepted = next((i for i, (d, t) in enumerate(zip(drafts, truth, strict=True)) if d != t), len(drafts))
            tokens += truth[:accepted]
            lookup.settle(ls, len(drafts), accepted, len(tokens))
        widths.append(len(drafts) + 1)
        tokens.append(answer[len(tokens) - len(prompt)])
    return widths


# generated tokens at which calibration's replay is also cut (a run's --max-new-tokens picks the longest that fits)
CUT_LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def lookup_stats(
    pairs: list[tuple[list[int], list[int]]],
    max_draft: int = DEFAULT_DRAFTS,
    stop_ids: tuple[int, ...] = (),
    max_ngram: int = MAX_NGRAM,
    min_draft: int = 1,
    memory: int = 0,
) -> LookupStats:
    """`replay` over (prompt, greedy answer) pairs: the steps by width, the drafts proposed and accepted; and the
    same over the answers cut at each of CUT_LENGTHS shorter than the longest (`LookupStats.cuts`). `memory`: the
    pairs replayed in order, each remembered after its replay in a DraftMemory of that many tokens, as a run of
    them drafts (RunConfig.draft_memory); 0: each prompt alone (calibration's price: what a first request gets)."""
    stats = _replayed(pairs, max_draft, stop_ids, max_ngram, min_draft, memory)
    longest = max((len(a) for _, a in pairs), default=0)
    stats.cuts = [
        _replayed([(p, a[:n]) for p, a in pairs], max_draft, stop_ids, max_ngram, min_draft, memory).model_copy(
            update={"length": n}
        )
        for n in CUT_LENGTHS
        if n < longest
    ]
    return stats


def _replayed(
    pairs: list[tuple[list[int], list[int]]],
    max_draft: int,
    stop_ids: tuple[int, ...],
    max_ngram: int,
    min_draft: int,
    memory: int = 0,
) -> LookupStats:
    kept = DraftMemory(memory, max_ngram) if memory else None
    lookup = PromptLookup(max_draft, max_ngram, min(MIN_NGRAM, max_ngram), min_draft=min_draft, memory=kept)
    per_prompt: list[tuple[int, dict[str, int]]] = []
    for prompt, answer in pairs:
        own: dict[str, int] = {}
        for width in replay(lookup, prompt, answer, stop_ids):
            own[str(width)] = own.get(str(width), 0) + 1
        per_prompt.append((max(0, len(answer) - 1), own))
        if kept is not None:
            kept.remember([*prompt, *answer])
    tokens, steps = LookupStats.pool(per_prompt)
    # every step emits one token of its own and its accepted drafts
    drafted = sum((int(w) - 1) * n for w, n in steps.items())
    accepted = tokens - sum(steps.values())
    return LookupStats(
        max_draft=max_draft,
        min_draft=lookup.min_draft,
        max_ngram=lookup.max_ngram,
        prompts=len(pairs),
        tokens=tokens,
        steps=steps,
        drafted=drafted,
        accepted=accepted,
        per_prompt=per_prompt,
    )
