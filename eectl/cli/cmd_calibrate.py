"""`eectl calibrate`: options, the call into calibrate/stage.py (or, with --guarantee sequence,
cli/calibrate_sequence.py), the thresholds table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eectl.cli.app import BudgetNameOpt, JsonOpt, ModelArg, RecipeOpt, ThreadsOpt, command, set_threads
from eectl.contracts.calibration import Calibration, SplitStats
from eectl.contracts.layers import needed_layers
from eectl.contracts.names import SIGNAL_SPECS
from eectl.contracts.recipe import load_recipe
from eectl.errors import UsageError
from eectl.output import Output
from eectl.plan.choose import sequence_agreement

DataOpt = Annotated[
    str | None, typer.Option(help="Text file, .jsonl, or built-in name (humaneval).", rich_help_panel="Data")
]
FieldOpt = Annotated[
    str | None, typer.Option(help="The .jsonl field to read (detected by default).", rich_help_panel="Data")
]
TokensOpt = Annotated[
    int | None,
    typer.Option(
        help="Tokens to measure, teacher-forced and generated together (default: 20000).", rich_help_panel="Data"
    ),
]
TargetOpt = Annotated[
    float | None,
    typer.Option(
        help="Agreement with the final layer's top-1 among exiting tokens, in (0, 1].",
        rich_help_panel="Exits & signal",
    ),
]
ExitsOpt = Annotated[
    str | None,
    typer.Option(help="Exit after these layers, comma-separated, e.g. 8,12,16.", rich_help_panel="Exits & signal"),
]
SignalOpt = Annotated[
    str | None,
    typer.Option(
        help=f"Exit signal: {', '.join(SIGNAL_SPECS)} (default: learned with probed heads, else topk-prob).",
        rich_help_panel="Exits & signal",
    ),
]
TopKOpt = Annotated[
    int | None, typer.Option(help="Local vocabulary size of the topk-* signals.", rich_help_panel="Exits & signal")
]
HeadsOpt = Annotated[
    Path | None,
    typer.Option(help="Trained exit heads (heads.safetensors): exits use them.", rich_help_panel="Exits & signal"),
]
ConfidenceOpt = Annotated[
    float,
    typer.Option(
        help="Require the Clopper-Pearson lower bound at this level to reach --target (0: point estimate).",
        rich_help_panel="Exits & signal",
    ),
]
CandidatesOpt = Annotated[
    str,
    typer.Option(
        help="Candidate source at the first exit: shortlist-int8, shortlist, int8 or first-exit-topk.",
        rich_help_panel="Candidates",
    ),
]
ShortlistOpt = Annotated[
    int,
    typer.Option(
        help="Rows of the frequency-ranked shortlist (--candidates shortlist, shortlist-int8).",
        rich_help_panel="Candidates",
    ),
]
CompareOpt = Annotated[
    str,
    typer.Option(
        help="Other candidate sources to measure on the same tokens, e.g. int8,full (report).",
        rich_help_panel="Candidates",
    ),
]
HoldoutOpt = Annotated[
    float,
    typer.Option(help="Share of chunks and prompts held out to check the thresholds.", rich_help_panel="Data"),
]
GenShareOpt = Annotated[
    float,
    typer.Option(
        help="Share of the tokens taken from the model's own greedy continuations of prompts.",
        rich_help_panel="Data",
    ),
]
GenTokensOpt = Annotated[
    int, typer.Option(help="Continuation length per prompt (at most; EOS ends it).", rich_help_panel="Data")
]
GenBatchOpt = Annotated[
    int,
    typer.Option(
        help="Prompts generated together (speed and memory only: the tokens are the same).", rich_help_panel="Data"
    ),
]
RawOpt = Annotated[
    bool,
    typer.Option(
        "--raw",
        help="Continue prompts as is, without the chat template (eectl run --raw).",
        rich_help_panel="Data",
        metavar="",
    ),
]
GateKeepOpt = Annotated[
    float,
    typer.Option(
        help="Gated options on the menu: each exit's gate keeps this share of the decisions that pass (0: none).",
        rich_help_panel="Exits & signal",
    ),
]
OutPathOpt = Annotated[
    Path | None,
    typer.Option(
        "--out", help="Where to write it (default: artifacts/<model>-calibration.json).", rich_help_panel="Output"
    ),
]
GuaranteeOpt = Annotated[
    str,
    typer.Option(
        help="token: per-token agreement (thresholds per exit); sequence: certify one threshold over all exits of "
        "--artifact for whole continuations (Learn-then-Test).",
        rich_help_panel="Sequence guarantee",
    ),
]
ArtifactOpt = Annotated[
    Path | None, typer.Option(help="The exported artifact to certify.", rich_help_panel="Sequence guarantee")
]
RiskOpt = Annotated[
    str,
    typer.Option(
        help="first:N (differs from full depth in its first N tokens), share:N, or exact-match (GSM8K).",
        rich_help_panel="Sequence guarantee",
    ),
]
DeltaOpt = Annotated[float, typer.Option(help="The risk to bound.", rich_help_panel="Sequence guarantee")]
EpsilonOpt = Annotated[
    float, typer.Option(help="1 - confidence over the calibration draw.", rich_help_panel="Sequence guarantee")
]
PolicyOpt = Annotated[str, typer.Option(help="KV policy to certify.", rich_help_panel="Sequence guarantee")]
GridOpt = Annotated[
    str | None,
    typer.Option(help="Thresholds to test, highest first (default by signal).", rich_help_panel="Sequence guarantee"),
]
PromptsOpt = Annotated[int, typer.Option(help="Calibration prompts.", rich_help_panel="Sequence guarantee")]
DeviceOpt = Annotated[
    str,
    typer.Option(
        help="Torch device: auto (a CUDA GPU when torch sees one, else the CPU), cpu or cuda.", rich_help_panel="Common"
    ),
]
OffsetOpt = Annotated[
    int, typer.Option(help="Skip this many of the data's prompts.", rich_help_panel="Sequence guarantee")
]


@command()
def calibrate(
    model: ModelArg = None,
    data: DataOpt = None,
    field: FieldOpt = None,
    tokens: TokensOpt = None,
    target: TargetOpt = None,
    exits: ExitsOpt = None,
    signal: SignalOpt = None,
    top_k: TopKOpt = None,
    heads: HeadsOpt = None,
    confidence: ConfidenceOpt = 0.95,
    candidates: CandidatesOpt = "shortlist-int8",  # candidates.DEFAULT_CANDIDATES (the CLI imports no torch up front)
    shortlist: ShortlistOpt = 4096,
    compare: CompareOpt = "",
    holdout: HoldoutOpt = 0.2,
    gen_share: GenShareOpt = 0.25,
    gen_tokens: GenTokensOpt = 64,
    gen_batch: GenBatchOpt = 64,
    raw: RawOpt = False,
    gate_keep: GateKeepOpt = 0.99,  # gates.DEFAULT_GATE_KEEP
    out_path: OutPathOpt = None,
    guarantee: GuaranteeOpt = "token",
    artifact: ArtifactOpt = None,
    risk: RiskOpt = "first:32",
    delta: DeltaOpt = 0.1,
    epsilon: EpsilonOpt = 0.05,
    policy: PolicyOpt = "defer",
    grid: GridOpt = None,
    prompts: PromptsOpt = 400,
    offset: OffsetOpt = 0,
    device: DeviceOpt = "auto",
    recipe: RecipeOpt = None,
    budget: BudgetNameOpt = None,
    threads: ThreadsOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Per-exit thresholds so that exits agree with the full model at a stated rate (sequential, held-out checked);
    with --guarantee sequence, a certified threshold for whole continuations of an exported artifact."""
    layers = needed_layers(exits, "calibrate")
    _one_guarantee(guarantee, locals())
    out, r = Output(json_out), load_recipe(recipe, budget)
    if guarantee == "sequence":
        from eectl.calibrate.stage import certify_artifact
        from eectl.cli.calibrate_sequence import print_certificate, sequence_request

        args = (risk, delta, epsilon, policy, layers, signal, top_k, grid, gen_batch)
        seq = sequence_request(artifact, data, field, prompts, offset, raw, out_path, *args)
        seq.threads = set_threads(threads, r)
        print_certificate(out, certify_artifact(r, seq, out))
        return
    from eectl.calibrate.stage import CalibrateRequest
    from eectl.calibrate.stage import calibrate as run_calibrate

    req = CalibrateRequest(
        model=model,
        data=data,
        field=field,
        tokens=tokens,
        target=target,
        exits=layers,
        signal=signal,
        top_k=top_k,
        heads=heads,
        confidence=None if confidence == 0 else confidence,
        candidates=candidates,
        shortlist=shortlist,
        compare=[c.strip() for c in compare.split(",") if c.strip()],
        holdout=holdout,
        gen_share=gen_share,
        gen_tokens=gen_tokens,
        gen_batch=gen_batch,
        raw=raw,
        gate_keep=gate_keep,
        out=out_path,
        recipe_file=recipe,
        device=device,
    )
    req.threads = set_threads(threads, r)
    done = run_calibrate(r, req, out)
    print_calibration(out, done.calibration, done.path, done.device)


