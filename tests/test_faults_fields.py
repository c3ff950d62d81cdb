"""Faults of #66: every field of an artifact checked where it is read (against the schema and against the files),
options and recipe values checked against what they apply to, standard input closed, arguments in a C locale.
One test per class; each failed on the code before its fix."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eectl import files
from eectl.cli import app
from eectl.contracts.manifest import MANIFEST, read_manifest
from eectl.errors import ArtifactError
from eectl.export.exporter import ExportOptions, export_artifact

runner = CliRunner()
RUN = ["--raw", "-n", "2", "--exits", "none"]  # full depth: no thresholds needed


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory) -> Path:
    """The tiny Llama exported once (exit after layer 3); tests copy it before tampering."""
    out = tmp_path_factory.mktemp("fields") / "art"
    export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))
    return out


def _copy(artifact: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(artifact, dst)
    return dst


def _edit(art: Path, edit) -> Path:
    doc = json.loads((art / MANIFEST).read_text())
    edit(doc)
    (art / MANIFEST).write_text(json.dumps(doc))
    return art


def _rehash(art: Path, rel: str) -> None:
    _edit(art, lambda d: d["files"].__setitem__(rel, files.sha256_file(art / rel)))


def _one_line(res, code: int) -> str:
    """The command failed with exit `code` and exactly one `error:` line, the last one, with no traceback."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    lines = res.stderr.strip().splitlines()  # a progress line ("loading ...") may come first
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in res.stderr, res.stderr
    return errors[0]


def _no_session(monkeypatch) -> None:
    """Fail the test if ONNX Runtime is asked for a session: the manifest's fields are all checked before."""

    def no_session(*a, **k):
        raise AssertionError("an ONNX Runtime session was created before the manifest was refused")

    monkeypatch.setattr("eectl.runtime.sessions._ort", no_session)


def _set(path: str, value):
    """An edit setting the manifest field at dotted `path` (list indexes as numbers) to `value`."""

    def edit(doc):
        *parents, last = path.split(".")
        x = doc
        for p in parents:
            x = x[int(p)] if isinstance(x, list) else x[p]
        if isinstance(x, list):
            x[int(last)] = value
        else:
            x[last] = value

    return edit


# --- 1. every manifest field against the schema: types, ranges, uniqueness, names ------------------------------------


def _twice(doc):
    doc["exits"].insert(0, doc["exits"][0])


@pytest.mark.parametrize(
    "edit,words",
    [
        (_set("max_positions", "512"), ["max_positions", "valid integer"]),  # was coerced to 512
        (_set("top_k", "8"), ["top_k"]),
        (_set("costs.threads", 1.5), ["costs.threads"]),
        (_twice, ["exits list layer 3 more than once"]),
        (_set("kv.layout", "BSNH"), ["kv.layout"]),
        (_set("family", "qwen2"), ["family 'qwen2'", "model_type 'llama'"]),
        (_set("family", "gpt2"), ["unknown model family 'gpt2'"]),
        (_set("costs.embed_ms", -0.5), ["costs.embed_ms is -0.5"]),
        (_set("costs.segment_ms.1", -3.0), ["costs.segment_ms.1 is -3.0"]),
        (_set("candidate_source", {"name": "bogus"}), ["candidate_source", "unknown candidate source 'bogus'"]),
        (_set("candidate_source", {"name": "shortlist"}), ["candidate_source", "token ids"]),
        (_set("eos_token_ids", []), ["eos_token_ids"]),
        (_set("eos_token_ids", [2, 2]), ["eos_token_ids", "more than once"]),
        (_set("top_k", 10**12), ["top_k 1000000000000 is outside 2..384"]),  # was "--top-k must be in 2..384", exit 2
        (_set("kv_policies", ["bogus"]), ["kv_policies", "unknown KV policy 'bogus'"]),  # was exit 2
        (_set("kv_policies", ["defer", "defer"]), ["kv_policies", "more than once"]),
        (_set("shared_weights.lm_head.dtype", "fp16"), ["shared_weights.lm_head.dtype is fp16"]),
        (_set("shared_weights.lm_head.dtype", "int3"), ["shared_weights.lm_head.dtype"]),
        (_set("dtype", "bf16"), ["dtype"]),
        (_set("segments.1.index", 7), ["segments.1.index is 7"]),
        (_set("dims.vocab_size", 0), ["dims.vocab_size must be a positive integer"]),
        (lambda d: d["files"].__setitem__("embed.onnx", "not-a-hash"), ["SHA-256"]),
    ],
)
def test_every_manifest_field_is_checked_before_any_session(artifact, tmp_path, monkeypatch, edit, words):
    art = _edit(_copy(artifact, tmp_path), edit)
    _no_session(monkeypatch)
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    assert line.startswith(f"error: inconsistent manifest in {art}: "), line
    assert all(w in line for w in words) and "--top-k" not in line, line


