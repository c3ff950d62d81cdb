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


# --- 3. chat templates are rendered within bounds -----------------------------------------------------------------


def _with_template(artifact: Path, tmp_path: Path, template: str) -> Path:
    """A copy of the artifact whose tokenizer has `template` as its chat template (listed and hashed)."""
    from eectl.files import sha256_file

    art = _copy(artifact, tmp_path, f"t{len(list(tmp_path.iterdir()))}")
    doc = json.loads((art / MANIFEST).read_text())
    path = art / doc["tokenizer_dir"] / "chat_template.jinja"
    path.write_text(template)
    doc["files"][f"{doc['tokenizer_dir']}/chat_template.jinja"] = sha256_file(path)
    (art / MANIFEST).write_text(json.dumps(doc))
    return art


CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|a|>{% endif %}"
)


@pytest.mark.parametrize(
    "template,text",
    [
        # 4 million loop steps (today's code spins through them; 100000 x 100000 spun for minutes)
        ("{% for i in range(2000) %}{% for j in range(2000) %}{% endfor %}{% endfor %}", "range() items"),
        ("{{ 'x' * 10**8 }}", "repeats 1 items 100000000 times"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),
        ("{% if %}", "TemplateSyntaxError"),
        ("{{ raise_exception('only user and assistant roles') }}", "TemplateError: only user and assistant roles"),
    ],
)
def test_a_runaway_or_failing_chat_template_is_one_line(artifact, tmp_path, template, text):
    art = _with_template(artifact, tmp_path, template)
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", "-n", "2", "--exits", "none"]), 5)
    assert text in line and f"tokenizer in {art / 'tokenizer'}" in line and "--raw" in line


def test_chat_templates_stop_at_the_time_bound_and_ids_are_unchanged(artifact, tmp_path, monkeypatch):
    """A loop with no range(), no call and no output (nested loops over a string) is stopped by the time bound; a
    sound template gives transformers' own ids, and --raw skips the template."""
    import time

    from eectl import data
    from tests.tiny import tiny_tokenizer

    monkeypatch.setattr(data, "TEMPLATE_SECONDS", 0.5)
    spin = "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
    art = _with_template(artifact, tmp_path, spin)
    t0 = time.monotonic()
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", "-n", "2", "--exits", "none"]), 5)
    assert "renders for more than 0.5 s" in line and time.monotonic() - t0 < 30
    assert runner.invoke(app, ["run", str(art), "hi", "-n", "2", "--exits", "none", "--raw"]).exit_code == 0
    tok = tiny_tokenizer()
    tok.chat_template = CHAT
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert data.chat_ids(tok, messages) == list(
        tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    )
    art = _with_template(artifact, tmp_path, CHAT)
    assert runner.invoke(app, ["run", str(art), "hi", "-n", "2", "--exits", "none"]).exit_code == 0


# --- 4. every count is bounded, in the recipe and on the command line ---------------------------------------------


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("heads", "steps", 10**22),
        ("heads", "rank", 10**9),
        ("heads", "tokens", 10**12),
        ("heads", "eval_tokens", 10**12),
        ("data", "tokens", 10**12),
        ("profile", "tokens", 10**12),
        ("bench", "prompts", 10**9),
        ("bench", "max_new_tokens", 10**9),
        ("bench", "reps", 10**6),
        ("bench", "ppl_tokens", 10**12),
    ],
)
def test_recipe_counts_have_upper_bounds(tmp_path, section, key, value):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\n{section}:\n  {key}: {value}\n")
    line = _one_line(runner.invoke(app, ["pipeline", "--recipe", str(recipe), "--dry-run"]), 2)
    assert f"{section}.{key}" in line and "less than or equal" in line


@pytest.mark.parametrize(
    "args,text",
    [
        (["train-heads", "--steps", str(10**22)], "--steps must be in 1..10000000, got 10000000000000000000000"),
        (["train-heads", "--rank", str(10**9), "--design", "low-rank"], "--rank must be in 1..65536"),
        (["train-heads", "--eval-tokens", str(10**12)], "--eval-tokens must be in 1..100000000"),
        (["calibrate", "--tokens", str(10**12)], "--tokens must be in 1..100000000"),
        (["calibrate", "--gen-tokens", str(10**9)], "--gen-tokens must be in 1..1048576"),
        (["profile", "--tokens", str(10**12)], "--tokens must be in 1..100000000"),
    ],
)
def test_count_options_have_the_recipes_bounds_before_the_model_loads(monkeypatch, args, text):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("eectl.models.load_model", no_load)
    assert text in _one_line(runner.invoke(app, args), 2)


