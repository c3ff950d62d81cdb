"""bench's report: the markdown table, its PNG plots and the JSON twin, each written atomically.

What this module does not do: measure (evaluate/bench.py) or compute statistics (evaluate/stats.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eectl.evaluate.results import AA, BenchResult, ConfigResult
from eectl.files import atomic_write, atomic_write_text


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _x(v: float | None) -> str:
    """A speed ratio: 1.23x, or - when there is none."""
    return "-" if v is None else f"{v:.2f}x"


def _ci(v: tuple[float, float] | list[float] | None, spec: str) -> str:
    if v is None or any(math.isnan(x) for x in v):
        return ""
    return f" [{format(v[0], spec)}, {format(v[1], spec)}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table without the columns that say nothing (every cell empty or -)."""
    keep = [j for j in range(len(header)) if any(row[j] not in ("", "-") for row in rows)]
    out = ["| " + " | ".join(header[j] for j in keep) + " |", "|" + "---|" * len(keep)]
    return out + ["| " + " | ".join(row[j] for j in keep) + " |" for row in rows]


def _exits(c: ConfigResult) -> str:
    exits = ",".join(map(str, c.exits)) if c.exits else ("-" if c.name in ("full", "hf") or c.runtime else "none")
    if c.exits and c.decisions_per_step is not None:  # how many decisions a step made (gates skip some)
        exits += f" ({'gated, ' if c.gated else ''}{c.decisions_per_step:.2f} decisions/step)"
    return exits


def _drafts(c: ConfigResult) -> str:
    """Verify's drafts by source (first repetition): from the exits, from the context (accepted of proposed), and
    the positions rolled back."""
    if not (c.drafted or c.prompt_drafted):
        return "-"
    parts = [f"exits {c.drafted}"] if c.drafted else []
    if c.prompt_drafted:
        parts.append(f"context {c.prompt_accepted}/{c.prompt_drafted} accepted")
    return ", ".join(parts) + f"; {c.rejected} rolled back"


def _speed(c: ConfigResult) -> str:
    return f"{_x(c.speedup_vs_full)}{_ci(c.speedup_vs_full_ci, '.2f')}"


def _widened(r: BenchResult) -> bool:
    """Whether the run's speed intervals (all but the A/A control's) are widened by its A/A reach (stats.widened)."""
    return r.resolution is not None and math.isfinite(r.resolution)


def _speed_header(r: BenchResult) -> str:
    return "vs full [95% CI +- A/A reach]" if _widened(r) else "vs full [95% CI]"


def _interval_line(r: BenchResult) -> str:
    """What the speed intervals are, in one sentence."""
    if _widened(r):
        return (
            f"intervals: the 95% bootstrap interval widened on both sides by the A/A reach +-{r.resolution:.1%} "
            "(the A/A row: its own); in a conclusive run one excludes 1.0 exactly when its verdict reads faster or "
            "slower"
        )
    return "intervals: the 95% bootstrap intervals, not widened (the A/A control has no finite interval)"


def _fp32(c: ConfigResult) -> str:
    """The share of the fp32 reference's tokens generated before the first divergence from them, and its mean index."""
    if c.fp32_prefix_share is None:
        return "-"
    return f"{c.fp32_prefix_share:.1%} ({_fmt(c.fp32_first_divergence, '.1f')})"


def _fp32_header(r: BenchResult) -> str:
    return f"equal to fp32 ({r.fp32_reference}) before 1st divergence"


def summary(result: BenchResult) -> str:
    """The console's short table: what ran, how fast against full depth (with its interval), how faithful, and
    whether this run can say so; then one line per configuration on how it was chosen, and the run's verdict."""
    rows = [
        [
            _name(c, result),
            _exits(c),
            f"{c.ms_per_token:.1f}",
            _speed(c),
            f"{_fmt(c.token_agreement, '.1%')}",
            _fp32(c),
            _verdict(c),
        ]
        for c in result.configs
    ]
    header = ["config", "exits", "ms/token", _speed_header(result), "token agreement", _fp32_header(result)]
    lines = _table([*header, "verdict"], rows)
    lines += [f"- {c.name}: {c.note}" for c in result.configs if c.note]
    lines += [f"- {c.name} drafts: {_drafts(c)}" for c in result.configs if c.drafted or c.prompt_drafted]
    if result.certificate:
        lines += [f"- certificate: {result.certificate}"]
    if result.certificate_check:
        lines += [f"- certificate check: {result.certificate_check}"]
    reach = f"; this run resolves speedups beyond +-{result.resolution:.1%}" if result.resolution is not None else ""
    lines += ["", f"verdict: {result.verdict or '-'} ({result.reps_run} repetitions timed{reach})"]
    lines += [_interval_line(result)]
    return "\n".join(lines) + "\n"


