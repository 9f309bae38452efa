"""A generation's checksum: CRC-32 of its bytes, which a publisher computes once its device
work is done and a subscriber computes again over what it holds. Read where the bytes lie when
they are host memory (the CPU, a device whose memory is host memory), else through the host in
bounded pieces: one pass over the bytes either way, no larger copy than a piece."""
import ctypes
import zlib

import torch

from ._host import host_addressable

__all__ = ["crc32"]

_PIECE = 64 << 20  # bytes copied to the host at a time for a device whose memory is not host's


def crc32(storage: torch.UntypedStorage, start: int, nbytes: int) -> int:
    """CRC-32 of `storage`'s bytes [start, start + nbytes), its device work done by the caller."""
    if not 0 <= start <= start + nbytes <= storage.nbytes():
        raise ValueError(f"bytes {start}..{start + nbytes} are outside a storage of "
                         f"{storage.nbytes()} bytes")
    if not nbytes:
        return 0
    if storage.device.type == "cpu" or host_addressable(storage.device):
        return zlib.crc32((ctypes.c_char * nbytes).from_address(storage.data_ptr() + start))
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    crc = 0
    for at in range(start, start + nbytes, _PIECE):
        piece = whole[at:min(at + _PIECE, start + nbytes)].cpu()
        crc = zlib.crc32((ctypes.c_char * piece.numel()).from_address(piece.data_ptr()), crc)
    return crc
