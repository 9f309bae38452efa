"""The six hooks as the contract states them, called directly (README, "The hook contract")."""

from __future__ import annotations

import threading

import torch

import devipc

from . import _tasks
from ._check import check, expect
from ._kit import Kit


@check("contract.registered", "hooks are registered for the device type and say it can share")
def registered(kit: Kit) -> str:
    hooks = kit.hooks
    expect(isinstance(hooks, devipc.hooks.IpcHooks), f"{type(hooks).__name__} is not an IpcHooks")
    expect(hooks.supports_ipc() is True, f"supports_ipc() is {hooks.supports_ipc()!r}, not True")
    expect(devipc.hooks.device_supports_ipc(kit.device.type), "device_supports_ipc() is False")
    return f"{type(hooks).__module__}.{type(hooks).__qualname__}"


@check(
    "contract.defaults",
    "a bare IpcHooks says no IPC; the device's two spellings of its event mode agree "
    "(hooks that sharing needs, left out, end the kit before any check)",
)
def defaults(kit: Kit) -> str:
    bare, device = devipc.hooks.IpcHooks(), kit.device
    expect(
        bare.supports_ipc() is False
        and bare.ipc_event_handle_size() == 0
        and bare.requires_event_sync() is False
        and bare.get_ipc_event_handle(device) == b""
        and bare.device_identity(device) == b""
        and bare.memory_kind(0) is None,
        "the base class's defaults no longer say 'no IPC'",
    )
    sync = kit.hooks.requires_event_sync()
    expect(type(sync) is bool, f"requires_event_sync() is {sync!r}, not a bool")
    if kit.overrides("ipc_event_handle_size"):  # the RFC's first spelling, kept consistent
        size = kit.hooks.ipc_event_handle_size()
        expect(isinstance(size, int) and size >= 0, f"ipc_event_handle_size() is {size!r}")
        expect(
            sync == (size > 0),
            f"requires_event_sync() is {sync} while ipc_event_handle_size() is {size}",
        )
    return "interprocess events" if sync else "no events: the producer synchronizes"


@check(
    "contract.supports_ipc",
    "supports_ipc() answers a bool and never raises, from many threads and in a fresh peer",
)
def supports_ipc(kit: Kit) -> str:
    answers: list[object] = []

    def ask() -> None:
        for _ in range(100):
            try:
                answers.append(kit.hooks.supports_ipc())
            except Exception as error:  # noqa: BLE001 - an answer too, for the check to judge
                answers.append(error)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    expect(
        len(answers) == 400 and all(answer is True for answer in answers),
        f"answers other than True: {[a for a in answers if a is not True][:3]}",
    )
    expect(
        kit.peer().call(_tasks.hooks_supports_ipc, kit.device.type) is True,
        "a fresh process's hooks do not say True",
    )
    return "400 calls in 4 threads, and the peer's"


@check(
    "contract.mem_handle",
    "get_ipc_mem_handle gives plain bytes naming the base allocation and ptr's byte offset; "
    "a peer opens them to memory that holds the range",
)
def mem_handle(kit: Kit) -> str:
    hooks = kit.hooks
    small = torch.zeros(16, dtype=torch.float32, device=kit.device)
    large = torch.zeros(1 << 20, dtype=torch.float32, device=kit.device)
    for tensor in (small, large):
        ptr, nbytes = tensor.data_ptr(), tensor.nbytes
        handle, offset = devipc.hooks.IpcMemHandle.of(hooks.get_ipc_mem_handle(ptr))
        expect(
            type(handle) is bytes and handle,
            f"the handle is {type(handle).__name__} {handle[:8]!r}..., not non-empty bytes",
        )
        expect(type(offset) is int and offset >= 0, f"the offset is {offset!r}")
        for step in (4, nbytes - 4):
            again, moved = devipc.hooks.IpcMemHandle.of(hooks.get_ipc_mem_handle(ptr + step))
            expect(again == handle, f"ptr + {step} of one allocation gave another handle")
            expect(
                moved == offset + step,
                f"ptr + {step} gave offset {moved}, expected {offset} + {step}",
            )
        opened = kit.peer().call(_tasks.open_mem_handle, kit.target, handle)
        expect(opened["types"] == ("int", "int"), f"OpenedMemory ptr/size are {opened['types']}")
        expect(opened["ptr"] != 0, "the peer's mapping is at address 0")
        expect(
            opened["size"] >= offset + nbytes,
            f"the mapping has {opened['size']} bytes, the range ends at {offset + nbytes}",
        )
        expect(
            torch.device(opened["device"]).type == kit.device.type,
            f"the peer's OpenedMemory is on {opened['device']}",
        )
    return "64 B and 4 MiB allocations, pointers inside them"


@check(
    "contract.event_handle",
    'get_ipc_event_handle gives non-empty bytes with events, b"" without (exactly '
    "ipc_event_handle_size() bytes where the hooks say a size), and wait_ipc_event accepts "
    'them and b"" on a peer\'s stream',
)
def event_handle(kit: Kit) -> str:
    sync = kit.events()
    event = kit.hooks.get_ipc_event_handle(kit.device)
    expect(type(event) is bytes, f"the event handle is a {type(event).__name__}")
    expect(
        bool(event) == sync,
        f"the event handle has {len(event)} bytes while requires_event_sync() is {sync}",
    )
    if kit.overrides("ipc_event_handle_size"):
        size = kit.hooks.ipc_event_handle_size()
        expect(len(event) == size, f"the event handle has {len(event)} bytes, the size is {size}")
    waited = kit.peer().call(_tasks.wait_events, kit.target, event)
    expect(waited == {"event": "ok", "empty": "ok"}, f"wait_ipc_event in the peer: {waited}")
    size = len(event)
    return f"{size}-byte handles" if size else 'b"" (no events)'
