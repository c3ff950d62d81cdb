"""Whether a padded artifact's segments pad every MatMul's rows or attention only, on this CPU (export/graphs.py
`_RowPad`, manifest `kv.pad_switch`).

ONNX Runtime's MatMulNBits computes one row with another kernel than several at accuracy level 4 on AVX2 CPUs (not
on AVX-512 ones) and at level 0 on every CPU; where it does, a one-row call's wide pass is exact only with every
MatMul's rows padded; where it does not, padding attention only is enough and cheaper. `one_row_as_two` asks this
CPU's kernels once per process on a small graph of the artifact's MatMul kind; `rows_padded` decides for a runtime
(runtime/sessions.py sets the graphs' switch from it). What this module does not do: check an artifact's wide passes
(runtime/wide_check.py).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from eectl.errors import UsageError

if TYPE_CHECKING:
    from eectl.contracts.manifest import Manifest


# auto (the default): pad rows only where this CPU needs it (`one_row_as_two`); 1: always; 0: attention only
PAD_ROWS_ENV = "EECTL_PAD_ROWS"
_ONE_ROW: dict[tuple[Any, ...], bool] = {}
# GGUF tensor types held as 8-bit MatMulNBits, and their block size (models/gguf_blocks.py)
EIGHT_BIT_BLOCKS = {"Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q6_K": 16}  # (kind, settings) -> this process's verdict


def one_row_as_two(m: Manifest) -> bool:
    """Whether this CPU's kernels compute a one-row call of the artifact's segment MatMuls bit for bit as the same row
    in a call of two rows: MatMulNBits with the artifact's bits, block size, zero points and accuracy level (int4
    segments and a quantized final LM head; on AVX2 CPUs not at level 4, on AVX-512 ones yes, at level 0 not
    anywhere), and fp32/fp16 MatMul (its layers kept, or every layer). Checked once per process on a small graph of
    the artifact's input width (a few ms); where it holds, padded segments need pad attention only (export/graphs.py
    `_RowPad`) and a padded quantized head no zero row (export/quantize.py `quantize_lm_head`)."""
    q = m.quantization
    width = int(m.dims["hidden_size"])
    kinds: list[tuple[Any, ...]] = [("matmul", m.dtype, width)]
    if q is not None and q.scope == "segments":
        kinds.append(("nbits", q.bits, q.block_size, q.symmetric, q.accuracy_level, width))
        # a GGUF's own blocks hold its 5-, 6- and 8-bit tensors as 8-bit MatMulNBits (models/gguf_blocks.py)
        for name in q.gguf_types or {}:
            if name in EIGHT_BIT_BLOCKS:
                kinds.append(("nbits", 8, EIGHT_BIT_BLOCKS[name], False, q.accuracy_level, width))
        if q.lm_head in ("int4", "int8"):  # the final head's own table (export/quantize.py quantize_lm_head)
            kinds.append(("nbits", 8 if q.lm_head == "int8" else 4, q.block_size, q.symmetric, q.accuracy_level, width))
    for kind in kinds:
        if kind not in _ONE_ROW:
            _ONE_ROW[kind] = _probe(kind)
    return all(_ONE_ROW[k] for k in kinds)


def _probe(kind: tuple[Any, ...]) -> bool:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from eectl.runtime.ort import _ort, session_options

    rng = np.random.default_rng(0)
    n = 64
    if kind[0] == "matmul":
        _, dtype, k = kind
        np_dtype, elem = (np.float16, TensorProto.FLOAT16) if dtype == "fp16" else (np.float32, TensorProto.FLOAT)
        inits = [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np_dtype), "b")]
        node = helper.make_node("MatMul", ["a", "b"], ["y"])
    else:
        _, bits, block, symmetric, level, k = kind
        np_dtype, elem = np.float32, TensorProto.FLOAT
        blocks = -(-k // block)
        packed = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
        scales = (rng.random(n * blocks, dtype=np.float32) * 0.02).astype(np.float32)
        inits = [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")]
        inputs = ["a", "b", "s"]
        if not symmetric:
            per_byte = 8 // bits
            inits.append(numpy_helper.from_array(rng.integers(0, 256, n * -(-blocks // per_byte), dtype=np.uint8), "z"))
            inputs.append("z")
        node = helper.make_node(
            "MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=block,
            accuracy_level=level,
        )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "one_row",
        [helper.make_tensor_value_info("a", elem, ["m", k])],
        [helper.make_tensor_value_info("y", elem, ["m", n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = onnx.helper.make_model(graph, opset_imports=opsets, ir_version=10)
    session = _ort().InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])
    a = rng.standard_normal((8, k)).astype(np_dtype)
    for pair in (a[:2], a[2:4], a[4:6], a[6:8]):
        two = session.run(None, {"a": pair})[0]
        if not all(np.array_equal(session.run(None, {"a": pair[i : i + 1]})[0], two[i : i + 1]) for i in range(2)):
            return False
    return True


def rows_padded(m: Manifest, asked: bool | None = None) -> bool:
    """Whether a runtime runs this artifact's padded segments with every MatMul's rows padded (the graphs' own
    setting) or attention only: as `asked`, else (None) only where this CPU computes one row otherwise than two
    (`one_row_as_two`). False for graphs without the switch (exported before it: attention only) or unpadded."""
    if not (m.kv.pad and m.kv.pad_switch):
        return False
    if asked is None:
        env = os.environ.get(PAD_ROWS_ENV, "auto").strip().lower()
        if env not in ("auto", "0", "1"):
            raise UsageError(f"{PAD_ROWS_ENV} must be auto, 0 or 1, got '{env}'")
        asked = None if env == "auto" else env == "1"
    return asked if asked is not None else not one_row_as_two(m)
