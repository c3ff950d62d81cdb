"""`eectl calibrate`: per-exit thresholds so that exiting tokens agree with the full model at a stated rate.

The decision rule is the runner's, and calibration follows it SEQUENTIALLY:

    for each exit l in ascending order:       (an exit "after layer l" reads the state after l decoder layers)
        if every criterion c of the signal has value_c(l) >= threshold_c(l):  exit here with the exit's top-1
    otherwise run all L layers

so exit l is calibrated only on the tokens that no earlier exit took. Per exit, FlexEE's
lambda*_l = min{ lambda : P(top1_l == top1_final | value_l >= lambda) >= target } on those tokens
with `confidence` the Clopper-Pearson lower bound on that precision must reach the target instead. The statistics
and the sequential fit live in eectl.thresholds; the calibration.json schema in eectl.calibration_file.

Signals are scored by eectl.exits (`ExitScoring`, the path the runner takes too) on `ExitHead`, the code export
turns into the exit graphs:
  - topk-*: at the FIRST listed exit one full LM-head projection (`ExitHead.full`) picks the K candidates
    (`topk_candidates`); the first exit's local logits are those K gathered full logits; every later exit scores
    only the K candidate rows (`ExitHead.local`). Probabilities are a softmax over the K local logits (`signals`).
    The candidates come from the first listed exit even when its threshold says "never".
  - full-*: a softmax over the whole vocabulary at every exit.
  - cosine: `transition_cosine` of decoder layer l's input and output (the last layer before the exit after
    layer l); the token is the exit's full-vocabulary top-1.
  - with trained heads, each exit's head sits before the frozen final norm + LM head (`ExitHead(adapter, head)`).

Tokens come from teacher-forced text (chunks, BOS first, as `eectl profile` reads it) and from the model's own
greedy, full-depth continuations of the data's prompts, encoded as `eectl run` encodes them (the chat template unless
`raw`): what the runner sees. The last `holdout` share of the chunks and of the prompts (each source apart) is held
out: thresholds are fitted on the rest and replayed on it, so the report puts realized agreement next to the target.
All hidden states are the full model's (every layer's KV exact); how far a KV policy moves them at run time is for
`eectl bench` to measure.

What this module does not do: fit thresholds (thresholds.py), define the file (calibration_file.py), run ONNX
Runtime, train heads, or choose where the exits are (see `eectl profile`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eectl.calibration_file import (
    Calibration,
    CandidatesInfo,
    ComparedSource,
    DataInfo,
    ExitResult,
    HeadsInfo,
    ModelInfo,
    OverallStats,
    SplitStats,
)
from eectl.data import encode_prompt
from eectl.errors import DataError, UsageError
from eectl.exits import (
    CANDIDATE_SOURCES,
    DEFAULT_CANDIDATES,
    DEFAULT_SHORTLIST,
    DEFAULT_SIGNAL,
    DEFAULT_TOP_K,
    CandidateSource,
    ExitHead,
    ExitScoring,
    TorchExitLogits,
    frequency_shortlist,
    get_signal,
    make_source,
)
from eectl.models.adapters import Adapter, Capture, KVCache
from eectl.plan import MAX_SUBSET, VERIFY_PRECISIONS, ExitOption, Option
from eectl.recipe import check_exit_layers
from eectl.thresholds import assign_exits, clopper_pearson_lower, fit_thresholds, min_tokens_for

SOURCES = ("teacher-forced", "generated")


@dataclass
class CalibrateOptions:
    exits: list[int]
    signal: str = DEFAULT_SIGNAL
    target: float = 0.99
    top_k: int = DEFAULT_TOP_K
    candidates: str = DEFAULT_CANDIDATES  # topk signals: the candidate source at the first exit (exits.py)
    shortlist: int = DEFAULT_SHORTLIST  # rows of the frequency-ranked shortlist
    tokens: int = 20000  # measured tokens, teacher-forced and generated together
    confidence: float | None = 0.95  # Clopper-Pearson confidence level; None: point estimate
    options: bool = True  # also fit every subset of up to MAX_SUBSET exits (the menu export's cost model picks from)
    compare: list[str] = field(default_factory=list)  # other candidate sources to measure on the same tokens
    holdout: float = 0.2  # share of chunks / prompts held out
    gen_share: float = 0.25  # share of the tokens that come from the model's own greedy continuations
    gen_tokens: int = 64  # continuation length per prompt (at most; a row ends at EOS)
    raw: bool = False  # feed prompts as is; default: the tokenizer's chat template, as `eectl run` does
    chunk_len: int = 256  # teacher-forced chunk length (BOS included)
    gen_batch: int = 16  # prompts generated together (left-padded)

    @property
    def generated_tokens(self) -> int:
        return round(self.tokens * self.gen_share)

    @property
    def text_tokens(self) -> int:
        return self.tokens - self.generated_tokens


def check_options(opts: CalibrateOptions, num_layers: int | None = None, vocab_size: int | None = None) -> None:
    """Raise UsageError / DataError for options that cannot work (the exits only once the model's depth is given)."""
    if not 0.0 < opts.target <= 1.0 or math.isnan(opts.target):
        raise UsageError(f"--target must be in (0, 1], got {opts.target}")
    signal = get_signal(opts.signal)
    if opts.confidence is not None:
        if not 0.0 < opts.confidence < 1.0 or math.isnan(opts.confidence):
            raise UsageError(f"--confidence must be in (0, 1), got {opts.confidence}")
        if opts.target >= 1.0:
            raise UsageError(
                "--target 1 cannot be guaranteed by a finite sample", hint="lower --target or drop --confidence"
            )
    if not 0.0 <= opts.holdout < 1.0 or math.isnan(opts.holdout):
        raise UsageError(f"--holdout must be in [0, 1), got {opts.holdout}")
    if not 0.0 <= opts.gen_share <= 1.0 or math.isnan(opts.gen_share):
        raise UsageError(f"--gen-share must be in [0, 1], got {opts.gen_share}")
    if opts.gen_tokens < 1:
        raise UsageError(f"--gen-tokens must be >= 1, got {opts.gen_tokens}")
    if opts.tokens <= 0:
        raise UsageError(f"--tokens must be positive, got {opts.tokens}")
    if opts.top_k < 2:
        raise UsageError(f"--top-k must be >= 2 (the margin needs two candidates), got {opts.top_k}")
    for name in [opts.candidates, *opts.compare]:
        if name not in CANDIDATE_SOURCES:
            raise UsageError(f"--candidates must be one of {', '.join(CANDIDATE_SOURCES)}, got '{name}'")
    if opts.shortlist < opts.top_k:
        raise UsageError(f"--shortlist ({opts.shortlist}) must be at least --top-k ({opts.top_k})")
    if not opts.exits and num_layers is not None:
        raise UsageError("no exits given", hint="pass --exits, e.g. --exits 8,12,16,20,24, or a --recipe with exits")
    check_exit_layers(opts.exits, num_layers)
    if vocab_size is not None and signal.needs_candidates and opts.top_k > vocab_size:
        raise UsageError(f"--top-k {opts.top_k} exceeds the vocabulary ({vocab_size})")
    if opts.confidence is not None:
        need = min_tokens_for(opts.target, opts.confidence)
        have = math.floor(opts.tokens * (1 - opts.holdout))
        if have < need:
            raise DataError(
                f"data too small for the requested guarantee: precision >= {opts.target} at confidence "
                f"{opts.confidence} needs at least {need} calibration tokens, --tokens {opts.tokens} with "
                f"--holdout {opts.holdout} gives about {have}",
                hint="raise --tokens, lower --target or --confidence",
            )


# ---------------------------------------------------------------------------------------------------------------
# Measuring: per token, per exit, the signal values and whether the exit's top-1 equals the final layer's
# ---------------------------------------------------------------------------------------------------------------


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

    @property
    def n(self) -> int:
        return int(self.source.numel())

    @staticmethod
    def concat(parts: Sequence[Measurements]) -> Measurements:
        first = parts[0]
        pv = pc = None
        if first.pair_values is not None:
            pv = {c: torch.cat([p.pair_values[c] for p in parts if p.pair_values], 2) for c in first.pair_values}
            pc = torch.cat([p.pair_correct for p in parts if p.pair_correct is not None], 2)
        return Measurements(
            exits=first.exits,
            num_layers=first.num_layers,
            values={c: torch.cat([p.values[c] for p in parts], 1) for c in first.values},
            correct=torch.cat([p.correct for p in parts], 1),
            source=torch.cat([p.source for p in parts]),
            unit=torch.cat([p.unit for p in parts]),
            pair_values=pv,
            pair_correct=pc,
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
        )

    def restrict(self, exits: Sequence[int]) -> Measurements:
        """The measurements a run with only these active exits sees (topk: candidates picked at the first)."""
        idx = [self.exits.index(e) for e in exits]
        if self.pair_values is not None and self.pair_correct is not None:
            f = idx[0]
            values = {c: v[f, idx] for c, v in self.pair_values.items()}
            correct = self.pair_correct[f, idx]
        else:
            values = {c: v[idx] for c, v in self.values.items()}
            correct = self.correct[idx]
        return Measurements(list(exits), self.num_layers, values, correct, self.source, self.unit)

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
        self.source = source or make_source("first-exit-topk", adapter.lm_head.weight)

    @property
    def needs_inputs(self) -> bool:
        return self.signal.needs_layer_input

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
        num, t = len(self.exits), final.shape[0]
        pv = {c: torch.zeros(num, num, t) for c in self.criteria}
        pc = torch.zeros(num, num, t, dtype=torch.bool)
        for c in self.criteria:
            pv[c][0] = values[c]
        pc[0] = correct
        for f in range(1, num):
            v, ok = self._scores(states, inputs, f, final_top, blocks)
            for c in self.criteria:
                pv[c][f, f:] = v[c]
            pc[f, f:] = ok
        return values, correct, final_top, pv, pc


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


def _forward_capture(
    scorer: ExitScorer,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache | None,
    key_padding: torch.Tensor | None,
    select: Callable[[torch.Tensor], torch.Tensor],
    block_caches: dict[int, KVCache] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None, torch.Tensor]:
    """All L layers on ids [B, S]; the selected positions' states at each exit (and the exit layer's input; with a
    signal that needs them, every block boundary of each exit's segment). A sequence head runs on the exit layer's
    whole output (its KV in `block_caches[layer]` when decoding)."""
    adapter = scorer.adapter
    blocks_needed = scorer.signal.needs_blocks
    after = range(1, scorer.exits[-1] + 1) if blocks_needed else scorer.exits  # every layer up to the last exit
    keep: Capture = Capture(after, inputs=scorer.needs_inputs or blocks_needed, select=select)
    if scorer.sequence_heads:
        keep = _SequenceHeadCapture(
            after,
            inputs=scorer.needs_inputs or blocks_needed,
            select=select,
            heads=scorer.sequence_heads,
            positions=positions,
            key_padding=key_padding,
            caches=None if cache is None else (block_caches if block_caches is not None else {}),
        )
    final = adapter.forward_layers(
        adapter.embed(ids), positions, 0, adapter.num_layers, cache, key_padding, capture=keep
    )
    states = [keep.states[layer] for layer in scorer.exits]
    inputs = [keep.layer_inputs[layer] for layer in scorer.exits] if scorer.needs_inputs else None
    blocks = None
    if blocks_needed:  # segment [lo, hi): the state after lo layers (the input of layer lo + 1), then after each
        bounds = zip([0, *scorer.exits], scorer.exits, strict=False)
        blocks = [
            torch.stack([keep.layer_inputs[lo + 1], *(keep.states[j] for j in range(lo + 1, hi + 1))])
            for lo, hi in bounds
        ]
    return states, inputs, blocks, select(final)


def _part(
    scorer: ExitScorer,
    scored: tuple[Any, ...],
    source: int,
    units: torch.Tensor,
) -> Measurements:
    values, correct, _, pv, pc = scored
    src = torch.full_like(units, source)
    return Measurements(scorer.exits, scorer.adapter.num_layers, values, correct, src, units, pv, pc)


@torch.no_grad()
def measure_text(
    scorer: ExitScorer,
    chunks: list[torch.Tensor],
    skip_first: int = 1,
    on_tokens: Callable[[int], None] | None = None,
    pairs: bool = False,
) -> Measurements | None:
    """Teacher-forced chunks [1, S]: every position from `skip_first` on is one measured token."""
    return _measure_text_all([scorer], chunks, skip_first, on_tokens, pairs)[0]


def _measure_text_all(
    scorers: Sequence[ExitScorer],
    chunks: list[torch.Tensor],
    skip_first: int,
    on_tokens: Callable[[int], None] | None,
    pairs: bool,
) -> list[Measurements | None]:
    """As `measure_text`, for several scorers (candidate sources, same exits) on the same states."""
    parts: list[list[Measurements]] = [[] for _ in scorers]
    for u, ids in enumerate(chunks):
        positions = torch.arange(ids.shape[1])[None]
        states, inputs, blocks, final = _forward_capture(
            scorers[0], ids, positions, None, None, lambda h: h[0, skip_first:]
        )
        units = torch.full((final.shape[0],), u, dtype=torch.long)
        for j, sc in enumerate(scorers):
            parts[j].append(_part(sc, sc.score_pairs(states, inputs, final, pairs, blocks), 0, units))
        if on_tokens is not None:
            on_tokens(final.shape[0])
    return [Measurements.concat(p) if p else None for p in parts]


@dataclass
class Continuation:
    unit: int  # the prompt's index
    prompt: list[int]
    generated: list[int]  # greedy full-depth tokens (the last may be EOS)


def prompt_batches(prompts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    """Indices of `prompts` in batches: the given order, but sorted by length within windows of four batches, so
    that prompts of similar length share a batch (less left padding)."""
    window = 4 * batch_size
    batches: list[list[int]] = []
    for w in range(0, len(prompts), window):
        idx = sorted(range(w, min(w + window, len(prompts))), key=lambda i: len(prompts[i]))
        batches += [idx[j : j + batch_size] for j in range(0, len(idx), batch_size)]
    return batches


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
    batch_size: int = 16,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[list[Continuation], int]:
    """Greedy full-depth continuations of prompts (token ids, BOS included), `gen_tokens` each, a row stopping at
    EOS, until `n_tokens` tokens are generated (the last continuation is cut to make it exact). Prompts are batched
    with left padding. Returns the continuations (in generation order) and the number of prompts used."""
    out: list[Continuation] = []
    measured = used = 0
    for members in prompt_batches(prompts, batch_size):
        if measured >= n_tokens:
            break
        batch = [prompts[i] for i in members]
        used += len(batch)
        b = len(batch)
        ids, pad, positions = left_padded(batch)
        cache, alive = KVCache(), torch.ones(b, dtype=torch.bool)
        gen: list[list[int]] = [[] for _ in range(b)]
        for _ in range(gen_tokens):
            rows = alive.clone()
            final = adapter.forward_layers(adapter.embed(ids), positions, 0, adapter.num_layers, cache, pad)
            top = adapter.logits(final[:, -1]).argmax(-1)
            for r in torch.nonzero(rows).flatten().tolist():
                gen[r].append(int(top[r]))
            if on_tokens is not None:
                on_tokens(min(int(rows.sum()), n_tokens - measured))
            measured += int(rows.sum())
            nxt = torch.full((b,), eos if eos is not None else 0, dtype=torch.long)
            nxt[rows] = top[rows]
            alive = rows if eos is None else rows & (nxt != eos)
            if not bool(alive.any()) or measured >= n_tokens:
                break
            ids, positions = nxt[:, None], positions[:, -1:] + 1
            pad = torch.cat([pad, torch.ones(b, 1, dtype=torch.bool)], 1)
        out += [Continuation(members[r], batch[r], gen[r]) for r in range(b) if gen[r]]
    over = sum(len(c.generated) for c in out) - n_tokens
    while over > 0 and out:  # cut the latest continuations to exactly n_tokens
        cut = min(over, len(out[-1].generated))
        out[-1].generated = out[-1].generated[: len(out[-1].generated) - cut]
        over -= cut
        if not out[-1].generated:
            out.pop()
    return out, used


@torch.no_grad()
def measure_sequences(
    scorer: ExitScorer, conts: list[Continuation], batch_size: int = 16, pairs: bool = False
) -> Measurements | None:
    """Teacher-forced prompt + continuation: position P-1+j (its final top-1 is generated token j) is one measured
    token, unit = the prompt's index. The same states as generating step by step, computed in one pass."""
    return _measure_sequences_all([scorer], conts, batch_size, pairs)[0]


def _measure_sequences_all(
    scorers: Sequence[ExitScorer], conts: list[Continuation], batch_size: int, pairs: bool
) -> list[Measurements | None]:
    """As `measure_sequences`, for several scorers (candidate sources, same exits) on the same states."""
    parts: list[list[Measurements]] = [[] for _ in scorers]
    for i in range(0, len(conts), batch_size):
        batch = conts[i : i + batch_size]
        seqs = [c.prompt + c.generated[:-1] for c in batch]
        ids, real, positions = left_padded(seqs)
        width = ids.shape[1]
        rows = torch.cat([torch.full((len(c.generated),), r, dtype=torch.long) for r, c in enumerate(batch)])
        cols = torch.cat(
            [
                torch.arange(len(c.generated)) + width - len(seq) + len(c.prompt) - 1
                for c, seq in zip(batch, seqs, strict=True)
            ]
        )

        def select(h: torch.Tensor, rows: torch.Tensor = rows, cols: torch.Tensor = cols) -> torch.Tensor:
            return h[rows, cols]

        states, inputs, blocks, final = _forward_capture(scorers[0], ids, positions, KVCache(), real, select)
        units = torch.tensor([c.unit for c in batch], dtype=torch.long)[rows]
        for j, sc in enumerate(scorers):
            parts[j].append(_part(sc, sc.score_pairs(states, inputs, final, pairs, blocks), 1, units))
    return [Measurements.concat(p) if p else None for p in parts]


def measure_generation(
    scorer: ExitScorer,
    prompts: list[list[int]],
    n_tokens: int,
    gen_tokens: int,
    eos: int | None,
    batch_size: int = 16,
    on_tokens: Callable[[int], None] | None = None,
) -> tuple[Measurements | None, int]:
    """Greedy continuations (`generate_continuations`), then measured teacher-forced (`measure_sequences`).
    Returns the first `n_tokens` measured tokens and the number of prompts used."""
    conts, used = generate_continuations(scorer.adapter, prompts, n_tokens, gen_tokens, eos, batch_size, on_tokens)
    return measure_sequences(scorer, conts, batch_size), used


# ---------------------------------------------------------------------------------------------------------------
# Sequential thresholds and their report
# ---------------------------------------------------------------------------------------------------------------


def _rate(num: int, den: int) -> float | None:
    return num / den if den else None


def evaluate(
    meas: Measurements, thresholds: list[dict[str, float]], mask: torch.Tensor, level: float | None = None
) -> tuple[list[SplitStats], OverallStats]:
    """Replay the sequential rule on the masked tokens: per-exit and overall numbers."""
    taken = assign_exits(meas.values, thresholds)[mask]
    correct = meas.correct[:, mask]
    n, num_exits, L = int(mask.sum()), len(meas.exits), meas.num_layers
    per_exit: list[SplitStats] = []
    hits_all = exited_all = 0
    for e in range(num_exits):
        here = taken == e
        exited, hits = int(here.sum()), int((here & correct[e]).sum())
        hits_all, exited_all = hits_all + hits, exited_all + exited
        bound = None if level is None or not exited else float(clopper_pearson_lower(hits, exited, level))
        per_exit.append(
            SplitStats(
                reached=int((taken >= e).sum()),
                exited=exited,
                coverage=exited / n if n else 0.0,
                precision=_rate(hits, exited),
                lower_bound=bound,
            )
        )
    layers = torch.tensor([*meas.exits, L], dtype=torch.float64)[taken]
    mean_layers = float(layers.mean()) if n else float(L)
    overall = OverallStats(
        tokens=n,
        exited=exited_all,
        exit_rate=exited_all / n if n else 0.0,
        precision=_rate(hits_all, exited_all),
        agreement=(n - exited_all + hits_all) / n if n else 1.0,
        mean_layers=mean_layers,
        speedup_bound=L / mean_layers,
    )
    return per_exit, overall


@dataclass
class Fit:
    thresholds: list[dict[str, float]]
    exits: list[ExitResult]
    calibration: OverallStats
    heldout: OverallStats | None
    heldout_by_source: dict[str, OverallStats]


def fit(
    meas: Measurements,
    target: float,
    confidence: float | None = None,
    holdout: float = 0.2,
    heads: Sequence[int] = (),
) -> Fit:
    """Fit on the calibration split, replay on the held-out split; DataError when the split is too small."""
    held = meas.heldout_mask(holdout)
    calib = ~held
    n_calib = int(calib.sum())
    if n_calib == 0:
        raise DataError("no calibration tokens", hint="raise --tokens")
    need = min_tokens_for(target, confidence) if confidence is not None else 1
    if n_calib < need:
        raise DataError(
            f"data too small for the requested guarantee: precision >= {target} at confidence {confidence} needs "
            f"at least {need} calibration tokens, got {n_calib}",
            hint="raise --tokens, lower --target or --confidence",
        )
    thresholds = fit_thresholds(meas.values, meas.correct, target, confidence, calib)
    cal_exits, cal_overall = evaluate(meas, thresholds, calib, confidence)
    held_exits: list[SplitStats | None] = [None] * len(meas.exits)
    held_overall = None
    by_source: dict[str, OverallStats] = {}
    if bool(held.any()):
        got, held_overall = evaluate(meas, thresholds, held, confidence)
        held_exits = list(got)
        for s, name in enumerate(SOURCES):
            part = held & (meas.source == s)
            if bool(part.any()):
                by_source[name] = evaluate(meas, thresholds, part)[1]
    exits: list[ExitResult] = []
    for e, layer in enumerate(meas.exits):
        thr = thresholds[e]
        note = None
        if all(math.isinf(t) for t in thr.values()):
            reached = cal_exits[e].reached
            if confidence is not None and reached < need:
                note = f"never exits: {reached} tokens reach it, the guarantee needs at least {need}"
            else:
                note = "never exits: no threshold reaches the target"
        exits.append(
            ExitResult(
                layer=layer,
                head=layer in heads,
                thresholds=thr,
                calibration=cal_exits[e],
                heldout=held_exits[e],
                note=note,
            )
        )
    return Fit(thresholds, exits, cal_overall, held_overall, by_source)


# ---------------------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer: Any, prompts: Sequence[str], max_len: int, raw: bool = False) -> list[list[int]]:
    """Each prompt encoded as the runner does (`encode_prompt`), last record first, keeping the last max_len tokens."""
    out = [encode_prompt(tokenizer, text, raw)[-max_len:] for text in reversed(prompts)]
    return [ids for ids in out if ids]


@dataclass
class Collected:
    """What one pass over the data measured; `summarise` turns it into a Calibration for any target."""

    meas: Measurements
    prompts_used: int
    chat_template: bool  # the prompts went through the tokenizer's chat template
    wall_s: float
    candidates: dict[str, Any] = field(default_factory=lambda: {"name": "full"})  # the candidate source
    shortlist: torch.Tensor | None = None  # its token ids (shortlist source), most frequent first
    compared: dict[str, Measurements] = field(default_factory=dict)  # other sources on the same tokens


@torch.no_grad()
def collect(
    loaded: Any,
    data: Any,
    opts: CalibrateOptions,
    heads: dict[int, nn.Module] | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> Collected:
    """Measure every exit's signals on `opts.tokens` tokens: teacher-forced chunks and greedy continuations.

    The continuations are generated first, because the shortlist candidate source is ranked on the calibration
    split's tokens: the text's and the model's own generations (never the held-out units')."""
    from eectl.data import TextData, token_chunks
    from eectl.models.loading import LoadedModel

    assert isinstance(loaded, LoadedModel) and isinstance(data, TextData)
    adapter = loaded.adapter
    dims = adapter.dims
    opts.exits = sorted(opts.exits)
    check_options(opts, dims.num_layers, dims.vocab_size)
    tok: Any = loaded.tokenizer
    start = time.perf_counter()
    chunks: list[torch.Tensor] = []
    if opts.text_tokens > 0:
        chunks = token_chunks(tok, data, opts.text_tokens, opts.chunk_len)
    prompts_used = 0
    conts: list[Continuation] = []
    if opts.generated_tokens > 0:
        max_prompt = max(8, min(dims.max_positions, 4096) - opts.gen_tokens - 1)
        prompts = prompt_ids(tok, data.prompts, max_prompt, opts.raw)
        eos = getattr(tok, "eos_token_id", None)
        conts, prompts_used = generate_continuations(
            adapter, prompts, opts.generated_tokens, opts.gen_tokens, eos, opts.gen_batch, on_tokens
        )
        got = sum(len(c.generated) for c in conts)
        if got < opts.generated_tokens:
            raise DataError(
                f"the data's {len(prompts)} prompts gave only {got} generated tokens, fewer than the "
                f"{opts.generated_tokens} asked for",
                hint="lower --gen-share or --tokens, or raise --gen-tokens",
            )
    shortlist = None
    topk = get_signal(opts.signal).needs_candidates
    if topk and opts.candidates == "shortlist":
        shortlist = frequency_shortlist(
            _calibration_tokens(chunks, conts, opts.holdout), opts.shortlist, dims.vocab_size
        )
    source = make_source(opts.candidates if topk else "first-exit-topk", adapter.lm_head.weight, shortlist)
    described = source.describe()
    if shortlist is not None:  # how often a held-out token is one the shortlist can predict at all
        held_ids = _calibration_tokens(chunks, conts, opts.holdout, held=True)
        inside = torch.isin(held_ids, shortlist)
        described["heldout_hit_rate"] = float(inside.float().mean()) if held_ids.numel() else None
    scorer = ExitScorer(adapter, opts.exits, opts.signal, opts.top_k, heads, source)
    # other candidate sources scored on the same states: a comparison for the report (fitted, never exported)
    others = [o for o in (opts.compare if topk else []) if o != opts.candidates]
    scorers = [scorer] + [
        ExitScorer(
            adapter, opts.exits, opts.signal, opts.top_k, heads, make_source(o, adapter.lm_head.weight, shortlist)
        )
        for o in others
    ]
    pairs = topk and opts.options
    parts: list[list[Measurements]] = [[] for _ in scorers]
    if chunks:
        skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
        for j, measured in enumerate(_measure_text_all(scorers, chunks, skip_first, on_tokens, pairs)):
            if measured is not None:
                parts[j].append(measured)
    if conts:
        for j, measured in enumerate(_measure_sequences_all(scorers, conts, opts.gen_batch, pairs)):
            assert measured is not None
            parts[j].append(measured)
    chat = not opts.raw and bool(getattr(tok, "chat_template", None))
    return Collected(
        Measurements.concat(parts[0]),
        prompts_used,
        chat,
        time.perf_counter() - start,
        described,
        shortlist,
        {o: Measurements.concat(p) for o, p in zip(others, parts[1:], strict=True)},
    )


def _calibration_tokens(
    chunks: list[torch.Tensor], conts: list[Continuation], holdout: float, held: bool = False
) -> torch.Tensor:
    """The token ids of the calibration split (or, with `held`, of the held-out split): text chunks and
    continuations."""
    held_text = set(heldout_units(torch.arange(len(chunks)), holdout).tolist())
    units = torch.unique(torch.tensor([c.unit for c in conts], dtype=torch.long))
    held_gen = set(heldout_units(units, holdout).tolist())
    ids = [c[0] for u, c in enumerate(chunks) if (u in held_text) == held]
    ids += [torch.tensor(c.generated, dtype=torch.long) for c in conts if (c.unit in held_gen) == held]
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)


MIN_JUDGE_TOKENS = 500  # held-out generated tokens needed to judge the menu on them alone


def options_judge(meas: Measurements, holdout: float) -> torch.Tensor:
    """The tokens the menu's coverage is measured on: the held-out GENERATED tokens when there are enough (what
    `eectl run` decodes; teacher-forced text exits several times less often), else all held-out tokens, else all."""
    held = meas.heldout_mask(holdout)
    generated = held & (meas.source == SOURCES.index("generated"))
    if int(generated.sum()) >= MIN_JUDGE_TOKENS:
        return generated
    return held if bool(held.any()) else ~held


def fit_options(
    meas: Measurements, target: float, confidence: float | None, holdout: float, max_subset: int = MAX_SUBSET
) -> list[Option]:
    """The menu for the cost model (plan.py): every subset of up to `max_subset` exits, fitted sequentially on the
    calibration split at the fidelity target (kind "target", with `confidence`) and at each of verify's precisions
    (kind "verify", point estimates: verify is lossless, its threshold only trades drafts for rollbacks), with the
    coverage and precision per exit on `options_judge`'s tokens. Options where an exit never exits are left out
    (a smaller subset without it is on the menu and is cheaper)."""
    from itertools import combinations

    held = meas.heldout_mask(holdout)
    calib = ~held
    judge = options_judge(meas, holdout)
    fits: list[tuple[str, float, float | None]] = [("target", target, confidence)]
    fits += [("verify", q, None) for q in VERIFY_PRECISIONS]
    out: list[Option] = []
    for size in range(1, min(max_subset, len(meas.exits)) + 1):
        for subset in combinations(meas.exits, size):
            sub = meas.restrict(subset)
            for kind, q, level in fits:
                thresholds = fit_thresholds(sub.values, sub.correct, q, level, calib)
                if any(all(math.isinf(v) for v in t.values()) for t in thresholds):
                    continue
                per_exit, overall = evaluate(sub, thresholds, judge)
                out.append(
                    Option(
                        exits=list(subset),
                        kind=kind,
                        target=q,
                        confidence=level,
                        per_exit=[
                            ExitOption(layer=layer, thresholds=t, coverage=st.coverage, precision=st.precision)
                            for layer, t, st in zip(subset, thresholds, per_exit, strict=True)
                        ],
                        agreement=overall.agreement,
                    )
                )
    return out


def summarise(
    loaded: Any,
    data: Any,
    opts: CalibrateOptions,
    collected: Collected,
    heads: dict[int, nn.Module] | None = None,
    heads_path: str | Path | None = None,
) -> Calibration:
    """Fit the thresholds for `opts.target` / `opts.confidence` on collected measurements; a validated Calibration."""
    from eectl.files import sha256_file

    start = time.perf_counter()
    meas = collected.meas
    result = fit(meas, opts.target, opts.confidence, opts.holdout, sorted(heads or {}))
    signal = get_signal(opts.signal)
    if signal.needs_candidates and result.exits[0].calibration.exited == 0 and len(result.exits) > 1:
        first = result.exits[0]
        first.note = (first.note or "never exits") + (
            "; the candidate source still runs here when it is the first active exit (export's cost model "
            "leaves it out unless it pays)"
        )
    wall = collected.wall_s + time.perf_counter() - start
    held = meas.heldout_mask(opts.holdout)
    source = loaded.source.to_dict()
    adapter = loaded.adapter
    return Calibration(
        model=ModelInfo(
            name=str(source["name"]),
            kind=str(source["kind"]),
            spec=str(source["spec"]),
            path=None if source["path"] in (None, "None") else str(source["path"]),
            sha256=str(source["sha256"]),
            family=adapter.family,
            num_layers=adapter.num_layers,
        ),
        data=DataInfo(
            name=data.name,
            description=data.description,
            records=len(data.texts),
            tokens=meas.n,
            teacher_forced_tokens=int((meas.source == 0).sum()),
            generated_tokens=int((meas.source == 1).sum()),
            prompts_used=collected.prompts_used,
            chat_template=collected.chat_template,
            gen_tokens_per_prompt=opts.gen_tokens,
            chunk_len=opts.chunk_len,
            holdout=opts.holdout,
            calibration_tokens=int((~held).sum()),
            heldout_tokens=int(held.sum()),
        ),
        signal=opts.signal,
        criteria=list(signal.criteria),
        top_k=opts.top_k if signal.needs_candidates else None,
        candidates_layer=opts.exits[0] if signal.needs_candidates else None,
        candidates=CandidatesInfo(
            name=str(collected.candidates["name"]),
            size=None if collected.shortlist is None else int(collected.shortlist.numel()),
            heldout_hit_rate=collected.candidates.get("heldout_hit_rate"),
            ids=None if collected.shortlist is None else [int(i) for i in collected.shortlist],
        )
        if signal.needs_candidates
        else None,
        options=fit_options(meas, opts.target, opts.confidence, opts.holdout) if opts.options else [],
        options_judged_on=int(options_judge(meas, opts.holdout).sum()) if opts.options else 0,
        compared={name: _compared(m, opts, heads) for name, m in collected.compared.items()},
        target=opts.target,
        confidence=opts.confidence,
        heads=None
        if heads_path is None
        else HeadsInfo(path=str(heads_path), sha256=sha256_file(heads_path), layers=sorted(heads or {})),
        exits=result.exits,
        calibration=result.calibration,
        heldout=result.heldout,
        heldout_by_source=result.heldout_by_source,
        threads=torch.get_num_threads(),
        wall_s=wall,
        seconds_per_10k_tokens=wall / max(1, meas.n) * 10_000,
    )


def _compared(meas: Measurements, opts: CalibrateOptions, heads: dict[int, nn.Module] | None) -> ComparedSource:
    result = fit(meas, opts.target, opts.confidence, opts.holdout, sorted(heads or {}))
    options = fit_options(meas, opts.target, opts.confidence, opts.holdout) if opts.options else []
    return ComparedSource(exits=result.exits, calibration=result.calibration, heldout=result.heldout, options=options)


def calibrate_model(
    loaded: Any,
    data: Any,
    opts: CalibrateOptions,
    heads: dict[int, nn.Module] | None = None,
    heads_path: str | Path | None = None,
    on_tokens: Callable[[int], None] | None = None,
) -> Calibration:
    """The stage as a library call: a LoadedModel, TextData and options in; a validated Calibration out."""
    return summarise(loaded, data, opts, collect(loaded, data, opts, heads, on_tokens), heads, heads_path)
