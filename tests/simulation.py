"""The runner's reference in PyTorch: early-exit decoding over the torch model, one position at a time, with an
explicit KV cache per row, written from the rules the runner documents rather than from its code.

Per step, a row feeds what its cache does not hold yet: its prompt (the first step or a conversation's turn, full depth;
a one-token prompt decides as a decode step) or its last token. The layers run segment by segment (the segments cut at
the artifact's exits); after a segment that ends at an active exit, a block exit head runs on the position (its own KV
cache), the exit's gate is read on the exit's state, and where it opens the exit's signal is scored through
`ExitScoring` over the torch exit heads (the code calibrate runs: the first exit that decides picks the K candidates). A
token whose test passes leaves there:

- defer: the position's deeper layers (and the later active exits' blocks) computed on its exit state, as the
  runner's deferred flush computes them later: the cache is the full model's at every position;
- copy: each skipped layer's K/V projected from the segment's output (CALM's state copying, `Adapter.project_kv`),
  the later active exits' blocks' too (`block_project_kv`).

verify is lossless (its tokens are full depth's) and the river predicts with int4 copies: neither is simulated
here (their tests compare with full depth, and with the river's own graphs).

Tokens: greedy, sampled (`pick_token` on one seeded generator, in the runner's order: per step, the rows that
exit at an exit in row order, exits in order, then the rows at full depth in row order), or teacher-forced (the
fed token scored on the layer it was decided at: -log p over that layer's full vocabulary, and its argmax). Rows
of a batch are independent sequences; with fewer slots than prompts a finished row's slot takes the next prompt
in the following step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from eectl.exits.base import CandidateSource, ExitHead, TorchExitLogits, passes
from eectl.exits.candidates import FirstExitTopK
from eectl.exits.designs import BlockHead
from eectl.exits.gates import gate_open
from eectl.exits.signals import ExitScoring, get_signal
from eectl.models.parts import KVCache
from eectl.runtime.sampling import pick_token


@dataclass
class Row:
    """One sequence's reference run: its tokens after the prompt, the layer each was decided at, the decisions taken
    per exit, each decision's signal values, the exit states a decision could read (before its gate), and the KV
    caches (the model's; each block head's own by exit)."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    decided: dict[int, int] = field(default_factory=dict)
    values: dict[int, list[float]] = field(default_factory=dict)  # exit -> the signal's first criterion per test
    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # exit -> its state [H] where it may decide
    nll: list[float] = field(default_factory=list)  # teacher-forced: per scored position
    greedy: list[int] = field(default_factory=list)
    cache: KVCache = field(default_factory=KVCache)
    own: dict[int, KVCache] = field(default_factory=dict)
    forced: list[int] | None = None

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


