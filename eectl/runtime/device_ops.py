"""The device pieces of the binding plan (runtime/binding.py): tiny ONNX graphs run on the artifact's provider.

Between the exported graphs, the runner needs a few small operations on values that, on the CUDA EP, must stay on
the device: the last position of a segment's output (`last`, per row: a padded batch's rows end at different
positions), deferred positions joined in front of a segment's input (`concat`), the full vocabulary's log-sum-exp
(`logsumexp`: p1 = exp(l1 - lse), one scalar per row to the host) and the transition cosines (`cosine`,
`cosine_min`: one scalar per row to the host). Each is a graph of a few standard ops built in memory and run
through ONNX Runtime with IO binding on the same provider and thread pool as the artifact, so the same code runs
on the CPU EP (where tests check it against the torch code calibrate uses) and on the CUDA EP (inputs and
outputs as device OrtValues, only the scalars copied out).

Values in and out are numpy arrays (host) or OrtValues (any device); `on_device=True` keeps an output on the
provider's device. The cosines are computed in float32 (fp16 inputs are cast first), as eectl.exits.signals does.

What this module does not do: decide anything (runner.py), or run the exported graphs (sessions.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from eectl.runtime.ort import PROVIDERS, DeviceView, _ort, session_options

EPS = 1e-8  # torch.nn.functional.cosine_similarity's floor on each norm


def _tensor_type(dtype: Any) -> int:
    types = {np.dtype(np.float16): TensorProto.FLOAT16, np.dtype(np.int64): TensorProto.INT64}
    return types.get(np.dtype(dtype), TensorProto.FLOAT)


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any], inits: list[Any] | None = None) -> Any:
    graph = helper.make_graph(nodes, "eectl_device_op", inputs, outputs, initializer=inits or [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _const(name: str, values: list[int]) -> Any:
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def last_graph(dtype: Any) -> Any:
    """hidden [N, S, H], positions [N] int64 -> hidden[n, positions[n]] as [N, H]."""
    t = _tensor_type(dtype)
    nodes = [
        helper.make_node("Shape", ["hidden"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["s"], axis=0),
        helper.make_node("Range", ["zero", "n", "one"], ["rows"]),
        helper.make_node("Mul", ["rows", "s"], ["starts"]),
        helper.make_node("Add", ["starts", "positions"], ["flat_index"]),
        helper.make_node("Flatten", ["hidden"], ["flat"], axis=2),  # [N * S, H]
        helper.make_node("Gather", ["flat", "flat_index"], ["hidden_out"], axis=0),
    ]
    inits = [helper.make_tensor(name, TensorProto.INT64, [], [v]) for name, v in (("zero", 0), ("one", 1))]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("hidden", t, ["N", "S", "H"]),
            helper.make_tensor_value_info("positions", TensorProto.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("hidden_out", t, ["N", "H"])],
        inits,
    )


def concat_graph(dtype: Any) -> Any:
    """pending [N, P, H], hidden [N, S, H] -> [N, P + S, H] (the deferred positions in front)."""
    t = _tensor_type(dtype)
    return _model(
        [helper.make_node("Concat", ["pending", "hidden"], ["hidden_out"], axis=1)],
        [
            helper.make_tensor_value_info("pending", t, ["N", "P", "H"]),
            helper.make_tensor_value_info("hidden", t, ["N", "S", "H"]),
        ],
        [helper.make_tensor_value_info("hidden_out", t, ["N", "T", "H"])],
    )


def logsumexp_graph(dtype: Any) -> Any:
    """logits [N, V] -> log(sum(exp(logits))) [N] float32."""
    t = _tensor_type(dtype)
    return _model(
        [
            helper.make_node("Cast", ["logits"], ["x"], to=TensorProto.FLOAT),
            helper.make_node("ReduceLogSumExp", ["x", "axis"], ["logsumexp"], keepdims=0),
        ],
        [helper.make_tensor_value_info("logits", t, ["N", "V"])],
        [helper.make_tensor_value_info("logsumexp", TensorProto.FLOAT, ["N"])],
        [_const("axis", [-1])],
    )


def _cosine_nodes(a: str, b: str, out: str) -> list[Any]:
    """cos = a.b / (max(|a|, eps) max(|b|, eps)) over the last axis, float32 (a and b already float32)."""
    return [
        helper.make_node("Mul", [a, b], [f"{out}_ab"]),
        helper.make_node("ReduceSum", [f"{out}_ab", "axis"], [f"{out}_dot"], keepdims=0),
        helper.make_node("ReduceL2", [a, "axis"], [f"{out}_na"], keepdims=0),
        helper.make_node("ReduceL2", [b, "axis"], [f"{out}_nb"], keepdims=0),
        helper.make_node("Max", [f"{out}_na", "eps"], [f"{out}_ca"]),
        helper.make_node("Max", [f"{out}_nb", "eps"], [f"{out}_cb"]),
        helper.make_node("Mul", [f"{out}_ca", f"{out}_cb"], [f"{out}_den"]),
        helper.make_node("Div", [f"{out}_dot", f"{out}_den"], [out]),
    ]


def cosine_graph(dtype: Any) -> Any:
    """layer_input [N, H], hidden_out [N, H] -> their cosine [N] float32 (the transition cosine)."""
    t = _tensor_type(dtype)
    nodes = [
        helper.make_node("Cast", ["layer_input"], ["a"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["hidden_out"], ["b"], to=TensorProto.FLOAT),
        *_cosine_nodes("a", "b", "cosine"),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("layer_input", t, ["N", "H"]),
            helper.make_tensor_value_info("hidden_out", t, ["N", "H"]),
        ],
        [helper.make_tensor_value_info("cosine", TensorProto.FLOAT, ["N"])],
        [_const("axis", [-1]), helper.make_tensor("eps", TensorProto.FLOAT, [], [EPS])],
    )


def cosine_min_graph(dtype: Any) -> Any:
    """layer_states [N, n + 1, H] (a segment's block boundaries) -> the minimum transition cosine [N] float32."""
    t = _tensor_type(dtype)
    nodes = [
        helper.make_node("Cast", ["layer_states"], ["x"], to=TensorProto.FLOAT),
        helper.make_node("Slice", ["x", "zero", "minus_one", "one"], ["a"]),  # blocks [0, n)
        helper.make_node("Slice", ["x", "one_start", "big", "one"], ["b"]),  # blocks [1, n + 1)
        *_cosine_nodes("a", "b", "cosines"),  # [N, n]
        helper.make_node("ReduceMin", ["cosines", "one"], ["cosine"], keepdims=0),
    ]
    inits = [
        _const("axis", [-1]),
        helper.make_tensor("eps", TensorProto.FLOAT, [], [EPS]),
        _const("zero", [0]),
        _const("minus_one", [-1]),
        _const("one", [1]),
        _const("one_start", [1]),
        _const("big", [np.iinfo(np.int64).max]),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("layer_states", t, ["N", "B", "H"])],
        [helper.make_tensor_value_info("cosine", TensorProto.FLOAT, ["N"])],
        inits,
    )


