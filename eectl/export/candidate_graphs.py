"""The candidate graphs: how the first active exit picks its K local candidates inside ONNX (a shortlist's rows, an
int8 ranking of the whole LM head, Top-K of the full projection), built from the same tensors as the torch
sources in exits/candidates.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto

from eectl.contracts.manifest import GraphIO
from eectl.errors import UsageError
from eectl.exits.base import CandidateSource
from eectl.exits.candidates import Int8Ranking, Shortlist, ShortlistInt8
from eectl.export.exit_graphs import _ROWS, _candidate_logits, _decision, _head_prefix, _probe
from eectl.export.graphs import _Builder, _rms
from eectl.models.adapters import Adapter


def _int8_scores(b: _Builder, normed: str, qweight: torch.Tensor, scale: torch.Tensor) -> str:
    """candidates.int8_scores as nodes: [N, H] -> [N, R] approximate logits, each row quantized on its own.

        x [N, H] -> scale = max(ReduceMax |x| / 127, tiny) [N, 1] -> q = round(x / scale) + 128 uint8
          -> MatMulInteger(q, W [H, R] int8, zero point 128) int32 -> float -> * (scale * the rows' scales [R])

    Not DynamicQuantizeLinear: it quantizes per tensor, so rows called together would share a scale and a row's
    candidates would depend on its batch. Symmetric, so every row's zero point is the same 128, which MatMulInteger
    takes as its one (per-tensor) zero point: (q + 128) - 128 exactly, on ORT's fast uint8 x int8 kernel (its int8 x
    int8 one is ~100x slower on this CPU, measured). The scales multiply in torch's order, so the scores equal
    `int8_scores` bit for bit (tests/test_candidates.py).
    """
    f32 = TensorProto.FLOAT
    x = normed if b.elem == f32 else b.op("Cast", [normed], to=f32)  # [N, H] float32, as torch quantizes
    peak = b.op("ReduceMax", [b.op("Abs", [x]), b.const("int8_axis1", np.array([1], np.int64), False)], keepdims=1)
    tiny = np.array([np.finfo(np.float32).tiny], np.float32)
    xs = b.op(
        "Max",
        [
            b.op("Div", [peak, b.const("int8_127", np.array([127.0], np.float32), False)]),
            b.const("int8_tiny", tiny, False),
        ],
    )
    offset = b.op(
        "Add", [b.op("Round", [b.op("Div", [x, xs])]), b.const("int8_128f", np.array([128.0], np.float32), False)]
    )
    xq = b.op("Cast", [offset], to=TensorProto.UINT8)  # [N, H] in [1, 255]
    wq = b.const("rows_int8", qweight.T.contiguous().numpy(), False)  # [H, R] int8
    zp = b.const("int8_zp", np.array(128, np.uint8), False, scalar=True)
    acc = b.op("MatMulInteger", [xq, wq, zp])  # [N, R] int32, exact
    row_scale = b.const("rows_int8_scale", scale.numpy().astype(np.float32), False)  # [R]
    return b.op("Mul", [b.op("Mul", [b.op("Cast", [acc], to=f32), row_scale]), xs])  # (acc * w_scale) * x_scale


def build_candidates(
    adapter: Adapter, layer: int, dtype: str, source: CandidateSource, head: torch.nn.Module | None = None
) -> tuple[onnx.ModelProto, GraphIO]:
    """The candidate source at exit `layer` as a graph: hidden [N, H] -> K candidates [N, K] and their exact logits.

        hidden -> (head) -> final norm -+- shortlist: MatMul [H, S] rows -> TopK -> Gather shortlist ids
                                        +- int8: per-row uint8 -> MatMulInteger [H, V] int8 -> scales -> TopK
                                                 -> Gather the K exact rows of lm_head_weight -> exact logits

    The same tensors as the torch source (exits/candidates.py): the shortlist's ids and rows, `quantize_rows_int8`'s
    weights.
    Weights are initializers so ONNX Runtime can prepack them. Every source picks each row as it would alone (int8
    quantizes each row with its own scale, as calibrate computes it), so the runner calls it once for all rows.
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
    cand_rows: str | None = None
    if isinstance(source, ShortlistInt8):  # before Shortlist: it is one
        approx = _int8_scores(b, normed, source.qweight, source.scale)  # [N, S]
        _, idx = b.op("TopK", [approx, "top_k"], 2, axis=-1, largest=1, sorted=1)
        cand = b.op("Gather", [b.const("shortlist_ids", source.ids.numpy().astype(np.int64), False), idx], axis=0)
        inputs["rows"] = _ROWS
        cand_logits, cand_rows = _candidate_logits(b, adapter, normed, cand)
        cand_logits = cap(cand_logits)
    elif isinstance(source, Shortlist):
        ids = source.ids
        logits = b.op("MatMul", [normed, b.const("shortlist_rows", weight_t[ids].T.contiguous())])  # [N, S]
        if bias is not None:
            logits = b.op("Add", [logits, b.const("shortlist_bias", bias.detach()[ids])])
        values, idx = b.op("TopK", [cap(logits), "top_k"], 2, axis=-1, largest=1, sorted=1)
        cand = b.op("Gather", [b.const("shortlist_ids", ids.numpy().astype(np.int64), False), idx], axis=0)
        cand_logits = values
    elif isinstance(source, Int8Ranking):
        approx = _int8_scores(b, normed, source.qweight, source.scale)  # [N, V]
        _, cand = b.op("TopK", [approx, "top_k"], 2, axis=-1, largest=1, sorted=1)
        inputs["rows"] = _ROWS
        cand_logits, cand_rows = _candidate_logits(b, adapter, normed, cand)
        cand_logits = cap(cand_logits)
    else:
        raise UsageError(f"no candidate graph for source '{source.name}' (the full source uses the full exit graph)")
    b.output(cand, "candidates", TensorProto.INT64, ["n", "k"])
    b.output(cand_logits, "candidate_logits", None, ["n", "k"])
    outputs: dict[str, str | list[str]] = {"candidates": "candidates", "candidate_logits": "candidate_logits"}
    if cand_rows is not None:  # the K exact rows it gathered: the later local exits can read them (chain.py)
        b.output(cand_rows, "candidate_rows", None, ["n", "k", dims.hidden_size])
        outputs["candidate_rows"] = "candidate_rows"
    _decision(b, cand_logits, cand, inputs, outputs, _probe(normed, head))
    io = GraphIO(file=f"exit_{layer:03d}_{source.name}.onnx", inputs=inputs, outputs=outputs)
    return b.model(f"exit_{layer}_{source.name}"), io
