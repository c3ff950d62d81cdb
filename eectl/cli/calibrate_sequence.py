"""`eectl calibrate --guarantee sequence --artifact A`: the options as calibrate/stage.py's SequenceRequest, and the
table of the settings tested once the certificate is written (into the manifest and, with --out, a calibration
file)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eectl.errors import UsageError
from eectl.output import Output

if TYPE_CHECKING:
    from eectl.calibrate.stage import CertifyResult, SequenceRequest


def sequence_request(
    artifact: Path | None,
    data: str | None,
    field: str | None,
    prompts: int,
    offset: int,
    raw: bool,
    out_path: Path | None,
    risk: str,
    delta: float,
    epsilon: float,
    policy: str,
    exits: list[int] | None,
    signal: str | None,
    top_k: int | None,
    grid: str | None,
    gen_batch: int,
) -> SequenceRequest:
    """calibrate's options as the certification's request (--grid parsed; --gen-batch: rows decoded together, its
    token-mode default 64 taken as 8)."""
    from eectl.calibrate.sequence import SequenceOptions
    from eectl.calibrate.stage import SequenceRequest

    try:
        values = [float(x) for x in grid.split(",") if x.strip()] if grid is not None else None
    except ValueError:
        raise UsageError(f"--grid must be comma-separated numbers, got '{grid}'") from None
    slots = 8 if gen_batch == 64 else gen_batch
    opts = SequenceOptions(risk, delta, epsilon, policy, exits or None, signal, top_k, values, slots=slots)
    if artifact is None:
        raise UsageError("--guarantee sequence certifies an exported artifact: pass --artifact DIR")
    return SequenceRequest(artifact, opts, data, field, prompts, offset, raw, out_path)


def print_certificate(out: Output, done: CertifyResult) -> None:
    """The settings tested (threshold, risk, p-value, certified, mean layers), the certificate, the plan and the
    margins; with --json the certificate."""
    cert, m = done.certificate, done.manifest
    out.json(cert.model_dump(mode="json"))
    rows = [
        [f"{t.threshold:g}", f"{t.risk:.3f}", f"{t.p_value:.3g}", "yes" if t.rejected else "no", f"{t.mean_layers:.2f}"]
        for t in cert.tested
    ]
    out.table(
        f"fixed-sequence test ({cert.bound}), {cert.prompts} prompts",
        ["threshold", "risk", "p-value", "certified", "mean layers"],
        rows,
    )
    out.line(f"certificate: {cert.describe()}")
    if m.plan is not None:
        out.line(m.plan.summary())
    if cert.upper_bound is not None and cert.empirical_risk is not None:
        out.line(
            f"margin at {cert.prompts} prompts: {cert.upper_bound - cert.empirical_risk:.3f} above the empirical risk"
        )
    if cert.prompts_needed is not None:
        out.line(f"the next setting (risk {cert.tested[-1].risk:.3f}) would need {cert.prompts_needed} prompts")
    if cert.prompts_for_half_delta is not None:
        out.line(f"delta {cert.delta / 2:g} at this setting would need {cert.prompts_for_half_delta} prompts")
    written = f"{done.artifact}/manifest.json" + (f", {done.out}" if done.out else "")
    out.line(f"{cert.wall_s:.0f}s (generation); written: {written}")
