"""`eectl export`: a segmented ONNX artifact with exit points, validated against PyTorch.

The decoder is cut at the exit points into segments, each one ONNX graph built directly from the weights:

    input_ids -> [embed] -> hidden -> [segment 0: layers 0..e1) -> hidden -> [segment 1: e1..e2) -> ... -> hidden
                                                 |                                 |                     |
                                              [exit e1]                         [exit e2]            [final head]

A segment layer is  RMSNorm -> QKV MatMul -> (q/k norm) -> GroupQueryAttention (rotary inside, packed QKV, past and
present KV share one buffer, written in place) -> O MatMul -> residual + RMSNorm -> gate/up MatMul -> act -> down
MatMul -> residual, with each "residual + RMSNorm" one SkipSimplifiedLayerNormalization (the MLP's residual is added
by the next layer's input norm, or by one Add at the segment's end), the fused ops onnxruntime-genai's graphs use.
One graph serves prefill, one-token decode and multi-token chunks on top of a past (batch, sequence and past length
dynamic). Each segment also gets a K/V-only graph (the `copy` policy). Exit graphs (optional trained head, final
norm, LM head, Top-K, greedy token) take the LM-head weight, stored transposed [H, V], as an input, so the artifact
stores it once (weights/*.npy) and every exit session binds the same array.

Weights live outside the protobuf: every graph is saved as `<graph>.onnx` (structure, a few KB) plus
`<graph>.onnx.data` (its initializers, ONNX external data, each tensor aligned for memory mapping), so no graph meets
protobuf's 2 GB limit, and graphs are built and written one at a time: peak memory is the model plus one graph.

Why built from the weights rather than exported by torch.onnx: GroupQueryAttention with a shared KV buffer avoids
concatenating the cache each token, the cost that dominates decode at long context (numbers in the issue notes).

What this module does not do: choose exits at run time (runtime/), or calibrate (calibrate.py).
"""

from __future__ import annotations

import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from eectl import __version__
from eectl.calibration_file import Calibration
from eectl.errors import ArtifactError, UsageError
from eectl.exits import DEFAULT_TOP_K, CandidateSource, ExitHead, FirstExitTopK, Int8Ranking, Shortlist, make_source
from eectl.files import STAGING_MARKER, locked_staging, output_error, sha256_file
from eectl.heads_meta import HeadsMeta
from eectl.manifest import (
    MANIFEST,
    SCHEMA_VERSION,
    ExitPoint,
    GraphIO,
    KVLayout,
    Manifest,
    Quantization,
    Segment,
    SharedWeight,
    is_artifact,
    write_manifest,
)
from eectl.models.adapters import Adapter, Capture, KVCache, LayerWeights
from eectl.models.loading import LoadedModel
from eectl.quantize import Int4Options, agreement_verdict, quantize_graph, quantize_lm_head
from eectl.recipe import check_exit_layers, default_exits
from eectl.runtime.policies import POLICIES

OPSET = 21
IR_VERSION = 10
DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}
# Validation tolerance on logits (max abs difference, ORT vs torch) per artifact dtype.
TOLERANCE = {"fp32": 1e-3, "fp16": 0.25}
VALIDATION_DECODE_STEPS = 16
# Initializers of at least this many bytes go to the graph's external data file; smaller ones (shapes, scalars)
# stay inline. Offsets are aligned to 64 KiB, the largest mmap allocation granularity ORT checks for.
EXTERNAL_MIN_BYTES = 1024
EXTERNAL_ALIGN = 1 << 16


class ExportValidationError(ArtifactError):
    """The exported graphs do not reproduce PyTorch within tolerance."""


# ---------------------------------------------------------------------------------------------------------------
# Graph building
# ---------------------------------------------------------------------------------------------------------------


class _Builder:
    """A small helper over onnx.helper: unique names, initializers in the artifact dtype."""

    def __init__(self, dtype: str) -> None:
        self.elem, self.np_dtype = DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._n = 0

    def fresh(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, name: str, value: Any, float_type: bool = True) -> str:
        arr = value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if float_type:
            arr = arr.astype(self.np_dtype, copy=False)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> Any:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else outs

    def input(self, name: str, elem: int | None, shape: list[Any]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, shape))
        return name

    def output(self, src: str, name: str, elem: int | None, shape: list[Any]) -> None:
        self.nodes.append(helper.make_node("Identity", [src], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, self.elem if elem is None else elem, shape))

    def model(self, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
            producer_name="eectl",
            producer_version=__version__,
        )
        model.ir_version = IR_VERSION
        return model


def _rms(b: _Builder, x: str, weight: torch.Tensor, eps: float, name: str) -> str:
    return b.op("SimplifiedLayerNormalization", [x, b.const(name, weight)], axis=-1, epsilon=eps)


def _add_rms(b: _Builder, x: str, delta: str | None, weight: torch.Tensor, eps: float, name: str) -> tuple[str, str]:
    """RMSNorm(x + delta) and the sum x + delta, as one SkipSimplifiedLayerNormalization (the residual add and the
    next norm read the stream once; ORT does not fuse the pair itself when the sum has other consumers)."""
    if delta is None:
        return _rms(b, x, weight, eps, name), x
    normed, total = b.fresh("skip_norm"), b.fresh("residual")
    b.nodes.append(
        helper.make_node(
            "SkipSimplifiedLayerNormalization",
            [x, delta, b.const(name, weight)],
            [normed, "", "", total],
            domain="com.microsoft",
            epsilon=eps,
        )
    )
    return normed, total


