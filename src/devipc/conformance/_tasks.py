"""What peers run, by reference (`Peer.call(_tasks.hold, ...)`): the other process's half of each
check.

Tasks take and return plain values, CPU tensors and device tensors; a device tensor in the
arguments was opened while the request was unpickled. `held` keeps what a check wants to stay
mapped between two calls. Refusals a check expects are returned as text, not raised.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

import devipc

from . import _device
from ._compare import views_of

TIMEOUT = 20.0
held: dict[str, Any] = {}


def hooks_of(device: str) -> devipc.hooks.IpcHooks:
    hooks = devipc.hooks.get_ipc_hooks(torch.device(device).type)
    if hooks is None:
        raise RuntimeError(f"no IPC hooks registered for {device} in the peer")
    return hooks


def outcome(action: Callable[[], object]) -> str:
    """ "ok", or what `action()` raised: its class and the devipc errors it is, then its message
    ("SpentHandleError InvalidHandleError: ..."), so that the kit can tell the kind of a refusal."""
    try:
        action()
    except Exception as error:  # noqa: BLE001 - any: its kinds are the answer
        kinds = [
            kind.__name__
            for kind in type(error).__mro__
            if kind.__name__.endswith("Error") and kind.__module__.startswith("devipc")
        ]
        names = [type(error).__name__] + [kind for kind in kinds if kind != type(error).__name__]
        return f"{' '.join(names)}: {error}"
    return "ok"


def raised(result: str, kind: str) -> bool:
    """Whether an `outcome` is a refusal of `kind` (a devipc error class name)."""
    return kind in result.partition(":")[0].split()


def report(tensor: torch.Tensor) -> dict:
    """What a check compares of a received tensor."""
    return {
        "values": tensor.detach().cpu().clone(),
        "dtype": tensor.dtype,
        "shape": tuple(tensor.shape),
        "stride": tensor.stride(),
        "offset": tensor.storage_offset(),
        "device": str(tensor.device),
        "type": type(tensor).__name__,
        "requires_grad": tensor.requires_grad,
        "received": devipc.received_via_ipc(tensor),
        "storage": tensor.untyped_storage().data_ptr(),
    }


# -- receiving and holding -------------------------------------------------------------------------
def describe(tensors: list) -> list[dict]:
    return [report(tensor) for tensor in tensors]


def hold(key: str, value: Any) -> str:
    held[key] = value
    return "held"


def held_report(key: str) -> dict:
    return report(held[key])


def add_to_held(key: str, value: float) -> str:
    tensor = held[key]
    tensor.add_(value)
    _device.synchronize(tensor.device)
    return "added"


def mapped_file(key: str) -> tuple[tuple[str, int], int] | None:
    """The file (device and inode in /proc/self/maps) whose mapping holds the memory of the
    tensor `key` holds, and how many mappings of it this process has; None where the memory is
    in no file's mapping (anonymous, or device memory outside the process's maps)."""
    address = held[key].data_ptr()
    for start, end, file in _mappings():
        if start <= address < end:
            return None if file[1] == 0 else (file, mapping_count(file))
    return None


def mapping_count(file: tuple[str, int]) -> int:
    return sum(found == tuple(file) for _, _, found in _mappings())


def _mappings() -> list[tuple[int, int, tuple[str, int]]]:
    """(start, end, (device, inode)) of each mapping of this process."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, _, _, device, inode = line.split()[:5]
            start, end = (int(part, 16) for part in span.split("-"))
            found.append((start, end, (device, int(inode))))
    return found


def drop(key: str, device: str) -> dict:
    """Let go of what `key` holds, and wait until devipc released it; devipc's stats after."""
    held.pop(key, None)
    _device.settle(torch.device(device), TIMEOUT)
    return devipc.stats()


def reset(device: str) -> dict:
    """Forget everything held (after a failed check)."""
    held.clear()
    return drop("", device)


def views_back(device: str) -> dict:
    """The peer's own tensor and views of it, sent to the kit (the kit is the consumer)."""
    base = torch.arange(64, dtype=torch.float32, device=device) - 7
    return {"base": base, "views": views_of(base)}


def make(device: str, count: int) -> list[torch.Tensor]:
    return [torch.full((100,), float(i), device=device) for i in range(count)]


def min_max(tensor: torch.Tensor) -> tuple[float, float]:
    """Read on this process's current stream right after the open: what a synchronization (or
    the producer's event) made visible."""
    return float(tensor.min().item()), float(tensor.max().item())


def open_min_max(data: bytes) -> tuple[float, float]:
    return min_max(devipc.open(data))


def pid() -> int:
    return os.getpid()


# -- the hooks, called directly ------------------------------------------------------------------
def hooks_supports_ipc(device_type: str) -> object:
    return hooks_of(device_type).supports_ipc()


def open_mem_handle(device: str, handle: bytes) -> dict:
    """Open a producer's raw hook handle, report what OpenedMemory says, close it."""
    memory = hooks_of(device).open_ipc_mem_handle(handle)
    try:
        return {
            "ptr": memory.ptr,
            "size": memory.size,
            "device": str(memory.device),
            "types": (type(memory.ptr).__name__, type(memory.size).__name__),
        }
    finally:
        memory.close()


def wait_events(device: str, event: bytes) -> dict:
    """wait_ipc_event with the producer's bytes, and with b"", on this peer's current stream."""
    target = torch.device(device)
    hooks, stream = hooks_of(device), _device.current_stream(target)
    result = {
        "event": outcome(lambda: hooks.wait_ipc_event(event, stream)),
        "empty": outcome(lambda: hooks.wait_ipc_event(b"", stream)),
    }
    _device.synchronize(target)
    return result


