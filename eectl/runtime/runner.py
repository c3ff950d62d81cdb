"""The early-exit runner: exits chosen at run time over an exported artifact, with the KV cache kept correct.

Per generated token, the segments run in order; after each segment that ends at an active exit, the exit is
tested: in the exit graph where it computes the signal (graph_decide.py), else on the host (decide.py) through
`eectl.exits.signals.ExitScoring` on the ONNX exit graphs' outputs (`OrtExitLogits`): the same code calibrate runs in
torch, so a calibrated threshold means the same thing here. What the skipped layers' K/V become is the KV policy's
business (policies.py): the step calls its hooks. Every step runs on the bound chain (chain.py: its graph calls bound
once; chain_steps.py chooses the step, chain_rows.py runs one with exits or drafts), the same way for one row or a
batch, on the host or with device buffers; tests/simulation.py is its reference in PyTorch.

Rows of a batch are independent sequences with their own cache rows and decisions (and, an engine's requests, their
own sampling: `RowState.sampling`), run in lock-step: a segment runs once for all rows that reach it with one new
position (per-row lengths), the final head once for all rows that reach it. Rows that exited early sit out the
deeper calls (they ride along on a scratch slot: GQA cannot skip rows); rows with several positions (prompts,
deferred positions, drafts) run their slot's one-row wide calls on the same buffers, and so do the river policy's
int4 copies after an exit (`KVPolicy.predict`).

Device-resident (`RunConfig.device_resident`, the default off the CPU EP; greedy with exits or drafts): the chain's
buffers are device memory, exit tests reading a flag and a token (binding.py). `generate` gives its calls a
`Placement` of its own (placement.py), which records every host read. A Runner keeps its last call's KV cache and
bound chains for the next call (`_buffers`).
What this module does not do: tokenise or format output (run/generate.py / cli/), or load torch models.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from eectl.contracts.layers import check_exit_layers
from eectl.errors import ArtifactError, UsageError
from eectl.exits.base import ExitScore, no_probe_error
from eectl.exits.candidates import CANDIDATE_SOURCES, FirstExitTopK
from eectl.exits.gates import active_gates
from eectl.exits.signals import get_signal
from eectl.runtime import scoring
from eectl.runtime.batch import new_batch_kv
from eectl.runtime.blocks import active_block
from eectl.runtime.chain import DecodeChain, chain_exits_supported
from eectl.runtime.chain_parts import Pick
from eectl.runtime.chain_steps import chain_for, chain_step, chain_tokens, slot_chain
from eectl.runtime.decide import Answer, ExitTest
from eectl.runtime.draft_memory import DraftMemory
from eectl.runtime.drafts import MIN_NGRAM, PromptLookup
from eectl.runtime.exit_logits import Decide
from eectl.runtime.feed import Feed, Prompts
from eectl.runtime.kv import KVBuffers
from eectl.runtime.placement import HOST, Placement
from eectl.runtime.policies import policy_class
from eectl.runtime.sampling import RowSampling, pick_token
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.slots import ROOM, Kept, Switch, narrowed, rebound, reused
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
        if "token" not in runtime.full_graphs[L].io.outputs or not chain_exits_supported(
            runtime, self.exits, self.signal
        ):  # graphs of an older eectl: no greedy token from the final head, or no block states for cosine-min
            raise ArtifactError(
                f"{runtime.folder} was exported by an older eectl: its graphs lack outputs this runner steps on",
                hint="export the artifact again with this version of eectl",
            )
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
            memory = DraftMemory(config.draft_memory, ngram) if config.draft_memory else None
            self.lookup = PromptLookup(
                config.prompt_drafts, ngram, min(MIN_NGRAM, ngram), min_draft=shortest, memory=memory
            )
        self.rng = np.random.default_rng(config.seed)
        if self.policy.checks_drafts:  # (greedy only: policies.py)
            # checks of drafts take the final head over several rows, packed (tables.py PackedHeads): its
            # session is made here, not inside the first decode step that checks (0.7-2 s on Gemma 3's 262K-token
            # table, which a one-prompt run and a bench's first repetition paid as decode time)
            self.rt.packed_head(L)
        self.last_kv: KVBuffers | None = None  # the cache of the last generate() call (bench: river's KV cosine)
        self._kept: Kept | None = None  # the last call's cache and chain, which the next call reuses (`_buffers`)
        # the placement of the call in progress: generate()'s own while it runs, else the host's
        self.place: Placement = HOST
        # the last generate()'s host reads, per step
        self.step_reads: list[list[tuple[str, int, str]]] = []
        # a batch's steps switch to full depth where the plan's configuration is priced slower (slots.py; the engine)
        self.switch: Switch | None = None
        # rows -> whether a chain over that many rows takes the certified head (timed where a server batches:
        # plan/batch.py `time_full`); a count not here: the configuration's `certified_head`
        self.heads: dict[int, bool] = {}

    # --- sampling ---------------------------------------------------------------------------------------------------
    def _pick(self, logits: np.ndarray, ids: np.ndarray | None = None, st: RowState | None = None) -> int:
        """Greedy or temperature/top-p sampling over logits [V] (or [K] with their vocabulary ids): with row `st`'s
        own settings and generator where it has them (an engine's request), else the run's."""
        if st is not None and st.sampling is not None:
            return st.sampling.pick(logits, ids)
        return pick_token(logits, ids, self.cfg.temperature, self.cfg.top_p, self.rng)

    def samples(self, st: RowState) -> bool:
        """Whether row `st` samples (its own setting, else the run's)."""
        return st.sampling.sampled if st.sampling is not None else self.cfg.temperature > 0

    def row_pick(self, st: RowState) -> Pick | None:
        """How the bound chain picks row `st`'s token where it samples (`_pick` with its settings); None where it is
        greedy (the graphs' argmax)."""
        return partial(self._pick, st=st) if self.samples(st) else None

    # --- exits -------------------------------------------------------------------------------------------------------
    def _decide_rows(self, layer: int, asks: dict[int, Decide]) -> dict[int, Answer]:
        """The exit test at `layer` for several rows' tokens at once (runtime/decide.py), on this call's placement."""
        return self.exit_test.rows(layer, asks, self.place)

    def _pick_score(self, score: ExitScore, i: int, st: RowState) -> int:
        """Row i's token from an exit's own prediction (computed once for all rows of the decision, on demand): its
        top-1 where row `st` is greedy and the decision knows it (decided in the graph), else picked from its logits
        (`_pick`: greedy or with the row's sampling)."""
        pred = score.prediction()  # numpy: the exit graphs' outputs
        if not self.samples(st) and pred.top1 is not None:
            return int(pred.top1[i])
        return self._pick(np.asarray(pred.logits[i]), None if pred.ids is None else np.asarray(pred.ids[i]), st)

    # --- teacher forcing --------------------------------------------------------------------------------------------
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
        per segment for the rows that run it (chain_steps.py `chain_tokens`).

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
        rows = [RowState(list(p), len(p), [None] * len(self.m.segments)) for p in prompts]
        self.run_feed(Prompts(rows), width, need, on_step, record=True)
        return [st.generation() for st in rows]

    def new_row(
        self, prompt: list[int], max_new_tokens: int | None = None, sampling: RowSampling | None = None
    ) -> RowState:
        """A row for `prompt` to give a feed (`run_feed`), with its own token budget and sampling (None: the run's)."""
        segments: list[np.ndarray | None] = [None] * len(self.m.segments)
        return RowState(list(prompt), len(prompt), segments, max_new_tokens=max_new_tokens, sampling=sampling)

    def run_feed(
        self,
        feed: Feed,
        width: int,
        need: int,
        on_step: Callable[[int, list[int]], None] | None = None,
        record: bool = False,
    ) -> None:
        """Step the rows of `feed` on `width` slots with room for `need` positions each until the feed ends
        (runtime/feed.py: `generate`'s prompts, or a server's requests arriving and leaving between steps).
        `on_step(key, confirmed)` as in `generate`; `record`: every step's host reads kept in `step_reads` (a
        generate call's; a server's feed runs unbounded and keeps none)."""
        kept = self._buffers(width, need)
        self.last_kv = kept.kv
        # the states on the device (the chain's buffers there), and every step's host reads recorded
        place = Placement(device=self._on_device(), record=record)
        self.step_reads = place.steps
        self.place = place
        try:
            self._loop(kept, feed, on_step, record)
        finally:
            self.place = HOST  # scoring, chat and cost timing run on the host (their own calls)

    def _loop(
        self, kept: Kept, feed: Feed, on_step: Callable[[int, list[int]], None] | None, record: bool = True
    ) -> None:
        """Steps until the feed ends. `seated[slot]` is the row in that slot of the cache; a row whose first step is
        still to run (its prefill: the whole prompt, always full depth) is `fresh`; a row the feed drops leaves its
        slot free before the step. Once no row waits, the rows still decoding narrow onto the fewest rows (slots.py);
        a row arriving after that steps on the whole batch's chain again."""
        kv, chain, rows = kept.kv, kept.chain, feed.rows
        seated: dict[int, int] = {}
        fresh: set[int] = set()

        def seat() -> None:  # fill the free slots with the next rows, in order
            for slot in range(kv.rows):
                if slot in seated or (i := feed.take()) is None:
                    continue
                seated[slot] = i
                fresh.add(slot)
                st = rows[i]
                if self.lookup is not None and st.lookup is None:
                    st.lookup = self.lookup.new_state()
                st.reused = reused(self.rt, kept, slot, st.tokens, self._pad())
                # what the slot's last prompt left beyond a prefix the new one shares is forgotten
                kv.rollback(slot, st.reused)
                kept.prompts[slot] = list(st.tokens)

        seat()
        while seated or feed.wait():
            for s in [s for s, i in seated.items() if feed.dropped(i)]:
                del seated[s]  # its rows' K/V are a finished row's: the next prompt in the slot cuts them
                fresh.discard(s)
            seat()
            if not seated:
                continue
            run, k, drain = self, kept, False  # the configuration this step runs (`Switch`) and its chains
            if self.switch is not None:
                run, k, drain = self.switch.pick(self, kept, [rows[i] for i in seated.values()])
                chain = rebound(self.rt, k, chain)
            # a row joining after the batch narrowed steps on the whole batch's chain again
            chain = narrowed(self.rt, k, chain, seated) if not feed.waiting() and not fresh else k.chain
            t0 = time.perf_counter()  # a step's time includes proposing and settling its drafts
            # a fresh row feeds its prompt after what its cache rows hold, the others their last token
            live: dict[int, tuple[RowState, list[int]]] = {}
            for s, i in seated.items():
                row = rows[i]
                live[s] = (row, row.tokens[row.reused :] if s in fresh else row.tokens[-1:])
            drafted: dict[int, int] = {}  # slot -> drafts from the context this step (RunConfig.prompt_drafts)
            lookup = None if drain else run.lookup
            if lookup is not None:
                stops, budget = self.cfg.stop_ids, self.cfg.max_new_tokens
                for s, i in seated.items():
                    if s not in fresh:
                        rows[i].lookup = rows[i].lookup or lookup.new_state()  # seated while full depth ran
                        drafted[s] = lookup.attach(rows[i], self.L, rows[i].budget(budget), stops)
            for s, n in drafted.items():
                if n:  # the row's last token, then its drafts: one wide pass through every layer
                    live[s] = (rows[seated[s]], rows[seated[s]].tokens[-n - 1 :])
            tokens = chain_tokens(run, chain, kv, live, fresh, drafted, k, force_full=drain)
            for s in tokens:
                if drafted.get(s):
                    assert lookup is not None
                    lookup.close(rows[seated[s]])
            took = time.perf_counter() - t0  # a row's latency is its batch step's: rows wait for each other
            fresh.clear()
            for s, token in tokens.items():
                i = seated[s]
                st = rows[i]
                st.emit(token, took)
                st.done = run._finished(s, st, kv, chain)
                if on_step is not None:
                    on_step(i, self._confirmed(st))
                if st.done:
                    del seated[s]
                    if self.lookup is not None and self.lookup.memory is not None:  # later requests draft from it
                        self.lookup.memory.remember(st.tokens)
            self.place.end_step()
            feed.stepped()
            if not record:  # a device-resident run records its reads whatever `record` says: a server keeps none
                self.place.steps.clear()
            seat()

    def forget_prompts(self, memory: bool = True) -> None:
        """The next prompts are fed whole (unless they share a beginning with each other): the cache's rows keep no
        prompt to reuse (slots.py `reused`), and (`memory`) drafts find nothing of the answers before
        (draft_memory.py `DraftMemory`). A bench's repetition starts so, or its prompts would find themselves."""
        if self._kept is not None:
            self._kept.prompts.clear()
        if memory and self.lookup is not None and self.lookup.memory is not None:
            self.lookup.memory.clear()

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
        self._kept = Kept(kv, self._chain(kv, width), copy.deepcopy(self.cfg), heads=self.heads)
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

    def _chain(self, kv: KVBuffers, rows: int, host: bool = False) -> DecodeChain:
        """The bound call chain a call steps on (runtime/chain_steps.py; `host`: its states in host buffers whatever
        the run's, for scoring and chat)."""
        return chain_for(self, kv, rows, host=host)

    @staticmethod
    def _confirmed(st: RowState) -> list[int]:
        end = len(st.tokens) if st.done or not st.drafts else min(p for p, _ in st.drafts)
        return st.tokens[st.prompt_len : end]

    def _finished(self, row: int, st: RowState, kv: KVBuffers, chain: DecodeChain) -> bool:
        generated = len(st.tokens) - st.prompt_len
        if st.tokens[-1] not in self.cfg.stop_ids and generated < st.budget(self.cfg.max_new_tokens):
            return False
        return self._settled(row, st, kv, chain)

    def _settled(self, row: int, st: RowState, kv: KVBuffers, chain: DecodeChain) -> bool:
        """Generation stops here: whatever the policy left unchecked is checked first (True), or a wrong draft was
        rolled back and generation continues from the corrected token (False). `chain`: the call's bound chain, which
        runs the closing pass (a batch's: on the row's slot's chain)."""
        if not self.policy.unchecked(st):
            return True
        n_before, t0 = len(st.tokens), time.perf_counter()
        if chain.rows > 1 and self._kept is not None:  # a batch: the row's slot's own chain
            chain = slot_chain(self, self._kept, row)
        extra = chain_step(self, chain, st, kv, force_full=True)
        if len(st.tokens) < n_before:  # a draft was wrong: continue from the corrected token
            st.emit(extra, time.perf_counter() - t0)
            return self._finished(row, st, kv, chain)
        st.exit_layers.pop()  # the look-ahead token is not emitted; its pass was decode time of the last token
        st.latencies[-1] += time.perf_counter() - t0
        return True
