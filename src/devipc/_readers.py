"""The records a publisher keeps of its readers (an arena's consumers, a weight publisher's
subscribers across hosts): the states a record goes through, the most records one keeps, and the
words of a wait that ran out. Both the arena and the NIXL publisher write these states into shared
words, so a number read there may be anything: `label` names the ones it knows."""
import enum
from collections.abc import Iterable
from typing import NamedTuple

from ._errors import AckTimeoutError

__all__ = ["ARENA_WORDS", "ATTACHED", "CLOSED", "FREE", "GONE", "MAX_READERS", "PENDING",
           "PUBLISHER_WORDS", "ReaderState", "Words", "acks_timeout", "attach_timeout", "label"]

MAX_READERS = 64


class ReaderState(enum.IntEnum):
    FREE = 0  # never used, or given back
    PENDING = 1  # handed out in a token or attachment, not opened yet
    ATTACHED = 2  # opened: its acknowledgements are waited for
    CLOSED = 3  # its reader closed it
    GONE = 4  # its reader died (seen by its lock, or a still heartbeat)


FREE, PENDING, ATTACHED, CLOSED, GONE = ReaderState
_LABELS: dict[int, str] = {FREE: "free", PENDING: "not opened yet", ATTACHED: "attached",
                           CLOSED: "closed", GONE: "died"}


class Words(NamedTuple):
    """What errors call the parts, in the words of the API the user called: an arena's own, or
    a weight publisher's (whose users never meet arenas, attachments or records)."""

    producer: str  # the object that publishes
    reader: str  # the object that reads
    consumer: str  # one who reads, in a sentence
    readers: str  # those who read, in a sentence
    token: str  # what a reader opens once
    one_each: str  # how to give each reader its own


ARENA_WORDS = Words("arena", "arena reader", "arena consumer", "consumers", "arena attachment",
                    "attach once per consumer")
PUBLISHER_WORDS = Words("WeightPublisher", "WeightSubscriber", "subscriber", "subscribers",
                        "WeightPublisher token", "one token() per subscriber")


def label(state: int) -> str:
    """A state word in words: its label, or the number when it is no state (a damaged record)."""
    return _LABELS.get(state, str(state))


def attach_timeout(attached: int, count: int, timeout: float, readers: str) -> TimeoutError:
    return TimeoutError(f"{attached} of {count} {readers} attached within {timeout} s")


def acks_timeout(timeout: float | None, generation: int, readers: str,
                 waiting: Iterable[str]) -> AckTimeoutError:
    """`waiting`: one description per reader not yet acknowledging, e.g. "3 (pid 12, ...)"."""
    return AckTimeoutError(f"after {timeout} s, {readers} " + ", ".join(waiting)
                           + f" have not acknowledged generation {generation}")
