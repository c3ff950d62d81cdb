"""The pipeline's last words: what the artifact buys, measured, and what a larger budget would cost and must achieve.

Read from what the stages wrote (the bench's JSON twin, the artifact's manifest and its plan, the calibration's
menu) and the stage times of this run; nothing is re-measured. Three to five lines:
- buys: the default configuration's speedup over full depth with the bench's reported interval (its bootstrap
  interval widened by the A/A reach: evaluate/stats.widened), when the bench was conclusive (else
  why there is no claim), and its fidelity (lossless, or token agreement);
- against llama.cpp (where the bench ran it on the same GGUF, `bench.peer`): the default's and full depth's speed as a
  ratio of llama.cpp's, from the same interleaved run;
- plan: what the plan chose and why (its own summary);
- budget: this budget's stage times; the next budget's time on this machine, estimated from this run's phases
  (eectl/phases.py): each sized phase scaled by the next budget's size over this one's, the rest of the stage
  (loading the model, creating sessions, warm-ups) kept as it is; a stage that reports no phases scaled whole by
  its size (_SCALES);
- needs (when the plan runs no exits): at the artifact's measured costs, the share of tokens that must exit at the
  cheapest exit with 99% agreement for lossless `verify` to clear the plan's line, against the share this run's
  heads reach.

What this module does not do: predict the next budget's speedup from first principles (heads' quality against
training tokens is model-specific: the `needs` line states the bar a larger budget must clear instead).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eectl.contracts.budgets import BUDGETS, SIZES, Budget, next_budget
from eectl.contracts.recipe import Recipe
from eectl.phases import FIXED, Phase

# stage -> what its whole time scales with, per budget, for a stage that reports no phases (a stage not listed takes
# the same time in every budget)
_SCALES = {
    "profile": lambda b: b.profile_tokens,
    "train-heads": lambda b: b.cache_tokens + b.probe_tokens,
    "calibrate": lambda b: b.calibrate_tokens,
    "bench": lambda b: b.bench_prompts * b.bench_tokens * b.bench_reps,
}
PRECISION = 0.99  # the agreement the `needs` line asks of an exit's tokens


def verdict(recipe: Recipe, report: Path, artifact: Path, calibration: Path, stages: Sequence[Any]) -> list[str]:
    """The verdict lines (empty when the bench wrote no report). `stages`: the run's StageRun list."""
    bench = _read(report.with_suffix(".json"))
    if bench is None:
        return []
    lines = [_buys(bench), *_peer_lines(bench), *_conditions(bench)]
    manifest = _read(artifact / "manifest.json")
    if manifest is not None and manifest.get("plan") is not None:
        from eectl.contracts.plan import Plan

        lines.append(Plan.model_validate(manifest["plan"]).summary())
    lines += _budget_lines(recipe, stages)
    need = _needs(manifest, _read(calibration))
    if need:
        lines.append(need)
    return lines


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _conditions(bench: dict[str, Any]) -> list[str]:
    """A line where the bench's full depth decoded away from the step the plan was priced with
    (evaluate/predicted.py `conditions`): the predictions beside the measured speedup were priced in another state of
    the machine."""
    note = (bench.get("conditions") or {}).get("note")
    return [f"conditions: {note}"] if note else []


def _buys(bench: dict[str, Any]) -> str:
    default = next((c for c in bench.get("configs", []) if c.get("name") == bench.get("default")), None)
    verdict = str(bench.get("verdict", "-"))
    if default is None or default.get("speedup_vs_full") is None:
        return f"buys: not measured (bench verdict: {verdict})"
    name = default["name"]
    if not verdict.startswith("conclusive"):
        return f"buys: no claim: the bench was {verdict}; rerun `eectl bench` on an idle machine or with more --prompts"
    lo, hi = default.get("speedup_vs_full_ci") or (None, None)
    ci = f" [{lo:.2f}, {hi:.2f}]" if lo is not None else ""
    agreement = default.get("token_agreement")
    if name in ("full", "verify", "lookup") or agreement is None or agreement >= 1.0:
        fidelity = "output identical to full depth"
    else:
        fidelity = f"token agreement {agreement:.1%} with full depth"
    reading = default.get("reading") or ""
    prompts = bench.get("prompts", "?")
    reach = f"A/A reach {bench.get('resolution', 0) or 0:.1%}"
    if default.get("speedup_vs_full_sampling_ci") is not None and bench.get("resolution") is not None:
        reach = f"95% interval widened by the {reach}"  # the bench's reported interval (evaluate/stats.widened)
    return (
        f"buys: the default ({name}) {default['speedup_vs_full']:.2f}x{ci} full depth ({reading or 'measured'}; "
        f"{prompts} held-out prompts, bench conclusive, {reach}), {fidelity}"
    )


def _peer_lines(bench: dict[str, Any]) -> list[str]:
    """The default and full depth against each peer the bench ran (evaluate/peers.py), as ratios of ms per token."""
    from eectl.evaluate.peers import LLAMA_CPP

    configs = {c.get("name"): c for c in bench.get("configs", [])}
    peer, default, full = configs.get(LLAMA_CPP), configs.get(bench.get("default")), configs.get("full")
    if peer is None or not peer.get("ms_per_token") or default is None or full is None:
        return []
    ms = peer["ms_per_token"]
    ratio = lambda c: ms / c["ms_per_token"] if c.get("ms_per_token") else float("nan")  # noqa: E731
    line = (
        f"against {LLAMA_CPP} on the same GGUF: the default ({default['name']}) {ratio(default):.2f}x its speed, full "
        f"depth {ratio(full):.2f}x ({ms:.1f} ms a token there; ms per token pooled over the same prompts and run)"
    )
    ref, mine, theirs = (
        bench.get("fp32_reference"),
        default.get("fp32_first_divergence"),
        peer.get("fp32_first_divergence"),
    )
    if ref and mine is not None and theirs is not None:  # evaluate/fidelity.py fp32_fidelity
        line += (
            f"; first divergence from the fp32 model's tokens ({ref}): the default at token {mine:.1f}, "
            f"{LLAMA_CPP} at {theirs:.1f} (mean over the prompts)"
        )
    return [line]


