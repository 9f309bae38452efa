"""`torch.openreg`: the device module of openreg, as `torch.cuda` is CUDA's, in a minimal form.

Everything goes through `_runtime` (the glue's ops and the runtime), never through
`torch.accelerator`, so these functions talk to openreg even where another accelerator is torch's
current one. Streams and events are torch's own `torch.Stream` / `torch.Event` with an openreg
device.
"""
import torch

from . import _runtime

__all__ = [
    "current_device",
    "current_stream",
    "device",
    "device_count",
    "empty_cache",
    "initial_seed",
    "is_available",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_device",
    "synchronize",
]

_UINT64 = (1 << 64) - 1
_STAT_KEYS = {  # orMemStats field: its key in torch.cuda.memory_stats
    "allocated": "allocated_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "reserved": "reserved_bytes.all.current",
    "peak_reserved": "reserved_bytes.all.peak",
    "num_allocs": "allocation.all.allocated",
    "num_frees": "allocation.all.freed",
    "num_segments": "segment.all.current",
}
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
_initialized = False


def _index(device) -> int:
    """Index of an openreg device given as None (current), int, str or torch.device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "openreg":
        raise ValueError(f"expected an openreg device, got {device}")
    return current_device() if device.index is None else device.index


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    return _runtime.device_count()


def _lazy_init() -> None:
    """The runtime initializes itself at first use; this only makes that use happen now."""
    global _initialized
    device_count()
    _initialized = True


def is_initialized() -> bool:
    return _initialized


def current_device() -> int:
    return _runtime.current_device()


def set_device(device) -> None:
    _runtime.set_device(_index(device))


class device:
    """Context manager that makes `device` the current openreg device; None changes nothing."""

    def __init__(self, device):
        self.index = None if device is None else _index(device)
        self.previous = None

    def __enter__(self):
        if self.index is not None:
            self.previous = current_device()
            set_device(self.index)

    def __exit__(self, *exc_info):
        if self.previous is not None:
            set_device(self.previous)


def synchronize(device=None) -> None:
    """Waits for all work queued on every stream of `device`."""
    _runtime.synchronize(_index(device))


def current_stream(device=None) -> torch.Stream:
    """This thread's current stream of `device`."""
    index = _index(device)
    stream_id = _runtime.current_stream_id(index)
    return torch.Stream(stream_id=stream_id, device_index=index, device_type=_PRIVATEUSE1)


# ---- memory ----
def memory_stats(device=None) -> dict:
    """The allocator's statistics, with the keys torch.cuda.memory_stats uses for them."""
    stats = _runtime.mem_stats(_index(device))
    return {key: stats[field] for field, key in _STAT_KEYS.items()}


def memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device=None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device=None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device=None) -> None:
    _runtime.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device=None) -> None:
    _runtime.reset_accumulated_memory_stats(_index(device))


def empty_cache() -> None:
    """Returns the cached, unused memory of every device to the system."""
    _runtime.empty_cache()


# ---- random numbers: torch's seeds are uint64, the glue's ops take int64 ----
def _as_int64(seed: int) -> int:
    seed = int(seed) & _UINT64
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def _is_in_bad_fork() -> bool:
    """True in a child forked after its parent used openreg: the runtime refuses it, like CUDA."""
    try:
        current_device()
    except RuntimeError:
        return True
    return False


def manual_seed(seed: int) -> None:
    """Seeds the default generator of the current device."""
    _runtime.manual_seed(current_device(), _as_int64(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds the default generators of all devices (torch.manual_seed calls this)."""
    for index in range(device_count()):
        _runtime.manual_seed(index, _as_int64(seed))


def initial_seed() -> int:
    return _runtime.initial_seed(current_device()) & _UINT64

from ._streams import Event, Stream, StreamContext, default_stream, set_stream, stream  # noqa: E402

__all__ += ["Event", "Stream", "StreamContext", "default_stream", "set_stream", "stream"]
