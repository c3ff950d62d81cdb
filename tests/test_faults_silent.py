"""Inputs that used to be accepted silently, or refused with an unclear message (#34): each is refused in one line
with the exit code of its kind, or handled as a user would expect."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from eectl import files
from eectl.cli import app
from eectl.contracts.calibration import read_calibration
from eectl.contracts.heads import FORMAT
from eectl.contracts.manifest import MANIFEST
from eectl.contracts.recipe import load_recipe
from eectl.data import load_text_data
from eectl.errors import ArtifactError, DataError, UsageError
from eectl.exits.base import Probe, attach_probe
from eectl.exits.designs import HeadStack, load_heads, make_head, save_heads
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.export.validation import ExportValidationError
from eectl.run.generate import read_prompts
from eectl.runtime.sessions import ArtifactRuntime
from tests.conftest import make_heads_meta
from tests.tiny import GSM8K

runner = CliRunner()


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory) -> Path:
    """The tiny Llama exported once (exit after layer 3); tests copy it before tampering."""
    out = tmp_path_factory.mktemp("silent") / "art"
    export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))
    return out


def _copy(artifact: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(artifact, dst)
    return dst


def _one_line(res, code: int, *words: str) -> None:
    """One error line, the last on stderr (a progress log may precede it), with the exit code of its kind."""
    assert res.exit_code == code, res.output
    lines = res.stderr.splitlines()
    assert lines and lines[-1].startswith("error: ") and sum(x.startswith("error") for x in lines) == 1, res.stderr
    for w in words:
        assert w in lines[-1], res.stderr


def _never_loads(monkeypatch, why: str, *targets: str) -> None:
    """Every one of `targets` (a loader's dotted path) fails the test if called: `why` is what the test expects to
    have refused first."""

    def no_load(*a, **k):
        raise AssertionError(why)

    for target in targets:
        monkeypatch.setattr(target, no_load)


# --- 1. a Fortran-ordered .npy --------------------------------------------------------------------------------------


def test_a_fortran_ordered_npy_is_refused_at_load(artifact, tmp_path):
    art = _copy(artifact, tmp_path)
    f = art / "weights" / "lm_head.npy"
    np.save(f, np.asfortranarray(np.load(f)))  # same values, same shape and dtype: column-major bytes
    doc = json.loads((art / MANIFEST).read_text())
    doc["files"]["weights/lm_head.npy"] = files.sha256_file(f)
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="weights/lm_head.npy is Fortran-ordered"):
        ArtifactRuntime(art, provider="cpu")
    res = runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2", "--threads", "1"])
    _one_line(res, 5, "Fortran-ordered")


# --- 2. NaN heads -------------------------------------------------------------------------------------------------


def _nan_heads(llama) -> dict[int, torch.nn.Module]:
    head = make_head("residual-linear", llama.adapter.dims.hidden_size)
    with torch.no_grad():
        next(head.parameters()).fill_(math.nan)
    return {3: head.to(llama.adapter.dtype)}


def test_nan_heads_fail_export_validation(llama, tmp_path):
    out = tmp_path / "art"
    with pytest.raises(ExportValidationError, match="non-finite"):
        export_artifact(llama, out, ExportOptions(exits=[3], top_k=8), heads=_nan_heads(llama))
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_nan_heads_fail_int4_validation_too(llama, tmp_path):
    """int4 graphs are judged by greedy agreement: NaN logits must not pass as agreeing tokens."""
    out = tmp_path / "art"
    with pytest.raises(ExportValidationError, match="non-finite"):
        export_artifact(llama, out, ExportOptions(exits=[3], top_k=8, weights="int4"), heads=_nan_heads(llama))
    assert not out.exists()


def test_a_heads_file_with_nan_weights_is_refused(llama, tmp_path):
    f = tmp_path / "h.safetensors"
    save_heads(HeadStack(_nan_heads(llama)), make_heads_meta(llama, [3]), f)
    with pytest.raises(ArtifactError, match="heads in h.safetensors have non-finite weights: exit_3"):
        load_heads(f, llama)


# --- 3. probe metadata --------------------------------------------------------------------------------------------


def _probe(llama, d: int = 1) -> Probe:
    h = llama.adapter.dims.hidden_size
    return Probe(np.zeros((h, d), np.float32), np.zeros((2, d), np.float32), np.zeros(d, np.float32))


PROBE_META = {
    "features": ["normed", "prob", "margin"],
    "top_k": 8,
    "candidates": {"name": "first-exit-topk"},
    "tokens": 100,
    "agreement": {"3": 0.5},
    "train_s": 0.1,
    "config": {},
}


@pytest.mark.parametrize(
    "fault,text",
    [
        ("garbage", "probe"),
        ("top-k", "probe.top_k"),
        ("feature", "unknown probe feature 'colour'"),
        ("no-tensors", "probe metadata but no probe tensors"),
        ("shape", "probe at exit 3"),
        ("other-exit", "probe tensors for layers [5] that are not its exits [3]"),
    ],
)
def test_garbage_probe_metadata_is_refused(llama, tmp_path, fault, text):
    meta = make_heads_meta(llama, [3]).model_dump(mode="json")
    meta["probe"] = dict(PROBE_META)
    head = make_head("residual-linear", llama.adapter.dims.hidden_size)
    tensors = {f"exit_3.{k}": v.contiguous() for k, v in head.state_dict().items()}
    probe = {f"probe.exit_3.{k}": torch.from_numpy(v) for k, v in _probe(llama).tensors().items()}
    if fault == "garbage":
        meta["probe"] = {"garbage": True}
    elif fault == "top-k":
        meta["probe"]["top_k"] = "many"
    elif fault == "feature":
        meta["probe"]["features"] = ["normed", "colour"]
    elif fault == "no-tensors":
        probe = {}
    elif fault == "shape":
        probe["probe.exit_3.w_state"] = torch.zeros(3, 1)
    else:
        probe = {k.replace("exit_3", "exit_5"): v for k, v in probe.items()}
    f = tmp_path / "h.safetensors"
    save_file({**tensors, **probe}, str(f), metadata={"format": FORMAT, "eectl": json.dumps(meta)})
    with pytest.raises(
        ArtifactError, match=r"heads in h.safetensors have invalid (metadata|probes): .*" + re.escape(text)
    ):
        load_heads(f, llama)


def test_a_well_formed_probe_still_loads(llama, tmp_path):
    head = make_head("residual-linear", llama.adapter.dims.hidden_size)
    attach_probe(head, _probe(llama))
    f = tmp_path / "h.safetensors"
    save_heads(HeadStack({3: head}), make_heads_meta(llama, [3], probe=dict(PROBE_META)), f)
    loaded = load_heads(f, llama)
    assert loaded.meta.probe is not None and loaded.exit_head(llama.adapter, 3).probe is not None


# --- 4. data with no text -----------------------------------------------------------------------------------------


def test_data_whose_records_are_all_empty_is_refused(tiny_dirs, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": ""}\n{"text": "  "}\n{"text": "\\n"}\n')
    with pytest.raises(DataError, match="every record of d.jsonl is empty"):
        load_text_data(str(f))
    res = runner.invoke(app, ["profile", str(tiny_dirs["llama"]), "--data", str(f), "--tokens", "64"])
    _one_line(res, 4, "is empty")
    f.write_text('{"text": ""}\n{"text": "one record with text"}\n')
    assert load_text_data(str(f)).texts == ["", "one record with text"]


# --- 5. byte-order marks and Unicode line breaks --------------------------------------------------------------------


def test_a_bom_is_not_part_of_a_prompt_or_a_record(tmp_path, monkeypatch):
    txt = tmp_path / "p.txt"
    txt.write_bytes("\ufefffirst prompt\nsecond\u2028still second\u2029and\x85this\x0cone\n".encode())
    assert read_prompts(txt) == ["first prompt", "second\u2028still second\u2029and\x85this\x0cone"]
    jl = tmp_path / "p.jsonl"
    jl.write_bytes('\ufeff{"prompt": "hi"}\n'.encode())
    assert read_prompts(jl) == ["hi"]
    assert load_text_data(str(jl)).texts == ["hi"]
    data = tmp_path / "d.txt"
    data.write_bytes("\ufeffa paragraph\n\nanother".encode())
    assert load_text_data(str(data)).texts == ["a paragraph", "another"]
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes("\ufeffname: bom\ntop_k: 16\n".encode())
    assert load_recipe(recipe).top_k == 16
    from eectl.evaluate.lmeval_tasks.utils import gsm8k  # eval --gsm8k (was json's "Unexpected UTF-8 BOM")

    g = tmp_path / "g.jsonl"
    g.write_bytes('\ufeff{"question": "q\u2028still q", "answer": "#### 1"}\r\n'.encode())
    assert gsm8k(gsm8k_path=str(g))["test"][0]["question"] == "q\u2028still q"

    seen: list[list[str]] = []

    def captured(recipe, req, *a, **k):
        seen.append(req.prompts)
        raise UsageError("stop here")

    monkeypatch.setattr("eectl.run.stage.run", captured)
    res = runner.invoke(app, ["run", "art", "--prompt-file", str(txt)])
    assert res.exit_code == 2 and seen[-1] == read_prompts(txt)
    res = runner.invoke(app, ["run", "art", "--prompt-file", "-"], input="\ufeffone\u2028line\r\ntwo\r\n")
    assert res.exit_code == 2 and seen[-1] == ["one\u2028line", "two"]
    res = runner.invoke(app, ["run", "art", "-"], input="\ufeffthe prompt\n")
    assert res.exit_code == 2 and seen[-1] == ["the prompt"]

    def chat(artifact, opts, read, write, **k):
        seen.append([read(), read()])
        raise UsageError("stop here")

    monkeypatch.setattr("eectl.run.chat.chat", chat)
    res = runner.invoke(app, ["run", "art", "--chat"], input="\ufeffhello\r\n")
    assert res.exit_code == 2 and seen[-1] == ["hello\n", None]


# --- 6. counts that mean nothing ------------------------------------------------------------------------------------


def test_negative_ppl_tokens_and_empty_configs_are_refused(artifact, monkeypatch):
    _never_loads(
        monkeypatch, "the artifact was loaded before the options were checked", "eectl.evaluate.bench.ArtifactRuntime"
    )
    res = runner.invoke(app, ["bench", str(artifact), "--data", str(GSM8K), "--ppl-tokens", "-1"])
    _one_line(res, 2, "--ppl-tokens must be >= 0", "-1")
    res = runner.invoke(app, ["bench", str(artifact), "--data", str(GSM8K), "--prompt-drafts", "-1"])
    _one_line(res, 2, "--prompt-drafts must be in 0..")
    res = runner.invoke(app, ["bench", str(artifact), "--data", str(GSM8K), "--policies", ""])
    _one_line(res, 2, "--policies names nothing")
    res = runner.invoke(app, ["eval", str(artifact), "--configs", "", "--gsm8k", str(GSM8K)])
    _one_line(res, 2, "--configs names nothing")


# --- 7. a folder where a file is expected ---------------------------------------------------------------------------


def test_a_folder_given_as_an_input_file_says_it_is_a_folder(llama, tmp_path):
    folder = tmp_path / "somewhere"
    folder.mkdir()
    res = runner.invoke(app, ["pipeline", "--recipe", str(folder), "--dry-run"])
    _one_line(res, 2, f"recipe {folder} is a folder, not a file")
    res = runner.invoke(app, ["run", "art", "--prompt-file", str(folder)])
    _one_line(res, 4, f"prompt file {folder} is a folder, not a file")
    res = runner.invoke(app, ["eval", "art", "--gsm8k", str(folder)])
    _one_line(res, 2, f"--gsm8k {folder} is a folder, not a file")
    with pytest.raises(UsageError, match="is a folder"):
        load_recipe(folder)
    with pytest.raises(DataError, match="is a folder"):
        read_prompts(folder)
    with pytest.raises(ArtifactError, match="is a folder"):
        read_calibration(folder)
    with pytest.raises(ArtifactError, match="is a folder"):
        load_heads(folder, llama)
    with pytest.raises(UsageError, match="recipe not found"):  # nothing there: as before
        load_recipe(tmp_path / "none.yaml")


# --- 8. CRLF text files ---------------------------------------------------------------------------------------------


def test_crlf_text_data_is_read_like_lf(tmp_path):
    f = tmp_path / "d.txt"
    f.write_bytes(b"first record\r\nits second line\r\n\r\nsecond record\r\n\r\n\r\nthird\r\n")
    assert load_text_data(str(f)).texts == ["first record\nits second line", "second record", "third"]
    p = tmp_path / "p.txt"
    p.write_bytes(b"one\r\ntwo\r\n")
    assert read_prompts(p) == ["one", "two"]


# --- 9. an artifact without its tokenizer/ ----------------------------------------------------------------------------


@pytest.mark.parametrize("listed", [True, False])
def test_a_missing_tokenizer_folder_names_it(artifact, tmp_path, listed):
    art = _copy(artifact, tmp_path)
    shutil.rmtree(art / "tokenizer")
    if not listed:  # its files taken out of the manifest too: nothing says it was ever there
        doc = json.loads((art / MANIFEST).read_text())
        doc["files"] = {k: v for k, v in doc["files"].items() if not k.startswith("tokenizer/")}
        (art / MANIFEST).write_text(json.dumps(doc))
    res = runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2", "--threads", "1"])
    _one_line(res, 5, "tokenizer/", "missing")
    assert "Repo id" not in res.stderr and "repo" not in res.stderr.lower()


# --- 10. train-heads --out that is not .safetensors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [["--cache", "{tmp}/states"], [], ["--probe-only", "--heads", "{tmp}/h.safetensors", "--cache", "{tmp}/states"]],
)
def test_train_heads_refuses_an_out_that_is_not_safetensors(tiny_dirs, tmp_path, monkeypatch, extra):
    _never_loads(monkeypatch, "the model was loaded before --out was checked", "eectl.models.load_model")
    args = [a.format(tmp=tmp_path) for a in extra]
    res = runner.invoke(
        app, ["train-heads", str(tiny_dirs["llama"]), "--data", str(GSM8K), "--out", str(tmp_path / "t.txt"), *args]
    )
    _one_line(res, 2, "--out must name a .safetensors file", "t.txt")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# --- 11. an exit list that names nothing ----------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", ",", " , "])
def test_an_exit_list_naming_no_layers_is_refused(artifact, text, monkeypatch):
    """`--exits ""` (an unset shell variable) was [] silently: full depth for run, an artifact with no exits for
    export, the default exits for calibrate. 'none' still means no exits."""
    from eectl.contracts.layers import parse_layers

    _never_loads(
        monkeypatch,
        "the model or artifact was loaded before --exits was checked",
        "eectl.models.load_model",
        "eectl.run.generate.ArtifactRuntime",
    )
    with pytest.raises(UsageError, match="--exits names no layers"):
        parse_layers(text)
    assert parse_layers("none") == [] and parse_layers("8, 12") == [8, 12] and parse_layers(None) is None
    for args in (
        ["run", str(artifact), "hi", "--exits", text],
        ["export", "nowhere", "--exits", text],
        ["calibrate", "nowhere", "--exits", text, "--data", str(GSM8K)],
    ):
        _one_line(runner.invoke(app, args), 2, "--exits names no layers", "'none'")


# --- 12. export --out inside another artifact -----------------------------------------------------------------------


def test_export_into_another_artifact_is_refused_before_the_model_loads(artifact, tiny_dirs, tmp_path, monkeypatch):
    """An --out inside an artifact's tokenizer/ (hashed whole) left that artifact unloadable ("files in tokenizer/
    that the manifest does not list"); anywhere inside it, a stray folder. Refused, nothing written."""
    art = _copy(artifact, tmp_path)
    before = sorted(p.relative_to(art).as_posix() for p in art.rglob("*"))

    _never_loads(monkeypatch, "the model was loaded before --out was checked", "eectl.models.load_model")
    for out in (art / "tokenizer" / "nested", art / "sub" / "deeper"):
        res = runner.invoke(app, ["export", str(tiny_dirs["llama"]), "--out", str(out)])
        _one_line(res, 2, f"--out {out} is inside the eectl artifact {art}")
    assert sorted(p.relative_to(art).as_posix() for p in art.rglob("*")) == before
    assert ArtifactRuntime(art, provider="cpu").manifest.exit_layers == [3]


# --- 13. an exit named twice ----------------------------------------------------------------------------------------


def test_an_exit_named_twice_is_refused_by_run_and_bench_as_by_export(artifact, tiny_dirs, tmp_path, monkeypatch):
    """`run --exits 3,3` ran exit 3 once, silently; export and calibrate refused the same list. Refused before the
    artifact loads."""

    _never_loads(
        monkeypatch,
        "the artifact was loaded before --exits was checked",
        "eectl.run.generate.ArtifactRuntime",
        "eectl.evaluate.bench.ArtifactRuntime",
        "eectl.models.load_model",
    )
    for args in (
        ["run", str(artifact), "hi", "--exits", "3,3"],
        ["bench", str(artifact), "--data", str(GSM8K), "--exits", "3, 3"],
        ["export", str(tiny_dirs["llama"]), "--out", str(tmp_path / "x"), "--exits", "3,3"],
    ):
        res = runner.invoke(app, args)
        _one_line(res, 2)
        assert res.stderr.splitlines()[-1] == "error: --exits must be distinct, got [3, 3]"


# --- 14. calibrate --exits none -------------------------------------------------------------------------------------


def test_calibrate_and_train_heads_refuse_exits_none(artifact, tiny_dirs, monkeypatch):
    """`calibrate --exits none` calibrated the default exits (token) or the artifact's (sequence), silently, and
    train-heads trained heads at the default exits: 'none' names no exit. Refused before the model loads."""

    _never_loads(
        monkeypatch,
        "the model or artifact was loaded before --exits was checked",
        "eectl.models.load_model",
        "eectl.runtime.sessions.ArtifactRuntime",
    )
    for args in (
        ["calibrate", str(tiny_dirs["llama"]), "--exits", "none", "--data", str(GSM8K), "--tokens", "400"],
        ["calibrate", "--guarantee", "sequence", str(artifact), "--exits", "None", "--data", str(GSM8K)],
        ["train-heads", str(tiny_dirs["llama"]), "--exits", "none", "--data", str(GSM8K)],
    ):
        res = runner.invoke(app, args)
        _one_line(res, 2)
        word = args[args.index("--exits") + 1]
        assert res.stderr.splitlines()[-1] == (
            f"error: {args[0]} needs at least one exit, got --exits '{word}' (give e.g. --exits 8,12, or leave "
            "--exits out for the default exits)"
        )


# --- 15. a threshold for an exit that does not run ------------------------------------------------------------------


@pytest.mark.parametrize(
    "exits,thresholds,line",
    [
        (
            "3",
            "3:0.9,2:0.8",
            "error: --thresholds names exits [2], not among the active exits [3] (add them to --exits)",
        ),
        (
            "none",
            "3:0.9",
            "error: --thresholds names exits [3], but no exit is active (full depth) (add them to --exits)",
        ),
    ],
)
def test_a_threshold_for_an_exit_that_does_not_run_is_refused(artifact, exits, thresholds, line):
    """`--thresholds 12:0.9` with exit 12 not among the active exits was dropped, silently (run and bench)."""
    for args in (
        ["run", str(artifact), "hi", "--raw", "-n", "2"],
        ["bench", str(artifact), "--data", str(GSM8K), "--prompts", "1", "--policies", "defer"],
    ):
        res = runner.invoke(app, [*args, "--exits", exits, "--thresholds", thresholds])
        _one_line(res, 2)
        assert res.stderr.splitlines()[-1] == line
    ok = runner.invoke(app, ["run", str(artifact), "hi", "--raw", "-n", "2", "--exits", "3", "--thresholds", "3:0.9"])
    assert ok.exit_code == 0, ok.output


# --- 16. a data error behind "too small for the guarantee" ----------------------------------------------------------


def test_a_data_error_is_named_before_the_sample_size(tiny_dirs, tmp_path, monkeypatch):
    """calibrate checked that --tokens carries the guarantee before it read the data: with a small --tokens an empty,
    textless or missing data file was reported as "data too small for the requested guarantee" (raising --tokens
    then met the real error). The data is read first; the sample size is still checked before the model loads."""

    _never_loads(
        monkeypatch, "the model was loaded before the data and the sample size were checked", "eectl.models.load_model"
    )
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    for data, words in (
        (tmp_path / "empty.txt", ["data is empty"]),
        (tmp_path / "blank.jsonl", ["data has no text: every record of blank.jsonl is empty"]),
        (tmp_path / "missing.txt", ["data not found"]),
        (GSM8K, ["data too small for the requested guarantee", "--tokens 64"]),  # good data: the size, as before
    ):
        res = runner.invoke(
            app,
            [
                "calibrate",
                str(tiny_dirs["llama"]),
                "--exits",
                "2",
                "--tokens",
                "64",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "c.json"),
            ],
        )
        _one_line(res, 4, *words)
    assert not (tmp_path / "c.json").exists()


