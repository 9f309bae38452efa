"""The seam between an Endpoint and what carries its transfers.

An Endpoint owns one Transport; each of its Connections owns the Link the transport made for that
peer. Two ship with devipc, each in its own module: `_ipc.IpcTransport` ("ipc": the device's IPC
hooks and devipc's core, same host) and `_nixl.NixlTransport` ("nixl": NIXL's agent, any host).
A third party passes its own object as `Endpoint(transport=...)`; its `name` travels in the
endpoint's metadata, and only endpoints of the same name connect.

The Endpoint does what every transport needs: it validates the descriptors and local tensors of
a call, keeps the registry (ids, liveness words, holds), and writes the wire bytes; a transport
adds only its own part of a descriptor and moves the bytes.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ._descriptor import Descriptor, Metadata
    from ._registry import Registration
    from ._transfer import Transfer

__all__ = [
    "OPERATIONS",
    "READ",
    "WRITE",
    "Link",
    "LinkExtras",
    "Prepared",
    "Reposted",
    "Transport",
    "operation",
]

# A link's two operations, in NIXL's words: READ copies remote ranges into local tensors, WRITE
# the other way. Users name them "read" and "write" (`operation`).
READ, WRITE = "READ", "WRITE"
OPERATIONS = (READ, WRITE)


class Prepared(Protocol):
    """A link's transfer validated once and posted many times (`Connection.prepare`)."""

    def post(self) -> "Transfer":
        """Start the transfer again; RemoteTensorFreedError if a remote registration ended."""
        ...

    def close(self) -> None:
        """Let go of what the prepared transfer holds. Called once."""
        ...


class Link(Protocol):
    """A transport's connection to one peer endpoint: these members, and any of the optional
    ones `LinkExtras` declares with their defaults."""

    def post(
        self, op: str, locals_: "list[torch.Tensor]", descs: "list[Descriptor]", wait: bool
    ) -> "Transfer":
        """Start `op` ("READ": each remote range into its local tensor, "WRITE": the other way).
        The Endpoint checked that the lists pair up, that each descriptor is this peer's and
        that sizes match. With `wait` the caller waits on the Transfer right after, so the
        transport may do the work in the calling thread."""
        ...

    def mapped(self) -> int:
        """How many of the peer's registrations this link holds open (0 if it maps none)."""
        ...

    def close(self) -> None:
        """Let go of everything held for the peer. Called once."""
        ...


@runtime_checkable
class Transport(Protocol):
    """What carries an Endpoint's transfers. A transport with `on_register(reg)` and
    `on_deregister(reg)` is made a registry listener while its endpoint is open."""

    name: str  # in the endpoint's metadata: a peer's endpoint must use the same one

    def metadata(self) -> bytes:
        """This side's part of `Endpoint.metadata()`, handed to the peer's `connect`."""
        ...

    def describe(self, reg: "Registration", offset: int, nbytes: int) -> dict[str, Any]:
        """This transport's fields of a descriptor of bytes [offset, offset + nbytes) of the
        registration's storage (a network transport fills `extra` with its own bytes). Device
        work queued so far on the storage's device must be visible to transfers through it."""
        ...

    def connect(self, meta: "Metadata") -> Link:
        """A link to the peer endpoint whose decoded metadata this is."""
        ...

    def close(self) -> None:
        """Called once, when the endpoint closes (after its connections)."""
        ...


@dataclass(frozen=True)
class LinkExtras:
    """A link's optional members, each declared with the default a link without it gets: what a
    link may do beyond `post`. The connection reads them once (`of`)."""

    # Given descriptors of a sub-range of what the owner advertised (`Descriptor.narrow`:
    # `offset`/`nbytes` the range to move, `shift` how far it starts past the advertised one; a
    # transport whose `extra` names an address adds `shift` to it). Default: never, and a
    # sub-range is refused.
    sub_ranges: bool = False
    # prepare(op, locals_, descs) -> Prepared: a transfer validated once. Default: `Reposted`,
    # which calls `post` at each post.
    prepare: "Callable[[str, list[torch.Tensor], list[Descriptor]], Prepared] | None" = None
    # again(op, local, desc) -> bool: a synchronous `read`/`write` of one whole descriptor made
    # by the link itself (True once done; False: the connection calls `post`). Default: `post`.
    again: "Callable[[str, torch.Tensor, Descriptor], bool] | None" = None
    # map(desc) -> torch.Tensor: the remote range mapped into this process. Default: none,
    # `Connection.map` refuses.
    map: "Callable[[Descriptor], torch.Tensor] | None" = None
    # liveness: bool, settable: whether a transfer first checks that the remote registrations
    # live; `connect(liveness=False)` sets it False. Default: a link without it ignores that.
    liveness: bool | None = None

    @classmethod
    def of(cls, link: Link) -> "LinkExtras":
        """The optional members `link` has, and the defaults of the others."""
        default = cls()
        return cls(
            **{
                member.name: getattr(link, member.name, getattr(default, member.name))
                for member in fields(cls)
            }
        )

    def prepared(
        self, link: Link, op: str, locals_: "list[torch.Tensor]", descs: "list[Descriptor]"
    ) -> Prepared:
        """The link's own prepared transfer, or the default one."""
        own = self.prepare
        return Reposted(link, op, locals_, descs) if own is None else own(op, locals_, descs)


class Reposted:
    """The default prepared transfer of a link without `prepare`: each post is a `post`."""

    def __init__(
        self, link: Link, op: str, locals_: "list[torch.Tensor]", descs: "list[Descriptor]"
    ):
        self._link: Link | None = link
        self._op, self._locals, self._descs = op, locals_, descs

    def post(self) -> "Transfer":
        link = self._link
        if link is None:
            raise ValueError("this prepared transfer is closed: prepare it again")
        return link.post(self._op, self._locals, self._descs, False)

    def close(self) -> None:
        self._link, self._locals, self._descs = None, [], []


def operation(op: object) -> str:
    """The operation a user names "read" or "write" (READ, WRITE); ValueError otherwise."""
    if op == "read":
        return READ
    if op == "write":
        return WRITE
    raise ValueError(f"op is 'read' or 'write', not {op!r}")
