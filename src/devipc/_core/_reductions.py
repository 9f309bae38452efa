"""Pickling glue: torch.multiprocessing's reducers, extended additively for devices with hooks.

`install()` swaps `reduce_tensor`/`reduce_storage` in torch.multiprocessing.reductions for versions
that send tensors of devices with IPC hooks through `rebuild_device_tensor` and hand everything
else (cuda, cpu, meta, devices without hooks) to torch's own functions, unchanged; then it lets
torch re-register its reducers with ForkingPickler. What a reducer returns is plain data (bytes,
ints, torch types): it survives `pickle` and a socket, no file descriptor is smuggled.
"""

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.multiprocessing.reductions as torch_reductions
from torch.multiprocessing.reductions import StorageWeakRef, shared_cache, storage_from_cache

from ._devices import name_of, type_of
from ._errors import DevIpcError, InvalidHandleError
from ._hooks import (
    device_supports_ipc,
    on_register,
    sharing_hooks,
    torch_shares,
    unsupported_device,
)
from ._memory import DLPACK_DTYPES, MAX_DIMS
from ._sharing import (
    check_grad,
    empty_storage,
    new_shared_device,
    open_shared,
    release_ipc_counter_device,
    requested_device,
    share_device,
    share_storage,
    unsendable,
    wait_for_producer,
)
from ._wire import is_wrapped, unwrap_storage_handle, wrap_storage_handle

_lock = threading.Lock()
_saved: dict[str, Any] = {}  # torch's own functions while installed (or _MISSING)


def _receive_storage(
    device: torch.device | str | int,
    handle: bytes | None,
    size_bytes: int,
    offset_bytes: int,
    ref_counter_handle: bytes | None,
    ref_counter_offset: int,
    event_handle: bytes,
    event_sync_required: bool,
    *,
    view: tuple[torch.dtype, tuple[int, ...]] | None = None,
) -> tuple[torch.UntypedStorage, torch.Tensor | None]:
    """The shared-cache lookup of rebuild_cuda_tensor, keyed by (the hooks' handle, offset in
    bytes), wrapped or not; plus the device asked for, when the caller overwrote args[6]. With
    `view` (`_whole`), a storage opened here comes with that tensor over it, else with None."""
    handle, origin, target = requested_device(device, handle)
    if not handle and size_bytes == 0 and type(size_bytes) is int and ref_counter_handle is None:
        return empty_storage(target or origin), None  # empty: travels without a send
    if (
        not isinstance(handle, bytes)
        or not handle
        or type(size_bytes) is not int
        or size_bytes <= 0
    ):
        # a forged empty storage would leave its slot unreleased; a bytearray is unhashable
        raise InvalidHandleError(
            f"malformed shared storage: handle {type(handle).__name__}, size {size_bytes!r}"
        )
    key = (handle, offset_bytes) if target is None else (handle, offset_bytes, name_of(target))
    storage = storage_from_cache(torch.UntypedStorage, key)
    if storage is None:
        tensor = open_shared(
            origin,
            handle,
            size_bytes,
            offset_bytes,
            ref_counter_handle,
            ref_counter_offset,
            event_handle,
            event_sync_required,
            target,
            view,
        )
        storage = tensor.untyped_storage()
        shared_cache[key] = StorageWeakRef(storage)
        return storage, tensor if view is not None else None
    # Already mapped here: the producer only needs this send's slot back. Unlike CUDA, still
    # honour this send's event: the producer may have written since the first send.
    release_ipc_counter_device(ref_counter_handle, ref_counter_offset, device)
    if event_sync_required:
        wait_for_producer(storage.device, event_handle)
    return storage, None


