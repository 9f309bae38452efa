"""The records a publisher keeps of its readers (an arena's consumers, a weight publisher's
subscribers across hosts): the states a record goes through, the most records one keeps, and the
words of a wait that ran out. Both the arena and the NIXL publisher write these states into shared
words, so a number read there may be anything: `label` names the ones it knows."""

import enum
from collections.abc import Callable
from typing import NamedTuple

from .._core._errors import AckTimeoutError, ConsumerDiedError

__all__ = [
    "ARENA_WORDS",
    "ATTACHED",
    "CLOSED",
    "FREE",
    "GONE",
    "MAX_READERS",
    "PENDING",
    "PUBLISHER_WORDS",
    "ReaderState",
    "Records",
    "Words",
    "acks_timeout",
    "attach_timeout",
    "attached",
    "label",
    "unacknowledged",
]

# the most records one publisher keeps: its files are sized for them at construction, sparse
# (a record's memory is touched once handed out), and its scans look only at the records handed
# out so far (`Records.used`), so a publisher of a few engines pays for a few
MAX_READERS = 1024


class ReaderState(enum.IntEnum):
    FREE = 0  # never used, or given back
    PENDING = 1  # handed out in a token or attachment, not opened yet
    ATTACHED = 2  # opened: its acknowledgements are waited for
    CLOSED = 3  # its reader closed it
    GONE = 4  # its reader died (seen by its lock, or a still heartbeat)


FREE, PENDING, ATTACHED, CLOSED, GONE = ReaderState
_LABELS: dict[int, str] = {
    FREE: "free",
    PENDING: "not opened yet",
    ATTACHED: "attached",
    CLOSED: "closed",
    GONE: "died",
}


class Words(NamedTuple):
    """What errors call the parts, in the words of the API the user called: an arena's own, or
    a weight publisher's (whose users never meet arenas, attachments or records)."""

    producer: str  # the object that publishes
    reader: str  # the object that reads
    consumer: str  # one who reads, in a sentence
    readers: str  # those who read, in a sentence
    token: str  # what a reader opens once
    one_each: str  # how to give each reader its own


ARENA_WORDS = Words(
    "arena",
    "arena reader",
    "arena consumer",
    "consumers",
    "arena attachment",
    "attach once per consumer",
)
PUBLISHER_WORDS = Words(
    "WeightPublisher",
    "WeightSubscriber",
    "subscriber",
    "subscribers",
    "WeightPublisher token",
    "one token() per subscriber",
)


def label(state: int) -> str:
    """A state word in words: its label, or the number when it is no state (a damaged record)."""
    return _LABELS.get(state, str(state))


class Records(NamedTuple):
    """A publisher's records as the scans below read them, each a function of a reader's index:
    the arena reads its control file, the NIXL publisher a copy of its control words."""

    state: Callable[[int], int]
    ack: Callable[[int], int]  # the newest generation it acknowledged
    pid: Callable[[int], int]
    died: Callable[[int], bool]  # whether an attached reader is dead (marked GONE once it is)
    used: Callable[[], int]  # how many records were handed out so far: the first ones


def unacknowledged(records: Records, generation: int, words: Words) -> list[int]:
    """The readers a wait for `generation` still waits for: attached, an older one acknowledged.
    ConsumerDiedError names those of them found dead (GONE from then on: named once)."""
    waiting = [
        i
        for i in range(records.used())
        if records.state(i) == ATTACHED and records.ack(i) < generation
    ]
    dead = [(i, records.pid(i)) for i in waiting if records.died(i)]
    if dead:
        raise ConsumerDiedError(dead, generation, words.consumer, words.producer)
    return waiting


def attached(records: Records) -> int:
    """How many readers opened what they were given and live."""
    return sum(records.state(i) == ATTACHED and not records.died(i) for i in range(records.used()))


def attach_timeout(attached: int, count: int, timeout: float, readers: str) -> TimeoutError:
    return TimeoutError(f"{attached} of {count} {readers} attached within {timeout} s")


def acks_timeout(
    records: Records, waiting: list[int], timeout: float | None, generation: int, readers: str
) -> AckTimeoutError:
    """The wait for `generation` ran out with `waiting` (`unacknowledged`) still waited for."""
    return AckTimeoutError(
        f"after {timeout} s, {readers} "
        + ", ".join(
            f"{i} (pid {records.pid(i)}, {label(records.state(i))}, acknowledged {records.ack(i)})"
            for i in waiting
        )
        + f" have not acknowledged generation {generation}"
    )
