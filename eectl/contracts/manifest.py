"""The artifact manifest: the single contract between `eectl export` and `eectl run`.

It names every file (with its SHA-256), every graph input and output, the KV layout, the exits and their
thresholds, and the export's validation result. The runner reads names from here and never rebuilds them.

`read_manifest` is the one reading of an artifact: every field checked against the schema (strict types: "512" is
not 512; ranges; names a registry knows; nothing listed twice) and against the folder (every path confined, every file
listed, hashed and a regular file, nothing unlisted beside them, the shared weights' dtype, shape, order and
finiteness), before anything the manifest names is opened by ONNX Runtime: an ArtifactError (exit 5), one line
naming the field. The graphs' declared shapes are checked against the fields when their sessions are created
(runtime/ort.py `_check_names`, from `graph_axes` here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eectl.contracts.artifact_files import (
    Dtype,
    SharedWeight,
    check_unlisted,
    check_weight,
    file_kind,
    regular_file,
)
from eectl.contracts.calibration import Calibration
from eectl.contracts.certificate import Certificate
from eectl.contracts.heads import HeadsMeta
from eectl.contracts.names import CANDIDATE_SOURCE_NAMES, FAMILIES, POLICY_SPECS, SHORTLISTS
from eectl.contracts.plan import Costs, Plan
from eectl.errors import ArtifactError
from eectl.files import atomic_write_text, confined, read_utf8, sha256_file
from eectl.parsing import parse_json

# 2: the calibration and the heads metadata are typed, and per-exit thresholds live only in `calibration`.
# 3: optional fields an eectl reading 2 does not know: block exit heads (`ExitPoint.block`), the bound chain's costs
#    (`Costs.chain_step_ms`, `bound_exits`), the exit graphs' in-graph decision io, and the cost samples and plan
#    intervals (`Costs.samples_ms`, `Prediction.interval`, `Plan.level`; without them the costs are planned as exact).
#    Written as 3, so an older eectl says "unknown schema version" instead of a field error; version 2 artifacts
#    still load (all of 3's additions are optional, and the runner falls back where a graph lacks them).
SCHEMA_VERSION = 3
READABLE_VERSIONS = (2, 3)
MANIFEST = "manifest.json"
# The longest context an artifact may state (16 Mi positions: beyond any released model's). Each segment graph embeds
# rotary tables of that many positions, and a KV cache is sized from it, so a larger value is a damaged manifest or
# config (a model with max_position_embeddings 2**40 asked torch for an 8 TB table at export).
MAX_POSITIONS = 1 << 24


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GraphIO(_M):
    """A graph file and its input/output names; list-valued entries are per decoder layer, in layer order."""

    file: str
    data: str | None = None  # the graph's weights (ONNX external data), next to `file`; None: all inline
    inputs: dict[str, str | list[str]]
    outputs: dict[str, str | list[str]]


class Segment(_M):
    index: int = Field(ge=0)
    layers: tuple[int, int]  # decoder layers [lo, hi)
    graph: GraphIO  # hidden + past KV -> hidden + present KV (one graph for prefill, decode and chunks)
    kv_graph: GraphIO  # hidden -> this segment's K/V only (the `copy` policy)
    river: GraphIO | None = None  # `export --river`: an int4 copy with the same names (the `river` policy)


class BlockExit(_M):
    """A block exit head (head_designs.BlockHead): one decoder layer of the model's shape between the exit's state
    and the frozen final norm + LM head, with its own KV buffer. Every position that passes the exit's layer runs
    it (while the exit is active), so its KV holds exactly the positions its segment's KV holds."""

    graph: GraphIO  # hidden [1, S, H] + its past KV -> block output [1, S, H] + present KV (in place, one buffer)
    kv_graph: GraphIO  # hidden -> the block's K/V only (the `copy` policy projects a skipped token's state into it)
    kv_slot: int  # index of its KV buffer in the runner's buffers: after the L decoder layers' (L, L + 1, ...)
    init_layer: int  # the decoder layer it runs as (rotary kind, attention window) and was initialised from
    cost_layers: float  # multiply-adds per token relative to a decoder layer (1.0: the same shape), attention aside


