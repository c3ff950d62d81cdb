"""The train-heads comparison of issue #13, as steps that each fit a few minutes (run them under the heavy lock):

    python scripts/heads_table.py build --cache artifacts/states --text 16000 --gen 4000
    python scripts/heads_table.py train --cache artifacts/states --design mlp --tokens 20000 --loss topk
    python scripts/heads_table.py calib --cache artifacts/states --heads artifacts/heads-mlp.safetensors

`build` computes the frozen base's states once (eectl.heads.state_cache; with more --layers than a complete cache
holds, and
the same budgets, it widens that cache: no generation again); `train` trains one design from them
(eectl.heads.cached); `calib` fits calibrate's sequential thresholds (--confidence 0.95) on half of the held-out
split and replays them on the other half, counting each head's cost in decoder-layer units. `merge` joins heads
files trained at disjoint exits (--heads A,B --out M).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _progress(total: int, what: str):
    start = time.perf_counter()
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        el = time.perf_counter() - start
        rate = done[0] / max(el, 1e-9)
        eta = (total - done[0]) / max(rate, 1e-9)
        print(f"\r{what}: {done[0]}/{total} tokens, {rate:.0f} tokens/s, ETA {eta:.0f} s   ", end="", file=sys.stderr)

    return tick


def build(a: argparse.Namespace) -> None:
    from eectl.data import load_text_data
    from eectl.heads.state_cache import CacheSpec
    from eectl.heads.state_cache_build import build_cache
    from eectl.models import load_model

    loaded = load_model(a.model)
    spec = CacheSpec(
        layers=[int(x) for x in a.layers.split(",")],
        text_tokens=a.text,
        gen_tokens=a.gen,
        eval_text_tokens=a.eval_text,
        eval_gen_tokens=a.eval_gen,
        gen_batch=a.gen_batch,
    )
    total = a.text + a.gen + a.eval_text + a.eval_gen
    cache = build_cache(loaded, load_text_data(a.data), spec, Path(a.cache), _progress(total, "states"), print)
    print(json.dumps(cache.describe(), indent=1))
    if "widen" in cache.timing:  # a widen prints its own rate; build_s adds the widen's seconds to the build's
        print(f"widen: {cache.timing['widen']:.0f} s (the run that finished it)")
    else:
        print(f"{total / cache.build_s:.1f} tokens/s over this build's {cache.build_s:.0f} s (files there count)")


def train(a: argparse.Namespace) -> None:
    from eectl.heads.cached import train_cached
    from eectl.heads.checkpoint import checkpoint_path
    from eectl.heads.config import TrainConfig
    from eectl.heads.state_cache import open_cache
    from eectl.models import load_model

    loaded = load_model(a.model)
    cache = open_cache(Path(a.cache))
    steps = max(1, a.tokens // a.batch)
    cfg = TrainConfig(
        exits=[int(x) for x in a.layers.split(",")],
        design=a.design,
        rank=a.rank,
        block_init=a.block_init,
        steps=steps,
        lr=a.lr,
        batch_tokens=a.batch,
        seed=a.seed,
        loss=a.loss,
        tail_samples=None if a.tail < 0 else a.tail,
        shortlist=a.shortlist,
        precision=a.precision,
        sources=tuple(a.sources.split(",")),
        save_every=max(10, steps // 10),
        eval_tokens=a.eval_report,
    )
    start = time.perf_counter()

    def on_step(step: int, tokens: int, kl: dict[int, float]) -> None:
        el = time.perf_counter() - start
        rate = step / max(el, 1e-9)
        print(
            f"\rstep {step}/{steps}, {tokens} tokens, {tokens / el:.0f} tokens/s, ETA {(steps - step) / rate:.0f} s, "
            + "KL "
            + " ".join(f"{k}:{v:.2f}" for k, v in kl.items()),
            end="",
            file=sys.stderr,
        )

    out = Path(a.out or f"artifacts/heads-{a.design}-{a.loss}.safetensors")
    resume = checkpoint_path(out) if a.resume else None
    res = train_cached(loaded, cache, cfg, out, resume, on_step, print)
    print(file=sys.stderr)
    assert res.meta is not None
    m = res.meta.model_dump(mode="json")
    print(json.dumps({"out": str(out), "training": m["training"], "head_cost": m["head_cost"]}, indent=1))
    for b, x in zip(m["report"]["before"]["exits"], m["report"]["after"]["exits"], strict=True):
        print(
            f"exit {b['layer']}: agree {b['agreement']:.3f} -> {x['agreement']:.3f}  KL {b['kl']:.2f} -> {x['kl']:.2f}"
            f"  cov0.99 full {x['coverage_full']:.1%} top-k {x['coverage_topk']:.1%}"
        )
    r = m["report"]["after"]
    print(f"oracle mean layers {r['oracle_mean_layers']:.2f}; in-sample sequential {r['sequential_mean_layers']:.2f}")


@torch.no_grad()
def _heads(a: argparse.Namespace, loaded) -> tuple[list[int], dict, str, float]:
    """--heads (or the logit lens at --layers): exits, heads by layer, design, cost per exit passed in layers."""
    from eectl.exits.designs import load_heads
    from eectl.heads.cached import design_cost

    if not a.heads:
        return [int(x) for x in a.layers.split(",")], {}, "logit lens", 0.0
    hs = load_heads(a.heads, loaded)
    cost = design_cost(loaded.adapter, hs.meta.design, hs.meta.rank)["layers"]
    if a.head_cost is not None:  # e.g. the exported head's measured cost (`eectl export`: block_heads)
        cost = a.head_cost
    return hs.exits, hs.heads, hs.meta.design, cost


def _exit_states(seq, exits: list[int], heads: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A cached sequence's measured positions and each exit's state there, as ExitScorer reads it: a sequence head
    (the block) already run over the whole sequence, a token head not (the scorer runs it, with its probe)."""
    idx = torch.nonzero(seq.measured).flatten()
    mapped = []
    for layer in exits:
        h = seq.states[layer].float()
        head = heads.get(layer)
        mapped.append(head(h)[idx] if getattr(head, "sequence", False) else h[idx])
    return idx, mapped