def _linear(b: _Builder, x: str, weights: list[torch.Tensor], biases: list[torch.Tensor | None], name: str) -> str:
    """x @ concat(weights).T (+ concat(biases)): one MatMul for several projections."""
    w = torch.cat([wt.T for wt in weights], dim=1)  # [in, out], one copy (big models: memory is the limit)
    y = b.op("MatMul", [x, b.const(name, w)])
    if any(bias is not None for bias in biases):
        full = torch.cat(
            [bias if bias is not None else torch.zeros(wt.shape[0]) for wt, bias in zip(weights, biases, strict=True)]
        )
        y = b.op("Add", [y, b.const(name + ".bias", full)])
    return y


def _head_norm(b: _Builder, x: str, weight: torch.Tensor, eps: float, heads: int, head_dim: int, name: str) -> str:
    """RMSNorm over each head of a [B, S, heads * D] projection (Qwen3 / Gemma3 q_norm and k_norm)."""
    split = b.op("Reshape", [x, b.const(name + ".shape4", np.array([0, 0, heads, head_dim], np.int64), False)])
    normed = _rms(b, split, weight, eps, name)
    return b.op("Reshape", [normed, b.const(name + ".shape3", np.array([0, 0, heads * head_dim], np.int64), False)])


def _layer(
    b: _Builder,
    x: str,
    delta: str | None,
    w: LayerWeights,
    names: dict[str, str],
    dims: Any,
    rope: dict[str, tuple[str, str]],
    kv_only: bool,
) -> tuple[str, str | None, str, str, str]:
    """One decoder layer on the residual stream x + delta (delta: an addend not yet added, or None).

    Returns (x_out, delta_out, layer_input, present_key, present_value): the stream after the layer is
    x_out + delta_out, the MLP's output is left unadded so that the next layer's input norm adds it (one
    SkipSimplifiedLayerNormalization); layer_input is this layer's materialised input stream.
    """
    i, nh, nkv, d = w.index, dims.num_heads, dims.num_kv_heads, dims.head_dim
    p = f"layers.{i}"
    h, x = _add_rms(b, x, delta, w.input_norm, w.eps, f"{p}.input_norm")
    layer_input = x
    qkv = _linear(b, h, [w.q, w.k, w.v], [w.q_bias, w.k_bias, w.v_bias], f"{p}.qkv")
    q, k, v = qkv, "", ""  # packed [B, S, (nh + 2 nkv) D]: GroupQueryAttention splits it itself
    if w.q_norm is not None and w.k_norm is not None:  # per-head norms need q and k apart
        q, k, v = b.op(
            "Split",
            [qkv, b.const(f"{p}.qkv.split", np.array([nh * d, nkv * d, nkv * d], np.int64), False)],
            3,
            axis=-1,
        )
        q = _head_norm(b, q, w.q_norm, w.eps, nh, d, f"{p}.q_norm")
        k = _head_norm(b, k, w.k_norm, w.eps, nkv, d, f"{p}.k_norm")
    cos, sin = rope[w.layer_type]
    attrs: dict[str, Any] = dict(num_heads=nh, kv_num_heads=nkv, scale=w.scale, do_rotary=1)
    if w.sliding_window is not None:
        attrs["local_window_size"] = int(w.sliding_window)
    if w.softcap:
        attrs["softcap"] = float(w.softcap)
    attn, present_k, present_v = b.op(
        "GroupQueryAttention",
        [q, k, v, names["past_key"], names["past_value"], "seqlens_k", "total_sequence_length", cos, sin],
        3,
        domain="com.microsoft",
        **attrs,
    )
    if kv_only:
        return x, None, layer_input, present_k, present_v
    o = _linear(b, attn, [w.o], [w.o_bias], f"{p}.o")
    if w.pre_feedforward_norm is not None and w.post_feedforward_norm is not None:  # Gemma's sandwich norms
        o = _rms(b, o, w.post_attention_norm, w.eps, f"{p}.post_attention_norm")
        h, x = _add_rms(b, x, o, w.pre_feedforward_norm, w.eps, f"{p}.pre_feedforward_norm")
    else:
        h, x = _add_rms(b, x, o, w.post_attention_norm, w.eps, f"{p}.post_attention_norm")
    inter = w.gate.shape[0]
    gu = _linear(b, h, [w.gate, w.up], [None, None], f"{p}.gate_up")
    gate, up = b.op("Split", [gu, b.const(f"{p}.gate_up.split", np.array([inter, inter], np.int64), False)], 2, axis=-1)
    if w.activation == "silu":
        act = b.op("Mul", [gate, b.op("Sigmoid", [gate])])
    else:
        act = b.op("Gelu", [gate], approximate="tanh")
    down = _linear(b, b.op("Mul", [act, up]), [w.down], [None], f"{p}.down")
    if w.post_feedforward_norm is not None:
        down = _rms(b, down, w.post_feedforward_norm, w.eps, f"{p}.post_feedforward_norm")
    return x, down, layer_input, present_k, present_v


