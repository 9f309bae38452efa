"""Tensors cross to a peer and back through torch.multiprocessing Queues: what arrives is the
same memory, seen with the same dtype, shape, stride and offset, and writes cross both ways."""

from __future__ import annotations

import torch

from . import _tasks
from ._check import check, expect
from ._compare import compare, preview, views_of
from ._kit import Kit

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
)


@check(
    "roundtrip.views",
    "views of one storage (offsets, strides, non-contiguous) arrive as views of one mapping "
    "with the sent values, both from and to the kit's process",
)
def views(kit: Kit) -> str:
    torch.empty(100, dtype=torch.uint8, device=kit.device)  # the next block starts inside a segment
    base = torch.arange(64, dtype=torch.float32, device=kit.device) * 1.5 + 1
    sent = views_of(base)
    reports = kit.peer().call(_tasks.describe, list(sent.values()))
    for (name, tensor), got in zip(sent.items(), reports):
        compare(f"to the peer, {name}", tensor, got)
    expect(
        len({got["storage"] for got in reports}) == 1, "the views arrived in more than one storage"
    )
    back = kit.peer().call(_tasks.views_back, kit.target)
    for name, tensor in views_of(back["base"]).items():
        got = back["views"][name]
        expect(
            got.device == kit.device,
            f"from the peer, {name}: arrived on {got.device}, made on {kit.device}",
        )
        expect(
            got.untyped_storage().data_ptr() == back["base"].untyped_storage().data_ptr(),
            f"from the peer, {name}: not a view of the received storage",
        )
        expect(torch.equal(got.cpu(), tensor.cpu()), f"from the peer, {name}: values differ")
    return f"{len(sent)} views each way"


@check("roundtrip.dtypes", "every dtype the device holds crosses bit for bit")
def dtypes(kit: Kit) -> str:
    sent, unsupported = {}, []
    for dtype in DTYPES:
        values = (torch.arange(-20, 44) * 3 % 17).to(dtype)
        try:
            sent[str(dtype)] = values.to(kit.device)
        except Exception:  # noqa: BLE001 - a dtype the device refuses: reported as such
            unsupported.append(str(dtype).removeprefix("torch."))
    expect(sent, "the device holds none of the dtypes tried")
    reports = kit.peer().call(_tasks.describe, list(sent.values()))
    for (name, tensor), got in zip(sent.items(), reports):
        compare(name, tensor, got)
    note = f"; the device holds no {', '.join(unsupported)}" if unsupported else ""
    return f"{len(sent)} dtypes{note}"


@check(
    "roundtrip.empty", "0-element tensors cross, with their shapes, also as views of a live storage"
)
def empty(kit: Kit) -> str:
    base = torch.arange(8, dtype=torch.float32, device=kit.device)
    sent = {
        "empty (0,)": torch.empty(0, device=kit.device),
        "empty (3, 0)": torch.empty(3, 0, dtype=torch.int64, device=kit.device),
        "view [4:4]": base[4:4],
    }
    reports = kit.peer().call(_tasks.describe, list(sent.values()))
    for (name, tensor), got in zip(sent.items(), reports):
        expect(
            got["shape"] == tuple(tensor.shape) and got["dtype"] == tensor.dtype,
            f"{name}: arrived as {got['dtype']} {got['shape']}",
        )
        expect(
            torch.device(got["device"]).type == kit.device.type,
            f"{name}: arrived on {got['device']}",
        )
    return f"{len(sent)} tensors"


@check(
    "roundtrip.parameter",
    "an nn.Parameter arrives as a Parameter, requires_grad kept, values shared",
)
def parameter(kit: Kit) -> str:
    sent = {
        "Parameter": torch.nn.Parameter(torch.full((4,), 2.0, device=kit.device)),
        "Parameter(requires_grad=False)": torch.nn.Parameter(
            torch.ones(3, device=kit.device), requires_grad=False
        ),
        "leaf requiring grad": torch.zeros(5, device=kit.device).requires_grad_(),
    }
    reports = kit.peer().call(_tasks.describe, list(sent.values()))
    for (name, tensor), got in zip(sent.items(), reports):
        compare(name, tensor, got)
        expect(got["type"] == type(tensor).__name__, f"{name}: arrived as a {got['type']}")
        expect(
            got["requires_grad"] == tensor.requires_grad,
            f"{name}: requires_grad {got['requires_grad']}, sent {tensor.requires_grad}",
        )
    return f"{len(sent)} tensors"


@check(
    "writes.both_ways",
    "the peer's writes into received memory are the kit's, and the kit's are the peer's",
)
def writes(kit: Kit) -> str:
    tensor = torch.zeros(32, device=kit.device)
    peer = kit.peer()
    try:
        peer.call(_tasks.hold, "written", tensor[8:24])
        peer.call(_tasks.add_to_held, "written", 1.0)
        expected = torch.zeros(32)
        expected[8:24] = 1
        expect(
            torch.equal(tensor.cpu(), expected),
            f"the peer wrote 1 into [8:24]; the kit sees {preview(tensor.cpu()[6:])} from [6:]",
        )
        tensor.fill_(7)
        kit.synchronize()
        got = peer.call(_tasks.held_report, "written")["values"]
        expect(
            torch.equal(got, torch.full((16,), 7.0)),
            f"the kit wrote 7; the peer sees {preview(got)}",
        )
    finally:
        peer.call(_tasks.drop, "written", kit.target)
    return "a view of 16 of 32 elements"
