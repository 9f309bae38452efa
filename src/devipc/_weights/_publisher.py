"""Weight sync as one API: a trainer publishes generations of its weights, any number of engines
subscribe, each acknowledges what it used.

    pack_module(model)                         # once: weights and buffers in one allocation
    pub = WeightPublisher(model)               # copy=False: the packed memory is what engines see
    token = pub.token()                        # one per engine, by any transport
    pub.publish()                              # after each optimizer step: returns once all acked

    sub = WeightSubscriber(token)              # in the engine
    sub.wait(); sub.copy_into(engine_model); sub.ack()
    model.load_weights(sub.weights())          # or the engine's own loader (vLLM, SGLang)

Both objects hold a backend: on one host an arena (`_publisher_local`), across hosts NIXL's
one-sided transfers (`_remote_publisher`, `_remote_subscriber`, `transport="nixl"`, imported only
then); a subscriber takes the one its token names (`subscriber_backend`). What the two share
lives below both, in `_common`.
"""

import asyncio
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from .._core._backoff import polling
from .._core._errors import AckTimeoutError, ConsumerDiedError
from ._common import ATTACH_TIMEOUT, Names, copy_into, token_reader
from ._publisher_local import LocalPublisher, LocalSubscriber

if TYPE_CHECKING:
    from ._remote_subscriber import NixlSubscriber

__all__ = ["WeightPublisher", "WeightSubscriber", "subscriber_backend"]

TRANSPORTS = ("ipc", "nixl")
_LOOK = 1e-9  # a wait_acks timeout that looks once: the acknowledgements as they are now


