"""Endpoint metadata and remote descriptors are devipc wire bytes: they round-trip, and anything
truncated, forged, of another version or kind is an InvalidHandleError, never a crash; a mutated
descriptor given to a connection fails with a devipc error or reaches only what it may."""

import dataclasses
import random
import struct

import pytest
import torch
from _support import open_fds, wait_until

import devipc
import devipc.p2p as p2p
from devipc._core import _wire
from devipc.p2p._descriptor import Descriptor, Metadata


@pytest.fixture
def loop():
    """An endpoint connected to itself, and a registered tensor on each kind of memory; what
    they held is let go after the test (what earlier tests of this process hold is theirs)."""
    before = devipc.stats()
    with p2p.Endpoint() as endpoint:
        held = [
            endpoint,
            endpoint.connect(endpoint.metadata()),
            p2p.create_tensor((64,), torch.float32, "openreg")[0],
            p2p.create_tensor((64,), torch.float32, "cpu")[0],
        ]
        yield held
        held.clear()  # pytest keeps the fixture's value until its teardown ends
    torch.accelerator.synchronize()
    wait_until(
        lambda: (
            devipc.stats()["mapped"] <= before["mapped"]
            and devipc.stats()["exports"] <= before["exports"]
        ),
        "nothing held",
        collect=True,
    )


def test_descriptors_and_metadata_round_trip(loop):
    endpoint, _, device, cpu = loop
    for tensor in (device, cpu):
        data = endpoint.advertise(tensor[4:12])
        desc = Descriptor.from_bytes(data)
        assert desc.to_bytes() == data
        assert (desc.offset, desc.nbytes, desc.device.type) == (16, 32, tensor.device.type)
    meta = Metadata.from_bytes(endpoint.metadata())
    assert meta.to_bytes() == endpoint.metadata() and meta.transport == "ipc"


def test_every_truncation_and_wrong_kind_is_refused(loop):
    endpoint, connection, device, _ = loop
    data, meta = endpoint.advertise(device), endpoint.metadata()
    local = torch.zeros(64, device="openreg")
    for end in range(len(data)):
        with pytest.raises(devipc.InvalidHandleError):
            Descriptor.from_bytes(data[:end])
    for end in range(0, len(data), 7):
        with pytest.raises(devipc.InvalidHandleError):
            connection.read(local, data[:end])
    for end in range(len(meta)):
        with pytest.raises(devipc.InvalidHandleError):
            endpoint.connect(meta[:end])
    with pytest.raises(devipc.InvalidHandleError, match="unexpected bytes"):
        Descriptor.from_bytes(data + b"\0")
    with pytest.raises(devipc.InvalidHandleError, match="expected a p2p remote descriptor"):
        connection.read(local, meta)
    with pytest.raises(devipc.InvalidHandleError, match="expected a p2p endpoint metadata"):
        endpoint.connect(data)
    handle = devipc.share(device)
    with pytest.raises(devipc.InvalidHandleError, match="expected a p2p remote descriptor"):
        connection.read(local, bytes(handle))
    assert handle.revoke()
    with pytest.raises(devipc.InvalidHandleError, match="wire version 9"):
        Descriptor.from_bytes(data[:4] + struct.pack("<H", 9) + data[6:])
    with pytest.raises(devipc.InvalidHandleError, match="not a devipc handle"):
        Descriptor.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(devipc.InvalidHandleError, match="is bytes"):
        connection.read(local, "descriptor")


def test_forged_fields_are_refused(loop):
    endpoint, connection, device, _ = loop
    desc = Descriptor.from_bytes(endpoint.advertise(device))
    local = torch.zeros(64, device="openreg")
    forged = [
        (dict(offset=300), "range offset"),  # past the storage
        (dict(nbytes=257), "range size"),
        (dict(reg_id=0), "registration id"),
        (dict(slot=1 << 20), "registry slot"),
        (dict(kind=7), "memory kind"),
        (dict(mem=b""), "needs a memory handle"),
        (dict(counter=b"short"), "needs a memory handle"),
        (dict(page=b"x" * 8), "registry page handle"),
        (dict(identity=b"u" * 300), "device identity"),
    ]
    for change, message in forged:
        data = dataclasses.replace(desc, **change).to_bytes()
        with pytest.raises(devipc.InvalidHandleError, match=message):
            connection.read(local, data)
    stranger = dataclasses.replace(desc, page=bytes(len(desc.page))).to_bytes()
    with pytest.raises(devipc.InvalidHandleError, match="another process"):
        connection.read(local, stranger)  # a descriptor of a process this does not reach
    stale = dataclasses.replace(desc, reg_id=desc.reg_id + 1000).to_bytes()
    with pytest.raises(p2p.RemoteTensorFreedError):
        connection.read(local, stale)


