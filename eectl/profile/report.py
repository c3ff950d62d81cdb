"""The profile's report: the per-layer plot, the workload suite's table and comparison plot, the files written."""

from __future__ import annotations

from pathlib import Path

from eectl.errors import UsageError
from eectl.files import atomic_write_text
from eectl.profile.lens import AGREEMENT_LEVELS, BOOTSTRAP, EAS_ALPHAS, MIN_CHUNKS, ProfileResult
from eectl.profile.suite import Suite


def plot(result: ProfileResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s.layer for s in result.layers]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(x, [s.top1_agreement for s in result.layers], marker="o", label="top-1 agreement")
    ax.plot(x, [s.transition_cosine for s in result.layers], marker=".", label="transition cosine")
    ax.plot(x, [s.eas_term for s in result.layers], linestyle="--", label=f"EAS term (alpha={result.alpha})")
    if result.similarity == "js":
        ax.plot(x, [s.js_similarity for s in result.layers], label="1 - JS")
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title(f"EAS {result.eas:.3f} ({result.similarity})")
    axes[1].semilogy(x[:-1], [max(s.kl, 1e-6) for s in result.layers[:-1]], marker="o")
    axes[1].set_xlabel("layer")
    axes[1].set_title("KL(final || layer), nats")
    axes[2].bar(x, [s.oracle_exits / result.tokens for s in result.layers])
    axes[2].set_xlabel("oracle exit layer")
    axes[2].set_title(f"oracle exits: skip {result.oracle_skip_ratio:.1%}, bound {result.oracle_speedup_bound:.2f}x")
    fig.suptitle(str(result.model.get("name", "")))
    fig.tight_layout()
    from eectl.files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def parse_workloads(spec: str | None) -> list[tuple[str, str]]:
    """'gsm8k=path.jsonl,humaneval,prose=file.txt' -> [(name, source)]; an unnamed path is named by its stem."""
    from eectl.data import BUILTIN, DEFAULT_DATA

    items = [x.strip() for x in (spec or DEFAULT_DATA).split(",") if x.strip()]
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, source = item.partition("=")
        if not sep:
            source = item
            name = item if item in BUILTIN else Path(item).stem
        if not name or not source:
            raise UsageError(f"--data entry '{item}' must be NAME=SOURCE or a source")
        if name in (n for n, _ in out):
            raise UsageError(f"--data names must be distinct: '{name}' appears twice")
        out.append((name, source))
    return out


def _ci(v: list[float], spec: str) -> str:
    return f"[{format(v[0], spec)}, {format(v[1], spec)}]"


def markdown_table(suite: Suite) -> str:
    """One row per model x workload: EAS at each alpha, oracle skip and bound, the 0.5 / 0.9 agreement layers."""
    head = (
        "| model | workload | tokens | "
        + " | ".join(f"EAS α={a} [95% CI]" for a in EAS_ALPHAS)
        + " | oracle skip [95% CI] | bound | agree ≥ 0.5 from layer | agree ≥ 0.9 from layer |"
    )
    lines = [head, "|" + "---|" * (7 + len(EAS_ALPHAS))]
    for e in suite.entries:
        r = e.result
        L = r.num_layers

        def layer(t: float, r: ProfileResult = r, L: int = L) -> str:
            x = r.agreement_layers[str(t)]
            lo, hi = r.ci[f"layer@{t}"]
            return f"{x}/{L} ({x / L:.2f}) [{lo:.0f}, {hi:.0f}]" if x is not None else "-"

        eas = " | ".join(f"{r.eas_by_alpha[str(a)]:.3f} {_ci(r.ci[f'eas@{a}'], '.3f')}" for a in EAS_ALPHAS)
        lines.append(
            f"| {e.model} | {e.workload} | {r.tokens} | {eas} | {r.oracle_skip_ratio:.1%} "
            f"{_ci(r.ci['oracle_skip_ratio'], '.1%')} | {r.oracle_speedup_bound:.2f}x | "
            f"{layer(0.5)} | {layer(0.9)} |"
        )
    few = sorted({e.result.chunks for e in suite.entries if e.result.chunks < MIN_CHUNKS})
    if few:
        lines += ["", f"Note: intervals from fewer than {MIN_CHUNKS} chunks ({few}) are rough; raise --tokens."]
    return "\n".join(lines) + "\n"


def plot_comparison(suite: Suite, path: str | Path) -> None:
    """Top-1 agreement against relative depth l / L, one line per model x workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for e in suite.entries:
        r = e.result
        x = [s.layer / r.num_layers for s in r.layers]
        ax.plot(x, [s.top1_agreement for s in r.layers], marker=".", label=f"{e.model} / {e.workload}")
    for t in AGREEMENT_LEVELS:
        ax.axhline(t, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("relative depth l / L")
    ax.set_ylabel("top-1 agreement with the final layer")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, 1.0)
    ax.legend(fontsize=8)
    ax.set_title("logit-lens agreement by relative depth")
    fig.tight_layout()
    from eectl.files import atomic_write

    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


def write_report(suite: Suite, path: str | Path, plot_path: str | Path | None = None) -> list[Path]:
    """The comparison as markdown (table, settings, the plot when drawn) and its JSON twin, written atomically."""
    import json

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    st = suite.settings
    text = [
        "# eectl profile: suitability comparison",
        "",
        f"{st['tokens']} tokens per model x workload (chunks of {st['chunk_len']}), similarity {st['similarity']}, "
        f"logit lens in {st['lens_dtype']}, {st['threads']} threads. Intervals: 95% percentile bootstrap, "
        f"{BOOTSTRAP} resamples of chunks.",
        "",
        markdown_table(suite),
    ]
    if plot_path is not None:
        text.append(f"![agreement by relative depth]({Path(plot_path).name})\n")
    written = []
    for target, body in ((p, "\n".join(text)), (p.with_suffix(".json"), json.dumps(suite.to_dict(), indent=2))):
        written.append(atomic_write_text(target, body + "\n"))
    return written
