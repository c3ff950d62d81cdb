from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from eectl.data import load_text_data
from eectl.models import load_model
from eectl.runtime.sessions import init_ort
from tests.tiny import GSM8K, TINY_CONFIGS, save_tiny

torch.set_num_threads(1)
init_ort(1)  # one global ONNX Runtime pool for the whole test process
os.environ.setdefault("EECTL_QUIET", "1")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every family's tiny model saved as a Hugging Face folder (save_pretrained layout)."""
    root = tmp_path_factory.mktemp("tiny-models")
    return {t: save_tiny(t, root / t) for t in TINY_CONFIGS}


@pytest.fixture(params=sorted(TINY_CONFIGS))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    """The tiny Llama, loaded once per test module."""
    return load_model(str(tiny_dirs["llama"]))


@pytest.fixture(scope="module")
def gsm8k():
    return load_text_data(str(GSM8K))