# --- 17. thresholds where no exit runs: --policy lookup/full, --exits none, bench and eval without an exit config --


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--policy", "lookup", "--thresholds", "3:0.9"],
            "error: --policy lookup runs at full depth: drop --thresholds (--policy verify --prompt-drafts N drafts "
            "from both)",
        ),
        (["--policy", "full", "--thresholds", "0.9"], "error: --policy full runs at full depth: drop --thresholds"),
        (["--policy", "full", "--exits", "3"], "error: --policy full runs at full depth: drop --exits"),
        (
            ["--exits", "none", "--thresholds", "0.9"],
            "error: --thresholds '0.9' sets the active exits' thresholds, but no exit is active (full depth) (drop "
            "--thresholds, or name exits with --exits)",
        ),
    ],
)
def test_thresholds_where_no_exit_runs_are_refused_by_run(artifact, monkeypatch, args, line):
    """`--policy lookup --thresholds 12:0.9` ran full depth with drafts from the context and dropped the thresholds,
    silently; so did `--exits none --thresholds 0.9`. Refused before the artifact loads."""

    _never_loads(
        monkeypatch, "the artifact was loaded before the options were checked", "eectl.run.generate.ArtifactRuntime"
    )
    res = runner.invoke(app, ["run", str(artifact), "hi", "--raw", "-n", "2", *args])
    _one_line(res, 2)
    assert res.stderr.splitlines()[-1] == line


