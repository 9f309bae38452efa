"""The optional hooks, each tested where the device has it (README, "Optional, beyond the RFC");
a device that keeps a default skips its check, saying so."""

from __future__ import annotations

import torch

import devipc

from . import _device, _tasks
from ._check import CheckFailed, Skip, check, expect
from ._kit import Kit
from ._tasks import raised

KINDS = ("DRAM", "VRAM", None)


def batch_case(kit: Kit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Device and host tensors, and rows (destination, source, bytes) between them: device to
    device (unaligned, one byte, overlapping none), host to device, device to host."""
    generator = torch.Generator().manual_seed(19)
    source = torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=generator)
    device_src = source.to(kit.device)
    device_dst = torch.zeros(4096, dtype=torch.uint8, device=kit.device)
    host_src = torch.randint(0, 255, (1024,), dtype=torch.uint8, generator=generator)
    host_dst = torch.zeros(1024, dtype=torch.uint8)
    spans = [
        (device_dst, 0, device_src, 0, 256),
        (device_dst, 300, device_src, 1001, 1),
        (device_dst, 513, device_src, 7, 777),
        (device_dst, 2000, device_src, 3000, 1000),
        (device_dst, 3500, host_src, 3, 500),
        (host_dst, 10, device_src, 100, 900),
    ]
    return device_src, device_dst, host_dst, spans


@check(
    "optional.copy_batch",
    "copy_batch queues a table of copies (device and host sides, unaligned) as one stream "
    "operation ordered with the caller's work, equal to per-pair Tensor.copy_, and raises "
    "for a copy outside the device's memory",
)
def copy_batch(kit: Kit) -> str:
    batch = kit.hooks.copy_batch
    if batch is None:
        raise Skip("the device keeps the default copy_batch (none: copies go pair by pair)")
    device_src, device_dst, host_dst, spans = batch_case(kit)
    expected_dst, expected_host = device_dst.clone(), host_dst.clone()
    device_src.add_(1)  # queued before the batch: the batch must copy its result
    targets = {id(device_dst): expected_dst, id(host_dst): expected_host}
    for dst, dst_at, src, src_at, n in spans:
        targets[id(dst)][dst_at : dst_at + n].copy_(src[src_at : src_at + n])
    table = torch.tensor(
        [
            [dst.data_ptr() + dst_at, src.data_ptr() + src_at, n]
            for dst, dst_at, src, src_at, n in spans
        ],
        dtype=torch.int64,
    )
    batch(kit.device.index, table)
    after = device_dst.clone()  # queued after the batch: must see all of it
    kit.synchronize()
    expect(
        torch.equal(after.cpu(), expected_dst.cpu()),
        "device destinations differ from per-pair copies (or the batch was not ordered "
        "with the work around it)",
    )
    expect(torch.equal(host_dst, expected_host.cpu()), "the host destination differs")
    host_a, host_b = torch.zeros(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    outside = torch.tensor([[host_a.data_ptr(), host_b.data_ptr(), 8]], dtype=torch.int64)
    try:
        batch(kit.device.index, outside)
        kit.synchronize()
    except Exception:  # noqa: BLE001 - any error is the refusal checked for
        pass
    else:
        raise CheckFailed("a copy with neither side in the device's memory did not raise")
    return f"{len(spans)} rows"


@check(
    "optional.reusable_mappings",
    "where reusable_mappings says yes (consumers keep a mapping open after its last storage "
    "for the next tensor on it), a handle names one allocation for good: an allocation "
    "freed back to the device (its cache emptied) and made again gets a new handle",
)
def reusable_mappings(kit: Kit) -> str:
    if not kit.hooks.reusable_mappings():
        raise Skip("the device closes a mapping with its last storage (reusable_mappings: no)")
    module = _device.module_of(kit.device)
    if (
        getattr(module, "empty_cache", None) is None
        or getattr(module, "memory_reserved", None) is None
    ):
        raise Skip(
            "the device's module has no empty_cache or memory_reserved: the kit cannot "
            "free an allocation and tell that it went"
        )

    def handle_of(tensor: torch.Tensor) -> bytes:
        return devipc.hooks.IpcMemHandle.of(kit.hooks.get_ipc_mem_handle(tensor.data_ptr())).handle

    def emptied() -> int:
        kit.synchronize()
        module.empty_cache()
        return int(module.memory_reserved(kit.device))

    nbytes, freed, same_address = 64 << 20, 0, 0  # large: an allocation of its own
    reserved = emptied()
    tensor = torch.empty(nbytes, dtype=torch.uint8, device=kit.device)
    address, first = tensor.data_ptr(), handle_of(tensor)
    for _ in range(4):
        del tensor
        gone = emptied() <= reserved  # else it shares its allocation: nothing to compare
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=kit.device)
        if gone:
            freed += 1
            same_address += tensor.data_ptr() == address
            expect(
                handle_of(tensor) != first,
                "memory freed and allocated again has the old allocation's handle: a "
                "consumer would take its kept mapping of the old memory for it. Make handles "
                "unique per allocation, or have reusable_mappings say no",
            )
    del tensor
    if not freed:
        raise Skip(f"a {nbytes >> 20} MiB allocation was never given back by empty_cache")
    return f"{freed} allocations made again after a free ({same_address} at the old address)"


@check(
    "optional.can_map_on",
    "can_map_on says yes for the owning device and no for the CPU or an index past the "
    "count, never raises, and devipc.open(..., device=) follows it",
)
def can_map_on(kit: Kit) -> str:
    if not kit.overrides("can_map_on"):
        raise Skip("the device keeps the default can_map_on (only the owning device)")
    peer = kit.peer()
    tensor = torch.arange(16, dtype=torch.float32, device=kit.device)
    handle, _ = devipc.hooks.IpcMemHandle.of(kit.hooks.get_ipc_mem_handle(tensor.data_ptr()))
    answer = peer.call(_tasks.can_map, kit.target, handle)
    answers, owner = answer["answers"], answer["owner"]
    expect(
        all(isinstance(value, bool) for value in answers.values()),
        f"answers that are not bools: {answers}",
    )
    count = _device.device_count(kit.device)
    past = str(torch.device(kit.device.type, count))
    expect(answers[owner], f"can_map_on says no for the owning device {owner}")
    expect(not answers["cpu"] and not answers[past], f"can_map_on says yes for cpu or {past}")
    handles = []
    try:
        for name, yes in answers.items():
            if name in ("cpu", past):
                continue
            handles.append(devipc.share(tensor))
            got = peer.call(_tasks.open_on, bytes(handles[-1]), name)
            if yes:
                where = got if isinstance(got, str) else got["device"]
                expect(where == name, f"devipc.open(device={name!r}) gave {where}")
                expect(torch.equal(got["values"], tensor.cpu()), f"on {name}: other values")
            else:
                expect(
                    isinstance(got, str) and raised(got, "UnsupportedDeviceError"),
                    f"devipc.open(device={name!r}) against can_map_on: {got}",
                )
    finally:
        for sent in handles:
            sent.revoke()
        peer.call(_tasks.drop, "", kit.target)
    return f"{count} devices, mapped where it says yes"


@check(
    "optional.device_identity",
    "device_identity gives bytes, stable, the same in a peer, distinct per device",
)
def device_identity(kit: Kit) -> str:
    count = _device.device_count(kit.device)
    ours = [kit.hooks.device_identity(torch.device(kit.device.type, i)) for i in range(count)]
    if not any(ours):
        raise Skip('the device reports no identity (device_identity gives b"")')
    expect(
        all(type(identity) is bytes and identity for identity in ours),
        f"identities that are not non-empty bytes: {ours}",
    )
    again = [kit.hooks.device_identity(torch.device(kit.device.type, i)) for i in range(count)]
    expect(again == ours, "identities changed between two calls")
    expect(len(set(ours)) == count, "two devices share an identity")
    theirs = kit.peer().call(_tasks.identities, kit.device.type)
    expect(theirs == ours, "the peer's identities of the same devices differ")
    return f"{count} devices"


@check(
    "optional.memory_kind",
    'memory_kind is "DRAM", "VRAM" or None for every device, the same on every call',
)
def memory_kind(kit: Kit) -> str:
    count = _device.device_count(kit.device)
    kinds = [kit.hooks.memory_kind(i) for i in range(count)]
    if not kit.overrides("memory_kind"):
        raise Skip(
            "the device keeps the default memory_kind (None: devipc.p2p's NIXL path refuses it)"
        )
    expect(all(kind in KINDS for kind in kinds), f"memory kinds {kinds}")
    expect([kit.hooks.memory_kind(i) for i in range(count)] == kinds, "the kinds changed")
    return f"{sorted(set(map(str, kinds)))}"


@check(
    "optional.make_resizable",
    "a sent storage resizes (resize_(0) and regrowth), and the consumer keeps the sent "
    "block's values",
)
def make_resizable(kit: Kit) -> str:
    if not kit.overrides("make_resizable"):
        raise Skip("the device keeps the default make_resizable (a sent storage cannot be resized)")
    peer = kit.peer()
    tensor = torch.arange(1024, dtype=torch.float32, device=kit.device)
    try:
        peer.call(_tasks.hold, "resized", tensor)
        sent_ptr = tensor.data_ptr()
        storage = tensor.untyped_storage()
        storage.resize_(0)
        storage.resize_(tensor.nbytes)
        tensor.fill_(-1)
        kit.synchronize()
        expect(tensor.data_ptr() != sent_ptr, "regrowth gave the storage the sent block back")
        got = peer.call(_tasks.held_report, "resized")["values"]
        expect(
            torch.equal(got, torch.arange(1024.0)),
            "the consumer's values changed when the producer resized and refilled",
        )
    finally:
        peer.call(_tasks.drop, "resized", kit.target)
    return "4 KiB, resized to 0 and back"