def rebuild_device_tensor(
    tensor_cls: type[torch.Tensor],
    tensor_size: tuple[int, ...],
    tensor_stride: tuple[int, ...],
    tensor_offset: int,
    storage_cls: type[torch.UntypedStorage],
    dtype: torch.dtype,
    storage_device: torch.device | str | int,
    storage_handle: bytes,
    storage_size_bytes: int,
    storage_offset_bytes: int,
    requires_grad: bool,
    ref_counter_handle: bytes | None,
    ref_counter_offset: int,
    event_handle: bytes,
    event_sync_required: bool,
) -> torch.Tensor:
    """Same 15 positional arguments as torch's rebuild_cuda_tensor. The device at index 6, left
    as the producer wrote it, means the local device that owns the memory (found by identity);
    overwritten (an index, as for CUDA), it means that device, where the hooks can map it."""
    check_grad(dtype, requires_grad)  # before the send is taken: the genuine bytes still open
    storage, tensor = _receive_storage(
        storage_device,
        storage_handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
        view=_whole(dtype, tensor_size, tensor_stride, tensor_offset, storage_size_bytes),
    )
    if tensor is None:
        _check_view(storage, dtype, tensor_offset, tensor_size, tensor_stride)
        tensor = torch.empty((0,), dtype=dtype, device=storage.device).set_(
            storage, tensor_offset, tensor_size, tensor_stride
        )
    if tensor_cls == torch.nn.parameter.Parameter:
        # Integer parameters need requires_grad=False at construction.
        return torch.nn.parameter.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad = requires_grad
    return tensor


def _whole(
    dtype: torch.dtype, size: object, stride: object, offset: object, nbytes: object
) -> tuple[torch.dtype, tuple[int, ...]] | None:
    """(dtype, size) when the view is its whole storage, contiguous, of a dtype DLPack carries:
    the open then makes the tensor itself (`tensor_from_memory`); None for any other view, or
    anything malformed (the general path checks it)."""
    if (
        offset != 0
        or type(size) is not tuple
        or type(stride) is not tuple
        or dtype not in DLPACK_DTYPES
        or not 0 < len(size) <= MAX_DIMS
        or len(stride) != len(size)
    ):
        return None
    expected = 1
    for n, step in zip(reversed(size), reversed(stride)):
        if type(n) is not int or n <= 0 or step != expected:
            return None
        expected *= n
    return (dtype, size) if expected * dtype.itemsize == nbytes else None


