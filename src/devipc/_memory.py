"""Wrap memory we mapped into a torch storage that owns it, from pure Python.

A DLPack capsule whose deleter we supply becomes a storage whose DataPtr calls that deleter when
the storage dies, so the consumer learns exactly when to release a ref-counter slot and a mapping.
torch maps DLPack's kDLExtDev to PrivateUse1 and kDLOneAPI to XPU.
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


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _Deleter),
]

_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# address of a live _DLManagedTensor -> (the struct, its shape array, on_free). No lock: a single
# dict store or pop is atomic under the GIL, and a lock here could be re-entered by a deleter that
# the garbage collector runs inside it.
_live: dict[int, tuple] = {}


@_Deleter
def _on_storage_freed(managed):
    # Runs when the storage dies, possibly at interpreter shutdown: never raise from here.
    try:
        entry = _live.pop(ctypes.addressof(managed.contents), None)
        if entry is not None:
            entry[2]()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        try:
            _log.exception("devipc: releasing a received storage failed")
        except Exception:  # noqa: BLE001
            pass


def untyped(tensor_or_storage) -> torch.UntypedStorage:
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
    """A non-resizable storage of `nbytes` at `ptr` on `device`; `on_free()` runs when it dies,
    in whatever thread drops it, possibly inside the garbage collector: it must take no lock."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor.data = ptr
    managed.dl_tensor.device = _DLDevice(_dlpack_device_type(device), device.index or 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    managed.dl_tensor.shape = shape
    managed.deleter = _on_storage_freed
    address = ctypes.addressof(managed)
    _live[address] = (managed, shape, on_free)
    try:
        capsule = _new_capsule(address, b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule).untyped_storage()
    except BaseException:
        _live.pop(address, None)
        raise
