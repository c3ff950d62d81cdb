"""Calibration's measurements: per token and exit, the exit signal's values and whether the exit's top-1 equals
the final layer's, on teacher-forced text and on the model's own greedy continuations.

`ExitScorer` scores exits as the runner does (eectl.exits.signals' `ExitScoring` on `ExitHead`); `Measurements` holds
the result ([E, N] per criterion, and for signals with candidates [F, E, N] with the candidates picked at each exit F,
so any subset of active exits can be replayed). Generated tokens are scored on the states their generation computed
(`generate_continuations` with `Keep`: the scorer's layers at the measured positions, a block head decoding with its
own KV), not by a second base pass over prompt + continuation (`measure_sequences`, the reference the tests compare
against). `generate_continuations` is also the state cache's generator (heads/state_cache.py).

Measuring runs on the model's device (the scorer's adapter): each call gathers its batches' results there and
returns them on the host in one copy per tensor (`Measurements.host`). What this module does not do: fit thresholds
(calibrate/fit.py, exits/thresholds.py) or write anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from eectl.exits.base import CandidateSource, ExitHead, TorchExitLogits, no_probe_error
from eectl.exits.candidates import make_source
from eectl.exits.generation import Continuation, Keep, generate_continuations, left_padded
from eectl.exits.signals import ExitScoring, get_signal
from eectl.models.adapters import Adapter
from eectl.models.device import to_device
from eectl.models.parts import KVCache

SOURCES = ("teacher-forced", "generated")


def heldout_units(units: torch.Tensor, holdout: float) -> torch.Tensor:
    """The held-out units among `units` (sorted unique ids of one source): the last `holdout` share, at least one,
    never all (a source with fewer than two units holds nothing out)."""
    if holdout <= 0 or units.numel() < 2:
        return units[:0]
    k = min(units.numel() - 1, max(1, round(holdout * units.numel())))
    return units[-k:]


@dataclass
class Measurements:
    exits: list[int]
    num_layers: int
    values: dict[str, torch.Tensor]  # criterion -> [E, N] float32
    correct: torch.Tensor  # [E, N] bool: the exit's top-1 == the final layer's top-1
    source: torch.Tensor  # [N] long: index into SOURCES
    unit: torch.Tensor  # [N] long: chunk (teacher-forced) or prompt (generated) index within its source
    # topk signals depend on where the candidates were picked: [F, E, N] with the candidates picked at exit F
    # (the first active exit), valid for E >= F; `values`/`correct` are the F = 0 slice. None for other signals.
    pair_values: dict[str, torch.Tensor] | None = None
    pair_correct: torch.Tensor | None = None
    # the decision's input state at each exit [E, N, H] (kept for fitting gates: eectl.exits.gates), and the gates'
    # logits
    # [E, N] once fitted; None when not kept
    hidden: torch.Tensor | None = None
    gate_logits: torch.Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.source.numel())

    def positions(self) -> torch.Tensor:
        """[N] long: each token's position within its unit, in the rows' order (a continuation's tokens are measured
        in order: its answer's position 0, 1, ...)."""
        key = self.source * (int(self.unit.max()) + 1) + self.unit
        order = torch.argsort(key, stable=True)
        ranked = key[order]
        index = torch.arange(ranked.numel())
        starts = torch.ones_like(ranked, dtype=torch.bool)
        starts[1:] = ranked[1:] != ranked[:-1]
        first = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values
        out = torch.empty_like(index)
        out[order] = index - first
        return out

    @staticmethod
    def concat(parts: Sequence[Measurements]) -> Measurements:
        first = parts[0]
        pv = pc = None
        if first.pair_values is not None:
            pv = {c: torch.cat([p.pair_values[c] for p in parts if p.pair_values], 2) for c in first.pair_values}
            pc = torch.cat([p.pair_correct for p in parts if p.pair_correct is not None], 2)
        hidden = None
        if first.hidden is not None:
            hidden = torch.cat([p.hidden for p in parts if p.hidden is not None], 1)
        gl = None
        if first.gate_logits is not None:
            gl = torch.cat([p.gate_logits for p in parts if p.gate_logits is not None], 1)
        return Measurements(
            exits=first.exits,
            num_layers=first.num_layers,
            values={c: torch.cat([p.values[c] for p in parts], 1) for c in first.values},
            correct=torch.cat([p.correct for p in parts], 1),
            source=torch.cat([p.source for p in parts]),
            unit=torch.cat([p.unit for p in parts]),
            pair_values=pv,
            pair_correct=pc,
            hidden=hidden,
            gate_logits=gl,
        )

    def host(self) -> Measurements:
        """These measurements on the host, where the fit reads them: one copy per tensor, however many batches were
        measured on the device (a no-op on the CPU)."""
        pv, pc, hidden, gl = self.pair_values, self.pair_correct, self.hidden, self.gate_logits
        return Measurements(
            self.exits,
            self.num_layers,
            {c: v.cpu() for c, v in self.values.items()},
            self.correct.cpu(),
            self.source.cpu(),
            self.unit.cpu(),
            None if pv is None else {c: v.cpu() for c, v in pv.items()},
            None if pc is None else pc.cpu(),
            None if hidden is None else hidden.cpu(),
            None if gl is None else gl.cpu(),
        )

    def take(self, n: int) -> Measurements:
        return Measurements(
            self.exits,
            self.num_layers,
            {c: v[:, :n] for c, v in self.values.items()},
            self.correct[:, :n],
            self.source[:n],
            self.unit[:n],
            None if self.pair_values is None else {c: v[:, :, :n] for c, v in self.pair_values.items()},
            None if self.pair_correct is None else self.pair_correct[:, :, :n],
            None if self.hidden is None else self.hidden[:, :n],
            None if self.gate_logits is None else self.gate_logits[:, :n],
        )

    def restrict(self, exits: Sequence[int], gate_ok: torch.Tensor | None = None) -> Measurements:
        """The measurements a run with only these active exits sees (topk: candidates picked at the first).

        `gate_ok` [len(exits), N] bool: the exits' gates (eectl.exits.gates): where an exit's gate fails its decision
        does
        not run (its values are -inf: no threshold passes), and the candidates are picked at the first exit whose
        gate passes, the later ones scoring those."""
        idx = [self.exits.index(e) for e in exits]
        if gate_ok is not None:
            return self._gated(idx, list(exits), gate_ok)
        if self.pair_values is not None and self.pair_correct is not None:
            f = idx[0]
            values = {c: v[f, idx] for c, v in self.pair_values.items()}
            correct = self.pair_correct[f, idx]
        else:
            values = {c: v[idx] for c, v in self.values.items()}
            correct = self.correct[idx]
        return Measurements(list(exits), self.num_layers, values, correct, self.source, self.unit)

    def _gated(self, idx: list[int], exits: list[int], gate_ok: torch.Tensor) -> Measurements:
        n = self.n
        values = {c: torch.full((len(idx), n), float("-inf")) for c in self.values}
        correct = torch.zeros(len(idx), n, dtype=torch.bool)
        picker = torch.full((n,), -1, dtype=torch.long)  # the exit (index into self.exits) that picked candidates
        for i, e in enumerate(idx):
            ok = gate_ok[i]
            picker[ok & (picker < 0)] = e
            if self.pair_values is None or self.pair_correct is None:
                for c, v in self.values.items():
                    values[c][i, ok] = v[e, ok]
                correct[i, ok] = self.correct[e, ok]
                continue
            for f in torch.unique(picker[ok]).tolist():
                sel = ok & (picker == f)
                for c, v in self.pair_values.items():
                    values[c][i, sel] = v[f, e, sel]
                correct[i, sel] = self.pair_correct[f, e, sel]
        return Measurements(exits, self.num_layers, values, correct, self.source, self.unit)

    def heldout_mask(self, holdout: float) -> torch.Tensor:
        """[N] bool: the tokens of the last `holdout` share of each source's units (at least one, never all)."""
        mask = torch.zeros(self.n, dtype=torch.bool)
        for s in range(len(SOURCES)):
            mine = self.source == s
            held = heldout_units(torch.unique(self.unit[mine]), holdout)
            if held.numel():
                mask |= mine & (self.unit >= held[0])
        return mask


class ExitScorer:
    """Every exit's signal values and top-1 for a batch of positions, scored as the runner scores them."""

    def __init__(
        self,
        adapter: Adapter,
        exits: list[int],
        signal: str,
        top_k: int,
        heads: dict[int, nn.Module] | None = None,
        source: CandidateSource | None = None,
    ) -> None:
        self.adapter = adapter
        self.exits = sorted(exits)
        self.signal = get_signal(signal)
        self.top_k = top_k
        self.criteria = self.signal.criteria
        # Sequence heads (a decoder block, head_designs.BlockHead) read every position at their exit, with their own
        # KV cache: `_forward_capture` runs them on the layer's whole output; the scorer sees their output.
        self.sequence_heads: dict[int, Any] = {
            layer: h for layer, h in (heads or {}).items() if getattr(h, "sequence", False)
        }
        token_heads = {layer: h for layer, h in (heads or {}).items() if layer not in self.sequence_heads}
        self.heads = {layer: ExitHead(adapter, token_heads.get(layer)).eval() for layer in self.exits}
        if self.signal.needs_probe and (lacking := [e for e in self.exits if self.heads[e].probe is None]):
            raise no_probe_error(lacking)
        self.source = source or make_source("first-exit-topk", adapter.lm_head.weight)

    @property
    def needs_inputs(self) -> bool:
        return self.signal.needs_layer_input

    def keep(self) -> Keep:
        """The states this scorer reads: after each exit (with a signal that needs them, after every layer up to
        the last exit, for the segments' block boundaries), with the layers' inputs where the signal reads them, a
        sequence head's output at its exit."""
        blocks_needed = self.signal.needs_blocks
        after = range(1, self.exits[-1] + 1) if blocks_needed else self.exits
        return Keep(after, self.needs_inputs or blocks_needed, heads=self.sequence_heads)

    def assemble(
        self, states: dict[int, torch.Tensor], inputs: dict[int, torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """What `keep` kept (layer -> [T, H]) -> `score`'s states, inputs and blocks."""
        out = [states[layer] for layer in self.exits]
        ins = [inputs[layer] for layer in self.exits] if self.needs_inputs else None
        blocks = None
        if self.signal.needs_blocks:  # segment [lo, hi): the state after lo layers (the input of layer lo + 1), then
            bounds = zip([0, *self.exits], self.exits, strict=False)  # the state after each of its layers
            blocks = [torch.stack([inputs[lo + 1], *(states[j] for j in range(lo + 1, hi + 1))]) for lo, hi in bounds]
        return out, ins, blocks

    def _scores(
        self,
        states: list[torch.Tensor],
        inputs: list[torch.Tensor] | None,
        first: int,
        final_top: torch.Tensor,
        blocks: list[torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Exits first.. scored in order, the candidates picked at exit `first`: values {c: [E', T]}, correct."""
        scoring = ExitScoring(self.signal, TorchExitLogits(self.heads), self.top_k, self.source)
        scores = [
            scoring.score(
                layer,
                h,
                None if inputs is None else inputs[first + e],
                None if blocks is None else blocks[first + e],
            )
            for e, (layer, h) in enumerate(zip(self.exits[first:], states[first:], strict=True))
        ]
        values = {c: torch.stack([s.values[c] for s in scores]).float() for c in self.criteria}
        return values, torch.stack([s.prediction().token == final_top for s in scores])

    def score(
        self,
        states: list[torch.Tensor],
        inputs: list[torch.Tensor] | None,
        final: torch.Tensor,
        blocks: list[torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """states[e] [T, H] (and inputs[e], the last layer's input; blocks[e] [n + 1, T, H], the segment's block
        boundaries) -> values {criterion: [E, T]}, correct [E, T] bool, the final layer's top-1 [T]."""
        values, correct, final_top, _, _ = self.score_pairs(states, inputs, final, pairs=False, blocks=blocks)
        return values, correct, final_top

    @torch.no_grad()
    def score_pairs(
        self,
        states: list[torch.Tensor],
        inputs: list[torch.Tensor] | None,
        final: torch.Tensor,
        pairs: bool = True,
        blocks: list[torch.Tensor] | None = None,
    ) -> tuple[
        dict[str, torch.Tensor], torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None, torch.Tensor | None
    ]:
        """As `score`, plus (signals with candidates, `pairs`) the values and correctness [F, E, T] with the
        candidates picked at every exit F in turn (entries E < F are 0 / False): what any subset of active exits
        would see."""
        final_top = self.adapter.logits(final).argmax(-1)
        values, correct = self._scores(states, inputs, 0, final_top, blocks)
        if not (pairs and self.signal.needs_candidates):
            return values, correct, final_top, None, None
        num, t, dev = len(self.exits), final.shape[0], final.device
        pv = {c: torch.zeros(num, num, t, device=dev) for c in self.criteria}
        pc = torch.zeros(num, num, t, dtype=torch.bool, device=dev)
        for c in self.criteria:
            pv[c][0] = values[c]
        pc[0] = correct
        for f in range(1, num):
            v, ok = self._scores(states, inputs, f, final_top, blocks)
            for c in self.criteria:
                pv[c][f, f:] = v[c]
            pc[f, f:] = ok
        return values, correct, final_top, pv, pc


def _forward_capture(
    scorer: ExitScorer,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache | None,
    key_padding: torch.Tensor | None,
    select: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None, torch.Tensor]:
    """All L layers on ids [B, S]; the selected positions' states the scorer reads (`ExitScorer.keep`) and the
    final state. A sequence head runs on the exit layer's whole output (with its own KV when `cache` is given)."""
    adapter = scorer.adapter
    keep = scorer.keep().capture(select, positions, key_padding, None if cache is None else {})
    final = adapter.forward_layers(
        adapter.embed(ids), positions, 0, adapter.num_layers, cache, key_padding, capture=keep
    )
    return (*scorer.assemble(keep.states, keep.layer_inputs), select(final))


def _part(
    scorer: ExitScorer,
    scored: tuple[Any, ...],
    source: int,
    units: torch.Tensor,
    states: list[torch.Tensor] | None = None,
) -> Measurements:
    """One batch's Measurements; `states` (the exits' input states, [T, H] each): kept as `hidden`."""
    values, correct, _, pv, pc = scored
    src = torch.full_like(units, source)
    hidden = None if states is None else torch.stack([s.float() for s in states])
    return Measurements(scorer.exits, scorer.adapter.num_layers, values, correct, src, units, pv, pc, hidden)


@torch.no_grad()
def measure_text(
    scorer: ExitScorer,
    chunks: list[torch.Tensor],
    skip_first: int = 1,
    on_tokens: Callable[[int], None] | None = None,
    pairs: bool = False,
) -> Measurements | None:
    """Teacher-forced chunks [1, S]: every position from `skip_first` on is one measured token."""
    return measure_text_all([scorer], chunks, skip_first, on_tokens, pairs)[0]


def measure_text_all(
    scorers: Sequence[ExitScorer],
    chunks: list[torch.Tensor],
    skip_first: int,
    on_tokens: Callable[[int], None] | None,
    pairs: bool,
    keep_states: bool = False,
) -> list[Measurements | None]:
    """As `measure_text`, for several scorers (candidate sources, same exits) on the same states (`keep_states`:
    the first scorer's measurements keep them, `Measurements.hidden`)."""
    parts: list[list[Measurements]] = [[] for _ in scorers]
    dev = scorers[0].adapter.device
    for u, ids in enumerate(chunks):
        ids = to_device(ids, dev)
        positions = torch.arange(ids.shape[1], device=dev)[None]
        states, inputs, blocks, final = _forward_capture(
            scorers[0], ids, positions, None, None, lambda h: h[0, skip_first:]
        )
        units = torch.full((final.shape[0],), u, dtype=torch.long, device=dev)
        for j, sc in enumerate(scorers):
            kept = states if keep_states and j == 0 else None
            parts[j].append(_part(sc, sc.score_pairs(states, inputs, final, pairs, blocks), 0, units, kept))
        if on_tokens is not None:
            on_tokens(final.shape[0])
    return [Measurements.concat(p).host() if p else None for p in parts]


def measure_kept_all(
    scorers: Sequence[ExitScorer],
    conts: list[Continuation],
    pairs: bool,
    tokens_per_call: int = 1024,
    keep_states: bool = False,
) -> list[Measurements | None]:
    """Generated tokens scored on the states their generation kept (`generate_continuations(keep=scorer.keep()`
    with `last_only`): position P-1+j of each continuation (its final top-1 is generated token j) is one measured
    token, unit = the prompt's index; about `tokens_per_call` tokens are scored together. No base pass."""
    parts: list[list[Measurements]] = [[] for _ in scorers]
    i = 0
    while i < len(conts):
        group = [conts[i]]
        n = len(conts[i].generated)
        while i + len(group) < len(conts) and n < tokens_per_call:
            group.append(conts[i + len(group)])
            n += len(group[-1].generated)
        i += len(group)
        for c in group:
            assert c.states is not None and c.first == len(c.prompt) - 1, "states kept with Keep(last_only=True)"
            assert all(v.shape[0] == len(c.generated) for v in c.states.values())
        states = {k: torch.cat([c.states[k] for c in group if c.states]) for k in group[0].states or {}}
        inputs = {k: torch.cat([c.inputs[k] for c in group if c.inputs]) for k in group[0].inputs or {}}
        exit_states, exit_inputs, blocks = scorers[0].assemble(states, inputs)
        dev = states[0].device
        units = torch.cat([torch.full((len(c.generated),), c.unit, dtype=torch.long, device=dev) for c in group])
        for j, sc in enumerate(scorers):
            scored = sc.score_pairs(exit_states, exit_inputs, states[0], pairs, blocks)
            parts[j].append(_part(sc, scored, 1, units, exit_states if keep_states and j == 0 else None))
    return [Measurements.concat(p).host() if p else None for p in parts]


@torch.no_grad()
def measure_sequences(
    scorer: ExitScorer,
    conts: list[Continuation],
    batch_size: int = 16,
    pairs: bool = False,
    keep_states: bool = False,
) -> Measurements | None:
    """Continuations measured teacher-forced, by a second base pass over prompt + continuation (position P-1+j, whose
    final top-1 is generated token j, is one measured token; unit = the prompt's index): the reference the states
    kept by the generation (`measure_kept_all`, what calibrate runs) are tested against."""
    parts: list[Measurements] = []
    dev = scorer.adapter.device
    for i in range(0, len(conts), batch_size):
        batch = conts[i : i + batch_size]
        seqs = [c.prompt + c.generated[:-1] for c in batch]
        ids, real, positions = (t.to(dev) for t in left_padded(seqs))
        width = ids.shape[1]
        rows = torch.cat([torch.full((len(c.generated),), r, dtype=torch.long) for r, c in enumerate(batch)])
        cols = torch.cat(
            [
                torch.arange(len(c.generated)) + width - len(seq) + len(c.prompt) - 1
                for c, seq in zip(batch, seqs, strict=True)
            ]
        ).to(dev)
        rows = rows.to(dev)

        def select(h: torch.Tensor, rows: torch.Tensor = rows, cols: torch.Tensor = cols) -> torch.Tensor:
            return h[rows, cols]

        states, inputs, blocks, final = _forward_capture(scorer, ids, positions, KVCache(), real, select)
        units = torch.tensor([c.unit for c in batch], dtype=torch.long, device=dev)[rows]
        scored = scorer.score_pairs(states, inputs, final, pairs, blocks)
        parts.append(_part(scorer, scored, 1, units, states if keep_states else None))
    return Measurements.concat(parts).host() if parts else None


def generation_keep(scorer: ExitScorer) -> Keep:
    """What calibrate's generation keeps for `scorer`: its states at the measured positions only."""
    return replace(scorer.keep(), last_only=True)


def measure_generation(
    scorer: ExitScorer,
    prompts: list[list[int]],
    n_tokens: int,
    gen_tokens: int,
    eos: int | None,
    batch_size: int = 64,
    on_tokens: Callable[[int], None] | None = None,
    pairs: bool = False,
) -> tuple[Measurements | None, int]:
    """Greedy continuations (`generate_continuations`), measured on the states the generation kept. Returns the
    first `n_tokens` measured tokens and the number of prompts used."""
    conts, used = generate_continuations(
        scorer.adapter, prompts, n_tokens, gen_tokens, eos, batch_size, on_tokens, generation_keep(scorer)
    )
    return measure_kept_all([scorer], conts, pairs)[0], used
