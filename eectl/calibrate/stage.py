"""The calibrate stage (per-token thresholds) as one library call: a recipe and a request in, the calibration file
written and its contents out.

What `eectl calibrate` and the pipeline both run. A request's None fields take the recipe's values; the caller has
set up the thread pools (cli.app.set_threads). What this module does not do: print results, or certify a sequence
guarantee on an artifact (calibrate/sequence.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eectl.calibrate.calibrator import CalibrateOptions
from eectl.contracts.calibration import Calibration
from eectl.contracts.gates import DEFAULT_GATE_KEEP
from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.exits.candidates import DEFAULT_CANDIDATES, DEFAULT_SHORTLIST
from eectl.files import check_outputs, existing_file, input_file
from eectl.output import Output


@dataclass
class CalibrateRequest:
    model: str | None = None  # None: the recipe's
    data: str | None = None
    field: str | None = None
    tokens: int | None = None  # teacher-forced and generated together
    target: float | None = None
    exits: list[int] | None = None  # None: the recipe's, else the model's default_exits
    signal: str | None = None  # None: the recipe's, else learned with probed heads, else topk-prob
    top_k: int | None = None
    heads: Path | None = None  # trained exit heads: exits use them
    confidence: float | None = 0.95  # Clopper-Pearson level; None: point estimate
    candidates: str = DEFAULT_CANDIDATES
    shortlist: int = DEFAULT_SHORTLIST
    compare: list[str] = dataclasses.field(default_factory=list)  # other candidate sources measured beside
    holdout: float = 0.2
    gen_share: float = 0.25
    gen_tokens: int = 64
    gen_batch: int = 64
    raw: bool = False
    gate_keep: float = DEFAULT_GATE_KEEP
    out: Path | None = None  # None: artifacts/<model>-calibration.json
    recipe_file: Path | None = None  # the recipe's file: an input no output may land on
    threads: int | None = None  # the thread count set up by the caller (reported)


@dataclass
class CalibrateResult:
    calibration: Calibration
    path: Path  # where it was written


def calibrate(recipe: Recipe, req: CalibrateRequest, out: Output) -> CalibrateResult:
    """Per-exit thresholds measured on the recipe's model and data, written as a calibration file."""
    from eectl.calibrate.calibrator import calibrate_model, check_options
    from eectl.contracts.calibration import write_calibration
    from eectl.contracts.layers import default_exits
    from eectl.data import load_text_data
    from eectl.exits.signals import DEFAULT_SIGNAL, choose_signal
    from eectl.models import load_model

    r = recipe
    opts = options(r, req)
    opts.signal = pick(req.signal, r.signal) or DEFAULT_SIGNAL  # checked here; chosen with the heads below
    check_options(opts)
    if req.heads is not None:
        existing_file(req.heads, "heads", UsageError, hint="train them with eectl train-heads")
    src = pick(req.data, r.data.source)
    ins = [("--data", input_file(src)), ("--heads", req.heads), ("--recipe", input_file(req.recipe_file))]
    check_outputs([("--out", req.out, [])], ins)
    text = load_text_data(src, pick(req.field, r.data.field))
    out.log(f"loading {pick(req.model, r.model) or 'the default model (SmolLM2-135M-Instruct)'}")
    loaded = load_model(pick(req.model, r.model), log=out)
    opts.exits = opts.exits or default_exits(loaded.adapter.num_layers)
    head_modules = None
    if req.heads is not None:
        from eectl.exits.designs import load_heads

        head_modules = dict(load_heads(req.heads, loaded).heads)  # checks the heads were trained on this checkpoint
    opts.signal = choose_signal(pick(req.signal, r.signal), head_modules, opts.exits)
    check_options(opts, loaded.adapter.num_layers, loaded.adapter.dims.vocab_size)
    path = req.out or Path("artifacts") / f"{loaded.source.name}-calibration.json"
    check_outputs([("--out", path, [])], ins)
    out.log(
        f"calibrating exits {opts.exits} on {opts.tokens} tokens of {text.name} ({opts.text_tokens} teacher-forced, "
        f"{opts.generated_tokens} generated), signal {opts.signal}, target {opts.target}, {req.threads} threads"
    )
    with out.progress("calibrate", total=opts.tokens) as bar:
        result = calibrate_model(loaded, text, opts, head_modules, req.heads, on_tokens=lambda n: bar.advance(n))
    write_calibration(result, path)
    return CalibrateResult(result, path)


def options(r: Recipe, req: CalibrateRequest) -> CalibrateOptions:
    """The calibrator's options: the request over the recipe (the signal is chosen once the heads are loaded)."""
    return CalibrateOptions(
        exits=pick(req.exits, r.exits or []),
        target=pick(req.target, r.target),
        top_k=pick(req.top_k, r.top_k),
        tokens=pick(req.tokens, r.data.tokens),
        confidence=req.confidence,
        candidates=req.candidates,
        shortlist=req.shortlist,
        compare=list(req.compare),
        holdout=req.holdout,
        gen_share=req.gen_share,
        gen_tokens=req.gen_tokens,
        gen_batch=req.gen_batch,
        raw=req.raw,
        gate_keep=req.gate_keep,
    )
