"""scripts/gpu_pack.py and scripts/gpu_check.py without a GPU, a network or a virtual environment: files split into
parts and joined again with every sha256 checked, a missing or corrupt part refused in one line, the device calls
kept under the tool's limits, and gpu_check's options and markers (which steps a second run skips)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_pack = _script("gpu_pack")
gpu_check = _script("gpu_check")
KIB = 1024


@pytest.fixture
def files(tmp_path) -> list[Path]:
    """Three files: one of many parts (its last part short), one of exactly two parts, one smaller than a part."""
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"big-1.0-py3-none-any.whl": 10 * KIB + 123, "even-1.0-py3-none-any.whl": 8 * KIB, "model.gguf": 100}
    out = []
    for i, (name, size) in enumerate(sizes.items()):
        path = src / name
        path.write_bytes(os.urandom(size) if i != 1 else bytes(range(256)) * (size // 256))
        out.append(path)
    return out


def _pack(tmp_path, files, part_kib=4.0, call_kib=9.0, tree=1000):
    return gpu_pack.pack(tmp_path / "pack", files, part_kib / KIB, call_kib / KIB, tree=tree, margin=0)


def _send(tmp_path, manifest, skip: str | None = None) -> Path:
    """Every call folder's files copied into one parts folder, as the device calls do (`skip`: one part lost)."""
    parts = tmp_path / "remote" / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for i in range(1, len(manifest["calls"]) + 1):
        for f in (tmp_path / "pack" / f"call-{i:02d}").iterdir():
            if f.name != skip:
                (parts / f.name).write_bytes(f.read_bytes())
    return parts


def test_split_and_join_round_trip_with_every_sha256(tmp_path, files):
    manifest = _pack(tmp_path, files)
    entries = {e["name"]: e for e in manifest["files"]}
    assert [len(entries[f.name]["parts"]) for f in files] == [3, 2, 1]  # 4 KiB parts; 8 KiB is exactly two
    assert manifest["gguf"] == "model.gguf" and len(manifest["wheels"]) == 2
    for e in manifest["files"]:
        assert sum(p["size"] for p in e["parts"]) == e["size"]
    parts = _send(tmp_path, manifest)
    assert gpu_pack.verify_parts(parts, manifest) == ([], [])
    joined = gpu_pack.unpack(parts, tmp_path / "files")
    for f, got in zip(files, joined, strict=True):
        assert got.read_bytes() == f.read_bytes() and gpu_pack.sha256(got) == entries[f.name]["sha256"]
    again = gpu_pack.unpack(parts, tmp_path / "files")  # re-running keeps the verified files
    assert [p.stat().st_mtime_ns for p in again] == [p.stat().st_mtime_ns for p in joined]