class WeightPublisher:
    """The trainer's side: `token()` per subscriber, `publish()` per generation. With
    `transport="nixl"` subscribers may be on other hosts; with `relay=True` each generation
    leaves the trainer once and passes from engine to engine (`_relay`). With
    `block_checksums=True` (NIXL) `publish(checksum=True)` also publishes a CRC-32 per block of
    the generation, which an engine that pulls only part of it (`ShardedSubscriber`) checks.

    Thread-safe: publishes from several threads take turns (each makes its own generation),
    and `close()` from another thread ends a `publish`, `wait_acks` or `wait_subscribers` under
    way there with ValueError."""

    def __init__(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        copy: bool = False,
        transport: str = "ipc",
        relay: bool = False,
        block_checksums: bool = False,
    ):
        if transport not in TRANSPORTS:
            raise ValueError(
                f"transport is 'ipc' (one host) or 'nixl' (across hosts), not {transport!r}"
            )
        if relay and transport != "nixl":
            raise ValueError(
                "relay=True passes generations from engine to engine across "
                "hosts: it needs transport='nixl' (on one host every engine maps "
                "the trainer's memory, nothing to relay)"
            )
        if block_checksums and transport != "nixl":
            raise ValueError(
                "block_checksums=True lets an engine that pulls part of a "
                "generation across hosts verify it: it needs transport='nixl' (on "
                "one host an engine maps the whole generation and verifies it all)"
            )
        if transport == "nixl":
            from ._remote_publisher import NixlPublisher

            self._backend: LocalPublisher | NixlPublisher = NixlPublisher(
                model_or_state_dict, copy=copy, relay=relay, block_checksums=block_checksums
            )
        else:
            self._backend = LocalPublisher(model_or_state_dict, copy=copy)
        self.transport = transport

    @property
    def copy(self) -> bool:
        """Whether generations are copies (two staging buffers) or the trainer's own memory."""
        return self._backend.copy

    device = property(lambda self: self._backend.device, doc="Where the published weights lie.")
    generation = property(
        lambda self: self._backend.generation, doc="The newest generation published (-1: none yet)."
    )

    def token(self) -> bytes:
        """One subscriber's way in (open it once, with `WeightSubscriber`); subscribers may join
        at any time."""
        return self._backend.token()

    def publish(
        self, *, wait: bool = True, timeout: float | None = None, checksum: bool = False
    ) -> int:
        """Make the current weights a new generation for every subscriber, once the device work
        that wrote them is done; returns it. With `wait`, returns once every live subscriber
        acknowledged it (`wait_acks`). With copy=False, ValueError, nothing published, if the
        weights left the packed allocation since the publisher was made, or if a live
        subscriber has not acknowledged the previous generation (the weights were written under
        it: `wait_acks` first). With `checksum`, the generation's CRC-32 goes with it, for
        `WeightSubscriber.verify()` (one pass over the bytes, through the host where the
        device's memory is not host memory). ConsumerDiedError and AckTimeoutError say in
        `published` whether the new generation went out: its number (the error came from the
        wait for its acknowledgements), or None (nothing was published: from the wait for an
        earlier generation's buffer, copy=True, or the look at the previous one's
        acknowledgements, copy=False)."""
        if not self.copy:
            self._refuse_unacknowledged()
        try:
            generation = self._backend.publish(timeout=timeout, checksum=checksum)
        except (ConsumerDiedError, AckTimeoutError) as error:
            error.published = None
            raise
        if wait:
            try:
                self._backend.wait_acks(generation, timeout)
            except (ConsumerDiedError, AckTimeoutError) as error:
                error.published = generation
                raise
        return generation

    def _refuse_unacknowledged(self) -> None:
        """copy=False: ValueError naming the live subscribers that have not acknowledged the
        newest generation: they still read the memory the trainer wrote the next one into.
        (Waiting here, as the backends would, hid the mistake behind a minute's
        AckTimeoutError.) One look, as `wait_acks` looks: a dead one is named by
        ConsumerDiedError, nothing published."""
        newest = self._backend.generation
        if newest < 0:
            return
        try:
            self._backend.wait_acks(newest, _LOOK)
        except AckTimeoutError as late:
            raise ValueError(
                f"{str(late).partition(', ')[2]}: with copy=False they read the trainer's own "
                f"memory, so the weights may change and the next generation go out only once "
                f"wait_acks({newest}) returned (or publish with wait=True); nothing was "
                f"published"
            ) from None
        except ConsumerDiedError as error:
            error.published = None
            raise

    def wait_acks(self, generation: int, timeout: float | None = None) -> None:
        """Return once every live subscriber acknowledged `generation`. AckTimeoutError after
        `timeout` seconds (None: no bound, but dead subscribers still end the wait);
        ConsumerDiedError names subscribers found dead, once: they are no longer waited for.
        With copy=False the trainer may write its weights once this returns for the newest
        generation: a subscriber that opens its token from then on is not handed it (its
        memory is being overwritten) but the next one."""
        self._backend.wait_acks(generation, timeout)

    def wait_subscribers(self, count: int, timeout: float = ATTACH_TIMEOUT) -> None:
        """Return once `count` subscribers opened their tokens (engines starting up); with
        `copy=False` a subscriber that opens after a publish gets the next generation.
        TimeoutError after `timeout` seconds."""
        self._backend.wait_subscribers(count, timeout)

    def subscribers(self) -> dict[int, dict]:
        """Each subscriber record in use: state, acknowledged generation, pid."""
        return self._backend.subscribers()

    def close(self) -> None:
        """Subscribers waiting are told (PeerGoneError); memory goes once they let go. The
        publisher no longer holds the model. Idempotent."""
        self._backend.close()

    def __enter__(self) -> "WeightPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<devipc.WeightPublisher {len(self._backend)} tensors on {self.device}, "
            f"{'copy' if self.copy else 'in place'}, generation {self.generation}>"
        )


