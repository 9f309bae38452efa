"""Torch tensors and storages over memory devipc manages, and how devipc learns that one died,
from pure Python and without running Python when it dies.

Both are made from a DLPack capsule whose deleter we supply: a C function, never Python (a
storage may die while an exception unwinds the stack, and CPython cannot call Python code then).
It is libc's `pthread_spin_unlock`, applied to the first word of the DLPack struct, a word torch
no longer reads once it made the tensor: devipc puts a held spin lock there after. torch maps
DLPack's kDLExtDev to PrivateUse1 and kDLOneAPI to XPU. Two kinds, one collection point
(`reap_freed`):
- `tensor_from_memory`: a tensor over memory we mapped (what a consumer receives), made in one
  call into torch: no dispatch of `empty` and `set_`, which cost more than the rest of a receive
  on a process that just woke up. Its storage is not resizable and nothing swaps its DataPtr, so
  the DataPtr's death is the storage's. Structs are reused once their tensor died.
- `aliasing_storage`: the alias of an exported allocation (`_exports`), whose DataPtr the
  producer's storage takes over. What matters there is that DataPtr's death (the storage freed,
  resized or `set_` elsewhere); its struct lives as long as the mark `lives` reads.

`reap_freed()` runs the Python side of every storage that died, from devipc's own calls and its
collector thread.
"""

import ctypes
import itertools
import logging
import weakref
from collections.abc import Callable

import torch

from ._devices import name_of, type_of
from ._errors import UnsupportedDeviceError

_log = logging.getLogger("devipc")

_KDL_EXT_DEV = 12
_KDL_ONEAPI = 14


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", ctypes.c_void_p),  # a C function of one pointer: see the module's docstring
]
_libc = ctypes.CDLL(None)
_MARK_FREED = ctypes.cast(_libc.pthread_spin_unlock, ctypes.c_void_p).value
_malloc, _free = _libc.malloc, _libc.free
_malloc.restype, _malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_free.restype, _free.argtypes = None, [ctypes.c_void_p]


def _locked_word() -> int:
    """A held spin lock's bits (1 or 0, depending on the C library's architecture)."""
    word = ctypes.c_int64(0)
    _libc.pthread_spin_init(ctypes.byref(word), 0)
    _libc.pthread_spin_lock(ctypes.byref(word))
    return word.value


_LIVE = _locked_word()  # the struct's first word while its storage lives: a held lock

# Each struct is written as int64 words, its shape array right after it: a template per device
# filled in by ctypes once and copied into a new struct, then a few words per tensor (ctypes field
# access costs more than the rest of making a storage).
MAX_DIMS = 8  # dimensions a struct has room for
_STRUCT_WORDS = ctypes.sizeof(_DLManagedTensor) // 8
_Words = ctypes.c_int64 * (_STRUCT_WORDS + MAX_DIMS)
_SHAPE_WORD = _DLTensor.shape.offset // 8
_KIND_WORD = _DLTensor.ndim.offset // 8  # ndim (int32), then dtype (code, bits, lanes)
assert _DLTensor.dtype.offset == _DLTensor.ndim.offset + 4
_templates: dict[tuple[str, int], bytes] = {}  # (device type, index) -> the struct's bytes

