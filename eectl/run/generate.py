"""What `eectl run` needs beside the runtime: its options, resolved against an artifact, and a runner for them.

Resolves the run options against the manifest (active exits, thresholds from the calibration, a scale factor or
explicit values, the signal, the plan), opens the artifact's runtime, tokenizer and runner (`open_runner`), and holds
the per-prompt report. The stage that generates with them is run/stage.py (`run`, what the command and the pipeline
call); bench, lm-eval and --chat resolve their configurations here too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from eectl.contracts.calibration import never_exits
from eectl.contracts.certificate import CERTIFIED
from eectl.contracts.gates import GATE
from eectl.contracts.layers import check_exit_layers, parse_layers
from eectl.contracts.names import POLICY_SPECS, SIGNAL_SPECS, threshold_problem
from eectl.contracts.plan import AHEAD, DRAFT_MEMORY, LOOKUP, MAX_DRAFT_NGRAM, MAX_DRAFTS, MAX_NGRAM, plan_drafts
from eectl.contracts.recipe import MAX_SEED
from eectl.errors import ArtifactError, DataError, UsageError
from eectl.exits.signals import DEFAULT_SIGNAL, get_signal
from eectl.files import confined, existing_file, read_utf8, text_lines
from eectl.parsing import parse_json
from eectl.run.thresholds import no_exit_active, parse_thresholds, threshold_syntax
from eectl.run.wide import inexact_here, wide_warning
from eectl.runtime.ort import PROVIDERS
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import Generation, RunConfig
from eectl.runtime.tiers import WeightOptions, load_tiers


@dataclass
class RunOptions:
    exits: str | None = None  # "12,20" | "none" | None (the manifest's plan, else its calibrated exits, else all)
    policy: str | None = None  # None: the plan's default (full depth when nothing pays), else defer
    river_predict: str = "end"  # river: predict at the river's end (final head) or at the exit
    thresholds: str | None = None  # "0.9" for every exit, or "12:0.9,20:0.8"; None: the calibration's
    threshold_scale: float = 1.0  # the scaled thresholds must stay in their criteria's ranges
    # bench's sweep multiplies them further, unchecked: an exit put past its range is a sweep point, not a mistake
    sweep_scale: float = 1.0
    signal: str | None = None  # None: the calibration's, else topk-prob
    top_k: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    raw: bool = False
    provider: str = "auto"
    threads: int | None = None
    profile_costs: bool = False  # re-measure the graph costs here and re-plan before running
    # verify: drafts per step from n-gram matches of the context (runtime/drafts.py); 0: off, None: the plan's
    prompt_drafts: int | None = None
    draft_ngram: int = MAX_NGRAM  # drafts from the context: the longest suffix matched
    draft_memory: int = DRAFT_MEMORY  # drafts from the context: tokens of earlier requests drafted from (0: none)
    draft_min: int | None = None  # drafts from the context: the shortest run proposed (None: the plan's, else 1)
    draft_ahead: float = 0.0  # verify: the first exit drafts ahead by its running confidence (runtime/ahead.py)
    # the largest risk a certified lossy setting may carry to be the plan's default (None: the certificate's delta)
    max_risk: float | None = None
    # where the segments' weights live (runtime/tiers.py): mapped, a memory budget with a slow tier, placement
    weights: WeightOptions = field(default_factory=WeightOptions)
    # rows decoded together (run's --batch-size): the plan prices one row, so a batch does not follow its default
    batch_size: int = 1
    exact_head: bool = False  # the full LM head every greedy step, not the artifact's certified head (--exact-head)


def load_tokenizer(rt: ArtifactRuntime) -> Any:
    """The artifact's tokenizer (models/loading.py load_tokenizer_folder), its folder confined to the artifact."""
    from eectl.models.loading import load_tokenizer_folder

    folder = confined(rt.folder, rt.manifest.tokenizer_dir, ArtifactError)
    return load_tokenizer_folder(folder, rt.manifest.tokenizer_dir)


