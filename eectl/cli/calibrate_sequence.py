"""`eectl calibrate --guarantee sequence --artifact A`: the certificate on an exported artifact (calibrate/sequence.py),
written into its manifest and, with --out, into a calibration file; the table of the settings tested."""

from __future__ import annotations

from pathlib import Path

from eectl.output import Output


def sequence_options(
    risk: str,
    delta: float,
    epsilon: float,
    policy: str,
    exits: list[int] | None,
    signal: str | None,
    top_k: int | None,
    grid: str | None,
    gen_batch: int,
) -> object:
    """calibrate's options as calibrate/sequence.py's SequenceOptions (--grid parsed; --gen-batch: rows decoded
    together, its token-mode default 64 taken as 8)."""
    from eectl.calibrate.sequence import SequenceOptions
    from eectl.errors import UsageError

    try:
        values = [float(x) for x in grid.split(",") if x.strip()] if grid is not None else None
    except ValueError:
        raise UsageError(f"--grid must be comma-separated numbers, got '{grid}'") from None
    slots = 8 if gen_batch == 64 else gen_batch
    return SequenceOptions(risk, delta, epsilon, policy, exits or None, signal, top_k, values, slots=slots)


def calibrate_sequence(
    out: Output,
    artifact: Path | None,
    data: str | None,
    field: str | None,
    opts: object,
    prompts: int,
    offset: int,
    raw: bool,
    threads: int | None,
    out_path: Path | None,
) -> None:
    from eectl.calibrate.sequence import SequenceOptions, certify
    from eectl.contracts.calibration import write_calibration
    from eectl.contracts.manifest import write_manifest
    from eectl.data import encode_prompt, gsm8k_answers, load_text_data
    from eectl.errors import UsageError
    from eectl.files import check_outputs, input_file
    from eectl.run.generate import load_tokenizer
    from eectl.runtime.sessions import ArtifactRuntime

    assert isinstance(opts, SequenceOptions)
    if artifact is None:
        raise UsageError("--guarantee sequence certifies an exported artifact: pass --artifact DIR")
    if prompts < 1 or offset < 0:
        raise UsageError(f"--prompts must be >= 1 and --offset >= 0, got {prompts} and {offset}")
    check_outputs([("--out", out_path, [])], [("--data", input_file(data))], [("--artifact", artifact)])
    text = load_text_data(data, field)
    window = slice(offset, offset + prompts)
    chosen = text.prompts[window]
    answers = gsm8k_answers(text.texts[window])
    rt = ArtifactRuntime(artifact, provider="cpu", threads=threads)
    if out_path is not None and rt.manifest.calibration is None:
        raise UsageError("--out writes the artifact's calibration with the certificate; this artifact has none")
    from eectl.calibrate.sequence import check

    check(opts, len(chosen), answers)
    tok = load_tokenizer(rt)
    ids = [encode_prompt(tok, p, raw) for p in chosen]
    out.log(
        f"certifying {opts.policy} on {len(ids)} prompts of {text.name} (from record {offset}): {opts.risk}, "
        f"delta {opts.delta:g}, epsilon {opts.epsilon:g}, {rt.threads} threads"
    )
    cert = certify(rt, ids, answers, opts, lambda t: str(tok.decode(t, skip_special_tokens=True)), text.name, out.log)
    m = rt.manifest.model_copy(update={"certificate": cert})
    if m.plan is not None and m.costs is not None:  # the plan may now choose the certified setting
        from eectl.plan.choose import plan_manifest

        m.plan = plan_manifest(m, m.costs)
    write_manifest(m, Path(artifact))
    if out_path is not None and m.calibration is not None:
        write_calibration(m.calibration.model_copy(update={"certificate": cert}), out_path)
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
    out.line(
        f"{cert.wall_s:.0f}s (generation); written: {artifact}/manifest.json" + (f", {out_path}" if out_path else "")
    )