# torch dtype -> its DLPack (code, bits) in the struct's kind word (one lane), ndim left out
DLPACK_DTYPES = {
    dtype: (code << 32) | (bits << 40) | (1 << 48)
    for dtype, (code, bits) in {
        torch.bool: (6, 8),
        torch.uint8: (1, 8),
        torch.uint16: (1, 16),
        torch.uint32: (1, 32),
        torch.uint64: (1, 64),
        torch.int8: (0, 8),
        torch.int16: (0, 16),
        torch.int32: (0, 32),
        torch.int64: (0, 64),
        torch.float16: (2, 16),
        torch.bfloat16: (4, 16),
        torch.float32: (2, 32),
        torch.float64: (2, 64),
        torch.complex32: (5, 32),
        torch.complex64: (5, 64),
        torch.complex128: (5, 128),
    }.items()
}
# Structs of received tensors that died (torch is done with them), by device. Never freed: a
# reap in another thread may still read one's first word (`reap_freed`); there are at most as
# many as the received tensors a process held at once.
_recycled: dict[tuple[str, int], list[tuple[int, ctypes.Array]]] = {}

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# A number never reused -> (the struct's address, its words, on_free, its device for reuse or
# None). Not keyed by address: a reused struct's address comes back, and a reap that took its
# list of storages before would take the new storage's entry for the old one's. No lock: a
# single dict store or pop is atomic under the GIL, and a lock here could be re-entered by
# `on_free`s that the garbage collector runs inside it.
_live: dict[int, tuple] = {}
_numbers = itertools.count()
_forgotten: list[tuple] = []  # in a forked child: its parent's entries, structs kept alive


def reap_freed(newest: int | None = None) -> int:
    """Run `on_free` of every storage that died since the last call; how many. Safe from any
    thread and re-entrant: each runs once.

    `newest`: look only at that many of the storages made last: a bounded look for the hot
    paths, whose cost must not grow with what a process holds (a consumer holding 10,000
    received weights would otherwise scan them at every open). The storage a loop drops is
    among the newest; the collector's rounds look at all of them."""
    while True:
        try:
            if newest is None:
                made = list(_live.items())
            else:
                made = list(itertools.islice(reversed(_live.items()), newest))
            break
        except RuntimeError:  # "changed size during iteration": building the list allocated,
            continue  # a collection ran finalizers, and another thread added a storage meanwhile
    freed = []
    for number, entry in made:  # a loop, not comprehensions: this runs at every open
        if entry[1][0] != _LIVE and _live.pop(number, None) is not None:
            freed.append(entry)
    for address, words, on_free, device in freed:
        if device is not None:
            _recycle(device, address, words)
        try:
            on_free()
        except Exception:  # noqa: BLE001 - every other storage must still be released
            _log.exception("devipc: releasing a storage's memory failed")
    return len(freed)


def forget_after_fork() -> None:
    """A forked child owns none of its parent's storages: their deaths there release nothing
    (the slots and mappings are the parent's). Their structs stay: the child's copies of the
    storages still point at them, and an alias's struct would be freed with its last reader."""
    _forgotten.extend(_live.values())
    _live.clear()


def watched() -> int:
    """Storages whose death devipc waits to see (received ones, and aliases of sent ones)."""
    return len(_live)


TensorOrStorage = torch.Tensor | torch.TypedStorage | torch.UntypedStorage


def untyped(tensor_or_storage: TensorOrStorage) -> torch.UntypedStorage:
    """The untyped storage of a tensor, a typed storage or an untyped storage."""
    if isinstance(tensor_or_storage, torch.Tensor):
        return tensor_or_storage.untyped_storage()
    if isinstance(tensor_or_storage, torch.TypedStorage):
        return tensor_or_storage._untyped_storage
    if isinstance(tensor_or_storage, torch.UntypedStorage):
        return tensor_or_storage
    raise TypeError(f"expected a tensor or a storage, got {type(tensor_or_storage).__name__}")


def storage_key(storage: torch.UntypedStorage) -> tuple:
    """(device, data_ptr, nbytes): how devipc's tables recognise a storage's memory. Storages
    are keyed by their bytes, not by object: two Python storages may wrap one allocation."""
    return (name_of(storage.device), storage.data_ptr(), storage.nbytes())


def _dlpack_device_type(device: torch.device) -> int:
    if device.type == torch._C._get_privateuse1_backend_name():
        return _KDL_EXT_DEV
    if device.type == "xpu":
        return _KDL_ONEAPI
    raise UnsupportedDeviceError(
        f"devipc cannot wrap memory of {device} into a storage: only PrivateUse1 and XPU "
        f"devices can be expressed through DLPack"
    )


