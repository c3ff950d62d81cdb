"""`eectl export`: a segmented ONNX artifact with exit points, validated against PyTorch.

The stage: check the options, build every graph (export/graphs.py) and write it with the shared weights, the
tokenizer and the manifest into a locked staging folder, validate the graphs against PyTorch (export/validation.py),
time them and plan exits (plan/costs.py, plan/choose.py), then rename the folder into place.

What this module does not do: choose exits at run time (runtime/), or calibrate (calibrate/calibrator.py).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from eectl import __version__
from eectl.contracts.calibration import Calibration
from eectl.contracts.heads import HeadsMeta
from eectl.contracts.layers import check_exit_layers, default_exits
from eectl.contracts.manifest import (
    LM_HEAD_ROWS,
    MANIFEST,
    MAX_POSITIONS,
    SCHEMA_VERSION,
    ExitPoint,
    GraphIO,
    KVLayout,
    Manifest,
    Quantization,
    Segment,
    SharedWeight,
    foreign_files,
    is_artifact,
    write_manifest,
)
from eectl.errors import ArtifactError, ModelLoadError, UsageError
from eectl.exits.base import DEFAULT_TOP_K, CandidateSource
from eectl.exits.candidates import CANDIDATE_SOURCES, FirstExitTopK, Shortlist, make_source
from eectl.export.block import export_block, is_block
from eectl.export.candidate_graphs import build_candidates
from eectl.export.certified_head import build_certified_head, certifiable
from eectl.export.exit_graphs import build_exit
from eectl.export.graphs import DTYPES, OPSET, PAD_ROWS, build_embedding, build_segment, save_graph
from eectl.export.quantize import Int4Options, gguf_graph, quantize_graph, quantize_lm_head, read_gguf_blocks
from eectl.export.validation import validate_artifact
from eectl.files import STAGING_MARKER, locked_staging, output_error, sha256_file
from eectl.models.adapters import Adapter
from eectl.models.gguf_blocks import GgufProjections
from eectl.models.loading import LoadedModel
from eectl.output_checks import nearest_existing
from eectl.runtime.policies import POLICIES

# what an export writes, counted up whenever the graphs it writes change for the same heads and calibration (the
# pipeline's cache then exports again instead of reusing an older artifact): 2 added the certified final head, 3
# bounded its tokens below the best 512 by the table's column maxima
EXPORT_REVISION = 3


@dataclass
class ExportOptions:
    exits: list[int]
    dtype: str = "fp32"
    top_k: int = DEFAULT_TOP_K
    max_positions: int | None = None  # rotary table length; default: the model's maximum
    force: bool = False
    validate: bool = True
    candidates: str | None = None  # candidate source; None: the calibration's (full without one)
    profile_costs: bool = True  # time every graph and write the costs and the plan into the manifest
    cost_past: int = 128  # KV positions in the cache while timing (a prompt plus some generated tokens)
    cost_seconds: float | None = None  # re-timing budget while the plan is undecided (None: costs.RETIME_BUDGET_S)
    weights: str = "fp32"  # fp32 or int4 (weight-only MatMulNBits segment graphs, export/quantize.py)
    int4: Int4Options = field(default_factory=Int4Options)  # settings for --weights int4 and --river
    river: bool = False  # add int4 copies of the segments after the first exit (the `river` policy)
    certified_head: bool = True  # add the certified final head where the model allows it (export/certified_head.py)
    # one-row calls run with one zero position after theirs so a wide pass computes each position bit for bit as a
    # one-position step does, on AVX2 and AVX-512 CPUs (export/graphs.py _RowPad): lossless drafts on int4 at
    # accuracy levels 2-4. None: where drafts rest on it (`pads`)
    exact_wide: bool | None = None

    def pads(self) -> bool:
        """Whether one-row calls are padded (export/graphs.py _RowPad): as `exact_wide` says, else (None) where the
        artifact's drafts and deferred positions are exact only so: int4 segments computing at accuracy levels 2-4
        (runtime/wide_check.py `relies_on_exact_wide`)."""
        return exact_wide_for(self.exact_wide, self.weights, self.int4.accuracy_level)


def exact_wide_for(exact_wide: bool | None, weights: str, accuracy_level: int) -> bool:
    """`--exact-wide` as asked (True, False), else (None: auto) on for int4 segments at accuracy levels 2-4."""
    if exact_wide is not None:
        return exact_wide
    return weights == "int4" and accuracy_level not in (0, 1)


def choose_exits(
    num_layers: int,
    requested: list[int] | None = None,
    calibration: Calibration | None = None,
    heads: dict[int, torch.nn.Module] | None = None,
    recipe: list[int] | None = None,
) -> list[int]:
    """Where the artifact's exits go: the ones asked for (--exits), else the calibrated ones, else the trained
    heads', else the recipe's, else `default_exits`."""
    if requested is not None:
        return requested
    if calibration is not None:
        return calibration.exit_layers
    if heads:
        return sorted(heads)
    return recipe if recipe is not None else default_exits(num_layers)


def check_options(options: ExportOptions, out: Path | None = None, vocab_size: int | None = None) -> None:
    """Every check that needs no model (run before the seconds-long load), and the vocabulary one when given."""
    if options.dtype not in DTYPES:
        raise UsageError(f"--dtype must be fp32 or fp16, got '{options.dtype}'")
    if options.weights not in ("fp32", "int4"):
        raise UsageError(f"--weights must be fp32 or int4, got '{options.weights}'")
    if (options.weights == "int4" or options.river) and options.dtype != "fp32":
        raise UsageError("int4 weights (--weights int4, --river) run with fp32 activations: use --dtype fp32")
    if options.weights == "int4" and options.river:
        raise UsageError("--river adds int4 copies to an fp32 artifact; with --weights int4 every segment is int4")
    top = vocab_size if vocab_size is not None else options.top_k
    if not 2 <= options.top_k <= top:
        raise UsageError(f"--top-k must be in 2..{vocab_size or 'the vocabulary size'}, got {options.top_k}")
    check_exit_layers(options.exits, None)
    options.int4.check(None)  # --int4-* and --lm-head (the kept layers' numbers again once the model is known)
    if options.candidates is not None and options.candidates not in CANDIDATE_SOURCES:
        raise UsageError(f"--candidates must be one of {', '.join(CANDIDATE_SOURCES)}, got '{options.candidates}'")
    if out is not None:
        check_destination(out, options.force)


def check_destination(out: Path, force: bool) -> None:
    """An existing destination needs --force, and --force replaces only an eectl artifact (never a user's folder or
    file). Checked before the work, and again under the destination lock at the rename."""
    if out.exists() or out.is_symlink():
        if not force:
            raise ArtifactError(f"{out} already exists", hint="pass --force to replace it")
        if out.is_symlink() or not is_artifact(out):
            raise ArtifactError(
                f"{out} exists and is not an eectl artifact: --force replaces only artifacts",
                hint="remove it yourself, or choose another --out",
            )
        foreign = foreign_files(out)
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            raise ArtifactError(
                f"{out} holds files that are not the artifact's ({', '.join(foreign[:3])}{more}): --force replaces "
                "only an artifact's own files",
                hint="move them out of the folder first",
            )
    parent = nearest_existing(out)
    if not parent.is_dir():
        raise ArtifactError(f"cannot create {out}: {parent} is not a folder")
    # inside another artifact (its tokenizer/ is hashed whole, and any stray file changes it): that one would break
    outer = next((p for p in out.resolve().parents if is_artifact(p)), None)
    if outer is not None:
        raise UsageError(f"--out {out} is inside the eectl artifact {outer}; write it elsewhere")


def export_artifact(
    loaded: LoadedModel,
    out_dir: str | Path,
    options: ExportOptions,
    heads: dict[int, torch.nn.Module] | None = None,
    heads_meta: HeadsMeta | None = None,
    calibration: Calibration | None = None,
    log: Any = None,
) -> Manifest:
    """Build, write and validate an artifact in a staging folder, then rename it into place.

    The destination is locked for the whole export (a second export to it fails at once), stale staging folders of
    killed exports beside it are removed first, and "exists" is checked again at the rename.
    """
    adapter = loaded.adapter
    L = adapter.num_layers
    out = Path(out_dir)
    check_options(options, out, adapter.dims.vocab_size)
    max_pos = options.max_positions or adapter.dims.max_positions
    if not 2 <= max_pos <= MAX_POSITIONS:  # before torch builds rotary tables of that many positions
        raise ModelLoadError(
            f"the model's context of {max_pos} positions (max_position_embeddings) is outside 2..{MAX_POSITIONS}",
            hint="fix the model's config.json",
        )
    exits = check_exit_layers(options.exits, L)
    if options.river and not exits:
        raise UsageError("--river needs at least one exit (the river starts after the first one)")
    options.int4.check(L)
    gguf, weights_check = None, None
    if options.weights == "int4":  # where the int4 weights come from, decided for this model (auto: gguf or ort)
        options = replace(options, int4=options.int4.resolved(loaded.source))
        if options.int4.source == "gguf":
            gguf, weights_check = read_gguf_blocks(loaded, log)
    if calibration is not None:
        if calibration.model.sha256 != loaded.source.sha256:
            raise UsageError("the calibration was made for another model (its model hash differs)")
        missing = set(calibration.exit_layers) - set(exits)
        if missing:
            raise UsageError(f"calibrated exits {sorted(missing)} are not among the export's exits {exits}")
    heads = heads or {}
    if set(heads) - set(exits):
        raise UsageError(f"heads for layers {sorted(set(heads) - set(exits))} that are not exits {exits}")
    started = time.perf_counter()
    with locked_staging(out) as staging:
        check_destination(out, options.force)  # again, now that no other eectl export can write it
        tmp = staging.folder
        try:
            manifest = _write_artifact(loaded, tmp, exits, options, heads, heads_meta, calibration, log, gguf)
            if options.validate:
                if log is not None:
                    log.log("validating the graphs against PyTorch (prefill + 16 greedy decode steps, every exit)")
                manifest.validation = validate_artifact(loaded, tmp, heads, log=log)
                if options.river:
                    manifest.validation["river"] = validate_artifact(loaded, tmp, heads, log=log, river=True)
            if weights_check is not None:  # the graphs' int4 weights against the file's dequantized ones
                manifest.validation["int4_weights"] = weights_check
            write_manifest(manifest, tmp)
            if options.profile_costs:
                if log is not None:
                    log.log("timing every graph at decode shape, then choosing exits by predicted speed")
                profile_and_plan(manifest, tmp, options.cost_past, options.cost_seconds)
                if log is not None and manifest.plan is not None:
                    log.log(manifest.plan.summary())
            manifest.validation["export_seconds"] = round(time.perf_counter() - started, 2)
            # the process's peak so far (model loading included): big models' export must fit in memory
            manifest.validation["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            write_manifest(manifest, tmp)
        except OSError as exc:
            raise output_error(out, exc) from None
        check_destination(out, options.force)  # and at the rename: something may have appeared meanwhile
        staging.publish(replace=lambda dest: options.force and not dest.is_symlink() and is_artifact(dest))
    return manifest


def candidate_source(
    adapter: Adapter, requested: str | None, calibration: Calibration | None
) -> tuple[CandidateSource, dict[str, Any]]:
    """The candidate source to build: the calibration's (so the thresholds mean what they were fitted for), or
    an explicit one; a shortlist needs the calibration's token ids."""
    cal = calibration.candidates if calibration is not None else None
    name = requested or (cal.name if cal is not None else None) or FirstExitTopK.name
    if requested is not None and cal is not None and cal.name != requested:
        raise UsageError(
            f"--candidates {requested} differs from the calibration's source '{cal.name}'",
            hint="recalibrate with --candidates, or export without it",
        )
    ids = cal.ids if cal is not None else None
    source = make_source(name, adapter.lm_head.weight, None if ids is None else torch.tensor(ids))
    info: dict[str, Any] = {"name": name}
    if isinstance(source, Shortlist):
        info.update(size=int(source.ids.numel()), ids=[int(i) for i in source.ids])
    return source, info