def _name(c: ConfigResult, r: BenchResult) -> str:
    return f"{c.name} (default)" if c.name == r.default else c.name


def _verdict(c: ConfigResult) -> str:
    """`inconclusive`, the baseline, or in a conclusive run what it says of the speed (faster / slower / no
    difference beyond the A/A control's spread)."""
    if c.reading:
        return c.reading
    return c.verdict.split(":")[0] if c.verdict else "-"


def _config_table(r: BenchResult) -> list[str]:
    """Every configuration's row, the columns that say nothing dropped."""
    header = [
        "config", "exits", "ms/token (pooled, min-max)", "tokens/s per row", "throughput tokens/s (vs full)",
        "TTFT ms", _speed_header(r), "verdict", "predicted [90%]", "model at realized exits", "vs hf",
        "mean layers", "bound", "decide share", "drafts", "token agreement [95% CI]", "predicted agreement",
        "step agreement [95% CI]", "calibrated step agreement", "exact match [95% CI]", "first divergence",
        _fp32_header(r), "perplexity", "GSM8K acc", "RSS MB",
    ]  # fmt: skip
    rows = []
    for c in r.configs:
        rows.append(
            [
                _name(c, r),
                _exits(c),
                f"{c.ms_per_token:.1f} ({c.ms_per_token_spread[0]:.1f}-{c.ms_per_token_spread[1]:.1f})",
                f"{c.tokens_per_s:.1f}",
                f"{c.throughput:.1f} ({_x(c.throughput_vs_full)})",
                f"{c.ttft_ms:.0f}",
                _speed(c),
                _verdict(c),
                f"{_x(c.predicted_speedup)}{_ci(c.predicted_interval, '.2f')}",
                _x(c.model_speedup),
                _x(c.speedup_vs_hf),
                _fmt(c.mean_layers, ".1f"),
                _x(c.layer_bound),
                _fmt(c.decide_share, ".1%"),
                _drafts(c),
                f"{_fmt(c.token_agreement, '.1%')}{_ci(c.token_agreement_ci, '.1%')}",
                _fmt(c.predicted_agreement, ".1%"),
                f"{_fmt(c.step_agreement, '.2%')}{_ci(c.step_agreement_ci, '.2%')}",
                _fmt(c.predicted_step_agreement, ".2%"),
                f"{_fmt(c.exact_match, '.0%')}{_ci(c.exact_match_ci, '.0%')}",
                _fmt(c.first_divergence, ".1f"),
                _fp32(c),
                _fmt(c.perplexity, ".2f"),
                _fmt(c.gsm8k_accuracy, ".0%"),
                f"{c.rss_mb:.0f}",
            ]
        )
    return _table(header, rows)


def _methods(r: BenchResult) -> list[str]:
    """The methods, as a footnote under the table."""
    lines: list[str] = []
    lines += [
        "",
        "Methods[^1].",
        "",
        "[^1]: Every configuration runs on one block of prompts (one prompt at batch size 1, else one batch) before "
        "the next block, in a Williams design's orders (every configuration in every position and after every other "
        "equally often over a cycle of blocks); within a block, eectl's configurations on the CPU EP take turns one "
        "decode step each (transformers' generate runs apart, before or after them), so a burst of other work falls "
        "on all of them alike; a speedup is the median over (repetition, block) "
        f"of full depth's seconds per token in that block (pooled with its A/A copy `{AA}`) over the "
        f"configuration's, its 95% sampling interval a bootstrap over blocks{_compared_method(r)}; "
        f"{_reported_interval(r)} Throughput compares wall time per token the "
        "same way. The run is conclusive only when the A/A control's interval lies inside "
        f"[{r.aa_band[0]:.2f}, {r.aa_band[1]:.2f}]; otherwise more repetitions run within a time budget, and a run "
        "still outside is inconclusive: its speedups are not results. ms/token is total decode time over total "
        "decode tokens (min-max: per repetition). The predicted speedup's interval (90%) is over the cost "
        "model's timing rounds (plan/choose.py). Predicted agreement (copy, defer as planned): the option's "
        "held-out per-token disagreement, compounded over the continuation (plan.sequence_agreement). Step "
        "agreement: per token on the configuration's own path, the share of its tokens full depth "
        "(teacher-forced over the same prefix) would emit: the quantity the calibration target bounds.",
    ]
    return lines


