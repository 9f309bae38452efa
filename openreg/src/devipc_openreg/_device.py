"""`torch.openreg`: the device module of openreg, as `torch.cuda` is CUDA's, in a minimal form.

Everything goes through `_runtime` (the glue's ops and the runtime), never through
`torch.accelerator`, so these functions talk to openreg even where another accelerator is torch's
current one. Streams and events are torch's own `torch.Stream` / `torch.Event` with an openreg
device.
"""

import torch

from . import _runtime
from ._current import current_device, current_stream, set_device
from ._current import index_of as _index
from ._streams import Event, Stream, StreamContext, default_stream, set_stream, stream

__all__ = [
    "DeviceProperties",
    "Event",
    "Stream",
    "StreamContext",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "get_amp_supported_dtype",
    "get_device_name",
    "get_device_properties",
    "get_rng_state",
    "get_rng_state_all",
    "initial_seed",
    "ipc_collect",
    "is_available",
    "is_bf16_supported",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_rng_state",
    "set_rng_state_all",
    "set_stream",
    "stream",
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


def is_available() -> bool:
    return device_count() > 0


def device_count() -> int:
    """Raises if OPENREG_DEVICE_COUNT or OPENREG_VISIBLE_DEVICES makes no sense, echoing it."""
    return _runtime.device_count()


def _lazy_init() -> None:
    """The runtime initializes itself at first use; this only makes that use happen now (and
    raises, as CUDA does, in a child forked after its parent used openreg)."""
    current_device()


def is_initialized() -> bool:
    """True once this process used openreg (counting devices does not count)."""
    return _runtime.runtime_state() == _runtime.RUNTIME_INITIALIZED


def __getattr__(name: str) -> bool:
    # torch.utils.checkpoint reads `_initialized` to decide whether to stash the device's RNG state.
    if name == "_initialized":
        return is_initialized()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class device:
    """Context manager that makes `device` the current openreg device; None changes nothing."""

    def __init__(self, device: torch.device | str | int | None) -> None:
        self.index = None if device is None else _index(device)
        self.previous: int | None = None

    def __enter__(self) -> None:
        if self.index is not None:
            self.previous = current_device()
            set_device(self.index)

    def __exit__(self, *exc_info: object) -> None:
        if self.previous is not None:
            set_device(self.previous)


def synchronize(device: torch.device | str | int | None = None) -> None:
    """Waits for all work queued on every stream of `device`."""
    _runtime.synchronize(_index(device))


# ---- memory ----
def memory_stats(device: torch.device | str | int | None = None) -> dict[str, int]:
    """The allocator's statistics, with the keys torch.cuda.memory_stats uses for them."""
    stats = _runtime.mem_stats(_index(device))
    return {key: stats[field] for field, key in _STAT_KEYS.items()}


def memory_allocated(device: torch.device | str | int | None = None) -> int:
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: torch.device | str | int | None = None) -> int:
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: torch.device | str | int | None = None) -> int:
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: torch.device | str | int | None = None) -> int:
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: torch.device | str | int | None = None) -> None:
    _runtime.reset_peak_memory_stats(_index(device))


def reset_accumulated_memory_stats(device: torch.device | str | int | None = None) -> None:
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
    return _runtime.runtime_state() == _runtime.RUNTIME_FORKED_AFTER_USE


def manual_seed(seed: int) -> None:
    """Seeds the default generator of the current device."""
    _runtime.manual_seed(current_device(), _as_int64(seed))


def manual_seed_all(seed: int) -> None:
    """Seeds the default generators of all devices (torch.manual_seed calls this)."""
    for index in range(device_count()):
        _runtime.manual_seed(index, _as_int64(seed))


def initial_seed() -> int:
    return _runtime.initial_seed(current_device()) & _UINT64


def seed() -> None:
    """Reseeds the current device's default generator with a non-deterministic seed."""
    _runtime.seed(current_device())


def seed_all() -> None:
    """Reseeds every device's default generator with one non-deterministic seed."""
    value = _runtime.seed(0) if device_count() else 0
    for index in range(1, device_count()):
        _runtime.manual_seed(index, value)


# ---- RNG state: what torch.random.fork_rng and torch.utils.checkpoint save and restore ----
def get_rng_state(device: torch.device | str | int | None = "openreg") -> torch.Tensor:
    """The state of `device`'s default generator, a CPU uint8 tensor."""
    return _runtime.get_rng_state(_index(device))


def set_rng_state(
    new_state: torch.Tensor, device: torch.device | str | int | None = "openreg"
) -> None:
    _runtime.set_rng_state(_index(device), new_state.to("cpu", torch.uint8).contiguous())


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(index) for index in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        set_rng_state(state, index)


# ---- AMP: torch.autocast("openreg") asks which dtypes it may cast to ----
def get_amp_supported_dtype() -> list[torch.dtype]:
    """Kernels run on the CPU, which computes in both."""
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


# ---- device information, as torch.cuda gives it ----
class DeviceProperties:
    """What get_device_properties reports: openreg devices are host memory run by host threads."""

    def __init__(self, index: int):
        self.index = index
        self.name = get_device_name(index)
        self.uuid = _runtime.device_uuid(index)
        self.total_memory = mem_get_info(index)[1]

    def __repr__(self) -> str:
        return (
            f"DeviceProperties(name={self.name!r}, index={self.index}, uuid={self.uuid!r}, "
            f"total_memory={self.total_memory >> 20}MB)"
        )


def get_device_name(device: torch.device | str | int | None = None) -> str:
    _index(device)  # a bad device raises here as in torch.cuda
    return "openreg"


def get_device_properties(device: torch.device | str | int | None = None) -> DeviceProperties:
    index = _index(device)
    if not 0 <= index < device_count():
        raise ValueError(f"openreg device {index} does not exist ({device_count()} visible)")
    return DeviceProperties(index)


def mem_get_info(device: torch.device | str | int | None = None) -> tuple[int, int]:
    """(free, total) bytes of the host memory the device allocates from (shared by all devices)."""
    return _runtime.mem_get_info(_index(device))


def memory_summary(
    device: torch.device | str | int | None = None, abbreviated: bool = False
) -> str:
    """A readable table of memory_stats (`abbreviated` is accepted for torch.cuda's signature)."""
    index = _index(device)
    stats = memory_stats(index)
    free, total = mem_get_info(index)
    lines = [f"openreg:{index} memory summary", "-" * 44]
    lines += [f"{key:<32}{value:>12,}" for key, value in stats.items()]
    lines += [f"{'host memory free / total (MiB)':<32}{f'{free >> 20} / {total >> 20}':>12}"]
    return "\n".join(lines) + "\n"


def ipc_collect() -> int:
    """devipc's collection (torch.cuda.ipc_collect's role): frees memory sent to other processes
    that they released, or whose consumers died. Returns how many sends ended."""
    import devipc  # the core, not this package: it names no device

    return devipc.ipc_collect()
