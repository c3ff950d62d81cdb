"""The steps of scripts/gpu_check.py that need eectl, torch or ONNX Runtime, run inside the check's environment.

    deps    eectl's requirements against the installed versions; ONNX Runtime's providers (JSON on stdout)
    model   a seeded random Llama of SmolLM2-135M's shape, saved as a Hugging Face folder with a tokenizer
    peer    eectl full depth against transformers generate on the same device, same prompt ids, greedy
    reads   per decoded token, what the resident path read on the host against the binding plan's host outputs

Each of model/peer/reads writes its result as JSON to --result. What this does not do: install anything, or
decide whether the check passed (gpu_check.py's verdict).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# SmolLM2-135M's shape (its config.json), with its rotary base and norms
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
TOP_K = 64


def deps(args: argparse.Namespace) -> dict:
    import importlib.metadata as md

    try:
        from packaging.requirements import Requirement
    except ImportError:  # a bare interpreter: pip's copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]

    out: dict = {"python": sys.version.split()[0], "missing": [], "missing_indirect": [], "out_of_range": []}
    out["versions"] = {}
    # eectl's requirements and theirs, transitively (the wheels came without their dependencies: what they need
    # must already be there, as the GPU image's packages)
    seen: set[str] = set()
    queue = ["eectl"]
    while queue:
        dist = queue.pop(0)
        for text in _requires(dist):
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                version = md.version(req.name)
            except md.PackageNotFoundError:  # eectl's own: fatal; a requirement of one of them: a warning
                out["missing" if dist == "eectl" else "missing_indirect"].append(f"{req} (for {dist})")
                continue
            if dist == "eectl":
                out["versions"][req.name] = version
            if not req.specifier.contains(version, prereleases=True):
                out["out_of_range"].append(f"{req.name} {version} ({dist} wants {req.specifier})")
            key = req.name.lower().replace("_", "-")
            if key not in seen:
                seen.add(key)
                queue.append(req.name)
    for key in ("missing", "missing_indirect", "out_of_range"):
        out[key] = sorted(set(out[key]))
    if args.missing_only:
        return {"missing": out["missing"] + out["missing_indirect"]}
    import onnxruntime as ort

    out["onnxruntime"] = ort.__version__
    out["onnxruntime_file"] = str(Path(ort.__file__).parent)
    out["ort_providers"] = list(ort.get_available_providers())
    if args.provider == "cuda" and "CUDAExecutionProvider" in out["ort_providers"]:
        # whether a CUDA session gets the CUDA EP before torch has loaded the CUDA libraries into the process
        # (`eectl run` imports no torch) and after: ORT falls back to the CPU EP with only a logged error
        out["cuda_session_before_torch"] = _session_providers()
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = bool(torch.cuda.is_available())
        if out["torch_cuda"]:
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # recorded, not fatal here: the missing list says what to do
        out["torch"] = f"unimportable: {type(exc).__name__}: {exc}"
    if args.provider == "cuda" and "CUDAExecutionProvider" in out["ort_providers"]:
        out["cuda_session_after_torch"] = _session_providers()
    from eectl.runtime.ort import cuda_usable

    out["cuda_usable"] = cuda_usable()
    return out


def _requires(dist: str) -> list[str]:
    """A distribution's requirements; eectl's from pyproject.toml where it is on the path without being installed."""
    import importlib.metadata as md

    try:
        return md.requires(dist) or []
    except md.PackageNotFoundError:
        if dist != "eectl":
            return []
        import tomllib

        with (Path(__file__).resolve().parent.parent / "pyproject.toml").open("rb") as f:
            return list(tomllib.load(f)["project"]["dependencies"])


def _session_providers() -> list[str] | str:
    """The providers a one-node fp16 graph's session really got, asked for CUDA then CPU."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 2])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 10)
    try:
        s = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
        return list(s.get_providers())
    except Exception as exc:  # the diagnostic itself must not stop the check
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def model(args: argparse.Namespace) -> dict:
    """The random model: weights from a seeded default init (top-1 margins of ~0.4 logits, fp16 argmax equal to fp32
    on this shape), a byte-level BPE tokenizer trained on HumanEval's prompts (the bench's data), no chat template."""
    if args.gguf:
        return {"model": str(args.gguf), "kind": "gguf", "bytes": Path(args.gguf).stat().st_size}
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from eectl.data import load_text_data

    folder = Path(args.out) / "model"
    config = transformers.LlamaConfig(**SMOLLM2_135M)
    torch.manual_seed(args.seed)
    m = transformers.AutoModelForCausalLM.from_config(config).eval()
    m.config.architectures = ["LlamaForCausalLM"]
    m.save_pretrained(folder)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=SMOLLM2_135M["vocab_size"],
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(load_text_data("humaneval").texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    params = sum(p.numel() for p in m.parameters())
    return {"model": str(folder), "kind": "random", "seed": args.seed, "parameters": params, "tokenizer": len(fast)}


def _runtime(args: argparse.Namespace):  # noqa: ANN202
    from eectl.runtime.sessions import ArtifactRuntime

    rt = ArtifactRuntime(Path(args.out) / "artifact", provider=args.provider, threads=args.threads)
    graphs = [rt.embedding, *rt.segments, *rt.full_graphs.values(), *rt.local_graphs.values()]
    # the provider each session really runs on (ORT falls back to the CPU EP when the CUDA one cannot load)
    first = sorted({g.session.get_providers()[0] for g in graphs if g.session is not None})
    return rt, first


def _on_provider(provider: str, providers: list[str]) -> bool:
    return provider != "cuda" or providers == ["CUDAExecutionProvider"]


def _prompt_ids(rt, n: int, raw: bool) -> list[list[int]]:  # noqa: ANN001
    from eectl.data import encode_prompt, load_text_data
    from eectl.run.generate import load_tokenizer

    tok = load_tokenizer(rt)
    return [encode_prompt(tok, p, raw=raw) for p in load_text_data("humaneval").prompts[:n]]


def peer(args: argparse.Namespace) -> dict:
    """Decode tokens/s of eectl full depth (the bound chain) and transformers generate, the same prompt ids, greedy,
    no stop token, alternating prompt by prompt after a warm-up of each; fp16 on cuda (the artifact's dtype), fp32
    torch on the CPU."""
    import numpy as np
    import torch

    from eectl.models import load_model
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    rt, providers = _runtime(args)
    ids = _prompt_ids(rt, args.prompts, raw=args.gguf is None)
    new = args.max_new_tokens
    runner = Runner(rt, RunConfig(exits=[], thresholds={}, max_new_tokens=new, stop_ids=()))
    device = "cuda" if args.provider == "cuda" else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = load_model(args.model).model.to(device=device, dtype=dtype).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run_hf(prompt: list[int]) -> tuple[list[int], list[float]]:
        stamps: list[float] = []

        class Stamp:  # one put per generated token (the first put is the prompt)
            def put(self, value: object) -> None:
                sync()
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                streamer=Stamp(),
            )
        times = stamps[1:]
        return out[0, len(prompt) :].tolist(), [b - a for a, b in zip(times, times[1:], strict=False)]

    def run_eectl(prompt: list[int]) -> tuple[list[int], list[float]]:
        g = runner.generate([prompt])[0]
        return g.token_ids, g.latencies_s[1:]

    run_eectl(ids[0])  # warm-up: sessions, cuBLAS handles, the bound chain
    run_hf(ids[0])
    lat: dict[str, list[float]] = {"eectl": [], "hf": []}
    toks: dict[str, list[list[int]]] = {"eectl": [], "hf": []}
    for rep in range(args.reps):
        for p in ids:
            for name, fn in (
                (("eectl", run_eectl), ("hf", run_hf)) if rep % 2 == 0 else (("hf", run_hf), ("eectl", run_eectl))
            ):
                t, latency = fn(p)
                lat[name] += latency
                if rep == 0:
                    toks[name].append(t)
    tps = {k: len(v) / sum(v) if v and sum(v) > 0 else 0.0 for k, v in lat.items()}
    same = [a == b for a, b in zip(toks["eectl"], toks["hf"], strict=True)]
    agree = [
        np.mean([x == y for x, y in zip(a, b, strict=False)]) for a, b in zip(toks["eectl"], toks["hf"], strict=True)
    ]
    first_diff = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        for a, b in zip(toks["eectl"], toks["hf"], strict=True)
    ]
    return {
        "device": device,
        "session_providers": providers,
        "artifact_dtype": rt.manifest.dtype,
        "hf_dtype": str(dtype).replace("torch.", ""),
        "prompts": len(ids),
        "prompt_tokens": [len(p) for p in ids],
        "max_new_tokens": new,
        "reps": args.reps,
        "eectl_tokens_per_s": round(tps["eectl"], 2),
        "hf_tokens_per_s": round(tps["hf"], 2),
        "speedup_vs_hf": round(tps["eectl"] / tps["hf"], 3) if tps["hf"] else None,
        "eectl_ms_per_token_median": round(1000 * float(np.median(lat["eectl"])), 3),
        "hf_ms_per_token_median": round(1000 * float(np.median(lat["hf"])), 3),
        "tokens_identical": all(same),
        "token_agreement": round(float(np.mean(agree)), 4),
        "first_divergence": first_diff,
        # on cuda every graph must really run on the CUDA EP (ORT falls back to the CPU EP with only a log line)
        "ok": _on_provider(args.provider, providers),
    }


