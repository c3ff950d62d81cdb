"""The final head's greedy token, certified from an int8 ranking: the full head's argmax for a quarter of its reads.

The full head streams the LM head table ([H, V]: 113 MB on the default model, ~18% of a full-depth step on 2 CPU
cores, ~30% of an int4 step) to emit one token. The certified head ranks the vocabulary with an 8-bit copy of the
table instead (ORT's MatMulNBits, blocks of 32 along H, a scale and zero point per block; the activations quantized
per block to int8 by the kernel: accuracy level 4), rescores its K best with the exact rows, and checks that no
other token can beat the best one:

    for every v:  |h.w_v - approx_v| <= sum_b ||h_b||_1 e_vb  +  sum_b (max|h_b| / 254) ||w~_vb||_1

(h the normed state; w~ the dequantized weights, e_vb the largest |w - w~| in block b of row v; the kernel rounds
each activation to the nearest of 255 steps of max|h_b| / 127, so it is off by at most half a step). The bound is a
table [V, 2 H / 32] dotted with [||h_b||_1, max|h_b| / 127]: for the `TOP_M` best-ranked tokens each its own, for
every token below them the table's column maxima at the ranking's (TOP_M + 1)-th score. Float32 summation order
is covered per term: e_vb also carries 2^-23 H max|w_vb| (a float32 dot product of length H in any order is within
H 2^-24 sum |h_i w_i| of the exact one), and the exact candidates' margins are 2^-22 H sum |h_i w_ci|. The token
passes when its exact logit beats every other candidate's and every non-candidate's upper bound by those margins:
a passing token IS the full head's argmax, whatever order either graph sums in; a row that does not pass runs the
full head. Outputs: `passed` [N] bool, `token` [N] int64.

Measured on the default model (5,000 GSM8K positions): ONNX Runtime's 8-bit scores stayed within 0.25 of the bound
everywhere, the full head's argmax was among the 8-bit top 8 at every position, and 98.5% of positions pass at
K = 16 (99.1% at K = 32); the graph takes ~1.5 ms where the fp32 head takes ~4 ms
(docs/results/2026-12-04-certified-head.md). The tables and the bound are runtime/certified_bound.py's, which also
checks at load that the machine running the graph has a kernel that keeps to the bound.

Exported for float32 artifacts whose final head is the shared fp32 table, with no bias and no logit soft-capping
(a capped logit can tie where the raw ones do not). What this module does not do: decide exits (exit_graphs.py) or
run the graph (runtime/).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from eectl.contracts.manifest import GraphIO
from eectl.export.exit_graphs import _candidate_logits
from eectl.export.graphs import _Builder, _rms
from eectl.models.adapters import Adapter
from eectl.runtime.certified_bound import BLOCK, KERNEL, ROUNDING, quantize_blocks

CERTIFIED_K = 16  # candidates rescored exactly: 98.5% of the default model's positions pass (module docstring)
FILE = "head_certified.onnx"


def certifiable(adapter: Adapter, dtype: str, lm_head: str) -> str | None:
    """Why this model's final head cannot be certified (None: it can)."""
    if dtype != "fp32":
        return "float32 artifacts only (a float16 head's own rounding is larger than the margin)"
    if lm_head != "fp32":
        return f"the final head is {lm_head}, not the shared table"
    if getattr(adapter.lm_head, "bias", None) is not None:
        return "the LM head has a bias"
    if getattr(adapter.config, "final_logit_softcapping", None):
        return "the logits are soft-capped"
    if adapter.dims.hidden_size % BLOCK:
        return f"the hidden size is not a multiple of {BLOCK}"
    return None


TOP_M = 512  # tokens whose own bound is computed; every token below them is bounded by the table's column maxima


