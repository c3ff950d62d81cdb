"""Building and widening a state cache: the frozen base run once over the training text and the model's own
continuations, each sequence's states written as it completes (resumable).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eectl.errors import DataError, UsageError
from eectl.heads.state_cache import (
    CACHE_FORMAT,
    CACHE_VERSION,
    CacheSpec,
    Entry,
    StateCache,
    Timing,
    base_states,
    make_sequence,
    open_cache,
    read_sequence,
    write_sequence,
)
from eectl.phases import FIXED, Phases


def _identity(loaded: Any, data: Any, spec: CacheSpec) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "version": CACHE_VERSION,
        "base_sha256": loaded.source.sha256,
        "base_name": loaded.source.name,
        # the states of the int4 twin are not the checkpoint's (models/int4.py); fp32 caches keep their identity
        **({} if getattr(loaded, "weights", "fp32") == "fp32" else {"weights": loaded.weights}),
        "data": data.name,
        "records": len(data.texts),
        # token budgets are left out: a cache can be extended (sequences already there are the same ones)
        # so are the batch sizes, which change how fast, not what
        "spec": {
            k: v
            for k, v in {**asdict(spec), "layers": sorted(spec.layers)}.items()
            if k not in _BUDGETS + ("gen_batch", "text_batch")
        },
    }


_BUDGETS = ("text_tokens", "gen_tokens", "eval_gen_tokens")


def build_cache(
    loaded: Any,
    data: Any,
    spec: CacheSpec,
    folder: Path,
    on_tokens: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
    phases: Phases | None = None,
) -> StateCache:
    """Compute (or finish computing) the cache for `spec` in `folder`; an existing cache of another identity is
    refused, an identical one is reused, a complete one that lacks only some of the layers is widened to them
    (`widen_cache`). Text chunks first, then generated sequences, per split. `phases` gets each part's time with
    the budget size it scales with (eectl/phases.py), and a note when part of the cache was there already."""
    from eectl.files import atomic_write as _atomic_write

    say = log or (lambda _m: None)
    phases = phases if phases is not None else Phases()
    adapter = loaded.adapter
    spec.check(adapter.num_layers)
    spec.layers = sorted(spec.layers)
    identity = _identity(loaded, data, spec)
    meta_path = folder / "cache.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text(encoding="utf-8"))
        if old.get("identity") != identity:
            if _only_layers_differ(old.get("identity"), identity):
                if old.get("complete") and old.get("budgets") == {k: getattr(spec, k) for k in _BUDGETS}:
                    phases.reused = "the state cache was there (widened to more layers)"
                    return widen_cache(loaded, folder, spec.layers, spec.text_batch, on_tokens, log)
                raise UsageError(
                    f"{folder} holds a state cache of other layers that is incomplete or has other token budgets",
                    hint="finish or widen it with its own budgets first (see its cache.json), then change one thing",
                )
            raise UsageError(
                f"{folder} holds a state cache of another model, data or spec",
                hint="pass another --cache folder, or delete this one",
            )
        if old.get("complete") and old.get("budgets") == {k: getattr(spec, k) for k in _BUDGETS}:
            phases.reused = "the state cache was there"
            return open_cache(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps({"identity": identity, "complete": False})))
    start = time.perf_counter()
    timing = Timing()
    tok = loaded.tokenizer
    train_data, held_data = _split_data(tok, data, spec)
    entries: list[Entry] = []
    plan = [
        ("train", train_data, spec.text_tokens, spec.gen_tokens),
        ("held", held_data, spec.eval_text_tokens, spec.eval_gen_tokens),
    ]
    if any(any((folder / split).glob("*.safetensors")) for split, *_ in plan):
        phases.reused = "part of the state cache was there"
    for split, part, n_text, n_gen in plan:
        (folder / split).mkdir(exist_ok=True)
        # the held-out part is the same in every budget (contracts/budgets.py HELD_TOKENS)
        what, sizes = ("train", ("text_tokens", "gen_steps")) if split == "train" else ("held-out", (FIXED, FIXED))
        if n_text > 0:
            with phases.time(f"state cache: {what} text", sizes[0]):
                entries += _cache_text(adapter, tok, folder, split, part, n_text, spec, timing, on_tokens)
        if n_gen > 0:
            with phases.time(f"state cache: {what} continuations", sizes[1]):
                entries += _cache_generated(adapter, tok, folder, split, part, n_gen, spec, timing, on_tokens)
        say(f"state cache: {split} part done ({sum(e.tokens for e in entries if e.split == split)} tokens)")
    build_s = time.perf_counter() - start
    doc = {
        "identity": identity,
        "complete": True,
        "budgets": {k: getattr(spec, k) for k in _BUDGETS},
        "build_s": build_s,
        "timing": dict(timing),
        "entries": [asdict(e) for e in entries],
    }
    _atomic_write(meta_path, lambda tmp: tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8"))
    return StateCache(folder, identity, entries, build_s, dict(timing))


def _only_layers_differ(old: Any, new: dict[str, Any]) -> bool:
    """Two cache identities that are equal but for the spec's layers."""
    if not isinstance(old, dict) or not isinstance(old.get("spec"), dict):
        return False
    return {**old, "spec": {**old["spec"], "layers": None}} == {**new, "spec": {**new["spec"], "layers": None}}


