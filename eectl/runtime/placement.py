"""Where one run keeps its states between graph calls, and what it read on the host: `Placement`.

A run's, not a runtime's: several Runners share one ArtifactRuntime (bench runs its configurations' Runners on one
and steps them in turns from threads), so the runtime holds sessions, weights and kept bindings only, and each graph
call that outputs a state or reads a value takes the placement of the run it serves (`place=`; the host's by
default). A device-resident run (`RunConfig.device_resident`; runner.Runner.generate) gets its own `Placement`:
every hidden state and full logits a graph outputs for it stays in the provider's memory (a `DeviceView` of an
OrtValue; on the CPU EP that memory is the host's, so the same code runs in the CPU tests), and every value it reads
on the host is recorded here, step by step, in one place (`read`), which tests compare with the binding plan. A run
stepped on the bound chain (runtime/chain.py) keeps the same record (`record`): its states stay in the chain's
buffers, and the chain records what each step reads (the final head's token, its exits' decisions, a gate's state),
as the host-path steps around it do theirs (the prompt's and verify's checks: the final head's tokens).

What this module does not do: run graphs (sessions.py, batch.py, blocks.py) or decide where a run's states live
(runner.Runner: greedy steps with active exits, by `RunConfig.device_resident`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Read = tuple[str, int, str]  # (graph or device op, exit layer or -1, output key) of one value read on the host


@dataclass(frozen=True)
class Placement:
    """device: the run's states stay device values between graphs. The record of its host reads is kept for a
    device-resident run and where `record` asks for it (every generate call), never for `HOST`'s calls (export's
    checks, cost timing, scoring, chat): there every output is a host array. Frozen: where a run's states live does
    not change while it runs."""

    device: bool = False
    record: bool = False  # keep the record of host reads with host states (a generate call)
    reads: list[Read] = field(default_factory=list)  # the step in progress
    steps: list[list[Read]] = field(default_factory=list)  # per finished step, in order

    def read(self, where: Read) -> None:
        """A value left the device for the host (the one place such reads are recorded)."""
        if self.device or self.record:
            self.reads.append(where)

    def end_step(self) -> None:
        """The step's reads become one entry of `steps`; the next step's start empty."""
        if self.device or self.record:
            self.steps.append(list(self.reads))
            self.reads.clear()


HOST = Placement()  # states on the host, nothing recorded: export's checks, costs, scoring, chat