def hook_refusals(device: str, handles: dict[str, bytes]) -> dict[str, str]:
    """open_ipc_mem_handle of each damaged handle: what it raised ("ok" when it opened)."""
    hooks = hooks_of(device)

    def try_open(handle: bytes) -> None:
        hooks.open_ipc_mem_handle(handle).close()

    return {name: outcome(functools.partial(try_open, handle)) for name, handle in handles.items()}


def open_refusals(damaged: dict[str, bytes]) -> dict[str, str]:
    """devipc.open of each damaged typed handle: what it raised ("ok" when it opened)."""
    return {name: outcome(functools.partial(devipc.open, data)) for name, data in damaged.items()}


def identities(device_type: str) -> list[bytes]:
    hooks = hooks_of(device_type)
    count = _device.device_count(torch.device(device_type))
    return [hooks.device_identity(torch.device(device_type, i)) for i in range(count)]


def can_map(device: str, handle: bytes) -> dict:
    """can_map_on of an opened allocation for every local index (and two it must refuse)."""
    target = torch.device(device)
    hooks = hooks_of(device)
    memory = hooks.open_ipc_mem_handle(handle)
    try:
        count = _device.device_count(target)
        answers = {
            str(torch.device(target.type, i)): hooks.can_map_on(
                memory, torch.device(target.type, i)
            )
            for i in range(count + 1)
        }
        answers["cpu"] = hooks.can_map_on(memory, torch.device("cpu"))
        return {"owner": str(memory.device), "answers": answers}
    finally:
        memory.close()


def open_on(data: bytes, device: str) -> dict | str:
    """devipc.open(data, device=...): the report, or the refusal as text."""
    opened: list[torch.Tensor] = []
    result = outcome(lambda: opened.append(devipc.open(data, device=device)))
    return report(opened[0]) if opened else result


# -- typed handles and buckets ---------------------------------------------------------------------
def open_handle(key: str, data: bytes) -> dict:
    tensor = devipc.open(data)
    held[key] = tensor
    return report(tensor)


def open_bucket(key: str, data: bytes) -> dict:
    views = devipc.open_tensors(data)
    held[key] = views
    return {name: report(view) for name, view in views.items()}


def add_to_bucket(key: str, name: str, value: float) -> str:
    view = held[key][name]
    view.add_(value)
    _device.synchronize(view.device)
    return "added"


# -- a producer that exits -----------------------------------------------------------------------
def produce_then_exit(device: str) -> tuple[torch.Tensor, bytes]:
    """A tensor (opened by the kit when it unpickles the reply) and the bytes of a send nobody
    opened yet; the kit ends this process next."""
    target = torch.device(device)
    sent = torch.arange(16, dtype=torch.float32, device=target)
    unopened = torch.zeros(1 << 20, dtype=torch.float32, device=target)  # an allocation of its own
    held["unopened"] = unopened
    return sent, bytes(devipc.share(unopened))


# -- p2p -------------------------------------------------------------------------------------------
def subscribe(key: str, token: bytes) -> str:
    held[key] = devipc.WeightSubscriber(token)
    return "subscribed"


def take_generation(key: str) -> dict:
    """Wait for the next generation, copy it into tensors of our own, acknowledge it."""
    subscriber = held[key]
    generation = subscriber.wait(timeout=TIMEOUT)
    own = {name: torch.empty_like(t) for name, t in subscriber.tensors().items()}
    subscriber.copy_into(own)
    subscriber.ack()
    return {"generation": generation, "values": {name: t.cpu() for name, t in own.items()}}


def unsubscribe(key: str, device: str) -> dict:
    held.pop(key).close()
    return drop(key, device)


def p2p_connect(metadata: bytes) -> str:
    import devipc.p2p as p2p

    endpoint = p2p.Endpoint()
    held["p2p"] = (endpoint, endpoint.connect(metadata))
    return "connected"


def p2p_read(descriptor: bytes, like: torch.Tensor, device: str) -> torch.Tensor:
    local = torch.empty_like(like, device=device)
    held["p2p"][1].read(local, descriptor)
    return local.cpu()


def p2p_write(descriptor: bytes, values: torch.Tensor, device: str) -> str:
    held["p2p"][1].write(values.to(device), descriptor)
    return "written"


def p2p_readv(descriptors: list[bytes], likes: list[torch.Tensor], device: str) -> list:
    locals_ = [torch.empty_like(like, device=device) for like in likes]
    held["p2p"][1].readv(locals_, descriptors)
    return [local.cpu() for local in locals_]


def p2p_writev(descriptors: list[bytes], values: list[torch.Tensor], device: str) -> str:
    held["p2p"][1].writev([value.to(device) for value in values], descriptors)
    return "written"


def p2p_read_refused(descriptor: bytes, like: torch.Tensor, device: str) -> str:
    local = torch.empty_like(like, device=device)
    return outcome(lambda: held["p2p"][1].read(local, descriptor))


def p2p_close(device: str) -> dict:
    endpoint, connection = held.pop("p2p", (None, None))
    if endpoint is not None:
        connection.close()
        endpoint.close()
    return drop("", device)


# -- DataLoader workers ----------------------------------------------------------------------------
class DeviceDataset(torch.utils.data.Dataset):
    """Items made on the device in a DataLoader worker."""

    def __init__(self, device: str, length: int):
        self.device, self.length = device, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((4,), float(index), device=self.device)


def start_worker(modules: list[str], worker_id: int) -> None:
    """DataLoader's worker_init_fn: the user's modules, as in every process of the kit."""
    _device.load(modules)
