"""devipc as a Ray Direct Transport: tensors of any device with devipc hooks (and CPU tensors)
move between Ray actors one-sided, the receiver alone acting.

The sender describes an object once (`extract_tensor_transport_metadata`): its tensors grouped by
the storage they are views of, and for each storage two ways in. On the sender's host, devipc
handles of the storage as it lies (`share_tensors(copy=False)`: the receiver maps the very
memory, the device's events or stream sync honored); each handle opens once, so an object carries
READERS of them per storage, and CPU memory one host send that any number open. Elsewhere, the
storage registered and advertised on a NIXL endpoint (`devipc.p2p`), which the receiver reads
into its own memory. The receiver takes the first way its host allows (same boot and PID
namespace: the handles; else NIXL), per transfer.

Lifetimes are devipc's: Ray's `garbage_collect` takes back the handles nobody opened; memory a
receiver mapped stays until it lets go (or dies: the core reclaims a dead consumer's hold), and a
receiver of a sender that died gets PeerGoneError, not a hang. A storage's NIXL registration lasts
as long as the storage (the p2p registry ends it then): registering memory costs milliseconds,
and a sender sends the same weights again and again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from ray.experimental.rdt.tensor_transport_manager import (
    CommunicatorMetadata,
    TensorTransportManager,
    TensorTransportMetadata,
)

from .._core import _handles
from .._core._copies import copy_pairs
from .._core._errors import DevIpcError, PeerGoneError, SpentHandleError, UnsupportedDeviceError
from .._core._host import HostSend, share_host
from .._core._memfd import host_identity
from .._core._table import Table

__all__ = ["READERS", "DevipcMetadata", "DevipcNetworkTransport", "DevipcTransport"]

READERS = 4  # receivers on the sender's host that map one object without a copy

_Row = tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]  # dtype, shape, stride, offset


@dataclass
class Group:
    """The tensors of an object that are views of one storage."""

    indices: list[int]  # their places in the object
    rows: list[_Row]  # where each lies in the storage
    nbytes: int  # the storage's bytes
    sends: list[bytes]  # devipc handles of the storage, each opened once (CPU: a host send)
    descriptor: bytes = b""  # the storage advertised over NIXL; b"": no NIXL on the sender


@dataclass
class DevipcMetadata(TensorTransportMetadata):
    """What a receiver needs of an object: the sender's host, its NIXL endpoint, the groups."""

    host: bytes = b""
    endpoint: bytes = b""
    groups: list[Group] = field(default_factory=list)


@dataclass
class DevipcCommunicatorMetadata(CommunicatorMetadata):
    """One-sided: nothing is arranged between the two actors."""


