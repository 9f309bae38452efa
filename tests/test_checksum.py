"""A generation's block sums: sizes, and the same CRC-32s whether the bytes are read in place
or copied through the host a piece at a time."""

import zlib

import pytest
import torch

from devipc._weights import _checksum
from devipc._weights._checksum import block_crc32s, block_size, blocks


@pytest.mark.parametrize("nbytes", [1, 64, 65, 1 << 20, (1 << 22) + 1, 10 << 30])
def test_blocks_are_powers_of_two_and_few(nbytes):
    block = block_size(nbytes)
    assert block >= 64 and block & (block - 1) == 0
    assert blocks(nbytes) <= 1 << 16
    assert (blocks(nbytes) - 1) * block < nbytes <= blocks(nbytes) * block


def test_each_block_has_its_own_crc32():
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    sums = block_crc32s(data.untyped_storage(), 10, 300)  # 64-byte blocks, the last of 44
    raw = bytes(data.numpy())[10:310]
    assert sums == [zlib.crc32(raw[at : at + 64]) for at in range(0, 300, 64)]
    with pytest.raises(ValueError, match="outside a storage"):
        block_crc32s(data.untyped_storage(), 900, 300)


def test_block_sums_through_the_host_match_those_read_in_place(monkeypatch):
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    expected = block_crc32s(data.untyped_storage(), 7, 4500)
    device = data.to("openreg")
    monkeypatch.setattr(_checksum, "host_addressable", lambda device: False)
    monkeypatch.setattr(_checksum, "_PIECE", 200)  # pieces of 192 bytes: 3 blocks each
    assert block_crc32s(device.untyped_storage(), 7, 4500) == expected
