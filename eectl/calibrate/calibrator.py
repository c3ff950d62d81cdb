"""`eectl calibrate`: per-exit thresholds so that exiting tokens agree with the full model at a stated rate.

The decision rule is the runner's, and calibration follows it SEQUENTIALLY:

    for each exit l in ascending order:       (an exit "after layer l" reads the state after l decoder layers)
        if every criterion c of the signal has value_c(l) >= threshold_c(l):  exit here with the exit's top-1
    otherwise run all L layers

so exit l is calibrated only on the tokens that no earlier exit took. Per exit, FlexEE's
lambda*_l = min{ lambda : P(top1_l == top1_final | value_l >= lambda) >= target } on those tokens
with `confidence` the Clopper-Pearson lower bound on that precision must reach the target instead. The statistics
and the sequential fit live in eectl.exits.thresholds; the calibration.json schema in eectl.contracts.calibration.

Signals are scored by eectl.exits.signals (`ExitScoring`, the path the runner takes too) on `ExitHead`, the code export
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

Gates (eectl.exits.gates): with `gate_keep` > 0, each exit also gets a logistic gate on its input state, fitted on the
calibration split, and every menu option also comes gated (the decision runs only where the gate opens; candidates
picked at the first open gate; thresholds refitted on that replay): export's cost model chooses between them.

Where things live: measuring (exits/measure.py), the fit and the menu (calibrate/fit.py; the statistics in
exits/thresholds.py); this module holds the options, the pass over the data (`collect`) and the Calibration it becomes.

What this module does not do: define the file (contracts/calibration.py), run ONNX Runtime, train heads, or choose where
the exits are (see `eectl profile`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eectl.calibrate.ahead import ahead_traces
from eectl.calibrate.fit import fit, fit_gates, fit_options, options_judge
from eectl.contracts.budgets import CALIBRATE_GEN_SHARE
from eectl.contracts.calibration import (
    AheadTraces,
    Calibration,
    CandidatesInfo,
    ComparedSource,
    DataInfo,
    HeadsInfo,
    ModelInfo,
)
from eectl.contracts.gates import DEFAULT_GATE_KEEP, Gate
from eectl.contracts.layers import check_exit_layers
from eectl.contracts.plan import LookupStats
from eectl.errors import DataError, UsageError
from eectl.exits.base import DEFAULT_TOP_K
from eectl.exits.candidates import (
    CANDIDATE_SOURCES,
    DEFAULT_CANDIDATES,
    DEFAULT_SHORTLIST,
    Shortlist,
    frequency_shortlist,
    make_source,
)
from eectl.exits.generation import Continuation, generate_continuations, prompt_ids
from eectl.exits.measure import (
    ExitScorer,
    Measurements,
    generation_keep,
    heldout_units,
    measure_kept_all,
    measure_text_all,
)
from eectl.exits.signals import DEFAULT_SIGNAL, get_signal
from eectl.exits.thresholds import min_tokens_for
from eectl.runtime.drafts import LONGEST_RUNS, SHORTEST_RUNS, lookup_stats


@dataclass
class CalibrateOptions:
    exits: list[int]
    signal: str = DEFAULT_SIGNAL
    target: float = 0.99
    top_k: int = DEFAULT_TOP_K
    candidates: str = DEFAULT_CANDIDATES  # topk signals: the candidate source at the first exit (exits/candidates.py)
    shortlist: int = DEFAULT_SHORTLIST  # rows of the frequency-ranked shortlist
    tokens: int = 20000  # measured tokens, teacher-forced and generated together
    confidence: float | None = 0.95  # Clopper-Pearson confidence level; None: point estimate
    options: bool = True  # also fit every subset of up to MAX_SUBSET exits (the menu export's cost model picks from)
    compare: list[str] = field(default_factory=list)  # other candidate sources to measure on the same tokens
    holdout: float = 0.2  # share of chunks / prompts held out
    gen_share: float = CALIBRATE_GEN_SHARE  # share of the tokens that come from the model's own greedy continuations
    gen_tokens: int = 64  # continuation length per prompt (at most; a row ends at EOS)
    raw: bool = False  # feed prompts as is; default: the tokenizer's chat template, as `eectl run` does
    chunk_len: int = 256  # teacher-forced chunk length (BOS included)
    gen_batch: int = 64  # prompts generated together (left-padded): speed only, never which tokens are measured
    # the menu's gated options (eectl.exits.gates): the share of each option's passing decisions its gates keep; 0: no
    # gates
    gate_keep: float = DEFAULT_GATE_KEEP

    @property
    def generated_tokens(self) -> int:
        return round(self.tokens * self.gen_share)

    @property
    def text_tokens(self) -> int:
        return self.tokens - self.generated_tokens


def check_options(opts: CalibrateOptions, num_layers: int | None = None, vocab_size: int | None = None) -> None:
    """Raise UsageError / DataError for options that cannot work (the exits only once the model's depth is given):
    check_settings, then check_sample."""
    check_settings(opts, num_layers, vocab_size)
    check_sample(opts)


def check_settings(opts: CalibrateOptions, num_layers: int | None = None, vocab_size: int | None = None) -> None:
    """UsageError for settings that cannot work, whatever the data (the exits only once the model's depth is
    given)."""
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
    if not 0.0 <= opts.gate_keep <= 1.0 or math.isnan(opts.gate_keep):
        raise UsageError(f"--gate-keep must be in [0, 1] (0: no gates), got {opts.gate_keep}")
    if opts.gen_batch < 1:
        raise UsageError(f"--gen-batch must be >= 1, got {opts.gen_batch}")
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


def check_sample(opts: CalibrateOptions) -> None:
    """DataError when --tokens cannot carry the guarantee asked for (--confidence). The calibrate stage checks it
    once the data has loaded: a missing, empty or textless data file is named first, not hidden behind it."""
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
    lookup: LookupStats | None = None  # drafts from the context replayed on the continuations
    gen_s: float = 0.0  # of wall_s, generating the continuations (decode steps: eectl/phases.py)
    ahead: AheadTraces | None = None  # verify drafting ahead traced on the continuations (calibrate/ahead.py)


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
    topk = get_signal(opts.signal).needs_candidates
    t_gen = time.perf_counter()
    conts, prompts_used, lookup = _continuations(adapter, tok, data, opts, heads, on_tokens)
    gen_s = time.perf_counter() - t_gen
    shortlist = None
    if topk and isinstance(CANDIDATE_SOURCES.get(opts.candidates), Shortlist):  # ranked here, on calibration units
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
    ahead = ahead_traces(scorer, conts) if conts else None  # on the states the generation kept
    states = opts.options and opts.gate_keep > 0  # the exits' states, for fitting gates (then dropped)
    parts: list[list[Measurements]] = [[] for _ in scorers]
    if chunks:
        skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
        for j, measured in enumerate(measure_text_all(scorers, chunks, skip_first, on_tokens, pairs, states)):
            if measured is not None:
                parts[j].append(measured)
    if conts:
        for j, measured in enumerate(measure_kept_all(scorers, conts, pairs, keep_states=states)):
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
        lookup,
        gen_s,
        ahead,
    )


def _continuations(
    adapter: Any,
    tok: Any,
    data: Any,
    opts: CalibrateOptions,
    heads: dict[int, nn.Module] | None,
    on_tokens: Callable[[int], None] | None,
) -> tuple[list[Continuation], int, LookupStats | None]:
    """The greedy full-depth continuations calibration measures (none when opts.generated_tokens is 0), with the
    prompts they used and the drafts from the context replayed on them."""
    if opts.generated_tokens <= 0:
        return [], 0, None
    dims = adapter.dims
    max_prompt = max(8, min(dims.max_positions, 4096) - opts.gen_tokens - 1)
    prompts = prompt_ids(tok, data.prompts, max_prompt, opts.raw)
    eos = getattr(tok, "eos_token_id", None)
    # the generation keeps the states the scorers read at the measured positions (candidate sources read the
    # same states): no second base pass over prompt + continuation
    keep = generation_keep(ExitScorer(adapter, opts.exits, opts.signal, opts.top_k, heads))
    conts, prompts_used = generate_continuations(
        adapter, prompts, opts.generated_tokens, opts.gen_tokens, eos, opts.gen_batch, on_tokens, keep
    )
    got = sum(len(c.generated) for c in conts)
    if got < opts.generated_tokens:
        raise DataError(
            f"the data's {len(prompts)} prompts gave only {got} generated tokens, fewer than the "
            f"{opts.generated_tokens} asked for",
            hint="lower --gen-share or --tokens, or raise --gen-tokens",
        )
    # what verify with drafts from the context would do on these prompts: its output is these continuations
    pairs, stops = [(c.prompt, c.generated) for c in conts], (eos,) if eos is not None else ()
    lookup = lookup_stats(pairs, stop_ids=stops)
    # and with the shortest runs proposed longer (where a wide pass costs what a step does, short runs cannot pay),
    # or the longest shorter (where each drafted position costs much and the drafts hold for a few tokens)
    lookup.shortest = [
        *(lookup_stats(pairs, stop_ids=stops, min_draft=d) for d in SHORTEST_RUNS),
        *(lookup_stats(pairs, max_draft=n, stop_ids=stops) for n in LONGEST_RUNS),
    ]
    return conts, prompts_used, lookup


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
    gates: dict[int, Gate] = {}
    if meas.hidden is not None and opts.options and opts.gate_keep > 0:
        gates, meas = fit_gates(meas, opts.target, opts.confidence, opts.holdout)
    result = fit(meas, opts.target, opts.confidence, opts.holdout, sorted(heads or {}))
    signal = get_signal(opts.signal)
    if signal.needs_candidates and result.exits[0].calibration.exited == 0 and len(result.exits) > 1:
        first = result.exits[0]
        first.note = (first.note or "never exits") + (
            "; the candidate source still runs here when it is the first active exit (export's cost model "
            "leaves it out unless it pays)"
        )
    wall = collected.wall_s + time.perf_counter() - start
    return Calibration(
        model=_model_info(loaded),
        data=_data_info(data, meas, opts, collected),
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
        options=fit_options(meas, opts.target, opts.confidence, opts.holdout, gate_keep=opts.gate_keep)
        if opts.options
        else [],
        gates={str(layer): g for layer, g in gates.items()},
        gate_keep=opts.gate_keep if gates else None,
        lookup=collected.lookup,
        ahead=collected.ahead,
        options_judged_on=int(options_judge(meas).sum()) if opts.options else 0,
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
        device=next(loaded.model.parameters()).device.type,
        wall_s=wall,
        seconds_per_10k_tokens=wall / max(1, meas.n) * 10_000,
    )


def _model_info(loaded: Any) -> ModelInfo:
    """The calibrated model as the calibration file names it: its source and its family's layer count."""
    source = loaded.source.to_dict()
    adapter = loaded.adapter
    return ModelInfo(
        name=str(source["name"]),
        kind=str(source["kind"]),
        spec=str(source["spec"]),
        path=None if source["path"] in (None, "None") else str(source["path"]),
        sha256=str(source["sha256"]),
        family=adapter.family,
        num_layers=adapter.num_layers,
    )


def _data_info(data: Any, meas: Measurements, opts: CalibrateOptions, collected: Collected) -> DataInfo:
    """What the thresholds were fitted on: the data, its tokens by source and the calibration / held-out split."""
    held = meas.heldout_mask(opts.holdout)
    return DataInfo(
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