def test_policy_full_runs_full_depth_without_a_plan(artifact):
    """`--policy full` on an artifact without a plan (or with --exits none) failed in the runtime with "--policy must
    be one of copy, defer, verify, river, got 'full'", though run's own check lists full."""
    for extra in ([], ["--exits", "none"]):
        res = runner.invoke(app, ["run", str(artifact), "hi", "--raw", "-n", "2", "--policy", "full", "--json", *extra])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc["exits"] == [] and doc["thresholds"] == {}
        assert doc["results"][0]["mean_executed_layers"] == 6.0  # the tiny Llama's every layer


def test_bench_and_eval_refuse_exit_options_no_configuration_takes(artifact, monkeypatch):
    """bench --policies lookup and eval --configs full,lookup run no exit: their --thresholds and --exits were
    dropped, silently. Refused before anything runs (eval: before full depth's minutes)."""

    _never_loads(
        monkeypatch,
        "a configuration was built before the options were checked",
        "eectl.evaluate.bench.ArtifactRuntime",
        "eectl.evaluate.lmeval._model",
    )
    for args in (
        ["bench", str(artifact), "--data", str(GSM8K), "--policies", "full,lookup", "--thresholds", "3:0.9"],
        ["bench", str(artifact), "--data", str(GSM8K), "--policies", "hf,full", "--exits", "3"],
        ["eval", str(artifact), "--gsm8k", str(GSM8K), "--configs", "full,lookup", "--thresholds", "0.9"],
        ["eval", str(artifact), "--gsm8k", str(GSM8K), "--configs", "full", "--exits", "3"],
    ):
        res = runner.invoke(app, args)
        _one_line(res, 2)
        given = "--thresholds" if "--thresholds" in args else "--exits"
        listed = "--policies" if args[0] == "bench" else "--configs"
        names = args[args.index(listed) + 1].replace(",", ", ")  # bench adds exact-head after them
        last = res.stderr.splitlines()[-1]
        assert last.startswith(f"error: {given} sets the early-exit configurations, but none of {names}"), last
        assert f"runs an exit (add one to {listed}: copy, defer, verify" in last and f"or drop {given})" in last


