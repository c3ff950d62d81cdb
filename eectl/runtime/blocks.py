"""Block exit heads at run time: one decoder layer per exit with its own KV buffer, kept in step with the segments.

A block exit (manifest `ExitPoint.block`, head_designs.BlockHead) attends over every earlier position at its exit,
so while the exit is active every position that passes its layer runs the block, prompt and deferred positions
included, and the block's K/V land in its own buffer (slot `kv_slot` of the runner's buffers, after the decoder
layers'; the same in-place GroupQueryAttention as the segments). The exit graphs then score the block's output.

Invariant, checked on every call: the block's buffer holds exactly the positions its segment's layers hold. It holds
under every policy because each one moves the block with its segment:

- defer / verify: the block runs on whatever its segment's call ran on (the token, pending positions, riders);
  verify's rollback cuts every slot's length at once (`KVBuffers.rollback`), the blocks' included;
- copy: a skipped segment's K/V-only graph is followed by the block's K/V-only graph on the same exit state;
- river: the int4 copies' output at a block exit runs the (fp32) block, as the segment's output would.

The bound chain (runtime/chain.py, chain_parts.py `BlockCall`) binds a block after its segment's call, one position or
wide, for one row or the rows of a batch (per-row lengths, idle rows writing their scratch slot); `run_block` runs one
row's positions (a batch's prompts padded into one call, scoring in one pass, the copy and river policies).

What this module does not do: decide exits (runner.py) or build the graphs (export/block.py).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from eectl.runtime.kv import KVBuffers
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.sessions import ArtifactRuntime


def active_block(rt: ArtifactRuntime, exits: Collection[int], segment: int) -> int | None:
    """The exit layer at the end of `segment` when that exit is active and has a block head, else None."""
    m = rt.manifest
    if segment >= len(m.segments) - 1:
        return None
    layer = m.segments[segment].layers[1]
    return layer if layer in exits and layer in rt.block_graphs else None


def run_block(
    rt: ArtifactRuntime,
    layer: int,
    hidden: Any,
    kv: KVBuffers,
    row: int,
    kv_only: bool = False,
    *,
    place: Placement = HOST,
) -> Any:
    """The block head at exit `layer` on hidden [1, S, H] (its segment's output for those positions), appending S
    positions to its own KV in place; returns its output [1, S, H] (None with kv_only: K/V only, the copy policy).

    Called right after the segment ran on the same positions, so its segment's last layer already holds them.
    """
    m = rt.manifest
    block = m.exit_at(layer).block
    assert block is not None
    g = rt.block_graphs[layer][1 if kv_only else 0]
    slot = block.kv_slot
    past = int(kv.filled[row, slot])
    s = hidden.shape[1]
    total = past + s
    segment_len = int(kv.filled[row, layer - 1])
    if total != segment_len:
        raise RuntimeError(
            f"the block head at exit {layer} would hold {total} positions of row {row}; its segment holds "
            f"{segment_len}: its KV is out of step"
        )
    call = rt.kv_call(g, kv, row, [slot])  # its own KV slot, bound once per row like a segment's layers
    call.seqlens_k[0] = total - 1
    call.total[()] = total
    x = rt._host(hidden, rt.np_dtype)
    rt._bind_array(call.io, g.name("hidden"), x)
    out = None if kv_only else rt._state_out(call.io, g.name("hidden_out"), x.shape, place)
    g.session.run_with_iobinding(call.io)
    kv.advance(row, slot, slot + 1, s)
    return out
