"""#28: a KV policy is one class. A policy the runtime has never seen, defined here and registered for this module
only, and a subclass of no built-in policy (so nothing can know it by name or by base class), gets its device
binding plan from its class alone, and the runner runs it, one row and batched, on the host path and
device-resident. It is verify assembled from verify's hooks and class variables, so its plan is verify's and its
tokens are full depth's. Every step a device-resident run of either takes is one of the plan's step shapes."""

from __future__ import annotations

import pytest
import torch

from eectl.contracts.names import POLICY_SPECS, PolicySpec
from eectl.errors import UsageError
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.runtime.binding import plan_for
from eectl.runtime.policies import POLICIES, Defer, KVPolicy, PlanFragment, Verify, register_policy
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K

NAME = "recheck"


class Recheck(KVPolicy):
    """Exited tokens wait as pending positions and are drafts that the next final-depth pass checks: verify's
    behaviour, stated in this class's hooks and variables only."""

    name = NAME
    lossless = greedy_only = pending_states = exact_states = checks_drafts = checks_at_final = True
    scores_text = False
    fragment = PlanFragment(pending=True, draft_check=True, forced_pass=True)
    may_exit = Verify.may_exit
    unchecked = Verify.unchecked
    on_final = Verify.on_final

    def on_exit(self, row, st, kv, s, out, token):
        Defer.on_exit(self, row, st, kv, s, out, token)
        st.drafts.append((len(st.tokens), token))
        st.drafted += 1


@pytest.fixture(scope="module")
def rt(tiny_dirs, tmp_path_factory):
    """The tiny Llama exported (exits 2 and 4) while the new policy is registered: the artifact lists it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(POLICY_SPECS, NAME, PolicySpec(checks_drafts=True))  # its cost term: verify's
        mp.setitem(POLICIES, NAME, Recheck)  # removed again when the module is done
        register_policy(Recheck)
        art = tmp_path_factory.mktemp("policy-class") / "a"
        opts = ExportOptions(exits=EXPORT_EXITS, top_k=EXPORT_TOP_K, profile_costs=False, validate=False)
        export_artifact(load_model(str(tiny_dirs["llama"])), art, opts)
        yield ArtifactRuntime(art, provider="cpu")
    assert NAME not in POLICIES and NAME not in POLICY_SPECS


def _shape(calls) -> list:
    return [(c.graph, c.at, [(b.key, b.device) for b in c.bindings]) for c in calls]


def test_a_new_policy_gets_its_binding_plan_from_its_class(rt, monkeypatch):
    m, L = rt.manifest, rt.manifest.num_layers
    assert NAME in m.kv_policies
    for provider in ("cuda", "cpu"):
        for signal in ("topk-prob", "cosine"):
            plan = plan_for(m, provider, EXPORT_EXITS, signal, NAME)
            got = plan.scenarios()
            assert [_shape(c) for c in got] == [
                _shape(c) for c in plan_for(m, provider, EXPORT_EXITS, signal, "verify").scenarios()
            ]
            assert all(c[0].graph == "embed" for c in got)
    plan = plan_for(m, "cuda", EXPORT_EXITS, "topk-prob", NAME)
    forced = plan.token(None, pending=True, drafts=True, tests=False)  # a full block of drafts: no exit test
    assert [c.graph for c in forced if c.graph not in ("segment", "concat")] == ["embed", "exit_full"]
    assert [(c.graph, c.at, b.key) for c, b in plan.host_copies(forced)] == [("exit_full", L, "token")]
    assert [c.at for c in forced if c.graph == "concat"] == [1, 2]  # the drafts' pending states join the pass
    monkeypatch.setattr(Recheck, "fragment", None)  # a class without a fragment runs on the host path only
    with pytest.raises(UsageError, match="no binding plan"):
        plan_for(m, "cuda", EXPORT_EXITS, "topk-prob", NAME)


def _config(policy: str, resident: bool, exits: list[int]) -> RunConfig:
    # exit 2 always passes, exit 4 never: every token decided there is a draft (tests exit 2, not 4)
    thresholds = {2: {"prob": 0.0}, 4: {"prob": 2.0}}
    return RunConfig(exits, thresholds, "topk-prob", policy, EXPORT_TOP_K, max_new_tokens=12, device_resident=resident)


def _host_reads(calls) -> tuple:
    return tuple(sorted((c.graph, c.at, b.key) for c in calls for b in c.bindings if b.host_read))


def test_the_runner_runs_a_new_policy_and_the_plan_covers_its_steps(rt):
    """The new policy's tokens are full depth's and its exit layers and drafts verify's, one row and batched (rows
    riding along stop before the final segment: `checks_at_final`). Device-resident with one row, each step reads
    on the host what one of the plan's step shapes sends there (verify's forced full-depth pass and the closing
    check after an exited token among them), for the new policy and for verify."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, rt.manifest.dims["vocab_size"], (3 + 4 * i,), generator=g).tolist() for i in range(3)]
    L = rt.manifest.num_layers
    full = [x.token_ids for x in Runner(rt, _config("defer", False, [])).generate(prompts)]
    # the prompt's step: full depth, no exit test (the certified head first, where the artifact has one: the chain's)
    prefill = {(("exit_full", L, "token"),), (("head_certified", L, "passed"), ("head_certified", L, "token"))}
    for resident in (False, True):
        for rows in (prompts[:1], prompts):
            runners = {p: Runner(rt, _config(p, resident, list(EXPORT_EXITS))) for p in (NAME, "verify")}
            got = {p: r.generate(rows) for p, r in runners.items()}
            assert [x.token_ids for x in got[NAME]] == full[: len(rows)], (resident, len(rows))
            for attr in ("token_ids", "exit_layers", "drafted", "rejected_drafts"):
                assert [getattr(x, attr) for x in got[NAME]] == [getattr(x, attr) for x in got["verify"]], attr
            assert all(x.drafted for x in got[NAME])
            if not resident or len(rows) > 1:  # a batch's step reads once per call for all its rows
                continue
            for policy, runner in runners.items():
                plan = plan_for(rt.manifest, "cuda", list(EXPORT_EXITS), "topk-prob", policy)
                shapes = {*prefill, *(_host_reads(c) for c in plan.scenarios())}
                steps = [tuple(sorted(tuple(r) for r in step)) for step in runner.step_reads]
                assert steps and [s for s in steps if s not in shapes] == [], (policy, len(rows))


def test_a_new_policy_is_priced_from_its_spec(rt):
    """The cost model knows a policy by its spec (contracts/names.py), not its name: the new one, spec'd as verify
    is (`checks_drafts`, its exited states riding along), is priced as verify at every exit rate and precision. (`rt`:
    the spec is registered while the module's artifact lives.)"""
    from eectl.plan.choose import predict
    from tests.test_plan import BOUNDARIES, _costs

    assert NAME in POLICY_SPECS
    for per_exit in ([(4, 0.4, 1.0)], [(4, 0.7, 0.8)], [(4, 1.0, 0.6)]):
        mine = predict(_costs(), BOUNDARIES, NAME, per_exit)
        assert mine.ms_per_token == pytest.approx(predict(_costs(), BOUNDARIES, "verify", per_exit).ms_per_token)
        assert mine.lost_per_step == pytest.approx(predict(_costs(), BOUNDARIES, "verify", per_exit).lost_per_step)