def _check_view(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> None:
    """A view must fit its storage: torch would try to grow the storage, which shared memory
    refuses with a RuntimeError that says nothing about a bad handle."""
    if len(size) == 1 and len(stride) == 1:  # the common case, without generators
        (n,), (step,) = size, stride
        if n == 0:
            return
        last, lowest = offset + (n - 1) * step, step
    else:
        if 0 in size:
            return
        last = offset + sum((n - 1) * step for n, step in zip(size, stride))
        lowest = min(stride, default=0)
    if offset < 0 or lowest < 0 or (last + 1) * dtype.itemsize > storage.nbytes():
        raise InvalidHandleError(
            f"a {dtype} view of size {tuple(size)}, stride {tuple(stride)} "
            f"at offset {offset} does not fit a storage of "
            f"{storage.nbytes()} bytes"
        )


def rebuild_device_storage(
    storage_cls: type[torch.UntypedStorage], *shared: Any
) -> torch.UntypedStorage:
    """Rebuilds an UntypedStorage sent on its own; `shared` is share_device's 8-tuple."""
    return _receive_storage(*shared)[0]


def reduce_tensor(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    device = tensor.device
    hooks = sharing_hooks(type_of(device))
    if hooks is None:
        return _saved["reduce_tensor"](tensor)
    if tensor.layout != torch.strided or tensor.is_nested:
        # torch's path sends the components of the kinds it can (through devipc); for the
        # others it ends in a dispatcher error of an internal backend: say what to do instead
        try:
            return _saved["reduce_tensor"](tensor)
        except (NotImplementedError, RuntimeError) as error:
            if isinstance(error, DevIpcError):
                raise
            raise unsendable(tensor, "pickling a tensor") from None
    if tensor.requires_grad and not tensor.is_leaf:
        # torch's own words: tests and users match them
        raise RuntimeError(
            "Cowardly refusing to serialize non-leaf tensor which requires_grad, "
            "since autograd does not support crossing process boundaries.  "
            "If you just want to transfer the data, call detach() on the tensor "
            "before serializing (e.g., putting it on the queue)."
        )
    torch.utils.hooks.warn_if_has_hooks(tensor)
    storage = tensor.untyped_storage()
    shared = share_storage(storage, device, hooks)
    # The sizes as a plain tuple, as the strides are: a torch.Size pickles as a global and a call.
    # args[7] carries the device written into args[6]: an overwritten args[6] shows.
    args = SentArgs(
        type(tensor),
        tuple(tensor.size()),
        tensor.stride(),
        tensor.storage_offset(),
        type(storage),
        tensor.dtype,
        shared.device,
        wrap_storage_handle(shared.device, shared.handle or b""),
        shared.size_bytes,
        shared.offset_bytes,
        tensor.requires_grad,
        shared.ref_counter_handle,
        shared.ref_counter_offset,
        shared.event_handle,
        shared.event_sync_required,
    )
    if (
        args.tensor_cls in _CLASS_NAMES
        and args.dtype in _DTYPE_NAMES
        and args.storage_cls is torch.UntypedStorage
    ):
        return rebuild_device_tensor, args
    return rebuild_device_tensor, tuple(args)  # pickled in full


class SentArgs(NamedTuple):
    """reduce_tensor's 15 arguments (rebuild_device_tensor's, by name), a tuple as torch's, that
    pickle without the tensor and storage classes, the dtype and the device: those are globals,
    an import lookup each on both sides, most of what pickling a send costs. The classes and the
    dtype travel by name, the device in the wrapped handle (args[7]) already. A copy made to
    overwrite args[6] is a plain tuple or list, pickled in full."""

    tensor_cls: type[torch.Tensor]
    tensor_size: tuple[int, ...]
    tensor_stride: tuple[int, ...]
    tensor_offset: int | torch.SymInt  # as `Tensor.storage_offset` types it
    storage_cls: type[torch.UntypedStorage]
    dtype: torch.dtype
    storage_device: torch.device
    storage_handle: bytes  # wrapped with the device (`wrap_storage_handle`)
    storage_size_bytes: int
    storage_offset_bytes: int
    requires_grad: bool
    ref_counter_handle: bytes | None
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def __reduce__(self) -> tuple[Callable[..., tuple], tuple]:
        # everything from the wrapped handle on, as sent: `_expand` takes it positionally
        return _expand, (
            _CLASS_NAMES[self.tensor_cls],
            _DTYPE_NAMES[self.dtype],
            self.tensor_size,
            self.tensor_stride,
            self.tensor_offset,
            *self[7:],
        )


def _expand(
    class_name: str,
    dtype_name: str,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    handle: bytes,
    *rest: Any,
) -> tuple:
    """`SentArgs` unpickled: the 15 arguments of rebuild_device_tensor, args[6] as the sender
    wrote it."""
    try:
        tensor_cls, dtype = _CLASSES[class_name], _DTYPES[dtype_name]
        device = unwrap_storage_handle(handle)[0] if is_wrapped(handle) else None
    except (KeyError, TypeError):
        device = None
    if device is None:
        raise InvalidHandleError(
            f"malformed sent tensor: class {class_name!r}, dtype "
            f"{dtype_name!r}, device handle {type(handle).__name__}"
        )
    return (tensor_cls, size, stride, offset, torch.UntypedStorage, dtype, device, handle, *rest)


# Pickles name `_expand` by reference: by the path it had before the layers became folders, which
# `devipc` keeps as an alias of this module, so a peer of either layout unpickles the other's.
_expand.__module__ = "devipc._reductions"


_CLASSES = {"Tensor": torch.Tensor, "Parameter": torch.nn.parameter.Parameter}
_CLASS_NAMES = {cls: name for name, cls in _CLASSES.items()}
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def reduce_storage(
    storage: torch.UntypedStorage,
) -> tuple[Callable[..., torch.UntypedStorage], tuple[Any, ...]]:
    device = storage.device
    if device_supports_ipc(device.type):
        return (rebuild_device_storage, (type(storage), *share_device(storage)))
    try:
        return _saved["reduce_storage"](storage)
    except RuntimeError as error:
        # torch can only share CPU memory here ("_share_fd_: only available on CPU"): for a
        # device without hooks, say which device and what to do instead.
        if torch_shares(device.type):
            raise
        raise unsupported_device(device) from error


def _new_shared_device(cls: type[torch.UntypedStorage], *shared: Any) -> torch.UntypedStorage:
    return new_shared_device(*shared)


def _release_ipc_counter_device(
    cls: type[torch.UntypedStorage],
    ref_counter_handle: bytes | None,
    ref_counter_offset: int,
    device: torch.device | str | int | None = None,
) -> None:
    release_ipc_counter_device(ref_counter_handle, ref_counter_offset, device)


# The RFC's names, where the RFC puts them.
_MODULE_NAMES = {
    "reduce_tensor": reduce_tensor,
    "reduce_storage": reduce_storage,
    "rebuild_device_tensor": rebuild_device_tensor,
    "_device_supports_ipc": device_supports_ipc,
}
_STORAGE_METHODS = {
    "_share_device_": share_device,
    "_new_shared_device": classmethod(_new_shared_device),
    "_release_ipc_counter_device": classmethod(_release_ipc_counter_device),
}
_MISSING = object()
_ACC_NAME = "_is_privateuse1_ipc_supported"  # in torch._C._acc, where the RFC's PRs put it


def _privateuse1_ipc_supported() -> bool:
    """torch._C._acc._is_privateuse1_ipc_supported(), as the RFC's pull requests spell it."""
    return device_supports_ipc(torch._C._get_privateuse1_backend_name())


def _refuse_torchs_own_ipc() -> None:
    """A torch with the RFC merged brings its own device IPC: devipc never replaces it."""
    own = getattr(torch.UntypedStorage, "_share_device_", _MISSING)
    if own is not _MISSING and own is not share_device:
        raise DevIpcError(
            f"torch {torch.__version__} has its own UntypedStorage._share_device_ (PyTorch's "
            f"device IPC, which devipc implements for torch releases without it), and devipc "
            f"will not replace it: share this torch's device tensors with torch.multiprocessing "
            f"alone (uninstall devipc), or use a torch devipc supports (>=2.13,<2.16)"
        )


def install() -> None:
    """Route torch.multiprocessing through devipc for devices with hooks. Idempotent. Refuses
    (DevIpcError) a torch that has device IPC of its own."""
    with _lock:
        if _saved:
            return
        _refuse_torchs_own_ipc()
        if not hasattr(torch._C._acc, _ACC_NAME):
            _saved["acc"] = _privateuse1_ipc_supported
            setattr(torch._C._acc, _ACC_NAME, _privateuse1_ipc_supported)
        for name, function in _MODULE_NAMES.items():
            _saved[name] = getattr(torch_reductions, name, _MISSING)
            setattr(torch_reductions, name, function)
        for name, method in _STORAGE_METHODS.items():
            _saved["storage." + name] = torch.UntypedStorage.__dict__.get(name, _MISSING)
            setattr(torch.UntypedStorage, name, method)
        torch_reductions.init_reductions()


def uninstall() -> None:
    """Give torch back its own reducers, exactly as they were. Idempotent."""
    with _lock:
        if not _saved:
            return
        for name in _MODULE_NAMES:
            _restore(torch_reductions, name, _saved.pop(name))
        for name in _STORAGE_METHODS:
            _restore(torch.UntypedStorage, name, _saved.pop("storage." + name))
        if _saved.pop("acc", None) is not None:
            delattr(torch._C._acc, _ACC_NAME)
        torch_reductions.init_reductions()


def installed() -> bool:
    return bool(_saved)


def _restore(owner: object, name: str, value: object) -> None:
    if value is _MISSING:
        delattr(owner, name)
    else:
        setattr(owner, name, value)


on_register(install)  # a device's registration puts its tensors on devipc's path
