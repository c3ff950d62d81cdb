"""Faults a user meets, one test per item of the reliability issue: nothing lost, one line instead of a traceback,
nothing loaded from outside the artifact, no pickles, checks before the expensive load, one file-mode convention."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from eectl import files
from eectl.cli import app
from eectl.contracts.calibration import read_calibration, write_calibration
from eectl.contracts.heads import FORMAT
from eectl.contracts.manifest import MANIFEST, read_manifest
from eectl.contracts.recipe import load_recipe
from eectl.data import load_text_data
from eectl.errors import ArtifactError, DataError, OutputError, UsageError
from eectl.exits.designs import HeadStack, load_heads, make_head, save_heads
from eectl.export import exporter as export_mod
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.files import DestinationLock, Staging, clean_stale
from eectl.heads.checkpoint import CHECKPOINT_FORMAT, load_checkpoint
from eectl.run.generate import RunOptions, load_tokenizer, read_prompts, resolve_config
from eectl.runtime.sessions import ArtifactRuntime
from tests.conftest import make_calibration, make_heads_meta
from tests.tiny import GSM8K

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory) -> Path:
    """The tiny Llama exported once (exit after layer 3); tests copy it before tampering."""
    out = tmp_path_factory.mktemp("reliab") / "art"
    export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))
    return out


def _copy(artifact: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(artifact, dst)
    return dst


def _rehash(art: Path, rel: str) -> None:
    """Record `rel`'s current hash in the manifest: the content is bad, the hash check passes."""
    doc = json.loads((art / MANIFEST).read_text())
    doc["files"][rel] = files.sha256_file(art / rel)
    (art / MANIFEST).write_text(json.dumps(doc))


def _holder(code: str) -> subprocess.Popen[str]:
    """A separate Python process that runs `code` (which prints 'ready'), then sleeps until killed."""
    script = f"import sys, time\nsys.path.insert(0, {str(ROOT)!r})\nfrom eectl import files\n{code}\ntime.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


# --- 1. two exports to one destination ----------------------------------------------------------------------------


def test_1_export_holds_a_lock_and_rechecks_the_destination_at_the_rename(llama, tmp_path, monkeypatch):
    out = tmp_path / "art"
    with DestinationLock(out), pytest.raises(OutputError, match="being written by another eectl process"):
        export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))  # while another export writes `out`
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no folder, no staging, lock file gone

    # An artifact that appears at the destination while this export runs is not replaced without --force.
    validate = export_mod.validate_artifact

    def other_export_lands(loaded, folder, heads=None, log=None):
        out.mkdir()
        (out / MANIFEST).write_text(json.dumps({"schema_version": 1, "eectl_version": "0", "other": True}))
        return validate(loaded, folder, heads, log=log)

    monkeypatch.setattr(export_mod, "validate_artifact", other_export_lands)
    with pytest.raises(ArtifactError, match="already exists"):
        export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))
    assert json.loads((out / MANIFEST).read_text())["other"] is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_1_a_lock_left_by_a_killed_process_is_free(tmp_path):
    dest = tmp_path / "art"
    proc = _holder(f"lock = files.DestinationLock({str(dest)!r}).__enter__(); print('ready', flush=True)")
    try:
        with pytest.raises(OutputError, match=f"pid {proc.pid}"), DestinationLock(dest):
            pass
    finally:
        _kill(proc)
    assert files.lock_path(dest).exists()  # SIGKILL left the lock file behind ...
    with DestinationLock(dest):  # ... but not the lock: the kernel dropped it with the process
        pass
    assert not files.lock_path(dest).exists()


# --- 2. --force replaces only an eectl artifact -------------------------------------------------------------------


