"""ctypes bindings of the torch-free openreg runtime (`libopenreg.so`, beside this file).

Pointers, streams and events are plain ints; IPC handles are `bytes` of IPC_HANDLE_SIZE. Every
failure raises: a bad handle InvalidHandleError, a vanished exporter PeerGoneError, anything else
OpenRegError, each with the runtime's message (which call, what to do).
"""
import ctypes
import os

from devipc import InvalidHandleError, PeerGoneError

IPC_HANDLE_SIZE = 64

SUCCESS, INVALID_VALUE, MEMORY_ALLOCATION, INVALID_DEVICE = 0, 1, 2, 3
INVALID_RESOURCE_HANDLE, NOT_READY, INVALID_HANDLE, PEER_GONE, OS_CALL = 4, 5, 6, 7, 8

HOST_TO_HOST, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 0, 1, 2, 3
EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 2, 4


class OpenRegError(RuntimeError):
    """An openreg runtime call failed; `code` is the orError_t value."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


class _MemStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "allocated", "peak_allocated", "reserved", "peak_reserved",
        "num_allocs", "num_frees", "num_segments")]


class _PointerAttributes(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("base", ctypes.c_void_p),
                ("size", ctypes.c_size_t), ("offset", ctypes.c_size_t)]


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


_P = ctypes.POINTER
_vp, _int, _size, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int64

lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libopenreg.so"))
for _name, _args in {
    "orGetDeviceCount": [_P(_int)],
    "orGetDevice": [_P(_int)],
    "orSetDevice": [_int],
    "orDeviceGetUuid": [_int, ctypes.c_char_p, _size],
    "orDeviceGetByUuid": [ctypes.c_char_p, _P(_int)],
    "orDeviceSynchronize": [],
    "orMalloc": [_P(_vp), _size],
    "orFree": [_vp],
    "orEmptyCache": [_int],
    "orMemGetStats": [_int, _P(_MemStats)],
    "orMemResetPeakStats": [_int],
    "orMemResetAccumulatedStats": [_int],
    "orPointerGetAttributes": [_P(_PointerAttributes), _vp],
    "orStreamCreate": [_P(_vp)],
    "orStreamDestroy": [_vp],
    "orStreamSynchronize": [_vp],
    "orStreamQuery": [_vp],
    "orStreamGetId": [_vp, _P(_i64)],
    "orStreamFromId": [_int, _i64, _P(_vp)],
    "orLaunchHostFunc": [_vp, _vp, _vp],
    "orMemcpy": [_vp, _vp, _size, _int],
    "orMemcpyAsync": [_vp, _vp, _size, _int, _vp],
    "orEventCreateWithFlags": [_P(_vp), ctypes.c_uint],
    "orEventDestroy": [_vp],
    "orEventRecord": [_vp, _vp],
    "orEventQuery": [_vp],
    "orEventSynchronize": [_vp],
    "orEventElapsedTime": [_P(ctypes.c_float), _vp, _vp],
    "orStreamWaitEvent": [_vp, _vp, ctypes.c_uint],
    "orIpcGetMemHandle": [_P(_Handle), _P(_size), _vp],
    "orIpcOpenMemHandle": [_P(_vp), _P(_size), _P(_int), _Handle],
    "orIpcCloseMemHandle": [_vp],
    "orIpcGetEventHandle": [_P(_Handle), _vp],
    "orIpcOpenEventHandle": [_P(_vp), _Handle],
}.items():
    _fn = getattr(lib, _name)
    _fn.argtypes = _args
    _fn.restype = _int
lib.orGetErrorString.argtypes = [_int]
lib.orGetErrorString.restype = ctypes.c_char_p
lib.orGetLastErrorMessage.argtypes = []
lib.orGetLastErrorMessage.restype = ctypes.c_char_p


def _check(err, what):
    if err == SUCCESS:
        return
    message = (f"{what}: {lib.orGetErrorString(err).decode()}: "
               f"{lib.orGetLastErrorMessage().decode(errors='replace')}")
    if err == INVALID_HANDLE:
        raise InvalidHandleError(message)
    if err == PEER_GONE:
        raise PeerGoneError(message)
    raise OpenRegError(message, err)


def _ready(err, what):
    """For queries: True when done, False when NOT_READY, raises otherwise."""
    if err == NOT_READY:
        return False
    _check(err, what)
    return True


def _handle(data):
    if not isinstance(data, (bytes, bytearray)) or len(data) != IPC_HANDLE_SIZE:
        size = len(data) if isinstance(data, (bytes, bytearray)) else type(data).__name__
        raise InvalidHandleError(f"an openreg IPC handle is {IPC_HANDLE_SIZE} bytes, got {size}")
    h = _Handle()
    ctypes.memmove(h.reserved, bytes(data), IPC_HANDLE_SIZE)
    return h


# ---- devices ----------------------------------------------------------------------------------
def device_count():
    n = _int()
    _check(lib.orGetDeviceCount(ctypes.byref(n)), "device_count")
    return n.value


def get_device():
    d = _int()
    _check(lib.orGetDevice(ctypes.byref(d)), "get_device")
    return d.value


def set_device(device):
    _check(lib.orSetDevice(device), f"set_device({device})")


def device_uuid(device):
    buf = ctypes.create_string_buffer(37)
    _check(lib.orDeviceGetUuid(device, buf, len(buf)), f"device_uuid({device})")
    return buf.value.decode()


def device_by_uuid(uuid):
    d = _int()
    _check(lib.orDeviceGetByUuid(uuid.encode(), ctypes.byref(d)), f"device_by_uuid({uuid!r})")
    return d.value


def device_synchronize(device):
    previous = get_device()
    set_device(device)
    try:
        _check(lib.orDeviceSynchronize(), f"device_synchronize({device})")
    finally:
        set_device(previous)


# ---- memory -----------------------------------------------------------------------------------
def malloc(size, device):
    """Allocates on `device` without changing this thread's current device."""
    previous = get_device()
    set_device(device)
    try:
        ptr = _vp()
        _check(lib.orMalloc(ctypes.byref(ptr), size), f"malloc({size}, device={device})")
    finally:
        set_device(previous)
    return ptr.value or 0


