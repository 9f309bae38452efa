"""torch.openreg's Stream, Event, stream() and set_stream (devipc_openreg/_streams.py), torch's own
stream and event APIs on openreg, and PyTorch's CUDA multiprocessing event tests with the device
swapped (test/test_multiprocessing.py: test_event_multiprocess, test_event_handle_importer,
test_event_handle_exporter). Streams are held back by Gates, never by sleeps.
"""

import pickle
import time

import _native as native
import pytest
import torch
from _support import recv, wait_until

import devipc_openreg  # registers the device where autoload is off
from devipc_openreg import _runtime


def held(stream, gate):
    """Holds `stream` (any openreg torch.Stream) at `gate`."""
    gate.hold_torch_stream(stream)


def assert_times_the_hold(elapsed_ms, before, started, opened, after):
    """`elapsed_ms` from a start event to an end event with a gate between them: at least the
    time from seeing start done to opening the gate, at most the time around both records
    (perf_counter and the runtime's steady_clock are both CLOCK_MONOTONIC)."""
    assert 0 < (opened - started) * 1e3 <= elapsed_ms <= (after - before) * 1e3, (
        elapsed_ms,
        (opened - started) * 1e3,
        (after - before) * 1e3,
    )


@pytest.fixture
def restore_current():
    """Puts back the current device and the current stream of every device."""
    device = torch.openreg.current_device()
    streams = [torch.openreg.current_stream(i) for i in range(torch.openreg.device_count())]
    yield
    for s in streams:
        _runtime.exchange_stream(s.device_index, s.stream_id)
    torch.openreg.set_device(device)


# ---- Stream ----
def test_a_stream_is_a_new_torch_stream_of_the_chosen_device():
    a, b = torch.openreg.Stream(), torch.openreg.Stream("openreg:1", priority=-1)
    assert isinstance(a, torch.Stream) and a.device == torch.device("openreg", 0)
    assert b.device == torch.device("openreg", 1)
    assert a.stream_id not in (0, torch.openreg.current_stream().stream_id)
    assert a != torch.openreg.Stream()  # every call makes a stream of its own
    same = torch.openreg.Stream(stream_id=a.stream_id, device_index=0, device_type=a.device_type)
    assert same == a and hash(same) == hash(a)
    assert torch.openreg.default_stream(1) == torch.Stream(
        stream_id=0, device_index=1, device_type=a.device_type
    )
    assert a.query()
    a.synchronize()


def test_wait_stream_and_wait_event_order_streams(gate):
    producer, consumer = torch.openreg.Stream(), torch.openreg.Stream("openreg:1")
    held(producer, gate)
    consumer.wait_stream(producer)
    torch_event = torch.Event("openreg")  # torch's own event is accepted too
    torch_event.record(producer)
    consumer.wait_event(torch_event)
    assert not producer.query() and not consumer.query()
    gate.open()
    consumer.synchronize()
    assert producer.query() and torch_event.query()


def test_record_event_returns_an_openreg_event(gate):
    s = torch.openreg.Stream()
    held(s, gate)
    event = s.record_event()
    assert isinstance(event, torch.openreg.Event) and event.device == s.device
    assert s.record_event(event) is event
    assert not event.query()
    gate.open()
    event.synchronize()
    assert event.query()


# ---- stream() and set_stream ----
def test_stream_context_sets_and_restores_the_stream_and_device(restore_current):
    s0, s1 = torch.openreg.Stream(), torch.openreg.Stream("openreg:1")
    before0 = torch.openreg.current_stream(0)
    with torch.openreg.stream(s0) as entered:
        assert entered is s0
        assert torch.openreg.current_stream() == s0 == torch.accelerator.current_stream()
        with torch.openreg.stream(s1):
            assert torch.openreg.current_device() == 1
            assert torch.openreg.current_stream() == s1
            assert torch.openreg.current_stream(0) == s0  # the other device keeps its own
        assert torch.openreg.current_device() == 0
        assert torch.openreg.current_stream(1).stream_id == 0
        assert torch.openreg.current_stream() == s0
    assert torch.openreg.current_stream() == before0
    with pytest.raises(KeyError), torch.openreg.stream(s1):
        raise KeyError("restored even when the block raises")
    assert torch.openreg.current_device() == 0 and torch.openreg.current_stream(1).stream_id == 0
    with torch.openreg.stream(None) as nothing:  # as torch.cuda.stream(None): no change
        assert nothing is None and torch.openreg.current_stream() == before0


