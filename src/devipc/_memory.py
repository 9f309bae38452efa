"""Torch storages over memory devipc manages, and how devipc learns that one died, from pure
Python and without running Python when it dies.

Two kinds, one collection point (`reap_freed`):
- `storage_from_memory`: a storage over memory we mapped (what a consumer receives). It is
  watched through a weak reference to its StorageImpl: it died when the reference expired. Such a
  storage is not resizable and nothing swaps its DataPtr, so its StorageImpl's death is the
  memory's.
- `aliasing_storage`: the alias of an exported allocation (`_exports`), whose DataPtr the
  producer's storage takes over. What matters there is that DataPtr's death (the storage freed,
  resized or `set_` elsewhere), so it is a DLPack capsule whose deleter we supply: a C function,
  never Python (a storage may die while an exception unwinds the stack, and CPython cannot call
  Python code then). It is libc's `pthread_spin_unlock`, applied to the first word of the DLPack
  struct, a word torch no longer reads once it made the storage: devipc puts a held spin lock
  there after. torch maps DLPack's kDLExtDev to PrivateUse1 and kDLOneAPI to XPU.

`reap_freed()` runs the Python side of every storage that died, from devipc's own calls and its
collector thread.
"""
import ctypes
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._errors import UnsupportedDeviceError

_log = logging.getLogger("devipc")

_KDL_EXT_DEV = 12
_KDL_ONEAPI = 14
_KDL_UINT = 1


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

# Each storage's struct is written as int64 words, its one-element shape array right after it:
# a template per device filled in by ctypes once, then three words per storage (ctypes field
# access costs more than the rest of making a storage).
_STRUCT_WORDS = ctypes.sizeof(_DLManagedTensor) // 8
_Words = ctypes.c_int64 * (_STRUCT_WORDS + 1)
_SHAPE_WORD = _DLTensor.shape.offset // 8
_templates: dict[tuple[str, int], bytes] = {}  # (device type, index) -> words, shape zeroed

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# address of a live struct -> (its words, on_free); id of a weak reference -> (it, on_free). No
# lock: a single dict store or pop is atomic under the GIL, and a lock here could be re-entered by
# `on_free`s that the garbage collector runs inside it.
_live: dict[int, tuple] = {}
_referenced: dict[int, tuple] = {}


def reap_freed(newest: int | None = None) -> int:
    """Run `on_free` of every storage that died since the last call; how many. Safe from any
    thread and re-entrant: each runs once.

    `newest`: look only at that many of the storages made last, of each kind: a bounded look
    for the hot paths, whose cost must not grow with what a process holds (a consumer holding
    10,000 received weights would otherwise scan them at every open). The storage a loop drops
    is among the newest; the collector's rounds look at all of them."""
    if newest is None:
        aliases, received = list(_live.items()), list(_referenced.items())
    else:  # C iterators only: no other thread runs, the dicts cannot change meanwhile
        aliases = list(itertools.islice(reversed(_live.items()), newest))
        received = list(itertools.islice(reversed(_referenced.items()), newest))
    dead = [address for address, entry in aliases if entry[0][0] != _LIVE]
    freed = [entry for address in dead if (entry := _live.pop(address, None)) is not None]
    dead = [key for key, entry in received if entry[0].expired()]
    freed += [entry for key in dead if (entry := _referenced.pop(key, None)) is not None]
    for entry in freed:
        try:
            entry[1]()
        except Exception:  # noqa: BLE001 - every other storage must still be released
            _log.exception("devipc: releasing a storage's memory failed")
    return len(freed)


def watched() -> int:
    """Storages whose death devipc waits to see (received ones, and aliases of sent ones)."""
    return len(_live) + len(_referenced)


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
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


_checked: set[str] = set()  # device types `_dlpack_device_type` accepted


def _dlpack_device_type(device: torch.device) -> int:
    if device.type == torch._C._get_privateuse1_backend_name():
        return _KDL_EXT_DEV
    if device.type == "xpu":
        return _KDL_ONEAPI
    raise UnsupportedDeviceError(
        f"devipc cannot wrap memory of {device} into a storage: only PrivateUse1 and XPU "
        f"devices can be expressed through DLPack")


def storage_from_memory(ptr: int, nbytes: int, device: torch.device,
                        on_free: Callable[[], None]) -> torch.UntypedStorage:
    """A non-resizable storage of `nbytes` at `ptr` on `device`, owning nothing; `on_free()`
    runs once it died, from the next `reap_freed()`, in whatever thread calls that, possibly
    inside the garbage collector: it must take no lock."""
    if device.type not in _checked:
        _dlpack_device_type(device)  # what can be received can be exported: the same devices
        _checked.add(device.type)
    storage = cast(torch.UntypedStorage,
                   torch._C._construct_storage_from_data_pointer(ptr, device, nbytes))
    reference = StorageWeakRef(storage)
    _referenced[id(reference)] = (reference, on_free)
    return storage


def _template(device: torch.device) -> bytes:
    """The words of a storage on `device`, but for its data pointer, shape pointer and size."""
    kind = _dlpack_device_type(device)
    managed = _DLManagedTensor()
    managed.dl_tensor.device = _DLDevice(kind, device.index or 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.deleter = _MARK_FREED
    return _templates.setdefault((device.type, device.index or 0), ctypes.string_at(
        ctypes.addressof(managed), ctypes.sizeof(managed)) + bytes(8))


def lives(mark: ctypes.Array) -> bool:
    """Whether the DataPtr of `aliasing_storage`'s `mark` lives, reaped or not: one load."""
    return mark[0] == _LIVE


def aliasing_storage(ptr: int, nbytes: int, device: torch.device, on_free: Callable[[], None],
                     ) -> tuple[torch.UntypedStorage, ctypes.Array]:
    """A non-resizable storage of `nbytes` at `ptr` whose DataPtr, wherever it moves, runs
    `on_free()` once it died (from the next `reap_freed()`); and the mark that `lives` reads."""
    template = _templates.get((device.type, device.index or 0)) or _template(device)
    # malloc'ed and freed with `words`, which `_live` keeps until the deleter ran; never freed
    # once the interpreter exits (a finalizer does not run then), when Python frees its objects
    # in any order and torch may call the deleter later
    address = _malloc(len(template))
    if not address:
        raise MemoryError("devipc: no memory for a DLPack struct")
    ctypes.memmove(address, template, len(template))
    words = _Words.from_address(address)
    weakref.finalize(words, _free, address).atexit = False
    words[0] = ptr
    words[_SHAPE_WORD] = address + 8 * _STRUCT_WORDS
    words[_STRUCT_WORDS] = nbytes
    storage = torch._C._from_dlpack(_new_capsule(address, b"dltensor", None)).untyped_storage()
    # torch read the struct; from now on its first word says whether the DataPtr lives
    words[0] = _LIVE
    _live[address] = (words, on_free)
    return storage, words