def join_graph(dtype: Any, n: int, axis: int, rank: int) -> Any:
    """x0 .. x{n-1} (each of `rank` axes) -> their concatenation along `axis` (rows of a batch, or a row's
    positions)."""
    t = _tensor_type(dtype)
    names = [f"x{i}" for i in range(n)]
    return _model(
        [helper.make_node("Concat", names, ["joined"], axis=axis)],
        [helper.make_tensor_value_info(x, t, [f"{x}_{d}" for d in range(rank)]) for x in names],
        [helper.make_tensor_value_info("joined", t, [f"j_{d}" for d in range(rank)])],
    )


def identity_graph(dtype: Any) -> Any:
    """x [N] -> y, the same values: a copy on the device (into a bound buffer, or a new one; any shape, flattened)."""
    t = _tensor_type(dtype)
    return _model(
        [helper.make_node("Identity", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", t, ["N"])],
        [helper.make_tensor_value_info("y", t, ["N"])],
    )


BUILDERS = {
    "identity": identity_graph,
    "last": last_graph,
    "concat": concat_graph,
    "logsumexp": logsumexp_graph,
    "cosine": cosine_graph,
    "cosine_min": cosine_min_graph,
}


class DeviceOps:
    """The pieces above as sessions on one provider (created on first use), called with IO binding."""

    def __init__(self, provider: str, dtype: Any, threads: int | None = None) -> None:
        ep = PROVIDERS[provider]
        self.device = ep.device
        self.providers = list(ep.ort_providers)
        self.dtype = np.dtype(dtype)
        self.threads = threads
        self._sessions: dict[str, Any] = {}

    def session(self, op: str) -> Any:
        sess = self._sessions.get(op)
        if sess is None:
            if op.startswith("join"):  # join<n>_<axis>_<rank>[_int64]: one graph per arity (and element type)
                n, axis, rank = (int(v) for v in op[4:].split("_")[:3])
                model = join_graph(np.int64 if op.endswith("_int64") else self.dtype, n, axis, rank)
            else:
                model = BUILDERS[op](self.dtype)
            onnx.checker.check_model(model)
            sess = _ort().InferenceSession(
                model.SerializeToString(), sess_options=session_options(self.threads), providers=self.providers
            )
            self._sessions[op] = sess
        return sess

    def run(
        self, op: str, inputs: dict[str, Any], output: str, on_device: bool = False, into: DeviceView | None = None
    ) -> Any:
        """Run `op` on inputs (numpy arrays or OrtValues); the output as an OrtValue on the provider's device
        (`on_device`) or a numpy array (copied to the host: only the scalars per row should be), or written into the
        device memory `into` (returned)."""
        sess = self.session(op)
        io = sess.io_binding()
        for name, value in inputs.items():
            if isinstance(value, np.ndarray):
                io.bind_cpu_input(name, np.ascontiguousarray(value))
            elif isinstance(value, DeviceView):
                io.bind_input(name, value.device, 0, value.dtype, list(value.shape), value.ptr)
            else:
                io.bind_ortvalue_input(name, value)
        if into is not None:
            io.bind_output(output, into.device, 0, into.dtype, list(into.shape), into.ptr)
            sess.run_with_iobinding(io)
            return into
        io.bind_output(output, self.device if on_device else "cpu")
        sess.run_with_iobinding(io)
        out = io.get_outputs()[0]
        return out if on_device else out.numpy()

    def join(self, parts: list[Any], axis: int, into: DeviceView | None = None) -> DeviceView:
        """Values (DeviceViews, OrtValues or host arrays) concatenated along `axis`, on the device (written into
        `into` where given)."""
        inputs = {f"x{i}": p for i, p in enumerate(parts)}
        first = next((p for p in parts if not isinstance(p, np.ndarray)), parts[0])
        first = first if isinstance(first, DeviceView | np.ndarray) else DeviceView.of(first)
        ids = "_int64" if np.dtype(first.dtype) == np.int64 else ""  # candidate ids beside the states' floats
        op = f"join{len(parts)}_{axis}_{len(first.shape)}{ids}"
        if into is not None:
            return self.run(op, inputs, "joined", into=into)
        return DeviceView.of(self.run(op, inputs, "joined", on_device=True))

    def write(self, src: Any, into: DeviceView) -> DeviceView:
        """src (a host array or DeviceView of into's size) copied into the device memory `into`."""
        self.run("identity", {"x": src.reshape(_size(src))}, "y", into=into.reshape(_size(into)))
        return into

    def copy(self, src: DeviceView) -> DeviceView:
        """src copied into new device memory (a state kept while its buffer is rewritten), of its shape."""
        flat = DeviceView.of(self.run("identity", {"x": src.reshape(_size(src))}, "y", on_device=True))
        return flat.reshape(*src.shape)

    # --- the pieces ------------------------------------------------------------------------------------------------
    def last(self, hidden: Any, positions: np.ndarray, on_device: bool = True) -> Any:
        """hidden [N, S, H] -> [N, H]: row n's position positions[n] (its last real one)."""
        inputs = {"hidden": hidden, "positions": np.asarray(positions, np.int64)}
        return self.run("last", inputs, "hidden_out", on_device)

    def concat(self, pending: Any, hidden: Any, on_device: bool = True) -> Any:
        return self.run("concat", {"pending": pending, "hidden": hidden}, "hidden_out", on_device)

    def logsumexp(self, logits: Any) -> np.ndarray:
        return self.run("logsumexp", {"logits": logits}, "logsumexp")

    def cosine(self, layer_input: Any, hidden: Any) -> np.ndarray:
        return self.run("cosine", {"layer_input": layer_input, "hidden_out": hidden}, "cosine")

    def cosine_min(self, layer_states: Any) -> np.ndarray:
        return self.run("cosine_min", {"layer_states": layer_states}, "cosine")


def _size(x: Any) -> int:
    return int(np.prod(x.shape))


def concat(rt: Any, parts: list[Any], axis: int) -> Any:
    """np.concatenate for the runner's states, host arrays or device-resident ones (then joined on the device by
    the artifact runtime's `ops`; nothing is copied through the host)."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=axis)
    if len(parts) == 1:
        return parts[0]
    return rt.ops.join(parts, axis)


def stack(rt: Any, parts: list[Any]) -> Any:
    """np.stack (a new first axis) for host arrays or device-resident states."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.stack(parts)
    return concat(rt, [p.reshape(1, *p.shape) for p in parts], 0)
