"""The early-exit runner: exits chosen at run time over an exported artifact, with the KV cache kept correct.

Per generated token, the segments run in order; after each segment that ends at an active exit, the exit is
tested (decide.py): in the exit graph where it computes the signal (graph_decide.py), else through
`eectl.exits.signals.ExitScoring` on the ONNX exit graphs' outputs (`OrtExitLogits`): the same code calibrate runs in
torch, so a calibrated threshold means the same thing here. What the skipped layers' K/V become is the KV policy's
business (policies.py): the runner calls its hooks. Steps run on the bound chain (chain_steps.py, chain_rows.py); the
loop below (the general path) takes every step with `RunConfig.bound` False, and artifacts without the in-graph token.

Rows of a batch are independent sequences with their own cache rows and decisions, run in lock-step: per token
every row's step runs until it needs a graph call, and a segment runs once for all rows that reach it with one new
position (runtime/batch.py; per-row lengths), the final head once for all rows that reach it. Rows that exited
early sit out the deeper calls (they ride along on a scratch slot: GQA cannot skip rows); rows with several
positions (prefill, deferred positions) run single-row calls on their rows of the same buffers, and so do the
river policy's int4 copies after an exit (`KVPolicy.predict`). Block states (cosine-min) come from the batched call.

Device-resident (`RunConfig.device_resident`, the default off the CPU EP; greedy with exits or drafts): every state
a device value, exit tests reading a flag and a token, K scores or a scalar per row (binding.py). `generate` gives
its calls a `Placement` of its own (placement.py), which records every host read. A Runner keeps its last call's KV
cache and bound chains for the next call (`_buffers`).
What this module does not do: tokenise or format output (run/generate.py / cli/), or load torch models.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from eectl.contracts.layers import check_exit_layers
from eectl.errors import UsageError
from eectl.exits.base import ExitScore, no_probe_error
from eectl.exits.candidates import CANDIDATE_SOURCES, FirstExitTopK
from eectl.exits.gates import active_gates
from eectl.exits.signals import get_signal
from eectl.runtime import resident, scoring
from eectl.runtime.asks import Ask, Decision, FinalLogits, FinalToken, Segment, position
from eectl.runtime.batch import new_batch_kv
from eectl.runtime.blocks import active_block
from eectl.runtime.chain import DecodeChain
from eectl.runtime.chain_steps import chain_for, chain_step, chain_tokens, slot_chain
from eectl.runtime.decide import Answer, ExitTest
from eectl.runtime.device_ops import concat
from eectl.runtime.drafts import MIN_NGRAM, PromptLookup
from eectl.runtime.exit_logits import Decide
from eectl.runtime.kv import KVBuffers
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.policies import policy_class
from eectl.runtime.sampling import pick_token
from eectl.runtime.segment_rows import segment_rows
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.slots import ROOM, Kept, narrowed, reused
from eectl.runtime.state import Generation, RowState, RunConfig


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
        if self.signal.needs_probe:  # the score is computed in the exit graphs: exported with heads that carry probes
            graphs = [runtime.local_graphs[e] for e in config.exits]
            graphs += [runtime.candidate_graphs.get(e, runtime.full_graphs[e]) for e in config.exits]
            lacking = sorted({e for e, g in zip(config.exits * 2, graphs, strict=True) if "score" not in g.io.outputs})
            if lacking:
                raise no_probe_error(lacking)
        source = str(self.m.candidate_source.get("name", FirstExitTopK.name))
        self.source = CANDIDATE_SOURCES.get(source, CANDIDATE_SOURCES[FirstExitTopK.name])
        self.exits = check_exit_layers(config.exits, L)
        cal = self.m.calibration
        # gated exits (eectl.exits.gates): the decision runs only where the gate on the exit's state opens
        self.gates = active_gates(cal.gates if cal is not None else None, {e: config.thresholds[e] for e in self.exits})
        self.exit_test = ExitTest(runtime, self.signal, config, self.source)
        self.exit_after_segment = {self.rt.segment_of_layer[e]: e for e in self.exits}
        # active exits with a block head: the block runs on every position its segment runs (runtime/blocks.py)
        blocks = {s: active_block(runtime, self.exits, s) for s in self.exit_after_segment}
        self.block_after_segment = {s: e for s, e in blocks.items() if e is not None}
        self.final_segment = len(self.m.segments) - 1
        self.L = L
        self.lookup: PromptLookup | None = None  # drafts from the context (runtime/drafts.py)
        if config.prompt_drafts:
            if not self.policy.checks_drafts:
                raise UsageError(
                    f"--prompt-drafts needs a policy that checks drafts at full depth (verify), not {config.policy}"
                )
            ngram, shortest = config.draft_ngram, config.draft_min
            self.lookup = PromptLookup(config.prompt_drafts, ngram, min(MIN_NGRAM, ngram), min_draft=shortest)
        self.rng = np.random.default_rng(config.seed)
        self.last_kv: KVBuffers | None = None  # the cache of the last generate() call (bench: river's KV cosine)
        self._kept: Kept | None = None  # the last call's cache and chain, which the next call reuses (`_buffers`)
        # the placement of the call in progress: generate()'s own while it runs, else the host's
        self.place: Placement = HOST
        # the last generate()'s host reads, per step (device-resident or on the bound chain; none on the host path)
        self.step_reads: list[list[tuple[str, int, str]]] = []

    # --- sampling --------------------------------------------------------------------------------------------------
    def _pick(self, logits: np.ndarray, ids: np.ndarray | None = None) -> int:
        """Greedy or temperature/top-p sampling over logits [V] (or [K] with their vocabulary ids)."""
        return pick_token(logits, ids, self.cfg.temperature, self.cfg.top_p, self.rng)

    def sampler(self) -> Callable[[np.ndarray, np.ndarray | None], int] | None:
        """How the bound chain picks a token where the run samples (`_pick`); None under greedy (the graphs' argmax)."""
        return self._pick if self.cfg.temperature > 0 else None

    # --- exits -------------------------------------------------------------------------------------------------------
    def _decide_rows(self, layer: int, asks: dict[int, Decide]) -> dict[int, Answer]:
        """The exit test at `layer` for several rows' tokens at once (runtime/decide.py), on this call's placement."""
        return self.exit_test.rows(layer, asks, self.place)

    def _pick_score(self, score: ExitScore, i: int) -> int:
        """Row i's token from an exit's own prediction (computed once for all rows of the decision, on demand): its
        top-1 under greedy where the decision knows it (decided in the graph), else picked from its logits."""
        pred = score.prediction()  # numpy: the exit graphs' outputs
        if self.cfg.temperature <= 0 and pred.top1 is not None:
            return int(pred.top1[i])
        return self._pick(np.asarray(pred.logits[i]), None if pred.ids is None else np.asarray(pred.ids[i]))

    # --- one sequence step ------------------------------------------------------------------------------------
    def _step(self, row: int, st: RowState, kv: KVBuffers, chunk_ids: list[int], force_full: bool = False) -> int:
        """One row's step on its own (teacher-forced scoring, verify's closing pass): `_steps` with one row."""
        return self._steps(kv, {row: (st, chunk_ids)}, force_full)[row]

    def _steps(
        self, kv: KVBuffers, work: dict[int, tuple[RowState, list[int]]], force_full: bool = False
    ) -> dict[int, int]:
        """One step for several rows at once: each row's `_row_step` runs until it asks for a graph call (asks.py);
        the asks are gathered in pass order, so a segment runs once for all rows that reach it with one position
        (batched, with per-row lengths; runtime/batch.py) and the final head once for all rows that reach it."""
        gens = {r: self._row_step(r, st, kv, ids, force_full) for r, (st, ids) in work.items()}
        asks = {r: next(g) for r, g in gens.items()}
        tokens: dict[int, int] = {}
        segments = len(self.m.segments)
        while asks:
            key = min(position(a, self.rt.segment_of_layer, segments) for a in asks.values())
            group = {r: a for r, a in asks.items() if position(a, self.rt.segment_of_layer, segments) == key}
            answers = self._answer(kv, group, work)
            for r, answer in answers.items():
                try:
                    asks[r] = gens[r].send(answer)
                except StopIteration as done:
                    tokens[r] = done.value
                    del asks[r]
        return tokens

    def _answer(
        self, kv: KVBuffers, group: dict[int, Ask], work: dict[int, tuple[RowState, list[int]]]
    ) -> dict[int, Any]:
        """One batched call for the rows whose asks sit at the same place in the pass (all of one kind)."""
        first = next(iter(group.values()))
        if isinstance(first, Segment):
            segs = {r: a for r, a in group.items() if isinstance(a, Segment)}
            if all(a.ride for a in segs.values()):
                return {r: None for r in segs}  # no row needs this segment now: the riders' states wait
            states = {r for r, a in segs.items() if a.states}
            block = self.block_after_segment.get(first.at)
            xs = {r: a.x for r, a in segs.items()}
            return segment_rows(self.rt, first.at, xs, kv, states, self.place, self._pad(), block)
        if isinstance(first, Decision):
            t0 = time.perf_counter()
            answers = self._decide_rows(first.layer, {r: a.ask for r, a in group.items() if isinstance(a, Decision)})
            for r in group:  # every row waited for the whole batched decision
                work[r][0].decide_s += time.perf_counter() - t0
            return answers
        rows = sorted(group)
        hidden = [a.hidden for a in (group[r] for r in rows) if isinstance(a, FinalToken | FinalLogits)]
        if isinstance(first, FinalToken):  # the final head's in-graph argmax: one token per row leaves the graph
            h = concat(self.rt, hidden, 0)
            ids = self.rt.greedy_token(self.L, h, place=self.place, certified=self.cfg.certified_head)
            return {r: int(ids[i]) for i, r in enumerate(rows)}
        logits, _, _ = self.rt.exit_full(self.L, np.concatenate(hidden), self.cfg.top_k, place=self.place)
        return {r: logits[i : i + 1] for i, r in enumerate(rows)}

    def _row_step(
        self,
        row: int,
        st: RowState,
        kv: KVBuffers,
        chunk_ids: list[int],
        force_full: bool = False,
    ) -> Generator[Ask, Any, int]:
        """Process chunk_ids (the prompt, or the last token) and decide the next token; returns it.

        Yields the graph calls it needs batched (asks.py: a segment, an exit's decision, the final head's token or
        logits); `_steps` answers them. Under verify, a final-depth pass may roll back wrong drafts: then st.tokens
        is shorter afterwards and the returned token is the full model's token at the first wrong position.
        """
        m, place = self.m, self.place
        h = self.rt.embed(np.array([chunk_ids], dtype=np.int64), place=place)
        cands: Any = None  # this token's candidates, once the first exit picked them
        decided = False  # a decision ran for this token already (the first one picked its candidates)
        may_exit = len(chunk_ids) == 1 and not force_full and self.policy.may_exit(st)
        for s in range(len(m.segments)):
            x = self.policy.before_segment(st, s, h)
            layer = self.exit_after_segment.get(s)
            # signals that read the segment's block boundaries (cosine-min) ask for them at the exits they test
            wants_blocks = self.signal.needs_blocks and layer is not None and may_exit
            out, layer_in, blocks, exit_in = yield Segment(s, x, states=wants_blocks)  # exit_in: a block head's, or out
            if s == self.final_segment:
                corrected = self.policy.on_final(row, st, kv, out, place=place)
                if corrected is not None:
                    return corrected
                st.exit_layers.append(self.L)
                if st.forced is None and self.cfg.temperature <= 0:  # greedy: only the token leaves the graph
                    return int((yield FinalToken(out[0, -1:])))
                logits = yield FinalLogits(out[0, -1:])
                if st.forced is not None:
                    return self._forced(st, logits[0])
                return self._pick(logits[0])
            if (
                layer is not None
                and may_exit
                and self.exit_test.gate_opens(self.gates.get(layer), st, layer, exit_in, place)
            ):
                last = None if blocks is None else resident.last_positions(self.rt, blocks)
                st.count_decisions([layer], None if decided else layer)
                decided = True
                score, i, cands = yield Decision(layer, Decide(exit_in[0, -1], layer_in[0, -1], cands, last))
                if score is not None:
                    return (yield from self._exited(row, st, kv, s, layer, out, exit_in, score, i))
            h = out
        raise AssertionError("unreachable: the final segment returns")

    def _exited(
        self,
        row: int,
        st: RowState,
        kv: KVBuffers,
        s: int,
        layer: int,
        out: Any,
        exit_in: Any,
        score: ExitScore,
        i: int,
    ) -> Generator[Ask, Any, int]:
        """The token exits at `layer` (after segment s): its token, the policy's hook, then its ride (`_ride`)."""
        own = self.policy.predict(row, st, kv, s, out, place=self.place)  # e.g. the river's end (one row)
        st.exit_layers.append(layer)
        if st.forced is not None:
            if own is None:  # the exit's full vocabulary (after its block head, where it has one)
                logits = self.rt.exit_full(layer, exit_in[0, -1:], self.cfg.top_k, place=self.place)[0]
                own = (logits[0], None)
            token = self._forced(st, own[0])
        else:
            token = self._pick(*own) if own is not None else self._pick_score(score, i)
        self.policy.on_exit(row, st, kv, s, out, token)
        if st.forced is None:
            yield from self._ride(st, s)
        return token

    def _ride(self, st: RowState, s: int) -> Generator[Ask, Any, None]:
        """The token exited after segment s; in a batch, its deferred state rides along in the deeper segments.

        A batched call costs about the same whatever rows are active in it (rows that sit out still ride along on
        their scratch slot), so computing the exited state's K/V in the calls other rows need anyway is free, and it
        spares a later single-row flush call (GQA takes several positions per row only one row at a time). A segment
        no other row needs this token is not run for a rider: its state keeps waiting there (plain defer). Riding
        stops before the final segment for policies that check states there (`checks_at_final`: verify's drafts)."""
        if not (self.cfg.ride_along and self.policy.pending_states):
            return
        end = self.final_segment if self.policy.checks_at_final else self.final_segment + 1
        for t in range(s + 1, end):
            x = st.pending[t]
            if x is None or x.shape[1] != 1:
                return
            result = yield Segment(t, x, ride=True)
            if result is None:
                return
            st.pending[t] = None
            if t < self.final_segment:  # its output waits at the next segment's input, behind earlier positions
                prev = st.pending[t + 1]
                st.pending[t + 1] = result[0] if prev is None else concat(self.rt, [prev, result[0]], 1)

    @staticmethod
    def _forced(st: RowState, logits: np.ndarray) -> int:
        assert st.forced is not None
        token = st.forced[len(st.tokens)]
        z = logits.astype(np.float64)
        top = z.max()  # log-sum-exp shifted by the max: ~4x faster than np.logaddexp.reduce over V, same to 1e-12
        st.nll.append(float(top + np.log(np.exp(z - top).sum()) - z[token]))
        st.greedy.append(int(np.argmax(z)))
        return token

    def score(self, ids: list[int], prompt_len: int = 1) -> tuple[list[float], list[int]]:
        """Teacher-forced: -log p(next token) at positions prompt_len - 1 .. len(ids) - 2 under the distribution of
        the layer each was decided at (its full vocabulary; exits deciding as in generation, the first position at
        full depth as after a prefill), and those layers. Verify is not scored (its output equals full depth)."""
        got = self.score_many([(ids, prompt_len)])[0]
        return got.nll, got.layers

    def score_many(self, texts: list[tuple[list[int], int]], rows: int = 1) -> list[scoring.Scored]:
        """`score` for several (ids, prompt_len) with each position's argmax: in one pass (runtime/scoring.py, `rows`
        texts a pass) where the configuration allows, else token by token."""
        if scoring.one_pass(self):
            return scoring.score_texts(self, texts, rows)
        done = [scoring.token_by_token(self, ids, p) for ids, p in texts]
        return [scoring.Scored(st.nll, st.greedy, st.exit_layers) for st in done]

    def greedy_choices(self, ids: list[int], prompt_len: int) -> list[int]:
        """Teacher-forced as `score`: the greedy token this configuration chooses after each prefix ids[:i], for i
        from prompt_len to len(ids) - 1 (on full depth: what full depth would emit after another path's tokens)."""
        return self.score_many([(ids, prompt_len)])[0].greedy

    # --- generation -------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        on_step: Callable[[int, list[int]], None] | None = None,
        slots: int | None = None,
    ) -> list[Generation]:
        """Generate for each prompt: rows in lock-step, each with its own cache rows and decisions, one graph call
        per segment for the rows that run it (`_steps`).

        `slots`: rows decoded together (default: every prompt at once). With fewer slots than prompts, a row that
        finishes frees its slot between steps and the next prompt joins there (its cache rows forgotten, its prompt
        prefilled in the step the others decode), so ragged answers keep every slot busy. The generations come
        back in prompt order, each the same as its prompt generated alone.

        `on_step(prompt_index, confirmed)` sees each row's generated tokens that can no longer change (under
        verify: those before the first unchecked draft), after every step: for streaming.
        """
        cfg = self.cfg
        if not prompts or any(len(p) == 0 for p in prompts):
            raise UsageError("empty prompt")
        if slots is not None and slots < 1:
            raise UsageError(f"--batch-size must be >= 1, got {slots}")
        longest = max(len(p) for p in prompts)
        need = longest + cfg.max_new_tokens + 1
        if need > self.m.max_positions:
            raise UsageError(
                f"prompt of {longest} tokens + {cfg.max_new_tokens} new tokens exceeds the maximum context "
                f"of {self.m.max_positions}"
            )
        width = len(prompts) if slots is None else min(slots, len(prompts))
        kept = self._buffers(width, need)
        self.last_kv, chain = kept.kv, kept.chain
        rows = [RowState(list(p), len(p), [None] * len(self.m.segments)) for p in prompts]
        if self.lookup is not None:
            for st in rows:
                st.lookup = self.lookup.new_state()
        device = self._on_device()  # the states on the device: the chain's buffers, or the general path's own
        # host reads recorded per step where every step's reads are named: device-resident, or on the bound chain
        place = Placement(device=device, record=chain is not None)  # a device run records its reads anyway
        self.step_reads = place.steps
        self.place = place
        try:
            self._loop(kept, rows, on_step)
        finally:
            self.place = HOST  # scoring, chat and cost timing run on the host (their own calls)
        return [st.generation() for st in rows]

    def _loop(self, kept: Kept, rows: list[RowState], on_step: Callable[[int, list[int]], None] | None) -> None:
        """Steps until every prompt is done. `seated[slot]` is the prompt in that slot of the cache; a prompt whose
        first step is still to run (its prefill: the whole prompt, always full depth) is `fresh`. Once no prompt
        waits, the rows still decoding narrow onto the fewest rows (slots.py)."""
        kv, chain = kept.kv, kept.chain
        queue = list(range(len(rows)))
        seated: dict[int, int] = {}
        fresh: set[int] = set()

        def seat() -> None:  # fill the free slots with the next prompts, in order
            for slot in range(kv.rows):
                if slot not in seated and queue:
                    seated[slot] = i = queue.pop(0)
                    fresh.add(slot)
                    rows[i].reused = reused(self.rt, kept, slot, rows[i].tokens, self._pad())
                    # what the slot's last prompt left beyond a prefix the new one shares is forgotten
                    kv.rollback(slot, rows[i].reused)
                    kept.prompts[slot] = list(rows[i].tokens)

        seat()
        while seated:
            if chain is not None and not queue and not fresh:
                chain = narrowed(self.rt, kept, chain, seated)
            t0 = time.perf_counter()  # a step's time includes proposing and settling its drafts
            # a fresh row feeds its prompt after what its cache rows hold, the others their last token
            live: dict[int, tuple[RowState, list[int]]] = {}
            for s, i in seated.items():
                row = rows[i]
                live[s] = (row, row.tokens[row.reused :] if s in fresh else row.tokens[-1:])
            drafted: dict[int, int] = {}  # slot -> drafts from the context this step (RunConfig.prompt_drafts)
            if self.lookup is not None:
                args = (self.L, self.cfg.max_new_tokens, self.cfg.stop_ids)
                drafted = {s: self.lookup.attach(rows[i], *args) for s, i in seated.items() if s not in fresh}
            for s, n in drafted.items():
                if n:  # the row's last token, then its drafts: one wide pass through every layer
                    live[s] = (rows[seated[s]], rows[seated[s]].tokens[-n - 1 :])
            bound = None if chain is None else chain_tokens(self, chain, kv, live, fresh, drafted, kept)
            # else: exits or drafts off the CPU EP, prompts padded into one call
            tokens = bound if bound is not None else self._steps(kv, live)
            for s in tokens:
                if drafted.get(s):
                    assert self.lookup is not None
                    self.lookup.close(rows[seated[s]])
            took = time.perf_counter() - t0  # a row's latency is its batch step's: rows wait for each other
            fresh.clear()
            for s, token in tokens.items():
                i = seated[s]
                st = rows[i]
                st.emit(token, took)
                st.done = self._finished(s, st, kv, chain)
                if on_step is not None:
                    on_step(i, self._confirmed(st))
                if st.done:
                    del seated[s]
            self.place.end_step()
            seat()

    def forget_prompts(self) -> None:
        """The next prompts are fed whole (unless they share a beginning with each other): the cache's rows keep no
        prompt to reuse (slots.py `reused`). A bench's repetition starts so, or its prompts would find themselves."""
        if self._kept is not None:
            self._kept.prompts.clear()

    def _buffers(self, width: int, need: int) -> Kept:
        """The KV cache of `width` rows with room for `need` positions and the bound chains over it (`Kept`): the
        last call's (its rows cut as prompts take them: `_loop`) where it has as many rows, the room, and was bound
        under the same configuration (the next call binds nothing the last one bound, e.g. verify's check widths);
        else new ones, the old freed first, with room for `need` rounded up to ROOM positions (so calls of about one
        length keep them and the prompts they hold: slots.py `reused`), or for `need` alone where that does not fit
        in memory. So `last_kv` is overwritten by the next call."""
        kept = self._kept
        if kept is not None and kept.kv.rows == width and kept.kv.max_len >= need and kept.cfg == self.cfg:
            return kept  # every slot's lengths are cut when a prompt takes it (`_loop`), to the prefix it shares
        self._kept = self.last_kv = kept = None  # the old buffers freed before the new ones are allocated
        try:
            kv = new_batch_kv(self.rt, width, min(self.m.max_positions, -(-need // ROOM) * ROOM))
        except UsageError:  # the rounded room does not fit in memory: what the call needs, or its one-line error
            kv = new_batch_kv(self.rt, width, need)
        self._kept = Kept(kv, self._chain(kv, width), copy.deepcopy(self.cfg))
        return self._kept

    def _pad(self) -> bool:
        """Whether a batch's new prompts prefill in one padded call (RunConfig.batch_prompts; default: off CPU)."""
        return self.cfg.batch_prompts if self.cfg.batch_prompts is not None else self.rt.device != "cpu"

    def _resident_wanted(self) -> bool:
        return self.rt.device != "cpu" if self.cfg.device_resident is None else self.cfg.device_resident

    def _on_device(self) -> bool:
        """Whether generate's steps with active exits or drafts keep their states on the device (a `Placement` of
        their own: the binding plan executed: only exit tests' flags and tokens, K ids and scores or a scalar per row,
        and tokens read on the host). Greedy only: sampling and teacher-forced scoring pick on the host."""
        return bool(self._resident_wanted() and (self.exits or self.lookup) and self.cfg.temperature <= 0)

    def _chain(self, kv: KVBuffers, rows: int, host: bool = False) -> DecodeChain | None:
        """The bound call chain this generate call steps on where it can (runtime/chain_steps.py; `host`: its states
        in host buffers whatever the run's, for scoring and chat), else None (and always None where the configuration
        is not `bound`)."""
        return chain_for(self, kv, rows, host=host) if self.cfg.bound else None

    @staticmethod
    def _confirmed(st: RowState) -> list[int]:
        end = len(st.tokens) if st.done or not st.drafts else min(p for p, _ in st.drafts)
        return st.tokens[st.prompt_len : end]

    def _finished(self, row: int, st: RowState, kv: KVBuffers, chain: DecodeChain | None = None) -> bool:
        generated = len(st.tokens) - st.prompt_len
        if st.tokens[-1] not in self.cfg.stop_ids and generated < self.cfg.max_new_tokens:
            return False
        return self._settled(row, st, kv, chain)

    def _settled(self, row: int, st: RowState, kv: KVBuffers, chain: DecodeChain | None = None) -> bool:
        """Generation stops here: whatever the policy left unchecked is checked first (True), or a wrong draft was
        rolled back and generation continues from the corrected token (False). `chain`: the generate call's bound
        chain, which runs the closing pass on the CPU EP (a batch's: on the row's slot's chain)."""
        if not self.policy.unchecked(st):
            return True
        n_before, t0 = len(st.tokens), time.perf_counter()
        if chain is not None and chain.rows > 1 and self._kept is not None:  # a batch: the row's slot's own chain
            chain = slot_chain(self, self._kept, row)
        if chain is not None:
            extra = chain_step(self, chain, st, kv, force_full=True)
        else:
            extra = self._step(row, st, kv, [st.tokens[-1]], force_full=True)
        if len(st.tokens) < n_before:  # a draft was wrong: continue from the corrected token
            st.emit(extra, time.perf_counter() - t0)
            return self._finished(row, st, kv, chain)
        st.exit_layers.pop()  # the look-ahead token is not emitted; its pass was decode time of the last token
        st.latencies[-1] += time.perf_counter() - t0
        return True