def read_prompts(path: str | Path) -> list[str]:
    """A .jsonl file (field prompt / question / text per line) or a text file (one prompt per line)."""
    p = existing_file(path, "prompt file", DataError)
    prompts: list[str] = []
    # lines end at \n (or \r\n) only: U+2028 and the other breaks of str.splitlines are content within a prompt
    for n, line in enumerate(text_lines(read_utf8(p, DataError)), 1):
        if not line.strip():
            continue
        if p.suffix.lower() == ".jsonl":
            row = parse_json(line, f"{p.name} is not valid JSON Lines", DataError, line=n)
            text = next((row[k] for k in ("prompt", "question", "text") if isinstance(row, dict) and k in row), None)
            if not isinstance(text, str):
                raise DataError(f"{p.name} line {n} has no prompt, question or text field")
            prompts.append(text)
        else:
            prompts.append(line)
    if not prompts:
        raise DataError(f"no prompts in {path}")
    return prompts


def check_options(opts: RunOptions) -> None:
    """The checks that need no artifact, run before its graphs load (resolve_config checks the rest)."""
    if not (opts.threshold_scale > 0 and math.isfinite(opts.threshold_scale)):
        raise UsageError(f"--threshold-scale must be a positive finite number, got {opts.threshold_scale}")
    if not (0 <= opts.temperature < math.inf) or not 0 < opts.top_p <= 1:
        raise UsageError("--temperature must be >= 0 and --top-p in (0, 1]")
    if opts.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {opts.max_new_tokens}")
    if not 0 <= opts.seed <= MAX_SEED:  # numpy's generators take no negative seed (a ValueError when sampling)
        raise UsageError(f"--seed must be in 0..{MAX_SEED}, got {opts.seed}")
    if opts.prompt_drafts is not None and not 0 <= opts.prompt_drafts <= MAX_DRAFTS:
        raise UsageError(f"--prompt-drafts must be in 0..{MAX_DRAFTS}, got {opts.prompt_drafts}")
    if opts.signal is not None and opts.signal not in SIGNAL_SPECS:
        raise UsageError(f"--signal must be one of {', '.join(SIGNAL_SPECS)}, got '{opts.signal}'")
    known = (*POLICY_SPECS, LOOKUP, CERTIFIED, "full")
    if opts.policy is not None and opts.policy not in known:
        raise UsageError(f"--policy must be one of {', '.join(known)}, got '{opts.policy}'")
    if opts.river_predict not in ("end", "exit"):
        raise UsageError(f"--river-predict must be end or exit, got '{opts.river_predict}'")
    layers = parse_layers(opts.exits)
    check_exit_layers(layers or [], None)  # distinct, as export and calibrate want them
    opts.weights.check()
    if opts.thresholds is not None:
        threshold_syntax(opts.thresholds)
    if opts.policy in ("full", LOOKUP):  # no exit runs: --exits and --thresholds would be dropped, silently
        hint = "--policy verify --prompt-drafts N drafts from both" if opts.policy == LOOKUP else None
        for flag, given in (("--exits", bool(layers)), ("--thresholds", opts.thresholds is not None)):
            if given:
                raise UsageError(f"--policy {opts.policy} runs at full depth: drop {flag}", hint=hint)
    if layers == [] and opts.thresholds is not None:  # --exits none
        no_exit_active(opts.thresholds)
    if opts.max_risk is not None and not 0 <= opts.max_risk < 1:
        raise UsageError(f"--max-risk must be in [0, 1), got {opts.max_risk}")
    if opts.top_k is not None and opts.top_k < 2:
        raise UsageError(f"--top-k must be >= 2, got {opts.top_k}")
    if not 1 <= opts.draft_ngram <= MAX_DRAFT_NGRAM:
        raise UsageError(f"--draft-ngram must be in 1..{MAX_DRAFT_NGRAM}, got {opts.draft_ngram}")
    if opts.draft_memory < 0:
        raise UsageError(f"--draft-memory must be >= 0 tokens, got {opts.draft_memory}")
    if opts.provider != "auto" and opts.provider not in PROVIDERS:
        raise UsageError(f"--provider must be auto or one of {', '.join(PROVIDERS)}, got '{opts.provider}'")


