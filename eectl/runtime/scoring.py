"""Teacher-forced scoring in one pass: a text's log-likelihood with the exits deciding as in generation.

Fed token by token (`token_by_token`), a text of n tokens costs n passes over the segments. Where the
policy leaves every position with the full model's states (`KVPolicy.exact_states`: defer computes a skipped
layer's K/V from the exit's exact state later; full depth trivially), the states a token-by-token run reaches are
the states of one full-depth pass over the whole text, so the same scores come from one pass:

- each segment runs once over every position (texts of a batch right-padded into one call, as generation's
  prompts are: `batch.run_prefill`), a block exit head over its segment's positions (its K/V as in generation);
- at each active exit, the positions still undecided ask the exit test together (`Runner._decide_rows`, decide.py:
  the same signal, gates and candidates as generation; positions stand in for rows), `SCORE_ROWS` at a time;
- a position that exits is scored on its exit's full vocabulary (after its block head), the others on the final
  head's; the position predicting the first continuation token is decided at full depth, as after a prefill (a
  one-token prompt is a decode step: it may exit).

The results equal the token-by-token path's up to float summation order (the same graphs on [S, H] instead of
[1, H]): log-probabilities within ~1e-5, and a decision can flip only where a signal sits within that of its
threshold. Policies whose skipped K/V are stand-ins (copy, river) change the states of later positions, so they
stay token by token. Scoring runs on host states whatever `RunConfig.device_resident` says (it reads every
position's full vocabulary), as the token-by-token path does.

What this module does not do: tokenise, generate, or choose exits (runner.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from eectl.contracts.manifest import Manifest
from eectl.errors import UsageError
from eectl.exits.gates import gate_open
from eectl.exits.signals import Signal
from eectl.runtime import stepping
from eectl.runtime.batch import new_batch_kv, run_prefill
from eectl.runtime.blocks import run_block
from eectl.runtime.chain_steps import chain_prompt, chain_step
from eectl.runtime.exit_logits import Decide
from eectl.runtime.policies import KVPolicy
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RowState, RunConfig

SCORE_ROWS = 256  # positions per exit-test or head call: bounds its [N, V] logits (50 MB at V = 49k, fp32)
BATCH_TOKENS = 2048  # padded positions per batched pass (rows x the longest text): the K/V and states it holds


class Runner(stepping.Runner, Protocol):
    """What scoring reads of the runner (runner.Runner, which imports this module): the chain's steps' part too."""

    rt: ArtifactRuntime
    m: Manifest
    cfg: RunConfig
    policy: KVPolicy
    signal: Signal
    exits: list[int]
    gates: dict[int, Any]
    exit_after_segment: dict[int, int]
    block_after_segment: dict[int, int]
    final_segment: int
    L: int

    def _decide_rows(self, layer: int, asks: dict[int, Decide]) -> dict[int, tuple[Any, int, Any]]: ...

    def _chain(self, kv: Any, rows: int, host: bool = False) -> Any: ...


@dataclass
class Scored:
    """One text's scores at positions prompt_len - 1 .. n - 2 (each predicting the next token)."""

    nll: list[float]  # -log p(next token) under the decided layer's full vocabulary
    greedy: list[int]  # the decided layer's argmax
    layers: list[int]  # the layer each position was decided at


def one_pass(runner: Runner) -> bool:
    """Whether the runner's configuration scores text in one pass (module docstring)."""
    exact = runner.policy.exact_states or not runner.exits
    return bool(runner.policy.scores_text and exact)


def token_by_token(runner: Runner, ids: list[int], prompt_len: int) -> RowState:
    """One text fed token by token through the runner's steps on the bound chain (chain_steps.py), the exits
    deciding as in generation: its RowState holds each position's -log p, argmax and layer. For any policy that
    scores text."""
    if not runner.policy.scores_text:
        raise UsageError(f"teacher-forced scoring does not cover the {runner.cfg.policy} policy")
    m = runner.m
    check_text(ids, prompt_len, m.max_positions)
    kv = runner.rt.new_kv(1, len(ids) + 1)
    st = RowState(list(ids[:prompt_len]), prompt_len, [None] * len(m.segments), forced=list(ids))
    # generation's steps, their states on the host (scoring reads each position's logits)
    chain = runner._chain(kv, 1, host=True)
    st.tokens.append(chain_prompt(runner, chain, st, kv))
    while len(st.tokens) < len(ids):
        st.tokens.append(chain_step(runner, chain, st, kv))
    return st


def check_text(ids: Sequence[int], prompt_len: int, max_positions: int) -> None:
    if not 1 <= prompt_len < len(ids) or len(ids) + 1 > max_positions:
        raise UsageError("text too short or longer than the maximum context")