def build_segment(
    adapter: Adapter, lo: int, hi: int, dtype: str, max_positions: int, kv_only: bool = False
) -> tuple[onnx.ModelProto, GraphIO]:
    dims = adapter.dims
    b = _Builder(dtype)
    hidden = b.input("hidden_states", None, ["batch", "sequence", dims.hidden_size])
    b.input("seqlens_k", TensorProto.INT32, ["batch"])
    b.input("total_sequence_length", TensorProto.INT32, [])
    rope: dict[str, tuple[str, str]] = {}
    for kind, (cos, sin) in adapter.rotary_tables(max_positions).items():
        rope[kind] = (b.const(f"rope.{kind}.cos", cos), b.const(f"rope.{kind}.sin", sin))
    kv_shape = ["batch", dims.num_kv_heads, "max_sequence", dims.head_dim]
    names = {k: [] for k in ("past_key", "past_value", "present_key", "present_value")}  # type: dict[str, list[str]]
    for i in range(lo, hi):
        names["past_key"].append(b.input(f"past_key_values.{i}.key", None, kv_shape))
        names["past_value"].append(b.input(f"past_key_values.{i}.value", None, kv_shape))
    x, delta = hidden, None
    layer_input = hidden
    boundaries = []  # the residual stream before each layer (materialised as its input), then after the last
    for j, i in enumerate(range(lo, hi)):
        x, delta, layer_input, pk, pv = _layer(
            b,
            x,
            delta,
            adapter.layer_weights(i),
            {"past_key": names["past_key"][j], "past_value": names["past_value"][j]},
            dims,
            rope,
            kv_only,
        )
        boundaries.append(layer_input)
        for kind, src in (("key", pk), ("value", pv)):
            name = f"present.{i}.{kind}"
            b.output(src, name, None, kv_shape)
            names[f"present_{kind}"].append(name)
    outputs: dict[str, str | list[str]] = {"present_key": names["present_key"], "present_value": names["present_value"]}
    if not kv_only:
        if delta is not None:  # the last layer's MLP output, not yet added to the stream
            x = b.op("Add", [x, delta])
        b.output(x, "hidden_states_out", None, ["batch", "sequence", dims.hidden_size])
        b.output(layer_input, "last_layer_input", None, ["batch", "sequence", dims.hidden_size])
        outputs.update(hidden_out="hidden_states_out", layer_input="last_layer_input")
        # [B, (n_layers + 1) * S, H]: one Concat (no per-layer ops) so a signal can read every block's transition
        # (River's minimum cosine over a segment's blocks); the runner binds it only when its signal needs it
        states = b.op("Concat", [*boundaries, x], axis=1)
        b.output(states, "layer_states", None, ["batch", "states", dims.hidden_size])
        outputs["layer_states"] = "layer_states"
    kind = "kv" if kv_only else "segment"
    file = f"{kind}_{lo:03d}_{hi:03d}.onnx"
    io = GraphIO(
        file=file,
        inputs={
            "hidden": "hidden_states",
            "seqlens_k": "seqlens_k",
            "total_sequence_length": "total_sequence_length",
            "past_key": names["past_key"],
            "past_value": names["past_value"],
        },
        outputs=outputs,
    )
    return b.model(f"{kind}_{lo}_{hi}"), io


def build_embedding(adapter: Adapter, dtype: str, transposed: bool) -> tuple[onnx.ModelProto, GraphIO]:
    """input_ids -> hidden states, gathering rows of the embedding table, or its columns where the table is the
    tied LM head stored transposed ([H, V], see _write_artifact)."""
    dims = adapter.dims
    b = _Builder(dtype)
    ids = b.input("input_ids", TensorProto.INT64, ["batch", "sequence"])
    if transposed:
        weight = b.input("embed_weight", None, [dims.hidden_size, dims.vocab_size])
        h = b.op("Transpose", [b.op("Gather", [weight, ids], axis=1)], perm=[1, 2, 0])  # [H, B, S] -> [B, S, H]
    else:
        weight = b.input("embed_weight", None, [dims.vocab_size, dims.hidden_size])
        h = b.op("Gather", [weight, ids], axis=0)
    scale = adapter.embed_scale()
    if scale != 1.0:
        h = b.op("Mul", [h, b.const("embed_scale", np.array(scale, np.float32))])
    b.output(h, "hidden_states", None, ["batch", "sequence", dims.hidden_size])
    io = GraphIO(
        file="embed.onnx",
        inputs={"input_ids": "input_ids", "weight": "embed_weight"},
        outputs={"hidden": "hidden_states"},
    )
    return b.model("embed"), io