def profile_and_plan(manifest: Manifest, folder: Path, past: int = 128, budget_s: float | None = None) -> None:
    """Measure the artifact's graph costs on its provider (plan/costs.py) and choose exits by them (plan/choose.py):
    with a calibrated menu, timing batches until the plan is decided or `budget_s` (costs.RETIME_BUDGET_S) is spent."""
    from eectl.contracts.plan import MIN_BATCHES
    from eectl.plan.choose import plan_manifest, settled
    from eectl.plan.costs import RETIME_BUDGET_S, measure_costs
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(folder, provider="auto", verify=False)
    signal = manifest.calibration.signal if manifest.calibration is not None else "topk-prob"
    calibrated_menu = manifest.calibration is not None and bool(manifest.calibration.options)
    manifest.costs = measure_costs(
        rt,
        past=past,
        signal=signal,
        decided=(lambda costs: settled(costs, plan_manifest(manifest, costs))) if calibrated_menu else None,
        budget_s=RETIME_BUDGET_S if budget_s is None else budget_s,
        min_batches=MIN_BATCHES if calibrated_menu else 1,
    )
    manifest.plan = plan_manifest(manifest, manifest.costs) if calibrated_menu else None


def _write_artifact(
    loaded: LoadedModel,
    folder: Path,
    exits: list[int],
    options: ExportOptions,
    heads: dict[int, torch.nn.Module],
    heads_meta: HeadsMeta | None,
    calibration: Calibration | None,
    log: Any,
    gguf: GgufProjections | None = None,
) -> Manifest:
    adapter = loaded.adapter
    dims = adapter.dims
    L = dims.num_layers
    max_pos = options.max_positions or dims.max_positions
    quantized = options.weights == "int4"
    lm, shared, tied = _write_shared_weights(adapter, folder, options.dtype)
    embedding = _save(folder, options, *build_embedding(adapter, options.dtype, transposed=tied))
    segments = _write_segments(adapter, folder, exits, options, max_pos, log, gguf)
    source, source_info = candidate_source(adapter, options.candidates, calibration)
    exit_points = _write_exits(adapter, folder, exits, options, heads, heads_meta, source, lm, max_pos, gguf)
    loaded.tokenizer.save_pretrained(str(folder / "tokenizer"))  # type: ignore[attr-defined]
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        eectl_version=__version__,
        model={**loaded.source.to_dict(), "model_type": adapter.config.model_type},
        family=adapter.family,
        dims={k: int(v) for k, v in dims.__dict__.items()},
        dtype=options.dtype,
        opset=OPSET,
        tokenizer_dir="tokenizer",
        eos_token_ids=_eos_ids(loaded),
        max_positions=max_pos,
        top_k=options.top_k,
        embedding=embedding,
        segments=segments,
        exits=exit_points,
        shared_weights=shared,
        kv=KVLayout(
            num_kv_heads=dims.num_kv_heads,
            head_dim=dims.head_dim,
            past_key=[f"past_key_values.{i}.key" for i in range(L)],
            past_value=[f"past_key_values.{i}.value" for i in range(L)],
            present_key=[f"present.{i}.key" for i in range(L)],
            present_value=[f"present.{i}.value" for i in range(L)],
            pad=int(options.pads()),
            pad_switch=PAD_ROWS if options.pads() else None,
        ),
        kv_policies=[n for n, policy in POLICIES.items() if options.river or not policy.needs_river_copies],
        calibration=calibration,
        candidate_source=source_info,
        quantization=None
        if not (quantized or options.river)
        else Quantization(**options.int4.record("segments" if quantized else "river", gguf)),
        heads=heads_meta,
    )
    manifest.files = {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in (MANIFEST, STAGING_MARKER)
    }
    write_manifest(manifest, folder)
    return manifest


