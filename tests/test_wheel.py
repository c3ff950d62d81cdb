"""`pip install` from a built wheel gives a working eectl outside a clone: the wheel carries every module, the lm-eval
task files and the recipes, its `eectl` entry point runs, and a recipe named as in the README resolves from the
installed package where no recipes/ folder exists."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build(tmp: Path) -> Path:
    src = tmp / "src"  # built from a copy: the build's own files (build/, *.egg-info) never land in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "eectl", src / "eectl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("eectl-*.whl")
    return wheel


def test_a_wheel_installs_a_working_eectl(tmp_path):
    wheel = _build(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "eectl").rglob("*.py") if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)[:5]
    recipes = {f"eectl/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml")}
    assert recipes and recipes <= names
    assert {n for n in names if "lmeval_tasks/" in n and n.endswith(".yaml")}
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "eectl = eectl.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()

    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)]
    subprocess.run(pip, check=True, capture_output=True, timeout=600)
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = (
        "import eectl, sys; from eectl.contracts.recipe import load_recipe; "
        "r = load_recipe('recipes/smollm2-135m-instruct.yaml'); print(eectl.__file__); print(r.name)"
    )
    res = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    where, name = res.stdout.split()
    assert Path(where).is_relative_to(target) and name == "smollm2-135m-instruct"  # the wheel's code, not the clone's
    version = subprocess.run(
        [sys.executable, "-m", "eectl.cli", "--version"], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip().endswith("0.1.0"), version.stderr
