"""Host memory between processes (`_host`): a CPU storage's shared-memory file sent as bytes
and opened again, checked by inode; forged, stale and unreachable sends refused; device memory
read on the CPU only where it is host memory."""

import os
import struct

import pytest
import torch

import devipc
from devipc._core import _host, _wire
from devipc._core._memfd import reach_tag


def test_a_host_send_opens_the_same_bytes_both_ways():
    storage = _host.shared_host_storage(4096)
    send = _host.HostSend.from_bytes(bytes(_host.HostSend.of(storage)))
    opened = send.open("test handle")
    assert opened.nbytes() == 4096 and opened.device.type == "cpu"
    mine = torch.empty(0, dtype=torch.uint8).set_(storage)
    theirs = torch.empty(0, dtype=torch.uint8).set_(opened)
    mine[7] = 9
    theirs[8] = 10
    assert theirs[7].item() == 9 and mine[8].item() == 10


def test_a_storage_outside_shared_memory_moves_there_with_its_tensors():
    weights = torch.arange(10, dtype=torch.float32)
    before = weights.data_ptr()
    send = _host.HostSend.of(weights.untyped_storage())
    assert weights.is_shared() and weights.data_ptr() != before
    opened = torch.empty(0).set_(send.open("test handle"))
    assert opened.tolist() == weights.tolist()


def _forged(send, **fields):
    values = dict(pid=send.pid, fd=send.fd, inode=send.inode, nbytes=send.nbytes)
    values.update(fields)
    return _host.HostSend(
        values["pid"], values["fd"], values["inode"], values["nbytes"], reach_tag()
    )


def test_forged_stale_and_gone_sends_are_clear_errors():
    storage = _host.shared_host_storage(64)
    send = _host.HostSend.of(storage)
    data = bytes(send)
    for cut in (3, 10, len(data) - 1):
        with pytest.raises(devipc.InvalidHandleError):
            _host.HostSend.from_bytes(data[:cut])
    with pytest.raises(devipc.InvalidHandleError, match="expected a host memory handle"):
        _host.HostSend.from_bytes(_wire.Writer(_wire.TENSOR).done())
    with pytest.raises(devipc.InvalidHandleError, match="not the memory"):
        _forged(send, inode=(send.inode[0], send.inode[1] + 1)).open("test handle")
    with pytest.raises(devipc.InvalidHandleError, match="not the memory"):
        _forged(send, nbytes=send.nbytes * 2).open("test handle")
    with pytest.raises(devipc.InvalidHandleError, match="cannot be opened"):
        _forged(send, fd=1 << 20).open("test handle")
    with pytest.raises(devipc.PeerGoneError, match="exited"):
        _forged(send, pid=(1 << 22) + 12345).open("test handle")
    elsewhere = _host.HostSend(send.pid, send.fd, send.inode, send.nbytes, b"\x01" * 8)
    with pytest.raises(devipc.InvalidHandleError, match="another host"):
        elsewhere.open("test handle")
    fd = send.fd
    del storage  # the file's fd goes with it
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.fstat(fd).st_ino != send.inode[1]
    with pytest.raises(devipc.InvalidHandleError):
        send.open("test handle")


def test_device_memory_reads_on_the_cpu_only_where_it_is_host_memory(monkeypatch):
    import devipc_openreg  # noqa: F401
    from devipc_openreg import _ipc_hooks

    device = torch.arange(6, dtype=torch.int64, device="openreg")
    torch.accelerator.synchronize()
    host = torch.empty(0, dtype=torch.int64).set_(_host.as_host(device.untyped_storage(), "x"))
    assert host.tolist() == list(range(6))
    host[0] = 99
    assert device[0].item() == 99  # the same bytes
    monkeypatch.setattr(_ipc_hooks.OpenRegIpcHooks, "memory_kind", lambda self, index: "VRAM")
    with pytest.raises(devipc.UnsupportedDeviceError, match="not host memory"):
        _host.as_host(device.untyped_storage(), "x")


def test_host_addressable_is_the_cpu_and_dram_devices(monkeypatch):
    """One answer for `as_host`, the checksum and p2p's copies made by the CPU."""
    import devipc_openreg  # noqa: F401
    from devipc_openreg import _ipc_hooks

    assert _host.host_addressable(torch.device("cpu"))
    assert _host.host_addressable(torch.device("openreg", 0))
    assert not _host.host_addressable(torch.device("meta"))  # no hooks
    monkeypatch.setattr(_ipc_hooks.OpenRegIpcHooks, "memory_kind", lambda self, index: "VRAM")
    assert not _host.host_addressable(torch.device("openreg", 0))  # asked anew, not cached


def test_the_wire_form_holds_what_it_names():
    send = _host.HostSend.of(_host.shared_host_storage(8))
    again = _host.HostSend.from_bytes(bytes(send))
    assert (
        (again.pid, again.fd, again.inode, again.nbytes)
        == (send.pid, send.fd, send.inode, send.nbytes)
        == (os.getpid(), send.fd, send.inode, 8)
    )
    assert struct.unpack_from("<4s", bytes(send))[0] == _wire.MAGIC
