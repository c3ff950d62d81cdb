"""What a run is told, and what the plan's default becomes, where wide passes are not exact.

Verify's check of drafts (from exits or from the context) and defer's deferred positions run several positions of a
row in one segment call. On int4 segments at accuracy levels 2-4 they are exact only where export padded one-row
attention and wide passes compute bit for bit as one-position steps on this machine (runtime/wide_check.py). Where
they are not: a configuration the plan chose runs full depth instead (its speedup was priced as lossless), and one
asked for runs with a warning of what it costs.

What this module does not do: choose configurations (run/generate.py) or check the graphs (runtime/wide_check.py).
"""

from __future__ import annotations

from eectl.runtime.sessions import ArtifactRuntime
from eectl.runtime.state import RunConfig
from eectl.runtime.wide_check import wide_refused


def uses_wide_passes(config: RunConfig) -> bool:
    """Verify with exits or drafts from the context (its check), defer with exits (its deferred positions)."""
    return (config.policy == "verify" and bool(config.exits or config.prompt_drafts)) or (
        config.policy == "defer" and bool(config.exits)
    )


def inexact_here(rt: ArtifactRuntime, config: RunConfig) -> str:
    """Why `config`'s wide passes are not exact on this artifact and machine ("" where they are or it runs none):
    the artifact's own reason (plan/choose.py `wide_inexact`), else this machine's check."""
    from eectl.plan.choose import wide_inexact

    if not uses_wide_passes(config):
        return ""
    return wide_inexact(rt.manifest) or wide_refused(rt) or ""


def wide_warning(rt: ArtifactRuntime, config: RunConfig) -> str | None:
    """What inexact wide passes cost the policy that runs: verify's drafts are not checked losslessly, defer's
    deferred positions are not computed exactly."""
    why = inexact_here(rt, config)
    if not why:
        return None
    if config.policy == "verify":
        return f"this run's output may differ from full depth's: {why}"
    return (
        f"defer's deferred positions run in wide passes whose numbers differ from one-row full depth, so its "
        f"agreement with full depth can fall below the calibrated rate: {why}"
    )
