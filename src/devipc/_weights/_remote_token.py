"""What a `transport="nixl"` publisher (`_remote_publisher`) and its subscribers
(`_remote_subscriber`) agree on: the layout of the publisher's control block, the token that
carries a subscriber's way in, the heartbeat's timing, and how either side lets go of what it
holds.

The control block is a host tensor of int64 words:

    header: published generation | filling | the CRC-32s of the last two generations
            (generation | CRC-32, -1: none), each pair rewritten only once nobody holds its
            generation
    record per subscriber: state | pid | host key | share key | serial |
            acknowledged generation | heartbeat | upstream (with relay: the record it pulls
            from, -1: the trainer) | leader (with relay: the record whose buffers it maps, -1:
            none)

A subscriber writes its record's first CLAIMED words (its claim), its acknowledgement and its
heartbeat; the publisher writes the rest.

Beside it, the block sums: a host tensor of int64 words, a row per parity (`_checksum.pair`):
generation | the CRC-32 of each of its blocks (`_checksum.blocks`), written before its generation
word, once nobody holds the generation two back; a partial pull reads the row with its data.
"""

import threading
from typing import NamedTuple

import torch

from .. import p2p
from .._core._table import Table
from ._checksum import SUM_WORDS, blocks
from ._common import token_reader, token_writer
from ._readers import MAX_READERS
from ._relay import CARD_BYTES

__all__ = [
    "ACK",
    "BEAT",
    "CARDS_BYTES",
    "CLAIMED",
    "CONTROL_WORDS",
    "FIELDS",
    "FILLING",
    "HEADER",
    "HEARTBEAT",
    "HOST",
    "LEADER",
    "LIVENESS",
    "PID",
    "PUBLISHED",
    "SERIAL",
    "SHARE",
    "STATE",
    "SUMS",
    "UP",
    "Control",
    "RemoteToken",
    "block_words",
    "count",
    "let_go",
    "word",
]

HEARTBEAT = 0.5  # seconds between a subscriber's heartbeats
LIVENESS = 10.0  # seconds of a still heartbeat after which a subscriber counts as dead
_JOIN = 5.0  # seconds a closing subscriber waits for its heartbeat thread
_DESCRIPTOR_BYTES = 1 << 20
_METADATA_BYTES = 1 << 20  # a NIXL agent's metadata
_WORD_BYTES = 8  # an int64
PUBLISHED, FILLING, SUMS = 0, 1, 2  # header words; from SUMS, the CRC-32s (`_checksum`)
HEADER = SUMS + SUM_WORDS  # words
# a record: what its subscriber writes (state, pid, host key, share key: its claim; ack,
# heartbeat), what the publisher writes (serial; the relay's upstream and leader: a record's
# index, or -1)
STATE, PID, HOST, SHARE, SERIAL, ACK, BEAT, UP, LEADER = range(9)
FIELDS = 9
CLAIMED = SHARE + 1  # a claim's words: state, pid, host and share keys
CONTROL_WORDS = HEADER + MAX_READERS * FIELDS
CARDS_BYTES = MAX_READERS * CARD_BYTES  # the relay's card slots, one per record
RECORDS_BYTES = MAX_READERS * FIELDS * _WORD_BYTES  # every record


def word(index: int, field: int) -> int:
    """Where `field` of record `index` lies in the control block."""
    return HEADER + index * FIELDS + field


def block_words(nbytes: int) -> int:
    """The words of one row of the block sums of a generation of `nbytes`."""
    return 1 + blocks(nbytes)


def count(words: list[int]) -> int:
    """How many records a copy of the control words holds."""
    return (len(words) - HEADER) // FIELDS


class Control(NamedTuple):
    """A subscriber's descriptors of the publisher's control block: the header, its record
    whole, its claim, its ack, its heartbeat; the relay's cards (empty without relay); the
    block sums, both rows; and every record (the relay's chain, read to find the engines ahead
    of an upstream; empty without relay)."""

    header: bytes
    record: bytes
    claim: bytes
    ack: bytes
    beat: bytes
    cards: bytes
    blocks: bytes
    records: bytes

    def sizes(self, relay: bool, nbytes: int) -> list[tuple[bytes, int]]:
        """Each descriptor with the bytes it must span (the cards' only with `relay`), for
        buffers of `nbytes`."""
        words = (
            (self.header, HEADER),
            (self.record, FIELDS),
            (self.claim, CLAIMED),
            (self.ack, 1),
            (self.beat, 1),
            (self.blocks, 2 * block_words(nbytes)),
        )
        sizes = [(desc, length * _WORD_BYTES) for desc, length in words]
        if relay:
            sizes += [(self.cards, CARDS_BYTES), (self.records, RECORDS_BYTES)]
        return sizes


class RemoteToken(NamedTuple):
    """A subscriber's way in across hosts: the publisher's endpoint, its device, a buffer's
    size, the token's serial, its record's index, the relay's chunk (0: no relay), descriptors
    of the control block (`Control`) and of each buffer, and the tensors' table."""

    metadata: bytes
    device: torch.device
    nbytes: int
    serial: int
    record: int
    chunk: int
    control: Control
    data: tuple[bytes, ...]
    table: Table

    def to_bytes(self) -> bytes:
        writer = token_writer("nixl").bytes(self.metadata, _METADATA_BYTES)
        writer.device(self.device).int(self.nbytes).int(self.serial).int(self.record)
        writer.int(self.chunk)
        for desc in self.control:
            writer.bytes(desc, _DESCRIPTOR_BYTES)
        writer.int(len(self.data))
        for desc in self.data:
            writer.bytes(desc, _DESCRIPTOR_BYTES)
        self.table.write(writer)
        return writer.done()

    @classmethod
    def from_bytes(cls, token: bytes | bytearray | memoryview) -> "RemoteToken":
        _, reader = token_reader(token, "nixl")
        metadata = reader.bytes("publisher endpoint metadata", _METADATA_BYTES)
        device = reader.device()
        nbytes = reader.int("buffer size", 1)
        serial = reader.int("token serial", 1)
        record = reader.int("record index", 0, MAX_READERS - 1)
        chunk = reader.int("relay chunk", 0, max(nbytes, 1))
        control = Control(
            *(reader.bytes("control descriptor", _DESCRIPTOR_BYTES) for _ in Control._fields)
        )
        data = tuple(
            reader.bytes("weights descriptor", _DESCRIPTOR_BYTES)
            for _ in range(reader.int("buffer count", 1, 2))
        )
        table = Table.read(reader, nbytes)
        reader.end()
        return cls(metadata, device, nbytes, serial, record, chunk, control, data, table)


def let_go(
    endpoints: list[p2p.Endpoint],
    ids: list[int],
    stop: threading.Event | None = None,
    threads: list[threading.Thread] | None = None,
) -> None:
    """End what a publisher or a subscriber holds (its heartbeat, registrations, endpoints),
    also when it is dropped unclosed: a registry listener would keep its NIXL agents alive."""
    if stop is not None:
        stop.set()  # a subscriber no longer beats: the publisher finds it dead
    for thread in threads or ():
        if thread is not threading.current_thread():
            thread.join(_JOIN)  # longer only while a write hangs on a vanished publisher
    for reg_id in ids:
        p2p.deregister(reg_id)
    ids.clear()
    for endpoint in endpoints:
        endpoint.close()
