"""bench's report: the markdown table, its PNG plots and the JSON twin, each written atomically.

What this module does not do: measure (evaluate/bench.py) or compute statistics (evaluate/stats.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from eectl.evaluate.results import AA, BenchResult
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


def markdown(result: BenchResult, plots: dict[str, str]) -> str:
    r = result
    lines = [
        f"# eectl bench: {r.model}",
        "",
        f"Artifact `{r.artifact}`, provider {r.provider}, {r.threads} threads, {r.prompts} prompts x "
        f"{r.max_new_tokens} new tokens, batch size {r.batch_size}, {r.reps} interleaved repetitions after a warm-up. "
        f"Early exit: signal {r.signal or '-'}, exits {r.exits or '-'}. ms/token is total decode time over total "
        "decode tokens, every prompt and repetition pooled (min-max: per repetition); a speedup is the ratio of two "
        "of those, measured in this run. Intervals (95%, over the "
        f"{r.prompts} prompts): paired bootstrap of that same ratio and of token agreement, Wilson for exact match; "
        "the predicted speedup's (90%) is over the cost model's timing rounds (plan/choose.py). Predicted agreement "
        "(copy, defer as planned): the option's held-out per-token disagreement on generated tokens, compounded "
        "over the continuation as if the first disagreement parted it from full depth (plan.sequence_agreement). "
        "Step agreement: per token on the configuration's own path, the share of its tokens that full depth "
        "(teacher-forced over the same prefix) would emit, against the calibrated option's held-out per-token "
        "agreement: the quantity the calibration target bounds. "
        f"Run order: a Williams design (every configuration in every position and after every other once per "
        f"cycle of repetitions). `{AA}` is a second copy of `full`: its speedup against `full` is this run's noise "
        f'floor; every other "vs full" is against `full` and `{AA}` pooled.',
        "",
        "| config | exits | ms/token (pooled, min-max) | tokens/s per row | throughput tokens/s (vs full) | TTFT ms | "
        "vs full [95% CI] | predicted [90%] | model at realized exits | vs hf | mean layers | bound | decide share | "
        "token agreement [95% CI] | predicted agreement | step agreement [95% CI] | calibrated step agreement | "
        "exact match [95% CI] | first divergence | perplexity | GSM8K acc | RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r.configs:
        name = f"{c.name} (default)" if c.name == r.default else c.name
        exits = ",".join(map(str, c.exits)) if c.exits else ("-" if c.name in ("full", "hf") else "none")
        if c.exits and c.decisions_per_step is not None:  # how many decisions a step made (gates skip some)
            exits += f" ({'gated, ' if c.gated else ''}{c.decisions_per_step:.2f} decisions/step)"
        lines.append(
            f"| {name} | {exits} | {c.ms_per_token:.1f} ({c.ms_per_token_spread[0]:.1f}-"
            f"{c.ms_per_token_spread[1]:.1f}) | "
            f"{c.tokens_per_s:.1f} | {c.throughput:.1f} ({_x(c.throughput_vs_full)}) | {c.ttft_ms:.0f} | "
            f"{_x(c.speedup_vs_full)}{_ci(c.speedup_vs_full_ci, '.2f')} | "
            f"{_x(c.predicted_speedup)}{_ci(c.predicted_interval, '.2f')} | {_x(c.model_speedup)} | "
            f"{_x(c.speedup_vs_hf)} | "
            f"{_fmt(c.mean_layers, '.1f')} | {_x(c.layer_bound)} | {_fmt(c.decide_share, '.1%')} | "
            f"{_fmt(c.token_agreement, '.1%')}{_ci(c.token_agreement_ci, '.1%')} | "
            f"{_fmt(c.predicted_agreement, '.1%')} | "
            f"{_fmt(c.step_agreement, '.2%')}{_ci(c.step_agreement_ci, '.2%')} | "
            f"{_fmt(c.predicted_step_agreement, '.2%')} | "
            f"{_fmt(c.exact_match, '.0%')}{_ci(c.exact_match_ci, '.0%')} | {_fmt(c.first_divergence, '.1f')} | "
            f"{_fmt(c.perplexity, '.2f')} | {_fmt(c.gsm8k_accuracy, '.0%')} | {c.rss_mb:.0f} |"
        )
    aa = next((c for c in r.configs if c.name == AA), None)
    if aa is not None and aa.speedup_vs_full is not None:
        lines += [
            "",
            f"Noise floor (A/A: `full` against itself): {_x(aa.speedup_vs_full)}"
            f"{_ci(aa.speedup_vs_full_ci, '.2f')}; a speedup inside that spread is not one.",
        ]
    if r.plan:
        lines += ["", r.plan + "."]
    lines += [f"- {c.name}: {c.note}" for c in r.configs if c.note]  # how each configuration was chosen
    if r.hf_matches_full is not None:
        lines += ["", f"transformers generate and eectl full depth produce identical tokens: {r.hf_matches_full}."]
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
    hist = [c for c in r.configs if c.exit_histogram and len(c.exit_histogram) > 1]
    if hist:
        lines += ["", "## Exit histograms (decode tokens, first repetition)", ""]
        for c in hist:
            lines.append(f"- {c.name}: " + ", ".join(f"layer {k}: {v}" for k, v in c.exit_histogram.items()))
    if plots:
        lines += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()]
    lines += ["", "Notes: " + "; ".join(r.notes) + "."]
    return "\n".join(lines) + "\n"


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
    stem = report.with_suffix("")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [c.name for c in result.configs]
    vals = [c.ms_per_token for c in result.configs]
    errs = [
        [v - c.ms_per_token_spread[0] for v, c in zip(vals, result.configs, strict=True)],
        [c.ms_per_token_spread[1] - v for v, c in zip(vals, result.configs, strict=True)],
    ]
    ax.bar(names, vals, yerr=errs, capsize=4)
    ax.set_ylabel("ms / token (decode)")
    ax.set_title(f"{result.model}: latency per configuration ({result.threads} threads)")
    fig.tight_layout()
    out["latency"] = stem.with_name(stem.name + "-latency.png")
    atomic_write(out["latency"], lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    hist = [c for c in result.configs if c.exit_histogram]
    if hist:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        width = 0.8 / len(hist)
        for j, c in enumerate(hist):
            xs = [int(k) for k in c.exit_histogram]
            ax.bar([x + j * width for x in xs], list(c.exit_histogram.values()), width=width, label=c.name)
        ax.set_xlabel("exit layer")
        ax.set_ylabel("tokens")
        ax.legend()
        ax.set_title("exit-layer histogram")
        fig.tight_layout()
        out["exits"] = stem.with_name(stem.name + "-exits.png")
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
        out["sweep"] = stem.with_name(stem.name + "-sweep.png")
        atomic_write(out["sweep"], lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
        plt.close(fig)
    return out
