"""What goes wrong in a local swarm: a process that crashed, a run that did not finish in time."""

from __future__ import annotations

from protocol.errors import SparseLocoError


class DemoError(SparseLocoError):
    """The local swarm could not complete: a validator, peer or store process exited with an error,
    wrote output the launcher cannot read, or the run did not finish before its timeout. The message
    says which process and where its log is; ``sparseloco demo`` exits with status 1."""