# --- 18. an exit named twice in --thresholds ------------------------------------------------------------------------


def test_an_exit_named_twice_in_thresholds_is_refused(artifact, monkeypatch):
    """`--thresholds 3:0.9,3:0.8` ran exit 3 at 0.8, the last value, silently (run, bench, eval). Refused before the
    artifact loads (eval: before any configuration runs)."""

    _never_loads(
        monkeypatch,
        "the artifact was loaded before --thresholds was checked",
        "eectl.run.generate.ArtifactRuntime",
        "eectl.evaluate.bench.ArtifactRuntime",
        "eectl.evaluate.lmeval._model",
    )
    for args in (
        ["run", str(artifact), "hi", "--exits", "3"],
        ["bench", str(artifact), "--data", str(GSM8K), "--policies", "defer"],
        ["eval", str(artifact), "--gsm8k", str(GSM8K), "--configs", "full,defer"],
    ):
        res = runner.invoke(app, [*args, "--thresholds", "3:0.9,3:0.8"])
        _one_line(res, 2)
        assert res.stderr.splitlines()[-1] == "error: --thresholds names exits [3] more than once, got '3:0.9,3:0.8'"


# --- 19. a --compare name given twice -------------------------------------------------------------------------------


def test_a_compare_name_given_twice_is_refused(artifact, tmp_path, monkeypatch):
    """`bench --compare x=A,x=B` benchmarked B alone as x, A dropped silently (the names became a dict's keys).
    Refused before anything loads."""

    _never_loads(
        monkeypatch,
        "an artifact was loaded before --compare was checked",
        "eectl.evaluate.bench.ArtifactRuntime",
        "eectl.evaluate.configs.ArtifactRuntime",
    )
    given = f"x={artifact},y={artifact},x={tmp_path}"
    res = runner.invoke(app, ["bench", str(artifact), "--data", str(GSM8K), "--policies", "full", "--compare", given])
    _one_line(res, 2)
    assert res.stderr.splitlines()[-1] == f"error: --compare names x more than once, got '{given}'"