class WeightSubscriber:
    """An engine's side: `wait()` for a generation, read `tensors()` or `copy_into(...)` its
    own weights, then `ack()`. Its calls from several threads take turns; `close()` from
    another thread ends a `wait` under way there with ValueError."""

    def __init__(
        self,
        token: bytes | bytearray | memoryview,
        device: torch.device | str | int | None = None,
        *,
        share: bool = True,
        prefetch: bool = False,
    ):
        """`device`: where to read the tensors (None: the publisher's device type, the local
        device that holds the memory). "cpu" for a CPU engine: on one host zero-copy where the
        publisher's memory is host memory (a CPU trainer, a device whose hooks say "DRAM"),
        else refused with the copy to make; across hosts each generation is pulled there.
        `share` (a relay's subscribers): map the buffers of the engine of this host and device
        that pulls each generation, rather than hold a copy of one's own; False for a copy.
        `prefetch` (across hosts): once the engine acknowledged what it holds, the next
        generation is pulled, and passed on down a relay's chain, in the background as soon as
        it is published; `wait()` then returns it at once. On one host there is nothing to
        pull: `wait()` returns as soon as a generation is published either way."""
        self._backend = subscriber_backend(token, device, share=share, prefetch=prefetch)

    device = property(lambda self: self._backend.device, doc="Where the tensors are read.")
    generation = property(
        lambda self: self._backend.generation, doc="The generation held (-1: none yet)."
    )

    def wait(self, timeout: float | None = None) -> int:
        """Block until a generation newer than the one held is published; returns the newest.
        PeerGoneError if the publisher closed or exited, TimeoutError after `timeout`."""
        return self._backend.wait(timeout)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held generation's tensors by name. On one host zero-copy views, valid until
        `ack()` (clone what must outlive it); across hosts this process's copy, valid until the
        next `wait()` (with `prefetch`, until `ack()`), or with a relay's `share` views of the
        buffers of an engine of this host, valid until `ack()` as on one host."""
        return self._backend.tensors()

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each tensor of the held generation, for an engine's own loader
        (`model.load_weights(subscriber.weights())`, which may rename, fuse and shard as it
        copies); the tensors are `tensors()`'s, valid as long."""
        return self._handed(self._backend.tensors())

    def _handed(self, tensors: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """`weights()`'s pairs, then (once the loader took them all) the look that says they
        were all of the held generation."""
        yield from tensors.items()
        self._backend.check_held()

    def copy_into(
        self,
        module_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        names: Names = None,
    ) -> None:
        """Copy the held generation into the engine's own tensors, as `copy_` would: shapes
        must match, a floating dtype converts to the engine's (fp32 to bf16, say), integer and
        bool dtypes must match. `names` maps a published name to the engine's: a dict of renames
        (names it leaves out keep theirs) or a callable; None for a tensor to leave out. Byte
        copies go as one device operation where the hooks batch copies, and each pair of dtypes
        converts in one."""
        copy_into(self._backend.tensors(), module_or_state_dict, names)
        self._backend.check_held()  # the bytes copied were all of the held generation

    async def wait_async(self, timeout: float | None = None) -> int:
        """`wait()` for an asyncio loop (an engine's own): awaits the next generation without a
        thread, looking every 0.1 ms growing to 2 ms. Across hosts the pull itself (one NIXL
        read) runs in the loop's thread once the generation is there."""
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        backoff = polling(timeout)
        while not self._backend.ready():
            if backoff.expired():
                raise TimeoutError(
                    f"no new generation within {timeout} s (the newest held is {self.generation})"
                )
            await asyncio.sleep(backoff.next_pause())
        return self._backend.wait(timeout)

    def verify(self) -> None:
        """Check the held generation end to end: the CRC-32 of its bytes as this subscriber
        holds them against the one the publisher computed (`publish(checksum=True)`).
        ChecksumError if they differ, ValueError if it was published without one. Before
        `ack()`: after it, the publisher may write the next generation there."""
        self._backend.verify()

    def ack(self) -> None:
        """Done with the held generation (its device work included): the publisher may go on."""
        self._backend.ack()

    def close(self) -> None:
        """Unsubscribe: the publisher no longer waits for this engine. Idempotent."""
        self._backend.close()

    def __enter__(self) -> "WeightSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<devipc.WeightSubscriber {len(self._backend)} tensors on {self.device}, "
            f"generation {self.generation}>"
        )


def subscriber_backend(
    token: bytes | bytearray | memoryview,
    device: torch.device | str | int | None,
    **across_hosts: Any,
) -> "LocalSubscriber | NixlSubscriber":
    """The subscriber a token names: across hosts a `NixlSubscriber` given `across_hosts` (its
    share, prefetch, parts), imported only then; on one host a `LocalSubscriber`, which has
    nothing to pull and takes none of them."""
    transport, _ = token_reader(token)
    if transport == "nixl":
        from ._remote_subscriber import NixlSubscriber

        return NixlSubscriber(token, device, **across_hosts)
    return LocalSubscriber(token, device)
