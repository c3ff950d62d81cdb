"""Weight tiers (runtime/tiers.py) on a tiny model exported with every tensor aligned (so ORT maps them all): mapped
weights and a memory budget give the same tokens as today's sessions; the slow tier really leaves memory after each
call and is read from the file again (mincore, /proc/self/io); placement on two CPU sessions changes nothing;
bad budgets, shrunk files and bad placements fail with one line."""

from __future__ import annotations

import gc
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from eectl.cli import app
from eectl.errors import ArtifactError, UsageError
from eectl.export import graphs
from eectl.export.exporter import ExportOptions, export_artifact
from eectl.models import load_model
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from eectl.runtime.tiers import WeightOptions, load_tiers, parse_place, parse_size, resident_bytes

EXITS = [2, 4]
PROMPT = [5, 9, 14, 3, 22, 17, 8, 30, 11]


@pytest.fixture(scope="module")
def aligned(tiny_dirs, tmp_path_factory):
    """The tiny Llama exported with every external tensor 64 KiB-aligned (the default model's large tensors are)."""
    folder = tmp_path_factory.mktemp("tiers") / "llama"
    mp = pytest.MonkeyPatch()
    mp.setattr(graphs, "EXTERNAL_ALIGN_MIN_BYTES", 0)
    try:
        export_artifact(load_model(str(tiny_dirs["llama"])), folder, ExportOptions(exits=EXITS, top_k=8))
    finally:
        mp.undo()
    return folder


def _runtime(folder, **weights):
    gc.collect()  # another live runtime's mapping of these files would keep their pages cached
    opts = WeightOptions(**weights)
    rt = ArtifactRuntime(folder, provider="cpu", lazy_segments=opts.active)
    if opts.active:
        load_tiers(rt, opts)
    return rt


def _first_mapped(folder) -> int:
    """Segment 0's mapped bytes (a budget that holds exactly it), from a runtime dropped again."""
    rt = _runtime(folder, mmap=True)
    n = rt.tiers.segments[0].mapped
    rt.tiers.close()
    del rt
    gc.collect()
    return n


def _generate(rt, policy="defer", exits=(), thresholds=None, new=12):
    thr = {e: {"prob": t} for e, t in (thresholds or {}).items()}
    cfg = RunConfig(exits=list(exits), thresholds=thr, policy=policy, top_k=8, max_new_tokens=new)
    return Runner(rt, cfg).generate([PROMPT])[0]


def test_sizes_and_places_parse():
    assert parse_size("200M", None) == 200 << 20
    assert parse_size("1.5G", None) == int(1.5 * (1 << 30))
    assert parse_size("300MB", None) == 300 << 20
    assert parse_size("50%", 1000) == 500
    assert parse_size("4096", None) == 4096
    for bad in ("", "lots", "-1M", "0", "150%", "0%", "12X"):
        with pytest.raises(UsageError):
            parse_size(bad, 1000)
    assert parse_place("0-1:cpu,2:cpu", 3) == {0: "cpu", 1: "cpu", 2: "cpu"}
    for bad, segments in (("0-1:tpu", 3), ("0-5:cpu", 3), ("1-0:cpu", 3), ("0:cpu,0:cpu", 3), ("cpu", 3)):
        with pytest.raises(UsageError):
            parse_place(bad, segments)


def test_mapped_weights_same_tokens(aligned):
    ref = _generate(ArtifactRuntime(aligned, provider="cpu"))
    rt = _runtime(aligned, mmap=True)
    tiers = rt.tiers
    assert all(s.mapped > 0 and s.unmapped == 0 for s in tiers.segments)  # every tensor aligned: all mapped
    assert _generate(rt).token_ids == ref.token_ids
    mem = tiers.resident()
    assert mem["mapped_weight_resident_bytes"] > 0 and mem["rss"] > 0
    assert not tiers.slow and tiers.counters.read_bytes == 0


