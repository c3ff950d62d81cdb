"""What one decode step's products cost by the rows they multiply: fp32 MatMul against ONNX Runtime's MatMulNBits.

    flock /tmp/eectl-heavy.lock .venv/bin/python benchmarks/matmulnbits_rows.py --threads 2 --rows 1,2,4,8,16

Why (issue 67): a server batching R requests runs each layer's products on R rows. fp32 MatMul streams its weights
once for all rows, so R rows cost far less than R times one row; if a kernel's time grows with R nearly linearly, a
batch of R buys little throughput, whatever the runtime around it does. This times, per weight shape [K, N] and per
kind (fp32 MatMul; MatMulNBits at each accuracy level; MatMulNBits plus the Q4_1 min term that eectl adds beside it
for a GGUF's own blocks, export/quantize.py `_nbits_nodes`), one product of an [R, K] input at each row count R,
and prints:

- per shape and kind, the median microseconds per product at each R and its ratio to the kind's own 1-row time;
- per R, a layer's products summed (each shape as often as a layer holds it) and "throughput at R rows / at 1 row"
  = R * T(1) / T(R): the most a batched decode step's products let batching of R rows gain over one row.

How: each graph holds `--graph-mib` MiB of distinct random weights (as many independent products as that takes, all
reading one input), read from memory as a step's 30 layers read theirs (the other graphs run between two runs of
one evict it from the L3 cache; about a minute at the defaults on 2 cores); per call time = a run's time / its
products. Every session is made with eectl's own `session_options` (one global pool of --threads intra-op threads,
`use_per_session_threads = False`, all graph optimizations); the kinds and row counts alternate within each
repetition (every kind at every row count once, in a new seeded order each repetition), so a burst of other load
falls on all of them alike; after a warm-up; medians over `--reps`.
The values are random (timing only): 4-bit weights and uint8 zero points packed as MatMulNBits takes them, blocks of
32 unless an artifact says otherwise.

`--artifact ART` reads the shapes from the artifact's segment graphs instead: every MatMulNBits node's K, N, bits and
block size, how many a layer holds, and whether a min term (Reshape -> ReduceSum -> MatMul) reads its input.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from eectl.runtime.ort import _ort, session_options

MIN_BLOCK = 32  # the min term's block (models/gguf_blocks.py MIN_BLOCK)
# the default model's per-layer products (K x N): q/k/v together, o, gate+up together, down
DEFAULT_SHAPES = "576x960,576x576,576x3072,1536x576"
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16")


@dataclass(frozen=True)
class Shape:
    k: int
    n: int
    per_layer: float = 1.0  # how many products of this shape a layer holds
    bits: int = 4
    block: int = 32
    min_term: bool = True  # a min term beside it (the "+ min" kinds are timed only where True)

    @property
    def label(self) -> str:
        extra = "" if (self.bits, self.block) == (4, 32) else f", {self.bits} bits, block {self.block}"
        times = "" if self.per_layer == 1 else f", x{self.per_layer:g} a layer"
        return f"{self.k} x {self.n}{extra}{times}"


@dataclass(frozen=True)
class Kind:
    level: int | None  # None: fp32 MatMul; else MatMulNBits' accuracy_level
    min_term: bool = False

    @property
    def label(self) -> str:
        if self.level is None:
            return "fp32 MatMul"
        return f"MatMulNBits level {self.level}" + (" + min term" if self.min_term else "")


def _nbits(i: int, s: Shape, kind: Kind, rng: np.random.Generator) -> tuple[list, list]:
    """One MatMulNBits product of x (plus the min term, as export/quantize.py builds it): nodes and initializers."""
    blocks = s.k // s.block
    stem = f"w{i}"
    inits = [
        numpy_helper.from_array(rng.integers(0, 256, (s.n, blocks, s.block * s.bits // 8), dtype=np.uint8), stem),
        numpy_helper.from_array((rng.random(s.n * blocks, dtype=np.float32) + 0.5) * 0.01, f"{stem}.scales"),
        numpy_helper.from_array(
            rng.integers(0, 256, s.n * math.ceil(blocks * s.bits / 8), dtype=np.uint8), f"{stem}.zp"
        ),
    ]
    out = f"y{i}" if not kind.min_term else f"{stem}.y"
    attrs = dict(K=s.k, N=s.n, bits=s.bits, block_size=s.block, accuracy_level=kind.level)
    ins = ["x", stem, f"{stem}.scales", f"{stem}.zp"]
    nodes = [helper.make_node("MatMulNBits", ins, [out], domain="com.microsoft", **attrs)]
    if kind.min_term:
        mins = (rng.random((s.k // MIN_BLOCK, s.n), dtype=np.float32) - 0.5) * 0.01
        inits.append(numpy_helper.from_array(mins, f"{stem}.mins"))
        nodes += [
            helper.make_node("Reshape", ["x", "blocks"], [f"{stem}.xb"]),  # [R, K/32, 32]
            helper.make_node("ReduceSum", [f"{stem}.xb", "last_axis"], [f"{stem}.xs"], keepdims=0),  # [R, K/32]
            helper.make_node("MatMul", [f"{stem}.xs", f"{stem}.mins"], [f"{stem}.ym"]),  # [R, N]
            helper.make_node("Add", [out, f"{stem}.ym"], [f"y{i}"]),
        ]
    return nodes, inits


def _node_bytes(s: Shape, kind: Kind) -> int:
    if kind.level is None:
        return 4 * s.k * s.n
    blocks = s.k // s.block
    size = s.n * blocks * (s.block * s.bits // 8 + 4) + s.n * math.ceil(blocks * s.bits / 8)
    return size + (4 * (s.k // MIN_BLOCK) * s.n if kind.min_term else 0)


def build(s: Shape, kind: Kind, graph_mib: float, rng: np.random.Generator) -> tuple[onnx.ModelProto, int]:
    """A graph of independent products of one input x [R, K], holding at least `graph_mib` MiB of weights."""
    count = max(2, math.ceil(graph_mib * 2**20 / _node_bytes(s, kind)))
    nodes, inits = [], []
    for i in range(count):
        if kind.level is None:
            w = rng.standard_normal((s.k, s.n), dtype=np.float32) * 0.05
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            nodes.append(helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"]))
        else:
            made, weights = _nbits(i, s, kind, rng)
            nodes += made
            inits += weights
    if kind.min_term:
        inits += [
            numpy_helper.from_array(np.array([0, s.k // MIN_BLOCK, MIN_BLOCK], np.int64), "blocks"),
            numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
        ]
    g = helper.make_graph(
        nodes,
        "products",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["R", s.k])],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["R", s.n]) for i in range(count)],
        inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(g, opset_imports=opsets, ir_version=10), count  # ORT 1.31 refuses ir_version 14


def artifact_shapes(folder: Path) -> list[Shape]:
    """Every distinct MatMulNBits product in an artifact's segment graphs, with how many a decoder layer holds."""
    from eectl.contracts.manifest import read_manifest

    manifest = read_manifest(folder, verify_hashes=False)
    layers = sum(hi - lo for lo, hi in (seg.layers for seg in manifest.segments))
    found: Counter[Shape] = Counter()
    for seg in manifest.segments:
        g = onnx.load(str(folder / seg.graph.file), load_external_data=False).graph
        consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in g.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)
        for node in g.node:
            if node.op_type != "MatMulNBits":
                continue
            a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
            reshapes = [c for c in consumers.get(node.input[0], []) if c.op_type == "Reshape"]
            has_min = any(c.op_type == "ReduceSum" for r in reshapes for c in consumers.get(r.output[0], []))
            found[Shape(a["K"], a["N"], 1.0, a["bits"], a["block_size"], has_min)] += 1
    if not found:
        raise SystemExit(f"{folder}: no MatMulNBits node in its segment graphs")
    return [Shape(s.k, s.n, n / layers, s.bits, s.block, s.min_term) for s, n in found.items()]