class Simulation:
    """`adapter`'s early-exit decoding under one configuration (the runner's `RunConfig` in torch terms).

    `cuts`: the artifact's exit layers (its segments end there; default: the active exits). `heads`: exit -> the
    trained head (a per-token module, possibly with a probe, or a `BlockHead`); exits without one read the logit lens.
    `gates`: exit -> (weight, bias, threshold). `source`: the candidate source (a name or an object)."""

    def __init__(
        self,
        adapter: Any,
        exits: Sequence[int],
        thresholds: dict[int, dict[str, float]],
        *,
        signal: str = "topk-prob",
        policy: str = "defer",
        top_k: int = 8,
        cuts: Sequence[int] | None = None,
        heads: dict[int, Any] | None = None,
        gates: dict[int, tuple[np.ndarray, float, float]] | None = None,
        source: str | CandidateSource = FirstExitTopK.name,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> None:
        if policy not in ("defer", "copy"):
            raise ValueError(f"no simulation of {policy}: it is compared with full depth or its own graphs")
        self.a, self.L = adapter, adapter.num_layers
        self.exits, self.thresholds = sorted(exits), thresholds
        self.signal, self.policy, self.top_k, self.source = get_signal(signal), policy, top_k, source
        bounds = sorted(set(cuts if cuts is not None else exits) | {self.L})
        self.segments = list(zip([0, *bounds[:-1]], bounds, strict=True))
        heads = heads or {}
        self.blocks = {e: h for e, h in heads.items() if isinstance(h, BlockHead) and e in self.exits}
        per_token = {e: h for e, h in heads.items() if not isinstance(h, BlockHead)}
        self.heads = {e: ExitHead(adapter, per_token.get(e)).eval() for e in [*bounds[:-1], self.L]}
        self.gates = gates or {}
        self.temperature, self.top_p = temperature, top_p
        self.rng = np.random.default_rng(seed)

    # --- runs --------------------------------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[Sequence[int]], new: int, slots: int | None = None, stop_ids: Sequence[int] = ()
    ) -> list[Row]:
        """Each prompt's `new` tokens (fewer where a stop id ends it), rows in lock-step in `slots` slots (default:
        every prompt at once); a finished row's slot takes the next prompt at the next step."""
        rows = [Row(list(p)) for p in prompts]
        queue, seated = list(range(len(rows))), []
        width = len(rows) if slots is None else min(slots, len(rows))
        with torch.no_grad():
            while queue or seated:
                while queue and len(seated) < width:
                    seated.append(queue.pop(0))
                self._step([rows[i] for i in seated])
                seated = [i for i in seated if len(rows[i].tokens) < new and rows[i].tokens[-1] not in stop_ids]
        return rows

    def turn(self, row: Row, ids: Sequence[int], new: int) -> Row:
        """A conversation's next turn on `row`'s caches: `ids` (the whole conversation so far, beginning with what
        the row's cache holds) fed after them as a prompt, then up to `new` tokens (the runner's chat turns)."""
        held = row.cache.length(0)
        if list(ids[:held]) != row.sequence[:held] or len(ids) <= held:
            raise ValueError("a turn continues what the row's cache holds with new tokens")
        turn = Row(list(ids), cache=row.cache, own=row.own)
        with torch.no_grad():
            while len(turn.tokens) < new:
                self._step([turn])
        return turn

    def score(self, ids: Sequence[int], prompt_len: int) -> Row:
        """Teacher-forced: ids[prompt_len:] fed after the prompt, each position's -log p, argmax and layer."""
        row = Row(list(ids[:prompt_len]), forced=list(ids))
        with torch.no_grad():
            while len(row.sequence) < len(ids):
                self._step([row])
        return row

    # --- one step ----------------------------------------------------------------------------------------------------
    def _step(self, rows: list[Row]) -> None:
        """One step of every row (the runner's order of picks: at each exit the rows leaving there, then the rest)."""
        live = []
        for r in rows:
            past = r.cache.length(0)  # what the row's cache holds (every fed position passes layer 0)
            feed = r.sequence[past:]
            scoring = ExitScoring(self.signal, TorchExitLogits(self.heads), self.top_k, self.source)
            pos = torch.arange(past, past + len(feed))[None]
            live.append(_Flow(r, self.a.embed(torch.tensor([feed])), pos, len(feed) == 1, scoring))
        for lo, hi in self.segments[:-1]:
            live = [f for f in live if not self._segment(f, lo, hi)]
        for f in live:  # full depth, in row order
            f.h = self.a.forward_layers(f.h, f.pos, self.segments[-1][0], self.L, f.row.cache)
            self._emit(f.row, self.L, self.heads[self.L].full(f.h[0, -1:])[0], None)

    def _segment(self, f: _Flow, lo: int, hi: int) -> bool:
        """Segment [lo, hi) for one row, then its exit at hi where active; True where the token left there."""
        r, states = f.row, []
        f.h = self.a.forward_layers(f.h, f.pos, lo, hi, f.row.cache, on_layer=lambda i, x, y: states.append((x, y)))
        if hi not in self.exits:
            return False
        x = f.h
        if hi in self.blocks:  # a block head runs on every position its segment runs
            x = self.blocks[hi].step(f.h, f.pos, r.own.setdefault(hi, KVCache()))
        if not f.may_exit:
            return False
        r.states.setdefault(hi, []).append(x[0, -1])
        if not gate_open(self.gates.get(hi), x[0, -1].float().numpy()):
            return False
        blocks = torch.stack([states[0][0][0, -1:], *(y[0, -1:] for _, y in states)])  # [n + 1, 1, H]
        score = f.scoring.score(hi, x[0, -1:], states[-1][0][0, -1:], blocks)
        r.decided[hi] = r.decided.get(hi, 0) + 1
        first = self.signal.criteria[0]
        r.values.setdefault(hi, []).append(float(torch.as_tensor(score.values[first]).reshape(-1)[0]))
        if not bool(passes(score.values, self.thresholds[hi])[0]):
            return False
        self._leave(f, hi)
        pred = score.prediction()
        ids = None if pred.ids is None else np.asarray(pred.ids[0])
        self._emit(r, hi, self.heads[hi].full(x[0, -1:])[0], (np.asarray(pred.logits[0]), ids, int(pred.token[0])))
        return True

    def _leave(self, f: _Flow, e: int) -> None:
        """The position's deeper layers: computed on its exit state (defer) or copied from it (copy)."""
        r = f.row
        for lo, hi in (seg for seg in self.segments if seg[0] >= e):
            if self.policy == "defer":
                f.h = self.a.forward_layers(f.h, f.pos, lo, hi, r.cache)
                if hi in self.blocks:
                    self.blocks[hi].step(f.h, f.pos, r.own.setdefault(hi, KVCache()))
            else:
                self.a.project_kv(f.h, f.pos, lo, hi, r.cache)
                if hi in self.blocks:
                    b = self.blocks[hi]
                    self.a.block_project_kv(b.block, f.h, f.pos, b.init_layer, r.own.setdefault(hi, KVCache()))

    def _emit(self, r: Row, layer: int, full: torch.Tensor, exit_pick: tuple[np.ndarray, Any, int] | None) -> None:
        """Row r's token decided at `layer`: `full` its full-vocabulary logits there [V]; `exit_pick` an exit's own
        (logits, their ids or None, top-1)."""
        r.layers.append(layer)
        if r.forced is not None:
            z = full.double()
            token = r.forced[len(r.sequence)]
            r.nll.append(float(torch.logsumexp(z, -1) - z[token]))
            r.greedy.append(int(z.argmax()))
        elif exit_pick is not None:
            logits, ids, top1 = exit_pick
            token = top1 if self.temperature <= 0 else pick_token(logits, ids, self.temperature, self.top_p, self.rng)
        else:
            token = pick_token(full.float().numpy(), None, self.temperature, self.top_p, self.rng)
        r.tokens.append(token)