# The options only one --guarantee reads (the others, --data, --exits, --signal, ..., both do): given with the other,
# each was dropped, silently. MODEL is the token guarantee's; the sequence guarantee certifies --artifact.
ONLY_READ_BY = {
    "token": (
        "model",
        "tokens",
        "target",
        "heads",
        "confidence",
        "candidates",
        "shortlist",
        "compare",
        "holdout",
        "gen_share",
        "gen_tokens",
        "gate_keep",
        "device",
    ),
    "sequence": ("artifact", "risk", "delta", "epsilon", "policy", "grid", "prompts", "offset"),
}


def _one_guarantee(guarantee: str, given: dict[str, object]) -> None:
    """--guarantee is token or sequence; an option of the other guarantee set away from its default is refused (one
    line naming it)."""
    import inspect

    if guarantee not in ONLY_READ_BY:
        raise UsageError(f"--guarantee must be token or sequence, got '{guarantee}'")
    other = "sequence" if guarantee == "token" else "token"
    defaults = inspect.signature(calibrate).parameters
    for name in ONLY_READ_BY[other]:
        if given[name] != defaults[name].default:
            flag = "MODEL" if name == "model" else f"--{name.replace('_', '-')}"
            raise UsageError(
                f"{flag} is read by --guarantee {other} only, but this calibration is --guarantee {guarantee}",
                hint="the sequence guarantee certifies an artifact: give it as --artifact DIR"
                if name == "model"
                else f"drop {flag}, or give --guarantee {other}",
            )


