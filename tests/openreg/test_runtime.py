"""The openreg runtime through its ctypes bindings (the package's `_runtime`, the tests' own
`_native`), in one process: no torch tensors here.

Environment variables are read once per process, so device-selection tests run subprocesses.
Streams are held back with a semaphore the stream waits on (`_native.Gate`), never with sleeps.
"""

import ctypes
import os
import re
import threading

import _native as native
import pytest
from _support import TIMEOUT, json_from, start_python

from devipc_openreg import _runtime as rt

MIB = 1 << 20
HEADER = os.path.join(
    os.path.dirname(__file__), "..", "..", "openreg", "csrc", "runtime", "openreg.h"
)
# The constants of the bindings (product and test) by their names in openreg.h.
HEADER_NAMES = {
    "IPC_HANDLE_SIZE": "OR_IPC_HANDLE_SIZE",
    "SUCCESS": "orSuccess",
    "INVALID_VALUE": "orErrorInvalidValue",
    "MEMORY_ALLOCATION": "orErrorMemoryAllocation",
    "INVALID_DEVICE": "orErrorInvalidDevice",
    "INVALID_RESOURCE_HANDLE": "orErrorInvalidResourceHandle",
    "NOT_READY": "orErrorNotReady",
    "INVALID_HANDLE": "orErrorInvalidHandle",
    "PEER_GONE": "orErrorPeerGone",
    "INITIALIZATION": "orErrorInitialization",
    "INVALID_ENVIRONMENT": "orErrorInvalidEnvironment",
    "HOST_TO_HOST": "orMemcpyHostToHost",
    "HOST_TO_DEVICE": "orMemcpyHostToDevice",
    "DEVICE_TO_HOST": "orMemcpyDeviceToHost",
    "DEVICE_TO_DEVICE": "orMemcpyDeviceToDevice",
    "EVENT_DISABLE_TIMING": "orEventDisableTiming",
    "EVENT_INTERPROCESS": "orEventInterprocess",
    "MEMORY_TYPE_UNREGISTERED": "orMemoryTypeUnregistered",
    "RUNTIME_UNUSED": "orRuntimeUnused",
    "RUNTIME_INITIALIZED": "orRuntimeInitialized",
    "RUNTIME_FORKED_AFTER_USE": "orRuntimeForkedAfterUse",
}


@pytest.fixture
def stream():
    s = native.stream_create(0)
    yield s
    native.stream_destroy(s)


def start_isolated(code, **env):
    """A fresh interpreter whose OPENREG_* variables are exactly `env`, and that finds _native."""
    return start_python(code, PYTHONPATH=native.PYTHONPATH, **env)


def header():
    """openreg.h without its comments."""
    with open(HEADER) as f:
        return re.sub(r"//[^\n]*", "", f.read())


def test_constants_match_the_header():
    values = {
        name: int(value)
        for name, value in re.findall(r"\b(or\w+)\s*=\s*(\d+)", header())
        + re.findall(r"#define\s+(\w+)\s+(\d+)", header())
    }
    for module in (rt, native):
        constants = {
            name: value
            for name, value in vars(module).items()
            if name.isupper() and name[0] != "_" and isinstance(value, int)
        }
        assert constants, module
        for name, value in constants.items():
            assert name in HEADER_NAMES, f"{module.__name__}.{name} is not mapped to openreg.h"
            assert value == values[HEADER_NAMES[name]], f"{module.__name__}.{name}"


@pytest.mark.parametrize(
    "structure, c_name",
    [(rt.MemStats, "orMemStats"), (native.PointerAttributes, "orPointerAttributes")],
)
def test_structures_match_the_header(structure, c_name):
    body = re.search(rf"typedef struct {c_name} \{{(.*?)\}} {c_name};", header(), re.S)[1]
    assert [name for name, _ in structure._fields_] == re.findall(r"(\w+)\s*;", body)


