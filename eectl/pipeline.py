"""`eectl pipeline`: the worked example, every stage from one recipe, in order.

The plan is data: which stages run, with which arguments, and where each output lands (artifacts/ under the
working directory, named after the model). The CLI runs each step with its own command, so a pipeline stage does
exactly what the command of the same name does.

What this module does not do: implement a stage (the stage modules) or print (cli.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eectl.recipe import load_recipe

STAGES = ("profile", "train-heads", "calibrate", "export", "run", "bench")


@dataclass
class Plan:
    name: str  # the model's name: every output is named after it
    folder: Path  # artifacts/
    steps: list[tuple[str, dict[str, Any]]]  # (command, its keyword arguments), in STAGES order

    @property
    def artifact(self) -> Path:
        return self.folder / self.name

    @property
    def report(self) -> Path:
        return self.folder / f"{self.name}-bench.md"

    @property
    def profile_plot(self) -> Path:
        return self.folder / f"{self.name}-profile.png"


def plan(recipe: Path, prompt: str, threads: int | None = None, folder: Path = Path("artifacts")) -> Plan:
    """The steps of the worked example for a recipe; creates `folder`."""
    from eectl.models import resolve_source

    r = load_recipe(recipe)
    name = resolve_source(r.model).name
    folder.mkdir(parents=True, exist_ok=True)
    heads = folder / f"{name}-heads.safetensors"
    calibration = folder / f"{name}-calibration.json"
    p = Plan(name, folder, [])
    common = {"recipe": recipe, "threads": threads}
    p.steps = [
        ("profile", {"plot": p.profile_plot, **common}),
        ("train-heads", {"out_path": heads, **common}),
        ("calibrate", {"heads": heads, "out_path": calibration, **common}),
        ("export", {"calibration": calibration, "heads": heads, "out": p.artifact, "force": True, **common}),
        ("run", {"artifact": str(p.artifact), "prompt": prompt, "max_new_tokens": 64, **common}),
        ("bench", {"artifact": str(p.artifact), "report": p.report, **common}),
    ]
    assert tuple(s for s, _ in p.steps) == STAGES
    return p