def test_2_force_refuses_a_users_folder_and_a_regular_file(llama, artifact, tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "cat.jpg").write_bytes(b"\xff\xd8 my cat")
    with pytest.raises(ArtifactError, match="not an eectl artifact"):
        export_artifact(llama, mine, ExportOptions(exits=[3], top_k=8, force=True))
    assert (mine / "cat.jpg").read_bytes() == b"\xff\xd8 my cat"
    note = tmp_path / "notes.txt"
    note.write_text("keep me")
    with pytest.raises(ArtifactError, match="not an eectl artifact"):
        export_artifact(llama, note, ExportOptions(exits=[3], top_k=8, force=True))
    assert note.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "photos"]  # no .old-* copy, no staging
    art = _copy(artifact, tmp_path, "art")  # an artifact is replaced
    export_artifact(llama, art, ExportOptions(exits=[2], top_k=8, force=True))
    assert read_manifest(art).exit_layers == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "notes.txt", "photos"]


# --- 3. stale staging folders of killed exports --------------------------------------------------------------------


def test_3_stale_staging_folders_are_removed_and_nothing_else(llama, tmp_path):
    dest = tmp_path / "art"
    proc = _holder(
        f"s = files.Staging(files.Path({str(dest)!r})).__enter__()\n"
        "(s.folder / 'segment.onnx').write_bytes(b'x' * 1000)\nprint('ready', flush=True)"
    )
    _kill(proc)  # an export killed mid-write
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".art.eectl-tmp-")]
    assert len(stale) == 1 and (stale[0] / files.STAGING_MARKER).is_file()
    unmarked = tmp_path / ".art.eectl-tmp-nomarker"  # our name, no marker: not ours to delete
    unmarked.mkdir()
    foreign = tmp_path / ".other.tmp-abc"  # someone else's temp folder, with a marker-like file
    foreign.mkdir()
    (foreign / files.STAGING_MARKER).write_text(json.dumps({"eectl": "staging"}))
    user = tmp_path / "data"
    user.mkdir()
    with Staging(tmp_path / "live") as live:  # a staging folder still being written (its marker is locked)
        export_artifact(llama, dest, ExportOptions(exits=[3], top_k=8))
        assert live.folder.is_dir()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".art.eectl-tmp-nomarker", ".other.tmp-abc", "art", "data"]


def test_3_an_artifact_moved_aside_by_a_killed_replace_is_put_back(tmp_path):
    dest = tmp_path / "art"
    proc = _holder(
        f"dest = files.Path({str(dest)!r}); dest.mkdir(); (dest / 'manifest.json').write_text('{{}}')\n"
        "old = files.Staging(dest, kind='old').__enter__(); dest.rename(old.folder / dest.name)\n"
        "print('ready', flush=True)"
    )
    _kill(proc)  # killed between moving the old artifact aside and renaming the new one in
    assert not dest.exists()
    assert len(clean_stale(tmp_path)) == 1
    assert (dest / "manifest.json").read_text() == "{}" and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


# --- 4. bytes that are not UTF-8 -----------------------------------------------------------------------------------


def test_4_non_utf8_inputs_are_one_line_with_the_offset(tmp_path):
    bad = b'{"question": "caf\xe9"}\n'
    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"question": "ok"}\n' + bad)
    with pytest.raises(DataError, match=r"not UTF-8 text: byte 0xe9 at offset 36 \(line 2\)"):
        load_text_data(str(data))
    text = tmp_path / "d.txt"
    text.write_bytes(b"para\xff")
    with pytest.raises(DataError, match="offset 4"):
        load_text_data(str(text))
    with pytest.raises(DataError, match="not UTF-8"):
        read_prompts(data)
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(UsageError, match="not UTF-8"):
        load_recipe(recipe)
    res = runner.invoke(app, ["run", str(tmp_path / "no-artifact"), "--prompt-file", str(data)])
    assert res.exit_code == 4 and res.stderr.count("\n") == 1 and "offset 36" in res.stderr


# --- 5. disk full, read-only destination --------------------------------------------------------------------------