def tensor_from_memory(
    ptr: int,
    nbytes: int,
    device: torch.device,
    on_free: Callable[[], None],
    dtype: torch.dtype = torch.uint8,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """A contiguous tensor of `dtype` (a key of DLPACK_DTYPES) and `shape` (at most MAX_DIMS
    dimensions, exactly `nbytes`; default: the bytes) at `ptr` on `device`, owning nothing. Its
    storage is not resizable; `on_free()` runs once it died, from the next `reap_freed()`, in
    whatever thread calls that, possibly inside the garbage collector: it must take no lock."""
    key = (type_of(device), device.index or 0)
    try:
        address, words = _recycled[key].pop()
    except (KeyError, IndexError):
        address, words = _new_struct(key)
    try:
        tensor = _dlpack_tensor(address, words, ptr, nbytes, dtype, shape)
    except BaseException:
        _recycle(key, address, words)  # torch is done with it, whether or not it took it
        raise
    _live[next(_numbers)] = (address, words, on_free, key)
    return tensor


def aliasing_storage(
    ptr: int,
    nbytes: int,
    device: torch.device,
    on_free: Callable[[], None],
) -> tuple[torch.UntypedStorage, ctypes.Array]:
    """A non-resizable storage of `nbytes` at `ptr` whose DataPtr, wherever it moves, runs
    `on_free()` once it died (from the next `reap_freed()`); and the mark that `lives` reads,
    whose struct is freed with it."""
    address, words = _new_struct((type_of(device), device.index or 0))
    weakref.finalize(words, _free, address).atexit = False
    tensor = _dlpack_tensor(address, words, ptr, nbytes)
    _live[next(_numbers)] = (address, words, on_free, None)
    return tensor.untyped_storage(), words


def _dlpack_tensor(
    address: int,
    words: ctypes.Array,
    ptr: int,
    nbytes: int,
    dtype: torch.dtype = torch.uint8,
    shape: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """`tensor_from_memory`'s tensor, through the struct at `address` (`_new_struct`)."""
    words[0] = ptr
    if shape is None:
        words[_KIND_WORD] = 1 | DLPACK_DTYPES[torch.uint8]
        words[_STRUCT_WORDS] = nbytes
    else:
        words[_KIND_WORD] = len(shape) | DLPACK_DTYPES[dtype]
        words[_STRUCT_WORDS : _STRUCT_WORDS + len(shape)] = list(shape)
    tensor = torch._C._from_dlpack(_new_capsule(address, b"dltensor", None))
    words[0] = _LIVE  # torch read the struct; from now on its first word says the storage lives
    return tensor


def _new_struct(device: tuple[str, int]) -> tuple[int, ctypes.Array]:
    """A struct for tensors on `device` (type, index), and its words: the device's template
    with the shape pointer set. Its memory is never freed while its tensor may live: not even
    at interpreter exit, when Python frees its objects in any order and torch may call the
    deleter later."""
    template = _templates.get(device) or _template(*device)
    address = _malloc(ctypes.sizeof(_Words))
    if not address:
        raise MemoryError("devipc: no memory for a DLPack struct")
    ctypes.memmove(address, template, len(template))
    words = _Words.from_address(address)
    words[_SHAPE_WORD] = address + 8 * _STRUCT_WORDS
    return address, words


def _recycle(device: tuple[str, int], address: int, words: ctypes.Array) -> None:
    """A struct whose tensor died, for the next tensor on that device: only the data pointer,
    kind and shape change."""
    _recycled.setdefault(device, []).append((address, words))


def _template(device_type: str, index: int) -> bytes:
    """The struct of a tensor on that device, but for its data pointer, kind and shape."""
    kind = _dlpack_device_type(torch.device(device_type, index))
    managed = _DLManagedTensor()
    managed.dl_tensor.device = _DLDevice(kind, index)
    managed.deleter = _MARK_FREED
    return _templates.setdefault(
        (device_type, index), ctypes.string_at(ctypes.addressof(managed), ctypes.sizeof(managed))
    )


def lives(mark: ctypes.Array) -> bool:
    """Whether the DataPtr of `aliasing_storage`'s `mark` lives, reaped or not: one load."""
    return mark[0] == _LIVE
