"""The one check of a command's output paths before any work: names the file system can hold, regular files under
folders, never one of the command's inputs, never inside a folder it reads or inside an eectl artifact, no two outputs
the same file (UsageError, one line, exit 2).

What this module does not do: write anything (eectl/files.py writes atomically and stages folders) or check a path
option's name alone (files.check_path_option, which cli/app.py calls for every option and check_outputs reuses).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from eectl.errors import UsageError
from eectl.files import check_path_option, path_problem


def nearest_existing(path: Path) -> Path:
    """The nearest ancestor of `path` that exists (the root at worst): what mkdir -p would create under."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def check_output_file(path: Path, option: str) -> None:
    """Cheap checks of an output file's path before any work: not an existing folder, and the nearest existing
    ancestor is a folder (mkdir creates the rest). UsageError (one line) otherwise."""
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name")
    parent = nearest_existing(path)
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a folder")


def check_folder_option(path: Path | None, option: str) -> None:
    """A folder option (created if missing, e.g. train-heads --cache) checked before any work: not an existing file,
    and the nearest existing ancestor a folder. UsageError (one line) otherwise."""
    if path is None:
        return
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path} is a file, not a folder", hint="give a folder; it is created if missing")
    parent = nearest_existing(path)
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: {parent} is not a folder")


def check_outputs(
    outputs: Sequence[tuple[str, Path | None, Sequence[Path]]],
    inputs: Sequence[tuple[str, Path | None]] = (),
    folders: Sequence[tuple[str, Path | None]] = (),
) -> None:
    """The one check of a command's outputs before any work (UsageError, one line, exit 2): for each output file and
    every sidecar written beside it (a report's JSON twin and plots, heads' metadata and checkpoint),

    - a name the file system can hold, its sidecars' too (`path_problem`);
    - not an existing folder, under a folder (`check_output_file`);
    - a regular file or nothing: a FIFO or a device (/dev/null) would be replaced by a file, a symbolic link by a file
      where the link was (eectl writes a new file and renames it into place), so both are refused;
    - not one of the command's input files (`inputs`, by option), compared after resolving links and by inode;
    - not inside a folder the command reads (`folders`: an artifact), nor inside any eectl artifact (its folder or
      the two above it hold an eectl manifest.json): its files are hash-checked, a stray one changes it;
    - no two outputs the same file.
    """
    seen: dict[Path, str] = {}
    for option, path, sidecars in outputs:
        if path is None:
            continue
        check_path_option(path, option)
        check_output_file(path, option)
        for target in [path, *sidecars]:
            what = f"{option} {path}" + ("" if target == path else f" (its {target.name} beside it)")
            problem = path_problem(target)
            if problem is not None:  # a sidecar's name adds bytes (x.ckpt.safetensors, x-agreement.png)
                raise UsageError(
                    f"{option}: {target.name[:32]}... beside it cannot be written: {problem}",
                    hint="give a shorter name",
                )
            if target.is_symlink():
                raise UsageError(
                    f"{what} is a symbolic link: eectl would write a new file in its place, not through it",
                    hint="give the path of the file it points to",
                )
            if target.exists() and not target.is_file():
                raise UsageError(f"{what} is not a regular file (a FIFO, device or socket); give a file name")
            for in_option, given in inputs:
                if given is not None and _same_file(target, given):
                    raise UsageError(f"{what} would overwrite {in_option} {given}; give another output path")
            for in_option, folder in folders:
                if folder is not None and is_inside(target, folder):
                    raise UsageError(f"{what} is inside {in_option} {folder}, which this command reads")
            artifact = next((p for p in list(target.resolve().parents)[:3] if _is_artifact(p)), None)
            if artifact is not None:
                raise UsageError(f"{what} is inside the eectl artifact {artifact}; write it elsewhere")
            key = target.resolve()
            if key in seen:
                raise UsageError(f"{what} and {seen[key]} are the same file")
            seen[key] = what


def input_file(spec: str | Path | None) -> Path | None:
    """A data or recipe option as the file it names (None: a built-in name, or nothing there)."""
    if spec is None:
        return None
    p = Path(spec).expanduser()
    return p if p.is_file() else None


def _is_artifact(folder: Path) -> bool:
    """Whether `folder` holds an eectl artifact's manifest (its first bytes name eectl's schema)."""
    try:
        with open(folder / "manifest.json", "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return b'"schema_version"' in head and b'"eectl_version"' in head


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
        return a.resolve() == b.resolve()
    except OSError:
        return False


def is_inside(target: Path, folder: Path) -> bool:
    try:
        return target.resolve().is_relative_to(folder.resolve())
    except OSError:
        return False
