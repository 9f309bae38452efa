"""Batched copies (`_copies`): the one table of (destination, source, bytes) rows a device's
`copy_batch` takes, from columns of any form, and copy_pairs' batch or its pair-by-pair path."""

import array

import pytest
import torch

from devipc._core import _copies
from devipc_openreg._ipc_hooks import OpenRegIpcHooks


def test_a_table_is_its_columns_side_by_side():
    table = _copies.copy_table(
        array.array("q", [1, 2]), torch.tensor([3, 4]), array.array("q", [5, 6])
    )
    assert table.dtype == torch.int64 and table.is_contiguous()
    assert table.tolist() == [[1, 3, 5], [2, 4, 6]]
    empty = array.array("q")
    assert _copies.copy_table(empty, empty, empty).shape == (0, 3)


@pytest.fixture
def tables(monkeypatch):
    """The tables openreg's copy_batch was given."""
    given = []
    original = OpenRegIpcHooks.copy_batch

    def counted(self, device_index, table):
        given.append(table.clone())
        original(self, device_index, table)

    monkeypatch.setattr(OpenRegIpcHooks, "copy_batch", counted)
    return given


def _pairs():
    sources = [torch.arange(n, dtype=torch.float32, device="openreg") for n in (3, 5, 0)]
    return [(torch.zeros_like(source), source) for source in sources]


def test_plain_pairs_go_as_one_batch(tables):
    pairs = _pairs()
    strided = torch.zeros(4, 2, device="openreg").t()
    pairs.append((strided, torch.ones(2, 4, device="openreg")))
    _copies.copy_pairs(pairs)
    (table,) = tables
    assert table.tolist() == [
        [dst.data_ptr(), src.data_ptr(), dst.nbytes] for dst, src in pairs[:2]
    ]  # neither the empty nor the strided
    torch.accelerator.synchronize()
    assert all(torch.equal(dst.cpu(), src.cpu()) for dst, src in pairs)


def test_without_copy_batch_each_pair_is_copied(monkeypatch):
    monkeypatch.setattr(OpenRegIpcHooks, "copy_batch", None)  # the contract's default
    assert _copies.batch_copier(torch.device("openreg", 0)) is None
    assert not _copies.copy_batched(
        torch.device("openreg", 0),
        array.array("q", [1]),
        array.array("q", [2]),
        array.array("q", [3]),
    )
    pairs = _pairs()
    _copies.copy_pairs(pairs)
    torch.accelerator.synchronize()
    assert all(torch.equal(dst.cpu(), src.cpu()) for dst, src in pairs)
    assert _copies.batch_copier(torch.device("cpu")) is None
