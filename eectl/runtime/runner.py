"""The early-exit runner: exits chosen at run time over an exported artifact, with the KV cache kept correct.

Per generated token, the segments run in order; after each segment that ends at an active exit, the exit's signal
is computed (Top-K local vocabulary by default: the first active exit projects the full LM head once and picks K
candidates, later exits score only those rows) and compared with the exit's thresholds. When a token exits after
segment s, the layers it skipped still owe later tokens their K/V. The policies:

- `copy`:   the skipped segments' K/V-only graphs project the exit hidden state into their caches (approximate).
- `defer`:  the exit hidden state waits at the boundary ("pending"); the next token that runs those segments
            carries it along as an extra position, so its K/V are exactly the full model's for that state.
- `verify`: like defer, but exited tokens are drafts: when a pass reaches the final layer, the final logits of the
            pending positions check the drafts; the first wrong draft and everything after it are rolled back by
            resetting the length counters, and the full model's token is emitted instead. Output == full depth.

Invariant (defer/verify): segment s holds K/V for positions [0, filled_s), filled_0 >= filled_1 >= ...;
pending[s] holds the hidden states at segment s's input for positions [filled_s, filled_{s-1}).

Rows of a batch are independent sequences with their own buffers and decisions, run in lock-step.
What this module does not do: tokenise or format output (generate.py / cli.py), or load torch models.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from eectl.errors import UsageError
from eectl.exits import CRITERIA, signals, transition_cosine
from eectl.runtime.sessions import ArtifactRuntime, KVBuffers

POLICIES = ("copy", "defer", "verify")


@dataclass
class RunConfig:
    exits: list[int]  # active exit layers ([] = full depth)
    thresholds: dict[int, dict[str, float]]  # exit layer -> criterion -> threshold (exit when value >= it)
    signal: str = "topk-prob"
    policy: str = "defer"
    top_k: int = 64
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    verify_block: int = 8  # verify: at most this many drafts before a forced full-depth pass
    stop_ids: tuple[int, ...] = ()
    note: str = ""  # how the configuration was chosen (one line for run and bench)
    planned: bool = False  # exits and thresholds come from the manifest's plan


@dataclass
class RowState:
    tokens: list[int]  # prompt + generated so far (the last one not yet processed)
    prompt_len: int
    pending: list[np.ndarray | None]  # per segment: [1, P, H] hidden at its input, or None
    drafts: list[tuple[int, int]] = field(default_factory=list)  # verify: (position, token) not yet checked
    exit_layers: list[int] = field(default_factory=list)  # per emitted token: the layer it was decided at
    latencies: list[float] = field(default_factory=list)  # per emitted token (seconds)
    forced: list[int] | None = None  # teacher forcing: the tokens to feed instead of the decided ones
    nll: list[float] = field(default_factory=list)  # teacher forcing: -log p(forced token) at the decided layer
    decide_s: float = 0.0
    drafted: int = 0
    rejected: int = 0
    done: bool = False


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    exit_layers: list[int]
    ttft_s: float
    latencies_s: list[float]
    decide_s: float  # time spent computing exit signals and decisions
    total_s: float
    drafted: int = 0  # verify: draft tokens proposed by exits
    rejected_drafts: int = 0  # verify: positions rolled back

    @property
    def tokens_per_s(self) -> float:
        decode = sum(self.latencies_s[1:])
        return (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else 0.0

    def mean_layers(self, num_layers: int) -> float:
        return float(np.mean(self.exit_layers)) if self.exit_layers else float(num_layers)


class Runner:
    def __init__(self, runtime: ArtifactRuntime, config: RunConfig) -> None:
        self.rt = runtime
        self.m = runtime.manifest
        self.cfg = config
        L = self.m.num_layers
        if config.policy not in POLICIES:
            raise UsageError(f"--policy must be one of {', '.join(POLICIES)}, got '{config.policy}'")
        if config.signal not in CRITERIA:
            raise UsageError(f"unknown signal '{config.signal}'; choose from {', '.join(CRITERIA)}")
        available = self.m.exit_layers
        bad = [e for e in config.exits if e not in available]
        if bad:
            raise UsageError(f"exit {bad[0]} is not in the artifact (its exits: {available})")
        for e in config.exits:
            missing = set(CRITERIA[config.signal]) - set(config.thresholds.get(e, {}))
            if missing:
                raise UsageError(f"no {'/'.join(sorted(missing))} threshold for exit {e}")
        if config.policy == "verify" and config.temperature > 0:
            raise UsageError("the verify policy is greedy only (it reproduces full-depth greedy output)")
        if not 2 <= config.top_k <= self.m.dims["vocab_size"]:
            raise UsageError(f"--top-k must be in 2..{self.m.dims['vocab_size']}")
        self.exits = sorted(config.exits)
        self.exit_after_segment = {self.rt.segment_of_layer[e]: e for e in self.exits}
        self.final_segment = len(self.m.segments) - 1
        self.L = L
        self.rng = np.random.default_rng(config.seed)

    # --- sampling --------------------------------------------------------------------------------------------------
    def _pick(self, logits: np.ndarray, ids: np.ndarray | None = None) -> int:
        """Greedy or temperature/top-p sampling over logits [V] (or [K] with their vocabulary ids)."""
        if self.cfg.temperature <= 0:
            i = int(np.argmax(logits))
        else:
            z = logits.astype(np.float64) / self.cfg.temperature
            p = np.exp(z - z.max())
            p /= p.sum()
            order = np.argsort(-p)
            keep = np.cumsum(p[order]) - p[order] < self.cfg.top_p
            keep[0] = True
            q = np.zeros_like(p)
            q[order[keep]] = p[order[keep]]
            i = int(self.rng.choice(len(q), p=q / q.sum()))
        return int(ids[i]) if ids is not None else i

    # --- exits -------------------------------------------------------------------------------------------------------
    def _decide(self, layer: int, h: np.ndarray, h_in: np.ndarray, state: dict[str, Any]) -> int | None:
        """Exit test at `layer` for the current token's hidden state h [H]; returns the token when it exits."""
        thr = self.cfg.thresholds[layer]
        sig = self.cfg.signal
        if sig == "cosine":
            cos = float(transition_cosine(torch.from_numpy(h_in), torch.from_numpy(h)))
            if cos < thr["cosine"]:
                return None
            logits, _, _ = self.rt.exit_full(layer, h[None], self.cfg.top_k)
            return self._pick(logits[0])
        if sig.startswith("topk"):
            if "candidates" not in state:  # the first active exit: the artifact's candidate source picks K
                cand, cand_logits = self.rt.exit_candidates(layer, h[None], self.cfg.top_k)
                state["candidates"] = cand
            else:
                cand = state["candidates"]
                cand_logits = self.rt.exit_local(layer, h[None], cand)
            s = signals(torch.from_numpy(cand_logits), torch.from_numpy(cand))
            if all(float(getattr(s, c)[0]) >= thr[c] for c in CRITERIA[sig]):
                return self._pick(cand_logits[0], cand[0])
            return None
        logits, _, _ = self.rt.exit_full(layer, h[None], self.cfg.top_k)
        s = signals(torch.from_numpy(logits))
        if all(float(getattr(s, c)[0]) >= thr[c] for c in CRITERIA[sig]):
            return self._pick(logits[0])
        return None

    # --- one sequence step ------------------------------------------------------------------------------------
    def _step(self, row: int, st: RowState, kv: KVBuffers, chunk_ids: list[int], force_full: bool = False) -> int:
        """Process chunk_ids (the prompt, or the last token) and decide the next token; returns it.

        Under verify, a final-depth pass may roll back wrong drafts: then st.tokens is shorter afterwards and the
        returned token is the full model's token at the first wrong position.
        """
        m = self.m
        h = self.rt.embed(np.array([chunk_ids], dtype=np.int64))
        state: dict[str, Any] = {}
        may_exit = len(chunk_ids) == 1 and not force_full
        if self.cfg.policy == "verify" and len(st.drafts) >= self.cfg.verify_block:
            may_exit = False
        for s in range(len(m.segments)):
            pend = st.pending[s]
            x = h if pend is None else np.concatenate([pend, h], axis=1)
            st.pending[s] = None
            out, layer_in = self.rt.run_segment(s, x, kv, row)
            if s == self.final_segment:
                if self.cfg.policy == "verify" and st.drafts:
                    # one final-head call for the drafts' positions and this one: the head's weight is read once
                    rows, _, _ = self.rt.exit_full(self.L, out[0], self.cfg.top_k)
                    corrected = self._verify(row, st, kv, out, rows[:-1])
                    if corrected is not None:
                        return corrected
                    logits = rows[-1:]
                else:
                    logits, _, _ = self.rt.exit_full(self.L, out[0, -1:], self.cfg.top_k)
                st.exit_layers.append(self.L)
                if st.forced is not None:
                    return self._forced(st, logits[0])
                return self._pick(logits[0])
            layer = self.exit_after_segment.get(s)
            if layer is not None and may_exit:
                t0 = time.perf_counter()
                token = self._decide(layer, out[0, -1], layer_in[0, -1], state)
                st.decide_s += time.perf_counter() - t0
                if token is not None:
                    self._skip(row, st, kv, s, out)
                    st.exit_layers.append(layer)
                    if st.forced is not None:
                        logits, _, _ = self.rt.exit_full(layer, out[0, -1:], self.cfg.top_k)
                        return self._forced(st, logits[0])
                    if self.cfg.policy == "verify":
                        st.drafts.append((len(st.tokens), token))
                        st.drafted += 1
                    return token
            h = out
        raise AssertionError("unreachable: the final segment returns")

    @staticmethod
    def _forced(st: RowState, logits: np.ndarray) -> int:
        assert st.forced is not None
        token = st.forced[len(st.tokens)]
        z = logits.astype(np.float64)
        st.nll.append(float(np.logaddexp.reduce(z) - z[token]))
        return token

    def score(self, ids: list[int], prompt_len: int = 1) -> tuple[list[float], list[int]]:
        """Teacher-forced: feed `ids` token by token (after a prefill of prompt_len) with exits deciding as in
        generation; returns -log p(next token) under the distribution of the layer each position was decided
        at (its full vocabulary), and those layers. Verify is not scored (its output equals full depth)."""
        if self.cfg.policy == "verify":
            raise UsageError("teacher-forced scoring covers copy and defer (verify equals full depth)")
        if not 1 <= prompt_len < len(ids) or len(ids) + 1 > self.m.max_positions:
            raise UsageError("text too short or longer than the maximum context")
        kv = self.rt.new_kv(1, len(ids) + 1)
        st = RowState(list(ids[:prompt_len]), prompt_len, [None] * len(self.m.segments), forced=list(ids))
        st.tokens.append(self._step(0, st, kv, st.tokens))
        while len(st.tokens) < len(ids):
            st.tokens.append(self._step(0, st, kv, [st.tokens[-1]]))
        return st.nll, st.exit_layers

    def _skip(self, row: int, st: RowState, kv: KVBuffers, s: int, out: np.ndarray) -> None:
        """The token exited after segment s: give the skipped segments their K/V per the policy."""
        if self.cfg.policy == "copy":  # no pending positions under copy: `out` is this token's exit state
            for t in range(s + 1, len(self.m.segments)):
                self.rt.run_segment(t, out, kv, row, kv_only=True)
        else:  # defer, verify: wait at the boundary; the next deep pass computes the exact K/V
            prev = st.pending[s + 1]
            st.pending[s + 1] = out if prev is None else np.concatenate([prev, out], axis=1)

    def _verify(self, row: int, st: RowState, kv: KVBuffers, out: np.ndarray, logits: np.ndarray) -> int | None:
        """Check the drafts against the final logits [P-1, V] of the flushed positions but the last; roll back at
        the first wrong one. out[0, j] is the final state of position base + j and predicts the token at base+j+1.
        """
        base = int(kv.filled[row, -1]) - out.shape[1]
        drafts = dict(st.drafts)
        st.drafts = []
        if out.shape[1] < 2:
            return None
        full_pred = logits.argmax(-1)
        for j in range(out.shape[1] - 1):
            pos = base + j + 1
            if pos in drafts and drafts[pos] != int(full_pred[j]):
                keep = pos - st.prompt_len  # generated tokens before the wrong draft
                st.rejected += len(st.tokens) - pos
                del st.tokens[pos:]
                del st.exit_layers[keep:]
                del st.latencies[keep:]
                kv.filled[row] = np.minimum(kv.filled[row], pos)
                st.pending = [None] * len(st.pending)
                st.exit_layers.append(self.L)
                return int(full_pred[j])
        return None

    # --- generation -------------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], on_step: Callable[[int, list[int]], None] | None = None
    ) -> list[Generation]:
        """Generate for each prompt (rows in lock-step, each with its own cache and decisions).

        `on_step(row, confirmed)` sees each row's generated tokens that can no longer change (under verify: those
        before the first unchecked draft), after every step: for streaming.
        """
        cfg = self.cfg
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UsageError("empty prompt")
        longest = max(len(p) for p in prompts)
        need = longest + cfg.max_new_tokens + 1
        if need > self.m.max_positions:
            raise UsageError(
                f"prompt of {longest} tokens + {cfg.max_new_tokens} new tokens exceeds the maximum context "
                f"of {self.m.max_positions}"
            )
        kv = self.rt.new_kv(len(prompts), need)
        rows = [RowState(list(p), len(p), [None] * len(self.m.segments)) for p in prompts]
        for r, st in enumerate(rows):  # prefill: always full depth
            t0 = time.perf_counter()
            st.tokens.append(self._step(r, st, kv, st.tokens))
            st.latencies.append(time.perf_counter() - t0)
            st.done = self._finished(r, st, kv)
            if on_step is not None:
                on_step(r, self._confirmed(st))
        while not all(st.done for st in rows):
            for r, st in enumerate(rows):
                if st.done:
                    continue
                t0 = time.perf_counter()
                st.tokens.append(self._step(r, st, kv, [st.tokens[-1]]))
                st.latencies.append(time.perf_counter() - t0)
                st.done = self._finished(r, st, kv)
                if on_step is not None:
                    on_step(r, self._confirmed(st))
        return [
            Generation(
                prompt_ids=st.tokens[: st.prompt_len],
                token_ids=st.tokens[st.prompt_len :],
                exit_layers=st.exit_layers,
                ttft_s=st.latencies[0],
                latencies_s=st.latencies,
                decide_s=st.decide_s,
                total_s=float(sum(st.latencies)),
                drafted=st.drafted,
                rejected_drafts=st.rejected,
            )
            for st in rows
        ]

    @staticmethod
    def _confirmed(st: RowState) -> list[int]:
        end = len(st.tokens) if st.done or not st.drafts else min(p for p, _ in st.drafts)
        return st.tokens[st.prompt_len : end]

    def _finished(self, row: int, st: RowState, kv: KVBuffers) -> bool:
        generated = len(st.tokens) - st.prompt_len
        if st.tokens[-1] not in self.cfg.stop_ids and generated < self.cfg.max_new_tokens:
            return False
        if self.cfg.policy != "verify" or not st.drafts:
            return True
        # verify: the drafts still outstanding must be checked by one full-depth pass before we stop
        last = st.tokens[-1]
        n_before = len(st.tokens)
        t0 = time.perf_counter()
        extra = self._step(row, st, kv, [last], force_full=True)
        if len(st.tokens) < n_before:  # a draft was wrong: continue from the corrected token
            st.tokens.append(extra)
            st.latencies.append(time.perf_counter() - t0)
            return self._finished(row, st, kv)
        st.exit_layers.pop()  # the look-ahead token is not emitted
        return True