def test_work_in_a_stream_context_is_queued_on_that_stream(gate, restore_current):
    s = torch.openreg.Stream()
    held(s, gate)
    with torch.openreg.stream(s):
        event = torch.openreg.Event()
        event.record()  # the current stream: s
        torch_event = torch.Event("openreg")
        torch_event.record()
    assert not event.query() and not torch_event.query()
    assert torch.openreg.current_stream().query()  # the default stream has nothing held
    gate.open()
    event.synchronize()
    torch_event.synchronize()


def test_set_stream_sets_the_stream_and_its_device(restore_current):
    s1 = torch.openreg.Stream("openreg:1")
    torch.openreg.set_stream(s1)
    assert torch.openreg.current_device() == 1
    assert torch.openreg.current_stream() == s1 == torch.accelerator.current_stream()
    torch.openreg.set_stream(None)  # no change, as torch.cuda.set_stream(None)
    assert torch.openreg.current_stream() == s1


def test_set_stream_refuses_what_is_no_openreg_stream(restore_current):
    with pytest.raises(TypeError, match="openreg stream"):
        torch.openreg.set_stream("openreg:0")
    with pytest.raises(ValueError, match="stream of cpu"):
        torch.openreg.set_stream(torch.Stream("cpu"))
    unknown = torch.Stream(
        stream_id=123456, device_index=0, device_type=torch.openreg.Stream().device_type
    )
    with pytest.raises(RuntimeError, match="123456"):
        torch.openreg.set_stream(unknown)
    assert torch.openreg.current_stream().stream_id != 123456


# ---- Event ----
def test_an_event_times_and_orders_work(gate):
    s = torch.openreg.Stream()
    start, end = (torch.openreg.Event(enable_timing=True) for _ in range(2))
    assert start.query()  # never recorded: nothing to wait for
    before = time.perf_counter()
    start.record(s)
    held(s, gate)
    end.record(s)
    wait_until(start.query, "start's record ran")
    started = time.perf_counter()
    waiter = torch.openreg.Stream()
    end.wait(waiter)
    assert not end.query() and not waiter.query()
    opened = time.perf_counter()
    gate.open()
    end.synchronize()
    waiter.synchronize()
    after = time.perf_counter()
    assert end.query()
    assert_times_the_hold(start.elapsed_time(end), before, started, opened, after)


def test_event_misuse_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot measure time"):
        torch.openreg.Event(enable_timing=True, interprocess=True)
    plain = torch.openreg.Event()
    with pytest.raises(ValueError, match="interprocess=True"):
        plain.ipc_handle()
    with pytest.raises(TypeError):
        pickle.dumps(plain)  # only torch.multiprocessing sends events, as their IPC handle
    a, b = torch.openreg.Event(), torch.openreg.Event()
    a.record()
    b.record()
    with pytest.raises(_runtime.OpenRegError, match="timing"):
        a.elapsed_time(b)
    on0 = torch.openreg.Event()
    on0.record(torch.openreg.Stream("openreg:0"))
    with pytest.raises(ValueError, match="openreg:0"):
        on0.record(torch.openreg.Stream("openreg:1"))
    with pytest.raises(devipc_openreg._runtime.InvalidHandleError):
        torch.openreg.Event.from_ipc_handle(0, b"\0" * 64)


def test_an_event_opened_in_this_process_shares_the_records(gate):
    event = torch.openreg.Event(interprocess=True)
    opened = torch.openreg.Event.from_ipc_handle("openreg:0", event.ipc_handle())
    s = torch.openreg.Stream()
    held(s, gate)
    opened.record(s)  # an importer may record, as in CUDA
    assert not event.query() and not opened.query()
    gate.open()
    event.synchronize()
    assert opened.query() and opened.device == torch.device("openreg", 0)


