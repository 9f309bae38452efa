"""The seam a network transport (NIXL) plugs into: an Endpoint given a transport object hears
every registration, carries the transport's metadata and descriptor part in its own wire bytes,
and posts transfers to it. A fake transport over host addresses stands in for NIXL here."""
import ctypes
import struct

import pytest
import torch

import devipc.p2p as p2p
from devipc.p2p._descriptor import NONE, Descriptor, Metadata


class Done:
    def done(self):
        return True

    def wait(self, timeout=None):
        pass


class FakeTransport:
    def __init__(self):
        self.registered, self.posts, self.closed = {}, [], False

    def metadata(self):
        return b"fake agent"

    def on_register(self, reg):
        self.registered[reg.id] = reg

    def on_deregister(self, reg):
        del self.registered[reg.id]

    def connect(self, peer_metadata):
        assert peer_metadata == b"fake agent"
        self.connected = getattr(self, "connected", 0) + 1
        return "peer agent"

    def disconnect(self, remote_agent):
        assert remote_agent == "peer agent"
        self.connected -= 1

    def descriptor_extra(self, reg, offset, nbytes):
        return struct.pack("<qq", reg.base + offset, nbytes)

    def post(self, op, remote_agent, local, remote_extras):
        self.posts.append((op, remote_agent, len(local)))
        for (address, nbytes, _device), extra in zip(local, remote_extras):
            remote, remote_bytes = struct.unpack("<qq", extra)
            assert remote_bytes == nbytes
            if op == "READ":
                ctypes.memmove(address, remote, nbytes)
            else:
                ctypes.memmove(remote, address, nbytes)
        return Done()

    def close(self):
        self.closed = True


def test_a_transport_object_carries_the_transfers():
    earlier, earlier_id = p2p.create_tensor((4,), torch.float32, "cpu")
    fake = FakeTransport()
    endpoint = p2p.Endpoint(transport=fake)
    assert endpoint.transport == "nixl" and earlier_id in fake.registered  # told of live ones
    tensor, tensor_id = p2p.create_tensor((16,), torch.float32, "cpu")
    tensor.copy_(torch.arange(16.0))
    assert tensor_id in fake.registered
    meta = Metadata.from_bytes(endpoint.metadata())
    assert (meta.transport, meta.extra) == ("nixl", b"fake agent")
    data = endpoint.advertise(tensor[4:8])
    desc = Descriptor.from_bytes(data)
    assert desc.kind == NONE and desc.extra == struct.pack("<qq", tensor.data_ptr() + 16, 16)
    connection = endpoint.connect(endpoint.metadata())
    local = torch.zeros(4)
    connection.read(local, data)
    assert local.tolist() == [4.0, 5.0, 6.0, 7.0]
    connection.writev_async([torch.full((4,), -1.0)], [data]).wait(5)
    assert tensor[4:8].tolist() == [-1.0] * 4
    assert fake.posts == [("READ", "peer agent", 1), ("WRITE", "peer agent", 1)]
    with pytest.raises(ValueError, match="contiguous"):
        connection.read(torch.zeros(8)[::2], data)
    with p2p.Endpoint() as same_host:  # an IPC endpoint's descriptor has no network part
        with pytest.raises(p2p.InvalidHandleError, match="no NIXL part"):
            connection.read(local, same_host.advertise(tensor[4:8]))
        with pytest.raises(ValueError, match="uses transport 'ipc'"):
            endpoint.connect(same_host.metadata())
    p2p.free_tensor(tensor)
    assert tensor_id not in fake.registered
    endpoint.close()
    assert fake.closed and fake.connected == 0  # closing the endpoint closed its connection
    p2p.free_tensor(earlier)
    assert earlier_id in fake.registered  # the closed endpoint's transport hears no more


def test_a_transport_is_a_name_or_an_object():
    with pytest.raises(ValueError, match="'auto', 'ipc', 'nixl' or a transport object"):
        p2p.Endpoint(transport="carrier-pigeon")
