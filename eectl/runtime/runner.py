"""The early-exit runner: exits chosen at run time over an exported artifact, with the KV cache kept correct.

Per generated token, the segments run in order; after each segment that ends at an active exit, the exit's signal
is scored through `eectl.exits.ExitScoring` on the ONNX exit graphs (`OrtExitLogits`): the same code calibrate
runs in torch, so a calibrated threshold means the same thing here. What the skipped layers' K/V become is the KV
policy's business (policies.py): the runner calls its hooks and stays a loop over segments.

Rows of a batch are independent sequences with their own buffers and decisions, run in lock-step.
What this module does not do: tokenise or format output (generate.py / cli.py), or load torch models.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from eectl.errors import UsageError
from eectl.exits import (
    CANDIDATE_SOURCES,
    DEFAULT_SIGNAL,
    CandidateSource,
    ExitScore,
    ExitScoring,
    FirstExitTopK,
    get_signal,
)
from eectl.recipe import check_exit_layers
from eectl.runtime.policies import policy_class
from eectl.runtime.sessions import ArtifactRuntime, KVBuffers


@dataclass
class RunConfig:
    exits: list[int]  # active exit layers ([] = full depth)
    thresholds: dict[int, dict[str, float]]  # exit layer -> criterion -> threshold (exit when value >= it)
    signal: str = DEFAULT_SIGNAL
    policy: str = "defer"
    top_k: int = 64
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    verify_block: int = 8  # verify: at most this many drafts before a forced full-depth pass
    river_predict: str = "end"  # river: the token from the river's end (final head) or from the exit itself
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


class OrtExitLogits:
    """`eectl.exits.ExitLogits` on the artifact's exit graphs: numpy in and out of ONNX Runtime, torch for scoring.

    The full graph computes its Top-K in-graph (TopK), so a first-exit candidate pick costs no extra pass."""

    def __init__(self, rt: ArtifactRuntime) -> None:
        self.rt = rt

    def full(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        logits, _, _ = self.rt.exit_full(layer, hidden.numpy(), 2)
        return torch.from_numpy(logits)

    def full_topk(self, layer: int, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, cand, cand_logits = self.rt.exit_full(layer, hidden.numpy(), k)
        return torch.from_numpy(cand), torch.from_numpy(cand_logits)

    def local(self, layer: int, hidden: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.rt.exit_local(layer, hidden.numpy(), candidates.numpy()))

    def candidates(
        self, source: CandidateSource, layer: int, hidden: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The artifact's candidate graph at this exit (export built it from `source`'s torch code)."""
        cand, cand_logits = self.rt.exit_candidates(layer, hidden.numpy(), k)
        return torch.from_numpy(cand), torch.from_numpy(cand_logits)


