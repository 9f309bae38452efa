"""Memory a consumer may reach lives exactly as long as someone may reach it: back to its
baseline once consumers let go or died, still mapped for a consumer after its producer exited."""

from __future__ import annotations

import torch

import devipc

from . import _tasks
from ._check import CheckFailed, check, expect
from ._kit import Kit

NBYTES = 1 << 20


class Baseline:
    """What the kit's process holds before a case, to come back to."""

    def __init__(self, kit: Kit):
        kit.settle()
        self.kit, self.memory = kit, kit.memory_allocated()
        self.sent, self.exports = devipc.stats()["sent"], devipc.stats()["exports"]

    def still_held(self) -> None:
        """The memory is held for a consumer: not back yet."""
        memory = self.kit.memory_allocated()
        expect(
            memory is None or self.memory is None or memory > self.memory,
            "the producer's memory went back to its allocator while a consumer held it",
        )
        expect(devipc.stats()["sent"] > self.sent, "no send is held while a consumer holds it")

    def back(self, why: str) -> None:
        """Back to the baseline, or below it: sends of earlier checks may end meanwhile."""
        self.kit.wait_for(
            lambda: (
                devipc.stats()["sent"] <= self.sent and devipc.stats()["exports"] <= self.exports
            ),
            f"devipc's sends and exports back to baseline after {why}",
        )
        memory = self.memory
        if memory is not None:
            self.kit.wait_for(
                lambda: (self.kit.memory_allocated() or 0) <= memory,
                f"the device's allocated memory back to {self.memory} bytes after {why}",
            )


@check(
    "lifetime.release",
    "memory stays while a consumer holds it, and is back to baseline once the consumer "
    "released it and the producer dropped it",
)
def release(kit: Kit) -> str:
    peer = kit.peer()
    baseline = Baseline(kit)
    tensor = torch.ones(NBYTES // 4, device=kit.device)
    peer.call(_tasks.hold, "released", tensor)
    mapped = peer.call(_tasks.mapped_file, "released")
    del tensor
    devipc.ipc_collect()
    baseline.still_held()
    after = peer.call(_tasks.drop, "released", kit.target)
    expect(after["mapped"] == 0, f"the peer still maps {after['mapped']} allocations")
    if mapped is not None:  # the mapping count of the received file goes back: close unmapped
        file, count = mapped
        kit.wait_for(
            lambda: peer.call(_tasks.mapping_count, file) < count,
            "the peer still maps the received memory after devipc closed it "
            "(OpenedMemory.close must unmap it: else every long-lived consumer leaks)",
        )
    baseline.back("the consumer released it")
    notes = (
        []
        if mapped is not None
        else ["the memory is in no file mapping of the peer: its unmapping is not seen"]
    )
    if baseline.memory is None:
        notes.append("the device module has no memory_allocated: devipc's counts only")
    return "; ".join(["1 MiB", *notes])


@check(
    "lifetime.dead_consumer",
    "a consumer killed (SIGKILL) while holding memory is reclaimed by the producer",
    fresh_peers=1,
)
def dead_consumer(kit: Kit) -> str:
    doomed = kit.peers.fresh()
    doomed.call(_tasks.pid)
    baseline = Baseline(kit)
    tensor = torch.ones(NBYTES // 4, device=kit.device)
    doomed.call(_tasks.hold, "doomed", tensor)
    del tensor
    baseline.still_held()
    doomed.kill()
    baseline.back("its consumer was killed")
    return "1 MiB held by a killed peer"


@check(
    "lifetime.producer_exit",
    "after its producer exited, a consumer's mapping still reads and writes, and a send "
    "nobody opened is refused with PeerGoneError",
    fresh_peers=1,
)
def producer_exit(kit: Kit) -> str:
    producer = kit.peers.fresh()
    producer.call(_tasks.pid)
    baseline = Baseline(kit)
    mapped_before = devipc.stats()["mapped"]
    tensor, unopened = producer.call(_tasks.produce_then_exit, kit.target)
    producer.close()
    expect(producer.process.exitcode == 0, f"the producer exited with {producer.process.exitcode}")
    expect(torch.equal(tensor.cpu(), torch.arange(16.0)), "the mapping reads other values now")
    tensor.add_(1)
    expect(torch.equal(tensor.cpu(), torch.arange(16.0) + 1), "a write did not read back")
    try:
        devipc.open(unopened)
    except devipc.PeerGoneError:
        pass
    except Exception as error:  # noqa: BLE001 - any other error is the check's verdict
        raise CheckFailed(
            f"opening a send of an exited producer raised "
            f"{type(error).__name__}: {error}, not PeerGoneError"
        ) from None
    else:
        raise CheckFailed("a send of an exited producer opened")
    del tensor
    kit.settle()
    kit.wait_for(
        lambda: devipc.stats()["mapped"] <= mapped_before, "the exited producer's memory unmapped"
    )
    baseline.back("the exited producer's memory was dropped")
    return "read, write, refusal, unmapped"
