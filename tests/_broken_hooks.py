"""Deliberately broken openreg hooks, for tests/test_conformance.py: the conformance kit must fail
them and name the check. `python -m devipc.conformance --hooks-module _broken_hooks` imports this
in every process of the kit (its own, its peers, DataLoader workers), after torch's autoload
registered openreg's own hooks, so these replace them everywhere. DEVIPC_BROKEN_HOOKS says how
they are broken."""

import os
import threading

import torch

import devipc_openreg  # noqa: F401  (the device, also where autoload is off)
from devipc.hooks import IpcHooks, OpenedMemory, register_ipc_hooks
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


class WorkerShareHangs(OpenRegIpcHooks):
    """Sharing from a DataLoader worker never returns; the worker writes its pid to
    DEVIPC_BROKEN_HOOKS_PIDS first, for the test to check that it was killed."""

    def get_ipc_mem_handle(self, ptr):
        if torch.utils.data.get_worker_info() is not None:
            with open(os.environ["DEVIPC_BROKEN_HOOKS_PIDS"], "a") as pids:
                print(os.getpid(), file=pids)
            threading.Event().wait()
        return super().get_ipc_mem_handle(ptr)


class CloseKeepsMapping(OpenRegIpcHooks):
    """OpenedMemory.close does nothing: every opened allocation stays mapped."""

    def open_ipc_mem_handle(self, handle):
        opened = super().open_ipc_mem_handle(handle)
        return OpenedMemory(opened.ptr, opened.size, opened.device, lambda: None)


class HandlesRepeat(OpenRegIpcHooks):
    """Consumers may keep mappings, yet every allocation gets the same handle."""

    def reusable_mappings(self):
        return True

    def get_ipc_mem_handle(self, ptr):
        _, offset = super().get_ipc_mem_handle(ptr)
        return bytes(64), offset


class AlwaysDeviceZero(OpenRegIpcHooks):
    """Opened memory is said to be on device 0, whichever device holds it."""

    def open_ipc_mem_handle(self, handle):
        opened = super().open_ipc_mem_handle(handle)
        return OpenedMemory(opened.ptr, opened.size, torch.device("openreg", 0), opened.close)


class SupportsIpcRaises(OpenRegIpcHooks):
    def supports_ipc(self):
        raise RuntimeError("the driver is not loaded")


class OnlySupportsIpc(IpcHooks):
    """A vendor's first try: supports_ipc() says True, no other hook is written yet."""

    def supports_ipc(self):
        return True


class EventsWithoutEventHooks(OpenRegIpcHooks):
    """Interprocess events said to be on, yet the event hooks are the base class's no-ops."""

    def requires_event_sync(self):
        return True

    get_ipc_event_handle = IpcHooks.get_ipc_event_handle
    wait_ipc_event = IpcHooks.wait_ipc_event


BROKEN = {
    "offset": OffsetOffByOne,
    "no_event_wait": NoEventWait,
    "open_hangs": OpenHangs,
    "worker_share_hangs": WorkerShareHangs,
    "close_keeps_mapping": CloseKeepsMapping,
    "always_device_zero": AlwaysDeviceZero,
    "supports_ipc_raises": SupportsIpcRaises,
    "handles_repeat": HandlesRepeat,
    "only_supports_ipc": OnlySupportsIpc,
    "events_without_event_hooks": EventsWithoutEventHooks,
}
register_ipc_hooks("openreg", BROKEN[os.environ["DEVIPC_BROKEN_HOOKS"]](), replace=True)
