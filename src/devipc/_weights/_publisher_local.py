"""The weight publisher on one host: an arena (`_arena`) underneath.

One allocation shared once per subscriber, a control file whose records hold each subscriber's
acknowledged generation under an OFD lock (a dead subscriber is found, named once, and no longer
waited for), and two words that processes sleep on (a futex, `_futex`): the newest published
generation, which subscribers wait for, and a count of acknowledgements, which the publisher
waits for. A publish costs a few system calls whatever the number of tensors, and nothing polls
while it waits.

With `copy=False` the subscribers see the trainer's own memory: `publish(wait=True)` returns once
every subscriber acknowledged, so the trainer's next write comes after they are done; a
subscriber that joins meanwhile gets the next generation. With `copy=True` the weights are copied
(one batched device operation) into one of two staging buffers: the trainer never waits for the
engines' reading, only for the acknowledgement of the generation two publishes back, and a
subscriber that joins gets the newest generation at once.
"""

import threading
from collections.abc import Mapping
from typing import NamedTuple

import torch

from .._core import _handles
from .._core._table import Table
from ._arena import Arena, ArenaReader, Attachment
from ._common import (
    ACK_TIMEOUT,
    ATTACH_TIMEOUT,
    InPlace,
    fill,
    named_weights,
    token_reader,
    token_writer,
)
from ._readers import PUBLISHER_WORDS

__all__ = ["LocalPublisher", "LocalSubscriber", "LocalToken"]

_ATTACHMENT_BYTES = 1 << 16


class LocalToken(NamedTuple):
    """A same-host subscriber's way in: its arena attachment, and where each tensor lies in a
    buffer of it. Read whole and checked before the attachment's one open is spent."""

    attachment: Attachment
    table: Table

    def to_bytes(self) -> bytes:
        writer = token_writer("ipc").bytes(self.attachment.to_bytes(), _ATTACHMENT_BYTES)
        self.table.write(writer)
        return writer.done()

    @classmethod
    def from_bytes(cls, token: bytes | bytearray | memoryview) -> "LocalToken":
        _, reader = token_reader(token, "ipc")
        attachment = Attachment.from_bytes(
            reader.bytes("subscriber's part", _ATTACHMENT_BYTES), reader.name
        )
        table = Table.read(reader, attachment.nbytes)  # rows inside a buffer
        reader.end()
        return cls(attachment, table)


class LocalPublisher:
    """A WeightPublisher whose subscribers are on this host: an arena.

    Thread-safe: publishes from several threads take turns (each makes its own generation),
    and `close()` from another thread ends a `publish` or `wait_acks` under way there with
    ValueError."""

    def __init__(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        copy: bool = False,
    ):
        self._source = model_or_state_dict
        items = _handles.named_items(
            named_weights(model_or_state_dict), "WeightPublisher", host=True
        )
        self.copy = bool(copy)
        self._in_place: InPlace | None = None
        if self.copy:
            self._table, end = Table.packed(items)
            self._arena = Arena(max(end, 1), items[0][1].device, buffers=2, words=PUBLISHER_WORDS)
        else:
            storage, self._table = _handles.in_place(items)
            # CPU weights move into shared memory here (as share_memory_() moves them), so
            # where they lie is taken after
            self._arena = Arena(
                storage.nbytes(), storage.device, buffers=1, storage=storage, words=PUBLISHER_WORDS
            )
            self._in_place = InPlace(model_or_state_dict, items, storage)
        self.device = self._arena.device
        self.generation = -1

    def __len__(self) -> int:
        """How many tensors a generation holds."""
        return len(self._table)

    def token(self) -> bytes:
        """One subscriber's way in (open it once, with `WeightSubscriber`); subscribers may join
        at any time."""
        attachment = Attachment.from_bytes(self._arena.attach(from_newest=self.copy))
        return LocalToken(attachment, self._table).to_bytes()

    def publish(self, *, timeout: float | None = None, checksum: bool = False) -> int:
        """Make the current weights a new generation for every subscriber, once the device work
        that wrote them is done; returns it (`WeightPublisher.publish` waits for the
        acknowledgements). With copy=False, ValueError if the weights left the packed
        allocation since the publisher was made (`InPlace`). With `checksum`, its CRC-32 goes
        with it."""
        if self._in_place is not None:
            self._in_place.check()
        fill = self._fill if self.copy else None
        generation = self._arena.publish(
            fill, ACK_TIMEOUT if timeout is None else timeout, checksum
        )
        self.generation = max(self.generation, generation)
        return generation

    def _fill(self, storage: torch.UntypedStorage, base: int) -> None:
        fill(storage, base, self._table, named_weights(self._source, detach=False))

    def wait_acks(self, generation: int, timeout: float | None = None) -> None:
        """With copy=False, the next generation is announced before the last look at whom to
        wait for: a subscriber opening later is handed that one, not the one being written."""
        if not self.copy and generation == self._arena.generation:
            self._arena.announce(generation + 1)  # before the last look at who to wait for
        self._arena.wait_for(generation, timeout)

    def wait_subscribers(self, count: int, timeout: float = ATTACH_TIMEOUT) -> None:
        self._arena.wait_attached(count, timeout)

    def subscribers(self) -> dict[int, dict]:
        return self._arena.consumers()

    def close(self) -> None:
        """The arena closes (its memory goes once subscribers let go), the model is let go."""
        self._arena.close()
        self._source = {}


class LocalSubscriber:
    """A WeightSubscriber of a publisher on this host: a reader of its arena. Its calls from
    several threads take turns; `close()` from another thread ends a `wait` under way there
    with ValueError."""

    def __init__(
        self, token: bytes | bytearray | memoryview, device: torch.device | str | int | None = None
    ):
        # everything checked before the token's one open is spent
        attachment, self._table = LocalToken.from_bytes(token)
        self._reader = ArenaReader(attachment, device, words=PUBLISHER_WORDS)
        self._turns = threading.Lock()
        self.device = self._reader.device
        self.generation = -1
        self._views: dict[int, dict[str, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._table)

    def wait(self, timeout: float | None = None) -> int:
        """Block until a generation newer than the one held is published; returns the newest.
        PeerGoneError if the publisher closed or exited, TimeoutError after `timeout`."""
        with self._turns:
            self.generation = self._reader.wait(timeout)
            return self.generation

    def ready(self) -> bool:
        """Whether `wait()` would return or raise at once."""
        return self._reader.ready()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held generation's tensors by name: zero-copy views, valid until `ack()` (clone
        what must outlive it)."""
        if self.generation < 0:
            raise ValueError("no generation yet: wait() first")
        buffer = self.generation % self._reader.buffers
        views = self._views.get(buffer)
        if views is None:
            views = self._views[buffer] = self._reader.views(self.generation, self._table)
        return views

    def check_held(self) -> None:
        """Nothing to look at: on one host the publisher overwrites a held generation only once
        this engine acknowledged it or died (a frozen one still holds its lock)."""

    def verify(self) -> None:
        """ChecksumError unless the held generation's bytes here are those published."""
        if self.generation < 0:
            raise ValueError("no generation to verify: wait() first")
        with self._turns:
            self._reader.verify(self.generation)

    def ack(self) -> None:
        """Done with the held generation (its device work included): the publisher may go on."""
        if self.generation < 0:
            raise ValueError("no generation to acknowledge: wait() first")
        with self._turns:
            self._reader.ack(self.generation)

    def close(self) -> None:
        """Unsubscribe: the publisher no longer waits for this engine. Idempotent."""
        self._views.clear()
        self._reader.close()
