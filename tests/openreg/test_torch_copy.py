"""Copies in every direction, views that alias, and stream ordering of asynchronous copies.

A stream is held back with a semaphore it waits on (the `gate` fixture, a `_native.Gate`), never
with sleeps, so "not finished yet" is observed deterministically.
"""

import functools
import threading

import pytest
import torch

import devipc_openreg  # noqa: F401  (registers the device where autoload is off)


def hold(gate, stream):
    gate.hold_torch_stream(stream)


DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_host_device_round_trip(dtype):
    cpu = (torch.arange(24) % 5).to(dtype).reshape(4, 6)
    dev = cpu.to("openreg")
    assert dev.device == torch.device("openreg", 0) and dev.dtype == dtype
    assert torch.equal(dev.cpu(), cpu)


@pytest.mark.parametrize(
    "src, dst",
    [
        ("cpu", "openreg"),
        ("openreg", "cpu"),
        ("openreg", "openreg"),
        ("openreg:0", "openreg:1"),
        ("openreg:1", "openreg:0"),
    ],
)
def test_copy_directions_with_conversion_and_non_contiguous(src, dst):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    source = base.to(src)[:, 1::2].t()  # non-contiguous
    out = torch.zeros(4, 6, dtype=torch.float64, device=dst)
    out.copy_(source)
    assert torch.equal(out.cpu(), base[:, 1::2].t().double())
    same = torch.empty(4, 6, device=dst).copy_(source)
    assert torch.equal(same.cpu(), base[:, 1::2].t())


def test_copy_into_non_contiguous_destination_keeps_gaps():
    dst = torch.full((4, 6), -1.0, device="openreg")
    dst[:, ::2] = torch.arange(12.0).reshape(4, 3).to("openreg")
    expected = torch.full((4, 6), -1.0)
    expected[:, ::2] = torch.arange(12.0).reshape(4, 3)
    assert torch.equal(dst.cpu(), expected)


def test_broadcasting_copy_and_scalar_assignment():
    x = torch.zeros(3, 4, device="openreg")
    x.copy_(torch.arange(4.0))
    x[1, 2] = 7
    expected = torch.arange(4.0).repeat(3, 1)
    expected[1, 2] = 7
    assert torch.equal(x.cpu(), expected)
    assert x[1, 2].item() == 7


def test_non_blocking_copies_round_trip():
    cpu = torch.randn(64, 64)
    dev = cpu.to("openreg", non_blocking=True)
    back = dev.to("cpu", non_blocking=True)
    torch.accelerator.synchronize()
    assert torch.equal(back, cpu)


def test_views_alias_their_base():
    base = torch.zeros(4, 6, device="openreg")
    views = [
        base[1],
        base.t()[2],
        base.view(24)[3:5],
        base.reshape(2, 12)[1],
        base.unfold(1, 2, 2)[0, 1],
        base.narrow(0, 2, 1),
        base.diagonal(),
        base.unsqueeze(0)[0, 3],
        base.flatten()[-2:],
    ]
    for value, view in enumerate(views, start=1):
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        view.fill_(value)
    expected = torch.zeros(4, 6)
    for value, view in enumerate(
        [
            expected[1],
            expected.t()[2],
            expected.view(24)[3:5],
            expected.reshape(2, 12)[1],
            expected.unfold(1, 2, 2)[0, 1],
            expected.narrow(0, 2, 1),
            expected.diagonal(),
            expected.unsqueeze(0)[0, 3],
            expected.flatten()[-2:],
        ],
        start=1,
    ):
        view.fill_(value)
    assert torch.equal(base.cpu(), expected)


def test_complex_views_alias():
    c = torch.zeros(3, dtype=torch.complex64, device="openreg")
    torch.view_as_real(c)[1, 1] = 5
    assert c[1].item() == 5j
    r = torch.zeros(3, 2, device="openreg")
    torch.view_as_complex(r)[2] = 1 + 2j
    assert torch.equal(r[2].cpu(), torch.tensor([1.0, 2.0]))


def test_no_view_op_falls_back():
    """Every aten view op with a CPU kernel has an openreg (or composite) kernel: a CPU fallback
    would return a copy where an alias is due."""
    missing = []
    for schema in torch._C._jit_get_all_schemas():
        aliases = any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        )
        if not schema.name.startswith("aten::") or not aliases:
            continue
        name = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        has = functools.partial(torch._C._dispatch_has_kernel_for_dispatch_key, name)
        try:
            if not has("CPU") or "nested" in name:
                continue
        except RuntimeError:  # a schema without an operator registration
            continue
        if not any(
            has(k)
            for k in (
                "PrivateUse1",
                "CompositeImplicitAutograd",
                "CompositeExplicitAutograd",
                "CompositeExplicitAutogradNonFunctional",
            )
        ):
            missing.append(name)
    assert missing == []


