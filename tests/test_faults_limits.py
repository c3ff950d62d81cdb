"""Faults of #34 about trust and limits: every graph hash-checked, the hf baseline checked against the artifact's
model, bounded chat templates, bounded recipe counts, a KV cache sized for what the run can reach, options checked
before the model loads, outputs published with their sidecars or not at all. One test per class; each failed on
the code before its fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.manifest import MANIFEST, read_manifest
from eectl.errors import ArtifactError
from eectl.export.exporter import ExportOptions, export_artifact

runner = CliRunner()


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory) -> Path:
    """The tiny Llama exported once (exit after layer 3); tests copy it before tampering."""
    out = tmp_path_factory.mktemp("limits") / "art"
    export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))
    return out


def _copy(artifact: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(artifact, dst)
    return dst


def _one_line(res, code: int) -> str:
    assert res.exit_code == code, res.output
    lines = res.stderr.strip().splitlines()  # progress lines ("loading ...") may come first
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in res.stderr, res.stderr
    return errors[0]


# --- 1. every graph the manifest names is hashed ---------------------------------------------------------------


def test_a_block_graph_missing_from_files_is_refused_at_load(artifact, tmp_path):
    """A block exit head's graphs (and any graph field) must be in `files`: before, a block graph named only in
    `exits[i].block` was opened and run with no hash check."""
    art = _copy(artifact, tmp_path)
    doc = json.loads((art / MANIFEST).read_text())
    exit3 = next(e for e in doc["exits"] if e["layer"] == 3)
    seg = doc["segments"][0]
    shutil.copy(art / seg["graph"]["file"], art / "block_003.onnx")  # some graph, in the folder, never hashed
    exit3["block"] = {
        "graph": {**seg["graph"], "file": "block_003.onnx", "data": seg["graph"]["data"]},
        "kv_graph": seg["kv_graph"],
        "kv_slot": doc["dims"]["num_layers"],
        "init_layer": 2,
        "cost_layers": 1.0,
    }
    (art / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=r"files not hashed: \['block_003.onnx'\]"):
        read_manifest(art)
    with pytest.raises(ArtifactError, match="files not hashed"):
        read_manifest(art, verify_hashes=False)  # listing is checked even where hashes are not
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2"]), 5)
    assert "block_003.onnx" in line and "files" in line


# --- 2. eval's hf baseline is the artifact's model ---------------------------------------------------------------


def test_the_hf_baseline_is_checked_against_the_artifacts_model_hash(artifact, tmp_path, monkeypatch):
    """`eval --configs hf` loads the checkpoint the manifest names: its weights must hash to model.sha256 (before,
    any model at that path was the baseline, silently)."""
    from eectl.evaluate.lmeval import hf_checkpoint
    from tests.tiny import GSM8K

    hf = hf_checkpoint(artifact)
    assert hf.checked and "model.sha256" in hf.note
    assert Path(hf.pretrained) == Path(json.loads((artifact / MANIFEST).read_text())["model"]["path"])
    art = _copy(artifact, tmp_path)
    doc = json.loads((art / MANIFEST).read_text())
    doc["model"]["sha256"] = "0" * 64  # what the checkpoint at model.spec hashed to at export: not what it is now
    (art / MANIFEST).write_text(json.dumps(doc))

    def no_eval(*a, **k):
        raise AssertionError("lm-eval ran before the checkpoint was checked")

    monkeypatch.setattr("lm_eval.simple_evaluate", no_eval)
    args = ["eval", str(art), "--configs", "full,hf", "--tasks", "eectl_gsm8k_loglik", "--gsm8k", str(GSM8K)]
    line = _one_line(runner.invoke(app, [*args, "--limit", "1"]), 3)
    assert "not the model it was exported from" in line and "model.sha256" in line
