"""The model's own greedy continuations, generated in left-padded batches with the exit states kept as they are
computed: what calibrate measures generated tokens on and the heads' state cache trains from.

`Keep` says which states a forward pass keeps (the exits' inputs and outputs, the sequence heads' own). Everything runs
on the model's device, and the kept states stay there (the caller moves what it stores). What this module does not
do: score exits (measure.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eectl.data import encode_prompt
from eectl.models.adapters import Adapter, Capture
from eectl.models.parts import KVCache


@dataclass
class Continuation:
    unit: int  # the prompt's index
    prompt: list[int]
    generated: list[int]  # greedy full-depth tokens (the last may be EOS)
    # with `keep`: the states the generation computed, layer -> [T, H] (under key 0 the last layer's, before the
    # final norm, as computed) and, with `Keep.inputs`, those layers' inputs; at positions `first`.. of
    # prompt + generated[:-1] (the last token is one no step fed): every position (first = 0) or, with
    # `Keep.last_only`, the n positions that predict the generated tokens (first = P - 1)
    states: dict[int, torch.Tensor] | None = None
    inputs: dict[int, torch.Tensor] | None = None
    first: int = 0

    def cut(self, n: int) -> None:
        """Keep the first n generated tokens (and their states)."""
        self.generated = self.generated[:n]
        keep = len(self.prompt) + max(n, 1) - 1 - self.first
        for kept in (self.states, self.inputs):
            if kept is not None:
                for k in kept:
                    kept[k] = kept[k][:keep]


def prompt_ids(tokenizer: Any, prompts: Sequence[str], max_len: int, raw: bool = False) -> list[list[int]]:
    """Each prompt encoded as the runner does (`encode_prompt`), last record first, keeping the last max_len tokens."""
    out = [encode_prompt(tokenizer, text, raw)[-max_len:] for text in reversed(prompts)]
    return [ids for ids in out if ids]


def left_padded(batch: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token id lists -> ids [B, S] (left-padded with 0), real [B, S] bool, positions [B, S] counted per row from its
    first real token."""
    b, s = len(batch), max(len(p) for p in batch)
    ids = torch.zeros(b, s, dtype=torch.long)
    real = torch.zeros(b, s, dtype=torch.bool)
    for r, p in enumerate(batch):
        ids[r, s - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        real[r, s - len(p) :] = True
    return ids, real, (real.long().cumsum(1) - 1).clamp(min=0)


@torch.no_grad()
def generate_continuations(
    adapter: Adapter,
    prompts: list[list[int]],
    n_tokens: int,
    gen_tokens: int,
    eos: int | None,
    batch_size: int = 64,
    on_tokens: Callable[[int], None] | None = None,
    keep: Keep | None = None,
) -> tuple[list[Continuation], int]:
    """Greedy full-depth continuations of the first prompts (token ids, BOS included), in order, `gen_tokens` each
    (a row stops at EOS), until `n_tokens` tokens are generated (the last continuation is cut to make it exact).

    Which prompts and tokens does not depend on `batch_size` (a speed knob): each round takes only as many of the
    next prompts as could still be needed (each gives at most `gen_tokens`), sorts them by length into batches of
    `batch_size` (prompts of similar length share a batch: less left padding) and generates every batch to its end.
    With `keep`, each continuation also keeps the states the generation computed (`Keep`), so a caller that needs
    them (calibrate, the state cache) does not run the base again. Returns the continuations (in prompt order) and
    the number of prompts used."""
    out: list[Continuation] = []
    got = used = 0

    def ticks(n: int) -> None:  # progress up to n_tokens (the last round may generate a few more)
        nonlocal got
        if on_tokens is not None:
            on_tokens(max(0, min(n, n_tokens - got)))
        got += n

    while got < n_tokens and used < len(prompts):
        take = min(len(prompts) - used, math.ceil((n_tokens - got) / gen_tokens))
        members = sorted(range(used, used + take), key=lambda i: len(prompts[i]))
        used += take
        for b0 in range(0, take, batch_size):
            out += _generate_batch(adapter, prompts, members[b0 : b0 + batch_size], gen_tokens, eos, keep, ticks)
    out.sort(key=lambda c: c.unit)
    over = sum(len(c.generated) for c in out) - n_tokens
    while over > 0 and out:  # cut the last continuations to exactly n_tokens
        cut = min(over, len(out[-1].generated))
        out[-1].cut(len(out[-1].generated) - cut)
        over -= cut
        if not out[-1].generated:
            out.pop()
    return out, used


EOS_CHECK_EVERY = 8  # decode steps between the host's reads of which rows are still alive


def _generate_batch(
    adapter: Adapter,
    prompts: list[list[int]],
    members: list[int],
    gen_tokens: int,
    eos: int | None,
    keep: Keep | None,
    on_tokens: Callable[[int], None],
) -> list[Continuation]:
    """One left-padded batch of prompts, each row to EOS or `gen_tokens` tokens, on the model's device.

    The tokens stay on the device until the batch ends (one copy to the host then): the host reads how many rows are
    alive once every EOS_CHECK_EVERY steps (progress, and the stop once every row has ended), not every step, so it
    never waits on each step. A batch whose rows all end early runs at most EOS_CHECK_EVERY - 1 steps more than it
    needs; those steps change nothing (a row's tokens end at its EOS)."""
    batch = [prompts[i] for i in members]
    b, dev = len(batch), adapter.device
    ids, pad, positions = (t.to(dev) for t in left_padded(batch))
    cache, alive = KVCache(), torch.ones(b, dtype=torch.bool, device=dev)
    tokens = torch.zeros(b, gen_tokens, dtype=torch.long, device=dev)  # [B, steps]: row r's first counts[r] are its
    counts = torch.zeros(b, dtype=torch.long, device=dev)  # tokens generated per row (a row ends after its EOS)
    kept = _StepStates(keep)
    steps = reported = 0
    for step in range(gen_tokens):
        capture = kept.capture(positions, pad)
        final = adapter.forward_layers(
            adapter.embed(ids), positions, 0, adapter.num_layers, cache, pad, capture=capture
        )
        kept.end_step(capture, final)
        top = adapter.logits(final[:, -1]).argmax(-1)
        tokens[:, step] = top
        counts += alive
        nxt = torch.where(alive, top, torch.full_like(top, eos if eos is not None else 0))
        alive = alive if eos is None else alive & (nxt != eos)
        steps = step + 1
        if eos is not None and steps < gen_tokens and steps % EOS_CHECK_EVERY == 0:
            left, produced = torch.stack([alive.sum(), counts.sum()]).tolist()  # one read per block of steps
            on_tokens(produced - reported)
            reported = produced
            if left == 0:
                break
        ids, positions = nxt[:, None], positions[:, -1:] + 1
        pad = torch.cat([pad, torch.ones(b, 1, dtype=torch.bool, device=dev)], 1)
    rows, lengths = tokens[:, :steps].tolist(), counts.tolist()  # the batch's one copy of its tokens
    on_tokens(sum(lengths) - reported)
    out = []
    for r in range(b):
        if lengths[r]:
            c = Continuation(members[r], batch[r], rows[r][: lengths[r]])
            kept.fill(c, r)
            out.append(c)
    return out


class _StepStates:
    """What one batch's generation keeps of its steps (`Keep`): per step, the kept layers' states (and inputs) and
    the final state, over the prefill [B, S0, H] then [B, 1, H] per decode step (only the last column with
    `last_only`); the sequence heads' own KV caches live here for the batch."""

    def __init__(self, keep: Keep | None) -> None:
        self.keep = keep
        self.steps: list[tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]] = []
        self.caches: dict[int, KVCache] = {}

    def _select(self, h: torch.Tensor) -> torch.Tensor:
        assert self.keep is not None
        return h[:, -1:] if self.keep.last_only else h

    def capture(self, positions: torch.Tensor, pad: torch.Tensor) -> Capture | None:
        return None if self.keep is None else self.keep.capture(self._select, positions, pad, self.caches)

    def end_step(self, capture: Capture | None, final: torch.Tensor) -> None:
        if capture is not None:
            self.steps.append(({0: self._select(final), **capture.states}, capture.layer_inputs))

    def fill(self, c: Continuation, r: int) -> None:
        """Continuation c (row r): its states at its prompt (the prefill's last columns: its own, no padding; with
        `last_only`, the last) and its first n - 1 fed tokens."""
        if self.keep is None or not self.steps:
            return
        n, width = len(c.generated), 1 if self.keep.last_only else len(c.prompt)

        def row(part: int) -> dict[int, torch.Tensor]:
            first = self.steps[0][part]
            return {k: torch.cat([first[k][r, -width:], *(s[part][k][r] for s in self.steps[1:n])]) for k in first}

        c.states, c.first = row(0), len(c.prompt) - width
        c.inputs = row(1) if self.keep.inputs else None


