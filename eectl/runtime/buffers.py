"""A bound chain's buffers moved between calls the same way on the host and on a device: a state written into a
bound buffer (`put`), parts joined into one (`join_into`), a state copied out of a buffer the next call rewrites
(`copy`), a buffer viewed for indexing (`view`) and one state read on the host (`host_state`). Host buffers are numpy
arrays (the CPU EP: numpy does it); device buffers are OrtValues or DeviceViews, moved by the runtime's device ops
(device_ops.py: graphs of one op on the artifact's provider), so nothing passes through the host.

What this module does not do: allocate or bind buffers (chain.py), or run the exported graphs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.runtime.ort import DeviceView


def view(buf: Any) -> Any:
    """A numpy array or DeviceView as it is; an OrtValue as a DeviceView of its memory (indexable)."""
    return buf if isinstance(buf, np.ndarray | DeviceView) else DeviceView.of(buf)


def put(rt: Any, dst: Any, src: Any) -> None:
    """dst[...] = src (of dst's size, any shape of it): in place, where graphs bound to dst read it."""
    if isinstance(dst, np.ndarray) and isinstance(src, np.ndarray):
        dst[...] = src.reshape(dst.shape)
        return
    to = view(dst)
    rt.ops.write(src.reshape(to.shape) if isinstance(src, np.ndarray) else view(src).reshape(*to.shape), to)


def join_into(rt: Any, parts: list[Any], dst: Any) -> None:
    """The parts [1, P_i, H] concatenated along positions into dst [1, sum P_i, H]."""
    if isinstance(dst, np.ndarray) and all(isinstance(p, np.ndarray) for p in parts):
        np.concatenate(parts, axis=1, out=dst)
        return
    rt.ops.join([p if isinstance(p, np.ndarray) else view(p) for p in parts], 1, into=view(dst))


def copy(rt: Any, buf: Any) -> Any:
    """A copy of buf the caller keeps (a numpy array, or new device memory as a DeviceView)."""
    if isinstance(buf, np.ndarray):
        return buf.copy()
    return rt.ops.copy(view(buf))


def host_state(rt: Any, buf: Any) -> np.ndarray:
    """The last position of buf [1, P, H] on the host, [H] (from a device buffer: one copy of H values; the caller
    records the read)."""
    if isinstance(buf, np.ndarray):
        return buf[0, -1]
    state = view(buf)[0, -1:]  # [1, H]: one contiguous position
    H = state.shape[-1]
    return np.asarray(rt.ops.last(state.reshape(1, 1, H), np.zeros(1, np.int64), on_device=False)).reshape(H)