def build_certified_head(adapter: Adapter, k: int = CERTIFIED_K) -> tuple[onnx.ModelProto, GraphIO]:
    """The certified final head (module docstring): hidden [N, H] -> passed [N], token [N]."""
    dims = adapter.dims
    H, V, nb = dims.hidden_size, dims.vocab_size, dims.hidden_size // BLOCK
    tables = quantize_blocks(adapter.lm_head.weight.detach().float().cpu().numpy())  # the one definition
    b = _Builder("fp32")
    hidden = b.input("hidden_states", None, ["n", H])
    norm_w, eps = adapter.final_norm_weight()
    normed = _rms(b, hidden, norm_w, eps, "final_norm")  # the full head's own nodes: the same normed state
    for name in ("q", "scales", "zero_points", "bound", "bound_max"):
        b.const(f"certified.{name}", tables[name], float_type=tables[name].dtype == np.float32)
    approx = b.op(
        "MatMulNBits",
        [normed, "certified.q", "certified.scales", "certified.zero_points"],
        domain="com.microsoft",
        K=H,
        N=V,
        **KERNEL,  # the kernel runtime/certified_bound.py checks at load
    )  # [N, V]
    k, top_m = min(k, V - 1), max(min(k, V - 1), min(TOP_M, V - 1))
    mag = b.op("Abs", [normed])
    per_block = b.op("Reshape", [mag, b.const("certified.blocks", np.array([0, nb, BLOCK], np.int64), False)])
    axis2 = b.const("certified.axis2", np.array([2], np.int64), False)
    l1 = b.op("ReduceSum", [per_block, axis2], keepdims=0)  # [N, nb]
    step = b.op("Mul", [b.op("ReduceMax", [per_block, axis2], keepdims=0), b.const("certified.inv127", 1 / 127)])
    coef = b.op("Concat", [l1, step], axis=1)  # [N, 2 nb]: the bound of token v is coef . bound[v]
    ranked, order = b.op("TopK", [approx, b.const("certified.m", np.array([top_m + 1], np.int64), False)], 2, axis=-1)
    one = b.const("certified.one", np.array([1], np.int64), False)
    zero, at_k, at_m = (b.const(f"certified.at{i}", np.array([i], np.int64), False) for i in (0, k, top_m))
    cand = b.op("Slice", [order, zero, at_k, one])  # [N, K]: rescored exactly
    mid_ids, mid_scores = b.op("Slice", [order, at_k, at_m, one]), b.op("Slice", [ranked, at_k, at_m, one])
    mid_bound = b.op(
        "Squeeze",
        [
            b.op("MatMul", [b.op("Gather", ["certified.bound", mid_ids], axis=0), b.op("Unsqueeze", [coef, axis2])]),
            axis2,
        ],
    )  # [N, M - K]
    mid = b.op("ReduceMax", [b.op("Add", [mid_scores, mid_bound]), one], keepdims=1)  # [N, 1]
    below = b.op("Slice", [ranked, at_m, b.const("certified.end", np.array([top_m + 1], np.int64), False), one])
    rest = b.op("Add", [below, b.op("Unsqueeze", [b.op("MatMul", [coef, "certified.bound_max"]), one])])  # [N, 1]
    others = b.op("Max", [mid, rest])
    exact, rows = _candidate_logits(b, adapter, normed, cand)  # [N, K], [N, K, H]
    weighted = b.op("Squeeze", [b.op("MatMul", [b.op("Abs", [rows]), b.op("Unsqueeze", [mag, axis2])]), axis2])
    slack = b.op("Mul", [weighted, b.const("certified.rounding", 2.0 * ROUNDING * H)])  # [N, K]: two computations
    two = b.const("certified.two", np.array([2], np.int64), False)
    top, where = b.op("TopK", [exact, two], 2, axis=-1)  # [N, 2]
    cols = [b.op("Slice", [where, zero, one, one]), b.op("Slice", [where, one, two, one])]
    best, runner_up = b.op("Slice", [top, zero, one, one]), b.op("Slice", [top, one, two, one])  # [N, 1]
    best_slack, up_slack = (b.op("GatherElements", [slack, c], axis=1) for c in cols)
    token = b.op("GatherElements", [cand, cols[0]], axis=1)  # [N, 1]
    clear = b.op("Greater", [b.op("Sub", [best, others]), best_slack])
    apart = b.op("Greater", [b.op("Sub", [best, runner_up]), b.op("Add", [best_slack, up_slack])])
    b.output(b.op("Squeeze", [b.op("And", [clear, apart]), one]), "passed", TensorProto.BOOL, ["n"])
    b.output(b.op("Squeeze", [token, one]), "token", TensorProto.INT64, ["n"])
    inputs: dict[str, Any] = {"hidden": "hidden_states", "rows": "lm_head_rows"}
    io = GraphIO(file=FILE, inputs=inputs, outputs={"passed": "passed", "token": "token"})
    return b.model("head_certified"), io
