"""Rows joining a running batch and leaving it early (runtime/feed.py, `Runner.run_feed`): a row that arrives while
others decode (after the batch narrowed, too) and the rows beside one dropped halfway get the tokens they get alone,
at full depth and with exits; a dropped row's slot takes the next row."""

from __future__ import annotations

import pytest

from eectl.runtime.feed import Feed
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from tests.conftest import EXPORT_EXITS, EXPORT_TOP_K

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18], [19, 20], [21, 22, 23, 24]]


class Scripted(Feed):
    """Rows arriving before given steps (key -> step) and dropped before given steps, each with its own budget."""

    def __init__(self, runner: Runner, arrive: dict[int, int], drop: dict[int, int], budget: dict[int, int]) -> None:
        super().__init__()
        self.arrive, self.drop = dict(arrive), drop
        self.rows = {k: runner.new_row(PROMPTS[k], budget[k]) for k in arrive}
        self.steps = 0
        self.left: list[int] = []

    def waiting(self) -> bool:
        for k in sorted(k for k, at in self.arrive.items() if at <= self.steps):
            self.queue.append(k)
            del self.arrive[k]
        return bool(self.queue)

    def take(self) -> int | None:
        self.waiting()
        return super().take()

    def dropped(self, key: int) -> bool:
        if self.drop.get(key) == self.steps:
            self.left.append(key)
            return True
        return False

    def wait(self) -> bool:
        while self.arrive and not self.waiting():
            self.steps += 1  # nothing seated: time passes until the next arrival
        return self.waiting()

    def stepped(self) -> None:
        self.steps += 1


@pytest.fixture(scope="module")
def runtime(exported):
    return ArtifactRuntime(exported["llama"][1], provider="cpu")


def _runner(rt, exits, new):
    thr = {e: {"prob": 0.3} for e in exits}
    cfg = RunConfig(exits=list(exits), thresholds=thr, policy="defer", top_k=EXPORT_TOP_K, max_new_tokens=new)
    return Runner(rt, cfg)


@pytest.mark.parametrize("exits", [(), tuple(EXPORT_EXITS)])
def test_rows_joining_and_leaving_a_running_batch_get_their_tokens_alone(runtime, exits):
    budget = {0: 12, 1: 3, 2: 10, 3: 8, 4: 5}
    alone = {k: _runner(runtime, exits, n).generate([PROMPTS[k]])[0].token_ids for k, n in budget.items()}
    runner = _runner(runtime, exits, 128)  # the rows' own budgets decide
    # 0 and 1 at once; 3 after 1 step, dropped before step 5; 2 after 2 steps; 4 once the others are done but 0,
    # on a batch narrowed to fewer rows (full depth)
    feed = Scripted(runner, arrive={0: 0, 1: 0, 2: 2, 3: 1, 4: 9}, drop={3: 5}, budget=budget)
    runner.run_feed(feed, 4, 64)
    assert feed.left == [3] and feed.steps >= 12
    for k in (0, 1, 2, 4):
        st = feed.rows[k]
        assert st.done and st.tokens[st.prompt_len :] == alone[k], k
    three = feed.rows[3]
    got = three.tokens[three.prompt_len :]
    assert not three.done and 0 < len(got) < budget[3] and got == alone[3][: len(got)]
    if not exits:  # row 4 joined after the batch narrowed (one row decoding of four)
        assert runner._kept is not None and runner._kept.narrow