def test_5_disk_full_and_read_only_are_one_line_and_leave_nothing(llama, artifact, tmp_path, monkeypatch):
    art = _copy(artifact, tmp_path, "art")
    before = read_manifest(art).files

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod.np, "save", full)
    with pytest.raises(OutputError, match=f"cannot write {art}: No space left on device"):
        export_artifact(llama, art, ExportOptions(exits=[2], top_k=8, force=True))
    monkeypatch.undo()
    assert read_manifest(art).files == before and sorted(p.name for p in tmp_path.iterdir()) == ["art"]

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path))

    monkeypatch.setattr(files.tempfile, "mkdtemp", read_only)
    with pytest.raises(OutputError, match="Read-only file system"):
        export_artifact(llama, tmp_path / "new", ExportOptions(exits=[2], top_k=8))
    monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
    with pytest.raises(OutputError, match="Read-only file system"):
        files.atomic_write_text(tmp_path / "calibration.json", "{}")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    files.atomic_write_text(tmp_path / "c.json", "old")
    with pytest.raises(OutputError, match="No space left"):
        files.atomic_write(tmp_path / "c.json", full)
    monkeypatch.setattr(Path, "write_bytes", full)  # heads and checkpoints are serialised, then written by Python
    with pytest.raises(OutputError, match="No space left"):
        save_heads(
            HeadStack({3: make_head("residual-linear", 64)}), make_heads_meta(llama, [3]), tmp_path / "h.safetensors"
        )
    monkeypatch.undo()
    assert (tmp_path / "c.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "c.json"]


# --- 6. artifact files with an updated hash but bad content -------------------------------------------------------


@pytest.mark.parametrize(
    "fault,message",
    [
        ("truncated-onnx", "cannot load the graph segment_000_003.onnx"),
        ("truncated-npy", "cannot load the weight weights/lm_head.npy"),
        ("object-npy", "cannot load the weight weights/lm_head.npy: Array can.t be memory-mapped: Python objects"),
        ("wrong-shape-npy", "the weight weights/lm_head.npy is float32 [3, 3]"),
        ("input-name", "has no input named 'no_such_input'"),
        ("tokenizer", "cannot load the tokenizer in tokenizer/"),
    ],
)
def test_6_bad_content_behind_a_valid_hash_is_one_line(artifact, tmp_path, fault, message):
    art = _copy(artifact, tmp_path)
    if fault == "truncated-onnx":
        f = art / "segment_000_003.onnx"
        f.write_bytes(f.read_bytes()[:5000])
        _rehash(art, "segment_000_003.onnx")
    elif fault.endswith("npy"):
        f = art / "weights" / "lm_head.npy"
        if fault == "truncated-npy":
            f.write_bytes(f.read_bytes()[:300])
        elif fault == "object-npy":
            np.save(f, np.array([{"x": 1}], dtype=object), allow_pickle=True)
        else:
            np.save(f, np.zeros((3, 3), np.float32))
        _rehash(art, "weights/lm_head.npy")
    elif fault == "input-name":
        doc = json.loads((art / MANIFEST).read_text())
        doc["segments"][0]["graph"]["inputs"]["hidden"] = "no_such_input"
        (art / MANIFEST).write_text(json.dumps(doc))
    else:
        (art / "tokenizer" / "tokenizer.json").write_text('{"model": "garbage"')
        _rehash(art, "tokenizer/tokenizer.json")
    with pytest.raises(ArtifactError, match=message.replace("[", r"\[")):
        load_tokenizer(ArtifactRuntime(art, provider="cpu"))


# --- 7. heads metadata ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["not-json", "no-exits", "not-an-object", "unknown-design"])
def test_7_bad_heads_metadata_is_one_line(llama, tmp_path, fault):
    doc = make_heads_meta(llama, [3]).model_dump(mode="json")
    if fault == "no-exits":
        del doc["exits"]
    elif fault == "unknown-design":
        doc["design"] = "cnn"
    text = {"not-json": "{not json", "not-an-object": "[3]"}.get(fault, json.dumps(doc))
    f = tmp_path / "h.safetensors"
    save_file({"exit_3.weight": torch.zeros(2, 2)}, str(f), metadata={"format": FORMAT, "eectl": text})
    with pytest.raises(
        ArtifactError, match=f"heads in h.safetensors have invalid metadata: {'' if fault != 'no-exits' else 'exits'}"
    ):
        load_heads(f, llama)


# --- 8. paths confined to the artifact ----------------------------------------------------------------------------


def test_8_manifest_paths_outside_the_artifact_are_refused_before_opening(artifact, tmp_path):
    art = _copy(artifact, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(art / "embed.onnx", outside / "embed.onnx")
    doc = json.loads((art / MANIFEST).read_text())
    doc["embedding"]["file"] = "../outside/embed.onnx"
    doc["files"]["../outside/embed.onnx"] = files.sha256_file(outside / "embed.onnx")
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="'../outside/embed.onnx' leaves the folder"):
        ArtifactRuntime(art, provider="cpu")
    doc = json.loads((artifact / MANIFEST).read_text())
    doc["files"]["/etc/hostname"] = "0" * 64  # a files entry alone is never opened or hashed
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="leaves the folder"):
        read_manifest(art)
    (art / MANIFEST).write_text(json.dumps(json.loads((artifact / MANIFEST).read_text())))
    (art / "tokenizer" / "added.json").write_text("{}")  # the tokenizer would read it: it must be listed
    with pytest.raises(ArtifactError, match="does not list"):
        read_manifest(art)
    (art / "tokenizer" / "added.json").unlink()
    (art / "embed.onnx").unlink()
    (art / "embed.onnx").symlink_to(outside / "embed.onnx")  # same bytes, same hash, outside the folder
    with pytest.raises(ArtifactError, match="'embed.onnx' leaves the folder"):
        read_manifest(art)