def test_a_key_given_twice_in_the_manifest_is_refused(artifact, tmp_path):
    """json keeps the last of two equal keys, silently: `"top_k": 8, ..., "top_k": 64` ran with 64."""
    art = _copy(artifact, tmp_path)
    text = (art / MANIFEST).read_text()
    (art / MANIFEST).write_text(text.replace('"top_k": 8,', '"top_k": 8, "top_k": 64,', 1))
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    assert "the key 'top_k' is given twice in one object" in line


# --- 2. the manifest against the files: weights' dtype and finiteness, unlisted and non-regular files --------------


def test_a_weight_file_of_another_dtype_or_non_finite_is_refused(artifact, tmp_path, monkeypatch):
    _no_session(monkeypatch)
    art = _copy(artifact, tmp_path)
    f = art / "weights" / "lm_head.npy"
    good = np.load(f)
    np.save(f, good.astype(np.float16))  # the manifest says fp32
    _rehash(art, "weights/lm_head.npy")
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    assert "the weight weights/lm_head.npy is float16 [64, 384]" in line and "says fp32" in line, line
    np.save(f, np.full_like(good, np.nan))  # an all-NaN shared LM head, its hash updated: ran and printed "\n"
    _rehash(art, "weights/lm_head.npy")
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    assert "the weight weights/lm_head.npy holds non-finite values (NaN or infinity), first in row 0" in line
    bad = good.copy()
    bad[40, 7] = np.inf
    np.save(f, bad)
    _rehash(art, "weights/lm_head.npy")
    with pytest.raises(ArtifactError, match="first in row 40"):
        read_manifest(art)


