"""A batch's slots across generate calls: the buffers a Runner keeps for its next call (`Kept`), the first tokens
of a new prompt that its slot's cache already holds from the slot's last prompt (`reused`: a chat template's header
is computed once per slot), the rows still decoding narrowed onto the fewest rows once no prompt waits for a slot
(`narrowed`), and the configuration each step of a batch runs where it switches between the plan's and full depth
as rows join and leave (`Switch`).

A batched full-depth step costs about as much whatever rows it needs a token from: every row of the chain's span
runs (rows that finished ride along on their scratch slot), and at 16 rows the step is compute-bound. Ragged answers
leave more and more of a batch's rows finished while the longest answers go on: on the default model at 2 threads a
16-row step took 32.2 ms, 28.9 ms with 4 of its rows active, and a 4-row step 15.5 ms. Where the rows still decoding
fill no more than half of the chain's rows, they move to the cache's first rows (`KVBuffers.move`: their K/V and
lengths) and step on a chain over the smallest power of two of rows that holds them, bound once per call's buffers.
Each row's tokens are its own whatever rows share its calls (a batch's rows equal batch 1's), so narrowing changes
no token.

What this module does not do: seat prompts or step rows (runner.py, chain_steps.py), or bind a chain (chain.py).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from eectl.runtime.batch import BatchKV
from eectl.runtime.chain import DecodeChain
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RowState, RunConfig
from eectl.runtime.wide_check import MIN_REST, prefix_refused

# a Runner's new KV cache has room for the positions a call needs rounded up to this many: calls of about one length
# (prompts of one file) keep the cache, and the prompts its slots hold (`reused`), instead of allocating it again
ROOM = 128


@dataclass
class Kept:
    """A generate call's KV cache and bound chains, kept for the next call, with the configuration they were bound
    under."""

    kv: BatchKV
    chain: DecodeChain
    cfg: RunConfig
    prompt_chains: dict[int, DecodeChain] = field(default_factory=dict)  # slot -> a one-row chain for its prompts
    narrow: dict[int, DecodeChain] = field(default_factory=dict)  # rows -> a full-depth chain over the first rows
    prompts: dict[int, list[int]] = field(default_factory=dict)  # slot -> the prompt whose K/V begin its cache rows
    heads: dict[int, bool] = field(default_factory=dict)  # rows -> the certified head on (Runner.heads)


def reused(rt: ArtifactRuntime, kept: Kept, slot: int, ids: list[int], pad: bool) -> int:
    """How many of the prompt `ids`' first tokens the slot's cache rows already hold from the slot's last prompt
    (`Kept.prompts`): the tokens they share, every layer holding them, at least MIN_REST tokens left to feed; 0 where
    none, in a padded prompt call (`pad`), or where this machine computes a prompt fed after its prefix otherwise than
    fed whole (wide_check.py `prefix_refused`: then reusing it could change tokens). Prompts in a chat template share
    its header (24 tokens of ~100 on the default model's GSM8K questions): their K/V are computed once per slot."""
    if pad:
        return 0
    n = _common(kept, slot, ids)
    return n if n > 0 and prefix_refused(rt) is None else 0


def shared(rt: ArtifactRuntime, kept: Kept, slot: int, ids: list[int], sources: list[int]) -> int:
    """The prompt `ids` about to be fed in `slot`, whose rows hold its first `kept.kv.filled[slot, 0]` tokens: where
    another row of `sources` (rows whose prompts are in the cache) holds a longer beginning of it, those positions are
    copied into the slot's rows (`KVBuffers.copy`) and their count returned, else what the slot holds. So a batch's
    first prompts, all new at once, compute a shared header once (each is prefilled in turn on the CPU EP)."""
    have = int(kept.kv.filled[slot, 0])
    best, src = have, None
    for other in sources:
        n = _common(kept, other, ids) if other != slot else 0
        if n > best:
            best, src = n, other
    if src is None or prefix_refused(rt) is not None:
        return have
    kept.kv.copy(src, slot, best)
    return best


def _common(kept: Kept, slot: int, ids: list[int]) -> int:
    """The tokens `ids` shares from its start with the prompt held in `slot`'s rows, every layer holding them, at most
    all but MIN_REST of `ids`."""
    cached = kept.prompts.get(slot)
    if not cached:
        return 0
    limit = min(len(cached), len(ids) - MIN_REST, int(kept.kv.filled[slot].min()))
    n = 0
    while n < limit and cached[n] == ids[n]:
        n += 1
    return n


def narrowed(rt: ArtifactRuntime, kept: Kept, chain: DecodeChain, seated: dict[int, int]) -> DecodeChain:
    """The chain the next step of the rows still decoding runs on (`seated`: slot -> prompt, updated where rows
    move): `chain` itself while they fill more than half of its rows, else the narrower chain over the cache's first
    rows, where they have moved (in slot order). Full-depth batch chains on the CPU EP only (their K/V move on the
    host); one-row chains and chains with exits stay."""
    if chain.rows == 1 or chain.exit_at or len(seated) > chain.rows // 2 or rt.device != "cpu":
        return chain
    for dst, src in enumerate(sorted(seated)):  # dst <= src: every row below src has moved already
        if src != dst:
            kept.kv.move(src, dst)
            seated[dst] = seated.pop(src)
            kept.prompts[dst] = kept.prompts.pop(src)
    return _narrow(rt, kept, 1 << (len(seated) - 1).bit_length(), chain.device)


def _narrow(rt: ArtifactRuntime, kept: Kept, rows: int, device: bool | None) -> DecodeChain:
    """`kept`'s full-depth chain over the cache's first `rows` rows, bound on first use."""
    if rows not in kept.narrow:
        certified = kept.cfg.certified_head and kept.heads.get(rows, True)
        kept.narrow[rows] = DecodeChain(rt, kept.kv, 0, rows=rows, certified_head=certified, device=device)
    return kept.narrow[rows]


def rebound(rt: ArtifactRuntime, kept: Kept, chain: DecodeChain) -> DecodeChain:
    """`kept`'s chain over the rows `chain` (another configuration's, on the same cache: `Switch`) spans: the whole
    batch's, or the narrowed one over the cache's first rows (a configuration with exits never narrows: its whole
    batch's chain, the rows where they are)."""
    if chain.rows == kept.chain.rows or kept.chain.exit_at:
        return kept.chain
    return _narrow(rt, kept, chain.rows, chain.device)


PLAN, FULL, DRAIN = "plan", "full", "drain"  # what a step of a switching batch ran (`Switch.ran`)


@dataclass
class Switch:
    """A batch that runs the plan's configuration (the runner's own: drafts from the context, or verify's exits)
    while it holds few enough rows for it to pay, and full depth (`full`, a runner of the same run at full depth)
    while it holds more: `pays(rows)` says which (plan/batch.py prices it), asked before every step.

    Both configurations step the same cache (`full`'s `Kept` shares the runner's buffers and their prompts: `view`),
    and only lossless configurations switch (verify's check makes every token full depth's), so each row's tokens
    are the ones it gets alone whatever its batch ran. A switch to full depth waits for a cycle boundary: a row with
    unchecked drafts or deferred states (verify's exits) first takes one step of the plan's configuration with no
    exit deciding (`DRAIN`: the deep pass checks the drafts and computes the deferred K/V); drafts from the context
    are checked in the step that carries them, so their rows are always at one. A step holding a sampled row (an
    engine's request with its own sampling, runtime/sampling.py `RowSampling`) never runs the plan's configuration,
    which is greedy only: it runs full depth, the sampled row's own configuration, after a drain where one is needed
    (the drain's deep pass, with no exit deciding, is full depth for the sampled row too). `ran` holds what the
    recent steps ran (rows, PLAN | FULL | DRAIN) and `counts` the steps of each since the engine started."""

    full: Any  # Runner (runtime/runner.py imports this module)
    pays: Callable[[int], bool]
    ran: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=4096))
    counts: dict[str, int] = field(default_factory=lambda: {PLAN: 0, FULL: 0, DRAIN: 0})

    def pick(self, runner: Any, kept: Kept, rows: list[RowState]) -> tuple[Any, Kept, bool]:
        """The runner and buffers the next step of these seated `rows` runs on, and whether no exit may decide in it
        (a drain step)."""
        if self.pays(len(rows)) and not any(runner.samples(st) for st in rows):
            mode = PLAN
        else:
            mode = DRAIN if any(st.drafts or any(p is not None for p in st.pending) for st in rows) else FULL
        self.ran.append((len(rows), mode))
        self.counts[mode] += 1
        if mode != FULL:
            return runner, kept, mode == DRAIN
        self.full.place = runner.place  # the run's placement (its record of host reads)
        return self.full, self.view(kept), False

    def view(self, kept: Kept) -> Kept:
        """`full`'s buffers: the runner's cache and the prompts its rows hold, with full depth's chains bound on it."""
        k = self.full._kept
        if k is None or k.kv is not kept.kv:
            cfg = copy.deepcopy(self.full.cfg)
            chain = self.full._chain(kept.kv, kept.kv.rows)
            k = self.full._kept = Kept(kept.kv, chain, cfg, prompts=kept.prompts, heads=self.full.heads)
        return k