@dataclass
class Keep:
    """Which states a forward pass keeps (`capture`), and how a generation stores them per continuation
    (`generate_continuations(keep=...)`)."""

    after: Collection[int]  # the state after these layers
    inputs: bool = False  # and each of those layers' input
    # sequence heads (a decoder block, head_designs.BlockHead) by exit layer: each runs on its layer's whole output,
    # with its own KV cache when decoding, and its output is what is kept at that exit
    heads: dict[int, Any] = field(default_factory=dict)
    last_only: bool = False  # generation: only each step's last position (the one that predicts the next token)

    def capture(
        self,
        select: Callable[[torch.Tensor], torch.Tensor],
        positions: torch.Tensor,
        key_padding: torch.Tensor | None,
        caches: dict[int, KVCache] | None,
    ) -> Capture:
        """A Capture for one forward call at `positions`; `caches` holds the sequence heads' own KV (decoding), None
        runs them on the whole sequence."""
        if not self.heads:
            return Capture(self.after, self.inputs, select)
        return _SequenceHeadCapture(
            self.after,
            self.inputs,
            select,
            heads=self.heads,
            positions=positions,
            key_padding=key_padding,
            caches=caches,
        )


@dataclass
class _SequenceHeadCapture(Capture):
    """Runs each sequence head (a block) on its exit layer's whole output before the positions are selected; with
    `caches`, each head keeps its own KV there (decoding), else it reads the whole sequence."""

    heads: dict[int, Any] = field(default_factory=dict)
    positions: torch.Tensor | None = None
    key_padding: torch.Tensor | None = None
    caches: dict[int, KVCache] | None = None

    def keep(self, layer: int, h_in: torch.Tensor, h_out: torch.Tensor) -> None:
        head = self.heads.get(layer)
        if head is not None and layer in self.after:
            own = None if self.caches is None else self.caches.setdefault(layer, KVCache())
            h_out = head.step(h_out, self.positions, own, self.key_padding)
        super().keep(layer, h_in, h_out)