@pytest.mark.parametrize(
    "place,where",
    [
        ("weights/extra.npy", "files in weights/ that the manifest does not list: ['weights/extra.npy']"),
        ("notes.txt", "that the manifest does not list: ['notes.txt']"),
        ("tokenizer/added.json", "files in tokenizer/ that the manifest does not list"),
    ],
)
def test_an_unlisted_file_in_a_folder_the_runtime_reads_is_refused(artifact, tmp_path, monkeypatch, place, where):
    art = _copy(artifact, tmp_path)
    (art / place).write_bytes(b"x")
    _no_session(monkeypatch)
    assert where in _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _folder(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _inside_link(p: Path) -> None:
    """A link to a copy of the same bytes inside the artifact: confined, but not the file the manifest hashed."""
    copy = p.with_name(p.name + ".same")
    p.rename(copy)
    p.symlink_to(copy.name)


@pytest.mark.parametrize(
    "rel,make,kind",
    [
        # was "artifact file missing" / "no manifest.json"
        ("weights/lm_head.npy", _fifo, "is a FIFO, device or socket, not a regular file"),
        ("embed.onnx", _folder, "is a folder, not a regular file"),
        ("embed.onnx", _inside_link, "is a symbolic link, not a regular file"),
        (MANIFEST, _fifo, "is a FIFO, device or socket, not a regular file"),
        (MANIFEST, _folder, "is a folder, not a regular file"),
        (MANIFEST, _inside_link, "is a symbolic link, not a regular file"),
    ],
)
def test_a_link_or_non_regular_file_where_an_artifact_file_should_be_says_so(artifact, tmp_path, rel, make, kind):
    art = _copy(artifact, tmp_path)
    make(art / rel)
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    assert kind in line and rel in line, line


def test_a_manifest_linked_from_outside_the_artifact_is_refused(artifact, tmp_path):
    """Every path the manifest names was confined, but manifest.json itself was read through a link to anywhere."""
    art = _copy(artifact, tmp_path)
    outside = tmp_path / "elsewhere.json"
    shutil.copy(art / MANIFEST, outside)
    (art / MANIFEST).unlink()
    (art / MANIFEST).symlink_to(outside)
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    assert f"path 'manifest.json' leaves the folder {art}" in line, line


def test_the_names_a_manifest_may_use_are_the_registries():
    """A manifest's family and candidate source are checked against names in contracts/names.py (which import no
    torch): the registries that run them must hold exactly those names."""
    from eectl.contracts.names import CANDIDATE_SOURCE_NAMES, FAMILIES
    from eectl.exits.candidates import CANDIDATE_SOURCES
    from eectl.models.adapters import ADAPTERS

    assert set(CANDIDATE_SOURCES) == set(CANDIDATE_SOURCE_NAMES)
    assert {cls.family: cls.model_types for cls in ADAPTERS.values()} == FAMILIES


# --- 3. options and recipe values against what they apply to; YAML keys twice, alias bombs --------------------------


@pytest.mark.parametrize(
    "args,text",
    [
        (
            ["--thresholds", "2.0"],
            "--thresholds '2.0': exit 3's prob threshold 2 is outside [0, 1]: the exit could",
        ),
        (["--thresholds", "-0.5"], "exit 3's prob threshold -0.5 is outside [0, 1]: the exit would always fire"),
        (["--thresholds", "3:0.5/1.5", "--signal", "topk-prob+margin"], "exit 3's margin threshold 1.5 is outside"),
        (["--thresholds", "0.5", "--threshold-scale", "1e308"], "--threshold-scale 1e+308: exit 3's prob threshold"),
        (["--thresholds", "0.9", "--threshold-scale", "1.5"], "prob threshold 1.35 is outside [0, 1]"),
    ],
)
def test_a_threshold_outside_its_signals_range_is_refused(artifact, args, text):
    """A probability threshold of 2.0 (or one scaled past 1) is an exit that can never fire, -0.5 one that always
    does: both ran, silently."""
    line = _one_line(runner.invoke(app, ["run", str(artifact), "hi", "--raw", "-n", "2", *args]), 2)
    assert text in line, line


def test_a_threshold_scale_within_range_and_the_sweep_beyond_it_still_run(artifact, monkeypatch):
    from eectl.run.generate import RunOptions, resolve_config
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(artifact)
    config = resolve_config(rt, RunOptions(exits="3", thresholds="0.5", threshold_scale=1.5), (2,))
    assert config.thresholds == {3: {"prob": 0.75}}
    # bench's sweep scales further on purpose: a threshold it puts past 1 is a point of the sweep (nothing exits)
    config = resolve_config(rt, RunOptions(exits="3", thresholds="0.95", sweep_scale=1.1), (2,))
    assert config.thresholds[3]["prob"] == pytest.approx(1.045)


def _alias_bomb(levels: int = 9) -> str:
    names = [chr(ord("a") + i) for i in range(levels)]
    lines = [f"{names[0]}: &{names[0]} [x, x, x, x, x, x, x, x, x]"]
    lines += [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip(names, names[1:], strict=False)]
    return "name: r\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text,words",
    [
        ("name: r\ntop_k: 8\ntarget: 0.9\ntop_k: 64\n", "the key 'top_k' is given twice in one mapping"),
        ("name: r\nheads:\n  steps: 5\n  steps: 50\n", "the key 'steps' is given twice in one mapping"),
        (_alias_bomb(), "its aliases expand it to more than 100000 values"),  # expanded for 25 s before its error
        ("name: r\nsignal: bogus\n", "signal: Value error, unknown signal 'bogus'"),
    ],
)
def test_recipe_keys_twice_alias_bombs_and_unknown_signals_are_refused(tmp_path, text, words):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    line = _one_line(runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run"]), 2)
    assert "recipe r.yaml" in line and words in line, line


def test_yaml_aliases_within_the_bound_still_load(tmp_path):
    from eectl.contracts.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\nexits: &e [2, 4]\nbench:\n  sweep: &s [0.9, 1.0]\nprofile:\n  alpha: 0.5\n")
    assert load_recipe(recipe).exits == [2, 4]


# --- 4. standard input closed; a UTF-8 argument in a C locale --------------------------------------------------------


def _eectl(args: list[str], env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[bytes]:
    """eectl in a fresh process, standard input set up by the shell (`stdin`: e.g. '0<&-', closed)."""
    cmd = " ".join([sys.executable, "-m", "eectl.cli", *map(shlex.quote, args)])
    return subprocess.run(
        ["bash", "-c", f"exec {cmd} {stdin}"], env={**os.environ, **(env or {})}, capture_output=True, timeout=120
    )


@pytest.mark.parametrize("args", [["-"], ["--chat"], ["--prompt-file", "-"]])
def test_standard_input_closed_is_one_line(artifact, args):
    """`eectl run ART - 0<&-`: Python's sys.stdin is None, and `.buffer`/`.readline` raised AttributeError."""
    res = _eectl(["run", str(artifact), *args, "--exits", "none"], stdin="0<&-")
    err = res.stderr.decode().strip().splitlines()
    assert res.returncode == 2 and len(err) == 1, res.stderr.decode()
    assert err[0].startswith("error: standard input is closed"), err


def test_a_utf8_prompt_argument_is_accepted_in_a_c_locale(artifact):
    """Under LC_ALL=C without UTF-8 mode Python decodes argv as ASCII (each other byte a lone surrogate): "café" was
    refused as "not UTF-8 text"; its bytes are UTF-8. The answer and the chat's turns are UTF-8 too."""
    env = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    res = _eectl(["run", str(artifact), "café ü", "--raw", "-n", "4", "--exits", "none", "--json"], env)
    assert res.returncode == 0, res.stderr.decode()
    assert json.loads(res.stdout)["results"][0]["prompt"] == "café ü"
    res = _eectl(["run", str(artifact), "--chat", "--raw", "-n", "4", "--exits", "none"], env, "<<< 'café'")
    assert res.returncode == 0 and "turn 1:" in res.stderr.decode(), res.stderr.decode()
    res = _eectl(["run", str(artifact), "caf\udce9", "--raw", "-n", "4", "--exits", "none"], env)
    assert res.returncode == 4 and "not UTF-8 text: byte 0xe9" in res.stderr.decode(), res.stderr.decode()


def test_calibration_files_and_heads_metadata_are_read_strictly_too(llama, tmp_path):
    """The same class in the other files between stages: calibration.json's `top_k: "8"` and a heads file's
    `steps: "0"` were coerced; a key given twice kept the last value; `export --force` took a folder whose
    manifest.json links to an artifact's elsewhere for an artifact."""
    import torch
    from safetensors.torch import save_file

    from eectl.contracts.calibration import read_calibration, write_calibration
    from eectl.contracts.heads import FORMAT
    from eectl.contracts.manifest import is_artifact
    from eectl.exits.designs import load_heads
    from tests.conftest import make_calibration, make_heads_meta

    cal = tmp_path / "calibration.json"
    write_calibration(make_calibration(llama, {3: {"prob": 0.9}}), cal)
    doc = json.loads(cal.read_text())
    doc["top_k"] = "8"
    cal.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="calibration.json: top_k: Input should be a valid integer"):
        read_calibration(cal)
    meta = make_heads_meta(llama, [3]).model_dump(mode="json")
    heads = tmp_path / "h.safetensors"
    for text, words in (
        (json.dumps({**meta, "steps": "0"}), "invalid metadata: steps: Input should be a valid integer"),
        (json.dumps(meta)[:-1] + ', "steps": 5}', "the key 'steps' is given twice"),
    ):
        save_file({"exit_3.weight": torch.zeros(64, 64)}, str(heads), metadata={"format": FORMAT, "eectl": text})
        with pytest.raises(ArtifactError, match=words):
            load_heads(heads, llama)
    art = tmp_path / "notart"
    art.mkdir()
    (art / MANIFEST).symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text('{"schema_version": 3, "eectl_version": "0.1.0"}')
    assert not is_artifact(art)


def test_a_manifest_dtype_that_is_not_the_graphs_is_refused_at_load(artifact, tmp_path):
    """`dtype: fp16` with its shared weights converted and rehashed, on fp32 graphs: the runner allocated float16
    states for graphs that take float32 (ONNX Runtime's error mid-run); now the graphs' declared state types are
    checked against it where their sessions are created, naming the field."""
    art = _copy(artifact, tmp_path)
    for rel in ("weights/lm_head.npy", "weights/lm_head_rows.npy"):
        np.save(art / rel, np.load(art / rel).astype(np.float16))
        _rehash(art, rel)

    def fp16(doc):
        doc["dtype"] = "fp16"
        for w in doc["shared_weights"].values():
            w["dtype"] = "fp16"

    _edit(art, fp16)
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", *RUN]), 5)
    # the tiny Llama's embedding is its LM head's table, gathered at run time from the row-major copy
    # (runtime/tables.py row_embedding), so the first graph checked is the first segment's
    assert (
        "the manifest's dtype is fp16, but the graph segment_000_003.onnx declares tensor(float) for its input" in line
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("scope", "everything"),
        ("bits", 3),
        ("block_size", 8),
        ("block_size", 48),
        ("accuracy_level", 7),
        ("algorithm", "gptq"),
        ("lm_head", "int2"),
        ("embedding", "int4"),
        ("exit_lm_heads", "int8"),
        ("min_agreement", 1.5),
        ("lm_head_source", "gguf"),  # with source ort: not the file's table
    ],
)
def test_every_quantization_field_is_checked_at_read(artifact, tmp_path, field, value):
    """The quantization record (what the row probe, the int4 twin and bench read) against its schema: a bit width,
    block or level the kernels do not take was read as given and failed later, in ONNX Runtime or torch."""
    from eectl.export.quantize import Int4Options

    record = Int4Options().record("river")
    art = _edit(_copy(artifact, tmp_path), lambda d: d.__setitem__("quantization", record))
    assert read_manifest(art).quantization is not None  # the record as export writes it reads
    _edit(art, lambda d: d["quantization"].__setitem__(field, value))
    with pytest.raises(ArtifactError, match=f"quantization(.{field}|: .*{field})"):
        read_manifest(art)
