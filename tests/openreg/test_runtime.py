"""The openreg runtime through its ctypes bindings, in one process (no torch needed).

Environment variables are read once per process, so device-selection tests run subprocesses.
Streams are held back with a semaphore the stream waits on (`Gate`), never with sleeps.
"""
import ctypes
import json
import os
import subprocess
import sys
import threading

import pytest

from devipc_openreg import _runtime as rt

SRC = os.path.abspath(os.path.join(os.path.dirname(rt.__file__), "..", ".."))
MIB = 1 << 20
libc = ctypes.CDLL(None, use_errno=True)
SEM_WAIT = ctypes.cast(libc.sem_wait, ctypes.c_void_p).value
USLEEP = ctypes.cast(libc.usleep, ctypes.c_void_p).value


class Gate:
    """A POSIX semaphore at `addr` (32 bytes, shared between processes when `shared`): a stream
    running `hold(stream)` stops there until `open()`."""

    def __init__(self, addr, shared=False):
        self.addr = addr
        assert libc.sem_init(ctypes.c_void_p(addr), int(shared), 0) == 0

    def hold(self, stream):
        assert rt.lib.orLaunchHostFunc(stream, SEM_WAIT, self.addr) == 0

    def open(self):
        assert libc.sem_post(ctypes.c_void_p(self.addr)) == 0


@pytest.fixture
def gate():
    buf = ctypes.create_string_buffer(64)
    yield Gate(ctypes.addressof(buf))


@pytest.fixture
def stream():
    s = rt.stream_create(0)
    yield s
    rt.stream_destroy(s)


