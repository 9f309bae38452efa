"""Test support, not a test module: the parts of the openreg runtime's C API only tests call
(devices, memory, copies, streams, events, pointer attributes), plus the Gate that holds a stream.

It uses `_runtime`'s library handle and error check; what the package itself calls (IPC, events,
statistics, stream lookup) the tests take from `_runtime`. Constants mirror openreg.h, checked by
test_runtime.py.
"""

import contextlib
import ctypes
import os
import threading

from devipc_openreg._runtime import check, declare, lib, stream_from_id

# for a fresh interpreter (_support.start_python / json_of) whose code imports this module
PYTHONPATH = os.pathsep.join(
    filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")])
)

INVALID_VALUE, MEMORY_ALLOCATION, INVALID_DEVICE, INVALID_RESOURCE_HANDLE, NOT_READY = 1, 2, 3, 4, 5
HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 0, 1, 2, 3
MEMORY_TYPE_UNREGISTERED = 0


class PointerAttributes(ctypes.Structure):
    """orPointerAttributes, field by field."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("base", ctypes.c_void_p),
        ("size", ctypes.c_size_t),
        ("offset", ctypes.c_size_t),
    ]


_P, _vp, _int, _size = ctypes.POINTER, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
declare(
    {
        "orGetDeviceCount": [_P(_int)],
        "orGetDevice": [_P(_int)],
        "orSetDevice": [_int],
        "orDeviceGetUuid": [_int, ctypes.c_char_p, _size],
        "orDeviceGetByUuid": [ctypes.c_char_p, _P(_int)],
        "orDeviceSynchronize": [],
        "orMalloc": [_P(_vp), _size],
        "orFree": [_vp],
        "orEmptyCache": [_int],
        "orMemResetPeakStats": [_int],
        "orMemResetAccumulatedStats": [_int],
        "orPointerGetAttributes": [_P(PointerAttributes), _vp],
        "orStreamCreate": [_P(_vp)],
        "orStreamDestroy": [_vp],
        "orStreamSynchronize": [_vp],
        "orStreamQuery": [_vp],
        "orStreamGetId": [_vp, _P(ctypes.c_int64)],
        "orLaunchHostFunc": [_vp, _vp, _vp],
        "orMemcpy": [_vp, _vp, _size, _int],
        "orMemcpyAsync": [_vp, _vp, _size, _int, _vp],
        "orEventQuery": [_vp],
        "orEventSynchronize": [_vp],
        "orEventElapsedTime": [_P(ctypes.c_float), _vp, _vp],
    }
)

_libc = ctypes.CDLL(None, use_errno=True)
_SEM_WAIT = ctypes.cast(_libc.sem_wait, _vp).value
_USLEEP = ctypes.cast(_libc.usleep, _vp).value


def _ready(err, what):
    """For queries: True when done, False when NOT_READY, raises otherwise."""
    if err == NOT_READY:
        return False
    check(err, what)
    return True


def _on(device, call):
    """Runs `call` with `device` current, leaving this thread's current device as it was."""
    previous = get_device()
    set_device(device)
    try:
        return call()
    finally:
        set_device(previous)


# ---- devices ----------------------------------------------------------------------------------
def device_count():
    n = _int()
    check(lib.orGetDeviceCount(ctypes.byref(n)), "device_count")
    return n.value


def get_device():
    d = _int()
    check(lib.orGetDevice(ctypes.byref(d)), "get_device")
    return d.value


def set_device(device):
    check(lib.orSetDevice(device), f"set_device({device})")


def device_uuid(device):
    buf = ctypes.create_string_buffer(37)
    check(lib.orDeviceGetUuid(device, buf, len(buf)), f"device_uuid({device})")
    return buf.value.decode()


def device_by_uuid(uuid):
    d = _int()
    check(lib.orDeviceGetByUuid(uuid.encode(), ctypes.byref(d)), f"device_by_uuid({uuid!r})")
    return d.value


def device_synchronize(device):
    _on(device, lambda: check(lib.orDeviceSynchronize(), f"device_synchronize({device})"))


# ---- memory -----------------------------------------------------------------------------------
def malloc(size, device):
    """Allocates on `device` without changing this thread's current device."""
    ptr = _vp()
    _on(
        device,
        lambda: check(lib.orMalloc(ctypes.byref(ptr), size), f"malloc({size}, device={device})"),
    )
    return ptr.value or 0


def free(ptr):
    check(lib.orFree(ptr), f"free({ptr:#x})")