class DevipcTransport(TensorTransportManager):
    """The transport Ray instantiates in each process (`devipc.ray.register_transport`)."""

    network_only = False  # a test's override: NIXL even between actors of one host

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent: dict[str, list[_handles.Handle]] = {}  # an object's handles, until freed
        self._endpoint: Any = None  # a NIXL endpoint, made on first use
        self._connections: dict[bytes, Any] = {}  # peer endpoint metadata -> connection

    def tensor_transport_backend(self) -> str:
        return "DEVIPC"

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return True  # every wait of a receive is bounded: there is nothing to interrupt

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True  # asked before each task: blocking on the actor would cost a round trip

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> DevipcCommunicatorMetadata:
        return DevipcCommunicatorMetadata()

    # -- the sender --

    def extract_tensor_transport_metadata(
        self, obj_id: str, rdt_object: list[Any]
    ) -> DevipcMetadata:
        tensors = list(rdt_object)
        meta = DevipcMetadata(
            tensor_meta=[(t.shape, t.dtype) for t in tensors],
            tensor_device=tensors[0].device.type if tensors else None,
            host=host_identity(),
        )
        if not tensors:
            return meta
        if len({t.device for t in tensors}) != 1:
            raise ValueError(
                f"the tensors of one Ray object must be on one device, got "
                f"{sorted({str(t.device) for t in tensors})}"
            )
        sent: list[_handles.Handle] = []
        try:
            for indices in _by_storage(tensors).values():
                meta.groups.append(self._describe(tensors, indices, sent, meta))
        except BaseException:
            _revoke(sent)
            raise
        with self._lock:
            self._sent[obj_id] = sent
        return meta

    def _describe(
        self,
        tensors: list[torch.Tensor],
        indices: list[int],
        sent: list[_handles.Handle],
        meta: DevipcMetadata,
    ) -> Group:
        storage = tensors[indices[0]].untyped_storage()
        items = [(str(i), tensors[i]) for i in indices]
        if not storage.nbytes():
            sends: list[bytes] = []  # nothing to map: the receiver makes an empty storage
        elif storage.device.type == "cpu":
            sends = [bytes(HostSend.of(storage))]  # moved into shared memory if it is not there
        else:
            handles = [_handles.share_tensors(items, copy=False) for _ in range(READERS)]
            sent += handles
            sends = [bytes(handle) for handle in handles]
        rows = [
            (t.dtype, tuple(t.shape), t.stride(), int(t.storage_offset()) * t.element_size())
            for _, t in items
        ]
        group = Group(indices, rows, storage.nbytes(), sends)
        network = self._network()
        if network is not None and storage.nbytes():
            meta.endpoint = network.metadata()
            group.descriptor = network.advertise(_registered(storage), 0, storage.nbytes())
        return group

    def _network(self) -> Any:
        """This process's NIXL endpoint, or None where NIXL is not installed."""
        with self._lock:
            if self._endpoint is None:
                from .. import p2p

                try:
                    self._endpoint = p2p.Endpoint(transport="nixl")
                except (ImportError, UnsupportedDeviceError):
                    self._endpoint = False
            return self._endpoint or None

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        raise NotImplementedError("the DEVIPC transport is one-sided: receivers read")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        """Ray freed the object: handles nobody opened are taken back."""
        with self._lock:
            sent = self._sent.pop(obj_id, [])
        _revoke(sent)

    def held(self) -> int:
        """Objects this process sent that Ray has not freed yet."""
        with self._lock:
            return len(self._sent)

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        pass  # (see can_abort_transport)

    # -- the receiver --

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Any]:
        meta = tensor_transport_metadata
        if not isinstance(meta, DevipcMetadata):
            raise TypeError(f"the DEVIPC transport reads DevipcMetadata, not {type(meta).__name__}")
        received: list[torch.Tensor | None] = [None] * len(meta.tensor_meta)
        here = bool(meta.host) and meta.host == host_identity() and not self.network_only
        for group in meta.groups:
            storage = self._storage_of(meta, group, here)
            table = (
                Table([str(i) for i in group.indices], *zip(*group.rows))
                if group.rows
                else Table([], [], [], [], [])
            )
            for i, view in zip(group.indices, table.views(storage).values()):
                received[i] = view
        tensors = [t for t in received if t is not None]
        assert len(tensors) == len(received)
        if target_buffers:
            copy_pairs(list(zip(target_buffers, tensors)))
            return list(target_buffers)
        return tensors

    def _storage_of(self, meta: DevipcMetadata, group: Group, here: bool) -> torch.UntypedStorage:
        """The group's storage in this process: mapped where the handles reach, else read."""
        if not group.nbytes:  # nothing to map or read
            return torch.empty(
                0, dtype=torch.uint8, device=_receiving_device(meta)
            ).untyped_storage()
        storage = self._map(group) if here else None
        return self._pull(meta, group) if storage is None else storage

    def _map(self, group: Group) -> torch.UntypedStorage | None:
        """The sender's storage mapped here, zero-copy; None once its handles are spent and it
        can be read over NIXL instead."""
        for data in group.sends:
            send = _handles.bucket_or_host_send(data, "Ray object handle")
            if isinstance(send, HostSend):
                return send.open("Ray object handle")  # CPU memory: any number open it
            try:
                return _handles.open_storage(send, None)
            except SpentHandleError:
                continue  # another receiver on this host took it
            except PeerGoneError as error:
                raise PeerGoneError(
                    f"the actor that made this Ray object has exited before "
                    f"this one read it ({error})"
                ) from None
        if group.descriptor:
            return None
        raise DevIpcError(
            f"this Ray object was already mapped by {len(group.sends)} receivers "
            f"on its sender's host (or Ray freed it); each storage maps zero-copy "
            f"into {READERS} processes, and further ones read it over NIXL: "
            f"install devipc[nixl] for them"
        )

    def _pull(self, meta: DevipcMetadata, group: Group) -> torch.UntypedStorage:
        """A copy of the sender's storage, read over NIXL into this process's memory."""
        from .. import p2p

        if not group.descriptor or self._network() is None:
            raise UnsupportedDeviceError(
                "this Ray object's sender is on another host or PID namespace, and NIXL is not "
                "installed on both sides (pip install 'devipc[nixl]'): its memory cannot be "
                "reached from here"
            )
        with self._lock:
            connection = self._connections.get(meta.endpoint)
            if connection is None:
                connection = self._connections[meta.endpoint] = self._endpoint.connect(
                    meta.endpoint
                )
        local, _ = p2p.create_tensor((group.nbytes,), torch.uint8, _receiving_device(meta))
        connection.read(local, group.descriptor)
        return local.untyped_storage()


class DevipcNetworkTransport(DevipcTransport):
    """DEVIPC that reads over NIXL even on the sender's host: to try the path between hosts
    on one machine (`register_transport(..., network=True)`)."""

    network_only = True


def _registered(storage: torch.UntypedStorage) -> int:
    """The storage's p2p id, registered now if it is not yet; the registry ends the registration
    when the storage dies."""
    from .. import p2p

    try:
        return p2p.get_tensor_id_by_tensor(storage)
    except p2p.NotRegisteredError:
        if storage.device.type == "cpu":
            share_host(storage)  # NIXL's peers map CPU memory through its shared file
        return p2p.register(storage)


def _revoke(handles: list[_handles.Handle]) -> None:
    for handle in handles:
        handle.revoke()


def _by_storage(tensors: list[torch.Tensor]) -> dict[int, list[int]]:
    """The tensors' indices, grouped by the storage they are views of."""
    groups: dict[int, list[int]] = {}
    for i, tensor in enumerate(tensors):
        key = tensor.untyped_storage().data_ptr() or -1 - i  # each empty storage its own
        groups.setdefault(key, []).append(i)
    return groups


def _receiving_device(meta: DevipcMetadata) -> torch.device:
    """The sender's device type here: this process's current device of it."""
    device_type = meta.tensor_device or "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    index = (
        torch.accelerator.current_device_index()
        if accelerator is not None and accelerator.type == device_type
        else 0
    )
    return torch.device(device_type, index)
