"""openreg IPC between processes: zero-copy memory, interprocess events, bad handles, dead peers.

Children are `spawn`ed (the `children` fixture); every handle crosses a Pipe as bytes; every wait
has a timeout. Streams are held back by a process-shared Gate living in openreg memory (`hold`),
never by sleeps.
"""

import contextlib
import ctypes
import gc
import os
import signal
import struct
import threading

import _native as native
import pytest
from _support import TIMEOUT, recv, shm_entries

from devipc import InvalidHandleError, PeerGoneError
from devipc_openreg import _runtime as rt

MIB = 1 << 20


def hold(stream, sem):
    """Makes `stream` wait at a process-shared Gate in openreg memory until someone opens it."""
    native.Gate(sem, shared=True).hold(stream)


def pattern(n, seed):
    return bytes((i * 7 + seed) & 0xFF for i in range(256)) * (n // 256)


def within(fn, *args, timeout=TIMEOUT):
    """Runs a blocking call with a bound; fails the test instead of hanging it, and raises here
    what the call raised."""
    raised = []

    def run():
        try:
            fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            raised.append(error)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn.__name__} did not return within {timeout} s"
    if raised:
        raise raised[0]


# ---- workers (module level, so spawn can find them) ---------------------------------------------
def zero_copy_producer(conn):
    p = native.malloc(64 * 1024, 0) + 512  # an interior pointer: the handle names the whole segment
    ctypes.memmove(p, pattern(4096, 1), 4096)
    conn.send(rt.ipc_get_mem_handle(p))
    assert conn.recv() == "consumer wrote"
    conn.send(ctypes.string_at(p + 4096, 4096))
    ctypes.memmove(p, pattern(4096, 3), 4096)  # a write after the consumer mapped the memory
    conn.send("producer wrote")
    assert conn.recv() == "bye"


def remapping_consumer(conn, visible):
    os.environ["OPENREG_VISIBLE_DEVICES"] = visible  # read at the runtime's first call
    results = []
    for handle in conn.recv():
        try:
            base, size, device = rt.ipc_open_mem_handle(handle)
            results.append((device, ctypes.string_at(base, 256)))
            rt.ipc_close_mem_handle(base)
        except rt.OpenRegError as e:
            results.append(e.code)
    conn.send(results)


def event_producer(conn, n):
    stream = native.stream_create(0)
    data, sem = native.malloc(n, 0), native.malloc(64, 0)
    final = ctypes.create_string_buffer(pattern(n, 5), n)
    hold(stream, sem)
    native.memcpy_async(data, ctypes.addressof(final), n, native.HOST_TO_DEVICE, stream)
    event = rt.event_create(interprocess=True, timing=False)
    rt.event_record(event, stream)
    conn.send(
        (rt.ipc_get_mem_handle(data), rt.ipc_get_mem_handle(sem), rt.ipc_get_event_handle(event))
    )
    assert conn.recv() == "bye"


def exiting_producer(conn):
    p = native.malloc(4096, 0)
    event = rt.event_create(interprocess=True, timing=False)
    rt.event_record(event, None)
    native.event_synchronize(event)
    conn.send((rt.ipc_get_mem_handle(p)[0], rt.ipc_get_event_handle(event)))


def killed_producer(conn):
    p = native.malloc(3 * MIB, 0)
    ctypes.memmove(p, pattern(MIB, 9), MIB)
    stream, sem = native.stream_create(0), native.malloc(64, 0)
    hold(stream, sem)  # never released: the event below stays pending until the kill
    event = rt.event_create(interprocess=True, timing=False)
    rt.event_record(event, stream)
    conn.send((rt.ipc_get_mem_handle(p)[0], rt.ipc_get_event_handle(event)))
    conn.recv()  # blocks until SIGKILL