def resolve_config(rt: ArtifactRuntime, opts: RunOptions, stop_ids: tuple[int, ...]) -> RunConfig:
    """Active exits, thresholds and policy: explicit options, else the manifest's plan (exits chosen by predicted
    speed; full depth when nothing pays), else the calibration's exits and thresholds. A configuration that is the
    sequence certificate's setting, however it was reached, says so (`certified`, and the certificate in its note)."""
    config = _resolve(rt, opts, stop_ids)
    cert = rt.manifest.certificate
    if (
        not config.certified
        and cert is not None
        and cert.matches(config.policy, config.exits, config.signal, config.thresholds, config.top_k)
    ):
        config.certified = True
        config.note = "; ".join(x for x in (config.note, f"certified: {cert.describe()}") if x)
    if opts.batch_size > 1 and (config.exits or config.prompt_drafts):  # asked for: the plan's prices are one row's
        one_row = f"exits and drafts are priced for one row; in a batch of {opts.batch_size} rows share every call"
        config.note = "; ".join(x for x in (config.note, f"{one_row}, so they often run slower than full depth") if x)
    return config


def _resolve(rt: ArtifactRuntime, opts: RunOptions, stop_ids: tuple[int, ...]) -> RunConfig:
    check_options(opts)  # bench resolves its configurations here, without open_runner
    m = rt.manifest
    cal = m.calibration
    calibrated = cal.thresholds_by_layer() if cal is not None else {}
    signal = get_signal(opts.signal or (cal.signal if cal is not None else DEFAULT_SIGNAL))
    plan = m.plan
    same_signal = cal is not None and signal.name == cal.signal
    # a policy the plan does not price (river: `export --river`) runs on the calibration's exits, as without a plan
    priced = plan is not None and (opts.policy in (None, "full", LOOKUP) or opts.policy in plan.choices)
    follow = priced and bool(plan and plan.choices) and opts.exits is None and opts.thresholds is None and same_signal
    if follow and opts.policy is None and plan is not None and opts.temperature > 0 and _greedy_only(plan.default):
        # the plan's default reproduces greedy full depth (verify's check): sampling runs at full depth instead
        note = f"plan: the default ({plan.default}) reproduces greedy full depth; sampling runs at full depth"
        return _config(rt, opts, stop_ids, signal.name, "defer", [], {}, note, planned=True)
    if follow and opts.policy is None and plan is not None and (batched := plan.batch_note(opts.batch_size)):
        # the plan prices one row: in a batch, drafts' wide passes and exits cost for rows that share each call (the
        # default model's lookup ran 0.54x full depth at 16 rows); full depth batches on the bound chain
        note = f"plan: {batched} (--policy NAME runs one anyway)"
        return _config(rt, opts, stop_ids, signal.name, "defer", [], {}, note, planned=True)
    if opts.policy == "full":
        return _full_depth(rt, opts, stop_ids, signal.name)
    if opts.policy == CERTIFIED or (follow and opts.policy is None and plan is not None and plan.default == CERTIFIED):
        return _certified(rt, opts, stop_ids)
    if opts.policy == LOOKUP or (follow and opts.policy is None and plan is not None and plan.default == LOOKUP):
        return _lookup(rt, opts, stop_ids, signal.name)
    if follow:
        return _from_plan(rt, opts, stop_ids, signal.name)
    exits = parse_layers(opts.exits)
    if exits is None:
        exits = sorted(calibrated) if calibrated else list(m.exit_layers)
    unknown = sorted(set(exits) - set(m.exit_layers))
    if unknown:  # before the thresholds: else "no calibrated thresholds at exits [99]" hid what was wrong
        raise UsageError(f"--exits {unknown} not in the artifact (its exits: {m.exit_layers})")
    exits = sorted(set(exits))
    thresholds: dict[int, dict[str, float]] = {}
    if opts.thresholds is not None:
        thresholds = parse_thresholds(opts.thresholds, exits, signal.criteria)
    elif exits:
        if cal is None or signal.name != cal.signal or not all(e in calibrated for e in exits):
            if opts.exits is None and opts.signal is None and opts.policy is None:  # no exit asked for: run anyway
                return _config(rt, opts, stop_ids, signal.name, "defer", [], {}, uncalibrated_note(cal is None))
            raise UsageError(
                f"no calibrated thresholds for signal {signal.name} at exits {exits}",
                hint="export with --calibration, or pass --thresholds (e.g. 0.9, or 12:0.9,20:0.8)",
            )
        # An exit calibrated never to exit only costs time: drop it, unless it is where candidates are picked.
        keep_first = signal.needs_candidates
        exits = [e for i, e in enumerate(exits) if (keep_first and i == 0) or not never_exits(calibrated[e])]
        thresholds = {e: calibrated[e] for e in exits}
    return _config(rt, opts, stop_ids, signal.name, opts.policy or "defer", exits, thresholds, "")


