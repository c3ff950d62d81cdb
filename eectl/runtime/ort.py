"""ONNX Runtime itself: the import, thread settings, the registry of execution providers, one session (`Graph`)
and a device-resident tensor (`DeviceView`).

What this module does not do: know artifacts (sessions.py) or KV buffers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eectl.contracts.manifest import Axis, GraphIO
from eectl.errors import ArtifactError, UsageError

_THREADS: int | None = None


def _ort() -> Any:
    import onnxruntime as ort

    return ort


def init_ort(threads: int | None = None) -> int:
    """Create ORT's environment once, with one global intra-op pool of `threads` shared by every session.

    Measured on 2 cores: per-session pools fighting over the cores cost several times more per token than one
    shared pool (see the export issue notes). Later calls must ask for the same size.
    """
    global _THREADS
    n = threads or os.cpu_count() or 1
    if _THREADS is None:
        ort = _ort()
        ort.set_default_logger_severity(3)
        from onnxruntime.capi import _pybind_state as C

        C.set_global_thread_pool_sizes(n, 1)
        _THREADS = n
    elif threads is not None and threads != _THREADS:
        raise UsageError(
            f"ONNX Runtime's thread pool already has {_THREADS} threads in this process; cannot switch to {threads}"
        )
    return _THREADS


def cuda_usable() -> bool:
    """True only where the CUDA EP can actually load: a visible NVIDIA device and the EP in this build.

    Checked without creating a CUDA session, so machines without a GPU never see the EP's library-load errors.
    """
    if "CUDAExecutionProvider" not in _ort().get_available_providers():
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg"))


@dataclass(frozen=True)
class ExecutionProvider:
    """An ONNX Runtime execution provider as `--provider` names it. To add one (e.g. TensorRT, DirectML): one
    `register_provider(...)` entry below; buffers on a non-CPU device are bound as OrtValues on `device`."""

    name: str
    ort_providers: tuple[str, ...]  # handed to InferenceSession, in preference order
    device: str  # where bound inputs and KV buffers live: "cpu", or an OrtValue device name ("cuda")
    usable: Callable[[], bool]  # checked without creating a session
    auto_dtypes: tuple[str, ...] = ()  # artifact dtypes `--provider auto` picks it for


PROVIDERS: dict[str, ExecutionProvider] = {}


def register_provider(provider: ExecutionProvider) -> ExecutionProvider:
    PROVIDERS[provider.name] = provider
    return provider


register_provider(ExecutionProvider("cpu", ("CPUExecutionProvider",), "cpu", lambda: True))


register_provider(
    ExecutionProvider("cuda", ("CUDAExecutionProvider", "CPUExecutionProvider"), "cuda", cuda_usable, ("fp16",))
)


def resolve_provider(requested: str, dtype: str) -> str:
    """auto -> the first registered provider that is usable and meant for this dtype (cuda for fp16 artifacts where
    CUDA is usable), else cpu. An explicit provider that cannot load here is an error."""
    if requested == "auto":
        return next((p.name for p in PROVIDERS.values() if dtype in p.auto_dtypes and p.usable()), "cpu")
    if requested not in PROVIDERS:
        raise UsageError(f"--provider must be auto or one of {', '.join(PROVIDERS)}, got '{requested}'")
    provider = PROVIDERS[requested]
    if not provider.usable():
        raise UsageError(
            f"the {provider.ort_providers[0]} execution provider is not available on this machine",
            hint="use --provider cpu",
        )
    return requested


def session_options(threads: int | None = None) -> Any:
    ort = _ort()
    init_ort(threads)
    so = ort.SessionOptions()
    so.use_per_session_threads = False  # the process-wide pool from init_ort
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


# the graph io keys that carry states (hidden states, K/V) in the artifact's precision, and ORT's name of each
STATE_KEYS = (
    "hidden",
    "hidden_out",
    "layer_input",
    "layer_states",
    "past_key",
    "past_value",
    "present_key",
    "present_value",
)
ORT_TYPES = {"fp32": "tensor(float)", "fp16": "tensor(float16)"}


def _check_names(
    io: GraphIO, session: Any, axes: Mapping[str, list[Axis]] | None = None, dtype: str | None = None
) -> None:
    """Every input and output name the manifest gives must exist in the graph, every fixed dimension the graph
    declares where `axes` (contracts.manifest.graph_axes) expects a manifest field must equal it, and every state
    (STATE_KEYS) must be of the manifest's `dtype`: caught at load, naming the field, rather than as ONNX Runtime's
    error mid-run (the runner sizes and types its buffers from them)."""
    # inputs with a default (an initializer, e.g. an exit's decision thresholds) are listed apart by ORT
    inputs = [*session.get_inputs(), *session.get_overridable_initializers()]
    have = {"input": {i.name: i for i in inputs}, "output": {o.name: o for o in session.get_outputs()}}
    for kind, names in (("input", io.inputs), ("output", io.outputs)):
        for key, value in names.items():
            for name in [value] if isinstance(value, str) else value:
                if name not in have[kind]:
                    raise ArtifactError(f"the graph {io.file} has no {kind} named {name!r} (the manifest names it)")
                declared = getattr(have[kind][name], "type", None)
                if dtype is not None and key in STATE_KEYS and declared != ORT_TYPES[dtype]:
                    raise ArtifactError(
                        f"the manifest's dtype is {dtype}, but the graph {io.file} declares {declared} for its "
                        f"{kind} {name!r}",
                        hint="the manifest was edited or belongs to other graphs; re-export the artifact",
                    )
                shape = list(getattr(have[kind][name], "shape", None) or [])
                for axis, field_name, want in (axes or {}).get(key, []):
                    got = shape[axis] if -len(shape) <= axis < len(shape) else None
                    if isinstance(got, int) and got != want:
                        raise ArtifactError(
                            f"the manifest's {field_name} is {want}, but the graph {io.file} declares {got} "
                            f"(axis {axis} of its {kind} {name!r})",
                            hint="the manifest was edited or belongs to other graphs; re-export the artifact",
                        )


def _run_errors() -> tuple[type[BaseException], ...]:
    """What a session's run raises for bad feeds or buffers: RuntimeError (run_with_iobinding), ValueError (its
    Python wrapper's checks of the feed) and ORT's pybind exception types (InvalidArgument, Fail, ...)."""
    state = _ort().capi.onnxruntime_pybind11_state
    types = [t for t in vars(state).values() if isinstance(t, type) and issubclass(t, Exception)]
    return (RuntimeError, ValueError, *types)


class HostInputs:
    """The IO binding of a session on a device provider, which binds again, before every run, the inputs it was
    given in host memory. ONNX Runtime copies a host input to the device when it is bound, not when the graph runs,
    so a binding kept across calls (the bound chain's token and lengths, the kept exit and segment bindings) whose
    host array is rewritten in place would feed every later run the values of its bind: on the first CUDA run
    (an H200, 2026-12-04) the chain decoded token 0 after every prompt. On the CPU EP a bound host array is read
    where it lies, and no session wraps its bindings. Everything but the input binds is the binding's own."""

    def __init__(self, io: Any) -> None:
        self.io = io
        self._host: dict[str, tuple[Any, ...]] = {}  # input name -> how it was bound, for `refresh`

    def __getattr__(self, name: str) -> Any:
        return getattr(self.io, name)

    def bind_input(self, name: str, device_type: str, device_id: int, element_type: Any, shape: Any, ptr: int) -> None:
        self.io.bind_input(name, device_type, device_id, element_type, shape, ptr)
        self._note(name, device_type == "cpu", ("ptr", device_type, device_id, element_type, shape, ptr))

    def bind_cpu_input(self, name: str, arr: np.ndarray) -> None:
        self.io.bind_cpu_input(name, arr)
        self._note(name, True, ("cpu", arr))

    def bind_ortvalue_input(self, name: str, value: Any) -> None:
        self.io.bind_ortvalue_input(name, value)
        self._note(name, value.device_name().lower() == "cpu", ("value", value))

    def _note(self, name: str, host: bool, how: tuple[Any, ...]) -> None:
        if host:
            self._host[name] = how  # holds the array or value too: bound by pointer, it must outlive the binding
        else:
            self._host.pop(name, None)

    def refresh(self) -> None:
        """Bind every host input again: ONNX Runtime copies its current values to the device."""
        for name, (kind, *how) in self._host.items():
            if kind == "ptr":
                self.io.bind_input(name, *how)
            elif kind == "cpu":
                self.io.bind_cpu_input(name, *how)
            else:
                self.io.bind_ortvalue_input(name, *how)


class CheckedSession:
    """An InferenceSession whose run errors are one line: the one place where ONNX Runtime's run errors are mapped
    (to an ArtifactError naming the graph and ORT's first line, not a page of its traceback), and where a device
    provider's bindings refresh their host inputs before a run (`HostInputs`). Everything else is the session's
    own."""

    def __init__(self, session: Any, file: str) -> None:
        self._session = session
        self._file = file
        providers = session.get_providers()
        self.on_device = bool(providers) and providers[0] != "CPUExecutionProvider"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def io_binding(self) -> Any:
        io = self._session.io_binding()
        return HostInputs(io) if self.on_device else io

    def _mapped(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except _run_errors() as exc:
            raise ArtifactError(
                f"ONNX Runtime failed running the graph {self._file}: {_first_line(exc)}",
                hint="the artifact's graphs and its manifest disagree, or the machine ran out of memory",
            ) from exc

    def run_with_iobinding(self, io: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(io, HostInputs):
            io.refresh()
            io = io.io
        return self._mapped(lambda: self._session.run_with_iobinding(io, *args, **kwargs))

    def run(self, *args: Any, **kwargs: Any) -> Any:
        return self._mapped(lambda: self._session.run(*args, **kwargs))


@dataclass
class Graph:
    """One graph's session and its names from the manifest."""

    io: GraphIO
    session: Any  # None while released (export's validation holds one segment's sessions at a time)
    device: str

    def name(self, key: str) -> str:
        value = self.io.inputs.get(key, self.io.outputs.get(key))
        assert isinstance(value, str), key
        return value

    def names(self, key: str) -> list[str]:
        value = self.io.inputs.get(key, self.io.outputs.get(key))
        assert isinstance(value, list), key
        return value

    def binding(self) -> Any:
        return self.session.io_binding()


@dataclass(frozen=True)
class DeviceView:
    """A contiguous piece of a device buffer bound by pointer (a row of a batch's [B, ...] KV buffer on the GPU, or a
    row / the last position of a device-resident hidden state: ORT's Python API has no OrtValue views, but it binds
    raw device memory). `owner` keeps the OrtValue that holds the memory alive as long as the view.

    Indexing takes the leading-axes forms whose result stays contiguous (`x[r]`, `x[a:b]`, `x[0, -1:]`, `x[0, -1]`,
    `x[0, :-1]`); anything else raises, so a strided copy never happens silently. There is no `.numpy()`: a
    device-resident state cannot be read on the host by accident (sessions.ArtifactRuntime._read is the one way out,
    for the outputs the binding plan sends to the host)."""

    device: str
    ptr: int
    shape: tuple[int, ...]
    dtype: Any
    owner: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, value: Any) -> DeviceView:
        """An OrtValue (a tensor on any device) as a view of its whole memory."""
        return cls(value.device_name(), value.data_ptr(), tuple(value.shape()), _np_dtype(value), value)

    def reshape(self, *shape: int) -> DeviceView:
        if shape.count(-1) == 1:  # one axis inferred, as numpy does
            known = int(np.prod([d for d in shape if d != -1]))
            shape = tuple(int(np.prod(self.shape)) // max(known, 1) if d == -1 else d for d in shape)
        if int(np.prod(shape)) != int(np.prod(self.shape)):
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return DeviceView(self.device, self.ptr, tuple(shape), self.dtype, self.owner)

    def __getitem__(self, index: Any) -> DeviceView:
        items = index if isinstance(index, tuple) else (index,)
        shape, ptr = list(self.shape), self.ptr
        axis = 0  # the axis the next item indexes, in `shape` as it shrinks
        sliced = False
        for item in items:
            if sliced:
                raise IndexError(f"a device view takes no index after a slice (contiguous only): {index}")
            n = shape[axis]
            inner = int(np.prod(shape[axis + 1 :])) * np.dtype(self.dtype).itemsize
            if isinstance(item, slice):
                start, stop, step = item.indices(n)
                if step != 1:
                    raise IndexError(f"a device view takes no strided slice: {index}")
                ptr += start * inner
                shape[axis] = max(stop - start, 0)
                axis += 1
                sliced = shape[axis - 1] > 1  # a longer kept axis: indexing inside it would stride
            else:
                i = int(item) + n if int(item) < 0 else int(item)
                if not 0 <= i < n:
                    raise IndexError(f"index {item} out of range for axis of {n}")
                ptr += i * inner
                del shape[axis]
        return DeviceView(self.device, ptr, tuple(shape), self.dtype, self.owner)


def _np_dtype(value: Any) -> Any:
    """An OrtValue's element type as numpy's."""
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}[value.data_type()]


def buffer_shape(buf: Any) -> tuple[int, ...]:
    """A bound buffer's shape: an attribute of a numpy array or a DeviceView, a method of an OrtValue (a device
    provider's buffers)."""
    shape = buf.shape
    return tuple(shape() if callable(shape) else shape)
