"""Writing and reading eectl's files safely: atomic writes, one hash, one permissions convention, folder staging
with a destination lock, stale-temp cleanup, UTF-8 decoding and path confinement.

Every producer (calibrate, train-heads, export, bench, profile, the GGUF cache) writes through here, so the
guarantees are stated once:

- **Atomic**: a file is written to a temporary name in the destination's folder and renamed over the destination
  (`os.replace`); a folder is built in a staging folder beside it and renamed into place. A reader sees the old
  file or the new one, never half of one; a failed write leaves nothing behind.
- **Permissions**: outputs are ordinary files, as `open()` and `mkdir` create them: 0o666 / 0o777 minus the umask
  (0644 / 0755 under the usual umask 022). `mkstemp`/`mkdtemp` create private (0600 / 0700) temporaries; they are
  widened before the rename.
- **Locks**: `DestinationLock` holds an exclusive `flock` on a lock file beside the destination for as long as a
  producer writes it. Why flock rather than a PID file: the kernel releases the lock when its process dies (SIGKILL
  and crashes included), so a lock left by a dead process is simply free again, with no PID-reuse guesswork and no
  clean-up needed; the PID written in the file only serves the error message.
- **Stale temps**: staging folders are named `.<name>.eectl-tmp-<random>` and hold a marker file
  (`.eectl-staging`, JSON naming eectl) that their writer keeps flock-ed. A later export removes a folder only when
  it has both the name and the marker and nobody holds the marker's lock (its writer is dead): never anything else.
- **Errors**: OS failures (disk full, read-only folder, a file where a folder should be) become one-line
  `OutputError`s naming the path.
- **Names**: every path option is checked once (`check_path_option`, called by cli/app.py for each command) for
  names the file system cannot hold (over NAME_MAX bytes, NUL bytes); the temporaries and locks named after an
  output keep within NAME_MAX by shortening that name (`side_name`), so any legal output name can be written.

What this module does not do: decide what goes into a file (the stages do) or check an artifact's contents
(contracts/manifest.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from eectl.errors import DataError, EectlError, OutputError, UsageError

STAGING_MARKER = ".eectl-staging"  # inside a staging folder; its writer holds an flock on it
_STAGING = re.compile(r"^\.(?P<name>.+)\.eectl-(?:tmp|old)-[A-Za-z0-9_]+$")


# ---------------------------------------------------------------------------------------------------------------
# Hashing and permissions
# ---------------------------------------------------------------------------------------------------------------


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """SHA-256 of a file's bytes, hex (read in 4 MB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask can only set-and-return)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of an output file: what open() would create (0o666 minus the umask)."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode of an output folder: what mkdir would create (0o777 minus the umask)."""
    return 0o777 & ~_umask()


