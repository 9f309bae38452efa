"""The one way from this package's Python to native code: the runtime (`libopenreg.so`, beside
this file) through ctypes, and the glue (`_C`) through its ops, `torch.ops.devipc_openreg`.

Only what the package uses is declared here; the tests declare the rest of the C API themselves
(tests/openreg/_native.py). Pointers, streams and events are plain ints; IPC handles are `bytes`
of IPC_HANDLE_SIZE. A failing runtime call raises: a bad handle InvalidHandleError, a vanished
exporter PeerGoneError, anything else OpenRegError, each with the runtime's message. Handles may
also come as bytearray or memoryview; anything else given as a handle is an InvalidHandleError.
"""

import ctypes
import importlib.util
import os

import torch

# devipc binds these names before it imports torch (see _ipc_hooks).
from devipc import InvalidHandleError, PeerGoneError

# Values from openreg.h; tests/openreg/test_runtime.py checks them against the header.
IPC_HANDLE_SIZE = 64
SUCCESS, INVALID_DEVICE, INVALID_HANDLE, PEER_GONE = 0, 3, 6, 7
INITIALIZATION, INVALID_ENVIRONMENT = 9, 10
RUNTIME_UNUSED, RUNTIME_INITIALIZED, RUNTIME_FORKED_AFTER_USE = 0, 1, 2
EVENT_DISABLE_TIMING, EVENT_INTERPROCESS = 2, 4

_NOT_BUILT = "is not built; run `make setup` in the devipc checkout, or `pip install ./openreg`"


class OpenRegError(RuntimeError):
    """An openreg runtime call failed; `code` is the orError_t value."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class MemStats(ctypes.Structure):
    """orMemStats, field by field."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "allocated",
            "peak_allocated",
            "reserved",
            "peak_reserved",
            "num_allocs",
            "num_frees",
            "num_segments",
        )
    ]


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_SIZE)]


try:
    lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(__file__)), "libopenreg.so"))
except OSError as e:
    raise ImportError(f"devipc_openreg's runtime libopenreg.so {_NOT_BUILT} ({e})") from e


def declare(signatures: dict[str, list[type]]) -> None:
    """Gives functions of `lib` their argument types ({name: [ctypes type]}); each returns an
    orError_t."""
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int


_P, _vp, _int, _size = ctypes.POINTER, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
declare(
    {
        "orDeviceGetUuid": [_int, ctypes.c_char_p, _size],
        "orGetRuntimeState": [_P(_int)],
        "orMemGetInfo": [_int, _P(_size), _P(_size)],
        "orMemGetStats": [_int, _P(MemStats)],
        "orStreamFromId": [_int, ctypes.c_int64, _P(_vp)],
        "orEventCreateWithFlags": [_P(_vp), ctypes.c_uint],
        "orEventDestroy": [_vp],
        "orEventRecord": [_vp, _vp],
        "orStreamWaitEvent": [_vp, _vp, ctypes.c_uint],
        "orIpcGetMemHandle": [_P(_Handle), _P(_size), _vp],
        "orIpcOpenMemHandle": [_P(_vp), _P(_size), _P(_int), _Handle],
        "orIpcCloseMemHandle": [_vp],
        "orIpcGetEventHandle": [_P(_Handle), _vp],
        "orIpcOpenEventHandle": [_P(_vp), _Handle],
        "orMemcpyBatchAsync": [_vp, _vp, _vp, _size, _vp],
    }
)
lib.orGetErrorString.argtypes = [_int]
lib.orGetErrorString.restype = ctypes.c_char_p
lib.orGetLastErrorMessage.argtypes = []
lib.orGetLastErrorMessage.restype = ctypes.c_char_p


def check(err: int, what: str) -> None:
    """Raises for a failed runtime call, naming `what` and the runtime's own message."""
    if err == SUCCESS:
        return
    message = (
        f"{what}: {lib.orGetErrorString(err).decode()}: "
        f"{lib.orGetLastErrorMessage().decode(errors='replace')}"
    )
    if err == INVALID_HANDLE:
        raise InvalidHandleError(message)
    if err == PEER_GONE:
        raise PeerGoneError(message)
    raise OpenRegError(message, err)


def _handle(data: object) -> _Handle:
    """The _Handle of `data`: bytes, bytearray or memoryview of IPC_HANDLE_SIZE bytes. Anything
    else is an invalid handle, never a TypeError: handles arrive from other processes."""
    if isinstance(data, memoryview):
        try:
            data = data.tobytes()  # any format or layout, as its bytes in order
        except ValueError:  # released
            raise InvalidHandleError(
                "an openreg IPC handle cannot be a released memoryview"
            ) from None
    if not isinstance(data, (bytes, bytearray)) or len(data) != IPC_HANDLE_SIZE:
        got = f"{len(data)} bytes" if isinstance(data, (bytes, bytearray)) else type(data).__name__
        raise InvalidHandleError(f"an openreg IPC handle is {IPC_HANDLE_SIZE} bytes, got {got}")
    h = _Handle()
    ctypes.memmove(h.reserved, bytes(data), IPC_HANDLE_SIZE)
    return h