def calib(a: argparse.Namespace) -> None:
    """Calibrate's sequential thresholds (--signal, default topk-prob; K = 64) through the heads on the cache's
    held-out split: fitted on its first half of sequences (per source), replayed on the second; mean executed layers
    counting head cost."""
    from eectl.calibrate.fit import fit
    from eectl.exits.measure import SOURCES, ExitScorer, Measurements
    from eectl.exits.thresholds import assign_exits
    from eectl.heads.state_cache import open_cache
    from eectl.models import load_model

    loaded = load_model(a.model)
    adapter = loaded.adapter
    cache = open_cache(Path(a.cache))
    exits, heads, design, cost = _heads(a, loaded)
    scorer = ExitScorer(adapter, exits, a.signal, a.top_k, heads)
    parts = []
    for u, entry in enumerate(cache.split("held")):
        seq = cache.load(entry)
        idx, mapped = _exit_states(seq, exits, heads)
        values, correct, _ = scorer.score(mapped, None, seq.final[idx].float())
        src = SOURCES.index("teacher-forced" if entry.source == "text" else "generated")
        n = idx.numel()
        parts.append(
            Measurements(exits, adapter.num_layers, values, correct, torch.full((n,), src), torch.full((n,), u))
        )
    meas = Measurements.concat(parts)
    L = adapter.num_layers
    for conf in (None, 0.95):
        res = fit(meas, a.target, conf, a.holdout)
        held = meas.heldout_mask(a.holdout)
        taken = assign_exits(meas.values, res.thresholds)[held]
        active = [e == 0 or all(t < float("inf") for t in res.thresholds[e].values()) for e in range(len(exits))]
        layers = torch.tensor([*exits, L], dtype=torch.float64)[taken]
        paid = torch.tensor(
            [cost * sum(1 for e in range(min(t, len(exits) - 1) + 1) if active[e]) for t in taken.tolist()],
            dtype=torch.float64,
        )
        o = res.heldout
        assert o is not None
        print(
            f"{design}: target {a.target} confidence {conf}: held-out tokens {o.tokens}, exit rate {o.exit_rate:.3f}, "
            f"precision {o.precision}, mean layers {o.mean_layers:.2f}, "
            f"with head cost {float((layers + paid).mean()):.2f}"
            f" (head {cost:.3f} layers per exit passed); per exit "
            + ", ".join(f"{x.layer}: {x.heldout.coverage:.3f}" if x.heldout else f"{x.layer}: -" for x in res.exits)
        )
        for name, st in res.heldout_by_source.items():  # generated = the distribution `eectl run` sees
            print(
                f"  {name}: held-out tokens {st.tokens}, exit rate {st.exit_rate:.3f}, precision {st.precision}, "
                f"mean layers {st.mean_layers:.2f}"
            )


