"""The worked example end to end on a tiny model: every stage runs from one recipe and leaves its outputs."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.plan import DEFAULT_DRAFTS
from eectl.runtime.drafts import LONGEST_RUNS, SHORTEST_RUNS
from tests.tiny import GSM8K


def test_pipeline_runs_every_stage_from_one_recipe(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        f"""# tiny pipeline
# eectl pipeline --recipe tiny.yaml
name: tiny
model: {tiny_dirs["qwen2"]}
exits: [2, 4]
target: 0.9
top_k: 8
threads: 1
data: {{source: {GSM8K}, tokens: 600}}
heads: {{steps: 4}}
bench: {{prompts: 2, max_new_tokens: 4, reps: 1, configs: [full, defer, verify]}}
"""
    )
    res = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--prompt", "12 clips"])
    assert res.exit_code == 0, res.output
    name = tiny_dirs["qwen2"].name
    art = tmp_path / "artifacts"
    for f in (f"{name}-profile.png", f"{name}-heads.safetensors", f"{name}-calibration.json", f"{name}-bench.md"):
        assert (art / f).is_file(), f
    manifest = json.loads((art / name / "manifest.json").read_text())
    assert manifest["heads"] is not None and manifest["calibration"]["signal"] == "learned"  # heads carry probes
    assert [e["layer"] for e in manifest["exits"]] == [2, 4, 6] and manifest["validation"]["passed"]
    bench = json.loads((art / f"{name}-bench.json").read_text())
    # full-aa: the A/A control; the plan's default is always benchmarked (lookup: drafts from the context, when the
    # calibration's replay priced them above the exit configurations)
    default = ["lookup"] if manifest["plan"]["default"] == "lookup" else []
    exact = ["exact-head"] if manifest["exits"][-1].get("certified") else []  # full depth without the certified head
    assert [c["name"] for c in bench["configs"]] == ["full", "full-aa", "defer", "verify", *default, *exact]
    assert manifest["calibration"]["lookup"]["tokens"] > 0 and manifest["costs"]["wide_ms"]  # what priced it
    # ... replayed at every run length the plan chooses among (runtime/drafts.py SHORTEST_RUNS, LONGEST_RUNS)
    variants = [(v["min_draft"], v["max_draft"]) for v in manifest["calibration"]["lookup"]["shortest"]]
    assert variants == [*((d, DEFAULT_DRAFTS) for d in SHORTEST_RUNS), *((1, n) for n in LONGEST_RUNS)]
    assert "bench report:" in res.stdout and "bench verdict: " in res.stdout  # the run ends on its verdict

    # Again: profile, heads, calibration and the artifact are reused (same inputs), bench measures afresh
    heads = (art / f"{name}-heads.safetensors").read_bytes()
    calib = (art / f"{name}-calibration.json").read_bytes()
    again = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--prompt", "12 clips"])
    assert again.exit_code == 0, again.output
    rows = _stage_rows(again.stdout)
    for stage in ("train-heads", "calibrate", "export"):
        assert "cached" in rows[stage], again.stdout
    assert "never cached" in rows["bench"] and "from the cache" in again.stderr
    assert (art / f"{name}-heads.safetensors").read_bytes() == heads
    assert (art / f"{name}-calibration.json").read_bytes() == calib
    # A changed setting (heads steps) invalidates heads and everything downstream of them
    recipe.write_text(recipe.read_text().replace("steps: 4", "steps: 5"))
    third = CliRunner().invoke(app, ["pipeline", "--recipe", str(recipe), "--prompt", "12 clips"])
    assert third.exit_code == 0, third.output
    rows = _stage_rows(third.stdout)
    assert all("cached" not in rows[s] for s in ("train-heads", "calibrate", "export")), third.stdout


def _stage_rows(stdout: str) -> dict[str, str]:
    """The pipeline's stage table: stage name -> its row."""
    from eectl.pipeline.steps import STAGES

    rows = {}
    for line in stdout.splitlines():
        words = line.split()
        if len(words) > 2 and words[0] in STAGES and words[1].replace(".", "", 1).isdigit():  # stage, seconds, ...
            rows[words[0]] = line
    return rows


