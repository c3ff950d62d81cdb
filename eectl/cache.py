"""Results reused across runs: JSON documents (and files) under $EECTL_CACHE/results, keyed by content hashes.

A key is the SHA-256 of a JSON description of everything the result depends on (model weights' hash, the data's
hash, the settings, a version of the code that computes it), so a hit can only return what the same computation
would produce again. Nothing is ever invalidated by time: a changed input is a different key.
What this module does not do: decide what goes into a key (each stage does), or cache timings as measurements.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eectl.files import sha256_file


def results_dir() -> Path:
    from eectl.models.loading import cache_dir

    return cache_dir() / "results"


def digest(description: Any) -> str:
    """A stable hash of a JSON-able description (dict order does not matter)."""
    blob = json.dumps(description, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def texts_sha256(texts: Iterable[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def read(kind: str, key: str) -> dict[str, Any] | None:
    path = results_dir() / kind / f"{key}.json"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # absent or unreadable (a partial write never lands: writes are atomic)
    return doc if isinstance(doc, dict) and doc.get("key") == key else None


def write(kind: str, key: str, doc: dict[str, Any]) -> Path:
    from eectl.files import atomic_write_text

    return atomic_write_text(results_dir() / kind / f"{key}.json", json.dumps({**doc, "key": key}))


def stored_files(kind: str, key: str) -> Path:
    """The folder holding the files of a cached stage output (may not exist)."""
    return results_dir() / kind / key


def store_files(kind: str, key: str, files: list[Path]) -> Path:
    """Copy files into the cache atomically (a temporary folder renamed into place)."""
    target = stored_files(kind, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key}-"))
    for f in files:
        if f.is_dir():
            shutil.copytree(f, tmp / f.name)
        else:
            shutil.copy2(f, tmp / f.name)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    return target


def restore_files(kind: str, key: str, dest: dict[str, Path]) -> bool:
    """Copy a cached stage output's files to their destinations (name in the cache -> path); False on a miss."""
    src = stored_files(kind, key)
    if not src.is_dir() or not all((src / name).exists() for name in dest):
        return False
    for name, path in dest.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.restoring")
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        if (src / name).is_dir():
            shutil.copytree(src / name, tmp)
        else:
            shutil.copy2(src / name, tmp)
        if path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    return True


def model_identity(source: Any) -> dict[str, object]:
    """What identifies a model's computation: its weights' SHA-256 (and a folder's tokenizer files), or its
    hub id when there are no local files to hash."""
    ident: dict[str, object] = {"kind": source.kind, "sha256": source.sha256 if source.weight_files else None}
    if source.kind == "hub" or not source.weight_files:
        ident["spec"] = source.spec
    if source.kind == "hf-folder" and source.path is not None:
        ident["tokenizer"] = texts_sha256(
            f.read_text(encoding="utf-8", errors="replace") for f in sorted(Path(source.path).glob("tokenizer*"))
        )
    return ident


# Bumped when calibrate's choice of measured tokens changes for the same settings (2: generation takes the data's
# prompts in order, whatever --gen-batch), so a cached calibration of the old sample is not reused.
CALIBRATE_SAMPLE = 2


class PipelineCache:
    """The main job's stage outputs, reused when the model, data and the recipe's settings for a stage (and the
    outputs it consumes, by hash) are unchanged. Heads and calibration files are stored in the cache; an exported
    artifact (hundreds of MB) is not copied: its manifest's hash is recorded, and the folder in artifacts/ is
    reused when it still has exactly that manifest (the runner checks every file's hash when it loads). The profile
    caches its own results (eectl.profile); run and bench always run: they are measurements."""

    def __init__(self, recipe: Any, plan: Any, enabled: bool = True) -> None:
        from eectl import __version__
        from eectl.data import load_text_data
        from eectl.models.loading import resolve_source

        self.enabled = enabled
        self.recipe, self.plan = recipe, plan
        text = load_text_data(recipe.data.source, recipe.data.field)
        self.base = {
            "eectl": __version__,
            "model": model_identity(resolve_source(recipe.model)),
            "data": {"sha256": texts_sha256(text.texts), "field": recipe.data.field},
            "exits": recipe.exits,
            "top_k": recipe.top_k,
            "target": recipe.target,
        }

    def _files(self, stage: str) -> list[Path]:
        from eectl.head_designs import sidecar_path

        p = self.plan
        return [p.heads, sidecar_path(p.heads)] if stage == "train-heads" else [p.calibration]

    def key(self, stage: str) -> str:
        r, p = self.recipe, self.plan
        if stage == "train-heads":
            return digest({**self.base, "stage": stage, "heads": r.heads.model_dump()})
        if stage == "calibrate":
            heads = sha256_file(p.heads)
            sample = CALIBRATE_SAMPLE
            return digest(
                {
                    **self.base,
                    "stage": stage,
                    "heads": heads,
                    "signal": r.signal,
                    "tokens": r.data.tokens,
                    "sample": sample,
                }
            )
        if stage == "export":
            parts = {"heads": sha256_file(p.heads), "calibration": sha256_file(p.calibration)}
            return digest({**self.base, "stage": stage, **parts})
        raise ValueError(stage)

    def restore(self, stage: str) -> str | None:
        """Put the stage's cached output in place and say so; None when the stage must run."""
        if not self.enabled or stage not in ("train-heads", "calibrate", "export"):
            return None
        key = self.key(stage)
        if stage == "export":
            hit = read("export", key)
            manifest = self.plan.artifact / "manifest.json"
            if hit is not None and manifest.is_file() and sha256_file(manifest) == hit.get("manifest_sha256"):
                return f"cached: {self.plan.artifact} is already the export of these heads and calibration"
            return None
        files = self._files(stage)
        if restore_files(stage, key, {f.name: f for f in files}):
            return f"cached: {', '.join(str(f) for f in files)} (same model, data and settings)"
        return None

    def store(self, stage: str) -> str:
        """Record a stage that ran; returns how it is reported."""
        if stage in ("run", "bench"):
            return "ran (a measurement: never cached)"
        if not self.enabled or stage == "profile":
            return "ran" if stage != "profile" else "ran (results cached by the profile itself)"
        key = self.key(stage)
        if stage == "export":
            manifest = self.plan.artifact / "manifest.json"
            write("export", key, {"manifest_sha256": sha256_file(manifest), "folder": str(self.plan.artifact)})
        else:
            store_files(stage, key, self._files(stage))
        return "ran"