# --- 20. eval's generation budget and few-shot count out of range ---------------------------------------------------


@pytest.mark.parametrize(
    "option,value,line",
    [
        ("--max-gen-toks", "0", "error: --max-gen-toks must be >= 1, got 0"),
        ("--max-gen-toks", "-5", "error: --max-gen-toks must be >= 1, got -5"),
        ("--num-fewshot", "-1", "error: --num-fewshot must be >= 0, got -1"),
    ],
)
def test_eval_refuses_a_generation_budget_or_fewshot_count_out_of_range(artifact, monkeypatch, option, value, line):
    """`eval --max-gen-toks 0` ran the task's default budget (0 read as not given), -5 and `--num-fewshot -1` ran
    too, exit 0. Refused before any configuration runs."""

    def no_run(*a, **k):
        raise AssertionError("a configuration ran before the options were checked")

    monkeypatch.setattr("eectl.evaluate.lmeval._model", no_run)
    args = ["eval", str(artifact), "--gsm8k", str(GSM8K), "--configs", "full", "--limit", "1", option, value]
    res = runner.invoke(app, args)
    _one_line(res, 2)
    assert res.stderr.splitlines()[-1] == line


# --- 21. export's int4 options on an fp32 export ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--lm-head", "int4"], "--lm-head"),
        (["--int4-block-size", "64"], "--int4-block-size"),
        (["--int4-symmetric"], "--int4-symmetric"),
        (["--int4-keep-layers", "0", "--min-agreement", "0.9"], "--int4-keep-layers"),
    ],
)
def test_int4_options_on_an_fp32_export_are_refused(tiny_dirs, tmp_path, monkeypatch, args, flag):
    """`export --lm-head int4` (or any --int4-* option, --min-agreement) without --weights int4 or --river wrote an
    fp32 artifact, the option dropped silently. Refused before the model loads; with int4 graphs they pass."""

    _never_loads(monkeypatch, "the model was loaded", "eectl.models.load_model")
    base = ["export", str(tiny_dirs["llama"]), "--out", str(tmp_path / "x"), "--exits", "2"]
    res = runner.invoke(app, [*base, *args])
    _one_line(res, 2)
    assert res.stderr.splitlines()[-1] == (
        f"error: {flag} shapes int4 graphs, but this export makes none (fp32 weights) (add --weights int4 or --river, "
        "or drop it)"
    )
    assert not (tmp_path / "x").exists()
    for int4 in (["--weights", "int4"], ["--river"]):  # past the options' checks, to the model's load
        res = runner.invoke(app, [*base, *args, *int4])
        assert isinstance(res.exception, AssertionError), res.output