def print_calibration(out: Output, result: object, path: Path, device: str | None = None) -> None:
    """What `eectl calibrate` prints of a calibration: the thresholds table and the lines under it (JSON with
    --json); `device`, where it was measured, when known."""
    assert isinstance(result, Calibration)
    out.json(result.to_dict())
    _thresholds_table(out, result)
    d = result.data
    for name, s in (("calibration", result.calibration), ("held-out", result.heldout)):
        if s is not None:
            out.line(
                f"{name}: {s.exit_rate:.1%} of {s.tokens} tokens exit early (agreement {_num(s.precision)} among "
                f"them, {s.agreement:.4f} overall); mean executed layers {s.mean_layers:.2f} of "
                f"{result.model.num_layers}, speedup bound {s.speedup_bound:.3f}x"
            )
    for name, s in result.heldout_by_source.items():
        out.line(f"  held-out {name}: {s.tokens} tokens, exit {s.exit_rate:.1%}, agreement {_num(s.precision)}")
        if name == "generated" and d.gen_tokens_per_prompt:
            n = d.gen_tokens_per_prompt
            out.line(
                f"  with every exit active, {1 - s.agreement:.2%} of generated tokens disagree with full depth: "
                f"{n}-token continuations under copy/defer agree {sequence_agreement(1 - s.agreement, n):.1%} "
                "position-wise (predicted: the first disagreement parts them)"
            )
    out.line(
        f"data: {d.tokens} tokens of {d.name}: {d.teacher_forced_tokens} teacher-forced, {d.generated_tokens} "
        f"generated ({d.prompts_used} prompts{' in the chat template' if d.chat_template else ''} x up to "
        f"{d.gen_tokens_per_prompt}); {result.wall_s:.1f}s on "
        + (f"{device}, " if device else "")
        + f"{result.threads} threads ({result.seconds_per_10k_tokens:.1f}s per 10,000 tokens)"
    )
    cand = result.candidates
    if cand is not None:
        size = f" ({cand.size} rows" if cand.size else ""
        hit = f", {cand.heldout_hit_rate:.1%} of held-out tokens inside)" if cand.heldout_hit_rate is not None else ""
        judged = f", judged out of fold on {result.options_judged_on} tokens" if result.options else ""
        out.line(
            f"candidates: {cand.name}{size}{hit or (')' if size else '')}; {len(result.options)} menu options{judged}"
        )
    if result.gates:
        gated = [o for o in result.options if o.gated]
        out.line(
            f"gates: exits {sorted(int(k) for k in result.gates)}, each keeping {result.gate_keep:.1%} of an "
            f"option's passing decisions; {len(gated)} gated options on the menu (export's cost model weighs the "
            "decisions they skip against the exits they lose)"
        )
    for name, comp in result.compared.items():
        held = comp.heldout or comp.calibration
        out.line(
            f"compared, candidates {name}: held-out exit rate {held.exit_rate:.1%}, agreement "
            f"{_num(held.precision)} among them, mean executed layers {held.mean_layers:.2f} "
            f"({len(comp.options)} menu options)"
        )
    for x in result.exits:
        if x.note:
            out.line(f"exit {x.layer}: {x.note}")
    for line in policy_lines(result):
        out.line(line)
    out.line(f"written: {path}")