def test_8_graph_weights_files_are_hashed_and_confined(artifact, tmp_path):
    """A graph's external data (`.onnx.data`, named in the manifest) is hashed like any file, and a name or a symlink
    leaving the artifact is refused before ONNX Runtime opens it."""
    art = _copy(artifact, tmp_path)
    doc = json.loads((art / MANIFEST).read_text())
    data = doc["segments"][0]["graph"]["data"]
    assert data == doc["segments"][0]["graph"]["file"] + ".data" and data in doc["files"]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(art / data, outside / data)
    doc["segments"][0]["graph"]["data"] = f"../outside/{data}"
    doc["files"][f"../outside/{data}"] = doc["files"][data]
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="leaves the folder"):
        ArtifactRuntime(art, provider="cpu")
    (art / MANIFEST).write_text((artifact / MANIFEST).read_text())
    (art / data).unlink()
    (art / data).symlink_to(outside / data)  # same bytes, same hash, outside the folder
    with pytest.raises(ArtifactError, match=f"'{data}' leaves the folder"):
        ArtifactRuntime(art, provider="cpu")
    (art / data).unlink()
    shutil.copy(outside / data, art / data)
    with open(art / data, "r+b") as f:  # an edited weight
        f.seek(0)
        f.write(b"\x00" * 16)
    with pytest.raises(ArtifactError, match="hash"):
        ArtifactRuntime(art, provider="cpu")


# --- 9. no pickle anywhere -----------------------------------------------------------------------------------------


def test_9_checkpoints_are_safetensors_and_pickles_are_never_loaded(tmp_path):
    pickled = tmp_path / "old.ckpt"
    torch.save({"format": CHECKPOINT_FORMAT, "version": 1, "identity": "{}", "step": 3}, pickled)
    with pytest.raises(UsageError, match="not a readable checkpoint"):
        load_checkpoint(pickled, {})
    source = "\n".join(p.read_text() for p in (ROOT / "eectl").rglob("*.py"))
    for needle in ("torch.load(", "import pickle", "allow_pickle=True", "torch.save("):
        assert needle not in source, needle


# --- 10. non-finite thresholds --------------------------------------------------------------------------------------