def uncalibrated_note(none: bool) -> str:
    """The note of a run at full depth because nothing asked for exits and the artifact has no thresholds for them
    (exported without --calibration): the user's first `eectl run` runs, and says why no exit is taken."""
    why = "the artifact has no calibration" if none else "the calibration has no thresholds for these exits"
    return f"{why}: running at full depth (export with --calibration for exits, or pass --exits and --thresholds)"


def _greedy_only(default: str) -> bool:
    """Whether a plan's default runs a policy that only decodes greedily (verify, and lookup: full depth with verify's
    check of drafts from the context)."""
    from eectl.runtime.policies import POLICIES

    name = "verify" if default in (LOOKUP, AHEAD) else default
    return name in POLICIES and POLICIES[name].greedy_only


def _from_plan(rt: ArtifactRuntime, opts: RunOptions, stop_ids: tuple[int, ...], signal: str) -> RunConfig:
    plan = rt.manifest.plan
    assert plan is not None
    policy = opts.policy or plan.default
    if policy == "full":  # the plan's default: nothing pays
        return _config(rt, opts, stop_ids, signal, "defer", [], {}, plan.summary(), planned=True)
    if policy == AHEAD and (a := plan.ahead) is not None:  # the drafter decides: the exit's own test never passes
        never = {a.exit: dict.fromkeys(get_signal(signal).criteria, math.inf)}
        chosen = replace(opts, draft_ahead=opts.draft_ahead or a.bound)
        return _config(rt, chosen, stop_ids, signal, "verify", [a.exit], never, plan.summary(), planned=True)
    choice = plan.choices.get(policy)
    if choice is None:
        raise UsageError(f"--policy must be one of {', '.join(plan.choices)}, got '{policy}'")
    if not choice.exits:
        best = choice.best
        if best is not None:
            tail = f" (best: exits {best.exits}, {best.describe()})"
        else:
            tail = " (no calibrated exit subset qualifies for it)"
        note = f"plan: no {policy} configuration has {plan.line()}{tail}; running at full depth"
        return _config(rt, opts, stop_ids, signal, policy, [], {}, note, planned=True)
    thresholds = {int(k): dict(v) for k, v in choice.thresholds.items()}
    gated = " (gated)" if choice.option is not None and choice.option.gated else ""
    note = (
        f"plan: {policy} at exits {choice.exits}{gated}, predicted {choice.prediction.describe()} full depth "
        f"({plan.level:.0%} interval)" + ("" if opts.policy else " (the default)")
    )
    return _config(rt, opts, stop_ids, signal, policy, list(choice.exits), thresholds, note, planned=True)