def _budget_lines(recipe: Recipe, stages: Sequence[Any]) -> list[str]:
    if recipe.budget is None:
        return []
    here = BUDGETS[recipe.budget]
    times = ", ".join(f"{s.stage} {s.seconds:.0f}" for s in stages)
    total = sum(s.seconds for s in stages)
    lines = [f"budget {here.name}: {total / 60:.1f} min here ({times} s)"]
    nxt = next_budget(here.name)
    if nxt is None:
        return lines
    ran = [s for s in stages if not str(s.work).startswith("cached")]
    if len(ran) < len(stages):
        lines.append(f"budget {nxt.name}: {nxt.about} (time not estimated: some stages here were reused)")
        return lines
    reused = [f"{s.stage}: {s.phases.reused}" for s in stages if getattr(s, "phases", None) and s.phases.reused]
    if reused:
        lines.append(f"budget {nxt.name}: {nxt.about} (time not estimated: {'; '.join(reused)})")
        return lines
    est = sum(_estimate(s, here, nxt) for s in stages)
    whole = [s.stage for s in stages if s.stage in _SCALES and not _phases(s)]
    how = "this run's stage times scaled by their sizes"
    if any(_phases(s) for s in stages):
        how = (
            f"an estimate from this run's phases: each that grows with a size scaled to {nxt.name}'s, model "
            "loading, sessions and warm-ups kept"
        )
        how += f"; {', '.join(whole)} scaled whole" if whole else ""
    lines.append(
        f"budget {nxt.name}: about {est / 60:.0f} min on this machine ({how}); {nxt.about}; `--budget {nxt.name}`"
    )
    return lines


def _estimate(stage: Any, here: Budget, nxt: Budget) -> float:
    """A stage's seconds at the next budget: each sized phase scaled by its size, its fixed phases and unaccounted
    time as they were; a stage without phases scaled whole (_SCALES). The state cache is priced as a fresh build
    (the next budget often needs other data: HumanEval cannot fill standard's), high by this budget's share when it
    extends this one's."""
    phases = _phases(stage)
    if not phases:
        return float(stage.seconds) * _ratio(stage.stage, here, nxt)
    seconds = float(stage.seconds)
    for p in phases.values():
        if p.size == FIXED:
            continue
        size = SIZES[p.size]
        seconds += p.seconds * (size(nxt) / max(size(here), 1) - 1.0)
    return seconds


def _phases(stage: Any) -> dict[str, Phase]:
    return stage.phases.phases if getattr(stage, "phases", None) is not None else {}


def _ratio(stage: str, here: Budget, nxt: Budget) -> float:
    scale = _SCALES.get(stage)
    return 1.0 if scale is None else scale(nxt) / max(scale(here), 1)


def _needs(manifest: Any, calibration: Any) -> str:
    """The bar for lossless exits at the artifact's costs: the share of tokens exiting at one exit (with 99%
    agreement) that verify needs to clear the plan's line, at the exit where it is lowest, against the share the
    calibrated heads reach there at the calibration's target."""
    if manifest is None or calibration is None or not manifest.get("costs") or not manifest.get("plan"):
        return ""
    if manifest["plan"].get("default") not in ("full", "lookup"):  # an exit configuration runs already
        return ""
    from eectl.contracts.plan import Costs

    costs = Costs.model_validate(manifest["costs"])
    line = 1.0 + float(manifest["plan"].get("min_gain", 0.03))
    boundaries = [int(s["layers"][1]) for s in manifest.get("segments", [])]
    if len(boundaries) < 2:
        return ""
    best: tuple[float, int] | None = None
    for layer in boundaries[:-1]:
        if str(layer) not in costs.local_ms:
            continue
        share = _break_even(costs, boundaries, layer, line)
        if share is not None and (best is None or share < best[0]):
            best = (share, layer)
    if best is None:
        return f"needs: at these costs no single exit pays {line:.2f}x even if every token exited there"
    share, layer = best
    now = _reached(calibration, layer)
    return (
        f"needs: verify at exit {layer} clears {line:.2f}x once {share:.0%} of tokens exit there at "
        f"{PRECISION:.0%} agreement; these heads reach {now:.0%} (calibration's menu)"
    )


def _break_even(costs: Any, boundaries: list[int], layer: int, line: float) -> float | None:
    from eectl.plan.choose import predict

    for pct in range(1, 101):
        c = pct / 100
        if predict(costs, boundaries, "verify", [(layer, c, PRECISION)]).speedup >= line:
            return c
    return None


def _reached(calibration: dict[str, Any], layer: int) -> float:
    """The largest share of held-out tokens a calibrated one-exit option at `layer` lets exit with at least
    PRECISION agreement (any target, any kind: the same bar the break-even assumes)."""
    shares = [  # an exit no held-out token passed has no precision (None): it reaches nothing
        sum(x.get("coverage") or 0.0 for x in o.get("per_exit", []))
        for o in calibration.get("options", [])
        if o.get("exits") == [layer] and all((x.get("precision") or 0.0) >= PRECISION for x in o.get("per_exit", []))
    ]
    return max(shares, default=0.0)
