"""`eectl pipeline`: the worked example, every stage from one recipe, in order.

The plan is data: which stages run and where each output lands (artifacts/ under the working directory, named after
the model); pipeline/runner.py runs them by calling each stage's library function, the same one its command calls,
so a pipeline stage does exactly what the command of the same name does with the recipe's settings.

`dry_run` checks a recipe against its model without running a stage; `with_changes` points a recipe at another
copy of its checkpoint or other data. What this module does not do: implement a stage (the stage packages) or
print (cli/).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eectl.contracts.layers import default_exits
from eectl.contracts.recipe import Recipe, load_recipe
from eectl.errors import UsageError

STAGES = ("profile", "train-heads", "calibrate", "export", "run", "bench")


@dataclass
class Plan:
    name: str  # the model's name (and its weights where not fp32): every output is named after it
    folder: Path  # artifacts/
    stages: tuple[str, ...] = STAGES  # in the order they run

    @property
    def artifact(self) -> Path:
        return self.folder / self.name

    @property
    def report(self) -> Path:
        return self.folder / f"{self.name}-bench.md"

    @property
    def profile_plot(self) -> Path:
        return self.folder / f"{self.name}-profile.png"

    @property
    def heads(self) -> Path:
        return self.folder / f"{self.name}-heads.safetensors"

    @property
    def calibration(self) -> Path:
        return self.folder / f"{self.name}-calibration.json"


def plan(recipe: Recipe, folder: Path = Path("artifacts")) -> Plan:
    """Where the worked example's outputs land for a recipe; creates `folder`. An int4 recipe's outputs carry its
    weights in their names: its heads and thresholds are fitted against the int4 twin, and an fp32 run of the same
    model keeps its own artifact beside it (`bench ... --compare`)."""
    from eectl.models import resolve_source

    name = resolve_source(recipe.model).name + ("" if recipe.weights == "fp32" else f"-{recipe.weights}")
    folder.mkdir(parents=True, exist_ok=True)
    return Plan(name, folder)


@contextmanager
def with_changes(recipe: Path, model: str | None, data: str | None, weights: str | None = None) -> Iterator[Path]:
    """A copy of the recipe (in a temporary folder, same file name) whose model is `model`, whose data source is
    `data` and whose weights are `weights` (None: the recipe's): every stage reads it. A recipe for the built-in
    default model (its `model` null, e.g. the default recipe) given another checkpoint gets the default exits for
    that checkpoint's depth where its own do not fit, and no family check: both were the default model's. A recipe
    naming its model keeps its exits and family, which `--dry-run` checks against the checkpoint.
    A state cache in the budget's default folder moves to the new model's, data's or weights' own (a cache refuses
    what it was not built from). The folder is removed when the block ends, however it ends. The copy writes the
    recipe as read, its budget's sizes included."""
    import yaml

    from eectl.contracts.budgets import states_folder

    r = load_recipe(recipe)
    default_cache = r.heads.cache == states_folder(r.name, r.data.source, r.weights)
    owner = r.name  # whose state cache: the recipe's model's, or another checkpoint's
    if model is not None:
        from eectl.models import resolve_source

        owner = resolve_source(model).name
        if r.model is None:  # a recipe for the built-in default model: its exits and family were that model's
            r = r.model_copy(update={"exits": _exits_for(r.exits, model), "family": None})
        r = r.model_copy(update={"model": model})
    if weights is not None:
        if weights not in ("fp32", "int4"):
            raise UsageError(f"--weights must be fp32 or int4, got '{weights}'")
        r = r.model_copy(update={"weights": weights})
    if data is not None:
        r = r.model_copy(update={"data": r.data.model_copy(update={"source": data, "field": None})})
    if default_cache:
        heads = r.heads.model_copy(update={"cache": states_folder(owner, r.data.source, r.weights)})
        r = r.model_copy(update={"heads": heads})
    with tempfile.TemporaryDirectory(prefix="eectl-recipe-") as folder:
        path = Path(folder) / recipe.name
        path.write_text(yaml.safe_dump(r.model_dump(mode="json"), sort_keys=False), encoding="utf-8")
        yield path


def _exits_for(exits: list[int] | None, model: str) -> list[int] | None:
    """A recipe's exits on another checkpoint (`--model`): kept where they fit its layers, else None (the default
    exits for its depth, contracts/layers.py `default_exits`): a recipe's exits are for its own model's depth."""
    from eectl.models.loading import layer_count

    if not exits:
        return exits
    layers = layer_count(model)
    if layers is None or all(1 <= e < layers for e in exits):
        return exits
    return None


def check_bench_configs(recipe: Recipe) -> None:
    """The recipe's bench configurations are ones bench runs (bench is the last stage: a name it refuses is refused
    before the first)."""
    from eectl.evaluate.results import BUILT_IN_CONFIGS

    if unknown := [c for c in recipe.bench.configs if c not in BUILT_IN_CONFIGS]:
        raise UsageError(
            f"recipe {recipe.name}: unknown bench configuration '{unknown[0]}'",
            hint=f"choose from {', '.join(BUILT_IN_CONFIGS)}",
        )


@dataclass
class DryRun:
    recipe: str
    model: dict[str, Any]
    family: str
    num_layers: int
    exits: list[int]
    data: dict[str, Any]
    stages: list[tuple[str, str]] = field(default_factory=list)  # (stage, what it would run)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def dry_run(recipe: Recipe) -> DryRun:
    """Load the recipe's model and data and check what would otherwise fail minutes into a run: the family the
    recipe names, the exits against the layer count, the signal, Top-K against the vocabulary, the head design and
    the bench configurations. Runs no stage."""
    from eectl.data import load_text_data
    from eectl.exits.designs import check_design
    from eectl.exits.signals import get_signal
    from eectl.models import load_model

    check_bench_configs(recipe)  # needs no model
    loaded = load_model(recipe.model)
    a = loaded.adapter
    L = a.num_layers
    if recipe.family is not None and a.family != recipe.family:
        raise UsageError(f"recipe {recipe.name} is for the {recipe.family} family, but the model is {a.family}")
    exits = list(recipe.exits) if recipe.exits else default_exits(L)
    bad = [e for e in exits if not 1 <= e < L]
    if bad:
        raise UsageError(f"recipe {recipe.name}: exit {bad[0]} is not in 1..{L - 1} for this {L}-layer model")
    if bad := [i for i in recipe.int4.keep_layers if not 0 <= i < L]:  # the int4 twin refuses them at its first load
        raise UsageError(f"recipe {recipe.name}: int4.keep_layers names layer {bad[0]}, not in 0..{L - 1}")
    if recipe.signal is not None:
        get_signal(recipe.signal)
    if not 2 <= recipe.top_k <= a.dims.vocab_size:
        raise UsageError(f"recipe {recipe.name}: top_k {recipe.top_k} not in 2..{a.dims.vocab_size}")
    check_design(recipe.heads.design, recipe.heads.rank)
    text = load_text_data(recipe.data.source, recipe.data.field)
    h, b, pr = recipe.heads, recipe.bench, recipe.profile
    if h.cache is not None:
        from eectl.heads.supply import check_supply

        s = check_supply(loaded.tokenizer, text, recipe)
        heads = (
            f"{h.design} heads at exits {exits} from a state cache of {h.tokens} tokens ({h.gen_share:.0%} greedy "
            f"continuations of {s.prompts_needed}+ of {s.prompts} prompts) in {h.cache}, probes on {h.probe_tokens}"
        )
    else:
        heads = f"{h.design} heads at exits {exits}, {h.steps} steps, {h.eval_tokens} held-out tokens"
    stages = [
        ("profile", f"{pr.tokens or recipe.data.tokens} tokens of {text.name}, alpha {pr.alpha}, {pr.similarity}"),
        ("train-heads", heads),
        (
            "calibrate",
            f"{recipe.signal or 'learned (heads with probes)'} (K={recipe.top_k}) to {recipe.target} "
            f"on {recipe.data.tokens} tokens",
        ),
        ("export", f"{len(exits) + 1} segments, exits {exits}, {recipe.weights}"),
        ("run", f"one sample prompt, policy {recipe.kv_policy}"),
        (
            "bench",
            f"{', '.join(b.configs)}; {b.prompts} prompts x {b.max_new_tokens} tokens x {b.reps} reps, "
            f"perplexity on {b.ppl_tokens} tokens, sweep {b.sweep or 'none'}",
        ),
    ]
    return DryRun(recipe.name, loaded.source.to_dict(), a.family, L, exits, text.to_dict(), stages)