def free(ptr):
    _check(lib.orFree(ptr), f"free({ptr:#x})")


def empty_cache(device):
    _check(lib.orEmptyCache(device), f"empty_cache({device})")


def mem_stats(device):
    s = _MemStats()
    _check(lib.orMemGetStats(device, ctypes.byref(s)), f"mem_stats({device})")
    return {name: getattr(s, name) for name, _ in _MemStats._fields_}


def reset_peak_stats(device):
    _check(lib.orMemResetPeakStats(device), f"reset_peak_stats({device})")


def reset_accumulated_stats(device):
    _check(lib.orMemResetAccumulatedStats(device), f"reset_accumulated_stats({device})")


def pointer_attributes(ptr):
    """(device, base, size, offset) of openreg memory; None for any other pointer."""
    a = _PointerAttributes()
    _check(lib.orPointerGetAttributes(ctypes.byref(a), ptr), f"pointer_attributes({ptr:#x})")
    if a.type == 0:
        return None
    return a.device, a.base or 0, a.size, a.offset


def memcpy(dst, src, n, kind):
    _check(lib.orMemcpy(dst, src, n, kind), f"memcpy({n} bytes, kind {kind})")


def memcpy_async(dst, src, n, kind, stream):
    _check(lib.orMemcpyAsync(dst, src, n, kind, stream), f"memcpy_async({n} bytes, kind {kind})")


# ---- streams ----------------------------------------------------------------------------------
def stream_create(device):
    previous = get_device()
    set_device(device)
    try:
        s = _vp()
        _check(lib.orStreamCreate(ctypes.byref(s)), f"stream_create({device})")
    finally:
        set_device(previous)
    return s.value


def stream_destroy(stream):
    _check(lib.orStreamDestroy(stream), "stream_destroy")


def stream_synchronize(stream):
    _check(lib.orStreamSynchronize(stream), "stream_synchronize")


def stream_query(stream):
    return _ready(lib.orStreamQuery(stream), "stream_query")


def stream_id(stream):
    i = _i64()
    _check(lib.orStreamGetId(stream, ctypes.byref(i)), "stream_id")
    return i.value


def stream_from_id(device, stream_id):
    s = _vp()
    _check(lib.orStreamFromId(device, stream_id, ctypes.byref(s)),
           f"stream_from_id({device}, {stream_id})")
    return s.value


# ---- events -----------------------------------------------------------------------------------
def event_create(interprocess=False, timing=True):
    """An interprocess event needs timing=False, as in CUDA."""
    flags = (0 if timing else EVENT_DISABLE_TIMING) | (EVENT_INTERPROCESS if interprocess else 0)
    e = _vp()
    _check(lib.orEventCreateWithFlags(ctypes.byref(e), flags), "event_create")
    return e.value


def event_destroy(event):
    _check(lib.orEventDestroy(event), "event_destroy")


def event_record(event, stream):
    _check(lib.orEventRecord(event, stream), "event_record")


def event_query(event):
    return _ready(lib.orEventQuery(event), "event_query")


def event_synchronize(event):
    _check(lib.orEventSynchronize(event), "event_synchronize")


def event_elapsed_ms(start, end):
    ms = ctypes.c_float()
    _check(lib.orEventElapsedTime(ctypes.byref(ms), start, end), "event_elapsed_ms")
    return ms.value


def stream_wait_event(stream, event):
    _check(lib.orStreamWaitEvent(stream, event, 0), "stream_wait_event")


# ---- IPC --------------------------------------------------------------------------------------
def ipc_get_mem_handle(ptr):
    """(handle bytes naming ptr's whole segment, ptr's byte offset in it)."""
    h, offset = _Handle(), _size()
    _check(lib.orIpcGetMemHandle(ctypes.byref(h), ctypes.byref(offset), ptr),
           f"ipc_get_mem_handle({ptr:#x})")
    return bytes(h.reserved), offset.value


def ipc_open_mem_handle(handle):
    """(base, size, local device) of the mapped segment; close it with ipc_close_mem_handle."""
    h = _handle(handle)
    base, size, device = _vp(), _size(), _int()
    _check(lib.orIpcOpenMemHandle(ctypes.byref(base), ctypes.byref(size), ctypes.byref(device), h),
           "ipc_open_mem_handle")
    return base.value, size.value, device.value


def ipc_close_mem_handle(base):
    _check(lib.orIpcCloseMemHandle(base), f"ipc_close_mem_handle({base:#x})")


def ipc_get_event_handle(event):
    h = _Handle()
    _check(lib.orIpcGetEventHandle(ctypes.byref(h), event), "ipc_get_event_handle")
    return bytes(h.reserved)


def ipc_open_event_handle(handle):
    """An event to wait on, query or synchronize; release it with event_destroy."""
    h = _handle(handle)
    e = _vp()
    _check(lib.orIpcOpenEventHandle(ctypes.byref(e), h), "ipc_open_event_handle")
    return e.value
