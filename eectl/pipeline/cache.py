"""The pipeline's reuse of stage outputs across runs, keyed by content (on top of eectl.cache's store)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eectl.cache import digest, model_identity, read, restore_files, store_files, texts_sha256, write
from eectl.contracts.budgets import TWIN_REVISION
from eectl.files import sha256_file

if TYPE_CHECKING:
    from eectl.contracts.recipe import Recipe
    from eectl.pipeline.steps import Plan

# Bumped when calibrate's choice of measured tokens, or what it records of them, changes for the same settings (2:
# generation takes the data's prompts in order, whatever --gen-batch; 3: drafts from the context replayed on the
# continuations; 4: each option's counts per judged unit; 5: the menu judged out of fold on every unit; 6: the
# counts as one line of text; 7: the drafts replayed again with longer shortest runs; 8: options' counts per block of
# positions and the drafts' replay cut at shorter lengths: what a run of another length is priced on), so a cached
# calibration of the old kind is not reused.
CALIBRATE_SAMPLE = 8


class PipelineCache:
    """The main job's stage outputs, reused when the model, data and the recipe's settings for a stage (and the
    outputs it consumes, by hash) are unchanged. Heads and calibration files are stored in the cache; an exported
    artifact (hundreds of MB) is not copied: its manifest's hash is recorded, and the folder in artifacts/ is
    reused when it still has exactly that manifest (the runner checks every file's hash when it loads). The profile
    caches its own results (eectl.profile.lens); run and bench always run: they are measurements."""

    def __init__(self, recipe: Recipe, plan: Plan, enabled: bool = True) -> None:
        from eectl import __version__
        from eectl.data import load_text_data
        from eectl.models.loading import resolve_source

        self.enabled = enabled
        self.recipe, self.plan = recipe, plan
        text = load_text_data(recipe.data.source, recipe.data.field)
        self.base = {
            "eectl": __version__,
            "model": model_identity(resolve_source(recipe.model)),
            "data": {"sha256": texts_sha256(text.texts), "field": recipe.data.field},
            "exits": recipe.exits,
            "top_k": recipe.top_k,
            "target": recipe.target,
            "weights": recipe.weights,  # int4: heads and calibration fitted against the int4 twin
            # export's own settings (exact_wide) key the export alone: the torch stages' outputs are the same
            **(
                {"int4": recipe.int4.model_dump(exclude={"exact_wide"}), "twin": TWIN_REVISION}
                if recipe.weights == "int4"
                else {}
            ),
        }

    def _files(self, stage: str) -> list[Path]:
        from eectl.contracts.heads import sidecar_path

        p = self.plan
        return [p.heads, sidecar_path(p.heads)] if stage == "train-heads" else [p.calibration]

    def key(self, stage: str) -> str:
        r, p = self.recipe, self.plan
        if stage == "train-heads":
            return digest({**self.base, "stage": stage, "heads": r.heads.model_dump()})
        if stage == "calibrate":
            heads = sha256_file(p.heads)
            sample = CALIBRATE_SAMPLE
            return digest(
                {
                    **self.base,
                    "stage": stage,
                    "heads": heads,
                    "signal": r.signal,
                    "tokens": r.data.tokens,
                    "sample": sample,
                }
            )
        if stage == "export":
            from eectl.export.exporter import EXPORT_REVISION

            parts: dict[str, object] = {"heads": sha256_file(p.heads), "calibration": sha256_file(p.calibration)}
            if r.weights == "int4":
                from eectl.export.exporter import exact_wide_for

                parts["exact_wide"] = exact_wide_for(r.int4.exact_wide, r.weights, r.int4.accuracy_level)
            return digest({**self.base, "stage": stage, "revision": EXPORT_REVISION, **parts})
        raise ValueError(stage)

    def restore(self, stage: str) -> str | None:
        """Put the stage's cached output in place and say so; None when the stage must run."""
        if not self.enabled or stage not in ("train-heads", "calibrate", "export"):
            return None
        key = self.key(stage)
        if stage == "export":
            hit = read("export", key)
            manifest = self.plan.artifact / "manifest.json"
            if hit is not None and manifest.is_file() and sha256_file(manifest) == hit.get("manifest_sha256"):
                return f"cached: {self.plan.artifact} is already the export of these heads and calibration"
            return None
        files = self._files(stage)
        if restore_files(stage, key, {f.name: f for f in files}):
            if stage == "train-heads" and not _finite(self.plan.heads):
                return None  # heads an older eectl trained to NaN (a state cache overflowed): trained again
            return f"cached: {', '.join(str(f) for f in files)} (same model, data and settings)"
        return None

    def store(self, stage: str) -> str:
        """Record a stage that ran; returns how it is reported."""
        if stage in ("run", "bench"):
            return "ran (a measurement: never cached)"
        if not self.enabled or stage == "profile":
            return "ran" if stage != "profile" else "ran (results cached by the profile itself)"
        key = self.key(stage)
        if stage == "export":
            manifest = self.plan.artifact / "manifest.json"
            write("export", key, {"manifest_sha256": sha256_file(manifest), "folder": str(self.plan.artifact)})
        else:
            store_files(stage, key, self._files(stage))
        return "ran"


def _finite(heads: Path) -> bool:
    """Whether every float tensor of a heads file is finite."""
    from safetensors.torch import load_file

    from eectl.exits.designs import nonfinite

    return not nonfinite(load_file(str(heads)))
