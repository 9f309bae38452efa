"""devipc.p2p over the device's hooks: a peer connects to the kit's Endpoint and reads and writes
its advertised tensor one-sidedly; a freed registration is refused."""

from __future__ import annotations

import torch

from . import _tasks
from ._check import check, expect
from ._kit import Kit
from ._tasks import raised

ELEMENTS = 256


@check(
    "p2p.read_write",
    "a peer connected to an Endpoint reads, writes, readv's and writev's an advertised "
    "tensor, and is refused with RemoteTensorFreedError once it was freed",
)
def read_write(kit: Kit) -> str:
    import devipc.p2p as p2p

    peer, device = kit.peer(), kit.target
    tensor, _ = p2p.create_tensor((ELEMENTS,), torch.float32, kit.device)
    tensor.copy_(torch.arange(float(ELEMENTS)))
    half = ELEMENTS // 2
    with p2p.Endpoint() as endpoint:
        whole = endpoint.advertise(tensor)
        halves = [endpoint.advertise(tensor, 0, half * 4), endpoint.advertise(tensor, half * 4)]
        like, like_half = torch.empty(ELEMENTS), torch.empty(half)
        try:
            peer.call(_tasks.p2p_connect, endpoint.metadata())
            got = peer.call(_tasks.p2p_read, whole, like, device)
            expect(torch.equal(got, torch.arange(float(ELEMENTS))), "read: other values")
            peer.call(_tasks.p2p_write, whole, torch.full((ELEMENTS,), 3.0), device)
            expect(
                torch.equal(tensor.cpu(), torch.full((ELEMENTS,), 3.0)),
                "write: the owner does not see the peer's write",
            )
            peer.call(
                _tasks.p2p_writev,
                halves,
                [torch.full((half,), 1.0), torch.full((half,), 2.0)],
                device,
            )
            expected = torch.cat([torch.full((half,), 1.0), torch.full((half,), 2.0)])
            expect(torch.equal(tensor.cpu(), expected), "writev: the owner sees other values")
            got = peer.call(_tasks.p2p_readv, halves, [like_half, like_half], device)
            expect(torch.equal(torch.cat(got), expected), "readv: other values")
            p2p.free_tensor(tensor)
            refused = peer.call(_tasks.p2p_read_refused, whole, like, device)
            expect(
                raised(refused, "RemoteTensorFreedError"),
                f"a read of a freed registration gave {refused!r}",
            )
        finally:
            peer.call(_tasks.p2p_close, device)
    return f"{ELEMENTS} float32, halves through readv/writev"