def test_artifact_count_options_are_bounded_before_the_artifact_loads(artifact, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the artifact was loaded before the options were checked")

    monkeypatch.setattr("eectl.run.generate.ArtifactRuntime", no_load)
    monkeypatch.setattr("eectl.runtime.sessions.ArtifactRuntime", no_load)
    for args, text in (
        (["run", str(artifact), "hi", "-n", str(10**9)], "--max-new-tokens must be in 1..1048576"),
        (["run", str(artifact), "hi", "--batch-size", str(10**6)], "--batch-size must be in 1..4096"),
        (["bench", str(artifact), "--prompts", str(10**9)], "--prompts must be in 1..1000000"),
        (["bench", str(artifact), "--reps", str(10**6)], "--reps must be in 1..1000"),
        (["bench", str(artifact), "--ppl-tokens", str(10**12)], "--ppl-tokens must be in 0..100000000"),
    ):
        assert text in _one_line(runner.invoke(app, args), 2), args


# --- 5. the KV cache: sized for what the run reaches, refused in one line when memory cannot hold it ------------


def test_a_huge_max_positions_allocates_only_what_the_run_reaches(artifact, tmp_path):
    art = _copy(artifact, tmp_path)
    doc = json.loads((art / MANIFEST).read_text())
    doc["max_positions"] = 2**24  # the most a manifest may state: a cache of that many positions is gigabytes
    (art / MANIFEST).write_text(json.dumps(doc))
    res = runner.invoke(app, ["run", str(art), "hi", "-n", "3", "--exits", "none", "--raw"])
    assert res.exit_code == 0, res.output
    doc["max_positions"] = 2**40  # beyond any model: a damaged manifest
    (art / MANIFEST).write_text(json.dumps(doc))
    line = _one_line(runner.invoke(app, ["run", str(art), "hi", "-n", "3", "--exits", "none", "--raw"]), 5)
    assert "max_positions" in line and str(2**24) in line


def test_a_model_with_a_huge_context_is_one_line_before_export_builds_its_tables(tiny_dirs, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2**40  # rotary tables of 2**40 positions: terabytes
    (model / "config.json").write_text(json.dumps(config))
    line = _one_line(runner.invoke(app, ["export", str(model), "--out", str(tmp_path / "art")]), 3)
    assert f"context of {2**40} positions" in line and "max_position_embeddings" in line
    assert not (tmp_path / "art").exists()


def test_a_kv_cache_that_memory_cannot_hold_is_refused_before_allocating(artifact, tmp_path, monkeypatch):
    """MemAvailable, or the memory cgroup's limit less its usage (plus its page cache), below the cache plus the
    mapped weights: one line naming both sizes and where the figure comes from (was numpy's ArrayMemoryError, or
    the OOM killer with no message)."""
    from eectl.runtime import memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:      64 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", meminfo)
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "no-cgroup")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "no-root")
    args = ["run", str(artifact), "hi", "-n", "3", "--exits", "none", "--raw"]
    line = _one_line(runner.invoke(app, args), 2)
    assert "the KV cache of 1 row(s) x" in line and "MemAvailable" in line and "64.0 KiB" in line
    assert "--max-new-tokens" in line
    # a cgroup v2 limit: 600 MB, nearly used, little page cache
    meminfo.write_text("MemAvailable:   100000000 kB\n")
    group = tmp_path / "root" / "job"
    group.mkdir(parents=True)
    (tmp_path / "cgroup").write_text("0::/job\n")
    (group / "memory.max").write_text(f"{600 << 20}\n")
    (group / "memory.current").write_text(f"{(600 << 20) - 2048}\n")
    (group / "memory.stat").write_text("anon 1\nactive_file 1024\ninactive_file 1024\n")
    monkeypatch.setattr(memory, "PROC_CGROUP", tmp_path / "cgroup")
    monkeypatch.setattr(memory, "CGROUP_ROOT", tmp_path / "root")
    assert memory.available_bytes() == (4096, "the memory cgroup's memory.max (600.0 MiB)")
    line = _one_line(runner.invoke(app, args), 2)
    assert "only 4.0 KiB of memory is available (the memory cgroup's memory.max" in line
    (group / "memory.max").write_text("max\n")  # no limit: MemAvailable decides, and it is plenty
    assert runner.invoke(app, args).exit_code == 0