class ExitPoint(_M):
    layer: int  # exit after this many decoder layers (== L for the final head)
    full: GraphIO  # hidden [N, H] -> logits [N, V], Top-K candidates and their logits, greedy token [N]
    local: GraphIO  # hidden [N, H] + candidates [N, K] -> candidate logits [N, K]
    candidates: GraphIO | None = None  # hidden [N, H] -> K candidates [N, K] + exact logits (the candidate source)
    river: GraphIO | None = None  # final head only, `export --river --lm-head int4|int8`: the river's quantized head
    certified: GraphIO | None = None  # final head only: its greedy token certified from an 8-bit ranking (or None)
    head: str | None = None  # trained head design, None for the plain logit lens
    block: BlockExit | None = None  # a block head: full/local/candidates then score the block's output (no head)


class Quantization(_M):
    """Weight-only quantization (export/quantize.py): which graphs, and ORT's MatMulNBits settings."""

    scope: Literal["segments", "river"]  # every segment graph (export --weights int4), or only the river copies
    op: str  # com.microsoft::MatMulNBits
    tool: str  # ORT's quantizer and version
    bits: Literal[4]
    block_size: Literal[16, 32, 64, 128, 256, 512, 1024, 2048, 4096]  # input channels per scale
    symmetric: bool
    accuracy_level: int = Field(ge=0, le=4)  # MatMulNBits compute type (0 unset / fp32, 4 int8 activations)
    algorithm: Literal["rtn", "hqq", "gguf"]  # ORT's default block quantizer, HQQ, or the GGUF's own blocks
    lm_head: Literal["fp32", "int8", "int4"]  # the final exit's LM head: fp32 (the shared table) or its own
    embedding: Literal["fp32"]  # precision of the embedding table
    exit_lm_heads: Literal["fp32"]  # precision of the intermediate exits' LM head (the shared table)
    keep_layers: list[int]  # decoder layers left in fp32
    min_agreement: float = Field(ge=0.0, le=1.0)  # the validation floor on greedy agreement at the final exit
    source: Literal["ort", "gguf"] = "ort"  # the segments' weights: ORT's quantizer (older ones) or the GGUF's blocks
    gguf_types: dict[str, int] | None = None  # source gguf: the file's projection tensors by type, counted
    gguf_not_held: dict[str, int] | None = None  # ... and those of types left fp32 in the graphs (not held exactly)
    lm_head_source: Literal["ort", "gguf"] = "ort"  # a quantized head's: the file's own table (exactly) or ORT's
    lm_head_gguf_type: str | None = None  # lm_head_source gguf: the table's GGUF type (models/gguf_blocks.py)

    @model_validator(mode="after")
    def _head_from_the_file(self) -> Quantization:
        held = self.source == "gguf" and self.lm_head != "fp32" and self.lm_head_gguf_type
        if self.lm_head_source == "gguf" and not held:
            raise ValueError("lm_head_source gguf needs source gguf, a quantized lm_head and lm_head_gguf_type")
        return self


# The shared table key of the LM head stored row-major, [V, H] (beside `lm_head`, [H, V]): a graph gathering K rows
# reads K contiguous rows, not K strided columns. Older artifacts have none; their local exits gather columns.
LM_HEAD_ROWS = "lm_head_rows"


class KVLayout(_M):
    layout: Literal["BNSH"] = "BNSH"  # [batch, kv_heads, max_sequence, head_dim]: the only layout the graphs take
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    past_key: list[str]  # per decoder layer: past_key_values.{i}.key
    past_value: list[str]
    present_key: list[str]  # per decoder layer: present.{i}.key
    present_value: list[str]
    buffer: str = "one preallocated buffer per layer, bound as both past input and present output (written in place)"
    positions: str = "position of a token == its slot in the cache; seqlens_k = total length - 1, per row"
    # zero positions a one-row segment call appends (export --exact-wide, export/graphs.py _RowPad): written to the
    # slot after the call's positions, so every buffer holds one more slot
    pad: int = Field(default=0, ge=0, le=1)
    # the segment graphs' initializer ([1], its value in the graphs: every MatMul's rows padded) that a runtime sets to
    # [0] (attention only) where this CPU computes one row as two (runtime/sessions.py); None: graphs exported before
    # it, which pad attention only
    pad_switch: str | None = None