def _certified(rt: ArtifactRuntime, opts: RunOptions, stop_ids: tuple[int, ...]) -> RunConfig:
    """--policy certified: the setting of the artifact's sequence certificate (calibrate --guarantee sequence), as it
    was certified (its policy, exits, signal, threshold and K)."""
    cert = rt.manifest.certificate
    if cert is None or not cert.certified:
        raise UsageError("this artifact holds no sequence certificate", hint="eectl calibrate --guarantee sequence")
    if opts.exits is not None or opts.thresholds is not None or opts.signal is not None or opts.threshold_scale != 1:
        raise UsageError("--policy certified runs the certified setting: drop --exits/--thresholds/--signal/--scale")
    chosen = replace(opts, top_k=cert.top_k)
    plan = rt.manifest.plan
    priced = plan.certified if plan is not None else None
    note = f"certified: {cert.describe()}"
    if plan is not None and priced is not None:
        default = " (the default)" if plan.default == CERTIFIED and opts.policy is None else ""
        note = f"plan: predicted {priced.prediction.describe()} full depth{default}; {note}"
    config = _config(rt, chosen, stop_ids, cert.signal, cert.policy, list(cert.exits), cert.thresholds(), note)
    config.certified = True
    return config


def _lookup(rt: ArtifactRuntime, opts: RunOptions, stop_ids: tuple[int, ...], signal: str) -> RunConfig:
    """Full depth with drafts from the context, verify's pass checking them (lossless): --policy lookup, or the
    plan's default. The drafts per step: --prompt-drafts, else the plan's, else DEFAULT_DRAFTS."""
    plan = rt.manifest.plan
    measured = plan.lookup if plan is not None else None
    drafts = opts.prompt_drafts if opts.prompt_drafts is not None else plan_drafts(plan)
    if drafts < 1:
        raise UsageError("--policy lookup drafts from the context: --prompt-drafts must be >= 1 with it")
    if plan is not None and measured is not None:
        note = plan.summary() if plan.default == LOOKUP else f"plan: lookup predicted {measured.prediction.describe()}"
    else:
        note = "lookup: full depth with drafts from the context (not priced: no measurement of them in the plan)"
    shortest = opts.draft_min if opts.draft_min is not None else (measured.min_draft if measured else 1)
    chosen = replace(opts, prompt_drafts=drafts, policy="verify", draft_min=shortest)
    return _config(rt, chosen, stop_ids, signal, "verify", [], {}, note, planned=measured is not None)


def _full_depth(rt: ArtifactRuntime, opts: RunOptions, stop_ids: tuple[int, ...], signal: str) -> RunConfig:
    """--policy full: full depth, no exit active (the plan's summary as the note, where there is a plan)."""
    plan = rt.manifest.plan
    note = plan.summary() if plan is not None else ""
    return _config(rt, opts, stop_ids, signal, "defer", [], {}, note, planned=plan is not None)