def start_isolated(code, **env):
    """Starts `code` in a fresh interpreter whose OPENREG_* variables are exactly `env`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("OPENREG_")}
    full.update(env, PYTHONPATH=SRC)
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result_of(proc):
    """Waits (bounded) for a process from start_isolated and returns its last line as JSON."""
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


DEVICES = """
import json
from devipc_openreg import _runtime as rt
n = rt.device_count()
print(json.dumps({"count": n, "uuids": [rt.device_uuid(i) for i in range(n)]}))
"""


def test_device_env_count_visible_and_stable_uuids():
    cases = {
        "default": {},
        "four": {"OPENREG_DEVICE_COUNT": "4"},
        "bad_count": {"OPENREG_DEVICE_COUNT": "many"},
        "renumbered": {"OPENREG_DEVICE_COUNT": "3", "OPENREG_VISIBLE_DEVICES": "2,0"},
        "bad_entries": {"OPENREG_DEVICE_COUNT": "3", "OPENREG_VISIBLE_DEVICES": "7, x,1,1,-1"},
        "none": {"OPENREG_VISIBLE_DEVICES": ""},
    }
    procs = {name: start_isolated(DEVICES, **env) for name, env in cases.items()}  # in parallel
    got = {name: result_of(proc) for name, proc in procs.items()}
    assert got["default"]["count"] == 2
    assert got["four"]["count"] == 4
    assert got["bad_count"]["count"] == 2  # unparsable: default
    assert got["none"]["count"] == 0
    phys = got["four"]["uuids"]
    assert len(set(phys)) == 4 and all(len(u) == 36 and u.count("-") == 4 for u in phys)
    assert got["default"]["uuids"] == phys[:2]  # same physical index, same UUID, any process
    assert got["renumbered"]["uuids"] == [phys[2], phys[0]]
    assert got["bad_entries"]["uuids"] == [phys[1]]


def test_current_device_is_per_thread_and_uuid_lookup():
    assert rt.device_count() >= 2
    rt.set_device(0)
    seen = []
    t = threading.Thread(target=lambda: (rt.set_device(1), seen.append(rt.get_device())))
    t.start()
    t.join(10)
    assert seen == [1] and rt.get_device() == 0
    assert rt.device_by_uuid(rt.device_uuid(1)) == 1
    with pytest.raises(rt.OpenRegError) as e:
        rt.set_device(rt.device_count())
    assert e.value.code == rt.INVALID_DEVICE and "orSetDevice" in str(e.value)
    with pytest.raises(rt.OpenRegError):
        rt.device_by_uuid("00000000-0000-0000-0000-000000000000")


def test_malloc_free_stats_and_empty_cache():
    rt.empty_cache(1)
    rt.reset_accumulated_stats(1)
    before = rt.mem_stats(1)
    small = rt.malloc(1000, 1)
    large = rt.malloc(3 * MIB, 1)
    s = rt.mem_stats(1)
    assert small % 512 == 0 and large % 512 == 0
    assert s["allocated"] - before["allocated"] == 1024 + 4 * MIB  # a large block keeps its rest < 1 MiB
    assert s["reserved"] - before["reserved"] == 2 * MIB + 4 * MIB  # small segment + own segment
    assert s["num_segments"] - before["num_segments"] == 2 and s["num_allocs"] == 2
    assert rt.malloc(0, 1) == 0

    rt.free(large)
    rt.reset_peak_stats(1)
    s = rt.mem_stats(1)
    assert s["peak_allocated"] == s["allocated"] == before["allocated"] + 1024
    assert s["reserved"] - before["reserved"] == 6 * MIB  # cached, not returned
    assert rt.malloc(3 * MIB, 1) == large  # served from the cache
    rt.free(large)
    rt.free(small)
    assert rt.mem_stats(1)["num_frees"] == 3
    rt.empty_cache(1)
    s = rt.mem_stats(1)
    assert s["reserved"] == before["reserved"] and s["num_segments"] == before["num_segments"]
    assert s["peak_reserved"] >= 6 * MIB
    rt.reset_accumulated_stats(1)
    assert rt.mem_stats(1)["num_allocs"] == 0


def test_malloc_of_a_size_rounding_would_wrap_fails_cleanly():
    before = rt.mem_stats(0)
    for size in (2**64 - 1, 2**64 - 512, 2**64 - 2 * MIB):  # rounded up, these wrapped to ~0 bytes
        with pytest.raises(rt.OpenRegError) as e:
            rt.malloc(size, 0)
        assert e.value.code == rt.MEMORY_ALLOCATION
    after = rt.mem_stats(0)
    assert (after["allocated"], after["reserved"]) == (before["allocated"], before["reserved"])


def test_free_blocks_split_and_merge():
    a, b, c = (rt.malloc(4096, 0) for _ in range(3))
    assert b == a + 4096 and c == b + 4096  # carved from one segment
    rt.free(b)
    rt.free(a)
    merged = rt.malloc(8192, 0)  # a and b merged back into one free block
    assert merged == a
    rt.free(merged)
    rt.free(c)
    rt.empty_cache(0)


def test_pointer_attributes_resolve_interior_pointers():
    p = rt.malloc(10_000, 0)
    dev, base, size, offset = rt.pointer_attributes(p + 1234)
    assert dev == 0 and base <= p and size == 2 * MIB and offset == p + 1234 - base
    host = ctypes.create_string_buffer(16)
    assert rt.pointer_attributes(ctypes.addressof(host)) is None
    rt.free(p)
    rt.empty_cache(0)
    assert rt.pointer_attributes(p) is None


def test_free_rejects_unknown_pointers():
    p = rt.malloc(4096, 0)
    for bogus in (0x1234, p + 512):
        with pytest.raises(rt.OpenRegError) as e:
            rt.free(bogus)
        assert e.value.code == rt.INVALID_VALUE and "orFree" in str(e.value)
    rt.free(p)
    with pytest.raises(rt.OpenRegError):
        rt.free(p)  # double free
    rt.free(0)  # NULL is a no-op
    rt.empty_cache(0)


def test_memcpy_every_kind_sync_and_async(stream):
    n = 3 * MIB + 17
    data = os.urandom(n)
    src = ctypes.create_string_buffer(data, n)
    out = ctypes.create_string_buffer(n)
    d1, d2 = rt.malloc(n, 0), rt.malloc(n, 0)
    for copy in (rt.memcpy, lambda *a: rt.memcpy_async(*a, stream)):
        ctypes.memset(out, 0, n)
        copy(d1, ctypes.addressof(src), n, rt.HOST_TO_DEVICE)
        copy(d2, d1, n, rt.DEVICE_TO_DEVICE)
        copy(ctypes.addressof(out), d2, n, rt.DEVICE_TO_HOST)
        rt.stream_synchronize(stream)
        assert out.raw == data
        host = ctypes.create_string_buffer(n)
        copy(ctypes.addressof(host), ctypes.addressof(out), n, rt.HOST_TO_HOST)
        rt.stream_synchronize(stream)
        assert host.raw == data
    with pytest.raises(rt.OpenRegError, match="destination"):
        rt.memcpy(ctypes.addressof(out), ctypes.addressof(src), n, rt.HOST_TO_DEVICE)
    with pytest.raises(rt.OpenRegError, match="source"):
        rt.memcpy(ctypes.addressof(out), d1 + 4 * MIB - n // 2, n, rt.DEVICE_TO_HOST)  # overruns
    with pytest.raises(rt.OpenRegError, match="kind"):
        rt.memcpy(d1, d2, 16, 9)
    rt.free(d1)
    rt.free(d2)
    rt.empty_cache(0)


def test_memcpy_is_ordered_after_the_default_stream(gate):
    dev = rt.malloc(8, 0)
    one, out = ctypes.c_uint64(1), ctypes.c_uint64(0)
    rt.memcpy(dev, ctypes.addressof(ctypes.c_uint64(0)), 8, rt.HOST_TO_DEVICE)
    gate.hold(None)
    rt.memcpy_async(dev, ctypes.addressof(one), 8, rt.HOST_TO_DEVICE, None)
    t = threading.Thread(target=rt.memcpy, args=(ctypes.addressof(out), dev, 8, rt.DEVICE_TO_HOST))
    t.start()
    assert not rt.stream_query(None)
    gate.open()
    t.join(10)
    assert not t.is_alive() and out.value == 1
    rt.free(dev)


def test_streams_run_fifo_and_report_idle(stream, gate):
    dev = rt.malloc(8, 0)
    values = [ctypes.c_uint64(i) for i in range(200)]
    gate.hold(stream)
    for v in values:  # all to the same address: only FIFO order leaves the last one
        rt.memcpy_async(dev, ctypes.addressof(v), 8, rt.HOST_TO_DEVICE, stream)
    assert not rt.stream_query(stream)
    gate.open()
    rt.stream_synchronize(stream)
    assert rt.stream_query(stream)
    out = ctypes.c_uint64()
    rt.memcpy(ctypes.addressof(out), dev, 8, rt.DEVICE_TO_HOST)
    assert out.value == 199
    rt.free(dev)


def test_stream_ids_and_lookup(stream):
    other = rt.stream_create(0)
    assert rt.stream_id(None) == 0 and rt.stream_id(rt.stream_from_id(0, 0)) == 0
    assert 0 < rt.stream_id(stream) < rt.stream_id(other)
    assert rt.stream_from_id(0, rt.stream_id(other)) == other
    rt.stream_destroy(other)
    with pytest.raises(rt.OpenRegError) as e:
        rt.stream_from_id(0, rt.stream_id(stream) + 1)
    assert e.value.code == rt.INVALID_RESOURCE_HANDLE
    rt.device_synchronize(0)


def test_events_query_synchronize_and_elapsed(stream, gate):
    start, end = rt.event_create(), rt.event_create()
    assert rt.event_query(end)  # never recorded: done, as in CUDA
    with pytest.raises(rt.OpenRegError) as e:
        rt.event_elapsed_ms(start, end)
    assert e.value.code == rt.INVALID_VALUE
    rt.event_record(start, stream)
    gate.hold(stream)
    assert rt.lib.orLaunchHostFunc(stream, USLEEP, 20_000) == 0
    rt.event_record(end, stream)
    assert not rt.event_query(end)
    with pytest.raises(rt.OpenRegError) as e:
        rt.event_elapsed_ms(start, end)
    assert e.value.code == rt.NOT_READY
    gate.open()
    rt.event_synchronize(end)
    assert rt.event_query(end) and rt.event_elapsed_ms(start, end) >= 19.0
    untimed = rt.event_create(timing=False)
    rt.event_record(untimed, stream)
    rt.event_synchronize(untimed)
    with pytest.raises(rt.OpenRegError) as e:
        rt.event_elapsed_ms(start, untimed)
    assert e.value.code == rt.INVALID_VALUE
    with pytest.raises(rt.OpenRegError):
        rt.event_create(interprocess=True)  # needs timing=False, as in CUDA
    for ev in (start, end, untimed):
        rt.event_destroy(ev)


def test_a_synchronized_stream_has_its_events_done():
    # On one CPU the woken synchronizer used to run before the worker marked the event done.
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(previous)})  # this thread only; the new worker inherits it
    try:
        s = rt.stream_create(0)
        try:
            for _ in range(2000):
                e = rt.event_create()
                rt.event_record(e, s)
                rt.stream_synchronize(s)
                done = rt.event_query(e)
                rt.event_destroy(e)
                assert done
        finally:
            rt.stream_destroy(s)
    finally:
        os.sched_setaffinity(0, previous)


def test_stream_wait_event_orders_two_streams(stream, gate):
    consumer = rt.stream_create(1)
    dev = rt.malloc(8, 0)
    value, out = ctypes.c_uint64(42), ctypes.c_uint64(0)
    ev = rt.event_create()
    gate.hold(stream)
    rt.memcpy_async(dev, ctypes.addressof(value), 8, rt.HOST_TO_DEVICE, stream)
    rt.event_record(ev, stream)
    rt.stream_wait_event(consumer, ev)
    rt.memcpy_async(ctypes.addressof(out), dev, 8, rt.DEVICE_TO_HOST, consumer)
    rt.event_destroy(ev)  # safe while pending: the queued work keeps what it needs
    assert not rt.stream_query(consumer)
    gate.open()
    rt.stream_synchronize(consumer)
    assert out.value == 42
    rt.stream_destroy(consumer)
    rt.free(dev)


EXIT_WITH_PENDING_WORK = """
import ctypes, json, time
from devipc_openreg import _runtime as rt
usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
s = rt.stream_create(0)
p = rt.malloc(1 << 20, 0)
for stream in (s, None):
    for _ in range(50):
        rt.lib.orLaunchHostFunc(stream, usleep, 100_000)
ev = rt.event_create(interprocess=True, timing=False)
rt.event_record(ev, s)
print(json.dumps(rt.stream_query(s)))
"""


def test_process_exits_cleanly_with_pending_work():
    # 10 s of queued work; exit must neither wait for it nor crash.
    assert result_of(start_isolated(EXIT_WITH_PENDING_WORK)) is False


USE_AFTER_FORK = """
import json, os
from devipc_openreg import _runtime as rt
rt.free(rt.malloc(4096, 0))
pid = os.fork()
if pid == 0:
    try:
        rt.malloc(4096, 0)
        os._exit(1)
    except rt.OpenRegError as e:
        os._exit(0 if "forked" in str(e) else 2)
_, status = os.waitpid(pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), rt.device_count(), rt.malloc(8, 0) > 0]))
"""


def test_forked_child_cannot_allocate():
    # Its allocator cache would alias the parent's memory and it has no stream workers.
    assert result_of(start_isolated(USE_AFTER_FORK)) == [0, 2, True]
