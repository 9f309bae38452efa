"""`WeightPublisher(..., transport="nixl")`: the publisher's API across hosts, every byte moved
by one-sided NIXL transfers (`devipc.p2p`) of its subscribers (`_remote_subscriber`), the
publisher's code taking no part.

The publisher registers two things with a NIXL endpoint: the weights (the packed allocation
itself with `copy=False`, two staging buffers with `copy=True`) and a small host control block
of int64 words, a header and a record per subscriber (laid out in `_remote_token`). With
`relay=True` (`_relay`) the subscribers pass each generation on along a chain, engines of one
host and device map the buffers of the one among them that pulls, and a third thing is
registered: one slot per record where its subscriber writes how it is reached.

A token (`RemoteToken`) carries the endpoint's metadata, the descriptors of the header, of the
subscriber's record and of the weights, and the table (names, dtypes, shapes, offsets: fixed
for the publisher's life). The publisher waits by looking at its own memory, where subscribers
write their claims, acks and heartbeats; a subscriber whose heartbeat stood still for LIVENESS
seconds is dead: named once (ConsumerDiedError), then dropped. A subscriber that attached while
the trainer may be writing (copy=False) is not waited for the published generation, which it
cannot get: its first is the next one.

Thread-safe as on one host: publishes take turns, and close() from another thread ends the
waits under way there with ValueError.
"""

import itertools
import threading
import time
import weakref
from collections.abc import Mapping
from typing import NamedTuple

import torch

from .. import p2p
from .._core import _handles
from .._core._backoff import Backoff
from .._core._devices import synchronize
from .._core._errors import NotRegisteredError
from .._core._host import share_host, shared_host_storage
from .._core._table import ALIGNMENT, Table
from . import _remote_token
from ._arena import Calls, counted
from ._checksum import NO_SUM, block_crc32s, crc32, pair
from ._common import ACK_TIMEOUT, ATTACH_TIMEOUT, InPlace, fill, named_weights
from ._readers import (
    ATTACHED,
    CLOSED,
    FREE,
    GONE,
    MAX_READERS,
    PENDING,
    PUBLISHER_WORDS,
    Records,
    acks_timeout,
    attach_timeout,
    attached,
    label,
    unacknowledged,
)
from ._relay import CARD_BYTES, Member, chain, chunk_size
from ._remote_token import (
    ACK,
    BEAT,
    CARDS_BYTES,
    CLAIMED,
    CONTROL_WORDS,
    FIELDS,
    FILLING,
    HEADER,
    HOST,
    LEADER,
    PID,
    PUBLISHED,
    SERIAL,
    SHARE,
    STATE,
    SUMS,
    UP,
    Control,
    RemoteToken,
    block_words,
    count,
    let_go,
    word,
)

__all__ = ["NixlPublisher"]


class _Beat(NamedTuple):
    """A record's heartbeat as last seen changing."""

    serial: int  # the token's whose subscriber wrote it
    beat: int
    seen: float  # when (time.monotonic())


