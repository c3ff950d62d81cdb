"""The binding plan's device pieces (runtime/device_ops.py) equal the numpy / torch code they stand in for, on the
CPU EP with OrtValue inputs and outputs (the CUDA run is the gpu-marked test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eectl.exits.base import min_transition_cosine, transition_cosine
from eectl.runtime.device_ops import DeviceOps
from eectl.runtime.ort import _ort, cuda_usable


def _ops(provider: str, dtype) -> DeviceOps:
    return DeviceOps(provider, dtype)


def _check_pieces(ops: DeviceOps, dtype, atol: float) -> None:
    rng = np.random.default_rng(0)
    N, S, H, V = 3, 5, 16, 50
    device = ops.device

    def dev(x: np.ndarray):
        return _ort().OrtValue.ortvalue_from_numpy(x.astype(dtype), device, 0)

    hidden = rng.standard_normal((N, S, H)).astype(dtype)
    positions = np.array([4, 0, 2])
    got = ops.last(dev(hidden), positions)  # on the device
    assert got.device_name().lower() == device
    np.testing.assert_array_equal(got.numpy(), hidden[np.arange(N), positions])

    pending = rng.standard_normal((1, 2, H)).astype(dtype)
    joined = ops.concat(dev(pending), dev(hidden[:1]), on_device=False)
    np.testing.assert_array_equal(joined, np.concatenate([pending, hidden[:1]], axis=1))

    logits = (rng.standard_normal((N, V)) * 4).astype(dtype)
    lse = ops.logsumexp(dev(logits))
    assert isinstance(lse, np.ndarray) and lse.dtype == np.float32
    np.testing.assert_allclose(lse, torch.logsumexp(torch.from_numpy(logits).float(), -1).numpy(), atol=atol)

    a, b = hidden[:, 0], hidden[:, 1] + 0.5 * hidden[:, 0]
    cos = ops.cosine(dev(a), dev(b))
    ref = transition_cosine(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(cos, ref, atol=atol)

    blocks = np.cumsum(rng.standard_normal((N, 4, H)), axis=1).astype(dtype)  # [N, n + 1, H]
    cmin = ops.cosine_min(dev(blocks))
    ref = min_transition_cosine(torch.from_numpy(blocks).transpose(0, 1)).numpy()  # eectl.exits.signals: [n + 1, N, H]
    np.testing.assert_allclose(cmin, ref, atol=atol)
    zero = np.zeros((N, H), dtype)  # a zero state: the eps floor, no NaN (torch's cosine gives 0 too)
    np.testing.assert_allclose(ops.cosine(dev(zero), dev(a)), np.zeros(N), atol=atol)
    _check_moves(ops, dtype, dev)


def _check_moves(ops: DeviceOps, dtype, dev) -> None:
    """What the bound chain's device buffers move with (runtime/buffers.py): a state written into a bound buffer, parts
    (host or device) joined into one, a copy that outlives its buffer, one position read on the host: exact."""
    from types import SimpleNamespace

    from eectl.runtime import buffers
    from eectl.runtime.ort import DeviceView

    rng = np.random.default_rng(1)
    H = 16
    rt = SimpleNamespace(ops=ops)
    buf = dev(np.zeros((3, 1, H), dtype))  # a batch's hop buffer [rows, 1, H]
    state = rng.standard_normal((1, 1, H)).astype(dtype)
    buffers.put(rt, buffers.view(buf)[1:2], dev(state))  # row 1 of it, from device memory
    buffers.put(rt, buffers.view(buf)[2:3], state[0])  # row 2, from a host array of another shape, same size
    want = np.zeros((3, 1, H), dtype)
    want[1] = want[2] = state[0]
    np.testing.assert_array_equal(buf.numpy(), want)
    pending = rng.standard_normal((1, 2, H)).astype(dtype)
    wide = dev(np.zeros((1, 3, H), dtype))
    buffers.join_into(rt, [pending, buffers.view(buf)[1:2]], wide)  # host pending states, then a device row
    np.testing.assert_array_equal(wide.numpy(), np.concatenate([pending, state], axis=1))
    kept = buffers.copy(rt, buffers.view(wide)[0, -1:])  # [1, H], new memory
    assert isinstance(kept, DeviceView) and kept.shape == (1, H)
    buffers.put(rt, wide, np.zeros((1, 3, H), dtype))  # the buffer rewritten: the copy keeps its values
    assert not wide.numpy().any()
    np.testing.assert_array_equal(buffers.host_state(rt, kept.reshape(1, 1, H)), state[0, 0])
    host = np.zeros((1, 3, H), dtype)
    buffers.join_into(rt, [pending, state], host)  # host buffers: numpy itself
    np.testing.assert_array_equal(host, np.concatenate([pending, state], axis=1))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_pieces_equal_the_host_code_on_cpu(dtype):
    _check_pieces(_ops("cpu", dtype), dtype, 1e-5 if dtype == np.float32 else 2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_usable(), reason="needs a usable CUDAExecutionProvider")
def test_device_pieces_on_cuda():
    _check_pieces(_ops("cuda", np.float16), np.float16, 2e-3)