def test_mapped_weights_keep_the_lm_head_unpacked(aligned):
    """A head over several rows (a batch's chain, verify's check) runs on the shared, mapped table where the run maps
    its weights or holds them to a budget: a packed copy would be the table's size again in anonymous memory. The
    batch's tokens are the same as with the packed head of a plain runtime."""
    import numpy as np

    from eectl.runtime.batch import new_batch_kv
    from eectl.runtime.chain import DecodeChain

    prompts = [PROMPT, PROMPT[:4], PROMPT[3:]]
    cfg = RunConfig(exits=[], thresholds={}, max_new_tokens=6, certified_head=False)  # the full head every step
    plain = ArtifactRuntime(aligned, provider="cpu")
    L, H = plain.manifest.num_layers, plain.manifest.dims["hidden_size"]
    assert plain.packed_head(L) is not None
    want = [g.token_ids for g in Runner(plain, cfg).generate(prompts)]
    for weights in ({"mmap": True}, {"budget": str(2 * _first_mapped(aligned))}):
        rt = _runtime(aligned, **weights)
        assert rt.packed_head(L) is None
        chain = DecodeChain(rt, new_batch_kv(rt, 2, 8), 0, rows=2)
        assert chain.calls[-1][0] is rt.full_graphs[L].session  # not a packed session
        rt.greedy_token(L, np.zeros((3, H), np.float32))
        assert [g.token_ids for g in Runner(rt, cfg).generate(prompts)] == want
        assert not rt.packed_heads._sessions  # no packed head was made
        rt.tiers.close()


def test_budget_slow_tier_reads_per_call(aligned):
    ref = _generate(ArtifactRuntime(aligned, provider="cpu"), exits=EXITS, thresholds={2: 0.3, 4: 0.3})
    full = ArtifactRuntime(aligned, provider="cpu")
    first = _first_mapped(aligned)
    rt = _runtime(aligned, budget=str(first))  # segment 0 fits, 1 and 2 are the slow tier
    tiers = rt.tiers
    assert [s.slow for s in tiers.segments] == [False, True, True]
    slow = [r for s in tiers.slow for f in s.files for r in f.ranges]
    assert resident_bytes(slow) == 0  # released after load
    gen = _generate(rt, exits=EXITS, thresholds={2: 0.3, 4: 0.3})
    assert gen.token_ids == ref.token_ids and gen.exit_layers == ref.exit_layers
    assert resident_bytes(slow) == 0  # released after every call
    c = tiers.counters
    # each call of a slow segment paged its whole graph back in: mincore saw every mapped byte before the release
    per_call = {s.index: s.mapped for s in tiers.slow}
    assert c.paged_bytes == sum(per_call[s] * n for s, n in c.calls.items())
    if c.read_bytes:  # the file system counts reads (ext4 does; tmpfs has no storage to read from)
        assert c.read_bytes >= 0.9 * c.paged_bytes
    # full depth: every token reaches every slow segment, so the histogram's prediction is the calls' bytes
    tiers.reset()
    gen = _generate(rt)
    predicted = tiers.predicted_bytes(gen.exit_layers)
    assert predicted == len(gen.token_ids) * sum(s.mapped for s in tiers.slow)
    assert c is not tiers.counters and abs(tiers.counters.paged_bytes / predicted - 1) < 0.15
    assert gen.token_ids == _generate(full).token_ids
    report = tiers.report(gen.exit_layers)
    assert report["slow_segments"] == [1, 2] and report["tokens"] == len(gen.token_ids)
    json.dumps(report)


def test_budget_smaller_than_a_segment(aligned):
    with pytest.raises(UsageError, match="smaller than one segment"):
        _runtime(aligned, budget="1K")


def test_file_shrunk_under_the_mapping(aligned, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(aligned, folder)
    first = _first_mapped(folder)
    rt = _runtime(folder, budget=str(first))
    path = rt.tiers.slow[-1].files[0].path
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ArtifactError, match="shrank under its mapping"):
        _generate(rt)


def test_placement_on_two_cpu_sessions(aligned):
    ref = _generate(ArtifactRuntime(aligned, provider="cpu"), exits=EXITS, thresholds={2: 0.3, 4: 0.3})
    rt = _runtime(aligned, place="0:cpu,1-2:cpu")
    assert rt.tiers.report([])["placement"] == {"0": "cpu", "1": "cpu", "2": "cpu"}
    gen = _generate(rt, exits=EXITS, thresholds={2: 0.3, 4: 0.3})
    assert gen.token_ids == ref.token_ids and gen.exit_layers == ref.exit_layers
    with pytest.raises(UsageError, match="leaves the artifact's segments"):
        _runtime(aligned, place="0-3:cpu")


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["--memory-budget", "1K"], 2, "smaller than one segment"),
        (["--memory-budget", "lots"], 2, "cannot read the size"),
        (["--place", "0-1:tpu"], 2, "unknown provider"),
        (["--place", "0-9:cpu"], 2, "leaves the artifact's segments"),
    ],
)
def test_cli_refuses_bad_weight_options(aligned, args, code, text):
    res = CliRunner().invoke(app, ["run", str(aligned), "hi", "--raw", "-n", "2", *args])
    assert res.exit_code == code, res.output
    assert text in res.output and "Traceback" not in res.output