class NixlPublisher:
    """A WeightPublisher whose subscribers may be on other hosts (`transport="nixl"`).

    Thread-safe: publishes (and tokens) from several threads take turns, each publish its own
    generation; `close()` from another thread ends a `publish`, `wait_acks` or
    `wait_subscribers` under way there with ValueError, and the memory goes once they left."""

    def __init__(
        self,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        copy: bool = False,
        relay: bool = False,
        block_checksums: bool = False,
    ):
        self._source = model_or_state_dict
        self.block_checksums = bool(block_checksums)
        items = _handles.named_items(
            named_weights(model_or_state_dict), "WeightPublisher", host=True
        )
        self.copy = bool(copy)
        if self.copy:
            self._table, end = Table.packed(items)
            self._nbytes = -(-max(end, 1) // ALIGNMENT) * ALIGNMENT
            self._buffers = 2
            device = items[0][1].device
            self._storage: torch.UntypedStorage | None = (
                shared_host_storage(2 * self._nbytes)
                if device.type == "cpu"
                else torch.empty(
                    2 * self._nbytes, dtype=torch.uint8, device=device
                ).untyped_storage()
            )
        else:
            self._storage, self._table = _handles.in_place(items)
            self._nbytes, self._buffers = self._storage.nbytes(), 1
            if self._storage.device.type == "cpu":
                share_host(self._storage)  # NIXL's peers map it; moved before InPlace looks
        self._in_place = None if self.copy else InPlace(model_or_state_dict, items, self._storage)
        self.device = self._storage.device
        self.generation = -1
        self._calls = Calls("WeightPublisher")
        self._turns = threading.Lock()  # one publish or token at a time
        self._serials = itertools.count(1)
        self._beats: dict[int, _Beat] = {}  # by record
        self._adopted: dict[int, int] = {}  # record -> serial of the subscriber seen attached
        self._used = 0  # records handed out so far (the first ones): those the scans look at
        self.relay = bool(relay)
        self._endpoint = p2p.Endpoint(transport="nixl")
        self._ids: list[int] = []  # registrations this publisher made, ended by close()
        self._let_go = weakref.finalize(self, let_go, [self._endpoint], self._ids)
        try:
            self._words, control = p2p.create_tensor((CONTROL_WORDS,), torch.int64, "cpu")
            self._ids.append(control)
            self._words.zero_()
            self._words[SUMS:HEADER] = NO_SUM
            self._words[PUBLISHED] = -1
            self._words[FILLING] = -1 if self.copy else 0  # copy=False: the trainer writes now
            try:
                data = p2p.get_tensor_id_by_tensor(self._storage)  # the user registered it
            except NotRegisteredError:
                data = p2p.register(self._storage)
                self._ids.append(data)
            self._data = [
                self._endpoint.advertise(data, b * self._nbytes, self._nbytes)
                for b in range(self._buffers)
            ]
            self._header = self._control(0, HEADER)
            self._blocks, blocks = p2p.create_tensor(
                (2, block_words(self._nbytes)), torch.int64, "cpu"
            )
            self._ids.append(blocks)
            self._blocks[:, 0] = -1  # no generation's sums yet
            self._blocks_desc = self._endpoint.advertise(blocks)
            self._chunk = chunk_size(self._nbytes) if self.relay else 0
            self._cards, self._cards_desc = torch.empty(0, dtype=torch.uint8), b""
            # every record, where a subscriber reads the chain ahead of its upstream
            self._records_desc = self._control(HEADER, MAX_READERS * FIELDS) if self.relay else b""
            if self.relay:  # one slot per record, where its subscriber writes its card
                self._cards, cards = p2p.create_tensor((CARDS_BYTES,), torch.uint8, "cpu")
                self._ids.append(cards)  # new fd-backed memory: zeros, untouched until a
                # token's slot is cleared for it (sparse: 16 KiB per subscriber, not 16 MiB)
                self._cards_desc = self._endpoint.advertise(cards)
        except BaseException:
            self._release()
            raise

    def _control(self, word: int, count: int) -> bytes:
        return self._endpoint.advertise(self._ids[0], 8 * word, 8 * count)

    def __len__(self) -> int:
        """How many tensors a generation holds."""
        return len(self._table)

    @counted
    def token(self) -> bytes:
        """One subscriber's way in, on this host or another: open it once with
        `WeightSubscriber`. A token nobody opens keeps its record until the publisher closes."""
        with self._turns:
            return self._token()

    def _token(self) -> bytes:
        words = self._known()
        states = [words[word(i, STATE)] for i in range(count(words))]
        # a record of a dead subscriber last: one that was only frozen may still write into it
        free = (
            [i for i, state in enumerate(states) if state in (FREE, CLOSED)]
            or [self._used] * (self._used < MAX_READERS)
            or [i for i, state in enumerate(states) if state == GONE]
        )
        if not free:
            raise ValueError(
                f"a publisher across hosts has at most {MAX_READERS} tokens "
                f"open or unopened: close subscribers, or make a new publisher"
            )
        index, serial = free[0], next(self._serials)
        self._used = max(self._used, index + 1)
        for field, value in (
            (PID, 0),
            (HOST, 0),
            (SHARE, 0),
            (SERIAL, serial),
            (ACK, -1),
            (BEAT, 0),
            (UP, -1),
            (LEADER, -1),
            (STATE, PENDING),
        ):
            self._words[word(index, field)] = value
        if self.relay:
            self._cards[index * CARD_BYTES : (index + 1) * CARD_BYTES] = 0
        control = Control(
            self._header,
            self._control(word(index, STATE), FIELDS),
            self._control(word(index, STATE), CLAIMED),
            self._control(word(index, ACK), 1),
            self._control(word(index, BEAT), 1),
            self._cards_desc,
            self._blocks_desc,
            self._records_desc,
        )
        return RemoteToken(
            self._endpoint.metadata(),
            self.device,
            self._nbytes,
            serial,
            index,
            self._chunk,
            control,
            tuple(self._data),
            self._table,
        ).to_bytes()

    def _known(self) -> list[int]:
        """The control words up to the last record handed out, read once."""
        return self._words[: word(self._used, 0)].tolist()

    def _arrange(self) -> None:
        """The relay's places for the next generation, over the subscribers attached now (one
        that attaches later pulls it from the trainer)."""
        words = self._known()
        members = [
            Member(words[word(i, HOST)], words[word(i, SHARE)], i)
            for i in range(count(words))
            if words[word(i, STATE)] == ATTACHED
        ]
        for index, place in chain(members).items():
            for field, value in ((UP, place.upstream), (LEADER, place.leader)):
                if words[word(index, field)] != value:
                    self._words[word(index, field)] = value

    @counted
    def publish(self, *, timeout: float | None = None, checksum: bool = False) -> int:
        """As for one host: the new generation is visible once the device work that wrote it is
        done (`WeightPublisher.publish` waits for the acknowledgements); `checksum` publishes
        its CRC-32 with it."""
        with self._turns:
            if self._in_place is not None:
                self._in_place.check()
            generation = self.generation + 1
            self._wait(generation - self._buffers, ACK_TIMEOUT if timeout is None else timeout)
            if self.copy:
                assert self._storage is not None
                self._words[FILLING] = generation  # subscribers reading it drop the pull
                fill(
                    self._storage,
                    (generation % 2) * self._nbytes,
                    self._table,
                    named_weights(self._source, detach=False),
                )
            synchronize(self.device)
            assert self._storage is not None
            word = SUMS + pair(generation)  # nobody holds generation - 2 any more
            start = (generation % self._buffers) * self._nbytes
            self._words[word + 1] = (
                crc32(self._storage, start, self._nbytes) if checksum else NO_SUM
            )
            self._words[word] = generation
            row = self._blocks[pair(generation) // 2]  # for a partial pull's verify()
            row[0] = -1
            if checksum and self.block_checksums:  # ~1.7 more passes: only when asked
                row[1:] = torch.tensor(block_crc32s(self._storage, start, self._nbytes))
                row[0] = generation
            self.generation = generation
            if self.relay:
                self._arrange()
            self._words[PUBLISHED] = generation
        return generation

    @counted
    def wait_acks(self, generation: int, timeout: float | None = None) -> None:
        """As for one host; dead subscribers are those whose heartbeat stood still for
        LIVENESS seconds. With copy=False, once the newest generation is acknowledged the
        trainer may write: a subscriber still pulling it then pulls again."""
        self._wait(generation, timeout)
        if not self.copy and generation == self.generation:
            self._words[FILLING] = generation + 1

    def _wait(self, generation: int, timeout: float | None) -> None:
        """Polls the records until every attached subscriber acknowledged `generation`, paced:
        its polls cost the trainer's CPU for as long as the engines take."""
        backoff = Backoff(timeout, first=0.00005, longest=0.001, pace=0.01)
        while True:
            self._calls.check()
            records = self._records(self._adopt(), mark=True)
            waiting = unacknowledged(records, generation, PUBLISHER_WORDS)
            if not waiting:
                return
            if backoff.expired():
                raise acks_timeout(records, waiting, timeout, generation, PUBLISHER_WORDS.readers)
            backoff.pause()

    def _records(self, words: list[int], mark: bool = False) -> Records:
        """The records in `words` (the control words, read once) for the scans of `_readers`: a
        subscriber whose heartbeat stood still is dead, marked GONE with `mark`."""
        now = time.monotonic()

        def died(index: int) -> bool:
            if not self._silent(index, words, now):
                return False
            if mark:
                self._words[word(index, STATE)] = GONE
            return True

        used = count(words)
        return Records(
            lambda i: words[word(i, STATE)],
            lambda i: words[word(i, ACK)],
            lambda i: words[word(i, PID)],
            died,
            lambda: used,
        )

    def _adopt(self) -> list[int]:
        """The control words, once every subscriber that attached since the last look is no
        longer waited for a generation it cannot get: with copy=False, the published one once
        the trainer may write it. (It acknowledges nothing newer before that is published.)"""
        words = self._known()
        published, filling = words[PUBLISHED], words[FILLING]
        for i in range(count(words)):  # the records of this copy: token() may add one meanwhile
            serial = words[word(i, SERIAL)]
            if words[word(i, STATE)] != ATTACHED or self._adopted.get(i) == serial:
                continue
            self._adopted[i] = serial
            if filling >= published + self._buffers and words[word(i, ACK)] < published:
                self._words[word(i, ACK)] = words[word(i, ACK)] = published
        return words

    def _silent(self, index: int, words: list[int], now: float) -> bool:
        """Whether the record's heartbeat stood still for LIVENESS seconds of our looking."""
        serial, beat = words[word(index, SERIAL)], words[word(index, BEAT)]
        seen = self._beats.get(index)
        if seen is None or (seen.serial, seen.beat) != (serial, beat):
            self._beats[index] = _Beat(serial, beat, now)
            return False
        return now - seen.seen > _remote_token.LIVENESS

    @counted
    def wait_subscribers(self, count: int, timeout: float = ATTACH_TIMEOUT) -> None:
        """Return once `count` subscribers opened their tokens; TimeoutError after `timeout`."""
        backoff = Backoff(timeout, first=0.0001, longest=0.01)
        while True:
            self._calls.check()
            now = attached(self._records(self._known()))
            if now >= count:
                return
            if backoff.expired():
                raise attach_timeout(now, count, timeout, PUBLISHER_WORDS.readers)
            backoff.pause()

    def subscribers(self) -> dict[int, dict]:
        """As for one host; with relay also each one's place for the newest generation: its
        `upstream` in the chain (a record's index; -1: the trainer) and its `leader`, the record
        whose buffers it maps instead of pulling (-1: none)."""
        words = self._known()
        found = {
            i: {
                "state": label(state),
                "acknowledged": words[word(i, ACK)],
                "pid": words[word(i, PID)],
            }
            for i in range(count(words))
            if (state := words[word(i, STATE)]) != FREE
        }
        if self.relay:
            for index, record in found.items():
                record["upstream"] = words[word(index, UP)]
                record["leader"] = words[word(index, LEADER)]
        return found

    def close(self) -> None:
        """The registrations and the endpoint go (once calls under way in other threads left):
        subscribers' next reads fail (PeerGoneError, saying so). Idempotent."""
        if self._calls.close():
            self._calls.release(self._release)

    def _release(self) -> None:
        self._let_go()
        self._storage, self._source = None, {}
        self._cards = torch.empty(0, dtype=torch.uint8)  # its fd-backed memory goes
        self._blocks = torch.empty(0, 0, dtype=torch.int64)  # as the block sums' does
        if hasattr(self, "_words"):  # its fd-backed memory goes; subscribers() still answers
            self._words = self._words.clone()