def score_texts(
    runner: Runner, texts: Sequence[tuple[Sequence[int], int]], rows: int = 1, batch_tokens: int = BATCH_TOKENS
) -> list[Scored]:
    """Score each (ids, prompt_len): ids[prompt_len:] given what precedes each token. Texts are passed `rows` at a
    time (longest first, at most `batch_tokens` padded positions a pass); results come back in the given order."""
    if not one_pass(runner):
        raise UsageError(f"the {runner.cfg.policy} policy does not score text in one pass")
    for ids, prompt_len in texts:
        check_text(ids, prompt_len, runner.m.max_positions)
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i][0]))
    out: dict[int, Scored] = {}
    while order:
        width = len(texts[order[0]][0]) - 1  # the longest input of this pass: every row is padded to it
        group = order[: max(1, min(rows, batch_tokens // max(width, 1)))]
        order = order[len(group) :]
        out.update(zip(group, _score_pass(runner, [texts[i] for i in group]), strict=True))
    return [out[i] for i in range(len(texts))]


def _score_pass(runner: Runner, texts: Sequence[tuple[Sequence[int], int]]) -> list[Scored]:
    rt, m = runner.rt, runner.m
    inputs = [np.asarray(ids[:-1], np.int64) for ids, _ in texts]  # the last token is only predicted
    kv = new_batch_kv(rt, len(inputs), max(len(x) for x in inputs))
    h = {r: rt.embed(x[None]) for r, x in enumerate(inputs)}
    # position keys r * stride + q; the first scored position (prompt_len - 1) ends the prefill, which runs at full
    # depth, unless the prompt is one token (then it is a decode step like the others, as in generation)
    stride = max(len(x) for x in inputs)
    undecided = [r * stride + q for r, (_, p) in enumerate(texts) for q in range(p if p > 1 else 0, len(inputs[r]))]
    undecided = undecided if runner.exits else []
    decided: dict[int, int] = {}  # position key -> the exit it left at
    exit_states: dict[int, dict[int, np.ndarray]] = {}  # exit layer -> row -> its states [S, H]
    candidates: dict[int, Any] = {}
    for s in range(len(m.segments)):
        layer = runner.exit_after_segment.get(s)
        blocks = bool(runner.signal.needs_blocks and layer is not None and undecided)
        res = _segment(runner, s, h, kv, blocks)
        h = {r: a[0] for r, a in res.items()}
        if layer is None or s == runner.final_segment:
            continue
        block = runner.block_after_segment.get(s)
        exit_in = {r: x if block is None else run_block(rt, block, x, kv, r) for r, x in h.items()}
        exit_states[layer] = {r: x[0] for r, x in exit_in.items()}
        if undecided:
            passed = _decide(runner, layer, undecided, stride, exit_in, res, candidates)
            decided.update(dict.fromkeys(passed, layer))
            undecided = [k for k in undecided if k not in passed]
    exit_states[runner.L] = {r: x[0] for r, x in h.items()}
    scored = [Scored([], [], []) for _ in texts]
    wanted: dict[int, list[int]] = {}  # layer -> the position keys scored there
    for r, (_, p) in enumerate(texts):
        for q in range(p - 1, len(inputs[r])):
            wanted.setdefault(decided.get(r * stride + q, runner.L), []).append(r * stride + q)
    nll: dict[int, tuple[float, int]] = {}
    for layer, keys in wanted.items():
        for i in range(0, len(keys), SCORE_ROWS):
            chunk = keys[i : i + SCORE_ROWS]
            states = np.stack([exit_states[layer][k // stride][k % stride] for k in chunk])
            targets = np.array([int(texts[k // stride][0][k % stride + 1]) for k in chunk])
            logits = rt.exit_full(layer, states, runner.cfg.top_k)[0]
            nll.update(zip(chunk, zip(*_nll(logits, targets), strict=True), strict=True))
    for r, (_, p) in enumerate(texts):
        for q in range(p - 1, len(inputs[r])):
            k = r * stride + q
            scored[r].nll.append(nll[k][0])
            scored[r].greedy.append(nll[k][1])
            scored[r].layers.append(decided.get(k, runner.L))
    return scored


def _segment(runner: Runner, s: int, h: dict[int, np.ndarray], kv: Any, blocks: bool) -> dict[int, tuple[Any, ...]]:
    """Segment s over every position of every row: one padded call for the rows together (block boundaries, which
    the padded call does not return, row by row)."""
    if len(h) > 1 and not blocks:
        return dict(run_prefill(runner.rt, s, h, kv))
    return {r: runner.rt.run_segment(s, x, kv, r, states=blocks) for r, x in h.items()}


def _decide(
    runner: Runner,
    layer: int,
    keys: list[int],
    stride: int,
    exit_in: dict[int, np.ndarray],
    res: dict[int, tuple[Any, ...]],
    candidates: dict[int, Any],
) -> set[int]:
    """The exit test at `layer` for the positions `keys` whose gate opens; returns those that exit (the others keep
    the candidates the test picked for them, as a token does between exits)."""
    gate = runner.gates.get(layer)
    asks: dict[int, Decide] = {}
    for k in keys:
        r, q = divmod(k, stride)
        x = exit_in[r][0, q]
        if gate is not None and not gate_open(gate, x):
            continue
        states = res[r][2][:, q] if len(res[r]) > 2 else None
        asks[k] = Decide(x, res[r][1][0, q], candidates.get(k), states)
    passed: set[int] = set()
    ordered = sorted(asks)
    for i in range(0, len(ordered), SCORE_ROWS):
        answers = runner._decide_rows(layer, {k: asks[k] for k in ordered[i : i + SCORE_ROWS]})
        for k, (score, _, cands) in answers.items():
            if score is not None:
                passed.add(k)
            elif cands is not None:
                candidates[k] = cands
    return passed


def _nll(logits: np.ndarray, targets: np.ndarray) -> tuple[list[float], list[int]]:
    """Per row: -log softmax(logits)[target] and the argmax (exp in float32 after subtracting the row's maximum,
    summed in float64: within ~1e-6 of float64 throughout, at half its cost on [N, V])."""
    z = np.asarray(logits, np.float32)
    top = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - top).sum(axis=1, dtype=np.float64)) + top[:, 0]
    picked = z[np.arange(len(targets)), targets].astype(np.float64)
    return (lse - picked).tolist(), z.argmax(axis=1).tolist()