def _thresholds_table(out: Output, result: Calibration) -> None:
    """The per-exit table: thresholds, coverage and precision on the calibration split and held out."""
    bound = result.confidence is not None
    rows = []
    for x in result.exits:
        thr = "never" if x.never else ", ".join(f"{c} >= {v:.4g}" for c, v in x.thresholds.items())
        c, h = x.calibration, x.heldout
        row = [x.layer, thr + (" (head)" if x.head else ""), c.reached, _pct(c.coverage), _prec(c)]
        if bound:
            row.append(_num(c.lower_bound))
        row += [_pct(h.coverage if h else None), _prec(h)]
        rows.append(row)
    columns = ["exit", "threshold", "reached", "coverage", "precision"]
    columns += [f"CP bound {result.confidence:.0%}"] if bound else []
    columns += ["held-out cov.", "held-out agree"]
    d = result.data
    out.table(
        f"{result.model.name}: {result.signal}"
        + (f" (K={result.top_k})" if result.top_k else "")
        + f", target {result.target}: {d.calibration_tokens} calibration + {d.heldout_tokens} held-out tokens",
        columns,
        rows,
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _prec(s: SplitStats | None) -> str:
    return _num(None if s is None else s.precision)


def policy_lines(result: Calibration) -> list[str]:
    """What each KV policy can use of this calibration: copy/defer exit only where the target is reached (per token);
    verify is lossless, so its menu's options at lower precisions are a speed knob, not a fidelity risk."""
    conf = f" at {result.confidence:.0%} confidence" if result.confidence else ""
    exiting = [x.layer for x in result.exits if x.calibration.exited > 0]
    verify = [o for o in result.options if o.kind == "verify"]
    if exiting:
        lossy = (
            f"copy/defer: exits {exiting} reach {result.target}{conf} per token (a whole answer's risk: calibrate "
            "--guarantee sequence on the exported artifact)"
        )
    else:
        lossy = f"copy/defer: no exit reaches {result.target}{conf}; they run at full depth"
    if verify:
        precisions = sorted({o.target for o in verify})
        lossless = (
            f"verify (lossless: the deep layers check every draft) may still draft: {len(verify)} menu options at "
            f"precisions {', '.join(f'{p:g}' for p in precisions)}; export's cost model keeps one only if it pays"
        )
    else:
        lossless = "verify: no menu options (calibrate with the menu to let export price verify)"
    return [lossy, lossless]