def recording_producer(conn, records_before):
    """Hands out its event's handle before the record the importer must wait for."""
    first, held, sem = native.stream_create(0), native.stream_create(0), native.malloc(64, 0)
    event = rt.event_create(interprocess=True, timing=False)
    for _ in range(records_before):
        rt.event_record(event, first)
    native.stream_synchronize(first)
    conn.send((rt.ipc_get_event_handle(event), rt.ipc_get_mem_handle(sem)))
    assert conn.recv() == "opened"
    hold(held, sem)  # the importer opens the gate
    rt.event_record(event, held)
    conn.send("recorded")
    assert conn.recv() == "bye"


def waiting_exporter(conn):
    """Exports an event that the importer records; reports what its own waits saw."""
    stream = native.stream_create(0)
    event = rt.event_create(interprocess=True, timing=False)
    conn.send(rt.ipc_get_event_handle(event))
    assert conn.recv() == "recorded"
    pending = not native.event_query(event)
    rt.stream_wait_event(stream, event)
    stream_pending = not native.stream_query(stream)
    conn.send((pending, stream_pending))
    native.event_synchronize(event)  # returns once the importer's record has run
    native.stream_synchronize(stream)
    conn.send(native.event_query(event))
    assert conn.recv() == "bye"


def killed_importer(conn, event_handle):
    """Records an imported event on a stream that never runs, then waits to be killed."""
    event = rt.ipc_open_event_handle(event_handle)
    stream, gate = native.stream_create(0), native.Gate()
    gate.hold(stream)
    rt.event_record(event, stream)
    conn.send("recorded")
    conn.recv()  # blocks until SIGKILL


# ---- tests ---------------------------------------------------------------------------------------
def test_opened_memory_is_zero_copy_both_ways(children):
    _, conn = children.start_piped(zero_copy_producer)
    handle, offset = recv(conn)
    assert offset == 512
    base, size, device = rt.ipc_open_mem_handle(handle)
    assert device == 0 and size == 2 * MIB
    p = base + offset
    assert ctypes.string_at(p, 4096) == pattern(4096, 1)
    assert native.pointer_attributes(p + 10) == (0, base, size, offset + 10)
    assert rt.ipc_open_mem_handle(handle)[0] == base  # same segment, same mapping, refcounted
    assert rt.ipc_get_mem_handle(p) == (handle, offset)  # received memory can be re-shared

    ctypes.memmove(p + 4096, pattern(4096, 2), 4096)
    conn.send("consumer wrote")
    assert recv(conn) == pattern(4096, 2)
    assert recv(conn) == "producer wrote"
    assert ctypes.string_at(p, 4096) == pattern(4096, 3)

    rt.ipc_close_mem_handle(base)
    assert ctypes.string_at(p, 256) == pattern(256, 3)  # one open left: still mapped
    rt.ipc_close_mem_handle(base)
    assert native.pointer_attributes(p) is None
    with pytest.raises(rt.OpenRegError):
        rt.ipc_close_mem_handle(base)
    conn.send("bye")
    children.join_ok()


def test_open_maps_the_device_by_identity_across_visible_devices(children):
    on0, on1 = native.malloc(4096, 0), native.malloc(4096, 1)
    ctypes.memmove(on1, pattern(256, 4), 256)
    _, conn = children.start_piped(remapping_consumer, "1")  # physical device 1 is its device 0
    conn.send([rt.ipc_get_mem_handle(on1)[0], rt.ipc_get_mem_handle(on0)[0]])
    assert recv(conn) == [(0, pattern(256, 4)), native.INVALID_DEVICE]
    children.join_ok()
    native.free(on0)
    native.free(on1)


def test_interprocess_event_orders_a_stream_of_another_process(children):
    n = 32 * MIB
    _, conn = children.start_piped(event_producer, n)
    (data_h, data_off), (sem_h, sem_off), event_h = recv(conn)
    data, sem = rt.ipc_open_mem_handle(data_h)[0], rt.ipc_open_mem_handle(sem_h)[0]
    event = rt.ipc_open_event_handle(event_h)
    again = rt.ipc_open_event_handle(event_h)  # shares the mapped progress page
    stream = native.stream_create(1)
    out = ctypes.create_string_buffer(n)
    rt.stream_wait_event(stream, event)
    native.memcpy_async(ctypes.addressof(out), data + data_off, n, native.DEVICE_TO_HOST, stream)
    assert not native.stream_query(stream) and not native.event_query(again)
    native.Gate.at(sem + sem_off).open()  # the producer's stream may now copy, then record
    within(native.stream_synchronize, stream)
    assert out.raw == pattern(n, 5)  # we copied only after the producer's copy
    assert native.event_query(event)
    within(native.event_synchronize, again)
    for e in (event, again):
        rt.event_destroy(e)
    native.stream_destroy(stream)
    rt.ipc_close_mem_handle(data)
    rt.ipc_close_mem_handle(sem)
    conn.send("bye")
    children.join_ok()


