"""Wrap memory we mapped into a torch storage that owns it, from pure Python.

A DLPack capsule whose deleter we supply becomes a storage whose DataPtr calls that deleter when
the storage dies, so devipc learns exactly when to release a ref-counter slot and a mapping.
torch maps DLPack's kDLExtDev to PrivateUse1 and kDLOneAPI to XPU.

The deleter is a C function, never Python: a storage may die while an exception unwinds the
stack, and CPython cannot call Python code then (a ctypes callback turns the user's exception
into a SystemError, or crashes). It is libc's `pthread_spin_unlock`, applied to the first word
of the DLPack struct, a word torch no longer reads once it made the storage: devipc puts a held
spin lock there after, and `reap_freed()` runs the Python side of every storage whose lock was
released, from devipc's own calls and its collector thread.
"""
import ctypes
import logging
from collections.abc import Callable

import torch

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


def _locked_word() -> int:
    """A held spin lock's bits (1 or 0, depending on the C library's architecture)."""
    word = ctypes.c_int64(0)
    _libc.pthread_spin_init(ctypes.byref(word), 0)
    _libc.pthread_spin_lock(ctypes.byref(word))
    return word.value


_LIVE = _locked_word()  # the struct's first word while its storage lives: a held lock

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# address of a live _DLManagedTensor -> (the struct, its shape array, on_free). No lock: a single
# dict store or pop is atomic under the GIL, and a lock here could be re-entered by `on_free`s
# that the garbage collector runs inside it.
_live: dict[int, tuple] = {}


def reap_freed() -> int:
    """Run `on_free` of every storage that died since the last call; how many. Safe from any
    thread and re-entrant: each runs once."""
    freed = 0
    for address, entry in list(_live.items()):
        if (entry[0].dl_tensor.data or 0) != _LIVE and _live.pop(address, None) is not None:
            freed += 1
            try:
                entry[2]()
            except Exception:  # noqa: BLE001 - every other storage must still be released
                _log.exception("devipc: releasing a storage's memory failed")
    return freed


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
    return (str(storage.device), storage.data_ptr(), storage.nbytes())


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
    """A non-resizable storage of `nbytes` at `ptr` on `device`; `on_free()` runs once it died,
    from the next `reap_freed()`, in whatever thread calls that, possibly inside the garbage
    collector: it must take no lock."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = _DLDevice(_dlpack_device_type(device), device.index or 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.deleter = _MARK_FREED
    address = ctypes.addressof(managed)
    capsule = _new_capsule(address, b"dltensor", None)
    storage = torch.utils.dlpack.from_dlpack(capsule).untyped_storage()
    # torch read the struct; from now on its first word says whether the storage lives
    managed.dl_tensor.data = _LIVE
    _live[address] = (managed, shape, on_free)
    return storage