def _config(
    rt: ArtifactRuntime,
    opts: RunOptions,
    stop_ids: tuple[int, ...],
    signal: str,
    policy: str,
    exits: list[int],
    thresholds: dict[int, dict[str, float]],
    note: str,
    planned: bool = False,
) -> RunConfig:
    check_options(opts)
    drafts = opts.prompt_drafts or 0
    if drafts and policy != "verify":
        if exits:
            raise UsageError(
                f"--prompt-drafts needs the verify policy (its deep pass checks the drafts), not {policy}",
                hint="add --policy verify, or --exits none for full depth with drafts from the context",
            )
        policy = "verify"  # no exit active: full depth, and verify's final pass checks the drafts
    # the scale is the signal's (a gate's threshold is a logit, not a confidence: left as fitted); a finite threshold
    # it puts outside its criterion's range is refused (1e308: every probability past 1, no exit could ever fire)
    for e, t in thresholds.items() if opts.threshold_scale != 1 else ():
        for c, v in t.items():
            if c != GATE and math.isfinite(v) and (problem := threshold_problem(c, v * opts.threshold_scale)):
                raise UsageError(f"--threshold-scale {opts.threshold_scale:g}: exit {e}'s {problem}")
    scale = opts.threshold_scale * opts.sweep_scale
    thresholds = {e: {c: v if c == GATE else v * scale for c, v in t.items()} for e, t in thresholds.items()}
    return RunConfig(
        exits=exits,
        thresholds=thresholds,
        signal=signal,
        policy=policy,
        river_predict=opts.river_predict,
        top_k=opts.top_k or rt.manifest.top_k,
        max_new_tokens=opts.max_new_tokens,
        temperature=opts.temperature,
        top_p=opts.top_p,
        seed=opts.seed,
        prompt_drafts=drafts,
        draft_ngram=opts.draft_ngram,
        draft_memory=opts.draft_memory,
        draft_min=opts.draft_min or 1,
        draft_ahead=opts.draft_ahead,
        stop_ids=stop_ids,
        note=note,
        planned=planned,
        certified_head=not opts.exact_head,
    )


def calibration_warning(rt: ArtifactRuntime, config: RunConfig) -> str | None:
    """Local-vocabulary thresholds were calibrated with candidates picked at the first calibrated exit; another
    first exit changes what the local probabilities mean."""
    cal = rt.manifest.calibration
    first = cal.candidates_layer if cal is not None else None
    if config.planned or config.certified:  # fitted with the candidates at its own first exit / measured as it runs
        return None
    if get_signal(config.signal).needs_candidates and config.exits and first and config.exits[0] != first:
        return (
            f"thresholds were calibrated with Top-K candidates chosen at exit {first}; with exit "
            f"{config.exits[0]} first they are only approximate (recalibrate with these exits)"
        )
    return None


def replan(rt: ArtifactRuntime, budget_s: float | None = None, max_risk: float | None = None) -> None:
    """Re-measure the artifact's graph costs on this machine and re-choose the exits (in memory, for this run):
    timing batches until the plan is decided (plan/choose.py `settled`) or `budget_s` seconds (costs.RETIME_BUDGET_S)
    are spent; what is still undecided then runs its conservative choice and the plan says so."""
    from eectl.contracts.plan import MIN_BATCHES
    from eectl.plan.choose import plan_manifest, settled
    from eectl.plan.costs import RETIME_BUDGET_S, measure_costs

    m = rt.manifest
    costs = measure_costs(
        rt,
        signal=m.calibration.signal if m.calibration is not None else DEFAULT_SIGNAL,
        decided=lambda costs: settled(costs, plan_manifest(m, costs, max_risk)),
        budget_s=RETIME_BUDGET_S if budget_s is None else budget_s,
        min_batches=MIN_BATCHES,
    )
    tiers = rt.tiers
    if tiers is not None and tiers.slow:  # timed through the tier's sessions: the slow segments cold, as runs read them
        costs = costs.model_copy(update={"memory_budget": tiers.budget})
        tiers.reset()  # the run's counters count the run, not the timing
    m.costs = costs
    m.plan = plan_manifest(m, m.costs, max_risk)


def choose_plan(
    rt: ArtifactRuntime,
    profile_costs: bool,
    max_risk: float | None,
    note: Callable[[str], None] | None = None,
    tokens: int | None = None,
) -> None:
    """The plan this run follows: re-measured (--profile-costs, and always under a memory budget with a slow tier:
    the artifact's costs were timed with every segment resident), re-chosen at the user's risk (--max-risk), or the
    artifact's as exported; priced at the run's length (`tokens`: plan/length.py)."""
    m = rt.manifest
    tiered = rt.tiers is not None and bool(rt.tiers.slow)
    if tiered and not profile_costs and m.costs is not None and note is not None:
        note("re-timing the graphs under the memory budget (the slow tier read from its files) to re-plan")
    if profile_costs or (tiered and m.costs is not None):
        replan(rt, max_risk=max_risk)
    elif max_risk is not None and m.plan is not None and m.costs is not None:
        from eectl.plan.choose import plan_manifest

        m.plan = plan_manifest(m, m.costs, max_risk)
    if tokens is not None:
        from eectl.plan.length import plan_for_run

        m.plan = plan_for_run(m, tokens)


