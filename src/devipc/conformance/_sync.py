"""Work the producer queued before a send is done for the consumer: by a synchronization before
the handle is handed out (event size 0), or by an interprocess event the consumer's stream waits
for.

The producer queues about BUSY seconds of device-to-device copies between two scratch buffers,
then one last copy that fills the sent tensor with ones, and sends it at once. Streams run in
order, so a consumer that reads before the producer's work is done reads zeros, whatever the
device's speed. (Copies, because they are asynchronous on every device; other ops may block.)
"""

from __future__ import annotations

import math
import time

import torch

import devipc

from . import _tasks
from ._check import Skip, check, expect
from ._kit import Kit

BUSY = 0.75  # seconds of work queued ahead of a send
SCRATCH = 1 << 22  # float32 elements of each scratch buffer (16 MiB)


def queue_busy_work(kit: Kit) -> tuple[torch.Tensor, int]:
    """A tensor of zeros that work queued on this thread's current stream fills with ones at its
    end, and how many copies run before."""
    source = torch.zeros(SCRATCH, device=kit.device)
    scratch = torch.empty(SCRATCH, device=kit.device)
    ones, sent = torch.ones(256, device=kit.device), torch.zeros(256, device=kit.device)
    scratch.copy_(source)
    kit.synchronize()
    start = time.monotonic()
    for _ in range(4):
        scratch.copy_(source)
    kit.synchronize()
    per_copy = max((time.monotonic() - start) / 4, 1e-6)
    copies = min(max(math.ceil(BUSY / per_copy), 8), 5000)
    for _ in range(copies):
        scratch.copy_(source)
    sent.copy_(ones)
    return sent, copies


def sends_see_queued_work(kit: Kit) -> str:
    peer = kit.peer()
    # its device set up: reads are quick
    peer.call(_tasks.min_max, torch.zeros(4, device=kit.device))
    for path in ("a Queue", "devipc.share"):
        tensor, copies = queue_busy_work(kit)
        if path == "a Queue":
            seen = peer.call(_tasks.min_max, tensor)  # pickled in the Queue's feeder thread
        else:
            seen = peer.call(_tasks.open_min_max, bytes(devipc.share(tensor)))  # this thread
        expect(
            seen == (1, 1),
            f"through {path}, the peer read values in {seen}, not all 1: "
            f"it read before the {copies} copies queued ahead of the send had run",
        )
        kit.synchronize()
    return (
        f"{copies} copies (~{BUSY:g} s) queued ahead of each send, through a Queue and devipc.share"
    )


@check(
    "sync.producer_synchronizes",
    "without events (size 0) the producer's queued work is done before the consumer reads",
)
def producer_synchronizes(kit: Kit) -> str:
    if kit.events():
        raise Skip("the device uses interprocess events")
    return sends_see_queued_work(kit)


@check(
    "sync.events",
    "with events the consumer's stream waits for the producer's queued work before it reads",
)
def events(kit: Kit) -> str:
    if not kit.events():
        raise Skip(
            "the device's requires_event_sync() is False here: no interprocess events "
            "(a device with an event mode: run the kit in that mode too)"
        )
    return sends_see_queued_work(kit)
