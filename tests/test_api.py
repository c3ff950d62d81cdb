"""The Python API (eectl/api): docs/api.md's examples run as written (on a tiny artifact); a call's greedy tokens are
`eectl run`'s; a stream's pieces make the whole answer's text; calls from several threads share the batch and each
gets its answer alone; stop strings cut the text; a closed stream frees its slot; text pieces never change once
given; `import eectl` stays light."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

import eectl
from eectl.api.text import TextStream
from eectl.cli import app
from eectl.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["12 clips in April", "the cat sat", "one two three", "a b c d", "hello", "7 more"]


@pytest.fixture(scope="module")
def artifact(exported) -> Path:
    return exported["llama"][1]  # the tiny Llama exported once for the session: exits 2 and 4, K = 8


@pytest.fixture(scope="module")
def model(artifact):
    with eectl.load(artifact, exits="none", max_batch=4, max_new_tokens=8) as m:
        yield m


def test_the_docs_examples_run(artifact):
    text = (ROOT / "docs" / "api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 4
    scope: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(block.replace('"artifacts/smollm2-135m-instruct"', repr(str(artifact))), scope)
    assert scope["answer"].finish_reason in ("stop", "length") and scope["answer"].tokens
    assert scope["pieces"].completion.text in out.getvalue()
    assert len(scope["answers"]) == 5 and all(a.tokens for a in scope["answers"])
    assert "\n" not in scope["reply"].text
    assert scope["answer"].text in out.getvalue()


def test_greedy_tokens_are_eectl_runs(model, artifact):
    for prompt in PROMPTS[:2]:
        got = CliRunner().invoke(app, ["run", str(artifact), prompt, "--exits", "none", "-n", "8", "--json"])
        assert got.exit_code == 0, got.output
        assert model.generate(prompt).tokens == json.loads(got.stdout)["results"][0]["token_ids"]


def test_a_streams_pieces_make_the_whole_text(model):
    whole = model.generate(PROMPTS[2], max_new_tokens=20)
    stream = model.generate(PROMPTS[2], max_new_tokens=20, stream=True)
    assert "".join(stream) == whole.text
    assert stream.completion is not None and stream.completion.tokens == whole.tokens


def test_threads_share_the_batch_and_each_gets_its_answer_alone(model):
    alone = [model.generate(p, max_new_tokens=4 + i).tokens for i, p in enumerate(PROMPTS)]
    got: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        got[i] = model.generate(PROMPTS[i], max_new_tokens=4 + i).tokens

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(PROMPTS))] == alone
    assert [len(t) for t in alone] == [4 + i for i in range(len(PROMPTS))]


def test_a_stop_string_cuts_the_text_before_it(model):
    whole = model.generate(PROMPTS[3], max_new_tokens=24, raw=True)
    stop = whole.text[5:7]
    assert len(stop) == 2 and whole.text.find(stop) == 5
    cut = model.generate(PROMPTS[3], max_new_tokens=24, raw=True, stop=[stop, "never seen"])
    assert cut.text == whole.text[:5] and cut.finish_reason == "stop"
    streamed = model.generate(PROMPTS[3], max_new_tokens=24, raw=True, stop=stop, stream=True)
    assert "".join(streamed) == whole.text[:5]


def test_closing_a_stream_frees_its_slot(model):
    stream = model.generate(PROMPTS[4], max_new_tokens=400, stream=True)
    next(stream)
    stream.close()
    assert stream.completion is not None and stream.completion.finish_reason == "cancelled"
    assert len(stream.completion.tokens) < 400 and model.engine.running == 0


def test_sampling_runs_beside_greedy_and_leaves_it_unchanged(model):
    greedy = model.generate(PROMPTS[5]).tokens
    sampled = model.generate(PROMPTS[5], temperature=0.9, top_p=0.9)
    assert len(sampled.tokens) == 8
    assert model.generate(PROMPTS[5]).tokens == greedy


def test_bad_calls_are_refused_in_one_line(model, artifact):
    with pytest.raises(UsageError, match="unknown run option"):
        eectl.load(artifact, exitz="none")
    with pytest.raises(UsageError, match="draft-memory must be >= 0"):
        eectl.load(artifact, draft_memory=-1)
    with pytest.raises(UsageError, match="exceeds the context"):
        model.generate(PROMPTS[0], max_new_tokens=600)
    with pytest.raises(UsageError, match="max_new_tokens"):
        model.generate(PROMPTS[0], max_new_tokens=0)
    with pytest.raises(UsageError, match="temperature"):
        model.generate(PROMPTS[0], temperature=-1)
    with pytest.raises(UsageError, match="messages"):
        model.chat([{"role": "robot", "content": "x"}])


class _Chars:
    """A tokenizer whose ids are characters; id 0 is half of a character (decoded as U+FFFD until id 1 follows)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = "".join("\ufffd" if i == 0 else chr(i) for i in ids)
        return text.replace("\ufffd" + chr(1), "é")