def _save(
    folder: Path,
    options: ExportOptions,
    model: onnx.ModelProto,
    io: GraphIO,
    int4: bool = False,
    gguf: GgufProjections | None = None,
) -> GraphIO:
    # quantized first (MatMulNBits' packed weights: ORT's quantizer, or the GGUF's own blocks), then saved with its
    # weights as external data
    if int4:
        model = quantize_graph(model, options.int4) if gguf is None else gguf_graph(model, gguf, options.int4)
    return save_graph(model, io, folder)


def _write_shared_weights(
    adapter: Adapter, folder: Path, dtype: str
) -> tuple[np.ndarray, dict[str, SharedWeight], bool]:
    """weights/lm_head.npy (and embed.npy unless tied): (the transposed LM head, the manifest's entries, tied)."""
    np_dtype = DTYPES[dtype][1]
    (folder / "weights").mkdir()
    # The LM head is stored transposed, [H, V]: MatMul on a [1, H] token is then ORT's matrix-vector path, which
    # streams the table once per token; the [V, H] table with Gemm(transB) is repacked on every call (measured:
    # 2x slower per projection on this CPU). It is a graph input, shared by every exit graph and stored once.
    lm = np.ascontiguousarray(adapter.lm_head.weight.detach().float().numpy().astype(np_dtype).T)
    np.save(folder / "weights" / "lm_head.npy", lm)
    shared = {"lm_head": SharedWeight(file="weights/lm_head.npy", shape=list(lm.shape), dtype=dtype, transposed=True)}
    # and row-major for the graphs that gather K rows (local exits, the int8 source): a column of the [H, V] table
    # is H strided reads, one cache miss each (measured, 64 candidates of the default model's head, 2 threads:
    # 0.80 ms gathering columns of [H, V], 0.011 ms gathering rows of [V, H]). The runtime maps it from disk, so
    # only the rows gathered are read.
    rows = np.ascontiguousarray(lm.T)
    np.save(folder / "weights" / "lm_head_rows.npy", rows)
    shared[LM_HEAD_ROWS] = SharedWeight(file="weights/lm_head_rows.npy", shape=list(rows.shape), dtype=dtype)
    tied = adapter.embed_tokens.weight.data_ptr() == adapter.lm_head.weight.data_ptr()
    if tied:
        shared["embed"] = shared["lm_head"]
    else:
        emb = adapter.embed_tokens.weight.detach().float().numpy().astype(np_dtype)
        np.save(folder / "weights" / "embed.npy", emb)
        shared["embed"] = SharedWeight(file="weights/embed.npy", shape=list(emb.shape), dtype=dtype)
    return lm, shared, tied


