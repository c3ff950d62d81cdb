"""calibration.json: the schema `eectl calibrate` writes and export and run read, and its I/O.

Thresholds are floats everywhere in memory, with inf meaning "never exits here" (the one representation the
runner's test, `eectl.exits.signals.passes`, understands directly). JSON has no inf, so the file writes null; the
conversion happens here, in the `Threshold` type, and nowhere else.

What this module does not do: measure or fit anything (exits/measure.py, calibrate/fit.py, exits/thresholds.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, ValidationError, model_validator

from eectl import __version__
from eectl.contracts.certificate import Certificate
from eectl.contracts.gates import GATE, Gate
from eectl.contracts.layers import check_exit_layers
from eectl.contracts.names import SIGNAL_SPECS, threshold_problem
from eectl.contracts.options import Option
from eectl.contracts.plan import LookupStats
from eectl.errors import ArtifactError, UsageError
from eectl.files import atomic_write_json, existing_file, read_utf8
from eectl.parsing import parse_json

SCHEMA_VERSION = 1


def _from_json(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        raise ValueError("a threshold must be a number, not NaN")  # NaN never passes: the exit would never fire
    return math.inf if v is None else v


def _to_json(v: float) -> float | None:
    return None if math.isinf(v) else v


# exit when the value is >= the threshold; inf (null in the file): never
Threshold = Annotated[float, BeforeValidator(_from_json), PlainSerializer(_to_json, return_type=float | None)]


def never_exits(thresholds: dict[str, float]) -> bool:
    return any(math.isinf(v) for v in thresholds.values())


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SplitStats(_Model):
    """One exit on one split."""

    reached: int  # tokens that no earlier exit took
    exited: int
    coverage: float  # exited / all tokens of the split
    precision: float | None  # agreement with the final top-1 among the exited tokens; None when none exited
    lower_bound: float | None = None  # Clopper-Pearson lower bound on precision (with --confidence)


class OverallStats(_Model):
    tokens: int
    exited: int
    exit_rate: float  # share of tokens that exit early
    precision: float | None  # agreement among tokens that exit early
    agreement: float  # agreement over all tokens (those that run every layer agree by definition)
    mean_layers: float  # exiting tokens count their exit layer, the others L
    speedup_bound: float  # L / mean_layers (decision and KV costs not counted)


class ExitResult(_Model):
    layer: int
    head: bool  # a trained head sits before the final norm + LM head at this exit
    thresholds: dict[str, Threshold]  # criterion -> exit when value >= threshold; inf (null on disk): never
    calibration: SplitStats
    heldout: SplitStats | None = None
    note: str | None = None

    @property
    def never(self) -> bool:
        return never_exits(self.thresholds)


class ModelInfo(_Model):
    name: str
    kind: str
    spec: str
    path: str | None
    sha256: str
    family: str
    num_layers: int


class DataInfo(_Model):
    name: str
    description: str
    records: int
    tokens: int  # measured tokens in all
    teacher_forced_tokens: int
    generated_tokens: int
    prompts_used: int  # prompts continued greedily (the data's prompts, last record first)
    chat_template: bool  # the prompts were wrapped in the tokenizer's chat template (as `eectl run` does)
    gen_tokens_per_prompt: int
    chunk_len: int
    holdout: float
    calibration_tokens: int
    heldout_tokens: int


class HeadsInfo(_Model):
    path: str
    sha256: str
    layers: list[int]


class CandidatesInfo(_Model):
    """The candidate source of signals that score candidates (exits/candidates.py): export builds its graph from
    this."""

    name: str  # first-exit-topk | shortlist | shortlist-int8 | int8
    size: int | None = None  # shortlist rows
    heldout_hit_rate: float | None = None  # share of held-out tokens (text and generated) inside the shortlist
    ids: list[int] | None = None  # the shortlist's token ids, most frequent first


class ComparedSource(_Model):
    """Another candidate source measured on the same tokens, fitted the same way (a comparison; not exported)."""

    exits: list[ExitResult]
    calibration: OverallStats
    heldout: OverallStats | None
    options: list[Option] = Field(default_factory=list)


class AheadTraces(_Model):
    """What verify drafting ahead (runtime/ahead.py) would see on calibration's greedy continuations, for the plan to
    price (plan/ahead.py): per exit without a block head, per continuation, at each generated token but the last, the
    exit's top-1 probability over the K candidates its candidate source picks there, negative where that top-1 is
    not the continuation's next token (one signed number a position keeps the file small)."""

    top_k: int = Field(ge=2)
    signed: dict[str, list[list[float]]]  # exit layer (str) -> per continuation -> per position

    @model_validator(mode="after")
    def _probabilities(self) -> AheadTraces:
        for layer, per in self.signed.items():
            if any(not 0.0 < abs(x) <= 1.0 for t in per for x in t):
                raise ValueError(f"exit {layer}: a top-1 probability outside (0, 1]")
        return self

    def traces(self, layer: int) -> list[tuple[list[float], list[bool]]]:
        """Exit `layer`'s traces as plan/ahead.py replays them: (probabilities, right) per continuation."""
        return [([abs(x) for x in t], [x > 0 for x in t]) for t in self.signed.get(str(layer), [])]

    def at_length(self, tokens: int) -> AheadTraces:
        """The traces of a run that generates at most `tokens` tokens (its --max-new-tokens): each continuation's
        first `tokens - 1` positions (position i decides the answer's token i + 1, and a run's first token comes
        from the prompt's pass); itself where that cuts nothing (a run as long as calibration's continuations or
        longer: nothing is known beyond them)."""
        keep = max(tokens - 1, 0)
        if all(len(t) <= keep for per in self.signed.values() for t in per):
            return self
        return self.model_copy(update={"signed": {e: [t[:keep] for t in per] for e, per in self.signed.items()}})


