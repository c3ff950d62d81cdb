"""Bad input that used to give a traceback or the wrong message (#34): one line, the right exit code, naming
what was wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.recipe import MAX_SEED

runner = CliRunner()


def test_manifest_counts_out_of_range_name_the_manifest(exported, tmp_path):
    for key, value in (("max_positions", -1), ("top_k", 0)):
        art = tmp_path / key
        shutil.copytree(exported["llama"][1], art)
        doc = json.loads((art / "manifest.json").read_text())
        doc[key] = value
        (art / "manifest.json").write_text(json.dumps(doc))
        res = runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2"])
        assert res.exit_code == 5 and "manifest" in res.stderr and key in res.stderr, res.output
        assert "--top-k" not in res.stderr


@pytest.mark.parametrize("eos", [[-5], [10**9]])
def test_an_end_of_sequence_id_outside_the_vocabulary_names_the_manifest(exported, tmp_path, eos):
    """An end-of-sequence id no token can take: generation never stopped there (it ran to the token budget)."""
    art = tmp_path / "a"
    shutil.copytree(exported["llama"][1], art)
    doc = json.loads((art / "manifest.json").read_text())
    doc["eos_token_ids"] = eos
    (art / "manifest.json").write_text(json.dumps(doc))
    res = runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2"])
    last = res.stderr.strip().splitlines()[-1]  # after the progress line
    assert res.exit_code == 5 and last.startswith("error: inconsistent manifest"), res.output
    assert f"end-of-sequence id {eos[0]} outside 0..383" in last and res.stderr.count("error") == 1


def test_a_huge_thread_count_is_one_line(exported):
    res = runner.invoke(app, ["run", str(exported["llama"][1]), "hi", "--threads", "99999999999"])
    assert res.exit_code == 2 and res.stderr == "error: --threads must be in 1..1024, got 99999999999\n"


def test_recipe_values_are_not_coerced(tmp_path):
    for bad, word in (("exits: [true, 4]", "exits"), ("top_k: '64'", "top_k"), ("target: yes", "target")):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"name: r\n{bad}\n")
        res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run"])
        assert res.exit_code == 2 and word in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize(
    "option,value,text",
    [
        ("--signal", "bogus", "--signal must be one of"),
        ("--policy", "bogus", "--policy must be one of"),
        ("--thresholds", "abc", "--thresholds: cannot parse"),
        ("--thresholds", "12:x", "--thresholds: cannot parse"),
        ("--exits", "abc", "--exits must be comma-separated"),
        ("--top-k", "1", "--top-k must be >= 2"),
        ("--river-predict", "middle", "--river-predict must be end or exit"),
    ],
)
def test_run_options_are_checked_before_the_artifact_loads(exported, monkeypatch, option, value, text):
    def no_load(*a, **k):
        raise AssertionError("the artifact was loaded before the options were checked")

    monkeypatch.setattr("eectl.run.generate.ArtifactRuntime", no_load)
    res = runner.invoke(app, ["run", str(exported["llama"][1]), "hi", option, value])
    assert res.exit_code == 2 and text in res.stderr, res.output


@pytest.mark.parametrize(
    "args,line",
    [
        (["--top-k", "1"], "error: --top-k must be >= 2, got 1"),
        (["--batch-size", "0"], "error: --batch-size must be >= 1, got 0"),
        (
            ["--policy", "bogus"],
            "error: --policy must be one of copy, defer, verify, river, lookup, certified, full, got 'bogus'",
        ),
        (["--chat", "--seed", "-1"], f"error: --seed must be in 0..{MAX_SEED}, got -1"),
    ],
)
def test_a_run_option_error_comes_alone_without_the_loading_line(exported, args, line):
    """An option error printed `loading ART (1 prompt)` first, as if the run had started, then the error: the options
    that need no artifact are checked before that line (--chat's too)."""
    cmd = ["run", str(exported["llama"][1]), *args] + ([] if "--chat" in args else ["hi"])
    res = runner.invoke(app, cmd, input="hi\n")
    assert res.exit_code == 2 and res.stderr == line + "\n", res.output


def test_an_uncalibrated_artifact_runs_at_full_depth_and_says_why(exported):
    """`eectl export` without --calibration, then `eectl run A "hi"`, refused: "no calibrated thresholds for signal
    topk-prob at exits [...]" (issue 63). With no exit asked for it runs at full depth, its tokens those of
    `--exits none`, and says why on stderr; exits named without thresholds are still refused, in one line."""
    art = exported["llama"][1]
    assert json.loads((art / "manifest.json").read_text())["calibration"] is None  # the fixture is uncalibrated
    args = ["run", str(art), "hi", "--raw", "-n", "6", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["exits"] == [] and doc["note"].startswith("the artifact has no calibration: running at full depth")
    said = runner.invoke(app, args[:-1])  # without --json: the note on stderr, the answer on stdout
    assert said.exit_code == 0 and "the artifact has no calibration: running at full depth" in said.stderr
    assert "no calibration" not in said.stdout and said.stdout.strip(), said.output
    full = json.loads(runner.invoke(app, [*args, "--exits", "none"]).stdout)["results"][0]
    got = doc["results"][0]
    assert got["token_ids"] == full["token_ids"] and len(got["token_ids"]) == 6
    assert got["mean_executed_layers"] == full["mean_executed_layers"] == exported["llama"][0].adapter.dims.num_layers
    asked = runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2", "--exits", "2"])
    assert asked.exit_code == 2 and asked.stderr.splitlines()[-1].startswith(
        "error: no calibrated thresholds for signal topk-prob at exits [2]"
    ), asked.output


def test_an_exit_the_artifact_lacks_is_named_as_such(exported):
    """--exits 99 without --thresholds said "no calibrated thresholds for signal ... at exits [99]" (export with
    --calibration): the exit does not exist, and no calibration would make it."""
    res = runner.invoke(app, ["run", str(exported["llama"][1]), "hi", "--raw", "-n", "2", "--exits", "2,99"])
    assert (
        res.exit_code == 2
        and res.stderr.splitlines()[-1] == "error: --exits [99] not in the artifact (its exits: [2, 4])"
    )


def _commands() -> list[str]:
    import typer

    return sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", _commands())
def test_option_parsing_errors_are_one_line_for_every_command(command):
    """click's own errors (unknown option, an option missing its value) were typer's boxed usage over five lines;
    now one line naming the command's help, exit 2, for every command."""
    for args, text in (
        (["--bogus", "x"], "error: No such option: --bogus"),
        (["--threads"], "error: Option '--threads' requires an argument."),
    ):
        res = runner.invoke(app, [command, *args])
        assert res.exit_code == 2 and res.stdout == "" and len(res.stderr.splitlines()) == 1, res.output
        assert res.stderr.startswith(text) and res.stderr.endswith(f" (eectl {command} -h for help)\n")


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["run", "ART", "hi", "--max-new-tokens", "abc"],
            "error: Invalid value for '--max-new-tokens' / '-n': Input should be a valid integer, unable to parse "
            "string as an integer (eectl run -h for help)",
        ),
        (["run"], "error: Missing argument 'artifact'. (eectl run -h for help)"),
        (["run", "ART", "hi", "extra"], "error: Got unexpected extra argument(s) (extra) (eectl run -h for help)"),
        (["bogus"], "error: No such command 'bogus'. (eectl -h for help)"),
        (["--bogus"], "error: No such option: --bogus (eectl -h for help)"),
    ],
)
def test_usage_errors_are_one_line(args, line):
    res = runner.invoke(app, args)
    assert res.exit_code == 2 and res.stderr == line + "\n", res.output