def time_shape(s: Shape, kinds: list[Kind], rows: list[int], args: argparse.Namespace) -> dict[Kind, list[float]]:
    """Median microseconds per product of each kind at each row count: every row count and kind once a repetition."""
    ort = _ort()
    rng = np.random.default_rng(0)
    sessions, counts = {}, {}
    for kind in kinds:
        model, counts[kind] = build(s, kind, args.graph_mib, rng)
        sessions[kind] = ort.InferenceSession(
            model.SerializeToString(), session_options(args.threads), providers=["CPUExecutionProvider"]
        )
        del model
    feeds = {r: {"x": rng.standard_normal((r, s.k), dtype=np.float32)} for r in rows}
    cells = [(r, kind) for r in rows for kind in kinds]
    for r, kind in cells:
        for _ in range(args.warmup):
            sessions[kind].run(None, feeds[r])
    times: dict[tuple[int, Kind], list[float]] = {cell: [] for cell in cells}
    order = np.random.default_rng(1)
    for _ in range(args.reps):  # every (rows, kind) once a repetition, in a new order each time
        for j in order.permutation(len(cells)):
            r, kind = cells[j]
            t0 = time.perf_counter()
            sessions[kind].run(None, feeds[r])
            times[r, kind].append((time.perf_counter() - t0) / counts[kind] * 1e6)
    return {kind: [statistics.median(times[r, kind]) for r in rows] for kind in kinds}


