"""Exceptions, split by cause: the device cannot share, the handle is bad, the peer is gone."""


class DevIpcError(RuntimeError):
    """Base class of every devipc error."""


class UnsupportedDeviceError(DevIpcError):
    """The tensor's device has no IPC hooks (or says it cannot share): nothing was sent."""


class UnsupportedTensorError(UnsupportedDeviceError, TypeError):
    """The tensor's kind cannot be shared (a strided-layout nested tensor, sparse, another
    layout): nothing was sent. The message says what to send instead."""


class InvalidHandleError(DevIpcError, ValueError):
    """A handle is forged, truncated, stale, or names something that is not what it claims to be;
    also a handle this process may not open (other user, PID namespace, non-dumpable producer)."""


class PeerGoneError(DevIpcError):
    """The other process is gone: a producer exited before its send was opened, a weight
    publisher closed or exited, a p2p owner exited (the connection is then closed)."""


class SpentHandleError(InvalidHandleError):
    """A handle whose one open is spent: it was opened already (each send opens in one process,
    once), opened and released, or revoked by its sender. Send it again for another process."""


class ReshareError(DevIpcError):
    """Memory received from another process cannot be sent on this way: a view inside a
    received storage that is not the received tensor itself, or a received storage advertised
    by devipc.p2p (a received tensor itself may be sent on, A -> B -> C). Send a clone()."""


class ConsumerDiedError(PeerGoneError):
    """A consumer (an arena's, a weight publisher's subscriber) died without acknowledging: the
    producer's wait ended, and that consumer no longer counts. `consumers` lists (index, pid) of
    the dead ones. From `WeightPublisher.publish`, `published` is the generation it published
    (the wait for its acknowledgements ended), or None: nothing went out."""

    published: int | None = None

    def __init__(
        self,
        consumers: list[tuple[int, int]],
        generation: int,
        consumer: str = "arena consumer",
        producer: str = "arena",
    ):
        """`consumer` and `producer`: what the message calls them (a weight publisher's
        subscriber)."""
        self.consumers, self.generation = consumers, generation
        names = ", ".join(f"{index} (pid {pid})" for index, pid in consumers)
        super().__init__(
            f"{consumer} {names} died before acknowledging generation "
            f"{generation}; the {producer} no longer waits for it"
        )


class ChecksumError(DevIpcError):
    """The bytes a weight subscriber holds are not those its publisher published with
    `checksum=True` (`WeightSubscriber.verify`): do not use them; the next generation may be
    whole again."""


class AckTimeoutError(DevIpcError, TimeoutError):
    """A consumer is alive but did not acknowledge in time. From `WeightPublisher.publish`,
    `published` is the generation it published, or None: nothing went out."""

    published: int | None = None


class RemoteTensorFreedError(DevIpcError):
    """devipc.p2p: the remote tensor a descriptor names was freed or deregistered by its owner;
    the peer's mapping of it was closed. Ask the owner for a new descriptor."""


class NotRegisteredError(DevIpcError, LookupError):
    """devipc.p2p: the tensor (or id) is not registered in this process."""


class TransferSizeError(DevIpcError, ValueError):
    """devipc.p2p: a local tensor and the remote range it is copied from or to differ in size."""