def output_error(path: str | Path, exc: OSError) -> OutputError:
    """One line for an OS failure while writing `path`: what failed, where."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    where = exc.filename if exc.filename and str(exc.filename) != str(path) else None
    return OutputError(f"cannot write {path}: {reason}" + (f" ({where})" if where else ""))


# ---------------------------------------------------------------------------------------------------------------
# Names the file system can hold
# ---------------------------------------------------------------------------------------------------------------

NAME_MAX = 255  # bytes in one file name (Linux ext4/xfs/tmpfs, macOS APFS): longer gives ENAMETOOLONG
PATH_MAX = 4096  # bytes in a whole path (Linux)
_PART_EXTRA = len("..") + 8 + len(".eectl-part")  # atomic_write's temporary: .NAME.<8 random>.eectl-part
_STAGE_EXTRA = len("..eectl-tmp-") + 8  # a staging folder: .NAME.eectl-tmp-<8 random>


def path_problem(value: str | Path) -> str | None:
    """Why `value` cannot name a file on this system (a NUL byte, a name over NAME_MAX bytes, a path over
    PATH_MAX), or None. Only the name is looked at: nothing is opened."""
    raw = os.fsencode(value)
    if b"\0" in raw:
        return "it contains a NUL byte"
    if len(raw) >= PATH_MAX:
        return f"it is {len(raw)} bytes long; a path may have at most {PATH_MAX - 1}"
    for part in raw.split(b"/"):
        if len(part) > NAME_MAX:
            shown = os.fsdecode(part[:24]).encode("utf-8", "backslashreplace").decode()
            return f"the name '{shown}...' is {len(part)} bytes; a file name may have at most {NAME_MAX}"
    return None


def check_path_option(value: str | Path | None, option: str) -> None:
    """The one check of a path option's name, before a command runs (cli/app.py calls it for every path option of
    every command): UsageError (exit 2) instead of `OSError: File name too long` from wherever it is first used."""
    problem = None if value is None else path_problem(value)
    if problem is not None:
        raise UsageError(f"{option} cannot name a file: {problem}", hint="give a shorter name")


def side_name(name: str, extra: int) -> str:
    """`name` as used in the name of a temporary or lock file that adds `extra` bytes to it: `name` itself while the
    whole fits in NAME_MAX, else its first bytes and 16 hex digits of its SHA-256. Deterministic, so every process
    agrees on a lock's name; only eectl's own temporaries carry it (the output keeps its full name)."""
    raw = os.fsencode(name)
    if len(raw) + extra <= NAME_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return f"{os.fsdecode(raw[: max(0, NAME_MAX - extra - 17)])}~{digest}"


# ---------------------------------------------------------------------------------------------------------------
# Atomic files
# ---------------------------------------------------------------------------------------------------------------


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> Path:
    """Write `path` atomically: `write(tmp)` fills a temporary file beside it, which is then renamed over `path`.

    The result has the output mode (file_mode); on any failure the temporary is removed, `path` is untouched, and an
    OS error becomes an OutputError naming the path.
    """
    return atomic_write_group([(path, write)])[0]


def atomic_write_group(files: Sequence[tuple[str | Path, Callable[[Path], object]]]) -> list[Path]:
    """Write files that belong together (an output and its sidecars) as `atomic_write` writes one, and publish them
    together or not at all: every temporary is filled (and synced) first, and only once all of them are written are
    they renamed into place, the first file (the output) last, so its sidecars are there when it appears. A failure
    while writing any of them (a disk full at the sidecar) removes every temporary and publishes none; the renames
    themselves need no space."""
    staged: list[tuple[Path, Path]] = []
    try:
        for given, write in files:
            path = Path(given)
            staged.append((path, _temporary(path)))
            try:
                write(staged[-1][1])
                os.chmod(staged[-1][1], file_mode())
                with open(staged[-1][1], "rb+") as f:
                    os.fsync(f.fileno())  # the content is on disk before the rename makes it the file (power loss)
            except OSError as exc:
                raise output_error(path, exc) from None
        for path, tmp in reversed(staged):
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise output_error(path, exc) from None
    finally:
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)
    return [path for path, _ in staged]


def _temporary(path: Path) -> Path:
    """An empty private temporary file beside `path` (its folder created), named after it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{side_name(path.name, _PART_EXTRA)}."
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".eectl-part", dir=path.parent)
    except OSError as exc:
        raise output_error(path, exc) from None
    os.close(fd)
    return Path(name)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, doc: Any) -> Path:
    """JSON, indented, strict (NaN and infinity are refused: they are not JSON)."""
    return atomic_write_text(path, json.dumps(doc, indent=2, allow_nan=False) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Reading text
# ---------------------------------------------------------------------------------------------------------------


def read_utf8(path: str | Path, error: type[EectlError] = DataError) -> str:
    """A text file decoded as UTF-8, as `clean_text` gives it (no byte-order mark, \\r\\n as \\n); bytes that are not
    UTF-8 are refused with one line naming the byte offset and line (no guessing at other encodings: a silently
    mis-decoded prompt or recipe is worse than an error)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {p}: {exc.strerror or exc}") from None
    return decode_utf8(raw, str(p), error)


def decode_utf8(raw: bytes, name: str, error: type[EectlError]) -> str:
    try:
        return clean_text(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise error(
            f"{name} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} (line {line})",
            hint="convert it to UTF-8, e.g. iconv -f latin1 -t utf-8",
        ) from None


def clean_text(text: str) -> str:
    """Text as eectl reads it from a file or stdin: without a leading byte-order mark (U+FEFF, which Windows editors
    write: an encoding marker, never content, and a token of its own in a prompt) and with Windows line ends (\\r\\n)
    as \\n, so that a record, a prompt line or a paragraph break means the same in a file saved on Windows."""
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def text_lines(text: str) -> list[str]:
    """The lines of a text (one prompt or one JSON record per line): split at \\n (and \\r\\n) only. Not
    str.splitlines, which also splits at U+2028, U+2029, U+0085, form feeds and other characters that are content
    inside a line (a JSON string may hold them raw)."""
    return clean_text(text).split("\n")


def existing_file(path: str | Path, what: str, error: type[EectlError], hint: str | None = None) -> Path:
    """`path` as a file to read, or one line saying what is there instead: nothing (`WHAT not found: PATH`, with
    `hint`), a folder, or something that is not a regular file (a FIFO or a device)."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise error(f"{what} {path} is a folder, not a file", hint="give the path of a file")
    if not p.exists():
        raise error(f"{what} not found: {path}", hint=hint)
    if not p.is_file():
        raise error(f"{what} {path} is not a regular file (a FIFO, device or socket)")
    return p


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def strict_json(text: str) -> Any:
    """json.loads without Python's extensions NaN, Infinity and -Infinity (eectl never writes them: a NaN threshold
    read back would silently never pass). JSONDecodeError (a ValueError) names line and column."""
    return json.loads(text, parse_constant=_refuse_constant)


# ---------------------------------------------------------------------------------------------------------------
# Paths inside a folder
# ---------------------------------------------------------------------------------------------------------------


def confined(root: str | Path, rel: str, error: type[EectlError]) -> Path:
    """`root/rel` resolved (symlinks followed); `error` when it leaves `root` (.., absolute paths, symlinks out) or
    cannot name a file (a NUL byte, a name over NAME_MAX: `path_problem`)."""
    problem = path_problem(rel)
    if problem is not None:
        raise error(f"path {rel[:64]!r} cannot name a file: {problem}")
    base = Path(root).resolve()
    target = (base / rel).resolve()
    if target != base and not target.is_relative_to(base):
        raise error(f"path {rel!r} leaves the folder {root}", hint="refusing to open anything outside it")
    return target


# ---------------------------------------------------------------------------------------------------------------
# Locks
# ---------------------------------------------------------------------------------------------------------------


def lock_path(dest: Path) -> Path:
    return dest.parent / f".{side_name(dest.name, len('..eectl-lock'))}.eectl-lock"


class DestinationLock:
    """An exclusive lock on `dest` for the whole time a producer writes it: `with DestinationLock(dest): ...`.

    A lock file `.NAME.eectl-lock` beside the destination is flock-ed (a second writer fails at once with an
    OutputError naming the holder's PID, or with `wait` waits for it) and removed on exit. A lock left by a killed
    process is not held by anyone (the kernel drops flocks with their process), so it is taken over silently: stale
    locks need no detection heuristic. After locking, the file at the path must still be the one locked (it may have
    been removed by the previous holder between our open and our flock); otherwise the attempt is repeated.
    """

    def __init__(self, dest: str | Path, wait: bool = False) -> None:
        self.dest = Path(dest)
        self.path = lock_path(self.dest)
        self.wait = wait  # block until the holder is done (a cache fill) instead of failing at once (an export)
        self._file: IO[str] | None = None

    def __enter__(self) -> DestinationLock:
        try:
            self.dest.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise output_error(self.dest, exc) from None
        for _ in range(20):
            try:
                f = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until __exit__)
            except OSError as exc:
                raise output_error(self.dest, exc) from None
            try:
                fcntl.flock(f, fcntl.LOCK_EX if self.wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.seek(0)
                holder = f.read().strip() or "unknown"
                f.close()
                raise OutputError(
                    f"{self.dest} is being written by another eectl process ({holder})",
                    hint="wait for it to finish, or choose another --out",
                ) from None
            try:
                same = os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                f.seek(0)
                f.truncate()
                f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
                f.flush()
                self._file = f
                return self
            f.close()  # the previous holder removed it after our open: lock the new one
        raise OutputError(f"cannot lock {self.dest}: the lock file keeps changing ({self.path})")

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self.path.unlink(missing_ok=True)  # before unlocking: a waiter then finds it gone and retries
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------------------------------
# Staging folders
# ---------------------------------------------------------------------------------------------------------------


class Staging:
    """A marked staging folder beside `dest`, removed unless published: `with Staging(dest) as s: ...; s.publish()`.

    The marker file inside it stays flock-ed while this process lives, so `clean_stale` can tell a folder whose
    writer died from one still being written. Call it under a DestinationLock for `dest`.
    """

    def __init__(self, dest: str | Path, kind: str = "tmp") -> None:
        self.dest = Path(dest)
        self.kind = kind
        self.path: Path | None = None
        self._marker: IO[str] | None = None

    def __enter__(self) -> Staging:
        try:
            prefix = f".{side_name(self.dest.name, _STAGE_EXTRA)}.eectl-{self.kind}-"
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=self.dest.parent))
            self.path.chmod(dir_mode())  # mkdtemp makes it private; once renamed it is an ordinary folder
            self._marker = _mark(self.path, self.dest, self.kind)
        except OSError as exc:
            self._discard()
            raise output_error(self.dest, exc) from None
        return self

    @property
    def folder(self) -> Path:
        assert self.path is not None, "use Staging as a context manager"
        return self.path

    def publish(self, replace: Callable[[Path], bool]) -> None:
        """Rename the staging folder to `dest`. An existing `dest` is replaced only when `replace(dest)` says so
        (else OutputError): it is moved aside into a marked folder first and removed after the rename."""
        folder = self.folder
        old: Staging | None = None
        try:
            _ordinary_modes(folder)
            if self.dest.exists() or self.dest.is_symlink():
                if not replace(self.dest):
                    raise OutputError(f"{self.dest} appeared during the export and was left alone")
                old = Staging(self.dest, kind="old").__enter__()
                self.dest.rename(old.folder / self.dest.name)
            folder.rename(self.dest)
            self.path = None
            # Removed only once renamed: a crash before this leaves a marked (cleanable) folder, never an unmarked one.
            (self.dest / STAGING_MARKER).unlink(missing_ok=True)
        except OSError as exc:
            if old is not None and not self.dest.exists():
                with contextlib.suppress(OSError):
                    (old.folder / self.dest.name).rename(self.dest)  # put the previous one back
            raise output_error(self.dest, exc) from None
        finally:
            if old is not None:
                old.__exit__(None, None, None)

    def _discard(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
        if self._marker is not None:
            self._marker.close()
            self._marker = None

    def __exit__(self, *exc: object) -> None:
        self._discard()


def _ordinary_modes(folder: Path) -> None:
    """Give everything in a staged folder the output modes: libraries write some files private (safetensors' writer
    creates 0600 files), and one convention should hold for whatever eectl publishes."""
    for p in [folder, *folder.rglob("*")]:
        if not p.is_symlink():
            p.chmod(dir_mode() if p.is_dir() else file_mode())


def _mark(folder: Path, dest: Path, kind: str) -> IO[str]:
    f = open(folder / STAGING_MARKER, "w", encoding="utf-8")  # noqa: SIM115 (held while the folder is in use)
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    doc = {"eectl": "staging", "kind": kind, "dest": dest.name, "pid": os.getpid(), "created": time.time()}
    f.write(json.dumps(doc) + "\n")
    f.flush()
    return f


def _stale(folder: Path) -> dict[str, Any] | None:
    """The marker of a staging folder whose writer is gone, or None (not ours, unreadable, or still in use)."""
    if not _STAGING.match(folder.name) or folder.is_symlink() or not folder.is_dir():
        return None
    marker = folder / STAGING_MARKER
    try:
        with open(marker, encoding="utf-8") as f:
            doc = json.loads(f.read())
            if not isinstance(doc, dict) or doc.get("eectl") != "staging":
                return None
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: its writer is dead (flocks die with processes)
            fcntl.flock(f, fcntl.LOCK_UN)
            return doc
    except (OSError, ValueError):
        return None


def clean_stale(parent: Path) -> list[Path]:
    """Remove the staging folders in `parent` left by killed eectl processes; return what was removed.

    Only folders named `.<name>.eectl-tmp-*` / `.<name>.eectl-old-*` holding an unlocked eectl marker qualify. A
    moved-aside previous artifact (`old`) whose destination is missing is put back rather than deleted.
    """
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for folder in entries:
        doc = _stale(folder)
        if doc is None:
            continue
        if doc.get("kind") == "old":
            dest = parent / str(doc.get("dest"))
            inner = folder / dest.name
            if not dest.exists() and inner.is_dir():
                with contextlib.suppress(OSError):
                    inner.rename(dest)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


@contextlib.contextmanager
def locked_staging(dest: str | Path, wait: bool = False) -> Iterator[Staging]:
    """Lock `dest` (DestinationLock), remove stale staging folders beside it, and stage a new folder for it."""
    dest = Path(dest)
    with DestinationLock(dest, wait):
        clean_stale(dest.parent)
        with Staging(dest) as staging:
            yield staging