def reads(args: argparse.Namespace) -> dict:
    """Each policy on one prompt with every exit active (exit 8 never passes, exit 16 always does) on the resident
    path. Per step, the (graph, layer, output) reads the runtime recorded on the host are compared with the binding
    plan's host outputs: copy and defer take one step per token, and each step must read exactly what the plan
    lists for that token's exit layer. verify takes more steps than tokens (drafts, rollbacks, its closing
    full-depth pass), so each step is matched against the plan's scenarios (`BindingPlan.scenarios`), and the
    steps that match none are listed by shape. A read the plan never lists, or a hidden state, KV or full logits
    read on the host, fails the check."""
    from eectl.runtime.binding import HIDDEN, KINDS, KV, LOGITS, plan_for
    from eectl.runtime.runner import Runner
    from eectl.runtime.state import RunConfig

    rt, providers = _runtime(args)
    exits = [int(e) for e in args.exits.split(",")]
    L = rt.manifest.num_layers
    thresholds = {e: {"prob": 0.0 if e == exits[1] else 2.0} for e in exits}
    prompt = _prompt_ids(rt, 1, raw=args.gguf is None)
    out: dict = {"session_providers": providers, "exits": exits, "thresholds": thresholds, "policies": {}}
    heavy = (HIDDEN, KV, LOGITS)
    # the prompt's step: full depth, no exit test, only the token (the certified head's where the artifact has one)
    prefill = {(("exit_full", L, "token"),), (("head_certified", L, "passed"), ("head_certified", L, "token"))}

    def host_reads(calls) -> tuple:  # noqa: ANN001
        return tuple(sorted((c.graph, c.at, b.key) for c in calls for b in c.bindings if b.host_read))

    for policy in ("copy", "defer", "verify"):
        cfg = RunConfig(
            exits=exits,
            thresholds=thresholds,
            signal="topk-prob",
            policy=policy,
            top_k=TOP_K,
            max_new_tokens=args.max_new_tokens,
            stop_ids=(),
            device_resident=True,
        )
        runner = Runner(rt, cfg)
        gen = runner.generate(prompt)[0]
        # the CUDA plan on either provider: it says what crosses to the host (on a CPU plan every output is host
        # memory); the resident path (the bound chain on device buffers) on the CPU EP runs the same calls with CPU
        # OrtValues as the device
        plan = plan_for(rt.manifest, "cuda", exits, "topk-prob", policy, chain=True)
        shapes = {*prefill, *(host_reads(calls) for calls in plan.scenarios())}
        listed = {r for shape in shapes for r in shape}
        steps = [tuple(sorted(tuple(r) for r in step)) for step in runner.step_reads]
        one_per_token = len(steps) == len(gen.exit_layers)
        exact = planned = 0
        mismatches: list = []
        if policy != "verify" and one_per_token:
            for step, (got, layer) in enumerate(zip(steps, gen.exit_layers, strict=True)):
                want = (
                    (got if got in prefill else min(prefill))
                    if step == 0
                    else host_reads(plan.token(None if layer == L else layer))
                )
                planned += len(want)
                exact += got == want
                if got != want and len(mismatches) < 5:
                    mismatches.append({"step": step, "exit_layer": layer, "read": got, "plan": want})
        off: dict[tuple, int] = {}
        for got in steps:
            if got not in shapes:
                off[got] = off.get(got, 0) + 1
        measured = sum(len(got) for got in steps)
        tokens = len(gen.token_ids)
        res = {
            "tokens": tokens,
            "steps": len(steps),
            "exited": sum(layer < L for layer in gen.exit_layers[1:]),
            "drafted": gen.drafted,
            "rejected": gen.rejected_drafts,
            "host_reads": measured,
            "host_reads_per_token": round(measured / tokens, 3) if tokens else None,
            "steps_in_plan_scenarios": len(steps) - sum(off.values()),
            "off_scenario_shapes": [{"steps": n, "read": [list(r) for r in k]} for k, n in list(off.items())[:5]],
            "reads_never_planned": sorted({r for got in steps for r in got} - listed),
            "heavy_reads": sorted(
                {r for got in steps for r in got if KINDS.get(r[0], {}).get(r[2], ("",))[0] in heavy}
            ),
        }
        if policy != "verify":
            res["one_step_per_token"] = one_per_token
            res["plan_reads_per_token"] = round(planned / tokens, 3) if tokens and one_per_token else None
            res["steps_equal_to_plan"] = exact
            res["mismatches"] = mismatches
        res["ok"] = bool(
            steps
            and not res["reads_never_planned"]
            and not res["heavy_reads"]
            and (policy == "verify" or (one_per_token and exact == len(steps)))
        )
        out["policies"][policy] = res
    # full depth runs on the bound chain: the plan's full-depth token reads only the final head's token
    out["full_depth_plan_reads"] = [list(r) for r in host_reads(plan_for(rt.manifest, "cuda", [], "topk-prob").token())]
    out["all_match"] = all(p["ok"] for p in out["policies"].values())
    out["ok"] = out["all_match"] and _on_provider(args.provider, providers)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check_steps.py")
    ap.add_argument("step", choices=("deps", "model", "peer", "reads"))
    ap.add_argument("--out", default=".")
    ap.add_argument("--result", type=Path)
    ap.add_argument("--provider", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--gguf")
    ap.add_argument("--model")
    ap.add_argument("--exits", default="8,16,24")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--missing-only", action="store_true", help="deps: only what is not installed")
    args = ap.parse_args(argv)
    if args.model and args.model.endswith(".gguf"):
        args.gguf = args.gguf or args.model
    os.environ.setdefault("EECTL_QUIET", "1")
    if args.step != "deps":
        from eectl.runtime.ort import init_ort

        init_ort(args.threads)
    result = {"deps": deps, "model": model, "peer": peer, "reads": reads}[args.step](args)
    if args.result:
        tmp = args.result.with_name(args.result.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
        os.replace(tmp, args.result)
    else:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
