"""The checkout itself: no merge-conflict block may be committed (one slipped into the README's Layout once)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def _ignored(rel: Path) -> bool:
    """Build outputs and hidden folders (benchmarks/.peers holds a whole virtual environment), not the sources."""
    return "__pycache__" in rel.parts or any(part.startswith(".") for part in rel.parts[1:])


def _text_files() -> list[Path]:
    roots = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "setup.sh"]
    for folder in ("eectl", "tests", "recipes", "benchmarks", "scripts", "docs", ".ci"):
        roots += sorted(p for p in (ROOT / folder).rglob("*") if p.is_file() and not _ignored(p.relative_to(ROOT)))
    return [p for p in roots if p.is_file() and p.suffix not in {".png", ".pyc", ".onnx", ".npy", ".safetensors"}]


def test_no_merge_conflict_markers_are_committed():
    files = _text_files()
    assert any(p.name == "README.md" for p in files)  # the scan covers what matters
    bad = []
    for p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        bad += [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}" for m in MARKER.finditer(text)]
    assert not bad, f"merge-conflict markers: {bad}"


def test_the_marker_pattern_finds_a_conflict_block():
    block = "a\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> main\nb\n"
    assert len(MARKER.findall(block)) == 3
