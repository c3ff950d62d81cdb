"""lm-evaluation-harness on an artifact: at full depth the eectl model scores exactly as lm-eval's own `hf` model on
the same checkpoint, task and samples (greedy); exits change the scores; the offline tasks read local files only."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

pytest.importorskip("lm_eval")

from eectl.cli import app  # noqa: E402
from eectl.errors import UsageError  # noqa: E402
from eectl.evaluate.lmeval import EvalOptions, markdown, run_eval  # noqa: E402
from eectl.export.exporter import ExportOptions, export_artifact  # noqa: E402
from eectl.models import load_model  # noqa: E402
from tests.tiny import GSM8K  # noqa: E402


@pytest.fixture(scope="module")
def artifact(tiny_dirs, tmp_path_factory):
    art = tmp_path_factory.mktemp("lmeval") / "llama"
    export_artifact(load_model(str(tiny_dirs["llama"])), art, ExportOptions(exits=[2, 4], top_k=8))
    return art


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_full_depth_scores_equal_lm_evals_hf_model(artifact):
    opts = EvalOptions(
        tasks=["eectl_gsm8k", "eectl_gsm8k_loglik"],
        configs=["full", "hf", "defer", "verify", "lookup"],
        limit=4,
        max_gen_toks=24,
        gsm8k_path=str(GSM8K),
        thresholds="0.0",  # every decode token may take the first exit: the early-exit configs must differ
    )
    scores, _ = run_eval(artifact, opts)
    by = {s.config: s for s in scores}
    full, hf = by["full"], by["hf"]
    # generation: the same generated text for every document, so the same score
    gen = [resps for _, resps, _ in full.samples["eectl_gsm8k"]]
    assert gen == [resps for _, resps, _ in hf.samples["eectl_gsm8k"]]
    assert len(gen) == 8 and any(_texts(r) for r in gen)  # 4 docs x 2 filters, non-empty generations
    assert full.metrics["eectl_gsm8k"] == hf.metrics["eectl_gsm8k"]
    # log-likelihood: ORT fp32 vs torch fp32 on the same token ids, equal to float tolerance; greedy flags equal
    for (_, _, a), (_, _, b) in zip(full.samples["eectl_gsm8k_loglik"], hf.samples["eectl_gsm8k_loglik"], strict=True):
        assert a[0][0] == pytest.approx(b[0][0], rel=1e-5, abs=1e-3) and a[0][1] == b[0][1]
    assert full.metrics["eectl_gsm8k_loglik"]["acc,none"] == hf.metrics["eectl_gsm8k_loglik"]["acc,none"]
    assert full.mean_layers == 6.0
    # verify is lossless: the same generations and scores as full depth
    assert [r for _, r, _ in by["verify"].samples["eectl_gsm8k"]] == gen
    assert by["verify"].metrics == full.metrics
    # lookup (full depth, drafts from the context, checked by verify's pass) too
    assert [r for _, r, _ in by["lookup"].samples["eectl_gsm8k"]] == gen
    assert by["lookup"].metrics == full.metrics
    # defer with threshold 0 exits at layer 2: fewer layers, and different log-likelihoods
    assert by["defer"].mean_layers is not None and by["defer"].mean_layers < 3
    ll = [r[0][0] for _, _, r in by["defer"].samples["eectl_gsm8k_loglik"]]
    assert ll != [r[0][0] for _, _, r in full.samples["eectl_gsm8k_loglik"]]
    table = markdown(scores)
    assert "| defer | eectl_gsm8k_loglik | loglikelihood,none |" in table and "Δ vs full" in table
    # throughput: the same request work counted for the artifact and for lm-eval's hf model, with its time
    assert full.stats.scored_tokens == hf.stats.scored_tokens == by["defer"].stats.scored_tokens > 0
    assert full.stats.generated_tokens == hf.stats.generated_tokens > 0  # the same texts, re-encoded
    assert full.stats.scoring_tps > 0 and hf.stats.generation_tps > 0
    assert "scored tok/s" in table and "generated tok/s" in table


def _texts(x) -> list[str]:
    return [x] if isinstance(x, str) and x.strip() else [t for y in x for t in _texts(y)] if isinstance(x, list) else []


def test_humaneval_task_runs_offline_and_scores_code(artifact):
    from eectl.evaluate.lmeval_tasks.utils import pass_at_1

    assert pass_at_1(["assert f(2) == 4"], [["def f(x):\n    return 2 * x\n"]]) == 1.0
    assert pass_at_1(["assert f(2) == 4"], [["def f(x):\n    return x\n"]]) == 0.0
    assert pass_at_1(["assert f(2) == 4"], [["while True:\n    pass\n"]], timeout_s=1.0) == 0.0
    opts = EvalOptions(tasks=["eectl_humaneval"], configs=["full"], limit=2, max_gen_toks=8)
    with pytest.raises(UsageError, match="runs the generated code"):
        run_eval(artifact, opts)
    opts.allow_code_execution = True
    scores, _ = run_eval(artifact, opts)
    assert scores[0].metrics["eectl_humaneval"]["pass_at_1,create_test"] == 0.0  # a random model passes nothing
    assert len(scores[0].samples["eectl_humaneval"]) == 2


def test_cli_eval(artifact):
    res = CliRunner().invoke(
        app,
        [
            "eval",
            str(artifact),
            "--tasks",
            "eectl_gsm8k_loglik",
            "--configs",
            "full,copy",
            "--gsm8k",
            str(GSM8K),
            "--limit",
            "2",
            "--thresholds",
            "2:0.0,4:0.0",  # per exit: full depth, where no exit runs, takes no thresholds
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [s["config"] for s in doc["scores"]] == ["full", "copy"]
    assert doc["scores"][0]["stats"]["scored_tokens"] > 0 and doc["scores"][0]["stats"]["scoring_tps"] > 0
    for flag in ("--tasks", "--configs"):  # an empty list is refused, not an empty table
        bad = CliRunner().invoke(app, ["eval", str(artifact), flag, " ,", "--gsm8k", str(GSM8K)])
        assert bad.exit_code == 2 and f"{flag} names nothing" in bad.stderr
    for flag, twice in (("--tasks", "eectl_gsm8k,eectl_gsm8k"), ("--configs", "full,copy,full")):  # not run twice
        bad = CliRunner().invoke(app, ["eval", str(artifact), flag, twice, "--gsm8k", str(GSM8K)])
        assert bad.exit_code == 2 and f"{flag} names {twice.split(',')[0]} more than once" in bad.stderr
    bad = CliRunner().invoke(app, ["eval", str(artifact), "--batch-size", "0", "--gsm8k", str(GSM8K)])
    assert bad.exit_code == 2
    bad = CliRunner().invoke(app, ["eval", str(artifact), "--tasks", "eectl_gsm8k"])
    assert bad.exit_code == 2 and "--gsm8k" in bad.stderr
    bad = CliRunner().invoke(app, ["eval", str(artifact), "--tasks", "mmlu", "--gsm8k", str(GSM8K)])
    assert bad.exit_code == 2 and "unknown task" in bad.stderr