# --- 22. export's int4 options under an int4 recipe ----------------------------------------------------------------


def test_int4_options_win_over_an_int4_recipe(tmp_path, monkeypatch):
    """`export --recipe R --int4-block-size 64` with R's `weights: int4` exported block size 32, the recipe's: every
    --int4-* option and --lm-head was replaced by the recipe's value, silently. An option given wins; the recipe sets
    the rest."""
    from eectl.export.quantize import Int4Options

    seen: list[Int4Options] = []

    def captured(recipe, req, out):
        seen.append(req.options.int4)
        raise UsageError("stop here")

    monkeypatch.setattr("eectl.export.stage.export", captured)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nweights: int4\nint4:\n  block_size: 128\n  symmetric: true\n  lm_head: int4\n")
    base = ["export", "model", "--recipe", str(recipe), "--out", str(tmp_path / "a")]
    given = ["--int4-block-size", "64", "--int4-accuracy-level", "0", "--int4-keep-layers", "0,1", "--lm-head", "int8"]
    for args in ([], given, ["--int4-symmetric", "--int4-algorithm", "rtn"]):
        assert runner.invoke(app, [*base, *args]).exit_code == 2
    assert seen == [
        Int4Options(block_size=128, symmetric=True, lm_head="int4"),  # the recipe's
        Int4Options(block_size=64, symmetric=True, accuracy_level=0, lm_head="int8", keep_layers=(0, 1)),
        Int4Options(block_size=128, symmetric=True, lm_head="int4"),
    ]
    assert runner.invoke(app, ["export", "model", "--out", str(tmp_path / "a"), "--weights", "int4"]).exit_code == 2
    assert seen[-1] == Int4Options()  # no recipe, no option: the defaults


