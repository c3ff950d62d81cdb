"""The artifact manifest: the single contract between `eectl export` and `eectl run`.

It names every file (with its SHA-256), every graph input and output, the KV layout, the exits and their
thresholds, and the export's validation result. The runner reads names from here and never rebuilds them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eectl.contracts.calibration import Calibration
from eectl.contracts.certificate import Certificate
from eectl.contracts.heads import HeadsMeta
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
    index: int
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

    scope: str  # "segments": every segment graph (export --weights int4); "river": only the river copies
    op: str  # com.microsoft::MatMulNBits
    tool: str  # ORT's quantizer and version
    bits: int
    block_size: int
    symmetric: bool
    accuracy_level: int  # MatMulNBits compute type (0 unset / fp32, 4 int8 activations)
    algorithm: str  # rtn (ORT's default block quantizer) or hqq
    lm_head: str  # the final exit's LM head: fp32 (the shared table), int8 or int4
    embedding: str  # precision of the embedding table
    exit_lm_heads: str  # precision of the intermediate exits' LM head (the shared table)
    keep_layers: list[int]  # decoder layers left in fp32
    min_agreement: float  # the validation floor on greedy agreement with PyTorch at the final exit


# The shared table key of the LM head stored row-major, [V, H] (beside `lm_head`, stored [H, V] for the full
# projection): a graph gathering K rows reads K contiguous rows of it instead of K strided columns of `lm_head`.
# Artifacts exported before it have no such table; their local exits gather columns of `lm_head` and run as they did.
LM_HEAD_ROWS = "lm_head_rows"


class SharedWeight(_M):
    file: str
    shape: list[int]
    dtype: str
    transposed: bool = False  # stored [hidden, vocab] (the LM head's MatMul layout) rather than [vocab, hidden]


class KVLayout(_M):
    layout: str = "BNSH"  # [batch, kv_heads, max_sequence, head_dim]
    num_kv_heads: int
    head_dim: int
    past_key: list[str]  # per decoder layer: past_key_values.{i}.key
    past_value: list[str]
    present_key: list[str]  # per decoder layer: present.{i}.key
    present_value: list[str]
    buffer: str = "one preallocated buffer per layer, bound as both past input and present output (written in place)"
    positions: str = "position of a token == its slot in the cache; seqlens_k = total length - 1, per row"
    # zero positions a one-row segment call's attention appends (export --exact-wide, export/graphs.py
    # _AttentionPad): written to the slot after the call's positions, so every buffer holds one more slot
    pad: int = Field(default=0, ge=0, le=1)


class Manifest(_M):
    schema_version: int
    eectl_version: str
    model: dict[str, Any]
    family: str
    dims: dict[str, int]
    dtype: str
    opset: int
    tokenizer_dir: str
    eos_token_ids: list[int]
    max_positions: int = Field(ge=2, le=MAX_POSITIONS)
    top_k: int = Field(ge=2)
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
    object with eectl's `schema_version` and `eectl_version`. `export --force` replaces nothing else."""
    path = folder / MANIFEST
    if folder.is_symlink() or not folder.is_dir() or not path.is_file():
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
    if not path.is_file():
        raise ArtifactError(f"not an eectl artifact (no {MANIFEST}): {folder}")
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
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise ArtifactError(f"inconsistent manifest in {folder}: {where}: {first['msg']}") from None
    for rel in artifact_paths(manifest):
        confined(root, rel, ArtifactError)
    _check_consistency(manifest, folder)
    if not (root / manifest.tokenizer_dir).is_dir():  # else transformers reads the path as a hub repo id
        raise ArtifactError(
            f"the artifact's {manifest.tokenizer_dir}/ folder is missing in {folder}", hint="re-export the artifact"
        )
    if verify_hashes:
        for rel, digest in manifest.files.items():
            f = root / rel
            if not f.is_file():
                raise ArtifactError(f"artifact file missing: {rel} in {folder}")
            if sha256_file(f) != digest:
                raise ArtifactError(f"artifact file changed since export: {rel} (hash mismatch)")
        # The tokenizer loads whatever its folder holds, so everything there must be listed (and so hashed).
        tok = root / manifest.tokenizer_dir
        extra = sorted(
            p.relative_to(root).as_posix()
            for p in (tok.rglob("*") if tok.is_dir() else [])
            if p.is_file() and p.relative_to(root).as_posix() not in manifest.files
        )
        if extra:
            raise ArtifactError(f"files in {manifest.tokenizer_dir}/ that the manifest does not list: {extra}")
    return manifest


def _check_consistency(m: Manifest, folder: str | Path) -> None:
    L = m.num_layers
    bounds = [s.layers for s in m.segments]
    if (
        not bounds
        or bounds[0][0] != 0
        or bounds[-1][1] != L
        or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ArtifactError(f"inconsistent manifest in {folder}: segments do not tile layers 0..{L}")
    cuts = {s.layers[1] for s in m.segments}
    if not m.exits or m.exits[-1].layer != L or any(e.layer not in cuts for e in m.exits):
        raise ArtifactError(f"inconsistent manifest in {folder}: exits must sit at segment ends, the last at {L}")
    if len(m.kv.past_key) != L or len(m.kv.present_key) != L:
        raise ArtifactError(f"inconsistent manifest in {folder}: KV names for {len(m.kv.past_key)} of {L} layers")
    unlisted = sorted(referenced_files(m) - set(m.files))
    if unlisted:  # a graph or weight outside `files` would be opened and run with no hash check
        raise ArtifactError(
            f"inconsistent manifest in {folder}: files not hashed: {unlisted}",
            hint="every graph and weight the manifest names must be in its `files`; re-export the artifact",
        )
    vocab = int(m.dims.get("vocab_size", 0))
    if bad := [t for t in m.eos_token_ids if not 0 <= t < vocab]:  # generation would never stop at such an id
        raise ArtifactError(f"inconsistent manifest in {folder}: end-of-sequence id {bad[0]} outside 0..{vocab - 1}")
    if m.calibration is not None and not set(m.calibration.exit_layers) <= set(m.exit_layers):
        raise ArtifactError(f"inconsistent manifest in {folder}: calibrated exits are not among the artifact's")