def test_forged_metadata_is_refused(loop):
    endpoint, _, _, _ = loop
    meta = Metadata.from_bytes(endpoint.metadata())
    with pytest.raises(devipc.UnsupportedDeviceError, match="another host"):
        endpoint.connect(dataclasses.replace(meta, host=b"elsewhere").to_bytes())
    with pytest.raises(ValueError, match="transport 'nixl'"):
        endpoint.connect(dataclasses.replace(meta, transport="nixl").to_bytes())
    with pytest.raises(ValueError, match="uses transport 'carrier-pigeon'"):  # a third party's
        endpoint.connect(dataclasses.replace(meta, transport="carrier-pigeon").to_bytes())
    bad = _wire.Writer(_wire.P2P_METADATA).text("Carrier Pigeon!").bytes(meta.host).int(meta.pid)
    with pytest.raises(devipc.InvalidHandleError, match="names no transport"):
        endpoint.connect(bad.bytes(meta.page).bytes(b"").done())
    token_flipped = meta.page[:-1] + bytes([meta.page[-1] ^ 1])
    with pytest.raises(devipc.InvalidHandleError):
        endpoint.connect(dataclasses.replace(meta, page=token_flipped).to_bytes())
    with pytest.raises(devipc.InvalidHandleError, match="another process than pid"):
        endpoint.connect(dataclasses.replace(meta, pid=meta.pid + 1).to_bytes())
    dead = (1 << 31) - 1  # no such process
    page = meta.page[:6] + struct.pack("<i", dead) + meta.page[10:]
    with pytest.raises(devipc.PeerGoneError, match=f"process {dead}"):
        endpoint.connect(dataclasses.replace(meta, pid=dead, page=page).to_bytes())


def test_mutated_descriptors_fail_cleanly(loop):
    endpoint, connection, device, cpu = loop
    rng = random.Random(8)
    for tensor in (device, cpu):
        tensor.copy_(torch.arange(64.0))
        data = endpoint.advertise(tensor)
        local = torch.zeros(64, device=tensor.device)
        for _ in range(500):
            mutated = bytearray(data)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            try:
                connection.read(local, bytes(mutated))
            except (devipc.DevIpcError, ValueError):
                pass  # what a bad descriptor may raise; anything else fails the test
        connection.read(local, data)  # the genuine one still works
        assert local.cpu().tolist() == list(range(64))
    assert connection.mapped() >= 2
    p2p.free_tensor(device)
    p2p.free_tensor(cpu)
    with pytest.raises(p2p.RemoteTensorFreedError):
        connection.read(local, data)
    assert connection.mapped() == 0  # whatever the mutants opened was closed too


def test_a_dropped_connection_lets_go_of_what_it_opened(loop):
    endpoint, first, device, _ = loop
    data = endpoint.advertise(device)
    first.read(torch.zeros(64, device="openreg"), data)  # devipc's counter files now exist

    def sent():  # this process is the owner too: the slots its peers' opens hold
        devipc.ipc_collect()
        return devipc.stats()["sent"]

    held, fds = wait_until(sent, "the first open listed"), open_fds()
    connection = endpoint.connect(endpoint.metadata())
    connection.read(torch.zeros(64, device="openreg"), data)
    wait_until(lambda: sent() == held + 1, "the second open listed")
    del connection
    torch.accelerator.synchronize()
    wait_until(lambda: sent() == held, "the dropped connection's slot released")
    assert open_fds() <= fds  # its page mapping and pidfd closed