DEVICES = """
import json
import _native as native
from devipc_openreg import _runtime as rt
try:
    n = native.device_count()
    print(json.dumps({"count": n, "uuids": [native.device_uuid(i) for i in range(n)]}))
except rt.OpenRegError as e:
    print(json.dumps({"code": e.code, "error": str(e)}))
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
    got = {name: json_from(proc) for name, proc in procs.items()}
    assert got["default"]["count"] == 2
    assert got["four"]["count"] == 4
    assert got["none"]["count"] == 0
    # Refused, with the value echoed (tests/openreg/test_env.py covers the cases through torch).
    assert got["bad_count"]["code"] == got["bad_entries"]["code"] == rt.INVALID_ENVIRONMENT
    assert "OPENREG_DEVICE_COUNT='many' is not valid" in got["bad_count"]["error"]
    assert "OPENREG_VISIBLE_DEVICES='7, x,1,1,-1' is not valid" in got["bad_entries"]["error"]
    phys = got["four"]["uuids"]
    assert len(set(phys)) == 4 and all(len(u) == 36 and u.count("-") == 4 for u in phys)
    assert got["default"]["uuids"] == phys[:2]  # same physical index, same UUID, any process
    assert got["renumbered"]["uuids"] == [phys[2], phys[0]]


def test_current_device_is_per_thread_and_uuid_lookup():
    assert native.device_count() >= 2
    native.set_device(0)
    seen = []
    t = threading.Thread(target=lambda: (native.set_device(1), seen.append(native.get_device())))
    t.start()
    t.join(TIMEOUT)
    assert seen == [1] and native.get_device() == 0
    assert native.device_by_uuid(native.device_uuid(1)) == 1
    with pytest.raises(rt.OpenRegError) as e:
        native.set_device(native.device_count())
    assert e.value.code == native.INVALID_DEVICE and "orSetDevice" in str(e.value)
    with pytest.raises(rt.OpenRegError):
        native.device_by_uuid("00000000-0000-0000-0000-000000000000")


def test_malloc_free_stats_and_empty_cache():
    native.empty_cache(1)
    native.reset_accumulated_stats(1)
    before = rt.mem_stats(1)
    small = native.malloc(1000, 1)
    large = native.malloc(3 * MIB, 1)
    s = rt.mem_stats(1)
    assert small % 512 == 0 and large % 512 == 0
    # a large block keeps its rest (< 1 MiB)
    assert s["allocated"] - before["allocated"] == 1024 + 4 * MIB
    assert s["reserved"] - before["reserved"] == 2 * MIB + 4 * MIB  # small segment + own segment
    assert s["num_segments"] - before["num_segments"] == 2 and s["num_allocs"] == 2
    assert native.malloc(0, 1) == 0

    native.free(large)
    native.reset_peak_stats(1)
    s = rt.mem_stats(1)
    assert s["peak_allocated"] == s["allocated"] == before["allocated"] + 1024
    assert s["reserved"] - before["reserved"] == 6 * MIB  # cached, not returned
    assert native.malloc(3 * MIB, 1) == large  # served from the cache
    native.free(large)
    native.free(small)
    assert rt.mem_stats(1)["num_frees"] == 3
    native.empty_cache(1)
    s = rt.mem_stats(1)
    assert s["reserved"] == before["reserved"] and s["num_segments"] == before["num_segments"]
    assert s["peak_reserved"] >= 6 * MIB
    native.reset_accumulated_stats(1)
    assert rt.mem_stats(1)["num_allocs"] == 0


def test_malloc_of_a_size_rounding_would_wrap_fails_cleanly():
    before = rt.mem_stats(0)
    for size in (2**64 - 1, 2**64 - 512, 2**64 - 2 * MIB):  # rounded up, these wrapped to ~0 bytes
        with pytest.raises(rt.OpenRegError) as e:
            native.malloc(size, 0)
        assert e.value.code == native.MEMORY_ALLOCATION
    after = rt.mem_stats(0)
    assert (after["allocated"], after["reserved"]) == (before["allocated"], before["reserved"])


def test_free_blocks_split_and_merge():
    a, b, c = (native.malloc(4096, 0) for _ in range(3))
    assert b == a + 4096 and c == b + 4096  # carved from one segment
    native.free(b)
    native.free(a)
    merged = native.malloc(8192, 0)  # a and b merged back into one free block
    assert merged == a
    native.free(merged)
    native.free(c)
    native.empty_cache(0)


def test_pointer_attributes_resolve_interior_pointers():
    p = native.malloc(10_000, 0)
    dev, base, size, offset = native.pointer_attributes(p + 1234)
    assert dev == 0 and base <= p and size == 2 * MIB and offset == p + 1234 - base
    host = ctypes.create_string_buffer(16)
    assert native.pointer_attributes(ctypes.addressof(host)) is None
    native.free(p)
    native.empty_cache(0)
    assert native.pointer_attributes(p) is None


def test_free_rejects_unknown_pointers():
    p = native.malloc(4096, 0)
    for bogus in (0x1234, p + 512):
        with pytest.raises(rt.OpenRegError) as e:
            native.free(bogus)
        assert e.value.code == native.INVALID_VALUE and "orFree" in str(e.value)
    native.free(p)
    with pytest.raises(rt.OpenRegError):
        native.free(p)  # double free
    native.free(0)  # NULL is a no-op
    native.empty_cache(0)


def test_memcpy_every_kind_sync_and_async(stream):
    n = 3 * MIB + 17
    data = os.urandom(n)
    src = ctypes.create_string_buffer(data, n)
    out = ctypes.create_string_buffer(n)
    d1, d2 = native.malloc(n, 0), native.malloc(n, 0)
    for copy in (native.memcpy, lambda *a: native.memcpy_async(*a, stream)):
        ctypes.memset(out, 0, n)
        copy(d1, ctypes.addressof(src), n, native.HOST_TO_DEVICE)
        copy(d2, d1, n, native.DEVICE_TO_DEVICE)
        copy(ctypes.addressof(out), d2, n, native.DEVICE_TO_HOST)
        native.stream_synchronize(stream)
        assert out.raw == data
        host = ctypes.create_string_buffer(n)
        copy(ctypes.addressof(host), ctypes.addressof(out), n, native.HOST_TO_HOST)
        native.stream_synchronize(stream)
        assert host.raw == data
    with pytest.raises(rt.OpenRegError, match="destination"):
        native.memcpy(ctypes.addressof(out), ctypes.addressof(src), n, native.HOST_TO_DEVICE)
    with pytest.raises(rt.OpenRegError, match="source"):
        overrun = d1 + 4 * MIB - n // 2
        native.memcpy(ctypes.addressof(out), overrun, n, native.DEVICE_TO_HOST)
    with pytest.raises(rt.OpenRegError, match="kind"):
        native.memcpy(d1, d2, 16, 9)
    native.free(d1)
    native.free(d2)
    native.empty_cache(0)


def test_memcpy_is_ordered_after_the_default_stream(gate):
    dev = native.malloc(8, 0)
    one, out = ctypes.c_uint64(1), ctypes.c_uint64(0)
    native.memcpy(dev, ctypes.addressof(ctypes.c_uint64(0)), 8, native.HOST_TO_DEVICE)
    gate.hold(None)
    native.memcpy_async(dev, ctypes.addressof(one), 8, native.HOST_TO_DEVICE, None)
    t = threading.Thread(
        target=native.memcpy, args=(ctypes.addressof(out), dev, 8, native.DEVICE_TO_HOST)
    )
    t.start()
    assert not native.stream_query(None)
    gate.open()
    t.join(TIMEOUT)
    assert not t.is_alive() and out.value == 1
    native.free(dev)


def test_streams_run_fifo_and_report_idle(stream, gate):
    dev = native.malloc(8, 0)
    values = [ctypes.c_uint64(i) for i in range(200)]
    gate.hold(stream)
    for v in values:  # all to the same address: only FIFO order leaves the last one
        native.memcpy_async(dev, ctypes.addressof(v), 8, native.HOST_TO_DEVICE, stream)
    assert not native.stream_query(stream)
    gate.open()
    native.stream_synchronize(stream)
    assert native.stream_query(stream)
    out = ctypes.c_uint64()
    native.memcpy(ctypes.addressof(out), dev, 8, native.DEVICE_TO_HOST)
    assert out.value == 199
    native.free(dev)


def test_stream_ids_and_lookup(stream):
    other = native.stream_create(0)
    assert native.stream_id(None) == 0 and native.stream_id(rt.stream_from_id(0, 0)) == 0
    assert 0 < native.stream_id(stream) < native.stream_id(other)
    assert rt.stream_from_id(0, native.stream_id(other)) == other
    native.stream_destroy(other)
    with pytest.raises(rt.OpenRegError) as e:
        rt.stream_from_id(0, native.stream_id(stream) + 1)
    assert e.value.code == native.INVALID_RESOURCE_HANDLE
    native.device_synchronize(0)


def test_events_query_synchronize_and_elapsed(stream, gate):
    start, end = rt.event_create(), rt.event_create()
    assert native.event_query(end)  # never recorded: done, as in CUDA
    with pytest.raises(rt.OpenRegError) as e:
        native.event_elapsed_ms(start, end)
    assert e.value.code == native.INVALID_VALUE
    rt.event_record(start, stream)
    gate.hold(stream)
    native.launch_sleep(stream, 20_000)
    rt.event_record(end, stream)
    assert not native.event_query(end)
    with pytest.raises(rt.OpenRegError) as e:
        native.event_elapsed_ms(start, end)
    assert e.value.code == native.NOT_READY
    gate.open()
    native.event_synchronize(end)
    assert native.event_query(end) and native.event_elapsed_ms(start, end) >= 19.0
    untimed = rt.event_create(timing=False)
    rt.event_record(untimed, stream)
    native.event_synchronize(untimed)
    with pytest.raises(rt.OpenRegError) as e:
        native.event_elapsed_ms(start, untimed)
    assert e.value.code == native.INVALID_VALUE
    with pytest.raises(rt.OpenRegError):
        rt.event_create(interprocess=True)  # needs timing=False, as in CUDA
    for ev in (start, end, untimed):
        rt.event_destroy(ev)


def test_a_synchronized_stream_has_its_events_done():
    # On one CPU the woken synchronizer used to run before the worker marked the event done.
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(previous)})  # this thread only; the new worker inherits it
    try:
        s = native.stream_create(0)
        try:
            for _ in range(2000):
                e = rt.event_create()
                rt.event_record(e, s)
                native.stream_synchronize(s)
                done = native.event_query(e)
                rt.event_destroy(e)
                assert done
        finally:
            native.stream_destroy(s)
    finally:
        os.sched_setaffinity(0, previous)


def test_stream_wait_event_orders_two_streams(stream, gate):
    consumer = native.stream_create(1)
    dev = native.malloc(8, 0)
    value, out = ctypes.c_uint64(42), ctypes.c_uint64(0)
    ev = rt.event_create()
    gate.hold(stream)
    native.memcpy_async(dev, ctypes.addressof(value), 8, native.HOST_TO_DEVICE, stream)
    rt.event_record(ev, stream)
    rt.stream_wait_event(consumer, ev)
    native.memcpy_async(ctypes.addressof(out), dev, 8, native.DEVICE_TO_HOST, consumer)
    rt.event_destroy(ev)  # safe while pending: the queued work keeps what it needs
    assert not native.stream_query(consumer)
    gate.open()
    native.stream_synchronize(consumer)
    assert out.value == 42
    native.stream_destroy(consumer)
    native.free(dev)


EXIT_WITH_PENDING_WORK = """
import json
import _native as native
from devipc_openreg import _runtime as rt
s = native.stream_create(0)
p = native.malloc(1 << 20, 0)
for stream in (s, None):
    for _ in range(50):
        native.launch_sleep(stream, 100_000)