def test_10_non_finite_thresholds_are_refused_everywhere(artifact, llama, tmp_path):
    rt = ArtifactRuntime(artifact, provider="cpu")
    for text in ("nan", "inf", "3:nan", "-inf"):
        with pytest.raises(UsageError, match="finite"):
            resolve_config(rt, RunOptions(exits="3", thresholds=text), (2,))
    with pytest.raises(UsageError, match="finite"):
        resolve_config(rt, RunOptions(exits="3", thresholds="0.9", threshold_scale=math.nan), (2,))
    res = runner.invoke(app, ["run", str(artifact), "hi", "--exits", "3", "--thresholds", "nan", "--threads", "1"])
    assert res.exit_code == 2 and "finite" in res.stderr
    cal = make_calibration(llama, {3: {"prob": 0.5}})
    write_calibration(cal, tmp_path / "c.json")
    raw = json.loads((tmp_path / "c.json").read_text())
    raw["exits"][0]["thresholds"]["prob"] = math.nan
    (tmp_path / "c.json").write_text(json.dumps(raw))  # json writes NaN, a Python extension of JSON
    with pytest.raises(ArtifactError, match="NaN is not a JSON number"):
        read_calibration(tmp_path / "c.json")
    with pytest.raises(ValueError, match="not NaN"):  # nor can a NaN threshold be built in memory
        make_calibration(llama, {3: {"prob": math.nan}})
    art = tmp_path / "calibrated"
    export_artifact(llama, art, ExportOptions(exits=[3], top_k=8), calibration=cal)
    doc = json.loads((art / MANIFEST).read_text())
    doc["calibration"]["exits"][0]["thresholds"]["prob"] = math.nan
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="NaN is not a JSON number"):
        read_manifest(art)


# --- 11. malformed JSON Lines ---------------------------------------------------------------------------------------


def test_11_malformed_jsonl_names_line_and_column(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "ok"}\n{"question": "a\tb"}\n')
    msg = "d.jsonl is not valid JSON Lines: Invalid control character at: line 2 column 16"
    with pytest.raises(DataError, match=msg):
        load_text_data(str(f))
    with pytest.raises(DataError, match=msg):
        read_prompts(f)
    f.write_text('{"question": "a\u2028b"}\n')  # a line separator inside a JSON string is not a line break
    assert load_text_data(str(f)).texts == ["a\u2028b"]


# --- 12. Ctrl-C -------------------------------------------------------------------------------------------------------


def test_12_interrupt_prints_interrupted_and_exits_130(monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("eectl.cli.cmd_run.load_recipe", interrupted)
    res = runner.invoke(app, ["run", "art", "hi"])
    assert res.exit_code == 130 and res.stderr == "interrupted\n"


# --- 13. options checked before the model loads -------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,code,text",
    [
        (["export", "--dtype", "fp8"], 2, "--dtype must be"),
        (["export", "--top-k", "1"], 2, "--top-k must be"),
        (["export", "--weights", "int8"], 2, "--weights must be"),
        (["export", "--exits", "3,3"], 2, "distinct"),
        (["export", "--out", "{existing}"], 5, "already exists"),
        (["export", "--out", "{existing}", "--force"], 5, "not an eectl artifact"),
        (["export", "--heads", "{missing}"], 2, "heads not found"),
        (["calibrate", "--out", "{existing}"], 2, "is a folder"),
        (["train-heads", "--exits", "2", "--out", "{file}/h.safetensors"], 2, "is not a folder"),
        (["profile", "--plot", "{existing}.png"], 2, "is a folder"),
        (["train-heads", "--exits", "2", "--resume", "{file}"], 2, "not a readable checkpoint"),
    ],
)
def test_13_cheap_options_are_checked_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch, args, code, text):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("eectl.models.load_model", no_load)
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing.png").mkdir()
    (tmp_path / "file").write_text("x")
    values = {"existing": tmp_path / "existing", "missing": tmp_path / "missing", "file": tmp_path / "file"}
    args = [a.format(**values) for a in args]
    data = [] if args[0] == "export" else ["--data", str(GSM8K)]
    res = runner.invoke(app, [args[0], str(tiny_dirs["llama"]), *args[1:], *data])
    assert res.exit_code == code, res.output
    assert res.stderr.startswith("error:") and text in res.stderr and res.stderr.count("\n") == 1