# ---- the glue: loaded once, then its ops -------------------------------------------------------
GLUE = __package__ + "._C"
_REBUILD = (
    "rebuild it against this torch: `make setup` in the devipc checkout, or `pip install "
    "--no-build-isolation --force-reinstall --no-deps devipc-openreg`"
)


def release(version: str) -> str:
    """'2.15.0' of '2.15.0+cu128': builds of one release share its C++ ABI."""
    return version.split("+")[0]


def check_glue_torch(built_with: str, running: str) -> None:
    """Refuses, in one line, a glue compiled against another torch release than the running one:
    loading it would end in an undefined symbol, or worse. The ImportError names the glue, which
    is how torch's autoload (_devipc_openreg_autoload) tells it from other failures."""
    if release(built_with) != release(running):
        raise ImportError(
            f"devipc_openreg was built against torch {built_with} but this is torch "
            f"{running}; {_REBUILD}",
            name=GLUE,
        )


def load_glue() -> None:
    """Loads `_C`, whose static registrations make openreg a PrivateUse1 backend."""
    spec = importlib.util.find_spec(GLUE)
    if spec is None or spec.origin is None:
        raise ImportError(f"devipc_openreg._C {_NOT_BUILT}", name=GLUE)
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "torch-version.txt")) as f:
            built_with = f.read().strip()
    except OSError:
        raise ImportError(
            f"devipc_openreg._C does not say which torch it was built against (an "
            f"older build); {_REBUILD}",
            name=GLUE,
        ) from None
    check_glue_torch(built_with, torch.__version__)
    torch.ops.load_library(spec.origin)


_ops = torch.ops.devipc_openreg  # looked up at each call, so usable once load_glue ran


def device_count() -> int:
    return _ops.device_count()


def current_device() -> int:
    return _ops.current_device()


def set_device(device: int) -> None:
    _ops.set_device(device)


def synchronize(device: int) -> None:
    """Waits for the work of every stream of `device`."""
    _ops.synchronize(device)


def current_stream_id(device: int) -> int:
    """The id of this thread's current torch stream on `device` (0: the default stream)."""
    return _ops.current_stream_id(device)


def manual_seed(device: int, seed: int) -> None:
    """Seeds the default generator of `device`; `seed` is an int64."""
    _ops.manual_seed(device, seed)


def initial_seed(device: int) -> int:
    return _ops.initial_seed(device)


def get_rng_state(device: int) -> torch.Tensor:
    """The state of `device`'s default generator: a CPU uint8 tensor."""
    return _ops.get_rng_state(device)


def set_rng_state(device: int, state: torch.Tensor) -> None:
    _ops.set_rng_state(device, state)


def seed(device: int) -> int:
    """Reseeds `device`'s default generator non-deterministically; returns the seed as int64."""
    return _ops.seed(device)


def reset_peak_memory_stats(device: int) -> None:
    _ops.reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device: int) -> None:
    _ops.reset_accumulated_memory_stats(device)


def empty_cache() -> None:
    """Synchronizes every device, then returns its unused segments to the system."""
    _ops.empty_cache()


# ---- the runtime: statistics, streams, events, IPC ---------------------------------------------
def mem_stats(device: int) -> dict[str, int]:
    """The allocator's statistics of `device`, by orMemStats field name."""
    s = MemStats()
    check(lib.orMemGetStats(device, ctypes.byref(s)), f"mem_stats({device})")
    return {name: getattr(s, name) for name, _ in MemStats._fields_}  # type: ignore[misc]


def mem_get_info(device: int) -> tuple[int, int]:
    """(free, total) bytes of the host memory that `device` allocates from."""
    free, total = _size(), _size()
    check(
        lib.orMemGetInfo(device, ctypes.byref(free), ctypes.byref(total)), f"mem_get_info({device})"
    )
    return free.value, total.value


def runtime_state() -> int:
    """RUNTIME_UNUSED, RUNTIME_INITIALIZED or RUNTIME_FORKED_AFTER_USE (refused, like CUDA)."""
    state = _int()
    check(lib.orGetRuntimeState(ctypes.byref(state)), "runtime_state")
    return state.value


def stream_from_id(device: int, stream_id: int) -> int:
    """The runtime stream behind a torch stream id (0: the default stream)."""
    s = _vp()
    check(
        lib.orStreamFromId(device, stream_id, ctypes.byref(s)),
        f"stream_from_id({device}, {stream_id})",
    )
    return s.value  # type: ignore[return-value]


