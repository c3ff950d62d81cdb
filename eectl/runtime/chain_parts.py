"""What a bound chain's step is made of (runtime/chain.py): an active exit's decision bound after its segment
(`BoundExit`), a block exit head bound after its segment (`BlockCall`), a segment bound for several positions
(`WideCall`), and how a token is picked where the run does not take the graphs' argmax (`Pick`: sampling, teacher
forcing)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eectl.runtime.placement import HOST, Placement, Read

# a row's token from logits [V] (or [K] with their vocabulary ids): the runner's sampling (runtime/sampling.py)
Pick = Callable[[np.ndarray, np.ndarray | None], int]


@dataclass
class BoundExit:
    """One active exit's decision bound after its segment: run `io` on `session`, then read `passed` and `token`
    (each read recorded in the run's placement under `graph`, the binding plan's name of the exit's graph)."""

    layer: int
    session: Any
    io: Any
    passed: np.ndarray  # [1] bool
    token: np.ndarray  # [1] int64
    ids: np.ndarray | None = None  # [1, K]: `token` is a column of these candidates (a local exit on the first's rows)
    graph: str = "exit_full"  # binding.KINDS: "candidates" or "exit_full" (picking), "exit_local" (scoring)
    ids_from: Read | None = None  # where `ids` were output (the picker's candidates): read for the token's id
    # sampling (temperature > 0): the candidates' logits [1, K] this decision wrote, and the vocabulary ids [1, K] of
    # those candidates (its own where it picks, the picker's where it scores them) with where they were output
    logits: np.ndarray | None = None
    candidates: np.ndarray | None = None
    candidates_from: Read | None = None

    def passes(self, place: Placement) -> bool:
        place.read((self.graph, self.layer, "passed"))
        return bool(self.passed[0])

    def exit_token(self, place: Placement = HOST) -> int:
        place.read((self.graph, self.layer, "exit_token"))
        t = int(self.token[0])
        if self.ids is None:
            return t
        assert self.ids_from is not None
        place.read(self.ids_from)
        return int(self.ids[0, t])

    def sampled(self, pick: Pick, place: Placement = HOST) -> int:
        """The exiting token sampled from the K candidates' logits (`pick` over them and their ids)."""
        assert self.logits is not None and self.candidates is not None and self.candidates_from is not None
        place.read((self.graph, self.layer, "candidate_logits"))
        place.read(self.candidates_from)
        return pick(self.logits[0], self.candidates[0])


@dataclass
class BlockCall:
    """A block exit head bound after its segment (runtime/blocks.py): run `io`, its K/V at `slot` advance as the
    segment's last layer's; its output `out` [1, n, H] is what the exit reads."""

    session: Any
    io: Any
    slot: int
    out: Any

    @classmethod
    def bind(cls, rt: Any, kv: Any, rows: tuple[int, int], layer: int, x: Any, out: Any, lengths: Any) -> BlockCall:
        """Exit `layer`'s block head on rows [first, last) of `kv` (an ArtifactRuntime's KVBuffers: this module
        sits below the runtime), input x, output out, the length scalars (seqlens_k, total) its segment's."""
        g = rt.block_graphs[layer][0]
        block = rt.manifest.exit_at(layer).block
        assert block is not None
        io = g.session.io_binding()
        rt.bind_kv(io, g, kv, [block.kv_slot], *rows)
        rt._bind_array(io, g.name("seqlens_k"), lengths[0])
        rt._bind_array(io, g.name("total_sequence_length"), lengths[1])
        rt._bind_array(io, g.name("hidden"), x)
        rt._bind_array(io, g.name("hidden_out"), out, output=True)
        return cls(g.session, io, block.kv_slot, out)


@dataclass
class WideCall:
    """Segment s bound for n positions: its input x [1, n, H] and output out [1, n, H] (host), lengths set per call."""

    session: Any
    io: Any
    x: np.ndarray
    out: np.ndarray
    seqlens_k: np.ndarray
    total: np.ndarray
    layer_in: np.ndarray  # [1, n, H]: each position's input to the segment's last layer
    blocks: np.ndarray | None  # [1, (layers + 1) * n, H]: its block boundaries, where the exit after it reads them
    block: BlockCall | None  # the block exit head after it, over the same positions
    held: list[Any] = field(default_factory=list)  # every buffer its binding reads by address