# --- 23. a recipe's bench section, checked before the first stage ---------------------------------------------------


@pytest.mark.parametrize(
    "bench,text",
    [
        ("sweep: [0.9, -1]", "bench.sweep.1: Input should be greater than 0"),
        ("sweep: [0]", "bench.sweep.0: Input should be greater than 0"),
        ("configs: []", "bench.configs: List should have at least 1 item"),
        ("configs: [full, defer, full]", "bench.configs: Value error, names full more than once"),
    ],
)
def test_a_recipes_bench_section_is_refused_at_load(tmp_path, monkeypatch, bench, text):
    """`bench: {configs: []}`, a configuration twice or a sweep scale <= 0 passed the recipe and --dry-run; the
    pipeline ran profile, train-heads, calibrate and export, then bench refused them naming --policies or --sweep,
    options never given (and so did `eectl bench --recipe`). Refused when the recipe is read."""
    _never_loads(monkeypatch, "the model was loaded before the recipe was checked", "eectl.models.load_model")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nbench:\n  {bench}\n")
    for args in (["pipeline", "--recipe", str(recipe), "--dry-run"], ["bench", "art", "--recipe", str(recipe)]):
        _one_line(runner.invoke(app, args), 2, f"recipe r.yaml: {text}")


def test_the_pipeline_checks_bench_configuration_names_as_bench_does(tiny_dirs, tmp_path, monkeypatch):
    """--dry-run refused lookup, verify+lookup, river-exit, certified and exact-head, which bench runs; the pipeline
    itself checked no name, so a typo failed at bench, after every other stage. Both check bench's own list."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nbench:\n  configs: [full, lookup, verify+lookup, exact-head]\n")
    res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--model", str(tiny_dirs["llama"]), "--dry-run"])
    assert res.exit_code == 0, res.output
    recipe.write_text("name: r\nbench:\n  configs: [full, lokup]\n")
    monkeypatch.chdir(tmp_path)  # the pipeline's outputs (artifacts/) would land here
    _never_loads(
        monkeypatch,
        "a stage started before the recipe's bench configurations were checked",
        "eectl.models.load_model",
        "eectl.models.loading.load_tokenizer",
    )
    for args in (["--dry-run"], []):
        res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), *args])
        _one_line(res, 2, "recipe r: unknown bench configuration 'lokup'", "verify+lookup")
    assert list(tmp_path.iterdir()) == [recipe]


# --- 24. an option of the other --guarantee -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--delta", "-1"],
            "error: --delta is read by --guarantee sequence only, but this calibration is --guarantee token (drop "
            "--delta, or give --guarantee sequence)",
        ),
        (["--artifact", "art"], "error: --artifact is read by --guarantee sequence only"),
        (["--grid", "0.9"], "error: --grid is read by --guarantee sequence only"),
        (["--prompts", "50"], "error: --prompts is read by --guarantee sequence only"),
        (
            ["--guarantee", "sequence", "--artifact", "art", "--tokens", "500"],
            "error: --tokens is read by --guarantee token only, but this calibration is --guarantee sequence (drop "
            "--tokens, or give --guarantee token)",
        ),
        (["--guarantee", "sequence", "--artifact", "art", "--target", "0.9"], "error: --target is read by"),
        (["--guarantee", "sequence", "--artifact", "art", "--confidence", "0"], "error: --confidence is read by"),
        (
            ["--guarantee", "sequence", "art"],
            "error: MODEL is read by --guarantee token only, but this calibration is --guarantee sequence (the "
            "sequence guarantee certifies an artifact: give it as --artifact DIR)",
        ),
    ],
)
def test_an_option_of_the_other_guarantee_is_refused(monkeypatch, args, line):
    """`calibrate --delta -1` (token guarantee) calibrated as if it were not there, and `--guarantee sequence
    --tokens 500 --target 0.9` certified with neither: each guarantee read its own options and dropped the other's,
    silently. Refused before anything loads."""
    _never_loads(
        monkeypatch,
        "the model or artifact was loaded before the options were checked",
        "eectl.models.load_model",
        "eectl.runtime.sessions.ArtifactRuntime",
    )
    res = runner.invoke(app, ["calibrate", "--data", str(GSM8K), *args])
    _one_line(res, 2)
    assert res.stderr.splitlines()[-1].startswith(line), res.stderr


# --- 25. train-heads options the chosen way of training does not read ----------------------------------------------


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ["--tokens", "500"],
            "error: --tokens is not read when train-heads trains on the fly (no --cache) (drop --tokens)",
        ),
        (["--gen-share", "0.5"], "error: --gen-share is not read when train-heads trains on the fly"),
        (["--loss", "exact"], "error: --loss is not read when train-heads trains on the fly"),
        (["--probe-hidden", "0"], "error: --probe-hidden is not read when train-heads trains on the fly"),
        (
            ["--cache", "{tmp}/states", "--steps", "5"],
            "error: --steps is not read when train-heads trains from a state cache (from a state cache, the steps are "
            "--tokens / --batch-tokens)",
        ),
        (
            ["--cache", "{tmp}/states", "--ce-weight", "0.5"],
            "error: --ce-weight is not read when train-heads trains from",
        ),
        (["--cache", "{tmp}/states", "--probe-hidden", "0"], "error: --probe-hidden is not read when train-heads"),
        (
            ["--probe-only", "--heads", "{tmp}/h.safetensors", "--cache", "{tmp}/states", "--lr", "0.1"],
            "error: --lr is not read when train-heads fits probes only (--probe-only) (drop --lr)",
        ),
        (
            ["--probe-only", "--heads", "{tmp}/h.safetensors", "--cache", "{tmp}/states", "--exits", "2"],
            "error: --exits is not read",
        ),
    ],
)
def test_train_heads_refuses_options_its_way_of_training_does_not_read(tiny_dirs, tmp_path, monkeypatch, args, line):
    """`train-heads --tokens 500` without --cache trained --steps on the fly, --tokens dropped; `--cache DIR --steps 5`
    trained --tokens / --batch-tokens steps; --probe-hidden only shaped --probe-only's probes; --probe-only read none
    of the training options. Each was dropped, silently; refused before the model loads or the cache is built."""
    _never_loads(monkeypatch, "the model was loaded before the options were checked", "eectl.models.load_model")
    given = [a.format(tmp=tmp_path) for a in args]
    res = runner.invoke(app, ["train-heads", str(tiny_dirs["llama"]), "--data", str(GSM8K), *given])
    _one_line(res, 2)
    assert res.stderr.splitlines()[-1].startswith(line), res.stderr
    assert list(tmp_path.iterdir()) == []


# --- 26. an artifact given as a file ------------------------------------------------------------------------------


def test_an_artifact_given_as_a_file_says_it_is_a_file(artifact, tmp_path):
    """`run art/manifest.json` said "artifact not found: art/manifest.json", of a file that is there."""
    res = runner.invoke(app, ["run", str(artifact / MANIFEST), "hi", "--raw", "-n", "2"])
    _one_line(res, 5)
    assert res.stderr.splitlines()[-1] == (
        f"error: artifact {artifact / MANIFEST} is a file, not a folder (give the folder that holds manifest.json)"
    )
    _one_line(runner.invoke(app, ["run", str(tmp_path / "none"), "hi", "--raw"]), 5, "artifact not found")  # as before


# --- 27. a recipe name that cannot name a file ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../outside", "a/b", ".hidden", "''"])
def test_a_recipe_name_that_is_not_a_file_name_is_refused(tmp_path, name):
    """A recipe's name names files: the default state cache `artifacts/<name>-states-...` (a budget's), the pipeline's
    copy of the recipe. `name: ../../outside` put the cache two folders above artifacts/; refused when read."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: {name}\nbudget: quick\n")
    res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run"])
    _one_line(res, 2, "recipe r.yaml: name:", "cannot name a file")
    fine = tmp_path / "qwen2.5-0.5b-instruct.yaml"  # dots inside a name, as the shipped recipes' file stems
    fine.write_text("budget: quick\n")
    assert load_recipe(fine).name == "qwen2.5-0.5b-instruct"