def test_resize_set_and_storage_resize():
    x = torch.arange(3.0, device="openreg")
    x.resize_(10)
    assert x.shape == (10,) and torch.equal(x[:3].cpu(), torch.arange(3.0))
    x.untyped_storage().resize_(80)
    assert x.untyped_storage().nbytes() == 80
    y = torch.empty(0, device="openreg").set_(x.untyped_storage(), 1, (2,), (1,))
    assert torch.equal(y.cpu(), torch.tensor([1.0, 2.0]))
    y.set_()
    assert y.numel() == 0 and y.device == x.device


def test_side_stream_copy_is_asynchronous_and_keeps_source_alive(gate):
    side = torch.Stream(device="openreg")
    hold(gate, side)
    with side:
        source = torch.arange(1 << 16, dtype=torch.float32)
        dev = source.to("openreg", non_blocking=True)
        done = torch.Event(device="openreg")
        done.record()
    del source  # the stream still holds the host memory it reads
    assert not side.query() and not done.query()
    gate.open()
    done.synchronize()
    assert done.query()
    with side:
        assert torch.equal(dev.cpu(), torch.arange(1 << 16, dtype=torch.float32))
    side.synchronize()
    assert side.query()


def test_op_waits_for_pending_work_on_the_current_stream(gate):
    hold(gate, torch.accelerator.current_stream())
    x = torch.ones(1000).to("openreg", non_blocking=True)
    threading.Timer(0.2, gate.open).start()
    assert x.sum().item() == 1000  # the fallback synchronizes the stream before reading


def test_wait_stream_orders_side_stream_work(gate):
    side = torch.Stream(device="openreg")
    hold(gate, side)
    with side:
        x = torch.full((256,), 3.0).to("openreg", non_blocking=True)
    ready = side.record_event()
    torch.accelerator.current_stream().wait_event(ready)
    main = torch.accelerator.current_stream()
    assert not main.query()  # main waits for the held side stream
    gate.open()
    main.synchronize()
    assert x.sum().item() == 768


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pending_non_blocking_copy_keeps_host_storage_from_being_resized(gate, direction):
    """Resizing the host tensor of a queued copy would free the memory the copy reads or writes:
    until the copy ran, the storage refuses to resize, then it resizes as before."""
    dev = torch.full((1024,), 7.0, device="openreg")
    host = torch.zeros(1024)
    hold(gate, torch.accelerator.current_stream())
    if direction == "h2d":
        host.fill_(7.0)
        dev = host.to("openreg", non_blocking=True)
    else:
        host.copy_(dev, non_blocking=True)
    with pytest.raises(RuntimeError, match="not resizable"):
        host.untyped_storage().resize_(1 << 20)
    gate.open()
    torch.accelerator.synchronize()
    assert torch.equal(host, torch.full((1024,), 7.0)) and torch.equal(dev.cpu(), host)
    host.resize_(1 << 18)  # resizable again
    assert host.untyped_storage().nbytes() == 4 << 18


def test_failed_resize_of_borrowed_memory_leaves_the_tensor_unchanged():
    """Memory that is not openreg's to reallocate (as from another process) cannot grow: resize_
    and set_ raise, and the tensor keeps sizes within its memory."""
    from devipc._core._memory import tensor_from_memory

    base = torch.arange(16.0, device="openreg")
    borrowed = tensor_from_memory(base.data_ptr(), 64, base.device, lambda: None).untyped_storage()
    t = torch.empty(0, device="openreg").set_(borrowed)
    with pytest.raises(RuntimeError, match="cannot be resized"):
        t.resize_(32)
    assert t.shape == (16,) and t.untyped_storage().data_ptr() == base.data_ptr()
    u = torch.zeros(2, device="openreg")
    with pytest.raises(RuntimeError, match="cannot be resized"):
        u.set_(borrowed, 0, (32,), (1,))
    assert u.shape == (2,) and u.untyped_storage().nbytes() == 8
    assert torch.equal(t.cpu(), torch.arange(16.0)) and torch.equal(u.cpu(), torch.zeros(2))
    t.resize_(4)  # shrinking needs no new memory
    assert torch.equal(t.cpu(), torch.arange(4.0))
