"""The calibrate stage as library calls: a recipe and a request in, what was written and its contents out.

`calibrate`: per-exit thresholds on the model, written as a calibration file (what `eectl calibrate` and the pipeline
both run). `certify_artifact`: with --guarantee sequence, one threshold certified for whole continuations of an
exported artifact (calibrate/sequence.py), written into its manifest. A request's None fields take the recipe's
values; the caller has set up the thread pools (cli.app.set_threads). The model is measured on the request's torch
device (models/device.py); the sequence guarantee runs the artifact with ONNX Runtime on the CPU. What this module does
not do: print results.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from eectl.calibrate.calibrator import CalibrateOptions
from eectl.calibrate.sequence import SequenceOptions
from eectl.contracts.calibration import Calibration
from eectl.contracts.certificate import Certificate
from eectl.contracts.gates import DEFAULT_GATE_KEEP
from eectl.contracts.manifest import Manifest
from eectl.contracts.recipe import Recipe, pick
from eectl.errors import UsageError
from eectl.exits.candidates import DEFAULT_CANDIDATES, DEFAULT_SHORTLIST
from eectl.files import existing_file
from eectl.output import Output
from eectl.output_checks import check_outputs, input_file
from eectl.phases import Phases


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
    device: str = "auto"  # the torch device the model is measured on (auto: a CUDA GPU when torch sees one)


@dataclass
class CalibrateResult:
    calibration: Calibration
    path: Path  # where it was written
    device: str = "cpu"  # where it was measured (models/device.py's name)
    phases: Phases = dataclasses.field(default_factory=Phases)  # where the time went (eectl/phases.py)


def calibrate(recipe: Recipe, req: CalibrateRequest, out: Output) -> CalibrateResult:
    """Per-exit thresholds measured on the recipe's model and data, written as a calibration file."""
    from eectl.calibrate.calibrator import check_options, check_sample, check_settings, collect, summarise
    from eectl.contracts.calibration import write_calibration
    from eectl.contracts.layers import default_exits
    from eectl.data import load_text_data
    from eectl.exits.signals import DEFAULT_SIGNAL, choose_signal
    from eectl.models import load_model
    from eectl.models.device import device_name, resolve_device

    r = recipe
    opts = options(r, req)
    opts.signal = pick(req.signal, r.signal) or DEFAULT_SIGNAL  # checked here; chosen with the heads below
    check_settings(opts)  # the sample size once the data has loaded: a data error is named first
    device = resolve_device(req.device)  # a missing GPU refused before the model loads
    if req.heads is not None:
        existing_file(req.heads, "heads", UsageError, hint="train them with eectl train-heads")
    src = pick(req.data, r.data.source)
    ins = [("--data", input_file(src)), ("--heads", req.heads), ("--recipe", input_file(req.recipe_file))]
    check_outputs([("--out", req.out, [])], ins)
    phases = Phases()
    with phases.time("load data, model and heads"):
        text = load_text_data(src, pick(req.field, r.data.field))
        check_sample(opts)
        out.log(f"loading {pick(req.model, r.model) or 'the default model (SmolLM2-135M-Instruct)'}")
        loaded = load_model(pick(req.model, r.model), log=out, int4=r.int4_twin())
        loaded.model.to(device)
        opts.exits = opts.exits or default_exits(loaded.adapter.num_layers)
        head_modules = None
        if req.heads is not None:
            from eectl.exits.designs import load_heads

            head_modules = dict(load_heads(req.heads, loaded).heads)  # checks the heads were trained on this model
            for head in head_modules.values():
                head.to(device)
    opts.signal = choose_signal(pick(req.signal, r.signal), head_modules, opts.exits)
    check_options(opts, loaded.adapter.num_layers, loaded.adapter.dims.vocab_size)
    path = req.out or Path("artifacts") / f"{loaded.source.name}-calibration.json"
    check_outputs([("--out", path, [])], ins)
    out.log(
        f"calibrating exits {opts.exits} on {opts.tokens} tokens of {text.name} ({opts.text_tokens} teacher-forced, "
        f"{opts.generated_tokens} generated), signal {opts.signal}, target {opts.target}, on {device_name(device)}, "
        f"{req.threads} threads"
    )
    with out.progress("calibrate", total=opts.tokens) as bar, phases.time("measure exits", "calibrate_tokens"):
        collected = collect(loaded, text, opts, head_modules, on_tokens=lambda n: bar.advance(n))
    phases.add("measure exits", -collected.gen_s)  # its continuations: decode steps, their own phase
    phases.add("generate continuations", collected.gen_s, "calibrate_gen_steps")
    with phases.time("fit thresholds", "calibrate_tokens"):
        result = summarise(loaded, text, opts, collected, head_modules, req.heads)  # calibrator.calibrate_model
    write_calibration(result, path)
    return CalibrateResult(result, path, device_name(device), phases)


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