@pytest.mark.parametrize(
    "records_before", [0, 1], ids=["handle before any record", "handle after an earlier record"]
)
def test_an_importer_waits_for_the_latest_record_made_after_the_handle(children, records_before):
    _, conn = children.start_piped(recording_producer, records_before)
    event_h, (sem_h, sem_off) = recv(conn)
    event = rt.ipc_open_event_handle(event_h)
    sem = rt.ipc_open_mem_handle(sem_h)[0]
    try:
        assert native.event_query(event)  # nothing pending yet: never recorded, or done
        within(native.event_synchronize, event)
        conn.send("opened")
        assert recv(conn) == "recorded"
        # the same opened event now stands for the exporter's new, held record
        assert not native.event_query(event)
        stream = native.stream_create(0)
        rt.stream_wait_event(stream, event)
        assert not native.stream_query(stream)
        native.Gate.at(sem + sem_off).open()
        within(native.event_synchronize, event)
        within(native.stream_synchronize, stream)
        assert native.event_query(event)
        native.stream_destroy(stream)
    finally:
        native.Gate.at(sem + sem_off).open()  # never leave the producer's stream held
        rt.event_destroy(event)
        rt.ipc_close_mem_handle(sem)
    conn.send("bye")
    children.join_ok()


def test_an_importer_records_the_event_and_the_exporter_waits_for_it(children):
    _, conn = children.start_piped(waiting_exporter)
    event = rt.ipc_open_event_handle(recv(conn))
    stream, gate = native.stream_create(0), native.Gate()
    try:
        gate.hold(stream)
        rt.event_record(event, stream)
        assert not native.event_query(event)
        conn.send("recorded")
        assert recv(conn) == (True, True)  # the exporter's query and stream wait saw our record
        gate.open()
        assert recv(conn) is True  # its synchronize returned, and the event is done
        within(native.event_synchronize, event)
    finally:
        gate.open()
        native.stream_synchronize(stream)
        native.stream_destroy(stream)
        rt.event_destroy(event)
    conn.send("bye")
    children.join_ok()


def test_two_records_a_wait_is_for_the_latest(gate):
    done, held = native.stream_create(0), native.stream_create(0)
    event = rt.event_create(interprocess=True, timing=False)
    opened = rt.ipc_open_event_handle(rt.ipc_get_event_handle(event))  # through this page
    try:
        rt.event_record(event, done)
        native.stream_synchronize(done)
        assert native.event_query(opened)
        gate.hold(held)
        rt.event_record(opened, held)  # the second record, made through the opened event
        for e in (event, opened):
            assert not native.event_query(e)  # the first record is done; the latest is not
        gate.open()
        for e in (event, opened):
            within(native.event_synchronize, e)
            assert native.event_query(e)
    finally:
        rt.event_destroy(opened)
        rt.event_destroy(event)
        native.stream_destroy(done)
        native.stream_destroy(held)


def test_a_killed_importer_that_recorded_releases_the_exporter(children):
    event = rt.event_create(interprocess=True, timing=False)
    proc, conn = children.start_piped(killed_importer, rt.ipc_get_event_handle(event))
    stream = native.stream_create(0)
    try:
        assert recv(conn) == "recorded"
        assert not native.event_query(event)
        rt.stream_wait_event(stream, event)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
        within(native.stream_synchronize, stream)
        with pytest.raises(PeerGoneError, match=f"process {proc.pid} exited before its record"):
            within(native.event_synchronize, event)
        rt.event_record(event, stream)  # a new record supersedes the lost one
        within(native.event_synchronize, event)
        assert native.event_query(event)
    finally:
        native.stream_destroy(stream)
        rt.event_destroy(event)


