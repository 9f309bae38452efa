"""What every check gets: the device under test, its hooks, the peers, and bounded waits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import devipc

from . import _device
from ._peers import Peer, Peers
from ._verdicts import CheckFailed

WAIT = 15.0  # seconds for a background effect (a release, a reclaim) to show


@dataclass
class Kit:
    device: torch.device
    modules: list[str]
    peers: Peers
    hung: bool = field(default=False)
    spared: set[int] = field(default_factory=set)  # processes the kit did not start

    @property
    def target(self) -> str:
        """The device as text, as tasks take it."""
        return str(self.device)

    @property
    def hooks(self) -> devipc.hooks.IpcHooks:
        hooks = devipc.hooks.get_ipc_hooks(self.device.type)
        if hooks is None:
            raise CheckFailed(f"no IPC hooks are registered for {self.device.type!r}")
        return hooks

    def peer(self) -> Peer:
        return self.peers.main()

    def events(self) -> bool:
        """Whether the hooks use interprocess events; False: the producer synchronizes."""
        return bool(self.hooks.requires_event_sync())

    def synchronize(self) -> None:
        _device.synchronize(self.device)

    def settle(self) -> None:
        _device.settle(self.device, WAIT)

    def wait_for(self, condition: Callable[[], object], what: str, timeout: float = WAIT) -> None:
        try:
            _device.wait_for(condition, what, timeout)
        except TimeoutError as error:
            raise CheckFailed(str(error)) from None

    def memory_allocated(self) -> int | None:
        return _device.memory_allocated(self.device)

    def overrides(self, hook: str) -> bool:
        """Whether the device's hooks define `hook` themselves instead of the default."""
        return overrides(self.hooks, hook)


def overrides(hooks: devipc.hooks.IpcHooks, hook: str) -> bool:
    """Whether `hooks` define `hook` themselves instead of the base class's default."""
    return getattr(type(hooks), hook) is not getattr(devipc.hooks.IpcHooks, hook)
