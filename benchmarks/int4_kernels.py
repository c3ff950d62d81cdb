"""One decode-token MatMulNBits per int4 setting, on real weights of the default model: the kernel each quantizer's
output lands on, timed in ONNX Runtime, and how exactly it reproduces the weights.

    flock /tmp/eectl-bench.lock python benchmarks/int4_kernels.py --threads 2

Why: the default model's weights are a Q4_1 GGUF (blocks of 32 input channels, a float scale and a float minimum).
ORT's round-to-nearest quantizer (integer zero points) cannot land on that grid and rounds every block a second
time; HQQ (float zero points) lands on it exactly, but its graphs run far slower. This prints, per setting, the
share of weights reproduced exactly, the relative weight error, and the median ms of one [1, K] x [K, N] call
(interleaved rounds, after a warm-up), for the layer shapes of a decoder block.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eectl.export.quantize import Int4Options, quantize_graph
from eectl.models import load_model
from eectl.runtime.ort import _ort, session_options


def _graph(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "B"], ["y"], name="B.matmul")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        [numpy_helper.from_array(np.ascontiguousarray(w), "B")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layer", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    adapter = load_model(args.model).adapter
    ort = _ort()
    so = session_options(args.threads)
    layer = adapter.layer_weights(args.layer)
    shapes = {"q": layer.q, "k": layer.k, "gate": layer.gate, "down": layer.down}  # [out, in] each
    settings = {
        "fp32": None,
        "rtn, accuracy 4": Int4Options(algorithm="rtn", accuracy_level=4),
        "rtn, accuracy 0": Int4Options(algorithm="rtn", accuracy_level=0),
        "hqq, accuracy 4": Int4Options(algorithm="hqq", accuracy_level=4),
        "hqq, accuracy 0": Int4Options(algorithm="hqq", accuracy_level=0),
    }
    print("| weight [K, N] | setting | ms per call (median) | vs fp32 | exact weights | relative error |")
    print("|---|---|---|---|---|---|")
    for name, t in shapes.items():
        w = t.detach().float().numpy().T  # [K, N]: y = x @ w
        k = w.shape[0]
        sessions, stats = {}, {}
        for label, opts in settings.items():
            m = _graph(w) if opts is None else quantize_graph(_graph(w), opts)
            s = ort.InferenceSession(m.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])
            deq = s.run(None, {"x": np.eye(k, dtype=np.float32)})[0]
            err = deq - w
            stats[label] = (
                float(np.mean(np.abs(err) <= 1e-6 * np.abs(w).max())),
                float(np.linalg.norm(err) / np.linalg.norm(w)),
            )
            sessions[label] = s
        x = np.random.default_rng(0).standard_normal((1, k)).astype(np.float32)
        times: dict[str, list[float]] = {label: [] for label in sessions}
        for _ in range(10):
            for s in sessions.values():
                s.run(None, {"x": x})
        for _ in range(args.calls):
            for label, s in sessions.items():
                t0 = time.perf_counter()
                s.run(None, {"x": x})
                times[label].append(time.perf_counter() - t0)
        base = statistics.median(times["fp32"])
        for label in sessions:
            ms = statistics.median(times[label])
            exact, rel = stats[label]
            print(
                f"| {name} {list(w.shape)} | {label} | {1000 * ms:.3f} | {base / ms:.2f}x | {exact:.1%} | {rel:.4f} |"
            )


if __name__ == "__main__":
    main()