def _head_prefix(b: _Builder, hidden: str, head: torch.nn.Module | None, hidden_size: int, name: str) -> str:
    """Inline a trained head (hidden [N, H] -> [N, H]) exported by torch.onnx into this graph, or pass through."""
    if head is None:
        return hidden
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "head.onnx"
        example = torch.zeros(2, hidden_size, dtype=torch.float32)
        module = head.float().eval()
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (example,),
                str(path),
                dynamo=False,
                opset_version=17,
                input_names=["h"],
                output_names=["y"],
                dynamic_axes={"h": {0: "n"}, "y": {0: "n"}},
            )
        sub = onnx.load(str(path))
    rename = {"h": hidden, "y": b.fresh(f"{name}.out")}

    def mapped(n: str) -> str:
        if n in rename:
            return rename[n]
        if n == "":
            return n
        return f"{name}.{n}"

    for init in sub.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.dtype in (np.float32, np.float64):
            arr = arr.astype(b.np_dtype)
        b.inits.append(numpy_helper.from_array(arr, mapped(init.name)))
    for node in sub.graph.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.input[:]
        del new.output[:]
        new.input.extend(mapped(n) for n in node.input)
        new.output.extend(mapped(n) for n in node.output)
        new.name = mapped(node.name) if node.name else ""
        if new.op_type == "Constant" and b.np_dtype == np.float16:
            for attr in new.attribute:
                if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                    attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float16)))
        b.nodes.append(new)
    return rename["y"]


def build_exit(
    adapter: Adapter, layer: int, dtype: str, local: bool, head: torch.nn.Module | None = None
) -> tuple[onnx.ModelProto, GraphIO]:
    """Exit graph after `layer`: (head) -> final norm -> LM head rows -> logits, the same math as ExitHead.

    The LM head is the shared table stored transposed, [H, V] (see _write_artifact): the full graph's MatMul with
    one token is then a matrix-vector product that streams the table once, and the local graph gathers K columns.
    The full graph also outputs the greedy token (ArgMax, first index on ties as torch): when the runner needs
    nothing else it copies only that out, with k = 1 for the Top-K (sessions.greedy_token).
    """
    dims = adapter.dims
    b = _Builder(dtype)
    hidden = b.input("hidden_states", None, ["n", dims.hidden_size])
    weight = b.input("lm_head_weight", None, [dims.hidden_size, dims.vocab_size])
    norm_w, eps = adapter.final_norm_weight()
    x = _head_prefix(b, hidden, head, dims.hidden_size, f"exit_{layer}.head")
    normed = _rms(b, x, norm_w, eps, "final_norm")
    softcap = getattr(adapter.config, "final_logit_softcapping", None)
    bias = getattr(adapter.lm_head, "bias", None)

    def cap(t: str) -> str:
        if not softcap:
            return t
        c = b.const(b.fresh("softcap"), np.array(softcap, np.float32))
        return b.op("Mul", [b.op("Tanh", [b.op("Div", [t, c])]), c])

    suffix = "local" if local else "full"
    inputs: dict[str, str | list[str]] = {"hidden": "hidden_states", "weight": "lm_head_weight"}
    if local:
        cand = b.input("candidates", TensorProto.INT64, ["n", "k"])
        cols = b.op("Transpose", [b.op("Gather", [weight, cand], axis=1)], perm=[1, 0, 2])  # [H, N, K] -> [N, H, K]
        q = b.op("Unsqueeze", [normed, b.const("axis1", np.array([1], np.int64), False)])  # [N, 1, H]
        logits = b.op("MatMul", [q, cols])  # [N, 1, K]
        logits = b.op("Squeeze", [logits, "axis1"])
        if bias is not None:
            logits = b.op("Add", [logits, b.op("Gather", [b.const("lm_head_bias", bias.detach()), cand], axis=0)])
        b.output(cap(logits), "candidate_logits", None, ["n", "k"])
        inputs["candidates"] = "candidates"
        outputs: dict[str, str | list[str]] = {"candidate_logits": "candidate_logits"}
    else:
        b.input("top_k", TensorProto.INT64, [1])
        logits = b.op("MatMul", [normed, weight])  # [N, H] @ [H, V]
        if bias is not None:
            logits = b.op("Add", [logits, b.const("lm_head_bias", bias.detach())])
        logits = cap(logits)
        values, indices = b.op("TopK", [logits, "top_k"], 2, axis=-1, largest=1, sorted=1)
        b.output(logits, "logits", None, ["n", dims.vocab_size])
        b.output(indices, "candidates", TensorProto.INT64, ["n", "k"])
        b.output(values, "candidate_logits", None, ["n", "k"])
        b.output(b.op("ArgMax", [logits], axis=-1, keepdims=0), "token", TensorProto.INT64, ["n"])
        inputs["top_k"] = "top_k"
        outputs = {
            "logits": "logits",
            "candidates": "candidates",
            "candidate_logits": "candidate_logits",
            "token": "token",
        }
    io = GraphIO(file=f"exit_{layer:03d}_{suffix}.onnx", inputs=inputs, outputs=outputs)
    return b.model(f"exit_{layer}_{suffix}"), io