def cpu_line() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU: /proc/cpuinfo unreadable"
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    return f"CPU: {model}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in FLAGS)


def _layer_time(kind: Kind, shapes: list[Shape], res: dict[Shape, dict[Kind, list[float]]], i: int) -> float:
    """A layer's products of `kind` at the i-th row count; a "+ min" kind takes its plain time where there is none."""
    total = 0.0
    for s in shapes:
        k = kind if (not kind.min_term or s.min_term) else Kind(kind.level)
        total += s.per_layer * res[s][k][i]
    return total


def report(shapes: list[Shape], kinds: list[Kind], rows: list[int], res: dict[Shape, dict[Kind, list[float]]]) -> None:
    head = " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows)
    rule = "|---" * (len(rows) + 2) + "|"
    print("\nMedian us per product (its time against its own 1-row time):\n")
    print(f"| shape (K x N) | kind | {head} |\n{rule}")
    for s in shapes:
        for kind, t in res[s].items():
            cells = " | ".join(f"{v:.1f} ({v / t[0]:.2f}x)" for v in t)
            print(f"| {s.label} | {kind.label} | {cells} |")
    print("\nA layer's products summed, us (throughput at R rows / at 1 row = R * T(1) / T(R)):\n")
    print(f"| kind | {head} |\n" + "|---" * (len(rows) + 1) + "|")
    for kind in kinds:
        t = [_layer_time(kind, shapes, res, i) for i in range(len(rows))]
        cells = " | ".join(f"{v:.1f} ({r * t[0] / v:.2f}x)" for r, v in zip(rows, t, strict=True))
        print(f"| {kind.label} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime's global intra-op pool")
    ap.add_argument("--rows", default="1,2,4,8,16", help="row counts R (the first is the ratios' base)")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="K x N products of one layer, comma-separated")
    ap.add_argument("--levels", default="0,4", help="MatMulNBits accuracy levels")
    ap.add_argument("--reps", type=int, default=40, help="repetitions (each kind at each row count once in each)")
    ap.add_argument("--warmup", type=int, default=2, help="runs of each graph before a row count's repetitions")
    ap.add_argument("--graph-mib", type=float, default=64.0, help="MiB of distinct weights per timed graph")
    ap.add_argument("--min-term", action=argparse.BooleanOptionalAction, default=True, help="time the + min kinds")
    ap.add_argument("--artifact", type=Path, default=None, help="read the shapes from this artifact instead")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.artifact is not None:
        shapes = artifact_shapes(args.artifact)
    else:
        shapes = [Shape(*(int(v) for v in kn.lower().split("x"))) for kn in args.shapes.split(",")]
    if not args.min_term:
        shapes = [Shape(s.k, s.n, s.per_layer, s.bits, s.block, False) for s in shapes]
    levels = [int(v) for v in args.levels.split(",")]
    kinds = [Kind(None), *(Kind(v) for v in levels)]
    if any(s.min_term for s in shapes):
        kinds += [Kind(v, True) for v in levels]
    print(f"ONNX Runtime {_ort().__version__}; {cpu_line()}")
    print(f"threads {args.threads}; reps {args.reps}; graphs of >= {args.graph_mib:g} MiB of weights; rows {rows}")
    t0 = time.perf_counter()
    res = {}
    for s in shapes:
        wanted = [k for k in kinds if not k.min_term or s.min_term]
        res[s] = time_shape(s, wanted, rows, args)
    report(shapes, kinds, rows, res)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