def test_help_version_and_a_bare_eectl_are_unchanged():
    assert runner.invoke(app, ["--version"]).stdout == "eectl 0.1.0\n"
    for args in (["-h"], ["run", "--help"]):
        res = runner.invoke(app, args)
        assert res.exit_code == 0 and "Usage: eectl" in res.stdout and res.stderr == "", res.output
    bare = runner.invoke(app, [])
    assert bare.exit_code == 2 and "Usage: eectl" in bare.stdout and "error" not in bare.output


def test_the_console_script_prints_the_same_one_line():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("eectl")  # the virtual environment's console script
    res = subprocess.run([str(script), "run", "ART", "hi", "-n", "abc"], capture_output=True, timeout=120)
    assert res.returncode == 2 and res.stdout == b""
    assert res.stderr.decode().splitlines() == [
        "error: Invalid value for '--max-new-tokens' / '-n': Input should be a valid integer, unable to parse "
        "string as an integer (eectl run -h for help)"
    ]


@pytest.mark.parametrize("option", ["--reps", "--prompts", "--max-new-tokens", "--batch-size"])
def test_bench_names_the_count_below_one(exported, option):
    """bench said "--reps, --prompts, --max-new-tokens and --batch-size must be >= 1" whichever it was: now the one."""
    from tests.tiny import GSM8K

    res = runner.invoke(app, ["bench", str(exported["llama"][1]), "--data", str(GSM8K), option, "0"])
    assert res.exit_code == 2 and res.stderr.splitlines()[-1] == f"error: {option} must be >= 1, got 0", res.output


def test_an_uncalibrated_artifact_is_benched_at_full_depth_and_says_why(exported):
    """`eectl bench A` on an artifact exported without --calibration refused ("no calibrated thresholds ...") because
    its default configurations ask for copy, defer and verify: they run full depth with the reason (as `eectl run`
    does); exits asked for without thresholds are still refused, in one line."""
    from tests.tiny import GSM8K

    art = exported["llama"][1]
    base = ["bench", str(art), "--data", str(GSM8K), "--prompts", "1", "--max-new-tokens", "4", "--reps", "1"]
    res = runner.invoke(app, [*base, "--ppl-tokens", "0", "--sweep", "", "--json"])
    assert res.exit_code == 0, res.output
    rows = {c["name"]: c for c in json.loads(res.stdout)["configs"]}
    assert {"full", "copy", "defer", "verify"} <= set(rows)
    for name in ("copy", "defer", "verify"):
        assert rows[name]["exits"] == [] and rows[name]["timed_as"] == "full", rows[name]
        assert "the artifact has no calibration: running at full depth" in rows[name]["note"]
    asked = runner.invoke(app, [*base, "--exits", "2", "--policies", "full,verify"])
    assert asked.exit_code == 2 and "no calibrated thresholds for signal topk-prob at exits [2]" in asked.stderr
