"""Where `eectl calibrate`'s time goes, per phase, and (--check) how far the states the generation kept are from a
second teacher-forced pass over prompt + continuation on a real model.

    python scripts/calibrate_phases.py --label after --threads 2 --tokens 6144 --gen-tokens 48
    python scripts/calibrate_phases.py --check --threads 2 --tokens 6144 --gen-tokens 48

Phases are exclusive wall times of calibrate's own functions, wrapped where `eectl.calibrate.calibrator` calls them (so
the
same script times older versions of the code, where the second pass is `measure_sequences_all`): generation,
the teacher-forced text pass, the second pass over the continuations (old) or the kept states' assembly (new),
signal computation (`ExitScorer.score_pairs`), the shortlist, and the fit (`summarise`: thresholds and menu).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

PHASES = {
    "generate_continuations": "generation",
    "measure_text_all": "text pass",
    "measure_sequences_all": "second pass",
    "measure_kept_all": "kept states",
    "frequency_shortlist": "shortlist",
    "summarise": "fit",
}


class Timer:
    """Exclusive seconds per phase: a nested phase's time is not counted in its caller's."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.stack: list[float] = []  # time spent in children of each open phase

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - t
                children = self.stack.pop()
                self.seconds[name] = self.seconds.get(name, 0.0) + took - children
                if self.stack:
                    self.stack[-1] += took

        return timed


def options(a: argparse.Namespace) -> Any:
    from eectl.calibrate.calibrator import CalibrateOptions

    extra = {} if a.gen_batch is None else {"gen_batch": a.gen_batch}
    return CalibrateOptions(
        exits=[int(x) for x in a.exits.split(",")],
        signal=a.signal,
        tokens=a.tokens,
        gen_share=a.gen_share,
        gen_tokens=a.gen_tokens,
        **extra,
    )


def timed_run(a: argparse.Namespace, loaded: Any, data: Any) -> dict[str, Any]:
    import eectl.calibrate.calibrator as cal
    import eectl.exits.measure as cm

    timer = Timer()
    for fn, phase in PHASES.items():
        if hasattr(cal, fn):
            setattr(cal, fn, timer.wrap(phase, getattr(cal, fn)))
    cm.ExitScorer.score_pairs = timer.wrap("signals", cm.ExitScorer.score_pairs)  # type: ignore[method-assign]
    opts = options(a)
    t = time.perf_counter()
    result = cal.calibrate_model(loaded, data, opts)
    total = time.perf_counter() - t
    phases = {k: round(v, 2) for k, v in timer.seconds.items()}
    phases["other"] = round(total - sum(timer.seconds.values()), 2)
    return {
        "label": a.label,
        "gen_batch": opts.gen_batch,
        "total_s": round(total, 2),
        "phases_s": phases,
        "tokens": result.data.tokens,
        "generated": result.data.generated_tokens,
        "prompts_used": result.data.prompts_used,
        "thresholds": [x.thresholds for x in result.exits],
        "heldout_mean_layers": None if result.heldout is None else result.heldout.mean_layers,
    }


def check(a: argparse.Namespace, loaded: Any, data: Any) -> dict[str, Any]:
    """The same continuations measured on the kept states and by the second pass (batches of 16): per-token
    differences, decisions, and the thresholds fitted from each (generated tokens only)."""
    from eectl.calibrate.fit import fit
    from eectl.exits.generation import generate_continuations, prompt_ids
    from eectl.exits.measure import ExitScorer, generation_keep, measure_kept_all, measure_sequences

    opts = options(a)
    adapter, tok = loaded.adapter, loaded.tokenizer
    scorer = ExitScorer(adapter, opts.exits, opts.signal, opts.top_k)
    prompts = prompt_ids(tok, data.prompts, 4096 - opts.gen_tokens - 1)
    n = opts.generated_tokens
    conts, used = generate_continuations(
        adapter, prompts, n, opts.gen_tokens, tok.eos_token_id, opts.gen_batch, keep=generation_keep(scorer)
    )
    kept = measure_kept_all([scorer], conts, True)[0]
    ref = measure_sequences(scorer, conts, 16, True)
    assert kept is not None and ref is not None and torch.equal(kept.unit, ref.unit)
    out: dict[str, Any] = {"label": "check", "generated": kept.n, "prompts": used, "gen_batch": opts.gen_batch}
    for c in ref.values:
        d = (kept.values[c] - ref.values[c]).abs()
        out[f"max_abs_diff_{c}"] = float(d.max())
        assert kept.pair_values is not None and ref.pair_values is not None
        out[f"max_abs_diff_pairs_{c}"] = float((kept.pair_values[c] - ref.pair_values[c]).abs().max())
    out["correct_agreement"] = float((kept.correct == ref.correct).float().mean())
    out["correct_differ"] = int((kept.correct != ref.correct).sum())
    assert kept.pair_correct is not None and ref.pair_correct is not None
    out["pair_correct_differ"] = int((kept.pair_correct != ref.pair_correct).sum())
    final = torch.cat([adapter.logits(c.states[0]).argmax(-1) for c in conts if c.states is not None])
    out["kept_final_top1_is_the_generated_token"] = final.tolist() == [t for c in conts for t in c.generated]
    for conf in (None, 0.95):
        for target in (0.9, 0.95, 0.99):
            fa, fb = fit(kept, target, conf, 0.2, []), fit(ref, target, conf, 0.2, [])
            key = f"target {target} conf {conf}"
            out[key] = {
                "thresholds kept": [x.thresholds for x in fa.exits],
                "thresholds second pass": [x.thresholds for x in fb.exits],
                "exited kept / second pass": [fa.calibration.exited, fb.calibration.exited],
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="run")
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default="/work/shared/data/gsm8k/train.jsonl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exits", default="8,12,16,20,24")
    ap.add_argument("--signal", default="topk-prob")
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--gen-share", type=float, default=0.25)
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--gen-batch", type=int, default=None, help="default: the code's own default")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    os.environ.setdefault("EECTL_QUIET", "1")
    from eectl.data import load_text_data
    from eectl.models import load_model

    loaded, data = load_model(a.model), load_text_data(a.data)
    doc = check(a, loaded, data) if a.check else timed_run(a, loaded, data)
    doc.update(threads=torch.get_num_threads(), load=os.getloadavg())
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()