def _write_segments(
    adapter: Adapter,
    folder: Path,
    exits: list[int],
    options: ExportOptions,
    max_pos: int,
    log: Any,
    gguf: GgufProjections | None = None,
) -> list[Segment]:
    """One segment graph (plus its K/V-only twin, and with --river an int4 copy after the first exit) per cut."""
    quantized = options.weights == "int4"
    cuts = [0, *exits, adapter.num_layers]
    segments = []
    for idx, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        if log is not None:
            log.log(f"segment {idx}: layers {lo}..{hi - 1}")
        seg_model, seg_io = build_segment(adapter, lo, hi, options.dtype, max_pos, exact_wide=options.pads())
        river = None
        if options.river and idx > 0:  # same input/output names: the runner binds the same KV buffers
            # quantized before the fp32 graph is saved: saving moves a model's weights out of it (external data)
            river_io = seg_io.model_copy(update={"file": f"river_{lo:03d}_{hi:03d}.onnx"})
            river = _save(folder, options, seg_model, river_io, int4=True)
        graph = _save(folder, options, seg_model, seg_io, quantized, gguf)
        kv_model, kv_io = build_segment(adapter, lo, hi, options.dtype, max_pos, kv_only=True)
        kv_graph = _save(folder, options, kv_model, kv_io, int4=quantized, gguf=gguf)
        segments.append(Segment(index=idx, layers=(lo, hi), graph=graph, kv_graph=kv_graph, river=river))
    return segments


