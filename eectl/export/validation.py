"""Export's check of what it wrote: the artifact's graphs against PyTorch, prefill + greedy decode, every exit.

What this module does not do: build or write graphs (export/graphs.py, export/exporter.py); it raises
ExportValidationError
and the stage (export/exporter.py) leaves nothing half-written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eectl.contracts.manifest import Manifest
from eectl.errors import ArtifactError
from eectl.exits.base import CandidateSource, ExitHead, signals
from eectl.exits.candidates import FirstExitTopK, make_source
from eectl.exits.designs import BlockHead
from eectl.export.block import block_kv_diff, is_block, torch_block_states, validate_block_kv
from eectl.export.quantize import agreement_verdict
from eectl.models.adapters import Adapter, Capture
from eectl.models.loading import LoadedModel
from eectl.models.parts import KVCache
from eectl.runtime.blocks import run_block
from eectl.runtime.wide_check import check_wide

# Validation tolerance on logits (max abs difference, ORT vs torch) per artifact dtype.
TOLERANCE = {"fp32": 1e-3, "fp16": 0.25}
VALIDATION_DECODE_STEPS = 16


class ExportValidationError(ArtifactError):
    """The exported graphs do not reproduce PyTorch within tolerance."""


VALIDATION_PROMPT = (
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether?\nAnswer:"
)


@torch.no_grad()
def validate_artifact(
    loaded: LoadedModel,
    folder: Path,
    heads: dict[int, torch.nn.Module] | None = None,
    log: Any = None,
    river: bool = False,
) -> dict[str, Any]:
    """Prefill + 16 greedy decode steps through the ONNX graphs and through PyTorch, compared at every exit.

    PyTorch runs first (its greedy tokens feed both sides); then the graphs run segment by segment, all steps of
    one segment before the next is loaded (each segment's output depends only on the previous segment's output and
    its own cache), so only one segment's sessions are alive beside the torch model.
    Raises ExportValidationError beyond tolerance (max abs logit difference, or a different greedy token). Int4
    graphs (and, with `river`, the int4 river copies after the first segment) are judged by their greedy
    agreement with PyTorch at the final exit against the manifest's floor instead (quantize.agreement_verdict).
    """
    from eectl.runtime.sessions import ArtifactRuntime

    adapter = loaded.adapter
    rt = ArtifactRuntime(folder, provider="cpu", verify=False, lazy_segments=True)
    m = rt.manifest
    ids = loaded.tokenizer(VALIDATION_PROMPT, add_special_tokens=False)["input_ids"][:48]  # type: ignore[operator]
    # a block head runs on the exit's states with its own KV (export_block.torch_block_states): the exit graphs
    # score its output with no head
    blocks = {layer: h for layer, h in (heads or {}).items() if is_block(h)}
    token_heads = {layer: h for layer, h in (heads or {}).items() if layer not in blocks}
    exit_heads = {e.layer: ExitHead(adapter, token_heads.get(e.layer)) for e in m.exits}
    chunks, ref_states, block_caches = _torch_reference(adapter, exit_heads, ids, m.num_layers, blocks)
    info = m.candidate_source
    source = make_source(
        str(info.get("name", FirstExitTopK.name)),
        adapter.lm_head.weight,
        torch.tensor(info["ids"]) if info.get("ids") else None,
    )
    d = _Diffs(
        logits={e.layer: 0.0 for e in m.exits},
        local={e.layer: 0.0 for e in m.exits},
        tokens={e.layer: 0 for e in m.exits},
    )
    own = {layer: (head, block_caches[layer]) for layer, head in blocks.items()}
    _compare_graphs(rt, adapter, exit_heads, source, chunks, ref_states, len(ids), river, d, own)
    result: dict[str, Any] = {
        "dtype": m.dtype,
        "tolerance": TOLERANCE[m.dtype],
        "prompt_tokens": len(ids),
        "decode_steps": VALIDATION_DECODE_STEPS,
        "positions": len(ids) + VALIDATION_DECODE_STEPS,  # compared greedy tokens per exit
        "max_abs_logit_diff": {str(k): v for k, v in d.logits.items()},
        "max_abs_local_logit_diff": {str(k): v for k, v in d.local.items()},
        "greedy_token_mismatches": {str(k): v for k, v in d.tokens.items()},
        "kv_graph_max_abs_diff": d.kv,
        "block_kv_max_abs_diff": d.block_kv,  # block exit heads' KV buffers after every step vs the torch blocks'
        "candidate_source": source.name,
        "candidate_checks": d.cand_checks,
        "candidate_set_mismatches": d.cand_mismatch,  # int8 ranking ties may flip the K-th candidate
        "candidate_batch_vs_alone_mismatches": d.cand_alone_mismatch,
        "candidate_logit_max_abs_diff": d.cand_logits,
        "probe_score_max_abs_diff": d.score,  # exit graphs with a probe (the learned signal); 0 without
        # the certified final head (export/certified_head.py) on the same final states: how many it passed, and how
        # many of those were not the full head's argmax (must be 0)
        "certified_head": dict(zip(("positions", "passed", "wrong"), d.certified, strict=True)),
        "passed": True,
    }
    if not river:  # a wide pass against one-position steps, bit for bit (runtime/wide_check.py)
        result["wide_exact"] = check_wide(rt, ids)
    return _verdict(result, m, d, river, log)


def abs_diff(got: Any, want: Any) -> float:
    """max |got - want| (arrays or tensors), inf where either side holds a NaN or an infinity: a NaN difference would
    pass every check (`max(0.0, nan)` is 0.0 and `nan > tol` is False), so NaN graphs read as "diff 0.0"."""
    g = (torch.from_numpy(got) if isinstance(got, np.ndarray) else got).float()
    w = (torch.from_numpy(want) if isinstance(want, np.ndarray) else want).float()
    if not (bool(torch.isfinite(g).all()) and bool(torch.isfinite(w).all())):
        return math.inf
    return float((g - w).abs().max()) if g.numel() else 0.0


@dataclass
class _Diffs:
    """What validation measured so far: max abs differences and mismatch counts, per exit layer where keyed."""

    logits: dict[int, float]  # full exit graph's logits vs torch
    local: dict[int, float]  # local (candidate rows) exit graph's logits vs torch
    tokens: dict[int, int]  # greedy token mismatches
    kv: float = 0.0  # K/V-only graphs vs the adapter's K/V projection
    block_kv: float = 0.0  # block exit heads' own KV after every step vs the torch blocks' caches
    cand_checks: int = 0
    cand_mismatch: int = 0  # candidate sets that differ from the torch source's
    cand_alone_mismatch: int = 0  # a row's candidate set alone vs in its batch (int8 sources: 0 by construction)
    cand_logits: float = 0.0
    score: float = 0.0  # the learned signal's score in the local exit graphs vs Probe.score in torch
    certified: tuple[int, int, int] = (0, 0, 0)  # the certified head: positions, passed, passed with another token


def _torch_reference(
    adapter: Adapter, exit_heads: dict[int, ExitHead], ids: list[int], L: int, blocks: dict[int, BlockHead]
) -> tuple[list[list[int]], list[dict[int, torch.Tensor]], dict[int, KVCache]]:
    """The token chunks both sides run (the prompt, then torch's greedy tokens) and, per chunk, the hidden state at
    every exit layer ([S, H]: a block exit head's output where the exit has one), and the blocks' own KV caches."""
    block_caches: dict[int, KVCache] = {}
    chunks: list[list[int]] = [list(ids)]
    ref_states: list[dict[int, torch.Tensor]] = []
    cache = KVCache()
    pos = 0
    for _ in range(VALIDATION_DECODE_STEPS + 1):
        chunk = chunks[-1]
        positions = torch.arange(pos, pos + len(chunk))[None]
        keep = Capture(set(exit_heads))  # the hidden state after every exit's layer
        adapter.forward_layers(adapter.embed(torch.tensor([chunk])), positions, 0, L, cache, capture=keep)
        states = torch_block_states(blocks, {layer: h[0] for layer, h in keep.states.items()}, positions, block_caches)
        ref_states.append(states)
        pos += len(chunk)
        chunks.append([int(exit_heads[L].full(states[L][-1:]).argmax(-1))])
    chunks.pop()
    return chunks, ref_states, block_caches


def _compare_graphs(
    rt: Any,
    adapter: Adapter,
    exit_heads: dict[int, ExitHead],
    source: CandidateSource,
    chunks: list[list[int]],
    ref_states: list[dict[int, torch.Tensor]],
    prompt_len: int,
    river: bool,
    d: _Diffs,
    blocks: dict[int, tuple[BlockHead, KVCache]],
) -> None:
    """Run the graphs segment by segment over every chunk and accumulate their differences from torch into `d`."""
    m = rt.manifest
    kv = rt.new_kv(1, prompt_len + VALIDATION_DECODE_STEPS + 1)
    hidden = [rt.embed(np.array([c], dtype=np.int64)) for c in chunks]
    kv_ids = torch.tensor([chunks[0][:8]])
    for s_idx, seg in enumerate(m.segments):
        rt.load_segment(s_idx)
        layer = seg.layers[1]  # every segment ends at an exit
        e = m.exit_at(layer)
        for t in range(len(chunks)):
            hidden[t], _ = rt.run_segment(s_idx, hidden[t], kv, row=0, river=river and s_idx > 0)
            exit_in = hidden[t] if e.block is None else run_block(rt, layer, hidden[t], kv, 0)
            assert exit_in is not None
            ref_h = ref_states[t][layer]
            ref = exit_heads[layer].full(ref_h).float()
            got, cand, _ = rt.exit_full(layer, exit_in[0], m.top_k, river=river)
            if layer == m.num_layers and rt.certified_head is not None and not river:
                d.certified = _certified(rt, exit_in[0], got.argmax(-1), d.certified)
            d.logits[layer] = max(d.logits[layer], abs_diff(got, ref))
            d.tokens[layer] += int((torch.from_numpy(got).float().argmax(-1) != ref.argmax(-1)).sum())
            cand_t = torch.from_numpy(cand)
            ref_local = exit_heads[layer].local(ref_h, cand_t).float()
            got_local = torch.from_numpy(rt.exit_local(layer, exit_in[0], cand)).float()
            d.local[layer] = max(d.local[layer], abs_diff(got_local, ref_local))
            probe = exit_heads[layer].probe
            if probe is not None and layer in rt.exit_scores:  # the score of the same call, from the graph's logits
                s = signals(ref_local, cand_t)
                want = probe.score(exit_heads[layer].normed(ref_h), s.prob, s.margin)
                got_score = torch.from_numpy(rt.exit_scores[layer]).float()
                d.score = max(d.score, abs_diff(got_score, want))
            if e.candidates is not None:  # the candidate source at every position in one call, as a batch of rows
                want_c, _ = source.torch_pick(exit_heads[layer], ref_h, m.top_k)
                got_c, got_l = rt.exit_candidates(layer, exit_in[0], m.top_k)
                d.cand_checks += got_c.shape[0]
                d.cand_mismatch += sum(set(w) != set(g) for w, g in zip(want_c.tolist(), got_c.tolist(), strict=True))
                exact = exit_heads[layer].local(ref_h, torch.from_numpy(got_c)).float()
                d.cand_logits = max(d.cand_logits, abs_diff(got_l, exact))
                # and the last position alone, as the one-row runner calls it: the same candidates as in the batch
                alone, _ = rt.exit_candidates(layer, exit_in[0][-1:], m.top_k)
                d.cand_alone_mismatch += int(set(alone[0].tolist()) != set(got_c[-1].tolist()))
        d.kv = max(d.kv, _validate_kv_graph(adapter, rt, s_idx, kv_ids))
        if e.block is not None:  # its KV after every step == the torch block's; its K/V-only graph == torch's
            head, cache = blocks[layer]
            d.block_kv = max(d.block_kv, block_kv_diff(rt, kv, layer, cache, e.block.init_layer))
            d.kv = max(d.kv, validate_block_kv(adapter, rt, head, layer, kv_ids))
        rt.release_segment(s_idx)
        kv.calls.clear()  # its bindings hold the released sessions


def _certified(rt: Any, states: np.ndarray, full: np.ndarray, seen: tuple[int, int, int]) -> tuple[int, int, int]:
    """Add the certified head's counts on these final states [S, H] (the full head's tokens `full`) to `seen`."""
    g = rt.certified_head
    passed, token = g.session.run([g.name("passed"), g.name("token")], {g.name("hidden"): states, **rt.weight_feeds(g)})
    wrong = int((token[passed] != full[passed]).sum())
    return seen[0] + len(passed), seen[1] + int(passed.sum()), seen[2] + wrong


def _verdict(result: dict[str, Any], m: Manifest, d: _Diffs, river: bool, log: Any) -> dict[str, Any]:
    """Pass or raise ExportValidationError: int4 graphs by greedy agreement, the others by tolerance."""
    L = m.num_layers
    tol = TOLERANCE[m.dtype]
    if d.certified[2]:
        result["passed"] = False
        raise ExportValidationError(
            f"the certified final head passed {d.certified[2]} tokens that are not the full head's argmax",
            hint="export with the certified head off (ExportOptions.certified_head) and report it",
        )
    measured = [*d.logits.values(), *d.local.values(), d.kv, d.cand_logits, d.block_kv, d.score]
    if not all(math.isfinite(v) for v in measured):  # int4 graphs too: NaN tokens can "agree" with NaN tokens
        result["passed"] = False
        where = sorted({k for diffs in (d.logits, d.local) for k, v in diffs.items() if not math.isfinite(v)})
        raise ExportValidationError(
            "exported graphs or the PyTorch reference give non-finite values (NaN or infinity)"
            + (f" at exits {where}" if where else ""),
            hint="float16 holds values up to 65,504, and some models' states pass it (Gemma's massive activations): "
            "export with --dtype fp32; else the weights or heads hold NaN or infinity"
            if m.dtype == "fp16"
            else "the weights or heads hold NaN or infinity: retrain the heads or check the checkpoint",
        )
    if m.quantization is not None and (river or m.quantization.scope == "segments"):
        result["graphs"] = "river" if river else "int4"  # before the verdict: its message names them
        failure = agreement_verdict(result, L, m.quantization.min_agreement)
        if failure is not None:
            result["passed"] = False
            raise ExportValidationError(failure, hint="try a smaller --int4-block-size, or --lm-head fp32")
        if log is not None:
            log.log(f"{result['graphs']} validation passed: greedy agreement {result['greedy_agreement'][str(L)]:.1%}")
        return result
    # the probe's score is a dot product over H of the normed state: fp16's rounding of z, times the probe's weights,
    # exceeds the logits' tolerance, so it is held to it in fp32 artifacts and reported in every one
    score = d.score if m.dtype == "fp32" else 0.0
    worst = max(max(d.logits.values()), max(d.local.values()), d.kv, d.cand_logits, d.block_kv, score)
    mismatches = sum(d.tokens.values())
    strict_tokens = m.dtype == "fp32"
    if worst > tol or (strict_tokens and mismatches):
        result["passed"] = False
        bad = {k: round(v, 5) for k, v in d.logits.items() if v > tol}
        raise ExportValidationError(
            f"exported graphs differ from PyTorch: max abs logit diff {worst:.3g} (tolerance {tol}), "
            f"{mismatches} greedy token mismatches; per exit {bad or d.logits}"
        )
    if log is not None:
        log.log(f"validation passed: max abs logit diff {worst:.2e} (tolerance {tol})")
    return result


def _validate_kv_graph(adapter: Adapter, rt: Any, s_idx: int, ids: torch.Tensor) -> float:
    """Segment s_idx's K/V-only graph against the adapter's K/V projection, on the same hidden states."""
    lo, hi = rt.manifest.segments[s_idx].layers
    hidden = adapter.embed(ids) * 0.5 + 0.1  # any plausible hidden state
    n = ids.shape[1]
    cache = KVCache()
    adapter.project_kv(hidden, torch.arange(n)[None], lo, hi, cache)
    kv = rt.new_kv(1, n + 1)
    rt.run_segment(s_idx, hidden.numpy().astype(rt.np_dtype), kv, row=0, kv_only=True)
    worst = 0.0
    for i in range(lo, hi):
        k = torch.from_numpy(np.asarray(kv.keys[0][i])[:, :, :n].astype(np.float32))
        v = torch.from_numpy(np.asarray(kv.values[0][i])[:, :, :n].astype(np.float32))
        worst = max(worst, abs_diff(k, cache.keys[i]), abs_diff(v, cache.values[i]))
    return worst