# --- 28. int4 kept layers outside the model ------------------------------------------------------------------------


def test_dry_run_refuses_int4_kept_layers_outside_the_model(tiny_dirs, tmp_path):
    """`int4: {keep_layers: [-1]}` passed --dry-run; the int4 twin refused it only when a run first loaded it."""
    recipe = tmp_path / "r.yaml"
    for bad, word in (("[-1, 2]", "-1"), ("[2, 6]", "6")):  # the tiny Llama has 6 layers
        recipe.write_text(f"name: r\nweights: int4\nint4:\n  keep_layers: {bad}\n")
        res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--model", str(tiny_dirs["llama"]), "--dry-run"])
        _one_line(res, 2, f"int4.keep_layers names layer {word}, not in 0..5")
    recipe.write_text("name: r\nweights: int4\nint4:\n  keep_layers: [0, 5]\n")
    res = runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--model", str(tiny_dirs["llama"]), "--dry-run"])
    assert res.exit_code == 0, res.output


def test_plain_progress_past_its_estimated_total_prints_no_negative_eta():
    """A state cache's chunks overshoot the total its progress was given ("ETA -1 s" was printed)."""
    import io

    from rich.console import Console

    from eectl.output import PlainProgress

    buf = io.StringIO()
    bar = PlainProgress(Console(file=buf, width=200), "base states", total=100, every_s=0.0)
    for _ in range(4):
        bar.advance(30)
    lines = buf.getvalue().splitlines()
    assert lines[-1].startswith("base states: 120/100") and lines[-1].endswith("ETA 0 s"), lines
    assert not any("ETA -" in ln for ln in lines), lines