# ---- torch's own APIs on openreg ----
def test_torch_stream_event_and_accelerator_apis_work_on_openreg(gate, restore_current):
    s = torch.Stream("openreg")
    assert s.device.type == "openreg" and s.query()
    with s:
        assert torch.accelerator.current_stream() == s == torch.openreg.current_stream()
    torch.accelerator.set_stream(s)
    assert torch.openreg.current_stream() == s
    start = torch.Event("openreg", enable_timing=True)
    end = torch.Event("openreg", enable_timing=True)
    before = time.perf_counter()
    start.record()
    held(s, gate)
    end.record(s)
    wait_until(start.query, "start's record ran")
    started = time.perf_counter()
    other = torch.Stream("openreg")
    other.wait_event(end)
    assert not end.query() and not other.query()
    opened = time.perf_counter()
    gate.open()
    end.synchronize()
    other.synchronize()
    torch.accelerator.synchronize()
    after = time.perf_counter()
    assert_times_the_hold(start.elapsed_time(end), before, started, opened, after)


# ---- PyTorch's multiprocessing event tests, device swapped -------------------------------------
def event_multiprocess_child(conn, event):
    conn.send("ready")
    assert conn.recv() == "recorded"
    conn.send(not event.query())
    event.synchronize()  # the parent's record, made after this event was sent
    conn.send("synchronized")


def event_handle_importer_consumer(conn, handle):
    e1 = torch.openreg.Event.from_ipc_handle(0, handle)
    conn.send("ready")
    assert conn.recv() == "recorded"
    pending = not e1.query()
    conn.send(pending)
    e1.synchronize()
    conn.send(e1.query())


def event_handle_exporter_consumer(conn, handle):
    sem = native.malloc(64, 0)
    gate = native.Gate(sem, shared=True)
    s = torch.openreg.Stream()
    with torch.openreg.stream(s):
        e1 = torch.openreg.Event.from_ipc_handle(torch.openreg.current_device(), handle)
        held(s, gate)  # instead of torch.cuda._sleep: held until the parent opens the gate
        e1.record()
        conn.send(_runtime.ipc_get_mem_handle(sem))
        assert conn.recv() == "done"  # keep e1 until the parent has synchronized


def test_event_multiprocess(children, gate):
    event = torch.openreg.Event(enable_timing=False, interprocess=True)
    assert event.query()
    _, conn = children.start_piped(event_multiprocess_child, event)  # pickled as its handle
    assert recv(conn) == "ready"
    s = torch.openreg.current_stream()
    held(s, gate)
    event.record()
    conn.send("recorded")
    assert not event.query()
    assert recv(conn) is True  # the child sees the record pending
    gate.open()
    assert recv(conn) == "synchronized"
    assert event.query()
    children.join_ok()


def test_event_handle_importer(children, gate):
    e0 = torch.openreg.Event(enable_timing=False, interprocess=True)
    assert e0.query()
    _, conn = children.start_piped(event_handle_importer_consumer, e0.ipc_handle())
    assert recv(conn) == "ready"
    held(torch.openreg.current_stream(), gate)
    e0.record()
    conn.send("recorded")
    assert recv(conn) is True  # the child saw the record made after it opened the handle
    gate.open()
    assert recv(conn) is True
    assert e0.query()
    children.join_ok()


def test_event_handle_exporter(children):
    e0 = torch.openreg.Event(enable_timing=False, interprocess=True)
    _, conn = children.start_piped(event_handle_exporter_consumer, e0.ipc_handle())
    sem_handle, offset = recv(conn)  # the child has recorded e0, on its held stream
    base = _runtime.ipc_open_mem_handle(sem_handle)[0]
    gate = native.Gate.at(base + offset)
    try:
        assert not e0.query()
    finally:
        gate.open()  # also when the check fails: the child's stream must not stay held
    e0.synchronize()
    assert e0.query()
    _runtime.ipc_close_mem_handle(base)
    conn.send("done")
    children.join_ok()