def test_a_missing_or_corrupt_part_is_refused_in_one_line(tmp_path, files, capsys):
    manifest = _pack(tmp_path, files)
    lost = manifest["files"][0]["parts"][1]["name"]
    parts = _send(tmp_path, manifest, skip=lost)
    with pytest.raises(gpu_pack.PackError, match=f"part {lost} is missing: send call \\d+ again"):
        gpu_pack.unpack(parts, tmp_path / "files")
    assert not (tmp_path / "files" / manifest["files"][0]["name"]).exists()
    good = tmp_path / "pack"
    (parts / lost).write_bytes(next(good.glob(f"call-*/{lost}")).read_bytes())
    victim = parts / manifest["files"][1]["parts"][0]["name"]
    data = bytearray(victim.read_bytes())
    data[17] ^= 0xFF  # same size, other bytes
    victim.write_bytes(bytes(data))
    assert gpu_pack.main(["unpack", "--parts", str(parts), "--to", str(tmp_path / "files")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: part {victim.name} is corrupt")
    assert gpu_pack.main(["check", "--parts", str(parts)]) == 1  # check says so too
    victim.unlink()
    assert gpu_pack.main(["check", "--parts", str(parts)]) == 0  # missing is normal between calls
    assert "1 missing (calls " in capsys.readouterr().out
    (parts / gpu_pack.MANIFEST).unlink()
    assert gpu_pack.main(["unpack", "--parts", str(parts), "--to", str(tmp_path / "files")]) == 1
    assert "no manifest.json" in capsys.readouterr().err


def test_the_plan_keeps_every_call_under_the_limit(tmp_path, files):
    tree = 1000
    manifest = _pack(tmp_path, files, call_kib=9.0, tree=tree)
    steps = gpu_pack.plan(manifest, ".gpu-pack", tree=tree)
    assert len(steps) == len(manifest["calls"]) >= 2
    sent = [p for s in steps for p in s["parts"]]
    assert sorted(sent) == sorted(p["name"] for e in manifest["files"] for p in e["parts"])  # each part once
    for s in steps:
        assert s["bytes"] <= 9 * KIB and len(s["carry"]) <= gpu_pack.CARRY_PATHS_MAX
        assert len(s["command"]) <= gpu_pack.COMMAND_MAX and s["carry"] == [f".gpu-pack/call-{s['call']:02d}"]
    assert (
        "gpu_pack.py unpack" in steps[-1]["command"] and "scripts/gpu_check.py --provider cuda" in steps[-1]["command"]
    )
    assert all("unpack" not in s["command"] for s in steps[:-1])
    assert "--gguf /tmp/eectl-gpu/files/model.gguf" in steps[-1]["command"]
    gpu_pack.check_plan(steps, 9.0 / KIB)
    with pytest.raises(gpu_pack.PackError, match="would send"):
        gpu_pack.check_plan(steps, 2.0 / KIB)
    with pytest.raises(gpu_pack.PackError, match="cannot fit in one call"):
        _pack(tmp_path, files, part_kib=8.0, call_kib=8.0)


def test_the_default_pack_fits_the_device_tool():
    """The real numbers: the default parts (56 MiB), this working tree, 64 MiB a call."""
    part = int(gpu_pack.PART_MIB * gpu_pack.MIB)
    manifest = {
        "files": [{"name": "w.whl", "size": 256 * gpu_pack.MIB, "sha256": "0", "parts": []}],
        "gguf": None,
        "calls": [],
    }
    parts = [{"name": f"w.whl.part{i:03d}", "size": part, "sha256": "0"} for i in range(4)]
    parts.append({"name": "w.whl.part004", "size": 256 * gpu_pack.MIB - 4 * part, "sha256": "0"})
    manifest["files"][0]["parts"] = parts
    tree = gpu_pack.tree_bytes()
    capacity = 64 * gpu_pack.MIB - tree - 8192 - gpu_pack.MIB
    manifest["calls"] = [[p["name"] for p in c] for c in gpu_pack.group_calls(parts, capacity)]
    gpu_pack.check_plan(gpu_pack.plan(manifest, tree=tree))


def test_small_files_fill_the_room_beside_large_parts():
    """First fit decreasing: 4 parts of 60 and small files of 1-3 in calls of 62.5 take the fewest calls (5: 247
    bytes over 62.5 each), no call over capacity, every part once, and a call's parts keep the input's order."""
    sizes = [1, 2, 3, 1, 60, 60, 60, 60, 1.5]
    parts = [{"name": f"p{i}", "size": int(s * 1000), "sha256": "0"} for i, s in enumerate(sizes)]
    calls = gpu_pack.group_calls(parts, 62_500)
    assert len(calls) == 5
    assert all(sum(p["size"] for p in c) <= 62_500 for c in calls)
    assert sorted(p["name"] for c in calls for p in c) == sorted(p["name"] for p in parts)
    for c in calls:
        assert [int(p["name"][1:]) for p in c] == sorted(int(p["name"][1:]) for p in c)
    with pytest.raises(gpu_pack.PackError, match="cannot fit in one call"):
        gpu_pack.group_calls(parts, 59_000)


def test_gpu_check_options(tmp_path, capsys):
    args = gpu_check.parse_args(["--out", str(tmp_path / "o")])
    assert args.provider == "cuda" and args.wheels is None and args.gguf is None and args.python == "python3"
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--out", "o", "--wheels", str(tmp_path / "nope")])
    assert exc.value.code == 2 and "is not a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "o", "--provider", "rocm"])
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--out", "o", "--gguf", str(tmp_path / "missing.gguf")])


def _fake(monkeypatch, calls: list[str], fail: str | None = None) -> None:
    """Every step replaced by one that records its call (and the tests step's `ok`)."""
    for step in gpu_check.STEPS:

        def run(self, step=step):
            calls.append(step)
            if step == fail:
                raise gpu_check.StepFailed(f"{step} broke")
            return {"ok": True, "passed": 1, "failed": 0, "errors": 0, "skipped": 0} if step == "tests" else {}

        monkeypatch.setattr(gpu_check.Check, f"step_{step}", run)


def test_gpu_check_skips_finished_steps_and_reruns_stale_ones(tmp_path, monkeypatch):
    out = tmp_path / "o"
    calls: list[str] = []
    _fake(monkeypatch, calls)
    assert gpu_check.main(["--out", str(out), "--provider", "cpu"]) == 0
    assert calls == gpu_check.STEPS
    summary = json.loads((out / gpu_check.SUMMARY).read_text())
    assert summary["verdict"]["passed"] and (out / gpu_check.LOG).is_file()
    calls.clear()
    assert gpu_check.main(["--out", str(out), "--provider", "cpu"]) == 0  # everything done: nothing runs
    assert calls == []
    summary = json.loads((out / gpu_check.SUMMARY).read_text())
    assert all(s.get("skipped") for s in summary["steps"].values()) and summary["verdict"]["passed"]
    assert gpu_check.main(["--out", str(out), "--provider", "cpu", "--threads", "3"]) == 0
    assert calls == ["bench", "peer", "reads"]  # their options changed; the earlier steps' did not
    calls.clear()
    assert gpu_check.main(["--out", str(out), "--provider", "cpu", "--threads", "3", "--redo", "export"]) == 0
    assert calls == ["export", "bench", "peer", "reads"]
    calls.clear()
    assert gpu_check.main(["--out", str(out), "--provider", "cuda"]) == 0  # another provider: all again
    assert calls == gpu_check.STEPS


def test_gpu_check_stops_at_a_failed_setup_step_and_resumes_there(tmp_path, monkeypatch):
    out, mirror = tmp_path / "o", tmp_path / "m"
    calls: list[str] = []
    _fake(monkeypatch, calls, fail="export")
    assert gpu_check.main(["--out", str(out), "--provider", "cpu", "--mirror", str(mirror)]) == 1
    assert calls == gpu_check.STEPS[: gpu_check.STEPS.index("export") + 1]  # the steps after export need it
    summary = json.loads((mirror / gpu_check.SUMMARY).read_text())  # the mirror holds the summary and the log
    assert summary["steps"]["export"] == {
        "status": "error",
        "seconds": summary["steps"]["export"]["seconds"],
        "error": "export broke",
    }
    assert not summary["verdict"]["passed"] and "export" in summary["verdict"]["steps_not_ok"]
    assert (mirror / gpu_check.LOG).is_file()
    calls.clear()
    _fake(monkeypatch, calls)
    assert gpu_check.main(["--out", str(out), "--provider", "cpu"]) == 0
    assert calls == ["export", "bench", "peer", "reads"]  # resumed at the step that failed


def test_gpu_check_stand_ins_skip_carried_and_installed_packages(tmp_path, monkeypatch):
    """The rehearsal installs what the GPU image would have had: eectl's requirements that neither the wheels nor
    the environment provide, torch pinned to this machine's CPU build; onnxruntime only ever from the wheels."""
    check = gpu_check.Check(gpu_check.parse_args(["--out", str(tmp_path / "o"), "--provider", "cpu"]))
    monkeypatch.setattr(gpu_check.Check, "run", lambda self, cmd, **k: json.dumps({"numpy": "2.4.6"}))
    wheels = [Path("transformers-5.24.0-py3-none-any.whl"), Path("pydantic_core-2.50.5-cp311-cp311-x.whl")]
    need = check.stand_ins(wheels)
    assert gpu_check.TORCH_CPU in need and "pytest>=8,<10" in need
    assert not any(n.startswith(("transformers", "numpy", "onnxruntime")) for n in need)


def test_gpu_check_steps_peer_and_reads_on_a_tiny_fp16_artifact(tiny_dirs, tmp_path):
    """The steps that use eectl's runtime, on the CPU EP: the resident path's host reads equal the CUDA plan's per
    token under copy and defer (verify's are at least all planned and light), and full depth against transformers
    gives the same greedy tokens. Here so a change of the runtime's API breaks this test, not the one GPU run."""
    from eectl.export.exporter import ExportOptions, export_artifact
    from eectl.models import load_model

    steps = _script("gpu_check_steps")
    model = str(tiny_dirs["llama"])
    export_artifact(load_model(model), tmp_path / "artifact", ExportOptions(exits=[2, 4], top_k=64, dtype="fp16"))
    common = ["--out", str(tmp_path), "--provider", "cpu", "--max-new-tokens", "6"]
    assert steps.main(["reads", *common, "--exits", "2,4", "--result", str(tmp_path / "reads.json")]) == 0
    reads = json.loads((tmp_path / "reads.json").read_text())
    assert reads["ok"] and reads["full_depth_plan_reads"] == [["exit_full", 6, "token"]]
    for policy in ("copy", "defer"):
        p = reads["policies"][policy]
        assert p["steps_equal_to_plan"] == p["steps"] == 6 and p["exited"] == 5
        assert p["host_reads_per_token"] == p["plan_reads_per_token"]
    assert gpu_check.verdict({"provider": "cpu", "steps": {"reads": {"status": "ok", "result": reads}}})[
        "reads_match_plan"
    ]
    assert steps.main(["peer", *common, "--model", model, "--prompts", "1", "--result", str(tmp_path / "p.json")]) == 0
    peer = json.loads((tmp_path / "p.json").read_text())
    assert peer["ok"] and peer["tokens_identical"] and peer["session_providers"] == ["CPUExecutionProvider"]
    assert peer["eectl_tokens_per_s"] > 0 and peer["hf_tokens_per_s"] > 0


def test_a_tree_without_git_is_one_line(tmp_path, files, capsys):
    with pytest.raises(gpu_pack.PackError, match="--tree-mib"):
        gpu_pack.tree_bytes(tmp_path)
    out = tmp_path / "pack"
    assert gpu_pack.main(["pack", "--wheels", str(files[0].parent), "--out", str(out), "--tree-mib", "2"]) == 0
    assert "calls, in this order" in capsys.readouterr().out and (out / gpu_pack.MANIFEST).is_file()
