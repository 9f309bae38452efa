"""Typed handles and buckets: devipc's own bytes (devipc.share/open, share_tensors/open_tensors),
sent here through the peer's Queue as plain bytes, as over any socket."""

from __future__ import annotations

import torch

import devipc

from . import _tasks
from ._check import check, expect
from ._compare import compare, same_values
from ._kit import WAIT, Kit
from ._tasks import raised


@check(
    "handles.share_open",
    "devipc.share/open: a typed handle opens in a peer as the same memory (writes cross); "
    "a revoked one is refused",
)
def share_open(kit: Kit) -> str:
    peer = kit.peer()
    base = torch.arange(32, dtype=torch.float32, device=kit.device)
    try:
        got = peer.call(_tasks.open_handle, "handle", bytes(devipc.share(base[4:20].view(4, 4))))
        compare("devipc.open", base[4:20].view(4, 4), got)
        peer.call(_tasks.add_to_held, "handle", 100.0)
        expected = torch.arange(32.0)
        expected[4:20] += 100
        expect(torch.equal(base.cpu(), expected), "the peer's write is not seen by the producer")
    finally:
        peer.call(_tasks.drop, "handle", kit.target)
    revoked = devipc.share(base)
    expect(revoked.revoke() and not revoked.unopened(), "revoke() of an unopened send failed")
    refused = peer.call(_tasks.open_refusals, {"revoked": bytes(revoked)})["revoked"]
    expect(
        raised(refused, "InvalidHandleError"),
        f"opening a revoked handle gave {refused!r}, not InvalidHandleError",
    )
    return "a 4x4 view at offset 16 bytes; a revoked send"


@check(
    "handles.open_in_producer",
    "a process opens its own typed handle: the same memory, writes crossing (CUDA refuses "
    "its own handles: the hooks must recognise them)",
)
def open_in_producer(kit: Kit) -> str:
    base = torch.arange(16, dtype=torch.float32, device=kit.device)
    own = devipc.open(bytes(devipc.share(base[4:12])))
    try:
        expect(torch.equal(own.cpu(), torch.arange(4.0, 12.0)), "the opened tensor differs")
        own.add_(100)
        kit.synchronize()
        expected = torch.arange(16.0)
        expected[4:12] += 100
        expect(
            torch.equal(base.cpu(), expected),
            "a write through the opened tensor is not in the producer's tensor",
        )
    finally:
        del own
        kit.settle()
    return "8 of 16 elements"


@check(
    "handles.buckets",
    "share_tensors/open_tensors: a bucket opens as views of one mapping, packed (a copy) and "
    "as packed weights sent in place (copy=False), writes crossing",
)
def buckets(kit: Kit) -> str:
    peer = kit.peer()
    named = {
        "weight": torch.arange(12, dtype=torch.float32, device=kit.device).view(3, 4),
        "bias": torch.full((3,), -1.0, dtype=torch.float16, device=kit.device),
        "steps": torch.tensor([7], dtype=torch.int64, device=kit.device),
        "unused": torch.empty(0, device=kit.device),
    }
    # Named, not temporaries: a devipc storage that dies while an exception unwinds the
    # stack crashes the process (its deleter is a ctypes callback).
    copied = devipc.share_tensors(named)
    in_place = devipc.share_tensors(devipc.pack(named), copy=False)
    try:
        for key, handle in (("copied", copied), ("in place", in_place)):
            got = peer.call(_tasks.open_bucket, key, bytes(handle))
            expect(set(got) == set(named), f"{key}: names {sorted(got)}")
            for name, tensor in named.items():
                if tensor.numel():
                    same_values(f"{key} {name}", tensor, got[name])
            expect(
                len({got[name]["storage"] for name in got if got[name]["shape"] != (0,)}) == 1,
                f"{key}: the views are not of one mapping",
            )
            peer.call(_tasks.add_to_bucket, key, "weight", 1.0)
            local = (handle.local or {}).get("weight")
            expect(
                local is not None and torch.equal(local.cpu(), torch.arange(12.0).view(3, 4) + 1),
                f"{key}: the peer's write is not in the producer's view (Handle.local)",
            )
    finally:
        peer.call(_tasks.drop, "copied", kit.target)
        peer.call(_tasks.drop, "in place", kit.target)
    return "4 tensors of 3 dtypes, both ways of packing"


@check(
    "weights.publish",
    "devipc.WeightPublisher/WeightSubscriber: a peer gets every published generation of "
    "packed weights (copy_into, batched where the hooks have copy_batch), acknowledges it, "
    "and the publisher's wait ends",
)
def publish(kit: Kit) -> str:
    peer = kit.peer()
    weights = devipc.pack(
        {
            "w": torch.arange(64.0, device=kit.device).view(8, 8),
            "b": torch.zeros(3, dtype=torch.int64, device=kit.device),
        }
    )
    publisher = devipc.WeightPublisher(weights)
    try:
        peer.call(_tasks.subscribe, "weights", publisher.token())
        for step in range(1, 3):
            weights["w"].mul_(step)
            weights["b"].fill_(step)
            generation = publisher.publish(wait=False)
            got = peer.call(_tasks.take_generation, "weights")
            expect(
                got["generation"] == generation,
                f"the peer got generation {got['generation']}, not {generation}",
            )
            for name, tensor in weights.items():
                expect(
                    torch.equal(got["values"][name], tensor.cpu()),
                    f"generation {generation}: the peer's {name!r} differs",
                )
            publisher.wait_acks(generation, timeout=WAIT)
    finally:
        peer.call(_tasks.unsubscribe, "weights", kit.target)
        publisher.close()
    return "2 generations of 2 packed tensors, acknowledged"
