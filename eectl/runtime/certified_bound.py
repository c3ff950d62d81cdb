"""The certified head's 8-bit tables and error bound, and the check at load that this machine's kernel keeps to it.

The certified final head (export/certified_head.py) ranks the vocabulary with ONNX Runtime's MatMulNBits (8 bits,
blocks of 32 along H with a scale and zero point, accuracy level 4: the kernel quantizes each block of activations
to int8) and proves its token with a per-block bound on how far the 8-bit score of a token can be from its exact
logit. The bound rests on one assumption about the kernel: it rounds each activation to the nearest of the 255
steps of max|h_b| / 127 and adds the integer products exactly. Measured on ORT 1.31's x86 kernel (within a quarter
of the bound on 5,000 real states), but a CPU whose kernel quantizes otherwise (coarser scales, truncation) would
let a certified token differ from the full head's argmax silently. Export's validation checks the graph on the
exporting machine only; `check_kernel` checks the machine that runs it: one MatMulNBits call on random weights and
activations (outlier rows and dimensions, a block of zeros, 1, 2 and 16 rows) whose every output must lie within
the bound of the exact float64 product. The runtime runs it once per process and hidden size before it uses a
certified head (sessions.ArtifactRuntime), and runs the full head instead where it fails.

`quantize_blocks` is the one definition of the tables and the bound: export builds the graph's constants from it,
the check its probe.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK = 32  # weights and activations quantized per 32 along H (MatMulNBits' block)
ROUNDING = 2.0**-23  # per term of a float32 dot product: twice the unit roundoff (any summation order, with slack)
SLACK = 1.0 + 2.0**-10  # the bound's table rounded up: covers its float32 storage and the graph's float32 product
# MatMulNBits' settings as the certified graph calls it, and so as the probe does
KERNEL: dict[str, Any] = {"bits": 8, "block_size": BLOCK, "accuracy_level": 4}
PROBE_ROWS = (1, 2, 16)  # activation rows per probe call: the kernel may take another path for one row than many
PROBE_COLUMNS = 1024


def quantize_blocks(weight: np.ndarray) -> dict[str, np.ndarray]:
    """[V, H] -> MatMulNBits' 8-bit tables (asymmetric per block of 32: q = round(w / s + z), w~ = (q - z) s) and the
    bound's table [V, 2 H / 32]: per block, the largest |w - w~| plus the float32 summation term (`ROUNDING` H
    max|w|), then half the L1 norm of the dequantized block; and its largest value per column [2 H / 32]. Both are
    rounded up (`SLACK`): the float32 table and the graph's float32 product with it never undercut the bound."""
    w = np.asarray(weight, np.float64)
    V, H = w.shape
    blocks = w.reshape(V, H // BLOCK, BLOCK)
    lo = np.minimum(blocks.min(2, keepdims=True), 0.0)
    hi = np.maximum(blocks.max(2, keepdims=True), 0.0)
    scale = ((hi - lo) / 255.0).astype(np.float32).astype(np.float64)  # as stored: the kernel multiplies by it
    scale = np.where(scale > 0, scale, 1.0)
    zero = np.clip(np.round(-lo / scale), 0, 255)
    q = np.clip(np.round(blocks / scale + zero), 0, 255)
    deq = (q - zero) * scale
    per_weight = np.abs(blocks - deq).max(2) + ROUNDING * H * np.abs(blocks).max(2)  # [V, H / 32]
    per_step = np.abs(deq).sum(2) / 2.0  # half an activation step (max|h_b| / 127) times ||w~_vb||_1
    table = np.concatenate([per_weight, per_step], 1) * SLACK  # [V, 2 H / 32]
    return {
        "q": q.astype(np.uint8),  # [V, H / 32, 32]
        "scales": scale.reshape(-1).astype(np.float32),  # [V * H / 32]
        "zero_points": zero.reshape(-1).astype(np.uint8),  # [V * H / 32]
        "bound": table.astype(np.float32),
        "bound_max": table.max(0).astype(np.float32),  # [2 H / 32]
    }


def bound_of(h: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The bound [N, V] on |h.w_v - the kernel's score| for activations h [N, H] and the bound's table [V, 2 H / 32]."""
    blocks = np.abs(np.asarray(h, np.float64)).reshape(h.shape[0], -1, BLOCK)
    coef = np.concatenate([blocks.sum(2), blocks.max(2) / 127.0], 1)  # [N, 2 H / 32]
    return coef @ np.asarray(table, np.float64).T


_CHECKED: dict[int, str | None] = {}  # hidden size -> this process's check (None: within the bound)


def check_kernel(hidden_size: int, options: Any = None, *, tighten: float = 1.0) -> str | None:
    """Whether this machine's MatMulNBits (8 bits, level 4) stays within the certified head's bound for `hidden_size`
    (module docstring): None, or why not in one line. Run once per process and size (`tighten` != 1: a check against
    a bound that many times tighter, never cached: what tests use to see it fail)."""
    if tighten == 1.0 and hidden_size in _CHECKED:
        return _CHECKED[hidden_size]
    rng = np.random.default_rng(20261204)
    H, N = hidden_size, PROBE_COLUMNS
    # weights of mixed scales per row, a few large entries; activations with outlier rows and dimensions
    w = rng.standard_normal((N, H)) * np.exp(rng.normal(-3.0, 1.0, (N, 1)))
    w[rng.random((N, H)) < 0.002] *= 20.0
    w = w.astype(np.float32)
    tables = quantize_blocks(w)
    worst = 0.0
    try:
        session = _probe_session(tables, H, N, options)
        for rows in PROBE_ROWS:
            h = rng.standard_normal((rows, H)) * np.exp(rng.normal(0.0, 1.0, (1, H)))
            h[:, rng.integers(0, H, 3)] *= 40.0
            h[0, :BLOCK] = 0.0  # a block of zeros: the kernel's scale 0
            h = h.astype(np.float32)
            got = session.run(None, {"a": h})[0].astype(np.float64)
            exact = h.astype(np.float64) @ w.astype(np.float64).T
            ratio = np.abs(got - exact) / (bound_of(h, tables["bound"]) / tighten)
            worst = max(worst, float(np.nanmax(ratio)))
    except Exception as exc:  # ORT's own pybind errors: a kernel this build cannot run is a failed check
        why: str | None = (
            f"its 8-bit kernel did not run ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        )
    else:
        why = None if worst <= 1.0 else f"its 8-bit kernel's error reached {worst:.2f}x the certified head's bound"
    if tighten == 1.0:
        _CHECKED[hidden_size] = why
    return why


def _probe_session(tables: dict[str, np.ndarray], H: int, N: int, options: Any) -> Any:
    """One MatMulNBits node as the certified head calls it: a [m, H] -> [m, N] over the 8-bit `tables`."""
    from onnx import TensorProto, helper, numpy_helper

    from eectl.runtime.ort import _ort

    node = helper.make_node(
        "MatMulNBits",
        ["a", "q", "scales", "zero_points"],
        ["y"],
        domain="com.microsoft",
        K=H,
        N=N,
        **KERNEL,
    )
    graph = helper.make_graph(
        [node],
        "certified_bound_probe",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["m", H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", N])],
        [numpy_helper.from_array(tables[k], k) for k in ("q", "scales", "zero_points")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return _ort().InferenceSession(model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"])