ev = rt.event_create(interprocess=True, timing=False)
rt.event_record(ev, s)
print(json.dumps(native.stream_query(s)))
"""


def test_process_exits_cleanly_with_pending_work():
    # 10 s of queued work; exit must neither wait for it nor crash.
    assert json_from(start_isolated(EXIT_WITH_PENDING_WORK)) is False


USE_AFTER_FORK = """
import json, os
import _native as native
from devipc_openreg import _runtime as rt
native.free(native.malloc(4096, 0))
pid = os.fork()
if pid == 0:
    try:
        native.malloc(4096, 0)
        os._exit(1)
    except rt.OpenRegError as e:
        os._exit(0 if "forked" in str(e) else 2)
_, status = os.waitpid(pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), native.device_count(),
                  native.malloc(8, 0) > 0]))
"""


def test_forked_child_cannot_allocate():
    # Its allocator cache would alias the parent's memory and it has no stream workers.
    assert json_from(start_isolated(USE_AFTER_FORK)) == [0, 2, True]


def test_host_alloc_is_known_to_the_runtime_and_free_host_refuses_strangers():
    """orHostAlloc is pin_memory()'s memory: the runtime resolves it (interior pointers too)."""
    rt.declare(
        {
            "orHostAlloc": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t],
            "orFreeHost": [ctypes.c_void_p],
        }
    )
    p = ctypes.c_void_p()
    rt.check(rt.lib.orHostAlloc(ctypes.byref(p), 1000), "host_alloc")
    device, base, size, offset = native.pointer_attributes(p.value + 999)
    assert (device, base, size, offset) == (-1, p.value, 1000, 999)
    rt.check(rt.lib.orFreeHost(p), "free_host")
    assert native.pointer_attributes(p.value) is None
    with pytest.raises(rt.OpenRegError, match="not a live pointer returned by orHostAlloc"):
        rt.check(rt.lib.orFreeHost(p), "free_host")
    rt.check(rt.lib.orFreeHost(None), "free_host")  # NULL is a no-op