class Runner:
    def __init__(self, runtime: ArtifactRuntime, config: RunConfig) -> None:
        self.rt = runtime
        self.m = runtime.manifest
        self.cfg = config
        L = self.m.num_layers
        policy = policy_class(config.policy)
        if config.policy not in self.m.kv_policies:
            raise UsageError(f"this artifact was exported for the policies {self.m.kv_policies}, not {config.policy}")
        policy.check(config)
        self.signal = get_signal(config.signal)
        available = self.m.exit_layers
        bad = [e for e in config.exits if e not in available]
        if bad:
            raise UsageError(f"exit {bad[0]} is not in the artifact (its exits: {available})")
        for e in config.exits:
            missing = set(self.signal.criteria) - set(config.thresholds.get(e, {}))
            if missing:
                raise UsageError(f"no {'/'.join(sorted(missing))} threshold for exit {e}")
        if not 2 <= config.top_k <= self.m.dims["vocab_size"]:
            raise UsageError(f"--top-k must be in 2..{self.m.dims['vocab_size']}")
        self.policy = policy(runtime, config)
        self.exit_logits = OrtExitLogits(runtime)
        source = str(self.m.candidate_source.get("name", FirstExitTopK.name))
        self.source = CANDIDATE_SOURCES.get(source, CANDIDATE_SOURCES[FirstExitTopK.name])
        self.exits = check_exit_layers(config.exits, L)
        self.exit_after_segment = {self.rt.segment_of_layer[e]: e for e in self.exits}
        self.final_segment = len(self.m.segments) - 1
        self.L = L
        self.rng = np.random.default_rng(config.seed)
        self.last_kv: KVBuffers | None = None  # the cache of the last generate() call (bench: river's KV cosine)

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
    def _decide(
        self, layer: int, h: np.ndarray, h_in: np.ndarray, blocks: np.ndarray | None, scoring: ExitScoring
    ) -> ExitScore | None:
        """Exit test at `layer` for the current token's hidden state h [H] (blocks [n + 1, H]: the segment's block
        boundaries, for signals that read them); returns the score when it exits (its prediction is lazy)."""
        layer_input = torch.from_numpy(h_in[None]) if self.signal.needs_layer_input else None
        block_states = torch.from_numpy(blocks[:, None]) if blocks is not None else None
        score = scoring.score(layer, torch.from_numpy(h[None]), layer_input, block_states)
        if not bool(self.signal.passes(score.values, self.cfg.thresholds[layer])[0]):
            return None
        return score

    def _pick_score(self, score: ExitScore) -> int:
        pred = score.prediction()
        return self._pick(pred.logits[0].numpy(), None if pred.ids is None else pred.ids[0].numpy())

    # --- one sequence step ------------------------------------------------------------------------------------
    def _step(self, row: int, st: RowState, kv: KVBuffers, chunk_ids: list[int], force_full: bool = False) -> int:
        """Process chunk_ids (the prompt, or the last token) and decide the next token; returns it.

        Under verify, a final-depth pass may roll back wrong drafts: then st.tokens is shorter afterwards and the
        returned token is the full model's token at the first wrong position.
        """
        m = self.m
        h = self.rt.embed(np.array([chunk_ids], dtype=np.int64))
        scoring = ExitScoring(self.signal, self.exit_logits, self.cfg.top_k, self.source)
        may_exit = len(chunk_ids) == 1 and not force_full and self.policy.may_exit(st)
        for s in range(len(m.segments)):
            x = self.policy.before_segment(st, s, h)
            layer = self.exit_after_segment.get(s)
            blocks = None
            if self.signal.needs_blocks and layer is not None and may_exit:
                out, layer_in, blocks = self.rt.run_segment(s, x, kv, row, states=True)
            else:
                out, layer_in = self.rt.run_segment(s, x, kv, row)
            if s == self.final_segment:
                corrected = self.policy.on_final(row, st, kv, out)
                if corrected is not None:
                    return corrected
                st.exit_layers.append(self.L)
                if st.forced is None and self.cfg.temperature <= 0:  # greedy: only the token leaves the graph
                    return int(self.rt.greedy_token(self.L, out[0, -1:])[0])
                logits, _, _ = self.rt.exit_full(self.L, out[0, -1:], self.cfg.top_k)
                if st.forced is not None:
                    return self._forced(st, logits[0])
                return self._pick(logits[0])
            if layer is not None and may_exit:
                t0 = time.perf_counter()
                score = self._decide(
                    layer, out[0, -1], layer_in[0, -1], None if blocks is None else blocks[:, -1], scoring
                )
                st.decide_s += time.perf_counter() - t0
                if score is not None:
                    own = self.policy.predict(row, st, kv, s, out)  # e.g. the river's end
                    st.exit_layers.append(layer)
                    if st.forced is not None:
                        logits = own if own is not None else self.rt.exit_full(layer, out[0, -1:], self.cfg.top_k)[0][0]
                        token = self._forced(st, logits)
                    else:
                        token = self._pick(own) if own is not None else self._pick_score(score)
                    self.policy.on_exit(row, st, kv, s, out, token)
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
        if not self.policy.scores_text:
            raise UsageError(f"teacher-forced scoring does not cover the {self.cfg.policy} policy")
        if not 1 <= prompt_len < len(ids) or len(ids) + 1 > self.m.max_positions:
            raise UsageError("text too short or longer than the maximum context")
        kv = self.rt.new_kv(1, len(ids) + 1)
        st = RowState(list(ids[:prompt_len]), prompt_len, [None] * len(self.m.segments), forced=list(ids))
        st.tokens.append(self._step(0, st, kv, st.tokens))
        while len(st.tokens) < len(ids):
            st.tokens.append(self._step(0, st, kv, [st.tokens[-1]]))
        return st.nll, st.exit_layers

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
        self.last_kv = kv
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
        if not self.policy.unchecked(st):
            return True
        # e.g. verify's drafts: what is still unchecked must go through one full-depth pass before we stop
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