class Calibration(_Model):
    schema_version: int = SCHEMA_VERSION
    eectl_version: str = __version__
    model: ModelInfo
    data: DataInfo
    signal: str
    criteria: list[str]  # every one must be >= its threshold for a token to exit
    top_k: int | None  # local vocabulary size (signals that score candidates)
    candidates_layer: int | None  # where the candidates are picked: the first exit (signals that score candidates)
    candidates: CandidatesInfo | None = None  # how they are picked (None: the full LM head's Top-K)
    target: float = Field(gt=0.0, le=1.0)
    confidence: float | None
    heads: HeadsInfo | None = None
    exits: list[ExitResult]
    calibration: OverallStats
    heldout: OverallStats | None
    heldout_by_source: dict[str, OverallStats] = Field(default_factory=dict)
    options: list[Option] = Field(default_factory=list)  # the cost model's menu (calibrate_fit.fit_options)
    options_judged_on: int = 0  # tokens the menu is judged on, each out of fold (calibrate/fit.py options_judge)
    compared: dict[str, ComparedSource] = Field(default_factory=dict)  # --compare: other candidate sources
    # exit layer (str) -> its gate (eectl.exits.gates: a linear test on the state that skips the decision), which gated
    # options' thresholds ("gate") refer to; and the share of passing decisions their thresholds keep. Empty: none
    gates: dict[str, Gate] = Field(default_factory=dict)
    gate_keep: float | None = None
    # drafts from the context replayed on the generated continuations (the plan prices them); None: no continuations
    lookup: LookupStats | None = None
    # verify drafting ahead traced on the same continuations (the plan prices it); None: none, or files before it
    ahead: AheadTraces | None = None
    # calibrate --guarantee sequence: a risk-controlled setting for whole continuations (contracts/certificate.py)
    certificate: Certificate | None = None
    threads: int = 0
    device: str = "cpu"  # the torch device calibration ran on (cpu, cuda)
    wall_s: float = 0.0
    seconds_per_10k_tokens: float = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> Calibration:
        signal = SIGNAL_SPECS.get(self.signal)
        if signal is None:
            raise ValueError(f"unknown signal '{self.signal}'")
        if tuple(self.criteria) != signal.criteria:
            raise ValueError(f"criteria {self.criteria} do not match signal '{self.signal}'")
        layers = [x.layer for x in self.exits]
        try:
            if not layers or check_exit_layers(layers, self.model.num_layers) != layers:
                raise UsageError(f"exits {layers} must be ascending")
        except UsageError as exc:
            raise ValueError(f"exits: {exc.message}") from None
        for x in self.exits:
            if set(x.thresholds) != set(self.criteria):
                raise ValueError(f"exit {x.layer}: thresholds {sorted(x.thresholds)} != criteria {self.criteria}")
        for where, layer, thresholds in [
            *(("exit", x.layer, x.thresholds) for x in self.exits),
            *((f"option at exits {o.exits}, exit", x.layer, x.thresholds) for o in self.options for x in o.per_exit),
        ]:
            problems = [threshold_problem(c, v) for c, v in thresholds.items() if not math.isinf(v)]
            if bad := next((p for p in problems if p), None):  # a file edited by hand, or written by another tool
                raise ValueError(f"{where} {layer}: {bad}")
        if signal.needs_candidates and (self.top_k is None or self.top_k < 2 or self.candidates_layer != layers[0]):
            raise ValueError(f"{self.signal} needs top_k >= 2 and candidates_layer = the first exit")
        if self.confidence is not None and not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence {self.confidence} outside (0, 1)")
        for o in self.options:
            lacking = [x.layer for x in o.per_exit if GATE in x.thresholds and str(x.layer) not in self.gates]
            if lacking:
                raise ValueError(f"option at exits {o.exits}: a gate threshold at exit {lacking[0]} without its gate")
        return self

    @property
    def exit_layers(self) -> list[int]:
        return [x.layer for x in self.exits]

    def thresholds_by_layer(self) -> dict[int, dict[str, float]]:
        """Exit layer -> {criterion: threshold} (inf everywhere for an exit that never exits)."""
        return {x.layer: dict(x.thresholds) for x in self.exits}

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def write_calibration(cal: Calibration, path: str | Path) -> Path:
    """Write atomically (files.atomic_write: a temp file in the same folder, then a rename), as an ordinary file."""
    return atomic_write_json(path, cal.to_dict())


def read_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration.json; ArtifactError (one line) when missing, edited or of another schema."""
    p = existing_file(path, "calibration", ArtifactError, hint="run eectl calibrate")
    raw = parse_json(read_utf8(p, ArtifactError), f"{p.name} is not valid JSON", ArtifactError)
    if not isinstance(raw, dict):
        raise ArtifactError(f"{p.name} is not a calibration (not a JSON object)")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{p.name} has schema_version {version!r}; this eectl reads {SCHEMA_VERSION}",
            hint="recalibrate with this version of eectl",
        )
    try:  # strict, on the JSON text, as a manifest is read: "8" is not 8, 1.5 not an integer
        return Calibration.model_validate_json(json.dumps(raw), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "calibration"
        raise ArtifactError(f"{p.name}: {where}: {first['msg']}") from exc
