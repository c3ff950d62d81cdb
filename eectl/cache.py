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

from eectl.errors import DataError
from eectl.parsing import parse_json


def results_dir() -> Path:

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
        doc = parse_json(path.read_text(encoding="utf-8"), str(path), DataError)  # a deep or huge one too
    except (OSError, ValueError, DataError):
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


def cache_dir() -> Path:
    env = os.environ.get("EECTL_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("eectl"))