def _reported_interval(r: BenchResult) -> str:
    """The methods' sentence on the interval the table reports."""
    if _widened(r):
        return (
            "the interval reported for every configuration but the A/A control is that interval widened on both "
            f"sides by the A/A control's reach from 1 (this run: +-{r.resolution:.1%}, [lo - reach, hi + reach]), "
            "because a bootstrap over a few blocks undercovers and the A/A control measures how far an identical "
            "configuration reads from 1 by chance in this run: in a conclusive run it excludes 1.0 exactly when the "
            "verdict column reads faster or slower (the JSON keeps the sampling interval as "
            "`speedup_vs_full_sampling_ci`); the A/A row shows its sampling interval, which defines the reach and the "
            "gate."
        )
    return (
        "this run's A/A control has no finite interval, so the intervals reported are the sampling intervals, not "
        "widened by an A/A reach."
    )


def _compared_method(r: BenchResult) -> str:
    if r.block_instances is None:
        return ""
    return (
        " (under --compare every configuration alternates block by block between two runtime instances created in "
        "a mirrored order, and the median is taken within each instance, the two combined by their geometric mean)"
    )


def _sweep(r: BenchResult) -> list[str]:
    lines: list[str] = []
    if r.sweep:
        lines += [
            "",
            "## Threshold scale sweep",
            "",
            "| scale | policy | speedup vs full | token agreement | exact match | mean layers |",
            "|---|---|---|---|---|---|",
        ]
        for s in r.sweep:
            lines.append(
                f"| {s['scale']} | {s['policy']} | {s['speedup']:.2f}x | {s['token_agreement']:.1%} | "
                f"{s['exact_match']:.0%} | {s['mean_layers']:.1f} |"
            )
    return lines


def _river(r: BenchResult) -> list[str]:
    lines: list[str] = []
    if r.river_kv is not None:
        kvr = r.river_kv
        lines += [
            "",
            "## River's K/V against the exact K/V (first prompt)",
            "",
            f"{kvr['exited']} of {kvr['tokens']} tokens exited; over the positions the river wrote, mean K/V cosine "
            f"{_fmt(kvr['mean_river_cosine'], '.4f')}, minimum per layer {_fmt(kvr['min_river_cosine'], '.4f')}.",
            "",
            "| layer | river positions | K cosine (river) | V cosine (river) | K cosine (all generated) | "
            "V cosine (all generated) |",
            "|---|---|---|---|---|---|",
        ]
        for x in kvr["layers"]:
            lines.append(
                f"| {x['layer']} | {x['river_positions']} | {_fmt(x['key_cosine_river'], '.4f')} | "
                f"{_fmt(x['value_cosine_river'], '.4f')} | {_fmt(x['key_cosine_generated'], '.4f')} | "
                f"{_fmt(x['value_cosine_generated'], '.4f')} |"
            )
    return lines


def markdown(result: BenchResult, plots: dict[str, str]) -> str:
    r = result
    lines = [
        f"# eectl bench: {r.model}",
        "",
        f"Artifact `{r.artifact}`, provider {r.provider}, {r.threads} threads, {r.prompts} prompts x "
        f"{r.max_new_tokens} new tokens, batch size {r.batch_size}, {r.reps_run} repetitions after a warm-up "
        f"({r.reps} asked{', more added by the noise gate' if r.reps_run > r.reps else ''}). Early exit: signal "
        f"{r.signal or '-'}, exits {r.exits or '-'}.",
        "",
        f"**Verdict: {r.verdict or '-'}.**"
        + (f" Other processes kept {r.other_load:.2f} CPU cores busy on average." if r.other_load is not None else "")
        + (f" Speedups within +-{r.resolution:.1%} of 1 are this run's noise." if r.resolution is not None else ""),
        "",
    ]
    if r.conditions is not None and r.conditions.get("note"):
        lines += [f"**Predictions priced in another state of the machine:** {r.conditions['note']}.", ""]
    lines += _config_table(r)
    lines += _methods(r)
    aa = next((c for c in r.configs if c.name == AA), None)
    if aa is not None and aa.speedup_vs_full is not None:
        lines += [
            "",
            f"Noise floor (A/A: `full` against itself): {_x(aa.speedup_vs_full)}"
            f"{_ci(aa.speedup_vs_full_ci, '.2f')}; a speedup inside that spread is not one"
            + (" (the other rows' intervals are widened by its reach)." if _widened(r) else "."),
        ]
    if r.plan:
        lines += ["", r.plan + "."]
    lines += [f"- {c.name}: {c.note}" for c in r.configs if c.note]  # how each configuration was chosen
    if r.hf_matches_full is not None:
        lines += ["", f"transformers generate and eectl full depth produce identical tokens: {r.hf_matches_full}."]
    lines += _sweep(r)
    lines += _river(r)
    hist = [c for c in r.configs if c.exit_histogram and len(c.exit_histogram) > 1]
    if hist:
        lines += ["", "## Exit histograms (decode tokens, first repetition)", ""]
        for c in hist:
            total = sum(c.exit_histogram.values()) or 1
            lines.append(
                f"- {c.name}: " + ", ".join(f"layer {k}: {v} ({v / total:.1%})" for k, v in c.exit_histogram.items())
            )
    if plots:
        lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()]
    lines += ["", "Notes: " + "; ".join(r.notes) + "."]
    return "\n".join(lines) + "\n"