class Manifest(_M):
    schema_version: int
    eectl_version: str
    model: dict[str, Any]
    family: str  # a name in contracts/names.py FAMILIES
    dims: dict[str, int]
    dtype: Dtype
    opset: int = Field(ge=1)
    tokenizer_dir: str
    eos_token_ids: list[int] = Field(min_length=1)  # none: generation could only stop at its token budget
    max_positions: int = Field(ge=2, le=MAX_POSITIONS)
    top_k: int = Field(ge=2)  # at most the vocabulary (checked with dims)
    embedding: GraphIO
    segments: list[Segment]
    exits: list[ExitPoint]  # in layer order; the last one is the final head (layer == L)
    shared_weights: dict[str, SharedWeight]
    kv: KVLayout
    kv_policies: list[str]  # the KV policies the runner may use with this artifact (eectl.runtime.policies)
    quantization: Quantization | None = None  # weight-only int4 graphs (export --weights int4 / --river)
    calibration: Calibration | None = None  # signal, exits and thresholds (inf: never exits) from eectl calibrate
    # calibrate --guarantee sequence on this artifact: a certified setting for whole continuations
    certificate: Certificate | None = None
    # how the first active exit picks the K candidates: {"name": first-exit-topk|shortlist|int8, "size", "ids"}
    candidate_source: dict[str, Any] = Field(default_factory=lambda: {"name": "first-exit-topk"})
    costs: Costs | None = None  # measured per-graph costs (plan/costs.py), the cost model's input
    plan: Plan | None = None  # the exits and thresholds chosen by predicted speed (plan/choose.py); run/bench default
    heads: HeadsMeta | None = None
    files: dict[str, str] = Field(default_factory=dict)  # relative path -> sha256
    validation: dict[str, Any] = Field(default_factory=dict)

    @field_validator("family")
    @classmethod
    def _known_family(cls, v: str) -> str:
        if v not in FAMILIES:
            raise ValueError(f"unknown model family '{v}' (eectl runs {', '.join(FAMILIES)})")
        return v

    @field_validator("eos_token_ids")
    @classmethod
    def _eos_once(cls, v: list[int]) -> list[int]:
        if twice := sorted({t for t in v if v.count(t) > 1}):
            raise ValueError(f"lists {twice} more than once")
        return v

    @field_validator("kv_policies")
    @classmethod
    def _known_policies(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("names no KV policy")
        if unknown := [p for p in v if p not in POLICY_SPECS]:
            raise ValueError(f"unknown KV policy '{unknown[0]}' (choose from {', '.join(POLICY_SPECS)})")
        if twice := sorted({p for p in v if v.count(p) > 1}):
            raise ValueError(f"lists {', '.join(twice)} more than once")
        return v

    @field_validator("candidate_source")
    @classmethod
    def _known_source(cls, v: dict[str, Any]) -> dict[str, Any]:
        name = v.get("name")
        if name not in CANDIDATE_SOURCE_NAMES:
            raise ValueError(f"unknown candidate source {name!r} (choose from {', '.join(CANDIDATE_SOURCE_NAMES)})")
        if extra := sorted(set(v) - {"name", "size", "ids"}):
            raise ValueError(f"unknown key {extra[0]!r}")
        if name in SHORTLISTS:
            ids, size = v.get("ids"), v.get("size")
            if not isinstance(ids, list) or not ids or not all(type(i) is int for i in ids):
                raise ValueError(f"a {name} needs its token ids (a list of integers)")
            if type(size) is not int or size != len(ids) or len(set(ids)) != len(ids):
                raise ValueError(f"size {size!r} is not the number of its {len(ids)} ids, each listed once")
        elif "ids" in v or "size" in v:
            raise ValueError(f"{name} takes no ids or size")
        return v

    @field_validator("files")
    @classmethod
    def _hashes(cls, v: dict[str, str]) -> dict[str, str]:
        for rel, digest in v.items():
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ValueError(f"{rel}: {digest[:80]!r} is not a SHA-256 digest (64 hexadecimal digits)")
        return v

    @property
    def num_layers(self) -> int:
        return self.dims["num_layers"]

    @property
    def exit_layers(self) -> list[int]:
        return [e.layer for e in self.exits if e.layer < self.num_layers]

    @property
    def kv_slots(self) -> int:
        """KV buffers per row: one per decoder layer, then one per block exit head."""
        return self.num_layers + sum(e.block is not None for e in self.exits)

    def exit_at(self, layer: int) -> ExitPoint:
        for e in self.exits:
            if e.layer == layer:
                return e
        raise ArtifactError(f"no exit after layer {layer} in this artifact", hint=f"exits: {self.exit_layers}")


def write_manifest(manifest: Manifest, folder: Path) -> None:
    atomic_write_text(folder / MANIFEST, json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")


def is_artifact(folder: Path) -> bool:
    """Whether `folder` is an eectl artifact, of any schema version: a real folder whose manifest.json is a JSON
    object with eectl's `schema_version` and `eectl_version`. `export --force` replaces nothing else (a folder whose
    manifest.json is a link to an artifact's elsewhere is no artifact: read_manifest refuses it too)."""
    path = folder / MANIFEST
    if folder.is_symlink() or not folder.is_dir() or file_kind(path) != "a regular file":
        return False
    try:
        raw = parse_json(path.read_text(encoding="utf-8"), str(path), ArtifactError)
    except (OSError, ValueError, ArtifactError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("schema_version"), int) and "eectl_version" in raw


def foreign_files(folder: Path) -> list[str]:
    """Files in an artifact folder that its manifest does not name (itself, or below a folder it names: the
    tokenizer, the weights): what a user put there, which `export --force` must not delete. Read without checking
    hashes or the schema, so an artifact of any version can be replaced."""
    try:
        raw = parse_json((folder / MANIFEST).read_text(encoding="utf-8"), MANIFEST, ArtifactError)
    except (OSError, ValueError, ArtifactError):
        return []
    named: set[str] = set()
    todo: list[object] = [raw]
    while todo:  # every string in the manifest (iterative: a deep document cannot overflow the stack)
        x = todo.pop()
        if isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, list):
            todo += x
        elif isinstance(x, str) and x:
            named.add(x.strip("/"))
    out = []
    for p in sorted(folder.rglob("*")):
        if p.is_dir() and not p.is_symlink():
            continue
        rel = p.relative_to(folder).as_posix()
        parts = rel.split("/")
        if rel == MANIFEST or any("/".join(parts[:i]) in named for i in range(1, len(parts) + 1)):
            continue
        out.append(rel)
    return out


def graph_ios(m: Manifest) -> list[GraphIO]:
    """Every graph the manifest names, wherever it sits (embedding, segments and their river copies, exits, their
    candidate, river and block graphs): found by walking the whole document rather than listed field by field, so a
    graph field added later is confined and must be hashed like the others without anyone remembering to add it
    here (block graphs were once opened with no hash check that way)."""
    found: list[GraphIO] = []
    todo: list[Any] = [m]
    while todo:
        x = todo.pop()
        if isinstance(x, GraphIO):
            found.append(x)
        elif isinstance(x, BaseModel):
            todo += [getattr(x, name) for name in type(x).model_fields]
        elif isinstance(x, list | tuple):
            todo += list(x)
        elif isinstance(x, dict):
            todo += list(x.values())
    return found


Axis = tuple[int, str, int]  # (axis of a graph input or output, the manifest field it must equal, its value)


def graph_axes(m: Manifest) -> dict[str, list[Axis]]:
    """Graph io key -> the axes whose fixed size the manifest states: the KV tensors' heads (axis 1) and head size
    (axis 3), the hidden states' width and the logits' vocabulary (last axis). The runner sizes its KV buffers and
    outputs from these fields, so a graph that declares another size is refused at load (runtime/ort.py)."""
    d = m.dims  # the model's dimensions as export read them (a dict: a field may be absent)

    def given(*axes: tuple[int, str, int | None]) -> list[Axis]:
        return [(axis, name, value) for axis, name, value in axes if value is not None]

    kv = given(
        (1, "kv.num_kv_heads", m.kv.num_kv_heads),
        (3, "kv.head_dim", m.kv.head_dim),
        (1, "dims.num_kv_heads", d.get("num_kv_heads")),
        (3, "dims.head_dim", d.get("head_dim")),
    )
    hidden = given((-1, "dims.hidden_size", d.get("hidden_size")))
    return {
        **dict.fromkeys(("past_key", "past_value", "present_key", "present_value"), kv),
        **dict.fromkeys(("hidden", "hidden_out", "layer_input"), hidden),
        "logits": given((-1, "dims.vocab_size", d.get("vocab_size"))),
    }


def referenced_files(m: Manifest) -> set[str]:
    """Every file the runtime opens by name from the manifest: each graph, its external data, each shared weight.
    All of them must be listed (and so hashed) in `files`; the tokenizer's folder is checked apart."""
    named = {w.file for w in m.shared_weights.values()}
    return named | {f for g in graph_ios(m) for f in (g.file, g.data) if f is not None}


def artifact_paths(m: Manifest) -> list[str]:
    """Every path the manifest names, relative to the artifact folder."""
    return [m.tokenizer_dir, *m.files, *sorted(referenced_files(m))]


def read_manifest(folder: str | Path, verify_hashes: bool = True) -> Manifest:
    """Read and check an artifact's manifest: schema version, every named path inside the folder (symlinks
    resolved), every listed file present and unchanged. Nothing named by the manifest is opened before that. A file
    or folder that cannot be read (permissions, I/O) is an ArtifactError naming it, not an OSError traceback."""
    try:
        return _read_manifest(folder, verify_hashes)
    except OSError as exc:
        what = exc.filename if exc.filename is not None else folder
        raise ArtifactError(f"cannot read {what}: {exc.strerror or exc}") from None


def _read_manifest(folder: str | Path, verify_hashes: bool) -> Manifest:
    root = Path(folder)
    path = root / MANIFEST
    if root.exists() and not root.is_dir():  # was "artifact not found" (e.g. the manifest.json itself given)
        raise ArtifactError(
            f"artifact {folder} is a file, not a folder", hint="give the folder that holds manifest.json"
        )
    if not root.is_dir():
        raise ArtifactError(f"artifact not found: {folder}", hint="create one with `eectl export`")
    # the manifest is a path inside the artifact like any other: a link out of it is refused before it is read
    confined(root, MANIFEST, ArtifactError)
    kind = file_kind(path)
    if kind == "missing":
        raise ArtifactError(f"not an eectl artifact (no {MANIFEST}): {folder}")
    if kind != "a regular file":
        raise ArtifactError(f"the {MANIFEST} of the artifact {folder} is {kind}, not a regular file")
    # NaN / Infinity refused (a NaN threshold never passes), and deep nesting, huge integers, lone surrogates
    raw = parse_json(read_utf8(path, ArtifactError), f"{path} is not valid JSON", ArtifactError)
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version not in READABLE_VERSIONS:
        older = isinstance(version, int) and version < min(READABLE_VERSIONS)
        raise ArtifactError(
            f"{'an older' if older else 'an unknown'} manifest schema version {version!r} in {folder} "
            f"(this eectl reads {', '.join(map(str, READABLE_VERSIONS))})",
            hint="re-export the artifact with this version of eectl",
        )
    try:  # strict, on the JSON text: a string is not a number ("512"), a float not an integer, a bool neither
        manifest = Manifest.model_validate_json(json.dumps(raw), strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ArtifactError(f"inconsistent manifest in {folder}: {where}: {first['msg']}") from None
    for rel in artifact_paths(manifest):
        confined(root, rel, ArtifactError)
    _check_consistency(manifest, folder)
    tokenizer = file_kind(root / manifest.tokenizer_dir)
    if tokenizer == "missing":  # else transformers reads the path as a hub repo id
        raise ArtifactError(
            f"the artifact's {manifest.tokenizer_dir}/ folder is missing in {folder}", hint="re-export the artifact"
        )
    if tokenizer != "a folder":
        raise ArtifactError(f"the artifact's {manifest.tokenizer_dir}/ in {folder} is {tokenizer}, not a folder")
    if verify_hashes:
        for rel, digest in manifest.files.items():
            f = regular_file(root, rel, folder)
            if sha256_file(f) != digest:
                raise ArtifactError(f"artifact file changed since export: {rel} (hash mismatch)")
        check_unlisted(root, set(manifest.files) | {MANIFEST}, manifest.tokenizer_dir)
        for key, w in manifest.shared_weights.items():
            check_weight(root, key, w, finite=True)
    return manifest


def _check_consistency(m: Manifest, folder: str | Path) -> None:
    def bad(what: str) -> ArtifactError:
        return ArtifactError(f"inconsistent manifest in {folder}: {what}")

    for key in ("num_layers", "hidden_size", "vocab_size"):  # what the runtime sizes everything from
        if m.dims.get(key, 0) < 1:
            raise bad(f"dims.{key} must be a positive integer, got {m.dims.get(key)!r}")
    if negative := sorted(k for k, v in m.dims.items() if v < 0):
        raise bad(f"dims.{negative[0]} is negative ({m.dims[negative[0]]})")
    L = m.num_layers
    if m.family not in FAMILIES or m.model.get("model_type", m.family) not in FAMILIES[m.family]:
        raise bad(f"family '{m.family}' does not read the model's model_type {m.model.get('model_type')!r}")
    if not m.segments:
        raise bad(f"segments do not tile layers 0..{L}")
    for i, s in enumerate(m.segments):
        if s.index != i:
            raise bad(f"segments.{i}.index is {s.index}, not its place in the list ({i})")
        if not s.layers[0] < s.layers[1]:
            raise bad(f"segments.{i}.layers {list(s.layers)} holds no layer")
    bounds = [s.layers for s in m.segments]
    if bounds[0][0] != 0 or bounds[-1][1] != L or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:], strict=False)):
        raise bad(f"segments do not tile layers 0..{L}")
    layers = [e.layer for e in m.exits]
    if twice := sorted({e for e in layers if layers.count(e) > 1}):  # the runner keys its graphs by exit layer
        raise bad(f"exits list layer {twice[0]} more than once")
    if layers != sorted(layers):
        raise bad(f"exits {layers} are not in layer order")
    cuts = {s.layers[1] for s in m.segments}
    if not m.exits or m.exits[-1].layer != L or any(e.layer not in cuts for e in m.exits):
        raise bad(f"exits must sit at segment ends, the last at {L}")
    blocks = [(e.layer, e.block) for e in m.exits if e.block is not None]
    for j, (layer, block) in enumerate(blocks):
        if block.kv_slot != L + j:  # the runner's buffers: L decoder layers', then one per block head in order
            raise bad(f"the block head at exit {layer} has kv_slot {block.kv_slot}, not {L + j}")
        if not 0 <= block.init_layer < L:
            raise bad(f"the block head at exit {layer} runs as layer {block.init_layer}, outside 0..{L - 1}")
    if any(len(names) != L for names in (m.kv.past_key, m.kv.past_value, m.kv.present_key, m.kv.present_value)):
        raise bad(f"KV names for {len(m.kv.past_key)} of {L} layers")
    unlisted = sorted(referenced_files(m) - set(m.files))
    if unlisted:  # a graph or weight outside `files` would be opened and run with no hash check
        raise ArtifactError(
            f"inconsistent manifest in {folder}: files not hashed: {unlisted}",
            hint="every graph and weight the manifest names must be in its `files`; re-export the artifact",
        )
    vocab = m.dims["vocab_size"]
    if bad_ids := [t for t in m.eos_token_ids if not 0 <= t < vocab]:  # generation would never stop at such an id
        raise bad(f"end-of-sequence id {bad_ids[0]} outside 0..{vocab - 1}")
    if m.top_k > vocab:  # was refused as "--top-k must be in 2..V" (exit 2) with no option given
        raise bad(f"top_k {m.top_k} is outside 2..{vocab} (the vocabulary)")
    ids = m.candidate_source.get("ids") or []
    if outside := [t for t in ids if not 0 <= t < vocab]:
        raise bad(f"candidate_source.ids holds {outside[0]}, outside 0..{vocab - 1}")
    for key, w in m.shared_weights.items():
        if w.dtype != m.dtype:  # the graphs take the tables in the artifact's precision
            raise bad(f"shared_weights.{key}.dtype is {w.dtype}, but the artifact's dtype is {m.dtype}")
    if m.costs is not None and (where := _not_a_cost(m.costs.model_dump(), "costs")):
        raise bad(where)
    if m.calibration is not None and not set(m.calibration.exit_layers) <= set(m.exit_layers):
        raise bad("calibrated exits are not among the artifact's")
    blocks_at = [e.layer for e in m.exits if e.block is not None]
    if m.plan is not None and (problem := m.plan.ahead_problem(m.exit_layers, blocks_at)):
        raise bad(problem)


def _not_a_cost(doc: Any, where: str) -> str | None:
    """The first number in a costs document that no timing gives (negative or not finite), as 'costs.x.y is -3.0:
    ...'; None when every one is a time, a count or a share (all >= 0)."""
    todo: list[tuple[str, Any]] = [(where, doc)]
    while todo:
        path, x = todo.pop()
        if isinstance(x, dict):
            todo += [(f"{path}.{k}", v) for k, v in x.items()]
        elif isinstance(x, list | tuple):
            todo += [(f"{path}.{i}", v) for i, v in enumerate(x)]
        elif isinstance(x, int | float) and not isinstance(x, bool) and (x < 0 or not math.isfinite(x)):
            return f"{path} is {x}: a time, count or share is a finite number >= 0"
    return None
