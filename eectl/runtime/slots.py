"""A batch's slots across generate calls: the buffers a Runner keeps for its next call (`Kept`), the first tokens
of a new prompt that its slot's cache already holds from the slot's last prompt (`reused`: a chat template's header
is computed once per slot), and the rows still decoding narrowed onto the fewest rows once no prompt waits for a slot
(`narrowed`).

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

from dataclasses import dataclass, field

from eectl.runtime.batch import BatchKV
from eectl.runtime.chain import DecodeChain
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
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
    rows = 1 << (len(seated) - 1).bit_length()
    if rows not in kept.narrow:
        certified = kept.cfg.certified_head  # its buffers where the chain it narrows keeps them
        kept.narrow[rows] = DecodeChain(rt, kept.kv, 0, rows=rows, certified_head=certified, device=chain.device)
    return kept.narrow[rows]
