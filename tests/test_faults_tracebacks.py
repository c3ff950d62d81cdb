"""Inputs of #34 that gave a Python traceback instead of one line: names the file system cannot hold, hostile
JSON/YAML (deep nesting, huge integers, lone surrogates, NUL bytes), manifest dimensions that do not match the graphs,
and a few option and data faults. One test per class; each failed on the code before its fix."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.contracts.calibration import read_calibration
from eectl.contracts.manifest import MANIFEST
from eectl.data import load_text_data
from eectl.errors import ArtifactError, DataError, UsageError
from eectl.exits.designs import head_width
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.files import atomic_write_text, lock_path, locked_staging
from eectl.run.chat import conversation_ids
from eectl.run.generate import load_tokenizer
from eectl.runtime.sessions import ArtifactRuntime
from tests.tiny import GSM8K, save_tiny

runner = CliRunner()


def _one_line(res, code: int) -> str:
    """The command failed with exit `code` and exactly one `error:` line, the last one, with no traceback."""
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    lines = res.stderr.strip().splitlines()  # progress lines ("loading ...") may come first
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in res.stderr, res.stderr
    return errors[0]


# --- 1. names the file system cannot hold --------------------------------------------------------------------------


LONG = "a" * 300  # over NAME_MAX (255 bytes): OSError "File name too long" wherever it was first used


@pytest.mark.parametrize(
    "args,option",
    [
        (["run", f"/tmp/{LONG}", "hi"], "ARTIFACT"),
        (["run", "art", "--prompt-file", f"/tmp/{LONG}.jsonl"], "--prompt-file"),
        (["run", "art", "hi", "--recipe", f"/tmp/{LONG}.yaml"], "--recipe"),
        (["calibrate", "m", "--data", f"/tmp/{LONG}.jsonl"], "--data"),
        (["calibrate", "m", "--out", f"/tmp/{LONG}.json"], "--out"),
        (["calibrate", "m", "--heads", f"{LONG}.safetensors"], "--heads"),
        (["train-heads", "m", "--cache", f"/tmp/x/{LONG}"], "--cache"),
        (["export", f"/tmp/{LONG}"], "MODEL"),
        (["export", "m", "--calibration", f"{LONG}.json"], "--calibration"),
        (["bench", "art", "--report", f"{LONG}.md"], "--report"),
        (["profile", "m", "--plot", f"{LONG}.png"], "--plot"),
        (["eval", "art", "--gsm8k", f"{LONG}.jsonl"], "--gsm8k"),
        (["pipeline", "--recipe", f"{LONG}.yaml", "--dry-run"], "--recipe"),
    ],
)
def test_a_name_too_long_for_the_file_system_is_one_line_in_every_path_option(args, option):
    line = _one_line(runner.invoke(app, args), 2)
    assert line.startswith(f"error: {option} cannot name a file: "), line
    assert " bytes; a file name may have at most 255" in line


def test_a_long_path_inside_a_recipe_is_one_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\ndata:\n  source: {tmp_path / LONG}\n")
    line = _one_line(runner.invoke(app, ["calibrate", "nowhere", "--recipe", str(recipe)]), 2)  # data before model
    assert "300 bytes" in line and "at most 255" in line


def test_a_legal_long_output_name_is_written_and_locked(tmp_path):
    """A 250-byte name is legal, but its temporary (.NAME.xxxxxxxx.eectl-part), staging folder and lock file added
    bytes and failed with ENAMETOOLONG; they are now shortened (a hash of the name), the output keeps its name."""
    name = "c" * 245 + ".json"
    assert len(name) == 250
    out = atomic_write_text(tmp_path / name, "{}\n")
    assert out.read_text() == "{}\n" and sorted(p.name for p in tmp_path.iterdir()) == [name]
    dest = tmp_path / ("d" * 250)
    with locked_staging(dest) as staging:
        assert len(lock_path(dest).name) <= 255 and lock_path(dest).exists()
        (staging.folder / "manifest.json").write_text("{}")
        staging.publish(lambda d: False)
    assert (dest / "manifest.json").is_file() and not lock_path(dest).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, dest.name])


def test_a_sidecar_name_too_long_is_refused_before_any_work(tmp_path):
    """train-heads writes x.json and x.ckpt.safetensors beside x.safetensors: a legal --out whose sidecar is not."""
    out = tmp_path / ("h" * 240 + ".safetensors")  # 252 bytes
    line = _one_line(runner.invoke(app, ["train-heads", "nowhere", "--out", str(out)]), 2)
    assert "beside it cannot be written" in line and "at most 255" in line


# --- 2. hostile JSON / YAML: deep nesting, huge integers, NUL bytes in manifest paths ------------------------------


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory) -> Path:
    """The tiny Llama exported once (exit after layer 3); tests copy it before tampering."""
    out = tmp_path_factory.mktemp("tracebacks") / "art"
    export_artifact(llama, out, ExportOptions(exits=[3], top_k=8))
    return out


def _edited(artifact: Path, tmp_path: Path, edit) -> Path:
    art = tmp_path / "art"
    shutil.copytree(artifact, art)
    text = (art / MANIFEST).read_text()
    (art / MANIFEST).write_text(edit(text))
    return art


DEEP = "[" * 5000 + "]" * 5000  # RecursionError in json / yaml
HUGE = "7" * 5000  # ValueError: Exceeds the limit (4300 digits) for integer string conversion


@pytest.mark.parametrize("value,why", [(DEEP, "nested more than 64 levels deep"), (HUGE, "more than 4300 digits")])
def test_deep_or_huge_json_and_yaml_are_one_line_everywhere(artifact, tmp_path, value, why):
    art = _edited(artifact, tmp_path, lambda t: t.replace('"top_k": 8', f'"top_k": {value}', 1))
    assert why in _one_line(runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2"]), 5)
    cal = tmp_path / "calibration.json"
    cal.write_text(f'{{"schema_version": 1, "exits": {value}}}')
    with pytest.raises(ArtifactError, match=why):
        read_calibration(cal)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nexits: {value}\n")
    assert why in _one_line(runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run"]), 2)
    rows = tmp_path / "p.jsonl"
    rows.write_text(f'{{"prompt": "a"}}\n{{"prompt": "b", "n": {value}}}\n')
    line = _one_line(runner.invoke(app, ["run", str(artifact), "--prompt-file", str(rows), "--raw", "-n", "2"]), 4)
    assert why in line and "line 2" in line
    with pytest.raises(DataError, match=why):
        load_text_data(str(rows))


def test_a_nul_byte_in_a_manifest_path_is_one_line(artifact, tmp_path):
    art = _edited(artifact, tmp_path, lambda t: t.replace('"embed.onnx"', '"embed\\u0000.onnx"'))
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2"]), 5)
    assert "NUL byte" in line


# --- 3. lone surrogates in prompts and data -------------------------------------------------------------------------


def test_lone_surrogates_in_prompts_and_data_are_one_line(artifact, tmp_path):
    """A `\\ud800` escape in JSON, or bytes that are not UTF-8 in argv or stdin (Python passes them on as lone
    surrogates): tokenizers raised TypeError: TextEncodeInput must be Union[...]."""
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "a\\ud800b"}\n')
    line = _one_line(runner.invoke(app, ["run", str(artifact), "--prompt-file", str(rows), "-n", "2"]), 4)
    assert "lone surrogate \\ud800" in line and "line 1" in line
    with pytest.raises(DataError, match="lone surrogate"):
        load_text_data(str(rows))
    args = ["run", str(artifact), "hi\udcff", "--raw", "-n", "2", "--thresholds", "0.9"]  # argv byte 0xff
    assert "the prompt is not UTF-8 text: byte 0xff" in _one_line(runner.invoke(app, args), 4)
    tok = load_tokenizer(ArtifactRuntime(artifact))
    with pytest.raises(DataError, match="the turn is not UTF-8 text: byte 0xff"):  # a --chat line from stdin
        conversation_ids(tok, [{"role": "user", "content": "hi\udcff"}], raw=True, history=[])


# --- 4. manifest dimensions that disagree with the graphs; ONNX Runtime's run errors --------------------------------


@pytest.mark.parametrize(
    "section,key,value",
    [("kv", "num_kv_heads", 3), ("kv", "head_dim", 8), ("dims", "hidden_size", 32), ("dims", "vocab_size", 100)],
)
def test_manifest_dimensions_that_disagree_with_the_graphs_are_refused_at_load(artifact, tmp_path, section, key, value):
    """The runner sizes its KV buffers and outputs from these fields: a wrong one was ORT's `Got invalid dimensions
    for input: past_key_values.0.key ...` traceback mid-run; now checked against the graphs' declared shapes."""

    def edit(text: str) -> str:
        doc = json.loads(text)
        doc[section][key] = value
        return json.dumps(doc)

    art = _edited(artifact, tmp_path, edit)
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", "--raw", "-n", "2", "--thresholds", "0.5"]), 5)
    assert f"the manifest's {section}.{key} is {value}, but the graph " in line


def test_onnx_runtime_run_errors_are_one_line(artifact):
    """What the load-time check cannot see fails in ONNX Runtime: mapped in one place (runtime/ort.CheckedSession) to
    an ArtifactError naming the graph, with ORT's first line."""
    rt = ArtifactRuntime(artifact)
    weight = rt.weight_feeds(rt.embedding, "embed")
    # the tiny Llama's embedding is its LM head's table: the runtime gathers rows of the row-major copy in a graph
    # of its own (runtime/tables.py row_embedding), named so
    name = re.escape("embedding gathering LM head rows (in memory)")
    for feeds in ({"input_ids": np.zeros((1, 2), np.float32), **weight}, {"input_ids": np.zeros((1, 2), np.int64)}):
        with pytest.raises(ArtifactError, match=rf"^ONNX Runtime failed running the graph {name}: ") as err:
            rt.embedding.session.run(None, feeds)  # float ids (int64 expected); the weight missing
        assert "\n" not in err.value.message


# --- 5. option and data faults: --seed, a model without layers, --cache a file, eval --gsm8k, low-rank ranks ------


def test_a_negative_seed_is_refused_before_the_artifact_loads(artifact):
    """numpy's generators take no negative seed: `ValueError: expected non-negative integer` when sampling began."""
    args = ["run", str(artifact), "hi", "--raw", "-n", "2", "--thresholds", "0.5", "--temperature", "0.8"]
    line = _one_line(runner.invoke(app, [*args, "--seed", "-1"]), 2)
    assert line == f"error: --seed must be in 0..{2**63 - 1}, got -1"
    big = str(2**70)  # torch's manual_seed: `ValueError: Overflow when unpacking long long` after the model loaded
    line = _one_line(runner.invoke(app, ["train-heads", "nowhere", "--seed", big]), 2)
    assert line == f"error: --seed must be in 0..{2**63 - 1}, got {big}"


def test_a_model_without_decoder_layers_is_one_line(tmp_path):
    """num_hidden_layers 0 loaded, then failed in export's validation (KeyError: 0) or profile (IndexError)."""
    folder = save_tiny("llama", tmp_path / "m0")
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 0
    (folder / "config.json").write_text(json.dumps(config))
    line = _one_line(runner.invoke(app, ["export", str(folder), "--out", str(tmp_path / "a0")]), 3)
    assert "num_hidden_layers 0" in line and "at least 2 decoder layers" in line
    assert not (tmp_path / "a0").exists()


def test_train_heads_cache_naming_a_file_is_one_line(tmp_path):
    """The state cache is a folder: a file there was FileExistsError at its mkdir, after the model loaded."""
    (tmp_path / "states").write_text("mine")
    line = _one_line(runner.invoke(app, ["train-heads", "nowhere", "--cache", str(tmp_path / "states")]), 2)
    assert "--cache" in line and "is a file, not a folder" in line
    assert (tmp_path / "states").read_text() == "mine"
    line = _one_line(runner.invoke(app, ["train-heads", "nowhere", "--cache", str(tmp_path / "states" / "x")]), 2)
    assert "is not a folder" in line


@pytest.mark.parametrize(
    "content,text",
    [
        (b'{"question": "1+1?", "answer": "#### 2"}\n{"question": \n', "is not valid JSON Lines"),
        (b'{"question": "caf\xe9?", "answer": "#### 2"}\n', "is not UTF-8 text: byte 0xe9"),
        (b'{"question": "1+1?", "solution": "#### 2"}\n', "line 1 has no answer string"),
        (b"\n\n", "holds no GSM8K records"),
    ],
)
def test_a_bad_gsm8k_file_is_one_line_before_anything_runs(artifact, tmp_path, content, text):
    """eval --gsm8k: lm-eval read the file inside its task and raised KeyError, UnicodeDecodeError, JSONDecodeError or
    evaluated nothing; now read as the task reads it (data.read_gsm8k) before any configuration runs."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_bytes(content)
    res = runner.invoke(app, ["eval", str(artifact), "--gsm8k", str(data), "--configs", "full", "--limit", "1"])
    assert text in _one_line(res, 4)


def test_a_low_rank_head_of_a_rank_above_the_hidden_size_is_refused(tiny_dirs, tmp_path):
    with pytest.raises(UsageError, match="--rank 65 is larger than the model's hidden size 64"):
        head_width("low-rank", 65, 64)
    assert head_width("low-rank", 64, 64) == 64 and head_width("mlp", 256, 64) == 256  # an mlp's width is not a rank
    args = ["train-heads", str(tiny_dirs["llama"]), "--design", "low-rank", "--rank", "5000", "--data", str(GSM8K)]
    line = _one_line(runner.invoke(app, [*args, "--steps", "1", "--out", str(tmp_path / "h.safetensors")]), 2)
    assert "is larger than the model's hidden size 64" in line and not (tmp_path / "h.safetensors").exists()


def test_a_damaged_state_cache_index_is_one_line(tmp_path):
    """train-heads --cache DIR reads DIR/cache.json: a damaged one was JSONDecodeError, RecursionError or
    AttributeError ('list' object has no attribute 'get'); now it is parsed like every other JSON input."""
    from eectl.heads.state_cache import open_cache

    for text, why in ((DEEP, "nested more than 64"), ("[1]", "is not an eectl state cache"), ("{", "not valid JSON")):
        (tmp_path / "cache.json").write_text(text)
        with pytest.raises(UsageError, match=why):
            open_cache(tmp_path)


def test_a_damaged_result_cache_entry_is_recomputed(tmp_path, monkeypatch):
    """profile's content-keyed cache: a deep entry raised RecursionError (only OSError/ValueError were caught)."""
    from eectl import cache

    monkeypatch.setattr(cache, "results_dir", lambda: tmp_path)
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "k.json").write_text(DEEP)
    assert cache.read("profile", "k") is None


def test_stdin_that_is_not_utf8_is_one_line_in_a_strict_utf8_locale(exported):
    """`run -` and `--prompt-file -` read standard input as bytes and decode them as files are decoded, so a strict
    UTF-8 locale (Python's stdin then raises UnicodeDecodeError) gives the same one line as a C locale."""
    import os
    import subprocess
    import sys

    _, folder = exported["llama"]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict", "LC_ALL": "C.UTF-8"}
    for args in (["-"], ["--prompt-file", "-"]):
        res = subprocess.run(
            [sys.executable, "-m", "eectl.cli", "run", str(folder), *args],
            input=b"caf\xe9 au lait\n",
            env=env,
            capture_output=True,
            timeout=120,
        )
        err = res.stderr.decode().strip().splitlines()
        assert res.returncode == 2 and len(err) == 1, res.stderr.decode()
        assert "standard input is not UTF-8 text: byte 0xe9 at offset 3 (line 1)" in err[0]


def test_an_artifact_file_that_cannot_be_read_is_one_line(artifact, monkeypatch):
    """A graph, weight or tokenizer file with no read permission (chmod 000; eectl run as another user): the hash
    check's open() raised PermissionError, a traceback; now an ArtifactError naming the file. Faked here, since the
    tests may run as root, whom permissions do not stop."""
    import errno

    from eectl.contracts import manifest

    real = manifest.sha256_file

    def denied(path, *a, **k):
        if Path(path).name == "embed.onnx":
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(manifest, "sha256_file", denied)
    line = _one_line(runner.invoke(app, ["run", str(artifact), "hi", "--raw", "-n", "2"]), 5)
    assert line == f"error: cannot read {artifact / 'embed.onnx'}: Permission denied"


# --- 6. a configuration named twice in bench --policies ------------------------------------------------------------


def test_a_configuration_named_twice_in_bench_policies_is_one_line(artifact, monkeypatch):
    """`bench --policies defer,defer` gave the one runner two turns in each step-by-step block: its KV cache met a
    second step at the same positions, a RuntimeError traceback from the chain. Refused before the artifact loads."""

    def no_load(*a, **k):
        raise AssertionError("the artifact was loaded before --policies was checked")

    monkeypatch.setattr("eectl.evaluate.bench.ArtifactRuntime", no_load)
    args = ["bench", str(artifact), "--data", str(GSM8K), "--prompts", "1", "--thresholds", "0.9"]
    line = _one_line(runner.invoke(app, [*args, "--policies", "verify,defer,full,defer,verify"]), 2)
    assert line == "error: --policies names defer, verify more than once"
