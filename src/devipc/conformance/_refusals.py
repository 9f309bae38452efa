"""Damaged handles are refused with InvalidHandleError, by the device's hooks and by devipc,
before anything is mapped, and a refusal leaves the genuine handle usable."""

from __future__ import annotations

import random

import torch

import devipc

from . import _tasks
from ._check import check, expect
from ._compare import compare
from ._kit import Kit
from ._tasks import raised


def refused(outcomes: dict[str, str]) -> list[str]:
    """The cases that were not refused with InvalidHandleError."""
    return [
        f"{case}: {result}"
        for case, result in outcomes.items()
        if not raised(result, "InvalidHandleError")
    ]


@check(
    "refusals.hook_handles",
    "open_ipc_mem_handle refuses empty, truncated, extended and forged handles with "
    "InvalidHandleError (and the peer survives)",
)
def hook_handles(kit: Kit) -> str:
    tensor = torch.ones(64, device=kit.device)
    handle, _ = devipc.hooks.IpcMemHandle.of(kit.hooks.get_ipc_mem_handle(tensor.data_ptr()))
    noise = random.Random(19)
    damaged = {
        "empty": b"",
        "truncated by 1": handle[:-1],
        "half": handle[: len(handle) // 2],
        "extended by 1": handle + b"\0",
        "zeros": bytes(len(handle)),
        "0xff": b"\xff" * len(handle),
        "random": noise.randbytes(len(handle)),
    }
    wrong = refused(kit.peer().call(_tasks.hook_refusals, kit.target, damaged))
    expect(not wrong, "not refused with InvalidHandleError: " + "; ".join(wrong))
    return f"{len(damaged)} damaged {len(handle)}-byte handles"


@check(
    "refusals.typed_handles",
    "devipc.open refuses every truncation of a typed handle, a bad magic, another version "
    "and a trailing byte with InvalidHandleError; the genuine handle opens after",
)
def typed_handles(kit: Kit) -> str:
    peer = kit.peer()
    tensor = torch.arange(16, dtype=torch.float32, device=kit.device)
    data = bytes(devipc.share(tensor))
    damaged = {f"truncated to {n}": data[:n] for n in range(len(data))}
    damaged.update(
        {
            "bad magic": b"XXXX" + data[4:],
            "trailing byte": data + b"\0",
            "other version": data[:4] + bytes([data[4] ^ 0x7F]) + data[5:],
        }
    )
    wrong = refused(peer.call(_tasks.open_refusals, damaged))
    expect(not wrong, f"{len(wrong)} not refused with InvalidHandleError: " + "; ".join(wrong[:3]))
    try:
        compare("the genuine handle", tensor, peer.call(_tasks.open_handle, "genuine", data))
    finally:
        peer.call(_tasks.drop, "genuine", kit.target)
    return f"{len(damaged)} damaged handles of {len(data)} bytes"