PLOTS = ("speedup", "exits", "sweep")  # the plots a report may have, written beside it as NAME-<plot>.png


def plot_path(report: Path, kind: str) -> Path:
    stem = report.with_suffix("")
    return stem.with_name(f"{stem.name}-{kind}.png")


def report_files(path: Path) -> list[Path]:
    """Every file a report at `path` may write beside it: its JSON twin and its plots."""
    return [path.with_suffix(".json"), *(plot_path(path, k) for k in PLOTS)]


def write_report(result: BenchResult, path: str | Path) -> list[Path]:
    """Write the markdown report, its PNG plots beside it, and a JSON twin, each atomically; returns the files."""
    p = Path(path)
    plots = _plots(result, p)
    atomic_write_text(p, markdown(result, {k: v.name for k, v in plots.items()}))
    js = atomic_write_text(p.with_suffix(".json"), json.dumps(result.to_dict(), indent=2) + "\n")
    return [p, js, *plots.values()]


def _plots(result: BenchResult, report: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, Path] = {}
    speed = [c for c in result.configs if c.speedup_vs_full is not None and c.name != "full" and not c.timed_as]
    if speed:  # speedup against full depth, each with its 95% interval, over the A/A band
        fig, ax = plt.subplots(figsize=(7, 0.9 + 0.4 * len(speed)))
        ys = list(range(len(speed)))[::-1]
        lo_band, hi_band = result.aa_band
        ax.axvspan(lo_band, hi_band, color="0.88", label=f"A/A band [{lo_band:.2f}, {hi_band:.2f}]")
        ax.axvline(1.0, color="0.4", lw=0.8)
        for y, c in zip(ys, speed, strict=True):
            x = float(c.speedup_vs_full or 0.0)
            lo, hi = c.speedup_vs_full_ci or (x, x)
            conclusive = c.verdict == "conclusive" and not c.reading.startswith("no difference")
            ax.errorbar(
                x,
                y,
                xerr=[[x - lo], [hi - x]],
                fmt="o",
                capsize=4,
                color="C0" if conclusive else "0.55",
                mfc="C0" if conclusive else "white",
            )
        ax.set_yticks(ys, [c.name for c in speed])
        what = f"95% CI widened by the A/A reach +-{result.resolution:.1%}" if _widened(result) else "95% CI"
        ax.set_xlabel(f"speedup vs full depth (median of paired ratios, {what}); hollow: not resolved")
        ax.set_title(f"{result.model}: speed against full depth ({result.threads} threads)")
        ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        out["speedup"] = plot_path(report, "speedup")
        atomic_write(out["speedup"], lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
    hist = [c for c in result.configs if c.exit_histogram and len(c.exit_histogram) > 1]
    if hist:  # where tokens left, as shares of each configuration's tokens (counts differ with answer lengths)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        width = 0.8 / len(hist)
        layers = sorted({int(k) for c in hist for k in c.exit_histogram})
        for j, c in enumerate(hist):
            total = sum(c.exit_histogram.values()) or 1
            xs = list(range(len(layers)))
            shares = [c.exit_histogram.get(str(k), 0) / total for k in layers]
            ax.bar([x + j * width for x in xs], shares, width=width, label=c.name)
        ax.set_xticks([x + (len(hist) - 1) * width / 2 for x in range(len(layers))], [str(k) for k in layers])
        ax.set_xlabel("exit layer (the last: full depth)")
        ax.set_ylabel("share of decode tokens")
        ax.set_ylim(0, 1)
        ax.legend()
        ax.set_title("where tokens exited")
        fig.tight_layout()
        out["exits"] = plot_path(report, "exits")
        atomic_write(out["exits"], lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
    if result.sweep:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([s["speedup"] for s in result.sweep], [s["token_agreement"] for s in result.sweep], marker="o")
        for s in result.sweep:
            ax.annotate(f"x{s['scale']}", (s["speedup"], s["token_agreement"]))
        ax.set_xlabel("speedup vs full depth")
        ax.set_ylabel("token agreement with full depth")
        ax.set_title("agreement vs speedup across threshold scales")
        fig.tight_layout()
        out["sweep"] = plot_path(report, "sweep")
        atomic_write(out["sweep"], lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
    return out