@dataclass
class SequenceRequest:
    """calibrate --guarantee sequence: certify one threshold over every exit of an exported artifact."""

    artifact: Path
    options: SequenceOptions
    data: str | None = None  # None: the recipe's
    field: str | None = None
    prompts: int = 400  # calibration prompts
    offset: int = 0  # skip this many of the data's prompts
    raw: bool = False  # prompts as is, without the chat template
    out: Path | None = None  # also write the artifact's calibration, with the certificate, here
    threads: int | None = None  # the thread count set up by the caller


@dataclass
class CertifyResult:
    certificate: Certificate
    manifest: Manifest  # the artifact's, as written: the certificate in it, the plan re-chosen
    artifact: Path  # where the manifest was written
    out: Path | None  # the calibration file written beside, if asked for


def certify_artifact(recipe: Recipe, req: SequenceRequest, out: Output) -> CertifyResult:
    """The Learn-then-Test certificate of a threshold on the artifact's own continuations, written into its
    manifest (and the plan re-chosen: it may now pick the certified setting)."""
    from eectl.calibrate.sequence import certify, check
    from eectl.contracts.calibration import write_calibration
    from eectl.contracts.manifest import write_manifest
    from eectl.data import encode_prompt, gsm8k_answers, load_text_data
    from eectl.errors import ArtifactError
    from eectl.files import confined
    from eectl.models.loading import load_tokenizer_folder
    from eectl.runtime.sessions import ArtifactRuntime

    opts, data = req.options, pick(req.data, recipe.data.source)
    if req.prompts < 1 or req.offset < 0:
        raise UsageError(f"--prompts must be >= 1 and --offset >= 0, got {req.prompts} and {req.offset}")
    check_outputs([("--out", req.out, [])], [("--data", input_file(data))], [("--artifact", req.artifact)])
    text = load_text_data(data, pick(req.field, recipe.data.field))
    window = slice(req.offset, req.offset + req.prompts)
    chosen, answers = text.prompts[window], gsm8k_answers(text.texts[window])
    rt = ArtifactRuntime(req.artifact, provider="cpu", threads=req.threads)
    if req.out is not None and rt.manifest.calibration is None:
        raise UsageError("--out writes the artifact's calibration with the certificate; this artifact has none")
    check(opts, len(chosen), answers)
    tokenizer_dir = rt.manifest.tokenizer_dir
    tok = load_tokenizer_folder(confined(rt.folder, tokenizer_dir, ArtifactError), tokenizer_dir)
    ids = [encode_prompt(tok, p, req.raw) for p in chosen]
    out.log(
        f"certifying {opts.policy} on {len(ids)} prompts of {text.name} (from record {req.offset}): {opts.risk}, "
        f"delta {opts.delta:g}, epsilon {opts.epsilon:g}, {rt.threads} threads"
    )

    def decode(t: list[int]) -> str:
        return str(tok.decode(t, skip_special_tokens=True))

    cert = certify(rt, ids, answers, opts, decode, text.name, out.log)
    m = rt.manifest.model_copy(update={"certificate": cert})
    if m.plan is not None and m.costs is not None:  # the plan may now choose the certified setting
        from eectl.plan.choose import plan_manifest

        m.plan = plan_manifest(m, m.costs)
    write_manifest(m, Path(req.artifact))
    if req.out is not None and m.calibration is not None:
        write_calibration(m.calibration.model_copy(update={"certificate": cert}), req.out)
    return CertifyResult(cert, m, req.artifact, req.out)
