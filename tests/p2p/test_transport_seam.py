"""The Transport seam (`devipc.p2p._transport`): an Endpoint given a transport object hears
every registration through it, carries its name, metadata and descriptor part in its own wire
bytes, validates each call, and hands the transfers to the transport's link. A fake transport
over host addresses, named "fake", stands in for a third party's here."""

import ctypes
import struct

import pytest
import torch
from _support import TIMEOUT

import devipc.p2p as p2p
from devipc.p2p._descriptor import NONE, Descriptor, Metadata
from devipc.p2p._transfer import Transfer
from devipc.p2p._transport import LinkExtras


class FakeLink:
    def __init__(self, transport):
        self.transport = transport

    def post(self, op, locals_, descs, wait):
        self.transport.posts.append((op, len(locals_), wait))
        for local, desc in zip(locals_, descs):
            if not desc.extra:
                raise p2p.InvalidHandleError("no fake part")
            remote, nbytes = struct.unpack("<qq", desc.extra)
            assert nbytes == local.nbytes  # the endpoint checked the sizes
            if op == "READ":
                ctypes.memmove(local.data_ptr(), remote, nbytes)
            else:
                ctypes.memmove(remote, local.data_ptr(), nbytes)
        return Transfer()

    def mapped(self):
        return 0

    def close(self):
        self.transport.links -= 1


class FakeTransport:
    name = "fake"

    def __init__(self):
        self.registered, self.posts, self.links, self.closed = {}, [], 0, False

    def metadata(self):
        return b"fake agent"

    def on_register(self, reg):
        self.registered[reg.id] = reg

    def on_deregister(self, reg):
        del self.registered[reg.id]

    def describe(self, reg, offset, nbytes):
        return {"extra": struct.pack("<qq", reg.base + offset, nbytes)}

    def connect(self, meta):
        assert meta.transport == "fake" and meta.extra == b"fake agent"
        self.links += 1
        return FakeLink(self)

    def close(self):
        self.closed = True


def test_a_transport_object_carries_the_transfers():
    earlier, earlier_id = p2p.create_tensor((4,), torch.float32, "cpu")
    fake = FakeTransport()
    endpoint = p2p.Endpoint(transport=fake)
    assert endpoint.transport == "fake" and earlier_id in fake.registered  # told of live ones
    tensor, tensor_id = p2p.create_tensor((16,), torch.float32, "cpu")
    tensor.copy_(torch.arange(16.0))
    assert tensor_id in fake.registered
    meta = Metadata.from_bytes(endpoint.metadata())
    assert (meta.transport, meta.extra) == ("fake", b"fake agent")  # the transport names itself
    data = endpoint.advertise(tensor[4:8])
    desc = Descriptor.from_bytes(data)
    assert desc.kind == NONE and desc.extra == struct.pack("<qq", tensor.data_ptr() + 16, 16)
    connection = endpoint.connect(endpoint.metadata())
    local = torch.zeros(4)
    connection.read(local, data)
    assert local.tolist() == [4.0, 5.0, 6.0, 7.0]
    connection.writev_async([torch.full((4,), -1.0)], [data]).wait(TIMEOUT)
    assert tensor[4:8].tolist() == [-1.0] * 4
    assert fake.posts == [("READ", 1, True), ("WRITE", 1, False)]
    with pytest.raises(p2p.TransferSizeError):  # checked by the endpoint, for every transport
        connection.read(torch.zeros(8), data)
    with p2p.Endpoint() as same_host:
        with pytest.raises(p2p.InvalidHandleError, match="no fake part"):
            connection.read(local, same_host.advertise(tensor[4:8]))
        with pytest.raises(ValueError, match="uses transport 'ipc'"):
            endpoint.connect(same_host.metadata())
        with pytest.raises(ValueError, match="uses transport 'fake'"):
            same_host.connect(endpoint.metadata())
    assert len(fake.posts) == 3  # the TransferSizeError never reached the link; the IPC one did
    connection.close()
    connection.close()
    assert fake.links == 0  # closed once
    with pytest.raises(ValueError, match="closed"):
        connection.read(local, data)
    endpoint.connect(endpoint.metadata())  # dropped at once: its link closes with it
    assert fake.links == 0
    kept = endpoint.connect(endpoint.metadata())
    p2p.free_tensor(tensor)
    assert tensor_id not in fake.registered
    endpoint.close()
    assert fake.closed and fake.links == 0 and kept.mapped() == 0  # closed its connection
    p2p.free_tensor(earlier)
    assert earlier_id in fake.registered  # the closed endpoint's transport hears no more