def _write_exits(
    adapter: Adapter,
    folder: Path,
    exits: list[int],
    options: ExportOptions,
    heads: dict[int, torch.nn.Module],
    heads_meta: HeadsMeta | None,
    source: CandidateSource,
    lm: np.ndarray,
    max_pos: int,
    gguf: GgufProjections | None = None,
) -> list[ExitPoint]:
    """The full, local and candidate graphs of every exit and of the final layer (and the final head's quantized
    table for int4 artifacts or the river's end, from `gguf`'s blocks where held); a block head's own graphs."""
    L = adapter.num_layers
    quantized = options.weights == "int4"
    exit_points = []
    block_slots = L  # block exit heads' KV buffers follow the decoder layers'
    for layer in [*exits, L]:
        head = heads.get(layer)
        design = None if head is None else (heads_meta.design if heads_meta else type(head).__name__)
        block = None
        if is_block(head):  # its own graphs and KV; the exit graphs below score its output
            save = partial(_save, folder, options)
            block = export_block(adapter, head, layer, options.dtype, max_pos, block_slots, save)
            block_slots += 1
            head = None
        cand_graph = None
        if layer < L and source.name != FirstExitTopK.name:
            cand_graph = _save(folder, options, *build_candidates(adapter, layer, options.dtype, source, head))
        full_model, full_io = build_exit(adapter, layer, options.dtype, local=False, head=head)
        river_head = None
        if layer == L and options.int4.lm_head != "fp32" and (quantized or options.river):
            # the final head's own quantized table: for every token (int4 artifact) or the river's end only
            weight_input = full_io.inputs["weight"]
            assert isinstance(weight_input, str)
            pad = quantized and options.pads()  # a wide check's rows as the one-row step's (quantize_lm_head)
            q_model = quantize_lm_head(full_model, weight_input, lm, options.int4, pad, gguf if quantized else None)
            inputs = {k: v for k, v in full_io.inputs.items() if k != "weight"}
            q_io = full_io.model_copy(update={"inputs": inputs}, deep=True)
            if quantized:
                full_model, full_io = q_model, q_io
            else:
                q_io.file = f"exit_{layer:03d}_river.onnx"
                river_head = _save(folder, options, q_model, q_io)
        certified = None
        head_table = options.int4.lm_head if quantized else "fp32"  # what the full head multiplies by
        if layer == L and options.certified_head and certifiable(adapter, options.dtype, head_table) is None:
            certified = _save(folder, options, *build_certified_head(adapter))
        exit_points.append(
            ExitPoint(
                layer=layer,
                full=_save(folder, options, full_model, full_io),
                certified=certified,
                local=_save(folder, options, *build_exit(adapter, layer, options.dtype, local=True, head=head)),
                candidates=cand_graph,
                river=river_head,
                head=design,
                block=block,
            )
        )
    return exit_points


def _eos_ids(loaded: LoadedModel) -> list[int]:
    """The generation config's end-of-sequence ids, else the tokenizer's, each once; ids beyond the model's
    vocabulary (which no step can produce, and a manifest refuses) left out. None left: refused (a manifest without
    one is: generation could only stop at its token budget)."""
    eos = loaded.model.generation_config.eos_token_id if loaded.model.generation_config is not None else None
    eos = eos if eos is not None else getattr(loaded.tokenizer, "eos_token_id", None)
    ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    kept = list(dict.fromkeys(e for e in ids if 0 <= e < loaded.adapter.dims.vocab_size))
    if not kept:
        raise ModelLoadError(
            f"the model {loaded.source.to_dict().get('name')} names no end-of-sequence token in its vocabulary "
            f"(ids {ids}): generation could never stop",
            hint="set eos_token_id in its generation_config.json or its tokenizer",
        )
    return kept