def save_graph(model: onnx.ModelProto, io: GraphIO, folder: Path) -> GraphIO:
    """Write `io.file` with its large initializers moved to `io.file + '.data'` (ONNX external data).

    Each tensor's bytes are written and dropped from the proto one at a time, so the proto that is finally
    serialised is small whatever the model's size. Returns io with `data` naming the weights file (None when the
    graph has no large initializer, e.g. the embedding graph, whose table is bound at run time).
    """
    data_name = io.file + ".data"
    offset = 0
    with open(folder / data_name, "wb") as f:
        for tensor in model.graph.initializer:
            if len(tensor.raw_data) < EXTERNAL_MIN_BYTES:
                continue
            offset = -(-offset // EXTERNAL_ALIGN) * EXTERNAL_ALIGN
            size = len(tensor.raw_data)
            f.seek(offset)
            f.write(tensor.raw_data)
            set_external_data(tensor, data_name, offset, size)
            tensor.ClearField("raw_data")
            offset += size
    if offset == 0:
        (folder / data_name).unlink()
        data = None
    else:
        data = data_name
    onnx.save(model, str(folder / io.file))
    return io.model_copy(update={"data": data})


def build_candidates(
    adapter: Adapter, layer: int, dtype: str, source: CandidateSource, head: torch.nn.Module | None = None
) -> tuple[onnx.ModelProto, GraphIO]:
    """The candidate source at exit `layer` as a graph: hidden [N, H] -> K candidates [N, K] and their exact logits.

        hidden -> (head) -> final norm -+- shortlist: MatMul [H, S] rows -> TopK -> Gather shortlist ids
                                        +- int8: DynamicQuantizeLinear -> MatMulInteger [H, V] int8 -> scales -> TopK
                                                 -> Gather the K exact rows of lm_head_weight -> exact logits

    The same tensors as the torch source (exits.py): the shortlist's ids and rows, `quantize_rows_int8`'s weights.
    Weights are initializers so ONNX Runtime can prepack them. DynamicQuantizeLinear quantizes per tensor: the
    runner passes one token (N = 1), where that is per row, as calibrate computes it.
    """
    dims = adapter.dims
    b = _Builder(dtype)
    hidden = b.input("hidden_states", None, ["n", dims.hidden_size])
    b.input("top_k", TensorProto.INT64, [1])
    norm_w, eps = adapter.final_norm_weight()
    x = _head_prefix(b, hidden, head, dims.hidden_size, f"exit_{layer}.head")
    normed = _rms(b, x, norm_w, eps, "final_norm")
    softcap = getattr(adapter.config, "final_logit_softcapping", None)
    bias = getattr(adapter.lm_head, "bias", None)
    weight_t = adapter.lm_head.weight.detach()

    def cap(t: str) -> str:
        if not softcap:
            return t
        c = b.const(b.fresh("softcap"), np.array(softcap, np.float32))
        return b.op("Mul", [b.op("Tanh", [b.op("Div", [t, c])]), c])

    inputs: dict[str, str | list[str]] = {"hidden": "hidden_states", "top_k": "top_k"}
    if isinstance(source, Shortlist):
        ids = source.ids
        logits = b.op("MatMul", [normed, b.const("shortlist_rows", weight_t[ids].T.contiguous())])  # [N, S]
        if bias is not None:
            logits = b.op("Add", [logits, b.const("shortlist_bias", bias.detach()[ids])])
        values, idx = b.op("TopK", [cap(logits), "top_k"], 2, axis=-1, largest=1, sorted=1)
        cand = b.op("Gather", [b.const("shortlist_ids", ids.numpy().astype(np.int64), False), idx], axis=0)
        cand_logits = values
    elif isinstance(source, Int8Ranking):
        x32 = normed if b.elem == TensorProto.FLOAT else b.op("Cast", [normed], to=TensorProto.FLOAT)
        xq, xs, xzp = b.op("DynamicQuantizeLinear", [x32], 3)
        wq = b.const("lm_head_int8", source.qweight.T.contiguous().numpy(), False)  # [H, V] int8
        acc = b.op("MatMulInteger", [xq, wq, xzp])  # [N, V] int32, exact
        approx = b.op(
            "Mul",
            [
                b.op("Mul", [b.op("Cast", [acc], to=TensorProto.FLOAT), xs]),
                b.const("lm_head_int8_scale", source.scale.numpy().astype(np.float32), False),
            ],
        )
        _, cand = b.op("TopK", [approx, "top_k"], 2, axis=-1, largest=1, sorted=1)
        weight = b.input("lm_head_weight", None, [dims.hidden_size, dims.vocab_size])  # stored [H, V]
        inputs["weight"] = weight
        cols = b.op("Transpose", [b.op("Gather", [weight, cand], axis=1)], perm=[1, 0, 2])  # [H, N, K] -> [N, H, K]
        q = b.op("Unsqueeze", [normed, b.const("axis1", np.array([1], np.int64), False)])  # [N, 1, H]
        exact = b.op("Squeeze", [b.op("MatMul", [q, cols]), "axis1"])
        if bias is not None:
            exact = b.op("Add", [exact, b.op("Gather", [b.const("lm_head_bias", bias.detach()), cand], axis=0)])
        cand_logits = cap(exact)
    else:
        raise UsageError(f"no candidate graph for source '{source.name}' (the full source uses the full exit graph)")
    b.output(cand, "candidates", TensorProto.INT64, ["n", "k"])
    b.output(cand_logits, "candidate_logits", None, ["n", "k"])
    io = GraphIO(
        file=f"exit_{layer:03d}_{source.name}.onnx",
        inputs=inputs,
        outputs={"candidates": "candidates", "candidate_logits": "candidate_logits"},
    )
    return b.model(f"exit_{layer}_{source.name}"), io


# ---------------------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------------------


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
    weights: str = "fp32"  # fp32 or int4 (weight-only MatMulNBits segment graphs, quantize.py)
    int4: Int4Options = field(default_factory=Int4Options)  # settings for --weights int4 and --river
    river: bool = False  # add int4 copies of the segments after the first exit (the `river` policy)


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
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"cannot create {out}: {parent} is not a folder")


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
    exits = check_exit_layers(options.exits, L)
    if options.river and not exits:
        raise UsageError("--river needs at least one exit (the river starts after the first one)")
    options.int4.check(L)
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
            manifest = _write_artifact(loaded, tmp, exits, options, heads, heads_meta, calibration, log)
            if options.validate:
                if log is not None:
                    log.log("validating the graphs against PyTorch (prefill + 16 greedy decode steps, every exit)")
                manifest.validation = validate_artifact(loaded, tmp, heads, log=log)
                if options.river:
                    manifest.validation["river"] = validate_artifact(loaded, tmp, heads, log=log, river=True)
            write_manifest(manifest, tmp)
            if options.profile_costs:
                if log is not None:
                    log.log("timing every graph at decode shape, then choosing exits by predicted speed")
                profile_and_plan(manifest, tmp, options.cost_past)
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