def test_a_destroyed_event_keeps_its_slot_until_its_record_ran(gate):
    stream = native.stream_create(0)
    event = rt.event_create(interprocess=True, timing=False)
    gate.hold(stream)
    rt.event_record(event, stream)
    handle = rt.ipc_get_event_handle(event)
    rt.event_destroy(event)  # as devipc's hooks do right after taking the handle
    opened = rt.ipc_open_event_handle(handle)
    gate2 = native.Gate()
    try:
        assert not native.event_query(opened)  # still the creator's pending record
        gate.open()
        within(native.event_synchronize, opened)
        native.stream_synchronize(stream)
        # now freed: another event may take the slot, and the old handle waits for nothing
        others = [rt.event_create(interprocess=True, timing=False) for _ in range(2)]
        gate2.hold(stream)
        for other in others:
            rt.event_record(other, stream)
        late = rt.ipc_open_event_handle(handle)
        assert native.event_query(late) and native.event_query(opened)
        with pytest.raises(rt.OpenRegError, match="destroyed"):
            rt.event_record(late, stream)
        gate2.open()
        native.stream_synchronize(stream)
        for e in [late, *others]:
            rt.event_destroy(e)
    finally:
        gate.open()
        gate2.open()
        rt.event_destroy(opened)
        native.stream_destroy(stream)


def _event_slot(event) -> int:
    return struct.unpack_from("<i", rt.ipc_get_event_handle(event), 28)[0]  # the handle's slot


def test_event_slots_are_reused():
    seen = set()
    for _ in range(9000):  # more than a page's 8192 slots: a destroyed event's slot comes back
        event = rt.event_create(interprocess=True, timing=False)
        seen.add(_event_slot(event))
        rt.event_destroy(event)
    assert len(seen) < 100, f"{len(seen)} slots for events alive one at a time"
    live = [rt.event_create(interprocess=True, timing=False) for _ in range(100)]
    assert len({_event_slot(event) for event in live}) == 100  # live ones never share a slot
    for event in live:
        rt.event_destroy(event)


def test_bad_handles_are_rejected():
    gc.collect()  # no garbage of an earlier test shares the segment that must go below
    p = native.malloc(4096, 0)
    handle, _ = rt.ipc_get_mem_handle(p)
    ev = rt.event_create(interprocess=True, timing=False)
    event_handle = rt.ipc_get_event_handle(ev)

    def forged(offset, value):
        b = bytearray(handle)
        b[offset] ^= value
        return bytes(b)

    bad = [
        os.urandom(rt.IPC_HANDLE_SIZE),
        handle[:-1],
        handle + b"\0",
        "x" * 64,
        forged(36, 0xFF),  # right magic, wrong token
        forged(12, 0x3F),  # another fd number: not the memory the token names
        forged(63, 1),
    ]  # junk in the unused bytes
    for h in bad:
        with pytest.raises(InvalidHandleError):
            rt.ipc_open_mem_handle(h)
    with pytest.raises(InvalidHandleError, match="event"):
        rt.ipc_open_event_handle(handle)  # a memory handle is no event handle
    with pytest.raises(InvalidHandleError):
        rt.ipc_open_mem_handle(event_handle)
    native.free(p)
    native.empty_cache(0)
    with pytest.raises(InvalidHandleError, match="no longer open|token"):
        rt.ipc_open_mem_handle(handle)  # stale: the segment is gone
    rt.event_destroy(ev)


