"""A batch's slots across generate calls: the buffers a Runner keeps for its next call (`Kept`), and the rows still
decoding narrowed onto the fewest rows once no prompt waits for a slot (`narrowed`).

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


@dataclass
class Kept:
    """A generate call's KV cache and bound chains, kept for the next call, with the configuration they were bound
    under."""

    kv: BatchKV
    chain: DecodeChain | None
    cfg: RunConfig
    prompt_chains: dict[int, DecodeChain] = field(default_factory=dict)  # slot -> a one-row chain for its prompts
    narrow: dict[int, DecodeChain] = field(default_factory=dict)  # rows -> a full-depth chain over the first rows


def narrowed(rt: ArtifactRuntime, kept: Kept, chain: DecodeChain, seated: dict[int, int]) -> DecodeChain:
    """The chain the next step of the rows still decoding runs on (`seated`: slot -> prompt, updated where rows
    move): `chain` itself while they fill more than half of its rows, else the narrower chain over the cache's first
    rows, where they have moved (in slot order). Full-depth batch chains on the CPU EP only (their K/V move on the
    host); one-row chains stay."""
    if chain.rows == 1 or len(seated) > chain.rows // 2 or rt.device != "cpu":
        return chain
    for dst, src in enumerate(sorted(seated)):  # dst <= src: every row below src has moved already
        if src != dst:
            kept.kv.move(src, dst)
            seated[dst] = seated.pop(src)
    rows = 1 << (len(seated) - 1).bit_length()
    if rows not in kept.narrow:
        kept.narrow[rows] = DecodeChain(rt, kept.kv, 0, rows=rows, certified_head=kept.cfg.certified_head)
    return kept.narrow[rows]
