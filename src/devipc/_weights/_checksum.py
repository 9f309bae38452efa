"""A generation's checksum: CRC-32 of its bytes, which a publisher computes once its device
work is done and a subscriber computes again over what it holds. Read where the bytes lie when
they are host memory (the CPU, a device whose memory is host memory), else through the host in
bounded pieces: one pass over the bytes either way, no larger copy than a piece.

Both publishers keep the sums in SUM_WORDS words of their control header: a (generation,
CRC-32) pair per parity, rewritten only once no reader holds the generation two back.

A publisher across hosts also publishes the CRC-32s of the generation's blocks (`blocks`,
`block_size`): an engine that pulls only part of a generation (a sharded engine's slices)
pulls whole blocks and checks each one it holds."""

import ctypes
import zlib
from collections.abc import Sequence

import torch

from .._core._host import host_addressable

__all__ = [
    "NO_SUM",
    "SUM_WORDS",
    "block_crc32s",
    "block_size",
    "blocks",
    "crc32",
    "pair",
    "published_sum",
]

NO_SUM = -1  # in a pair's CRC-32 word: published without one
SUM_WORDS = 4

_PIECE = 64 << 20  # bytes copied to the host at a time for a device whose memory is not host's
_MIN_BLOCK = 64  # bytes: a block's least size
_MAX_BLOCKS = 1 << 16  # per generation: their sums, 512 KiB of int64 words at most


def block_size(nbytes: int) -> int:
    """The bytes of each block of a generation of `nbytes` (the last one may be shorter): a
    power of two, small enough that a partial pull reads few bytes beyond its own, large
    enough that the sums stay at most _MAX_BLOCKS."""
    return max(_MIN_BLOCK, 1 << (-(-nbytes // _MAX_BLOCKS) - 1).bit_length())


def blocks(nbytes: int) -> int:
    """How many blocks a generation of `nbytes` has."""
    return -(-nbytes // block_size(nbytes))


def pair(generation: int) -> int:
    """Where `generation`'s (generation, CRC-32) pair starts among the SUM_WORDS words. Write
    its CRC-32 word first, then its generation word."""
    return 2 * (generation % 2)


def published_sum(words: Sequence[int], generation: int) -> int | None:
    """The CRC-32 published with `generation` in the SUM_WORDS `words`, or None: none."""
    at = pair(generation)
    crc = words[at + 1]
    return crc if words[at] == generation and crc != NO_SUM else None


def crc32(storage: torch.UntypedStorage, start: int, nbytes: int) -> int:
    """CRC-32 of `storage`'s bytes [start, start + nbytes), its device work done by the caller."""
    _check_range(storage, start, nbytes)
    if not nbytes:
        return 0
    if host_addressable(storage.device):
        return zlib.crc32((ctypes.c_char * nbytes).from_address(storage.data_ptr() + start))
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    crc = 0
    for at in range(start, start + nbytes, _PIECE):
        piece = whole[at : min(at + _PIECE, start + nbytes)].cpu()
        crc = zlib.crc32((ctypes.c_char * piece.numel()).from_address(piece.data_ptr()), crc)
    return crc


def block_crc32s(storage: torch.UntypedStorage, start: int, nbytes: int) -> list[int]:
    """The CRC-32 of each `block_size(nbytes)` block of `storage`'s bytes [start, start +
    nbytes), its device work done by the caller; through the host a piece at a time."""
    _check_range(storage, start, nbytes)
    block = block_size(nbytes)
    if storage.device.type == "cpu" or host_addressable(storage.device):
        return _block_sums(storage.data_ptr() + start, nbytes, block)
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    sums: list[int] = []
    piece = max(block, _PIECE // block * block)
    for at in range(start, start + nbytes, piece):
        host = whole[at : min(at + piece, start + nbytes)].cpu()
        sums += _block_sums(host.data_ptr(), host.numel(), block)
    return sums


def _block_sums(address: int, nbytes: int, block: int) -> list[int]:
    return [
        zlib.crc32((ctypes.c_char * min(block, nbytes - at)).from_address(address + at))
        for at in range(0, nbytes, block)
    ]


def _check_range(storage: torch.UntypedStorage, start: int, nbytes: int) -> None:
    if not 0 <= start <= start + nbytes <= storage.nbytes():
        raise ValueError(
            f"bytes {start}..{start + nbytes} are outside a storage of {storage.nbytes()} bytes"
        )