def test_a_real_token_under_a_forged_kind_or_device_is_rejected():
    p = native.malloc(4096, 0)
    handle = bytearray(rt.ipc_get_mem_handle(p)[0])
    ev = rt.event_create(interprocess=True, timing=False)
    event_handle = bytearray(rt.ipc_get_event_handle(ev))
    # The event page passed off as device memory (kind 1, physical 0, no slot).
    struct.pack_into("=H", event_handle, 6, 1)
    struct.pack_into("=iiI", event_handle, 24, 0, -1, 0)
    # Device 0's segment passed off as device 1's.
    struct.pack_into("=i", handle, 24, 1)
    for h in (event_handle, handle):
        with pytest.raises(InvalidHandleError):
            rt.ipc_open_mem_handle(bytes(h))
    base = rt.ipc_open_mem_handle(rt.ipc_get_mem_handle(p)[0])[0]  # the same, already mapped
    with pytest.raises(InvalidHandleError):
        rt.ipc_open_mem_handle(bytes(handle))
    rt.ipc_close_mem_handle(base)
    with pytest.raises(rt.OpenRegError):
        rt.ipc_close_mem_handle(base)  # the forgery took no reference
    rt.event_destroy(ev)
    native.free(p)


def test_handles_of_an_exited_process_raise_peer_gone(children):
    _, conn = children.start_piped(exiting_producer)
    mem_h, event_h = recv(conn)
    children.join_ok()
    with pytest.raises(PeerGoneError, match="exited"):
        rt.ipc_open_mem_handle(mem_h)
    with pytest.raises(PeerGoneError):
        rt.ipc_open_event_handle(event_h)


def test_sigkilled_producer_leaves_nothing_and_releases_waiters(children):
    before = shm_entries()
    proc, conn = children.start_piped(killed_producer)
    mem_h, event_h = recv(conn)
    base, size, _ = rt.ipc_open_mem_handle(mem_h)
    event = rt.ipc_open_event_handle(event_h)
    stream = native.stream_create(0)
    rt.stream_wait_event(stream, event)
    assert not native.event_query(event) and not native.stream_query(stream)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    assert not shm_entries() - before
    assert ctypes.string_at(base, MIB) == pattern(MIB, 9)  # the mapping outlives the producer
    within(native.stream_synchronize, stream)  # a dead recorder releases waiting streams
    # ... and waits on the host say why the record never completed
    with pytest.raises(PeerGoneError, match=f"process {proc.pid} exited before its record"):
        within(native.event_synchronize, event)
    with pytest.raises(PeerGoneError, match=f"process {proc.pid} exited before its record"):
        native.event_query(event)
    rt.event_destroy(event)
    native.stream_destroy(stream)
    rt.ipc_close_mem_handle(base)


def openreg_fds() -> int:
    """This process's fds on openreg's memory files (memfds named "openreg:..."), not all of
    its fds: other threads of a test process (a collector, a NIXL agent left by an earlier test)
    open and close fds of their own meanwhile."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # closed since listed (the listing's own)
            count += "memfd:openreg:" in os.readlink(f"/proc/self/fd/{fd}")
    return count


def test_fd_count_returns_to_baseline():
    for d in range(native.device_count()):
        native.empty_cache(d)
    ev = rt.event_create(interprocess=True, timing=False)
    event_handle = rt.ipc_get_event_handle(ev)  # its event page's fd stays, once
    baseline = openreg_fds()
    ptrs = [
        native.malloc(size, d) for d in (0, 1) for size in (100, 512 * 1024, MIB, 5 * MIB, 9 * MIB)
    ]
    assert openreg_fds() > baseline
    for p in ptrs:
        native.free(p)
    native.empty_cache(0)
    native.empty_cache(1)
    assert openreg_fds() == baseline

    p = native.malloc(4096, 0)
    baseline = openreg_fds()
    handle, _ = rt.ipc_get_mem_handle(p)
    bases = [rt.ipc_open_mem_handle(handle)[0] for _ in range(3)]  # opened through /proc/self/fd
    events = [rt.ipc_open_event_handle(event_handle) for _ in range(2)]
    assert openreg_fds() == baseline  # an importer holds no fd, only mappings
    for b in bases:
        rt.ipc_close_mem_handle(b)
    for e in events:
        rt.event_destroy(e)
    assert openreg_fds() == baseline
    rt.event_destroy(ev)
    native.free(p)
    native.empty_cache(0)