def test_a_transport_is_a_name_or_an_object_with_a_name():
    with pytest.raises(ValueError, match="'auto', 'ipc', 'nixl' or a Transport object"):
        p2p.Endpoint(transport="carrier-pigeon")
    with pytest.raises(ValueError, match="Transport object"):
        p2p.Endpoint(transport=object())
    unnamed = FakeTransport()
    unnamed.name = "Carrier Pigeon!"
    with pytest.raises(ValueError, match="a transport's name"):
        p2p.Endpoint(transport=unnamed)


def test_a_transport_describes_only_descriptor_fields():
    class Odd(FakeTransport):
        def describe(self, reg, offset, nbytes):
            return {"extra": b"x", "colour": "blue"}

    tensor, _ = p2p.create_tensor((4,), torch.float32, "cpu")
    with p2p.Endpoint(transport=Odd()) as endpoint:
        with pytest.raises(ValueError, match="'colour'"):
            endpoint.advertise(tensor)
    p2p.free_tensor(tensor)


def test_a_link_without_prepare_or_sub_ranges_gets_the_defaults():
    tensor, _ = p2p.create_tensor((16,), torch.float32, "cpu")
    tensor.copy_(torch.arange(16.0))
    fake = FakeTransport()
    with p2p.Endpoint(transport=fake) as endpoint:
        connection = endpoint.connect(endpoint.metadata())
        data = endpoint.advertise(tensor[4:8])
        local = torch.zeros(4)
        with connection.prepare("read", [local], [data]) as prepared:  # re-posts through post
            for _ in range(3):
                prepared.post().wait(TIMEOUT)
        assert local.tolist() == [4.0, 5.0, 6.0, 7.0]
        assert fake.posts == [("READ", 1, False)] * 3
        connection.read(local, data, offset=0)  # the whole range: no sub-range
        with pytest.raises(ValueError, match="does not move sub-ranges"):
            connection.read(torch.zeros(2), data, offset=4)
        assert len(fake.posts) == 4
    p2p.free_tensor(tensor)


def test_a_links_optional_members_are_its_own_or_the_declared_defaults():
    class MappingLink(FakeLink):
        sub_ranges = True

        def map(self, desc):
            return torch.full((desc.nbytes,), 7, dtype=torch.uint8)

    class Mapping(FakeTransport):
        def connect(self, meta):
            self.links += 1
            return MappingLink(self)

    assert LinkExtras.of(FakeLink(FakeTransport())) == LinkExtras()  # every default
    extras = LinkExtras.of(MappingLink(FakeTransport()))
    assert extras.sub_ranges and extras.map is not None
    assert (extras.prepare, extras.again, extras.liveness) == (None, None, None)
    tensor, _ = p2p.create_tensor((16,), torch.float32, "cpu")
    for transport, maps in ((FakeTransport(), False), (Mapping(), True)):
        with p2p.Endpoint(transport=transport) as endpoint:
            connection = endpoint.connect(endpoint.metadata())
            data = endpoint.advertise(tensor[4:8])
            if maps:
                assert connection.map(data).tolist() == [7] * 16
            else:
                with pytest.raises(ValueError, match="cannot map"):
                    connection.map(data)
    p2p.free_tensor(tensor)