def adapter_layer_macs(adapter) -> float:
    """Multiply-adds per token of one decoder layer, in units of LM-head rows (H each)."""
    from eectl.heads.cached import layer_macs

    return layer_macs(adapter) / adapter.lm_head.weight.shape[1]


def menu(a: argparse.Namespace) -> None:
    """Calibrate's menu as `eectl calibrate --heads` measures it: the runner's candidate source (the shortlist, ranked
    on the fit half's tokens), every subset of up to 3 exits (candidates at its first active exit) and all exits,
    each fitted sequentially (--signal, target, --confidence 0.95) on the first half of the held-out sequences and
    replayed on the other half; mean executed layers with the head cost per active exit passed, on the held-out
    generated tokens (what `eectl run` decodes; calibrate's menu judges on them) and on all held-out tokens."""
    from itertools import combinations

    from eectl.calibrate.fit import evaluate
    from eectl.exits.candidates import (
        CANDIDATE_SOURCES,
        DEFAULT_CANDIDATES,
        Shortlist,
        frequency_shortlist,
        make_source,
    )
    from eectl.exits.measure import SOURCES, ExitScorer, Measurements, heldout_units
    from eectl.exits.thresholds import assign_exits, fit_thresholds
    from eectl.heads.state_cache import open_cache
    from eectl.models import load_model

    loaded = load_model(a.model)
    adapter = loaded.adapter
    cache = open_cache(Path(a.cache))
    exits, heads, design, cost = _heads(a, loaded)
    entries = list(cache.split("held"))
    src_of = [SOURCES.index("teacher-forced" if e.source == "text" else "generated") for e in entries]
    unit_of = []
    counters = [0] * len(SOURCES)
    for s_ in src_of:
        unit_of.append(counters[s_])
        counters[s_] += 1
    # the fit half's tokens rank the shortlist (calibrate ranks it on its calibration split)
    held_units = [set(heldout_units(torch.arange(c), a.holdout).tolist()) for c in counters]
    fit_ids = []
    for u, entry in enumerate(entries):
        if unit_of[u] not in held_units[src_of[u]]:
            seq = cache.load(entry)
            fit_ids.append(seq.ids[1:][seq.measured[:-1]])
    shortlist = None
    a.candidates = a.candidates or DEFAULT_CANDIDATES
    if isinstance(CANDIDATE_SOURCES.get(a.candidates), Shortlist):  # shortlist, shortlist-int8: ids from the fit half
        shortlist = frequency_shortlist(torch.cat(fit_ids), a.shortlist, adapter.lm_head.weight.shape[0])
    scorer = ExitScorer(
        adapter, exits, a.signal, a.top_k, heads, make_source(a.candidates, adapter.lm_head.weight, shortlist)
    )
    parts = []
    with torch.no_grad():
        for u, entry in enumerate(entries):
            seq = cache.load(entry)
            idx, mapped = _exit_states(seq, exits, heads)
            values, correct, _, pv, pc = scorer.score_pairs(mapped, None, seq.final[idx].float())
            n = idx.numel()
            parts.append(
                Measurements(
                    exits,
                    adapter.num_layers,
                    values,
                    correct,
                    torch.full((n,), src_of[u]),
                    torch.full((n,), unit_of[u]),
                    pv,
                    pc,
                )
            )
    meas = Measurements.concat(parts)
    if a.save:  # for offline analysis of the fit (torch.load(..., weights_only=False))
        torch.save(meas, a.save)
    L = adapter.num_layers
    held = meas.heldout_mask(a.holdout)
    calib = ~held
    gen = held & (meas.source == SOURCES.index("generated"))
    subsets = [c for k in range(1, 4) for c in combinations(exits, k)]
    if len(exits) > 3:
        subsets.append(tuple(exits))
    assert meas.pair_values is not None and meas.pair_correct is not None
    # "own": every active exit picks its own candidates (the diagonal of the pairs), one more shortlist projection
    # per active exit passed after the first: what re-picking would buy against the runner's pinned candidates
    e_idx = range(len(exits))
    own = Measurements(
        exits,
        L,
        {c: torch.stack([v[e, e] for e in e_idx]) for c, v in meas.pair_values.items()},
        torch.stack([meas.pair_correct[e, e] for e in e_idx]),
        meas.source,
        meas.unit,
    )
    pick = a.shortlist / adapter_layer_macs(adapter)  # one shortlist projection in decoder layers
    print(
        f"{design}, signal {a.signal}: candidates {a.candidates} (K = {a.top_k}), target {a.target}, "
        f"confidence {a.confidence}; "
        f"fit on {int(calib.sum())} tokens; held-out generated {int(gen.sum())}, all {int(held.sum())}; "
        f"a re-pick costs {pick:.2f} layers"
    )
    for mode, source in (("pinned", meas), ("own", own)):
        rows = []
        for subset in subsets:
            if mode == "own" and len(subset) == 1:
                continue  # the same as pinned
            sub = source.restrict(list(subset))
            thr = fit_thresholds(sub.values, sub.correct, a.target, a.confidence, calib)
            active = [all(t < float("inf") for t in x.values()) for x in thr]
            if not any(active):
                continue
            first = active.index(True)
            per_exit = cost + (pick if mode == "own" else 0.0)
            out = []
            for mask in (gen, held):
                _, overall = evaluate(sub, thr, mask)
                taken = assign_exits(sub.values, thr)[mask]
                layers = torch.tensor([*subset, L], dtype=torch.float64)[taken]
                paid = torch.tensor(
                    [
                        sum(cost if e == first else per_exit for e in range(min(t, len(subset) - 1) + 1) if active[e])
                        for t in taken.tolist()
                    ],
                    dtype=torch.float64,
                )
                out.append((overall, float((layers + paid).mean())))
            rows.append((out[0][1], subset, out, active))
        rows.sort(key=lambda r: r[0])
        for rank, (_, subset, out, active) in enumerate(rows):
            if rank >= a.show and len(subset) != len(exits):
                continue
            (g, gl), (h, hl) = out
            used = [x for x, on in zip(subset, active, strict=True) if on]
            print(
                f"  {mode} exits {list(subset)} (exiting at {used}): generated: mean layers {g.mean_layers:.2f} "
                f"(+ cost {gl:.2f}), exit rate {g.exit_rate:.3f}, precision {g.precision}; all held-out: "
                f"{h.mean_layers:.2f} (+ cost {hl:.2f}), precision {h.precision}"
            )


