"""How many exit decisions could a linear gate on the exit's input state skip? (#11: the decision share)

A decision costs its memory traffic whether or not the token exits (the exit head's weights, the candidate source's
rows, the K exact LM-head rows), so the lever left is not to make it. This estimates, offline, what a logistic gate
on the raw hidden state at each exit (H multiply-adds, nothing else read) would skip: fitted on half of the tokens
to predict "this exit's decision passes" (the plan's thresholds from an exported artifact, the calibration's
candidate source, candidates pinned at the plan's first exit as the runner pins them), its threshold at a share of
the passing tokens of that half; measured on the other half (recall of passing tokens, decisions skipped).

    .venv/bin/python scripts/gate_estimate.py --artifact artifacts/rl1m-slim \\
        --heads artifacts/rl1m-mlp262k.safetensors --calibration artifacts/rl1m-slim-cal.json --policy defer

Default model, defer [12, 20, 24] (the rl1m-slim export's plan), 160 GSM8K-train records from 1000, teacher-forced
(28,044 tokens), 1 torch thread: keep 0.99 / 0.995 -> exit 12 (pass rate 5.1%) skips 67% / 56% of its decisions,
recall 0.968 / 0.982; exit 20 (8.3%) 64% / 61%, 0.968 / 0.976; exit 24 (35.8%) 19% / 13%, 0.978 / 0.989.

Not the runner's behaviour: the gate is not built (a gated-out first exit cannot pick candidates for the later ones,
so calibrate would have to fit and measure it).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from eectl.candidates import make_source
from eectl.exits import probe_of, signals
from eectl.head_designs import load_heads
from eectl.models import load_model


def _fit_gate(x: np.ndarray, y: np.ndarray, n: int) -> np.ndarray:
    """A logistic regression on the standardised states, fitted on the first n tokens: every token's gate logit."""
    mu, sd = x[:n].mean(0), x[:n].std(0) + 1e-6
    xs, yt = torch.tensor((x - mu) / sd), torch.tensor(y)
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=200)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logit = xs[:n] @ w + b
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, yt[:n]) + 1e-3 * (w * w).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return (xs @ w + b).detach().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True, help="an exported artifact: its plan's exits and thresholds")
    ap.add_argument("--heads", required=True, help="the heads file (with probes) the artifact was exported with")
    ap.add_argument("--calibration", required=True, help="the calibration file: its candidate source")
    ap.add_argument("--policy", default="defer")
    ap.add_argument("--data", default="../shared/data/gsm8k/train.jsonl")
    ap.add_argument("--offset", type=int, default=1000)
    ap.add_argument("--records", type=int, default=160)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    ad, tok = loaded.adapter, loaded.tokenizer
    heads = load_heads(args.heads, loaded)
    with open(f"{args.artifact}/manifest.json") as f:
        plan = json.load(f)["plan"]["choices"][args.policy]
    thresholds = {int(e): t["score"] for e, t in plan["thresholds"].items()}
    with open(args.calibration) as f:
        cal = json.load(f)["candidates"]
    ids = cal.get("ids")
    source = make_source(cal["name"], ad.lm_head.weight, None if ids is None else torch.tensor(ids))
    with open(args.data) as f:
        lines = f.read().splitlines()[args.offset : args.offset + args.records]
    states: dict[int, list[np.ndarray]] = {e: [] for e in thresholds}
    passed: dict[int, list[np.ndarray]] = {e: [] for e in thresholds}
    with torch.no_grad():
        for line in lines:
            r = json.loads(line)
            x = torch.tensor([tok(r["question"] + "\n" + r["answer"])["input_ids"][: args.max_len]])
            out = loaded.model(x, output_hidden_states=True)
            cand = None
            for e in sorted(thresholds):
                h = out.hidden_states[e][0].float()
                head = heads.exit_head(ad, e)
                if cand is None:  # pinned at the plan's first exit
                    cand, _ = source.torch_pick(head, h, 64)
                s = signals(head.local(h, cand).numpy(), cand.numpy())
                probe = probe_of(heads.heads[e])
                assert probe is not None, f"exit {e}: the heads carry no probe"
                score = np.asarray(probe.score(head.normed(h), s.prob, s.margin))
                states[e].append(h.numpy())
                passed[e].append(score >= thresholds[e])
    for e in sorted(thresholds):
        X, y = np.concatenate(states[e]), np.concatenate(passed[e]).astype(np.float32)
        n = len(y) // 2
        g = _fit_gate(X, y, n)
        cells = []
        for keep in (0.99, 0.995):
            gamma = np.quantile(g[:n][y[:n] > 0], 1 - keep)
            recall = float((g[n:][y[n:] > 0] >= gamma).mean())
            cells.append(f"keep {keep}: recall {recall:.3f}, skipped {float((g[n:] < gamma).mean()):.3f}")
        print(f"exit {e}: {len(y)} tokens, pass rate {y.mean():.3f}; " + "; ".join(cells))


if __name__ == "__main__":
    main()