def test_run_pipeline_is_a_library_call(tiny_dirs, tmp_path, monkeypatch):
    """pipeline/runner.py's run_pipeline, without the CLI: every stage's own result object, in order, and the outputs
    in the folder asked for; a second call reuses the heads, calibration and artifact."""
    from eectl.calibrate.stage import CalibrateResult
    from eectl.evaluate.stage import BenchRun
    from eectl.export.stage import ExportResult
    from eectl.heads.train import TrainResult
    from eectl.output import Output
    from eectl.pipeline.runner import Hooks, run_pipeline
    from eectl.pipeline.steps import STAGES
    from eectl.profile.stage import ProfileRun
    from eectl.run.stage import RunResult

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EECTL_CACHE", str(tmp_path / "cache"))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        f"""name: tiny
model: {tiny_dirs["llama"]}
exits: [3]
target: 0.9
top_k: 8
data: {{source: {GSM8K}, tokens: 400}}
heads: {{steps: 2}}
bench: {{prompts: 1, max_new_tokens: 3, reps: 1, configs: [full], ppl_tokens: 0, sweep: []}}
"""
    )
    seen: list[str] = []
    texts: list[str] = []
    hooks = Hooks(start=lambda i, n, stage: seen.append(stage), text=lambda i, text: texts.append(text))
    folder = tmp_path / "out"
    done = run_pipeline(recipe, "12 clips", Output(quiet=True), threads=1, folder=folder, hooks=hooks)
    assert seen == list(STAGES) == [s.stage for s in done.stages]
    kinds = (ProfileRun, TrainResult, CalibrateResult, ExportResult, RunResult, BenchRun)
    assert all(isinstance(s.result, kind) for s, kind in zip(done.stages, kinds, strict=True))
    assert all(s.work.startswith("ran") for s in done.stages)
    run = done.stages[4].result
    assert texts and texts[-1] == run.reports[0].text  # the run stage streamed its answer through the hook
    assert run.artifact == str(done.plan.artifact) and run.batch_size == 1 and len(run.reports) == 1
    assert done.plan.folder == folder and (folder / done.plan.name / "manifest.json").is_file()
    assert done.stages[5].result.files[0] == done.plan.report and done.verdict.startswith("bench verdict: ")
    # where the time went, each phase with the budget size it scales with (eectl/phases.py; the verdict scales them)
    sizes = {s.stage: {n: p.size for n, p in s.phases.phases.items()} for s in done.stages if s.phases is not None}
    assert sizes["profile"] == {"logit lens": "profile_tokens", "plot and report": "fixed"}
    assert sizes["calibrate"] == {
        "load data, model and heads": "fixed",
        "measure exits": "calibrate_tokens",
        "generate continuations": "calibrate_gen_steps",
        "fit thresholds": "calibrate_tokens",
    }
    assert sizes["bench"]["timed repetitions"] == "bench_tokens" and sizes["bench"]["warm-up"] == "fixed"
    assert sizes["train-heads"] == {}  # heads trained on the fly (no state cache): scaled whole
    assert all(0 < s.phases.seconds <= s.seconds for s in done.stages if s.phases is not None and s.phases.phases)

    again = run_pipeline(recipe, "12 clips", Output(quiet=True), threads=1, folder=folder)
    work = {s.stage: s for s in again.stages}
    for stage in ("train-heads", "calibrate", "export"):
        assert work[stage].work.startswith("cached") and work[stage].result is None


def test_stage_requests_default_as_the_commands_do():
    """The pipeline builds each stage's request from the recipe alone, so a request's (and its options type's)
    defaults must be the command's: a default changed on one side only would make `eectl pipeline` run a stage
    differently from its command."""
    import dataclasses
    import inspect

    from eectl.calibrate.stage import CalibrateRequest
    from eectl.cli import cmd_bench, cmd_calibrate, cmd_export, cmd_profile, cmd_run, cmd_train_heads
    from eectl.evaluate.results import BenchOptions
    from eectl.evaluate.stage import BenchRequest
    from eectl.export.exporter import ExportOptions
    from eectl.export.quantize import Int4Options
    from eectl.heads.stage import HeadsRequest
    from eectl.profile.stage import ProfileRequest
    from eectl.run.generate import RunOptions
    from eectl.run.stage import RunRequest

    pairs = [
        (cmd_profile.profile, [ProfileRequest], ""),
        (cmd_train_heads.train_heads, [HeadsRequest], ""),
        (cmd_calibrate.calibrate, [CalibrateRequest], ""),
        (cmd_export.export, [ExportOptions], ""),
        (cmd_export.export, [Int4Options], "int4_"),
        (cmd_run.run, [RunRequest, RunOptions], ""),
        (cmd_bench.bench, [BenchRequest, BenchOptions], ""),
    ]
    compared = 0
    for command, types, prefix in pairs:
        given = {k: p.default for k, p in inspect.signature(command).parameters.items()}
        for kind in types:
            for f in dataclasses.fields(kind):
                name = prefix + f.name if prefix and prefix + f.name in given else f.name
                if name not in given or f.default is dataclasses.MISSING:
                    continue
                cli, own = given[name], f.default
                if cli is None or own is None or type(cli) is not type(own):
                    continue  # None: the recipe's (or the stage's own rule); a str the CLI parses into a list
                assert cli == own, f"{command.__name__} --{name.replace('_', '-')}: {cli!r} != {kind.__name__} {own!r}"
                compared += 1
    assert compared >= 30


def test_another_checkpoint_gets_exits_for_its_own_depth(tiny_dirs, tmp_path):
    """`--model` points a recipe for the built-in default model (the default recipe) at another checkpoint: its exits
    are kept where they fit its layers, else the default exits for its depth (the default recipe's [8, 12, 16, 20, 24]
    are for a 30-layer model; the tiny models have 6), its family is no longer checked; a recipe naming its own model
    keeps both. The default state cache folder is the checkpoint's own either way; its layer count is read from its
    config alone (a folder's config.json, a GGUF's metadata)."""
    from pathlib import Path

    from eectl.contracts.recipe import load_recipe
    from eectl.models.loading import layer_count
    from eectl.pipeline.steps import with_changes

    assert layer_count(str(tiny_dirs["qwen3"])) == 6 and layer_count(None) == 30  # the default model's GGUF
    assert layer_count(str(tmp_path / "missing")) is None
    default = Path("recipes/smollm2-135m-instruct.yaml")
    assert load_recipe(default).exits == [8, 12, 16, 20, 24] and load_recipe(default).family == "llama"
    with with_changes(default, str(tiny_dirs["qwen3"]), None) as copy:
        r = load_recipe(copy)
        assert r.model == str(tiny_dirs["qwen3"]) and r.exits is None and r.family is None
        # its state cache its own, not the recipe's model's (a cache refuses another model's states)
        assert r.heads.cache is not None and r.heads.cache.startswith("artifacts/qwen3-states-")
    with with_changes(default, None, str(GSM8K), "int4") as copy:
        r = load_recipe(copy)
        assert r.heads.cache is not None and r.heads.cache.startswith("artifacts/smollm2-135m-instruct-states-train-")
        assert "-int4-twin" in r.heads.cache  # the twin's own
    own = tmp_path / "own.yaml"
    own.write_text(default.read_text().replace("exits: [8, 12, 16, 20, 24]", "exits: [2, 4]"))
    with with_changes(own, str(tiny_dirs["qwen3"]), None) as copy:
        assert load_recipe(copy).exits == [2, 4]  # they fit: kept
    res = CliRunner().invoke(
        app, ["pipeline", "--recipe", str(default), "--model", str(tiny_dirs["qwen3"]), "--dry-run"]
    )
    assert res.exit_code == 0, res.output
    # a recipe naming its own model keeps its exits and family: --dry-run refuses what does not fit the checkpoint
    named = tmp_path / "named.yaml"
    named.write_text(default.read_text().replace("model: null", "model: someone/a-30-layer-llama"))
    with with_changes(named, str(tiny_dirs["qwen3"]), None) as copy:
        assert load_recipe(copy).exits == [8, 12, 16, 20, 24] and load_recipe(copy).family == "llama"
    res = CliRunner().invoke(app, ["pipeline", "--recipe", str(named), "--model", str(tiny_dirs["qwen3"]), "--dry-run"])
    assert res.exit_code == 2 and "for the llama family, but the model is qwen3" in res.stderr, res.output
