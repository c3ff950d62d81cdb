"""Block exit heads in an artifact: their graphs, and the PyTorch reference export's validation compares them to.

A block exit head (head_designs.BlockHead, `train-heads --design block`) is a decoder layer of the model's own shape
between the exit's state and the frozen final norm + LM head. It is exported as part of its exit:

    segment s -> hidden [1, S, H] --------------------------------------------------> segment s + 1
                         |
                         +-> [exit_{l}_block: the layer, export's `_layer` op pattern; past/present KV one buffer,
                             |  written in place by GroupQueryAttention, as in the segments] -> [1, S, H]
                             +-> last position -> exit_{l}_full / _local / _candidates, built with no head:
                                                  final norm -> LM head (the shared [H, V] table)

The block is its own graph rather than a prefix of the exit graphs because it runs on every position that passes the
exit's layer (the prompt, deferred positions: its KV needs them all), the LM head only on the token being decided.
A K/V-only graph of the block serves the `copy` policy (a skipped token's exit state projected into its KV). The
block's KV buffer is one more slot of the runner's buffers (`BlockExit.kv_slot`, after the decoder layers').

What this module does not do: run the graphs (runtime/blocks.py) or train the block (heads/cached.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeGuard

import numpy as np
import onnx
import torch
from onnx import TensorProto

from eectl.contracts.manifest import BlockExit, GraphIO
from eectl.exits.designs import BlockHead
from eectl.export.graphs import _Builder, _layer
from eectl.models.adapters import Adapter
from eectl.models.parts import KVCache


def is_block(head: torch.nn.Module | None) -> TypeGuard[BlockHead]:
    return isinstance(head, BlockHead)


def build_block(
    adapter: Adapter, head: BlockHead, layer: int, dtype: str, max_positions: int, kv_only: bool = False
) -> tuple[onnx.ModelProto, GraphIO]:
    """The block head at exit `layer` as a graph: hidden [B, S, H] + its own past KV -> its output [B, S, H] + present
    KV (or, kv_only, the K/V only), built from the block's weights exactly as a segment builds layer `init_layer`."""
    dims = adapter.dims
    init = head.init_layer
    w = adapter.layer_weights(init, head.block)
    b = _Builder(dtype)
    hidden = b.input("hidden_states", None, ["batch", "sequence", dims.hidden_size])
    b.input("seqlens_k", TensorProto.INT32, ["batch"])
    b.input("total_sequence_length", TensorProto.INT32, [])
    cos, sin = adapter.rotary_tables(max_positions)[w.layer_type]
    rope = {w.layer_type: (b.const(f"rope.{w.layer_type}.cos", cos), b.const(f"rope.{w.layer_type}.sin", sin))}
    kv_shape = ["batch", dims.num_kv_heads, "max_sequence", dims.head_dim]
    past_k = b.input(f"past_key_values.exit_{layer}_block.key", None, kv_shape)
    past_v = b.input(f"past_key_values.exit_{layer}_block.value", None, kv_shape)
    x, delta, _, pk, pv = _layer(b, hidden, None, w, {"past_key": past_k, "past_value": past_v}, dims, rope, kv_only)
    present = {"key": f"present.exit_{layer}_block.key", "value": f"present.exit_{layer}_block.value"}
    b.output(pk, present["key"], None, kv_shape)
    b.output(pv, present["value"], None, kv_shape)
    outputs: dict[str, str | list[str]] = {"present_key": [present["key"]], "present_value": [present["value"]]}
    if not kv_only:
        out = x if delta is None else b.op("Add", [x, delta])
        b.output(out, "block_out", None, ["batch", "sequence", dims.hidden_size])
        outputs["hidden_out"] = "block_out"
    name = f"exit_{layer:03d}_block{'_kv' if kv_only else ''}"
    io = GraphIO(
        file=f"{name}.onnx",
        inputs={
            "hidden": "hidden_states",
            "seqlens_k": "seqlens_k",
            "total_sequence_length": "total_sequence_length",
            "past_key": [past_k],
            "past_value": [past_v],
        },
        outputs=outputs,
    )
    return b.model(name), io


def export_block(
    adapter: Adapter,
    head: BlockHead,
    layer: int,
    dtype: str,
    max_positions: int,
    kv_slot: int,
    save: Callable[[onnx.ModelProto, GraphIO], GraphIO],
) -> BlockExit:
    """Build and save both graphs of the block head at exit `layer`; its manifest entry."""
    graph = save(*build_block(adapter, head, layer, dtype, max_positions))
    kv_graph = save(*build_block(adapter, head, layer, dtype, max_positions, kv_only=True))
    return BlockExit(graph=graph, kv_graph=kv_graph, kv_slot=kv_slot, init_layer=head.init_layer, cost_layers=1.0)


@torch.no_grad()
def torch_block_states(
    heads: Mapping[int, torch.nn.Module],
    states: dict[int, torch.Tensor],
    positions: torch.Tensor,
    caches: dict[int, KVCache],
) -> dict[int, torch.Tensor]:
    """The reference: each block exit's state [S, H] replaced by its block's output, decoded on top of the block's
    own KV in caches[layer] (positions [1, S]); other exits' states unchanged."""
    out = dict(states)
    for layer, head in heads.items():
        if isinstance(head, BlockHead) and layer in states:
            out[layer] = head.step(states[layer][None], positions, caches.setdefault(layer, KVCache()))[0]
    return out


@torch.no_grad()
def validate_block_kv(adapter: Adapter, rt: object, head: BlockHead, layer: int, ids: torch.Tensor) -> float:
    """The block's K/V-only graph against the adapter's projection through the block, on the same hidden states."""
    from eectl.runtime.blocks import run_block
    from eectl.runtime.sessions import ArtifactRuntime

    assert isinstance(rt, ArtifactRuntime)
    hidden = adapter.embed(ids) * 0.5 + 0.1  # any plausible hidden state
    n = ids.shape[1]
    cache = KVCache()
    init = head.init_layer
    adapter.block_project_kv(head.block, hidden, torch.arange(n)[None], init, cache)
    kv = rt.new_kv(1, n + 1)
    kv.seek(0, n, layer - 1, layer)  # the block follows its segment: pretend the segment holds these positions
    run_block(rt, layer, hidden.numpy().astype(rt.np_dtype), kv, 0, kv_only=True)
    slot = rt.manifest.exit_at(layer).block.kv_slot  # type: ignore[union-attr]
    k = torch.from_numpy(np.asarray(kv.keys[0][slot])[:, :, :n].astype(np.float32))
    v = torch.from_numpy(np.asarray(kv.values[0][slot])[:, :, :n].astype(np.float32))
    return max(float((k - cache.keys[init]).abs().max()), float((v - cache.values[init]).abs().max()))


def block_kv_diff(rt: object, kv: object, layer: int, cache: KVCache, init_layer: int) -> float:
    """Max abs difference between the block's KV buffer (its filled positions) and the torch block's cache."""
    from eectl.runtime.sessions import ArtifactRuntime, KVBuffers

    assert isinstance(rt, ArtifactRuntime) and isinstance(kv, KVBuffers)
    slot = rt.manifest.exit_at(layer).block.kv_slot  # type: ignore[union-attr]
    n = int(kv.filled[0, slot])
    worst = 0.0
    for got, want in ((kv.keys[0][slot], cache.keys[init_layer]), (kv.values[0][slot], cache.values[init_layer])):
        g = torch.from_numpy(np.asarray(got)[:, :, :n].astype(np.float32))
        worst = max(worst, float((g - want.float()).abs().max()))
    return worst
