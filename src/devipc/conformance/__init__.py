"""devipc's conformance kit: does a device's IPC hooks implementation hold the contract?

    python -m devipc.conformance --device openreg [--index N] [-k SUBSTRING] [--json]
    python -m devipc.conformance --device mydev --hooks-module mydev_ipc   # loads/registers it

It runs every check (`--list` names them) against the registered hooks: the contract called
directly, round trips through torch.multiprocessing Queues to a spawned peer and back, writes
both ways, the device's synchronization mode, lifetime (release, killed consumer, exited
producer), refused handles, DataLoader workers, typed handles and buckets, devipc.p2p, and the
optional hooks the device has. It prints one row per check (passed, failed with how, skipped with
why) and exits non-zero when one failed. Every process it starts runs the `--hooks-module`s
first, so hooks registered by a user module are the ones tested everywhere.
It is a user of devipc's public faces (`devipc`, `hooks`, `p2p`), never of their private modules.
"""

from . import (  # noqa: F401  (importing a module of checks adds them to CHECKS)
    _contract,
    _lifetime,
    _multiprocessing,
    _optional,
    _p2p,
    _refusals,
    _roundtrip,
    _sync,
    _typed,
)
from ._check import CHECKS, Check
from ._runner import Result, Session, run

# The order checks run in: the contract first, then what builds on it.
ORDER = (
    "contract.",
    "roundtrip.",
    "writes.",
    "sync.",
    "mp.",
    "handles.",
    "refusals.",
    "lifetime.",
    "p2p.",
    "optional.",
)

__all__ = ["CHECKS", "Check", "Result", "Session", "run", "select"]


def select(substrings: list[str] | None = None) -> list[Check]:
    """The checks whose names contain any of `substrings` (all without), in running order."""
    chosen = [
        check
        for check in CHECKS
        if not substrings or any(part in check.name for part in substrings)
    ]
    return sorted(
        chosen,
        key=lambda check: next(
            (i for i, prefix in enumerate(ORDER) if check.name.startswith(prefix)), len(ORDER)
        ),
    )