def widen_cache(
    loaded: Any,
    folder: Path,
    layers: list[int],
    batch: int = 4,
    on_tokens: Callable[[int], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> StateCache:
    """Add the states of `layers` the complete cache in `folder` does not hold to every sequence file (teacher-forced
    on its stored ids, `batch` sequences of equal length per base call), then name the union in `cache.json`.
    `on_tokens` counts measured tokens per file done (files already widened first), as the build does."""
    from safetensors import safe_open

    from eectl.files import atomic_write as _atomic_write

    say = log or (lambda _m: None)
    cache = open_cache(folder)
    doc = json.loads((folder / "cache.json").read_text(encoding="utf-8"))
    adapter = loaded.adapter
    new = sorted(set(layers) - set(cache.layers))
    if not new:
        return cache
    CacheSpec(layers=new).check(adapter.num_layers)
    names = {f"state_{layer}" for layer in new}
    todo: list[Entry] = []
    skipped = 0
    for entry in _widen_order(cache.entries):
        with safe_open(str(folder / entry.file), framework="pt") as f:  # type: ignore[no-untyped-call]
            have = set(f.keys())
        if names <= have:
            skipped += entry.tokens
        else:
            todo.append(entry)
    say(f"state cache: widening {len(todo)} of {len(cache.entries)} sequences to layers {new} (the others hold them)")
    if on_tokens is not None:
        on_tokens(skipped)
    start = time.perf_counter()
    positions = 0
    window = 16 * batch  # sequences per window, batched by equal length inside it (no padding)
    for w0 in range(0, len(todo), window):
        groups: dict[int, list[Entry]] = {}
        for entry in todo[w0 : w0 + window]:
            groups.setdefault(entry.length, []).append(entry)
        for group in groups.values():
            for g0 in range(0, len(group), batch):
                part = group[g0 : g0 + batch]
                seqs = [read_sequence(folder / e.file) for e in part]
                states = base_states(adapter, [s.ids.tolist() for s in seqs], new, final=False)
                for entry, seq, st in zip(part, seqs, states, strict=True):
                    seq.states.update({layer: h.to("cpu") for layer, h in st.items()})
                    write_sequence(folder / entry.file, seq)
                    positions += entry.length
                    if on_tokens is not None:
                        on_tokens(entry.tokens)
    widen_s = time.perf_counter() - start
    say(
        f"state cache: widened {len(todo)} sequences ({positions} positions) in {widen_s:.0f} s, "
        f"{positions / max(widen_s, 1e-9):.0f} positions/s"
    )
    doc["identity"]["spec"]["layers"] = sorted(set(cache.layers) | set(new))
    doc["timing"] = {**doc.get("timing", {}), "widen": doc.get("timing", {}).get("widen", 0.0) + widen_s}
    doc["build_s"] = float(doc.get("build_s", 0.0)) + widen_s
    _atomic_write(folder / "cache.json", lambda tmp: tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8"))
    return open_cache(folder)


def _widen_order(entries: list[Entry]) -> list[Entry]:
    """The order a widen takes: the held-out split first (every evaluation reads all of it), then the training split
    with its sources interleaved in proportion, so a widen stopped early has widened a sample of the training data
    that is mixed as the whole is (text chunks and generated sequences), not only its first source."""
    by_source: dict[tuple[str, str], list[Entry]] = {}
    for entry in entries:
        by_source.setdefault((entry.split, entry.source), []).append(entry)
    keyed = [
        (split == "train", i / len(group), source, e)
        for (split, source), group in by_source.items()
        for i, e in enumerate(group)
    ]
    return [e for *_k, e in sorted(keyed, key=lambda k: k[:3])]


def _split_data(tok: Any, data: Any, spec: CacheSpec) -> tuple[Any, Any]:
    """The training records and the held-out records at the end of the data, with held-out prompts enough for the
    held-out generated part."""
    from eectl.data import TextData, split_records

    train_data, held_data = split_records(tok, data, spec.eval_text_tokens or 1)
    # held-out prompts enough for the held-out generated part (EOS ends some continuations early)
    want = math.ceil(4 * spec.eval_gen_tokens / spec.gen_len)
    if len(held_data.texts) < want < len(data.texts):
        k = len(data.texts) - want
        train_data = TextData(data.name, data.description, data.texts[:k], data.prompts[:k])
        held_data = TextData(data.name, data.description, data.texts[k:], data.prompts[k:])
    return train_data, held_data


def _cache_text(
    adapter: Any,
    tok: Any,
    folder: Path,
    split: str,
    part: Any,
    n_text: int,
    spec: CacheSpec,
    timing: Timing,
    on_tokens: Callable[[int], None] | None,
) -> list[Entry]:
    """The split's teacher-forced chunks, each computed unless its file is already there, `text_batch` at a time."""
    from eectl.data import token_chunks

    skip_first = 1 if getattr(tok, "bos_token_id", None) is not None else 0
    body = spec.chunk_len - skip_first  # whole chunks only, so a larger budget extends the same chunks
    n_whole = math.ceil(n_text / body) * body if split == "train" else n_text
    entries, todo = [], []
    chunks = [c[0].tolist() for c in token_chunks(tok, part, n_whole, spec.chunk_len)]
    for u, ids in enumerate(chunks):
        name = f"{split}/text_{u:06d}.safetensors"
        if not (folder / name).is_file():
            todo.append((name, ids))
        entries.append(Entry(split, "text", name, len(ids) - skip_first, len(ids)))
    done = {e.file: e.tokens for e in entries} if on_tokens is not None else {}
    if on_tokens is not None:
        on_tokens(sum(done.values()) - sum(done[n] for n, _ in todo))
    # equal lengths batch without padding (only a split's last chunk may be shorter)
    groups: dict[int, list[tuple[str, list[int]]]] = {}
    for name, ids in todo:
        groups.setdefault(len(ids), []).append((name, ids))
    for group in groups.values():
        for g0 in range(0, len(group), spec.text_batch):
            part_ = group[g0 : g0 + spec.text_batch]
            t = time.perf_counter()
            states = base_states(adapter, [ids for _, ids in part_], spec.layers)
            t = timing.add("text base", t)
            for (name, ids), st in zip(part_, states, strict=True):
                measured = torch.zeros(len(ids), dtype=torch.bool)
                measured[skip_first:] = True
                seq = make_sequence(adapter, ids, measured, st, spec.teacher_k)
                t = timing.add("teacher", t)
                write_sequence(folder / name, seq)
                t = timing.add("write", t)
                if on_tokens is not None:
                    on_tokens(done[name])
    return entries


def _cache_generated(
    adapter: Any,
    tok: Any,
    folder: Path,
    split: str,
    part: Any,
    n_gen: int,
    spec: CacheSpec,
    timing: Timing,
    on_tokens: Callable[[int], None] | None,
) -> list[Entry]:
    """The split's prompts + greedy continuations until `n_gen` measured tokens; files already there are kept.
    The generation keeps the states it computes (calibrate's generator with `keep`): the base does not run
    again on the generated sequences."""
    from eectl.exits.generation import Keep, generate_continuations, prompt_ids

    max_prompt = max(8, min(adapter.dims.max_positions, 4096) - spec.gen_len - 1)
    prompts = prompt_ids(tok, part.prompts, max_prompt, spec.raw)
    eos = getattr(tok, "eos_token_id", None)
    entries: list[Entry] = []
    got = 0
    window = spec.gen_batch * 4  # prompts per call: sorted by length into batches there, files written after it
    for b0 in range(0, len(prompts), window):
        if got >= n_gen:
            break
        members = range(b0, min(b0 + window, len(prompts)))
        todo = [i for i in members if not (folder / f"{split}/gen_{i:06d}.safetensors").is_file()]
        if todo:
            t = time.perf_counter()
            conts, _ = generate_continuations(
                adapter,
                [prompts[i] for i in todo],
                min(len(todo) * spec.gen_len, n_gen - got),
                spec.gen_len,
                eos,
                spec.gen_batch,
                keep=Keep(spec.layers),
            )
            t = timing.add("generation", t)
            for c in conts:
                assert c.states is not None
                p, n = len(c.prompt), len(c.generated)
                # position j predicts token j + 1: the last prompt position predicts the first continuation token;
                # the last generated token is only a label (no step fed it), so the sequence ends before it
                ids = (c.prompt + c.generated)[: p + n - 1]
                measured = torch.zeros(len(ids), dtype=torch.bool)
                measured[p - 1 :] = True
                seq = make_sequence(adapter, ids, measured, c.states, spec.teacher_k)
                t = timing.add("teacher", t)
                write_sequence(folder / f"{split}/gen_{todo[c.unit]:06d}.safetensors", seq)
                t = timing.add("write", t)
        for i in members:
            name = f"{split}/gen_{i:06d}.safetensors"
            if got >= n_gen or not (folder / name).is_file():
                continue
            n, length = _counts(folder / name)
            entries.append(Entry(split, "gen", name, n, length))
            got += n
            if on_tokens is not None:
                on_tokens(n)
    if got < n_gen:
        raise DataError(
            f"the {split} part's {len(prompts)} prompts gave only {got} generated tokens, fewer than {n_gen}",
            hint="lower the generated token budget or pass more data",
        )
    return entries


def _counts(path: Path) -> tuple[int, int]:
    """A sequence file's measured positions and length, without reading its states."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # type: ignore[no-untyped-call]
        measured = f.get_tensor("measured")
    return int(measured.sum()), int(measured.numel())