# --- 6. options checked before the model or the artifact loads ----------------------------------------------------


@pytest.mark.parametrize(
    "args,text",
    [
        (["--weights", "int4", "--int4-block-size", "7"], "--int4-block-size must be a power of two >= 16, got 7"),
        (["--weights", "int4", "--int4-accuracy-level", "9"], "--int4-accuracy-level must be one of 0..4, got 9"),
        (["--weights", "int4", "--int4-algorithm", "bogus"], "--int4-algorithm must be one of"),
        (["--weights", "int4", "--lm-head", "bogus"], "--lm-head must be one of"),
        (["--weights", "int4", "--int4-keep-layers", "-1"], "--int4-keep-layers"),
        (["--candidates", "bogus"], "--candidates must be one of"),
    ],
)
def test_export_options_are_checked_before_the_model_loads(tiny_dirs, tmp_path, monkeypatch, args, text):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("eectl.models.load_model", no_load)
    res = runner.invoke(app, ["export", str(tiny_dirs["llama"]), "--out", str(tmp_path / "a"), *args])
    assert text in _one_line(res, 2)


@pytest.mark.parametrize(
    "option,value,text",
    [
        ("--signal", "bogus", "--signal must be one of"),
        ("--exits", "abc", "--exits must be comma-separated"),
        ("--thresholds", "abc", "--thresholds: cannot parse"),
        ("--thresholds", "nan", "--thresholds must be finite numbers"),
        ("--prompt-drafts", "99", "--prompt-drafts must be in 0..64"),
        ("--provider", "bogus", "--provider must be auto or one of"),
    ],
)
def test_bench_options_are_checked_before_the_artifact_loads(artifact, monkeypatch, option, value, text):
    """The options `run` checks before loading (commit 3edd53a), checked the same way by bench."""

    def no_load(*a, **k):
        raise AssertionError("the artifact was loaded before the options were checked")

    monkeypatch.setattr("eectl.evaluate.bench.ArtifactRuntime", no_load)
    res = runner.invoke(app, ["bench", str(artifact), option, value, "--prompts", "1"])
    assert text in _one_line(res, 2)


# --- 7. an output and its sidecars are published together or not at all -----------------------------------------


def test_heads_and_their_sidecar_are_published_together_or_not_at_all(llama, tmp_path, monkeypatch):
    """A disk that fills while the .json sidecar is written: before, the new .safetensors was already in place
    beside the old .json (or none); now neither is published and the previous pair is left as it was."""
    import errno

    from eectl.errors import OutputError
    from eectl.exits.designs import HeadStack, make_head, save_heads
    from tests.conftest import make_heads_meta

    out = tmp_path / "h.safetensors"
    stack = HeadStack({3: make_head("residual-linear", llama.adapter.dims.hidden_size)})
    side = save_heads(stack, make_heads_meta(llama, [3]), out)
    before = {p.name: p.read_bytes() for p in (out, side)}
    real = Path.write_text

    def full_at_the_sidecar(self, *a, **k):
        if ".json." in self.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full_at_the_sidecar)
    newer = make_heads_meta(llama, [3])
    newer.steps = 7  # another training: other bytes in both files
    with pytest.raises(OutputError, match=r"cannot write .*h\.json: No space left on device"):
        save_heads(stack, newer, out)
    assert {p.name: p.read_bytes() for p in (out, side)} == before  # the previous pair, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.json", "h.safetensors"]  # no temporaries
    out.unlink()
    side.unlink()
    with pytest.raises(OutputError):
        save_heads(stack, make_heads_meta(llama, [3]), out)
    assert list(tmp_path.iterdir()) == []  # nothing published at all