def test_cli_run_json_reports_memory(aligned):
    first = _first_mapped(aligned)
    res = CliRunner().invoke(
        app, ["run", str(aligned), "hi", "--raw", "-n", "3", "--memory-budget", str(first), "--exits", "none", "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    mem = doc["memory"]
    assert mem["slow_segments"] == [1, 2] and mem["tokens"] == 3
    assert mem["slow_bytes_per_token_predicted"] > 0
    assert 0.85 < mem["measured_over_predicted"] < 1.15


def test_bench_memory_section(aligned):
    """bench under a budget: every configuration on the same tiers, bytes per token measured and predicted."""
    from tests.tiny import GSM8K

    first = _first_mapped(aligned)
    args = ["bench", str(aligned), "--data", str(GSM8K), "--prompts", "2", "--max-new-tokens", "6", "--reps", "1"]
    args += ["--policies", "full,verify", "--thresholds", "0.3", "--ppl-tokens", "0", "--sweep", "", "--raw"]
    res = CliRunner().invoke(app, [*args, "--memory-budget", str(first), "--json", "--threads", "1"])
    assert res.exit_code == 0, res.output
    mem = json.loads(res.stdout)["memory"]
    assert mem["slow_segments"] == [1, 2] and mem["resident"]["rss"] > 0
    full = mem["configs"]["full"]
    assert full["tokens"] > 0 and full["agree"] is True  # full depth: every token reads the whole slow tier
    assert mem["configs"]["verify"]["slow_mb_per_token_predicted"] <= full["slow_mb_per_token_predicted"]


def test_the_plan_is_priced_in_the_tier_under_a_budget(aligned, tmp_path):
    """#32 item 4: under a memory budget the artifact's costs (timed with every segment resident) are re-timed
    through the tier's sessions, so the slow segments are timed cold, as a run reads them, and the plan is chosen on
    those; the costs say the budget they were timed under, and the run's counters start after the timing."""
    from eectl.contracts.manifest import write_manifest
    from eectl.run.generate import RunOptions, open_runner, replan

    art = tmp_path / "art"
    shutil.copytree(aligned, art)
    resident = ArtifactRuntime(art, provider="cpu")
    replan(resident, budget_s=0)  # an artifact with costs and a plan, timed with everything resident
    assert resident.manifest.costs is not None and resident.manifest.costs.memory_budget is None
    write_manifest(resident.manifest, art)
    del resident
    first = _first_mapped(art)
    rt = _runtime(art, budget=str(first))
    timing = rt.tiers.counters
    replan(rt, budget_s=0)
    assert rt.manifest.costs.memory_budget == rt.tiers.budget == first
    assert set(timing.calls) == {1, 2} and all(n > 0 for n in timing.calls.values())  # the timing read the slow tier
    assert rt.tiers.counters is not timing and rt.tiers.counters.calls == {}  # the run's counters start afresh
    rt.tiers.close()
    del rt
    gc.collect()
    # run re-prices by itself under a budget (no --profile-costs needed), and says so
    notes: list[str] = []
    opts = RunOptions(exits="none", max_new_tokens=2, weights=WeightOptions(budget=str(first)))
    rt, _, config, _ = open_runner(art, opts, note=notes.append)
    assert rt.manifest.costs.memory_budget == first and any(
        "re-timing the graphs under the memory budget" in n for n in notes
    )
    rt.tiers.close()
    # without a slow tier nothing is re-timed
    notes.clear()
    rt, _, _, _ = open_runner(art, RunOptions(exits="none", max_new_tokens=2), note=notes.append)
    assert rt.manifest.costs.memory_budget is None and not any("re-timing" in n for n in notes)
