"""Would a tree of drafts pay? Several draft branches from the context, checked in one wide pass, against the one
branch lookup drafts today, replayed exactly and priced with an artifact's own costs (#65 item 2).

    flock /tmp/eectl-heavy.lock .venv/bin/python benchmarks/tree_replay.py ARTIFACT \
        --data ../shared/data/gsm8k/train.jsonl --offset 3000 --prompts 64 --max-new-tokens 96 --threads 2

Generates each prompt's full-depth greedy answer (what lossless drafting emits), then replays decoding them as verify
with drafts from the context does (runtime/drafts.py `replay`: exact, no model run: a draft is accepted exactly where
it equals the answer), with the answers remembered in order as a server's runner does (runtime/draft_memory.py).
A step of B branches drafts, besides the latest occurrence's continuation, those after other earlier occurrences of
the context's suffix whose first token differs (longest suffix first, latest first), then the memory's draft: the
step accepts the longest prefix any branch shares with the answer, and its wide pass covers every branch's positions
(one position for the row's token plus each branch's drafts; distinct first tokens share no prefix). `--side N` caps
every branch but the first at N drafts. Each step is priced at the artifact's timed wide pass of its width
(`Costs.wide_ms`, plan/lookup.py `predict_lookup`, as calibration prices lookup), so the figures are predictions on
this machine's costs; a tree's mask and the rollback of its other branches would cost more, not less. `--answers
FILE` keeps the generated answers (and reads them back when FILE exists).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from eectl.contracts.plan import DEFAULT_DRAFTS, LookupStats
from eectl.data import encode_prompt, load_text_data
from eectl.plan.lookup import predict_lookup
from eectl.run.generate import RunOptions, load_tokenizer, resolve_config
from eectl.runtime.draft_memory import DraftMemory
from eectl.runtime.drafts import PromptLookup, cut_at_stop, suffix_matches
from eectl.runtime.ort import init_ort
from eectl.runtime.runner import Runner
from eectl.runtime.sessions import ArtifactRuntime


def answers(a: argparse.Namespace, rt: ArtifactRuntime) -> list[tuple[list[int], list[int]]]:
    if a.answers and Path(a.answers).exists():
        return [(p, q) for p, q in json.loads(Path(a.answers).read_text())]
    tok = load_tokenizer(rt)
    texts = load_text_data(a.data).prompts[a.offset : a.offset + a.prompts]
    stop = tuple(rt.manifest.eos_token_ids)
    runner = Runner(rt, resolve_config(rt, RunOptions(exits="none", max_new_tokens=a.max_new_tokens), stop))
    pairs = []
    for text in texts:
        ids = encode_prompt(tok, text, False)
        (g,) = runner.generate([ids])
        pairs.append((ids, list(g.token_ids)))
    if a.answers:
        Path(a.answers).write_text(json.dumps(pairs))
    return pairs


def branches(
    lk: PromptLookup, tokens: list[int], limit: int, b: int, side: int, stop: tuple[int, ...]
) -> list[list[int]]:
    """Up to `b` drafts with distinct first tokens: continuations of earlier occurrences of the context's suffix
    (longest suffix first, latest occurrence first), then the memory's; the first is lookup's own draft."""
    arr, n_tok, out = np.asarray(tokens, dtype=np.int64), len(tokens), []
    for n in range(min(lk.max_ngram, n_tok - 1), lk.min_ngram - 1, -1):
        for i in suffix_matches(arr, n)[::-1]:
            cap = limit if not out else min(limit, side)
            d = cut_at_stop(arr[i + n : i + n + cap].tolist(), stop)
            if d and all(c[0] != d[0] for c in out):
                out.append(d)
            if len(out) >= b:
                return out
    if lk.memory is not None and len(out) < b:
        d = lk.memory.find(tokens, limit if not out else min(limit, side), stop)
        if d and all(c[0] != d[0] for c in out):
            out.append(d)
    return out


def _agreed(draft: list[int], truth: list[int]) -> int:
    """How many of `draft`'s first tokens equal the answer's (`truth` is at least as long)."""
    return next((i for i, (d, t) in enumerate(zip(draft, truth[: len(draft)], strict=True)) if d != t), len(draft))


def replay_tree(pairs: list[tuple[list[int], list[int]]], b: int, side: int, memory: int, stop: tuple[int, ...]):
    kept = DraftMemory(memory) if memory else None
    lk = PromptLookup(DEFAULT_DRAFTS, memory=kept)
    widths: Counter[int] = Counter()
    tokens_out = 0
    for prompt, answer in pairs:
        ls = lk.new_state()
        tokens = [*prompt, *answer[:1]]
        while len(tokens) - len(prompt) < len(answer):
            done = len(tokens) - len(prompt)
            limit = min(len(answer) - done - 1, ls.span)
            got = branches(lk, tokens, limit, b, side, stop) if len(tokens) >= ls.resume_at and limit >= 1 else []
            if got:
                truth = answer[done : done + limit]
                acc = max(_agreed(c, truth) for c in got)
                tokens += truth[:acc]
                lk.settle(ls, len(got[0]), min(acc, len(got[0])), len(tokens))
            widths[1 + sum(len(c) for c in got)] += 1
            tokens.append(answer[len(tokens) - len(prompt)])
        tokens_out += max(0, len(answer) - 1)
        if kept is not None:
            kept.remember([*prompt, *answer])
    return tokens_out, widths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--offset", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--branches", default="1,2,3,4")
    ap.add_argument("--side", type=int, default=DEFAULT_DRAFTS)
    ap.add_argument("--draft-memory", type=int, default=32768)
    ap.add_argument("--answers", help="JSON of (prompt ids, answer ids) pairs: written after generating, else read")
    a = ap.parse_args()
    init_ort(a.threads)
    rt = ArtifactRuntime(a.artifact, provider="cpu", threads=a.threads)
    pairs = answers(a, rt)
    stop = tuple(rt.manifest.eos_token_ids)
    costs = rt.manifest.costs
    assert costs is not None and costs.wide_ms, "the artifact's costs have no wide-pass timings"
    print(
        f"{a.artifact}: {len(pairs)} prompts, {sum(len(q) for _, q in pairs)} answer tokens, side branches <= {a.side}"
    )
    print("| branches | tokens per step | mean pass width | predicted vs full depth |")
    print("|---|---|---|---|")
    for b in (int(x) for x in a.branches.split(",")):
        tokens, widths = replay_tree(pairs, b, a.side, a.draft_memory, stop)
        steps = sum(widths.values())
        stats = LookupStats(
            max_draft=DEFAULT_DRAFTS, min_draft=1, max_ngram=5, prompts=len(pairs), tokens=tokens,
            steps={str(w): n for w, n in sorted(widths.items())}, drafted=0, accepted=0, per_prompt=[],
        )  # fmt: skip
        pred = predict_lookup(costs, stats)
        assert pred is not None
        mean_width = sum(w * n for w, n in widths.items()) / steps
        print(f"| {b} | {tokens / steps:.3f} | {mean_width:.2f} | {pred.speedup:.3f}x |")


if __name__ == "__main__":
    main()