def empty_cache(device):
    check(lib.orEmptyCache(device), f"empty_cache({device})")


def reset_peak_stats(device):
    check(lib.orMemResetPeakStats(device), f"reset_peak_stats({device})")


def reset_accumulated_stats(device):
    check(lib.orMemResetAccumulatedStats(device), f"reset_accumulated_stats({device})")


def pointer_attributes(ptr):
    """(device, base, size, offset) of openreg memory; None for any other pointer."""
    a = PointerAttributes()
    check(lib.orPointerGetAttributes(ctypes.byref(a), ptr), f"pointer_attributes({ptr:#x})")
    if a.type == MEMORY_TYPE_UNREGISTERED:
        return None
    return a.device, a.base or 0, a.size, a.offset


def memcpy(dst, src, n, kind):
    check(lib.orMemcpy(dst, src, n, kind), f"memcpy({n} bytes, kind {kind})")


def memcpy_async(dst, src, n, kind, stream):
    check(lib.orMemcpyAsync(dst, src, n, kind, stream), f"memcpy_async({n} bytes, kind {kind})")


# ---- streams and events -----------------------------------------------------------------------
def stream_create(device):
    s = _vp()
    _on(device, lambda: check(lib.orStreamCreate(ctypes.byref(s)), f"stream_create({device})"))
    return s.value


def stream_destroy(stream):
    check(lib.orStreamDestroy(stream), "stream_destroy")


def stream_synchronize(stream):
    check(lib.orStreamSynchronize(stream), "stream_synchronize")


def stream_query(stream):
    return _ready(lib.orStreamQuery(stream), "stream_query")


def stream_id(stream):
    i = ctypes.c_int64()
    check(lib.orStreamGetId(stream, ctypes.byref(i)), "stream_id")
    return i.value


def launch_sleep(stream, microseconds):
    """Queues a host function on `stream` that sleeps, as a stand-in for a kernel."""
    check(lib.orLaunchHostFunc(stream, _USLEEP, microseconds), "launch_sleep")


def event_query(event):
    return _ready(lib.orEventQuery(event), "event_query")


def event_synchronize(event):
    check(lib.orEventSynchronize(event), "event_synchronize")


def event_elapsed_ms(start, end):
    ms = ctypes.c_float()
    check(lib.orEventElapsedTime(ctypes.byref(ms), start, end), "event_elapsed_ms")
    return ms.value


_GATE_BUFFERS: list = []


class Gate:
    """A POSIX semaphore that holds streams back deterministically, never with sleeps: a stream
    running `hold(stream)` stops there until someone calls `open()`.

    Without `addr` it lives in a buffer of its own, never freed: a stream worker woken by
    `open()` may still be inside `sem_wait`, writing the semaphore's words, after `sem_post`
    returned (POSIX: a semaphore may be destroyed only once no thread waits on it). Freed with
    the Gate, that write landed in whatever malloc put there next: a rare segfault of the test
    process, one or two tests later. At `addr` (32 bytes) in openreg memory and `shared`, another
    process that mapped that memory can open it with `Gate.at(addr).open()`.
    """

    def __init__(self, addr=None, shared=False):
        if addr is None:
            buffer = ctypes.create_string_buffer(64)
            _GATE_BUFFERS.append(buffer)  # 64 bytes a gate, for the life of the process
            addr = ctypes.addressof(buffer)
        self.addr = addr
        assert _libc.sem_init(ctypes.c_void_p(addr), int(shared), 0) == 0

    @classmethod
    def at(cls, addr):
        """A Gate created elsewhere (another process), not initialized again."""
        gate = cls.__new__(cls)
        gate.addr = addr
        return gate

    def hold(self, stream):
        check(lib.orLaunchHostFunc(stream, _SEM_WAIT, self.addr), "Gate.hold")

    def hold_torch_stream(self, stream):
        """`hold` for an openreg `torch.Stream` (the runtime stream behind its id)."""
        self.hold(stream_from_id(stream.device_index, stream.stream_id))

    def open(self):
        assert _libc.sem_post(ctypes.c_void_p(self.addr)) == 0


@contextlib.contextmanager
def held_stream(stream, timeout):
    """An openreg `torch.Stream` held back by a Gate until the block ends; a timer opens the gate
    after `timeout` seconds, so a failing test cannot hang the stream."""
    gate = Gate()
    safety = threading.Timer(timeout, gate.open)
    safety.start()
    try:
        gate.hold_torch_stream(stream)
        yield gate
    finally:
        gate.open()
        safety.cancel()
