"""Executing the binding plan (runtime/binding.py) for a batch's full-depth greedy decode step.

The plan lists, per generated token, every graph call and where each input and output lives. This module runs
those calls as listed: values the plan keeps on the device are OrtValues on the artifact's device, handed from one
graph to the next (hidden states, K/V, the final logits and Top-K), and only the outputs the plan sends to the host
are read as numpy arrays — for a full-depth greedy token, the in-graph argmax, one id per row. The plan is built for
a device provider even when the artifact runs on the CPU EP, so this same code runs in the CPU tests (where the
"device" is host memory behind OrtValues) and on the CUDA EP (device memory); `host_reads` records what was read,
so tests check the rule on the execution itself, not only on the plan.

Scope: the decode steps of a batch with no active exit and greedy decoding (`eectl run --exits none`, a plan whose
default is full depth), all rows in one call per segment. Steps with exits run the same plan through the runner's
own loop in resident mode (runner.py `Runner._resident`, sessions.py `ArtifactRuntime.resident`), where per-row
decisions, deferred positions, drafts and river copies need the runner's policy hooks.

What this module does not do: decide exits, prefill, or apply policies (runner.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eectl.runtime.batch import BatchKV, _past, _rows
from eectl.runtime.binding import HIDDEN, BindingPlan, Call, plan_for
from eectl.runtime.device_ops import DeviceOps
from eectl.runtime.ort import _ort
from eectl.runtime.sessions import ArtifactRuntime


class DeviceStep:
    """One full-depth greedy decode step for the rows of a batch, executed as the binding plan says."""

    def __init__(self, rt: ArtifactRuntime) -> None:
        self.rt = rt
        m = rt.manifest
        # the device-resident plan: "cuda" names where values live; on the CPU EP that memory is the host's
        self.plan: BindingPlan = plan_for(m, "cuda", [])
        self.calls: list[Call] = self.plan.token(None)
        self.ops = DeviceOps(rt.provider, rt.np_dtype, rt.threads)
        self.L = m.num_layers
        self.H = m.dims["hidden_size"]
        self.host_reads: list[tuple[str, int, str]] = []  # (graph, at, key) read on the host in the last step

    def _device(self, shape: tuple[int, ...], dtype: Any = None) -> Any:
        dt = self.rt.np_dtype if dtype is None else dtype
        return _ort().OrtValue.ortvalue_from_shape_and_type(list(shape), dt, self.rt.device, 0)

    def step(self, kv: BatchKV, last_tokens: dict[int, int]) -> dict[int, int]:
        """Rows in last_tokens each process their last token at full depth; returns each one's greedy next token."""
        B = kv.rows
        active = np.zeros(B, dtype=bool)
        active[list(last_tokens)] = True
        ids = np.zeros((B, 1), dtype=np.int64)
        for r, t in last_tokens.items():
            ids[r, 0] = t
        rows = np.flatnonzero(active)
        first, last = int(rows[0]), int(rows[-1]) + 1
        n = last - first
        self.host_reads = []
        hidden: Any = None
        for call in self.calls:
            if call.graph == "embed":
                hidden = self._embed(call, ids[first:last])
            elif call.graph == "segment":
                hidden = self._segment(call, hidden, kv, active, first, last)
            elif call.graph == "last":  # one position per row: the last is position 0, gathered on the device
                hidden = self.ops.last(hidden, np.zeros(n, np.int64))
            elif call.graph == "exit_full":
                tokens = self._final(call, hidden, n)
            else:
                raise AssertionError(f"the full-depth plan has no {call.graph} call")
        return {r: int(tokens[r - first]) for r in last_tokens}

    def _embed(self, call: Call, ids: np.ndarray) -> Any:
        g = self.rt.embedding
        io = g.binding()
        assert not call.binding("input_ids").output and call.binding("hidden").device != "cpu"
        io.bind_cpu_input(g.name("input_ids"), ids)  # ids are the plan's host input
        self.rt.bind_weights(io, g, "embed")
        out = self._device((ids.shape[0], 1, self.H))
        io.bind_ortvalue_output(g.name("hidden"), out)
        g.session.run_with_iobinding(io)
        return out

    def _segment(self, call: Call, hidden: Any, kv: BatchKV, active: np.ndarray, first: int, last: int) -> Any:
        """The batched segment call of runtime/batch.py `run_rows`, with the hidden states in and out as device
        values. Rows between first and last that sit out ride along on their scratch slot (their input is whatever
        their embedding was: only their scratch slot is written, never counted)."""
        rt = self.rt
        s = call.at
        g = rt.segments[s]
        lo, hi = rt.manifest.segments[s].layers
        past = _past(kv, np.arange(kv.rows), lo, hi)
        if int(past[active].max()) + 1 > kv.max_len:
            from eectl.errors import UsageError

            raise UsageError(f"the sequence reached {int(past[active].max()) + 1} tokens, beyond the KV buffer")
        io = g.binding()
        io.bind_ortvalue_input(g.name("hidden"), hidden)
        io.bind_cpu_input(g.name("seqlens_k"), past[first:last].astype(np.int32))
        io.bind_cpu_input(g.name("total_sequence_length"), np.array(int(past[first:last].max()) + 1, np.int32))
        for j, layer in enumerate(range(lo, hi)):
            for key, buf in (("key", kv.batch_keys[layer]), ("value", kv.batch_values[layer])):
                view = _rows(buf, first, last, rt.np_dtype)
                rt._bind_array(io, g.names(f"past_{key}")[j], view)
                rt._bind_array(io, g.names(f"present_{key}")[j], view, output=True)
        shape = (last - first, 1, self.H)
        out = self._device(shape)
        for b in call.bindings:
            if b.output and b.kind == HIDDEN and b.key in g.io.outputs and b.key != "layer_states":
                assert b.device != "cpu", f"the plan sends segment output {b.key} to the host"
                io.bind_ortvalue_output(g.name(b.key), out if b.key == "hidden_out" else self._device(shape))
        g.session.run_with_iobinding(io)
        kv.advance(active, lo, hi)
        return out

    def _final(self, call: Call, hidden: Any, n: int) -> np.ndarray:
        """The final head: everything on the device except the outputs the plan sends to the host (the token)."""
        rt = self.rt
        g = rt.full_graphs[self.L]
        io = g.binding()
        io.bind_ortvalue_input(g.name("hidden"), hidden)
        rt.bind_weights(io, g)
        io.bind_cpu_input(g.name("top_k"), np.ones(1, np.int64))  # the Top-1 output is never read: a scan, no sort
        host: dict[str, np.ndarray] = {}
        for b in call.bindings:
            if not b.output:
                continue
            if b.device == "cpu":
                dtype = np.int64 if b.key in ("token", "candidates") else rt.np_dtype
                shape = (n,) if b.key == "token" else (n, 1)
                host[b.key] = rt._out(io, g.name(b.key), shape, dtype)
                self.host_reads.append((call.graph, call.at, b.key))
            else:
                io.bind_output(g.name(b.key), rt.device)  # ORT allocates it on the device; nobody reads it
        g.session.run_with_iobinding(io)
        if "token" in host:
            return host["token"]
        return host["candidates"][:, 0]  # an artifact without the token output: the Top-1 id