def profile_and_plan(manifest: Manifest, folder: Path, past: int = 128) -> None:
    """Measure the artifact's graph costs on its provider (costs.py) and choose exits by them (plan.py)."""
    from eectl.costs import measure_costs
    from eectl.plan import plan_manifest
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(folder, provider="auto", verify=False)
    signal = manifest.calibration.signal if manifest.calibration is not None else "topk-prob"
    manifest.costs = measure_costs(rt, past=past, signal=signal)
    calibrated_menu = manifest.calibration is not None and bool(manifest.calibration.options)
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
) -> Manifest:
    adapter = loaded.adapter
    dims = adapter.dims
    L = dims.num_layers
    max_pos = options.max_positions or dims.max_positions
    from eectl.export_block import export_block, is_block  # it builds on this module's graph pieces

    np_dtype = DTYPES[options.dtype][1]

    def save(model: onnx.ModelProto, io: GraphIO, int4: bool = False) -> GraphIO:
        # quantized first (MatMulNBits' packed weights), then saved with its weights as external data
        return save_graph(quantize_graph(model, options.int4) if int4 else model, io, folder)

    quantized = options.weights == "int4"

    (folder / "weights").mkdir()
    # The LM head is stored transposed, [H, V]: MatMul on a [1, H] token is then ORT's matrix-vector path, which
    # streams the table once per token; the [V, H] table with Gemm(transB) is repacked on every call (measured:
    # 2x slower per projection on this CPU). It is a graph input, shared by every exit graph and stored once.
    lm = np.ascontiguousarray(adapter.lm_head.weight.detach().float().numpy().astype(np_dtype).T)
    np.save(folder / "weights" / "lm_head.npy", lm)
    shared = {
        "lm_head": SharedWeight(file="weights/lm_head.npy", shape=list(lm.shape), dtype=options.dtype, transposed=True)
    }
    tied = adapter.embed_tokens.weight.data_ptr() == adapter.lm_head.weight.data_ptr()
    if tied:
        shared["embed"] = shared["lm_head"]
    else:
        emb = adapter.embed_tokens.weight.detach().float().numpy().astype(np_dtype)
        np.save(folder / "weights" / "embed.npy", emb)
        shared["embed"] = SharedWeight(file="weights/embed.npy", shape=list(emb.shape), dtype=options.dtype)

    embedding = save(*build_embedding(adapter, options.dtype, transposed=tied))
    cuts = [0, *exits, L]
    segments = []
    for idx, (lo, hi) in enumerate(zip(cuts, cuts[1:], strict=False)):
        if log is not None:
            log.log(f"segment {idx}: layers {lo}..{hi - 1}")
        seg_model, seg_io = build_segment(adapter, lo, hi, options.dtype, max_pos)
        river = None
        if options.river and idx > 0:  # same input/output names: the runner binds the same KV buffers
            # quantized before the fp32 graph is saved: saving moves a model's weights out of it (external data)
            river = save(seg_model, seg_io.model_copy(update={"file": f"river_{lo:03d}_{hi:03d}.onnx"}), int4=True)
        graph = save(seg_model, seg_io, quantized)
        kv_graph = save(*build_segment(adapter, lo, hi, options.dtype, max_pos, kv_only=True), int4=quantized)
        segments.append(Segment(index=idx, layers=(lo, hi), graph=graph, kv_graph=kv_graph, river=river))
    source, source_info = candidate_source(adapter, options.candidates, calibration)
    exit_points = []
    block_slots = L  # block exit heads' KV buffers follow the decoder layers'
    for layer in [*exits, L]:
        head = heads.get(layer)
        design = None if head is None else (heads_meta.design if heads_meta else type(head).__name__)
        block = None
        if is_block(head):  # its own graphs and KV; the exit graphs below score its output (export_block.py)
            block = export_block(adapter, head, layer, options.dtype, max_pos, block_slots, save)
            block_slots += 1
            head = None
        cand_graph = None
        if layer < L and source.name != FirstExitTopK.name:
            cand_graph = save(*build_candidates(adapter, layer, options.dtype, source, head))
        full_model, full_io = build_exit(adapter, layer, options.dtype, local=False, head=head)
        river_head = None
        if layer == L and options.int4.lm_head != "fp32" and (quantized or options.river):
            # the final head's own quantized table: for every token (int4 artifact) or the river's end only
            weight_input = full_io.inputs["weight"]
            assert isinstance(weight_input, str)
            q_model = quantize_lm_head(full_model, weight_input, lm, options.int4)
            q_io = full_io.model_copy(
                update={"inputs": {k: v for k, v in full_io.inputs.items() if k != "weight"}},
                deep=True,
            )
            if quantized:
                full_model, full_io = q_model, q_io
            else:
                q_io.file = f"exit_{layer:03d}_river.onnx"
                river_head = save(q_model, q_io)
        exit_points.append(
            ExitPoint(
                layer=layer,
                full=save(full_model, full_io),
                local=save(*build_exit(adapter, layer, options.dtype, local=True, head=head)),
                candidates=cand_graph,
                river=river_head,
                head=design,
                block=block,
            )
        )
    tok_dir = folder / "tokenizer"
    loaded.tokenizer.save_pretrained(str(tok_dir))  # type: ignore[attr-defined]
    eos = loaded.model.generation_config.eos_token_id if loaded.model.generation_config is not None else None
    eos = eos if eos is not None else getattr(loaded.tokenizer, "eos_token_id", None)
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        eectl_version=__version__,
        model={**loaded.source.to_dict(), "model_type": adapter.config.model_type},
        family=adapter.family,
        dims={k: int(v) for k, v in dims.__dict__.items()},
        dtype=options.dtype,
        opset=OPSET,
        tokenizer_dir="tokenizer",
        eos_token_ids=eos_ids,
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
        ),
        kv_policies=[n for n, policy in POLICIES.items() if options.river or not policy.needs_river_copies],
        calibration=calibration,
        candidate_source=source_info,
        quantization=None
        if not (quantized or options.river)
        else Quantization(**options.int4.record("segments" if quantized else "river")),
        heads=heads_meta,
    )
    manifest.files = {
        str(p.relative_to(folder)): sha256_file(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in (MANIFEST, STAGING_MARKER)
    }
    write_manifest(manifest, folder)
    return manifest


# ---------------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------------


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
    from eectl.export_block import block_kv_diff, is_block, torch_block_states, validate_block_kv
    from eectl.runtime.blocks import run_block
    from eectl.runtime.sessions import ArtifactRuntime

    adapter = loaded.adapter
    rt = ArtifactRuntime(folder, provider="cpu", verify=False, lazy_segments=True)
    m = rt.manifest
    L = m.num_layers
    tol = TOLERANCE[m.dtype]
    ids = loaded.tokenizer(VALIDATION_PROMPT, add_special_tokens=False)["input_ids"][:48]  # type: ignore[operator]
    heads = heads or {}
    # a block head runs on the exit's states with its own KV (torch_block_states); its exit graphs have no head
    token_heads = {layer: h for layer, h in heads.items() if not is_block(h)}
    exit_heads = {e.layer: ExitHead(adapter, token_heads.get(e.layer)) for e in m.exits}
    block_caches: dict[int, KVCache] = {}
    # torch reference: per step, the hidden state at every exit layer ([S, H]); its greedy token is the next chunk
    chunks: list[list[int]] = [list(ids)]
    ref_states: list[dict[int, torch.Tensor]] = []
    cache = KVCache()
    pos = 0
    for _ in range(VALIDATION_DECODE_STEPS + 1):
        chunk = chunks[-1]
        positions = torch.arange(pos, pos + len(chunk))[None]
        keep = Capture(set(exit_heads))  # the hidden state after every exit's layer
        adapter.forward_layers(adapter.embed(torch.tensor([chunk])), positions, 0, L, cache, capture=keep)
        states = torch_block_states(heads, {layer: h[0] for layer, h in keep.states.items()}, positions, block_caches)
        ref_states.append(states)
        pos += len(chunk)
        chunks.append([int(exit_heads[L].full(states[L][-1:]).argmax(-1))])
    chunks.pop()
    del cache
    diffs = {e.layer: 0.0 for e in m.exits}
    local_diffs = {e.layer: 0.0 for e in m.exits}
    token_mismatch: dict[int, int] = {e.layer: 0 for e in m.exits}
    info = m.candidate_source
    source = make_source(
        str(info.get("name", FirstExitTopK.name)),
        adapter.lm_head.weight,
        torch.tensor(info["ids"]) if info.get("ids") else None,
    )
    cand_checks = cand_mismatch = 0
    cand_diff = 0.0
    kv = rt.new_kv(1, len(ids) + VALIDATION_DECODE_STEPS + 1)
    hidden = [rt.embed(np.array([c], dtype=np.int64)) for c in chunks]
    kv_diff = block_diff = 0.0
    kv_ids = torch.tensor([ids[:8]])
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
            diffs[layer] = max(diffs[layer], float((torch.from_numpy(got).float() - ref).abs().max()))
            token_mismatch[layer] += int((torch.from_numpy(got).float().argmax(-1) != ref.argmax(-1)).sum())
            cand_t = torch.from_numpy(cand)
            ref_local = exit_heads[layer].local(ref_h, cand_t).float()
            got_local = torch.from_numpy(rt.exit_local(layer, exit_in[0], cand)).float()
            local_diffs[layer] = max(local_diffs[layer], float((got_local - ref_local).abs().max()))
            if e.candidates is not None:  # the candidate source at the last position, as the runner calls it
                want_c, _ = source.torch_pick(exit_heads[layer], ref_h[-1:], m.top_k)
                got_c, got_l = rt.exit_candidates(layer, exit_in[0][-1:], m.top_k)
                cand_checks += 1
                cand_mismatch += int(set(want_c[0].tolist()) != set(got_c[0].tolist()))
                exact = exit_heads[layer].local(ref_h[-1:], torch.from_numpy(got_c)).float()
                cand_diff = max(cand_diff, float((torch.from_numpy(got_l).float() - exact).abs().max()))
        kv_diff = max(kv_diff, _validate_kv_graph(adapter, rt, s_idx, kv_ids))
        if e.block is not None:  # its KV after every step == the torch block's; its K/V-only graph == torch's
            head = heads[layer]
            assert is_block(head)
            block_diff = max(block_diff, block_kv_diff(rt, kv, layer, block_caches[layer], e.block.init_layer))
            kv_diff = max(kv_diff, validate_block_kv(adapter, rt, head, layer, kv_ids))
        rt.release_segment(s_idx)
        kv.calls.clear()  # its bindings hold the released sessions
    result: dict[str, Any] = {
        "dtype": m.dtype,
        "tolerance": tol,
        "prompt_tokens": len(ids),
        "decode_steps": VALIDATION_DECODE_STEPS,
        "positions": len(ids) + VALIDATION_DECODE_STEPS,  # compared greedy tokens per exit
        "max_abs_logit_diff": {str(k): v for k, v in diffs.items()},
        "max_abs_local_logit_diff": {str(k): v for k, v in local_diffs.items()},
        "greedy_token_mismatches": {str(k): v for k, v in token_mismatch.items()},
        "kv_graph_max_abs_diff": kv_diff,
        "block_kv_max_abs_diff": block_diff,  # block exit heads' KV buffers after every step vs torch's
        "candidate_source": source.name,
        "candidate_checks": cand_checks,
        "candidate_set_mismatches": cand_mismatch,  # int8 ranking ties may flip the K-th candidate
        "candidate_logit_max_abs_diff": cand_diff,
        "passed": True,
    }
    if m.quantization is not None and (river or m.quantization.scope == "segments"):
        result["graphs"] = "river" if river else "int4"  # before the verdict: its message names them
        failure = agreement_verdict(result, L, m.quantization.min_agreement)
        if failure is not None:
            result["passed"] = False
            raise ExportValidationError(failure, hint="try a smaller --int4-block-size, or --lm-head fp32")
        if log is not None:
            log.log(f"{result['graphs']} validation passed: greedy agreement {result['greedy_agreement'][str(L)]:.1%}")
        return result
    worst = max(max(diffs.values()), max(local_diffs.values()), kv_diff, cand_diff, block_diff)
    mismatches = sum(token_mismatch.values())
    strict_tokens = m.dtype == "fp32"
    if worst > tol or (strict_tokens and mismatches):
        result["passed"] = False
        bad = {k: round(v, 5) for k, v in diffs.items() if v > tol}
        raise ExportValidationError(
            f"exported graphs differ from PyTorch: max abs logit diff {worst:.3g} (tolerance {tol}), "
            f"{mismatches} greedy token mismatches; per exit {bad or diffs}"
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
        worst = max(worst, float((k - cache.keys[i]).abs().max()), float((v - cache.values[i]).abs().max()))
    return worst


def describe(manifest: Manifest, folder: Path) -> dict[str, Any]:
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    L = manifest.num_layers
    return {
        "artifact": str(folder),
        "model": manifest.model.get("name"),
        "dtype": manifest.dtype,
        "segments": [list(s.layers) for s in manifest.segments],
        "exits": manifest.exit_layers,
        "size_mb": round(size / 1e6, 1),
        "quantization": None if manifest.quantization is None else manifest.quantization.model_dump(),
        "validation": manifest.validation,
        "candidate_source": {k: v for k, v in manifest.candidate_source.items() if k != "ids"},
        "costs": None if manifest.costs is None else manifest.costs.model_dump(),
        # block exit heads: per token, in decoder layers (static shape ratio; measured on this machine where timed)
        "block_heads": {
            str(e.layer): {
                "cost_layers": e.block.cost_layers,
                "measured_layers": None if manifest.costs is None else manifest.costs.block_layers(L).get(str(e.layer)),
            }
            for e in manifest.exits
            if e.block is not None
        },
        "plan": None if manifest.plan is None else manifest.plan.model_dump(),
    }