def test_13_run_options_are_checked_before_the_artifact_loads(monkeypatch, tmp_path):
    res = runner.invoke(app, ["run", str(tmp_path / "none"), "hi", "--threshold-scale", "nan"])
    assert res.exit_code == 2 and "--threshold-scale" in res.stderr  # not "artifact not found"
    res = runner.invoke(app, ["run", str(tmp_path / "none"), "hi", "--provider", "tpu"])
    assert res.exit_code == 2 and "--provider" in res.stderr
    res = runner.invoke(app, ["bench", str(tmp_path / "none"), "--report", str(tmp_path)])
    assert res.exit_code == 2 and "is a folder" in res.stderr


# --- 14. one file-mode convention -----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_14_outputs_are_ordinary_files(llama, tmp_path, umask):
    old = os.umask(umask)
    try:
        stack = HeadStack({3: make_head("residual-linear", llama.adapter.dims.hidden_size)})
        side = save_heads(stack, make_heads_meta(llama, [3]), tmp_path / "h.safetensors")
        cal = files.atomic_write_json(tmp_path / "calibration.json", {"a": 1})
        art = tmp_path / "art"
        export_artifact(llama, art, ExportOptions(exits=[3], top_k=8))
    finally:
        os.umask(old)
    want_file, want_dir = 0o666 & ~umask, 0o777 & ~umask
    for f in (side, tmp_path / "h.safetensors", cal, art / MANIFEST, art / "weights" / "lm_head.npy"):
        assert f.stat().st_mode & 0o777 == want_file, f
    assert art.stat().st_mode & 0o777 == want_dir and (art / "tokenizer").stat().st_mode & 0o777 == want_dir


def test_14_calibration_json_is_written_like_every_output(llama, tmp_path):
    cal = make_calibration(llama, {3: {"prob": 0.5}})
    path = write_calibration(cal, tmp_path / "calibration.json")
    assert path.stat().st_mode & 0o777 == files.file_mode() and read_calibration(path) == cal


def test_14_a_published_folder_has_output_modes_and_no_marker(tmp_path):
    with files.locked_staging(tmp_path / "out") as staging:
        f = staging.folder / "model.safetensors"
        f.write_bytes(b"x")
        f.chmod(0o600)  # as safetensors' writer leaves it
        staging.publish(replace=lambda _dest: False)
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == files.file_mode()
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in (tmp_path / "out").iterdir()] == [
        "model.safetensors"
    ]


def test_10_a_calibration_file_with_a_threshold_outside_its_criterions_range_is_refused(llama, tmp_path):
    """A probability threshold below 0 would let every token exit (a lossy exit the calibration never measured), one
    above 1 could never fire: refused when calibration.json (or the manifest's copy) is read, naming the exit."""
    cal = make_calibration(llama, {3: {"prob": 0.5}})
    write_calibration(cal, tmp_path / "c.json")
    assert read_calibration(tmp_path / "c.json").exits[0].thresholds == {"prob": 0.5}
    for value, said in [(-0.2, "would always fire"), (1.5, "could never fire")]:
        raw = json.loads((tmp_path / "c.json").read_text())
        raw["exits"][0]["thresholds"]["prob"] = value
        (tmp_path / "c.json").write_text(json.dumps(raw))
        with pytest.raises(
            ArtifactError, match=f"exit 3: prob threshold {value:g} is outside \\[0, 1\\]: the exit {said}"
        ):
            read_calibration(tmp_path / "c.json")
    raw["exits"][0]["thresholds"]["prob"] = None  # null: never exits, as calibrate writes it
    (tmp_path / "c.json").write_text(json.dumps(raw))
    assert math.isinf(read_calibration(tmp_path / "c.json").exits[0].thresholds["prob"])
    art = tmp_path / "calibrated"
    export_artifact(llama, art, ExportOptions(exits=[3], top_k=8), calibration=cal)
    doc = json.loads((art / MANIFEST).read_text())
    doc["calibration"]["exits"][0]["thresholds"]["prob"] = -0.2
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="would always fire"):
        read_manifest(art)