def merge(a: argparse.Namespace) -> None:
    """--heads A,B,...: one heads file at --out with every exit (same model and design, disjoint exits; probes
    dropped: fit them onto the result with `eectl train-heads --probe-only`)."""
    from eectl.exits.designs import merge_heads
    from eectl.models import load_model

    if not a.heads or not a.out:
        sys.exit("merge needs --heads A,B,... and --out FILE")
    meta = merge_heads([Path(p) for p in a.heads.split(",")], load_model(a.model), Path(a.out))
    print(f"wrote {a.out}: {meta.design} heads at exits {meta.exits} (no probes)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["build", "train", "calib", "menu", "merge"])
    ap.add_argument("--cache", default="artifacts/states")
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M-Instruct")
    ap.add_argument("--data", default="/work/shared/data/gsm8k/train.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", default="8,12,16,20,24")
    ap.add_argument("--text", type=int, default=16000)
    ap.add_argument("--gen", type=int, default=4000)
    ap.add_argument("--eval-text", type=int, default=4000)
    ap.add_argument("--eval-gen", type=int, default=2000)
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--design", default="residual-linear")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--block-init", default="last")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss", default="topk")
    ap.add_argument("--tail", type=int, default=4096, help="tail samples; -1: the exact normaliser")
    ap.add_argument("--shortlist", type=int, default=4096, help="topk: most frequent teacher tokens counted exactly")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--sources", default="text,gen")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--heads", default=None)
    ap.add_argument("--head-cost", type=float, default=None, help="head cost per exit passed, in decoder layers")
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--signal", default="topk-prob", help="calib, menu: the exit signal (learned: heads with probes)")
    ap.add_argument("--candidates", default=None, help="menu: the candidate source (default: the runner's)")
    ap.add_argument("--confidence", type=float, default=0.95, help="menu: the fit's confidence")
    ap.add_argument("--save", default=None, help="menu: torch.save the measurements here")
    ap.add_argument("--show", type=int, default=5, help="menu: best subsets shown (and all exits)")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--holdout", type=float, default=0.5)
    ap.add_argument("--eval-report", type=int, default=3000, help="held-out tokens of the training report")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    {"build": build, "train": train, "calib": calib, "menu": menu, "merge": merge}[a.step](a)


if __name__ == "__main__":
    main()