@dataclass
class RunReport:
    prompt: str
    text: str
    generation: Generation
    num_layers: int

    def to_dict(self) -> dict[str, Any]:
        g = self.generation
        return {
            "prompt": self.prompt,
            "text": self.text,
            "prompt_ids": g.prompt_ids,
            "token_ids": g.token_ids,
            "exit_layers": g.exit_layers,
            "tokens_per_s": g.tokens_per_s,
            "ttft_s": g.ttft_s,
            "latencies_s": g.latencies_s,
            "mean_executed_layers": g.mean_layers(self.num_layers),
            "decide_s": g.decide_s,
            "drafted": g.drafted,
            "rejected_drafts": g.rejected_drafts,
            "prompt_drafted": g.prompt_drafted,
            "prompt_accepted": g.prompt_accepted,
            "prompt_reused": g.reused,  # prompt tokens the cache held from the last prompt in the row's slot
        }


def open_runner(
    artifact: str | Path,
    opts: RunOptions,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> tuple[ArtifactRuntime, Any, RunConfig, Runner]:
    """The artifact's runtime, its tokenizer, the configuration the options resolve to, and a runner for it;
    `note` gets how the configuration was chosen (the plan's line), `warn` warnings about the options."""
    rt, tok = open_artifact(artifact, opts, note)
    config, runner = runner_for(rt, opts, warn, note)
    return rt, tok, config, runner


def open_artifact(
    artifact: str | Path, opts: RunOptions, note: Callable[[str], None] | None = None
) -> tuple[ArtifactRuntime, Any]:
    """The artifact's runtime (its weights placed as the options say) and tokenizer, its plan chosen for the run
    (`choose_plan`): what every runner of the run shares (`runner_for`; an engine has a greedy and a sampling one)."""
    check_options(opts)
    rt = ArtifactRuntime(artifact, provider=opts.provider, threads=opts.threads, lazy_segments=opts.weights.active)
    if opts.weights.active:
        tiers = load_tiers(rt, opts.weights)
        if note is not None:
            note(tiers.describe())
    tok = load_tokenizer(rt)
    choose_plan(rt, opts.profile_costs, opts.max_risk, note, opts.max_new_tokens)
    return rt, tok


def runner_for(
    rt: ArtifactRuntime,
    opts: RunOptions,
    warn: Callable[[str], None] | None = None,
    note: Callable[[str], None] | None = None,
) -> tuple[RunConfig, Runner]:
    """The configuration `opts` resolve to on an opened artifact (`open_artifact`), and a runner for it."""
    stop_ids = tuple(rt.manifest.eos_token_ids)
    config = resolve_config(rt, opts, stop_ids)
    # the plan's default, priced as lossless, is not exact on this machine: full depth (an asked policy runs, warned)
    if opts.policy is None and opts.prompt_drafts is None and config.planned and (why := inexact_here(rt, config)):
        config = _config(rt, opts, stop_ids, config.signal, "defer", [], {}, f"plan: full depth: {why}", planned=True)
    if config.note and note is not None:
        note(config.note)
    warning = calibration_warning(rt, config) if opts.thresholds is None else None
    if warning is not None and warn is not None:
        warn(warning)
    if (wide := wide_warning(rt, config)) is not None and warn is not None:
        warn(wide)
    if rt.certified_refused and warn is not None:  # runtime/certified_bound.py's check at load
        warn(f"the certified final head is off on this machine ({rt.certified_refused}): the full head runs")
    return config, Runner(rt, config)
