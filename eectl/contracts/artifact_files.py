"""The artifact's folder as `read_manifest` checks it (contracts/manifest.py), apart from the manifest's fields:
what is at a path (`file_kind`), every listed file a regular one reached through real folders, nothing unlisted in
a folder the runtime reads, and the shared weights' files against their entries (`SharedWeight`, `check_weight`:
dtype, shape, order, finiteness), which runtime/tables.py maps the same way.

What this module does not do: read the manifest or check its hashes (manifest.py does, calling these).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from eectl.errors import ArtifactError
from eectl.files import STAGING_MARKER, confined

# the precisions an artifact's graphs and shared tables are stored in, and the numpy dtype of each
DTYPES: dict[str, Any] = {"fp32": np.float32, "fp16": np.float16}
Dtype = Literal["fp32", "fp16"]


class SharedWeight(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: str
    shape: list[int] = Field(min_length=2, max_length=2)
    dtype: Dtype  # the .npy file's own dtype (checked against it when read)
    transposed: bool = False  # stored [hidden, vocab] (the LM head's MatMul layout) rather than [vocab, hidden]


def file_kind(path: Path) -> str:
    """What is at `path`, not following a final link: 'missing', 'a regular file', 'a folder', 'a symbolic link',
    or 'a FIFO, device or socket'."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a regular file" if stat.S_ISREG(mode) else "a FIFO, device or socket"


def regular_file(root: Path, rel: str, folder: str | Path) -> Path:
    """`root/rel` where it is a regular file reached through real folders: an artifact holds its files itself (a link
    inside it, even to another of its files, is refused: what it reads could change behind its hashes); a FIFO would
    block the hash's read, a folder is no file."""
    p = root
    parts = PurePosixPath(rel).parts
    for i, part in enumerate(parts):
        p = p / part
        kind = file_kind(p)
        if kind == "missing":
            raise ArtifactError(f"artifact file missing: {rel} in {folder}")
        last = i == len(parts) - 1
        if kind != ("a regular file" if last else "a folder"):
            what = "/".join(parts[: i + 1])
            raise ArtifactError(
                f"the artifact's {'file' if last else 'folder'} {what} in {folder} is {kind}, not a regular "
                f"{'file' if last else 'folder'}",
                hint="re-export the artifact: it holds its files itself",
            )
    return p


def _eectl_temporary(name: str) -> bool:
    """eectl's own files that a killed write may leave (files.atomic_write's `.NAME.xxxx.eectl-part`, a staging
    marker, a lock): never read as the artifact's."""
    return name == STAGING_MARKER or name.endswith((".eectl-part", ".eectl-lock"))


def check_unlisted(root: Path, listed: set[str], tokenizer_dir: str) -> None:
    """Nothing unlisted in a folder the runtime reads: the artifact's own, the tokenizer's (transformers loads
    whatever it holds) and every folder holding a listed file (weights/)."""
    tok = PurePosixPath(tokenizer_dir).as_posix().strip("/")
    parents = {PurePosixPath(rel).parent.as_posix() for rel in listed}
    read = {"" if d == "." else d for d in parents}
    extra: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):  # links are not followed: a linked folder is an entry
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir
        inside_tok = rel_dir == tok or rel_dir.startswith(f"{tok}/")
        linked = [d for d in dirnames if (Path(dirpath) / d).is_symlink()]
        for name in sorted([*filenames, *linked]):
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if rel in listed or _eectl_temporary(name) or not (rel_dir in read or inside_tok):
                continue
            extra.setdefault(tok if inside_tok else rel_dir, []).append(rel)
    if extra:
        where, names = next(iter(sorted(extra.items())))
        place = f"{where}/" if where else f"the artifact's folder {root}"
        raise ArtifactError(
            f"files in {place} that the manifest does not list: {names}",
            hint="the runtime reads these folders: move the files out of the artifact",
        )


def check_weight(root: Path, key: str, w: SharedWeight, finite: bool = False) -> np.ndarray:
    """The shared table `key` mapped from its .npy file and checked against its manifest entry: the file's dtype is
    the entry's, its shape the entry's, C-ordered (ORT would read a Fortran-ordered file's column-major bytes as
    rows), no pickle; with `finite`, every value finite (a NaN LM head hashed as the manifest says gives "\n"
    tokens, silently), read in blocks of rows."""
    path = confined(root, w.file, ArtifactError)
    try:
        # mapped, not read: pages are read as graphs touch them (a K-row gather reads K rows of a table), and
        # two keys naming one file (a tied embedding) share its pages; object arrays (pickles) are refused
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ArtifactError(f"cannot load the weight {w.file}: {first}") from None
    if arr.dtype != DTYPES[w.dtype] or list(arr.shape) != w.shape:
        raise ArtifactError(
            f"the weight {w.file} is {arr.dtype} {list(arr.shape)}; the manifest's shared_weights.{key} says "
            f"{w.dtype} ({np.dtype(DTYPES[w.dtype]).name}) {w.shape}"
        )
    if arr.ndim and not arr.flags.c_contiguous:
        raise ArtifactError(
            f"the weight {w.file} is Fortran-ordered; eectl reads C-ordered .npy files",
            hint="re-export the artifact, or save the array with np.ascontiguousarray",
        )
    if finite:
        rows = max(1, (1 << 24) // max(1, arr.itemsize * int(np.prod(arr.shape[1:]))))  # ~16 MB a block
        for lo in range(0, arr.shape[0], rows):
            block = np.asarray(arr[lo : lo + rows])
            if not np.isfinite(block).all():
                bad = int(np.argwhere(~np.isfinite(block))[0][0]) + lo
                raise ArtifactError(
                    f"the weight {w.file} holds non-finite values (NaN or infinity), first in row {bad}",
                    hint="re-export the artifact from a model with finite weights",
                )
    return arr
