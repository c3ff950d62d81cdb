"""Outputs never overwrite inputs (#34, data loss): one check (output_checks.check_outputs) before any work, for every
command that writes files, its sidecars included; non-regular and symlinked targets refused; `export --force`
replaces an artifact's own files only."""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from tests.tiny import GSM8K


def _run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _refused(res, *words: str) -> None:
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), res.stderr


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "d.jsonl"
    shutil.copy(GSM8K, d)
    return d


def test_calibrate_refuses_to_write_over_its_data_or_heads(tiny_dirs, data, tmp_path):
    model = tiny_dirs["llama"]
    before = data.read_bytes()
    _refused(_run("calibrate", model, "--data", data, "--out", data), "--out", "would overwrite --data")
    assert data.read_bytes() == before
    heads = tmp_path / "h.safetensors"
    heads.write_bytes(b"not really heads")
    _refused(_run("calibrate", model, "--data", data, "--heads", heads, "--out", heads), "would overwrite --heads")
    assert heads.read_bytes() == b"not really heads"
    link = tmp_path / "same.jsonl"  # another name for the data: compared after resolving links
    link.symlink_to(data)
    _refused(_run("calibrate", model, "--data", link, "--out", data), "would overwrite --data")


def test_train_heads_from_a_cache_checks_its_output_too(tiny_dirs, data, tmp_path):
    """The state-cache and probe-only paths of train-heads check --out like the per-token path: not an input (the
    heads it fits probes onto), not inside the state cache it reads, before any work."""
    model = tiny_dirs["llama"]
    heads = tmp_path / "h.safetensors"
    heads.write_bytes(b"not really heads")
    cache = tmp_path / "states"
    res = _run("train-heads", model, "--probe-only", "--heads", heads, "--cache", cache, "--out", heads)
    _refused(res, "--out", "would overwrite --heads")
    assert heads.read_bytes() == b"not really heads"
    cache.mkdir()
    res = _run("train-heads", model, "--data", data, "--cache", cache, "--out", cache / "heads.safetensors")
    _refused(res, "--out", "inside")
    assert list(cache.iterdir()) == []


def test_sidecars_are_checked_like_the_output(tiny_dirs, tmp_path, exported):
    model = tiny_dirs["llama"]
    x = tmp_path / "x.json"
    shutil.copy(GSM8K, x)
    before = x.read_bytes()
    # train-heads writes x.json (its metadata) beside x.safetensors; profile writes x.json beside x.md
    _refused(_run("train-heads", model, "--data", x, "--out", tmp_path / "x.safetensors"), "x.json beside it")
    _refused(_run("profile", model, "--data", x, "--report", tmp_path / "x.md"), "x.json beside it")
    assert x.read_bytes() == before
    art = exported["llama"][1]
    manifest = (art / "manifest.json").read_bytes()
    _refused(_run("bench", art, "--data", GSM8K, "--report", art / "manifest.md"), "inside ARTIFACT")
    _refused(_run("train-heads", model, "--data", GSM8K, "--out", art / "manifest.safetensors"), "eectl artifact")
    assert (art / "manifest.json").read_bytes() == manifest


def test_non_regular_and_symlinked_outputs_are_refused(tiny_dirs, tmp_path):
    model = tiny_dirs["llama"]
    _refused(_run("calibrate", model, "--data", GSM8K, "--out", "/dev/null"), "not a regular file")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    _refused(_run("calibrate", model, "--data", GSM8K, "--out", fifo), "not a regular file")
    target = tmp_path / "real.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    _refused(_run("calibrate", model, "--data", GSM8K, "--out", link), "symbolic link")
    assert link.is_symlink() and target.read_text() == "{}"


def test_export_force_keeps_a_users_files_and_its_inputs(tiny_dirs, exported, tmp_path):
    model = tiny_dirs["llama"]
    art = tmp_path / "art"
    shutil.copytree(exported["llama"][1], art)
    mine = art / "notes.txt"
    mine.write_text("mine")
    res = _run("export", model, "--out", art, "--force")
    assert res.exit_code == 5 and "notes.txt" in res.stderr and "own files" in res.stderr, res.output
    assert mine.read_text() == "mine" and (art / "manifest.json").is_file()
    mine.unlink()
    heads = art / "tokenizer" / "heads.safetensors"  # an input inside the folder --force would replace
    heads.write_bytes(b"x")
    res = _run("export", model, "--out", art, "--force", "--heads", heads)
    assert res.exit_code == 2 and "inside --out" in res.stderr, res.output
    assert heads.read_bytes() == b"x"


def test_sigterm_during_export_cleans_up_like_ctrl_c(tiny_dirs, tmp_path, monkeypatch):
    """SIGTERM arrives mid-export (after the graphs are written): exit 143, one line, and neither the staging folder
    nor the lock file is left beside --out."""
    import signal
    import time

    def killed(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)  # the handler raises here
        raise AssertionError("SIGTERM was not delivered")

    monkeypatch.setattr("eectl.export.exporter.validate_artifact", killed)
    out = tmp_path / "out" / "art"
    res = _run("export", tiny_dirs["llama"], "--out", out, "--exits", "2,4")
    assert res.exit_code == 143 and res.stderr.endswith("\nterminated\n"), res.output
    assert not out.exists() and list(out.parent.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the command's handler is gone