def test_text_pieces_never_change_once_given():
    s = TextStream(_Chars(), stop=["END"])
    ids = [ord(c) for c in "ab"]
    assert s.update(ids) == "ab"
    ids += [0]
    assert s.update(ids) == ""  # the half character waits
    ids += [1, ord("E"), ord("N")]
    assert s.update(ids) == "é"  # "EN" may begin the stop string: it waits
    ids += [ord("D"), ord("x")]
    assert s.update(ids) == "" and s.stopped and s.sent_text == "abé"
    t = TextStream(_Chars(), stop=["END"])
    assert t.update([ord("E")]) == "" and t.finish([ord("E"), ord("N")]) == "EN"  # no stop: the held tail at the end


def test_import_eectl_stays_light():
    code = "import eectl; assert callable(eectl.load) and eectl.Completion.__name__ == 'Completion'"
    heavy = "('torch', 'onnxruntime', 'transformers', 'fastapi')"
    light = f"import sys, eectl; print(sorted(m for m in {heavy} if m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, cwd=ROOT).stdout.strip() == "[]"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).returncode == 0


def test_a_batch_runs_full_depth_where_the_plan_prices_one_row(artifact, exported):
    """The engine resolves its configuration for the batch it runs: the plan's one-row default (lookup here) with one
    slot; with four, that default priced per batch size (plan/batch.py: tests/test_batch_switch.py), or full depth
    (said so) where the engine does not switch; a policy asked for in a batch anyway; lossless either way, so the
    tokens are the same."""
    from eectl.contracts.plan import LOOKUP, Choice, LookupChoice, Plan, Prediction
    from eectl.run.engine import Engine
    from eectl.run.generate import RunOptions
    from eectl.runtime.sessions import ArtifactRuntime
    from tests.conftest import make_calibration

    rt = ArtifactRuntime(artifact, provider="cpu")
    pred = Prediction(policy=LOOKUP, exits=[], ms_per_token=5.0, full_ms=10.0, speedup=2.0, decision_ms=0.0,
                      exit_rate=0.0, interval=(1.8, 2.2))  # fmt: skip
    choice = Choice(policy="verify", exits=[], thresholds={}, option=None, prediction=pred)
    look = LookupChoice(drafts=5, prediction=pred, on=True, tokens_per_step=2.5, min_draft=2)
    rt.manifest.plan = Plan(default=LOOKUP, choices={"verify": choice}, lookup=look)
    loaded = exported["llama"][0]
    rt.manifest.calibration = make_calibration(loaded, {2: {"prob": 0.9}, 4: {"prob": 0.9}})
    engines = [Engine(rt, RunOptions(), slots=s) for s in (1, 4)] + [Engine(rt, RunOptions(policy=LOOKUP), slots=4)]
    engines.append(Engine(rt, RunOptions(), slots=4, switch=False))
    try:
        one, four, asked, fixed = (e.config() for e in engines)
        assert (one.policy, one.prompt_drafts) == ("verify", 5) and engines[0].batching() is None
        assert (four.policy, four.prompt_drafts) == ("verify", 5) and "batch prices (lookup" in four.note
        assert (fixed.policy, fixed.exits, fixed.prompt_drafts) == ("defer", [], 0)
        assert "a batch of 4 runs full depth" in fixed.note
        assert (asked.policy, asked.prompt_drafts) == ("verify", 5) and engines[2].batching() is None
        prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11], [12, 13, 14, 15, 16]]
        tokens = [[g.token_ids for g in e.generate(prompts, 10)] for e in engines]
        assert tokens[0] == tokens[1] == tokens[2] == tokens[3] and all(len(t) == 10 for t in tokens[0])
        batching = engines[1].batching()
        assert batching is not None and sum(batching["steps"].values()) > 0
    finally:
        for e in engines:
            e.stop()


def test_max_prefills_seats_new_requests_one_a_step_with_the_same_tokens(artifact):
    """`max_prefills=1`: requests arriving together are seated one per step (each one's first token a step after
    the previous one's), not all in the first step; every answer is the same either way."""
    from eectl.run.engine import Engine, Job
    from eectl.run.generate import RunOptions
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(artifact, provider="cpu")
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
    firsts: dict[int | None, list[int]] = {}
    answers = {}
    for admit in (None, 1):
        engine = Engine(rt, RunOptions(exits="none"), slots=4, admit=admit)
        seen: dict[int, int] = {}
        done = threading.Semaphore(0)
        gens: dict[int, list[int]] = {}

        def step(i: int, confirmed: list[int], seen=seen, engine=engine) -> None:
            seen.setdefault(i, engine.steps)  # the steps taken before this one: its first token's step

        def end(i: int, gen, error, gens=gens, done=done) -> None:
            gens[i] = gen.token_ids
            done.release()

        jobs = [
            Job(p, 6, on_step=lambda c, i=i: step(i, c), on_done=lambda g, e, i=i: end(i, g, e))
            for i, p in enumerate(prompts)
        ]
        with engine._cond:  # all four queued before the worker seats any
            for job in jobs:
                engine._pending.append(job)
            engine._cond.notify_all()
        for _ in jobs:
            done.acquire()
        engine.stop()
        firsts[admit] = [seen[i] for i in range(len(prompts))]
        answers[admit] = gens
    assert firsts[None] == [0, 0, 0, 0] and firsts[1] == [0, 1, 2, 3]
    assert answers[None] == answers[1] and all(len(t) == 6 for t in answers[1].values())