@dataclass
class _Flow:
    row: Row
    h: torch.Tensor
    pos: torch.Tensor
    may_exit: bool
    scoring: ExitScoring


def assert_cache(
    kv: Any, row: int, ref: Row, manifest: Any, *, tol: float = 1e-4, whole: bool = False, fed: bool = True
) -> None:
    """Row `row` of a runner's cache (`KVBuffers`) holds `ref`'s K/V within `tol`: each decoder layer, and each
    active block head's own slot, up to the positions the runner holds there. Those are at most the reference's
    (defer's last exited positions wait for a later flush in the deeper layers); with `fed` layer 0 holds every
    position the reference fed, with `whole` every slot does."""
    slots = [(layer, ref.cache, layer) for layer in range(manifest.num_layers)]
    for e, own in ref.own.items():
        block = manifest.exit_at(e).block
        slots.append((block.kv_slot, own, block.init_layer))
    assert not fed or int(kv.filled[row, 0]) == ref.cache.length(0), (row, kv.filled[row, 0], ref.cache.length(0))
    for slot, cache, layer in slots:
        n = int(kv.filled[row, slot])
        assert 0 < n <= cache.length(layer), (row, slot, n, cache.length(layer))
        assert n == cache.length(layer) or not whole, (row, slot, n, cache.length(layer))
        for got, want in ((kv.keys[row][slot], cache.keys[layer]), (kv.values[row][slot], cache.values[layer])):
            mine = np.asarray(got)[0, :, :n]
            np.testing.assert_allclose(mine, want[0, :, :n].numpy(), rtol=tol, atol=tol, err_msg=f"slot {slot}")