def event_create(interprocess: bool = False, timing: bool = True) -> int:
    """An interprocess event needs timing=False, as in CUDA."""
    flags = (0 if timing else EVENT_DISABLE_TIMING) | (EVENT_INTERPROCESS if interprocess else 0)
    e = _vp()
    check(lib.orEventCreateWithFlags(ctypes.byref(e), flags), "event_create")
    return e.value  # type: ignore[return-value]


def event_destroy(event: int) -> None:
    check(lib.orEventDestroy(event), "event_destroy")


def event_record(event: int, stream: int) -> None:
    check(lib.orEventRecord(event, stream), "event_record")


def stream_wait_event(stream: int, event: int) -> None:
    check(lib.orStreamWaitEvent(stream, event, 0), "stream_wait_event")


def device_uuid(device: int) -> str:
    """The stable identity of (visible) `device`, the same in every process."""
    buf = ctypes.create_string_buffer(37)
    check(lib.orDeviceGetUuid(device, buf, len(buf)), f"device_uuid({device})")
    return buf.value.decode()


def ipc_get_mem_handle(ptr: int) -> tuple[bytes, int]:
    """(handle bytes naming ptr's whole segment, ptr's byte offset in it)."""
    h, offset = _Handle(), _size()
    check(
        lib.orIpcGetMemHandle(ctypes.byref(h), ctypes.byref(offset), ptr),
        f"ipc_get_mem_handle({ptr:#x})",
    )
    return bytes(h.reserved), offset.value


def ipc_open_mem_handle(handle: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(base, size, local device) of the mapped segment; close it with ipc_close_mem_handle."""
    h = _handle(handle)
    base, size, device = _vp(), _size(), _int()
    check(
        lib.orIpcOpenMemHandle(ctypes.byref(base), ctypes.byref(size), ctypes.byref(device), h),
        "ipc_open_mem_handle",
    )
    return base.value, size.value, device.value  # type: ignore[return-value]


def memcpy_batch_async(table: torch.Tensor, stream: int) -> None:
    """Queue the copies of `table`, an int64 CPU tensor of shape (N, 3) whose rows are
    (destination, source, bytes), as one operation of runtime `stream`."""
    columns = table.t().contiguous()  # three arrays, one per column: one small copy
    count = columns.shape[1]
    base, row = columns.data_ptr(), 8 * count
    check(
        lib.orMemcpyBatchAsync(base, base + row, base + 2 * row, count, stream),
        f"memcpy_batch_async({count} copies)",
    )


def make_resizable(storage: torch.UntypedStorage) -> None:
    """Give a storage openreg's allocator back and make it resizable (devipc's hook)."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    view.set_(storage, 0, (0,))  # type: ignore[call-overload]
    _ops.make_resizable(view)


def ipc_close_mem_handle(base: int) -> None:
    check(lib.orIpcCloseMemHandle(base), f"ipc_close_mem_handle({base:#x})")


def ipc_get_event_handle(event: int) -> bytes:
    h = _Handle()
    check(lib.orIpcGetEventHandle(ctypes.byref(h), event), "ipc_get_event_handle")
    return bytes(h.reserved)


def ipc_open_event_handle(handle: bytes | bytearray | memoryview) -> int:
    """An event to wait on, query or synchronize; release it with event_destroy."""
    h = _handle(handle)
    e = _vp()
    check(lib.orIpcOpenEventHandle(ctypes.byref(e), h), "ipc_open_event_handle")
    return e.value  # type: ignore[return-value]


# ---- streams and events of torch.openreg (_streams) --------------------------------------------
declare(
    {
        "orEventQuery": [_vp],
        "orEventSynchronize": [_vp],
        "orEventElapsedTime": [_P(ctypes.c_float), _vp, _vp],
    }
)
NOT_READY = 5  # orErrorNotReady (checked against openreg.h with the constants above)


def exchange_stream(device: int, stream_id: int) -> int:
    """Makes torch stream `stream_id` this thread's current stream of `device`; returns the id of
    the one it replaces."""
    return _ops.exchange_stream(device, stream_id)


def event_query(event: int) -> bool:
    """True when the event's latest record has completed (or it was never recorded)."""
    err = lib.orEventQuery(event)
    if err == NOT_READY:
        return False
    check(err, "event_query")
    return True


def event_synchronize(event: int) -> None:
    check(lib.orEventSynchronize(event), "event_synchronize")


def event_elapsed_ms(start: int, end: int) -> float:
    ms = ctypes.c_float()
    check(lib.orEventElapsedTime(ctypes.byref(ms), start, end), "event_elapsed_time")
    return ms.value
