"""Deliberately broken openreg hooks, for tests/test_conformance.py: the conformance kit must fail
them and name the check. `python -m devipc.conformance --hooks-module _broken_hooks` imports this
in every process of the kit (its own, its peers, DataLoader workers), after torch's autoload
registered openreg's own hooks, so these replace them everywhere. DEVIPC_BROKEN_HOOKS says how
they are broken."""
import os
import threading

import devipc_openreg  # noqa: F401  (the device, also where autoload is off)
from devipc.hooks import register_ipc_hooks
from devipc_openreg._ipc_hooks import OpenRegIpcHooks


class OffsetOffByOne(OpenRegIpcHooks):
    """The producer names the byte after the tensor's first."""

    def get_ipc_mem_handle(self, ptr):
        handle, offset = super().get_ipc_mem_handle(ptr)
        return handle, offset + 1


class NoEventWait(OpenRegIpcHooks):
    """The consumer's stream never waits for the producer's event."""

    def wait_ipc_event(self, event_handle, stream):
        pass


class OpenHangs(OpenRegIpcHooks):
    """Opening a handle never returns."""

    def open_ipc_mem_handle(self, handle):
        threading.Event().wait()


BROKEN = {"offset": OffsetOffByOne, "no_event_wait": NoEventWait, "open_hangs": OpenHangs}
register_ipc_hooks("openreg", BROKEN[os.environ["DEVIPC_BROKEN_HOOKS"]]())
