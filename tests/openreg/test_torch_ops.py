"""Ops on openreg give the CPU's results, run in place on openreg's memory (no copy of operands),
and keep torch's aliasing: in-place, out= and view ops write and share the device memory."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import devipc_openreg  # noqa: F401  (registers the device where autoload is off)


def _on(device, tensors):
    return [t.detach().to(device).requires_grad_(t.requires_grad) for t in tensors]


def _conv2d(x, w, b):
    return [torch.nn.functional.conv2d(x, w, b, stride=2, padding=1)]


def _conv_transpose2d(x, w, b):
    return [torch.nn.functional.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1)]


def _embedding(w, ids):
    return [torch.nn.functional.embedding(ids, w)]


def _sort(x):
    values, indices = torch.sort(x, dim=1, descending=True)
    return [values, indices]


def _topk(x):
    values, indices = torch.topk(x, 3, dim=1)
    return [values, indices]


torch.manual_seed(0)
CASES = {
    "conv2d": (
        _conv2d,
        [
            torch.randn(2, 3, 9, 9, requires_grad=True),
            torch.randn(4, 3, 3, 3, requires_grad=True),
            torch.randn(4, requires_grad=True),
        ],
    ),
    "conv_transpose2d": (
        _conv_transpose2d,
        [
            torch.randn(2, 4, 5, 5, requires_grad=True),
            torch.randn(4, 2, 3, 3, requires_grad=True),
            torch.randn(2, requires_grad=True),
        ],
    ),
    "embedding": (
        _embedding,
        [torch.randn(10, 4, requires_grad=True), torch.tensor([[1, 3, 3], [0, 9, 1]])],
    ),
    "index": (
        lambda x, i: [x[i]],
        [torch.randn(6, 5, requires_grad=True), torch.tensor([4, 0, 4])],
    ),
    "index_select": (
        lambda x, i: [x.index_select(1, i)],
        [torch.randn(6, 5, requires_grad=True), torch.tensor([2, 2, 0])],
    ),
    "gather": (
        lambda x, i: [x.gather(1, i)],
        [torch.randn(4, 5, requires_grad=True), torch.randint(0, 5, (4, 3))],
    ),
    "scatter": (
        lambda x, i, s: [x.scatter(1, i, s)],
        [
            torch.randn(3, 5, requires_grad=True),
            torch.tensor([[0, 1], [2, 3], [4, 0]]),
            torch.randn(3, 2, requires_grad=True),
        ],
    ),
    "scatter_add": (
        lambda x, i, s: [x.scatter_add(1, i, s)],
        [
            torch.randn(3, 5, requires_grad=True),
            torch.tensor([[0, 0], [2, 2], [4, 4]]),
            torch.randn(3, 2, requires_grad=True),
        ],
    ),
    "sort": (_sort, [torch.randn(4, 6, requires_grad=True)]),
    "topk": (_topk, [torch.randn(4, 6, requires_grad=True)]),
    "contiguous_of_slice": (
        lambda x: [x[:, ::2].contiguous()],
        [torch.randn(5, 8, requires_grad=True)],
    ),
}


def _run(device, fn, inputs):
    """The outputs and the gradients of every input that requires them."""
    args = _on(device, inputs)
    outputs = fn(*args)
    loss = sum(
        (o * torch.arange(o.numel(), device=device).reshape(o.shape)).sum()
        for o in outputs
        if o.is_floating_point()
    )
    loss.backward()
    return [o.detach() for o in outputs] + [a.grad for a in args if a.requires_grad]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_cpu_forward_and_backward(name):
    fn, inputs = CASES[name]
    cpu = _run("cpu", fn, inputs)
    dev = _run("openreg", fn, inputs)
    assert len(cpu) == len(dev)
    for c, d in zip(cpu, dev):
        assert d.device.type == "openreg" and d.dtype == c.dtype and d.shape == c.shape
        assert d.stride() == c.stride()
        torch.testing.assert_close(d.cpu(), c)


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU])
def test_recurrent_modules_match_cpu(cls):
    torch.manual_seed(0)
    cpu_module = cls(4, 5, num_layers=2, batch_first=True)
    dev_module = cls(4, 5, num_layers=2, batch_first=True)
    dev_module.load_state_dict(cpu_module.state_dict())
    dev_module.to("openreg")
    x = torch.randn(3, 7, 4)
    results = []
    for module, device in [(cpu_module, "cpu"), (dev_module, "openreg")]:
        xd = x.detach().to(device).requires_grad_()
        out, _ = module(xd)
        out.square().sum().backward()
        results.append([out.detach(), xd.grad] + [p.grad for p in module.parameters()])
    for c, d in zip(*results):
        assert d.device.type == "openreg"
        torch.testing.assert_close(d.cpu(), c)


def _cpu_bytes_allocated(fn):
    """Bytes the CPU allocator handed out while fn ran (torch's profiler sees every allocation)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
        torch.openreg.synchronize()
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def test_ops_read_the_device_memory_in_place_without_copies():
    x = torch.randn(2048, 2048, device="openreg")  # 16 MiB
    idx = torch.tensor([1, 5, 2000], device="openreg")
    torch.openreg.synchronize()
    before = torch.openreg.memory_allocated()
    torch.openreg.reset_peak_memory_stats()
    ops = [
        lambda: x.index_select(0, idx),
        lambda: x[idx],
        lambda: x.gather(1, idx[None]),
        lambda: x.sum(),
        lambda: torch.nn.functional.embedding(idx, x),
    ]
    for op in ops:
        assert _cpu_bytes_allocated(op) < x.nbytes // 16
    assert torch.openreg.max_memory_allocated() - before < x.nbytes // 16


def test_new_outputs_are_allocated_on_the_device_without_copies():
    x = torch.randn(1024, 1024, device="openreg")
    assert _cpu_bytes_allocated(lambda: x * 2) < x.nbytes // 16
    before = torch.openreg.memory_allocated()
    y = x * 2
    assert torch.openreg.memory_allocated() - before >= y.nbytes  # y lives in device memory
    torch.testing.assert_close(y.cpu(), x.cpu() * 2)


def test_in_place_ops_write_the_same_memory():
    base = torch.zeros(4, 6, device="openreg")
    ptr = base.data_ptr()
    other_view = base.view(24)
    column = base[:, 1]
    column.add_(5)
    base[1:3, ::2].mul_(0).add_(torch.arange(3.0, device="openreg"))
    assert base.data_ptr() == ptr and column.data_ptr() == ptr + base.stride(1) * 4
    expected = torch.zeros(4, 6)
    expected[:, 1].add_(5)
    expected[1:3, ::2].mul_(0).add_(torch.arange(3.0))
    torch.testing.assert_close(other_view.cpu(), expected.view(24))


def test_in_place_op_with_overlapping_operands_matches_cpu():
    cpu = torch.arange(10.0)
    dev = cpu.to("openreg")
    for t in (cpu, dev):
        t[1:].add_(t[:-1].clone())
        t[:5].copy_(t[5:].flip(0))
    torch.testing.assert_close(dev.cpu(), cpu)
    with pytest.raises(RuntimeError, match="single memory location"):
        dev[1:].add_(dev[:-1])  # partial overlap: refused as the CPU refuses it


def test_out_variants_write_the_given_tensor():
    x = torch.randn(5, 4)
    xd = x.to("openreg")
    out = torch.empty(5, 4, device="openreg")
    ptr = out.data_ptr()
    assert torch.mul(xd, 3, out=out) is out and out.data_ptr() == ptr
    torch.testing.assert_close(out.cpu(), x * 3)


def test_out_variants_that_must_resize():
    x = torch.randn(6, 5)
    xd = x.to("openreg")
    idx = torch.tensor([3, 0])
    out = torch.empty(0, device="openreg")
    torch.index_select(xd, 0, idx.to("openreg"), out=out)
    assert out.device.type == "openreg" and out.shape == (2, 5)
    torch.testing.assert_close(out.cpu(), x.index_select(0, idx))
    values = torch.empty(0, device="openreg")
    indices = torch.empty(0, dtype=torch.long, device="openreg")
    result = torch.sort(xd, dim=0, out=(values, indices))
    assert result.values is values and result.indices is indices
    expected = torch.sort(x, dim=0)
    torch.testing.assert_close(values.cpu(), expected.values)
    torch.testing.assert_close(indices.cpu(), expected.indices)
    # Shrinking keeps the memory; the result is still the device tensor passed.
    big = torch.empty(100, device="openreg")
    ptr = big.data_ptr()
    with pytest.warns(UserWarning, match="resized"):  # as on the CPU
        torch.sum(xd, dim=1, out=big)
    assert big.shape == (6,) and big.data_ptr() == ptr
    torch.testing.assert_close(big.cpu(), x.sum(1))


def test_views_alias_device_memory():
    x = torch.arange(12.0).reshape(3, 4).to("openreg")
    views = [
        x.t(),
        x[:, 1],
        x.diagonal(),
        x.unfold(1, 2, 2),
        x.view(2, 6),
        x.narrow(1, 1, 2),
        x.expand(2, 3, 4)[1],
        x.unbind(0)[2],
        x.split(2, dim=1)[1],
    ]
    for v in views:
        assert v.device == x.device and v.untyped_storage().data_ptr() == x.data_ptr()
        assert v._base is x
    x.diagonal().fill_(-1)
    assert torch.equal(x.cpu().diagonal(), torch.full((3,), -1.0))


@pytest.fixture
def library():
    lib = torch.library.Library("devipc_openreg_test", "DEF")  # noqa: TOR901
    yield lib
    lib._destroy()


def test_a_custom_view_op_with_a_cpu_kernel_returns_a_device_view(library):
    # An op of a new namespace reaches the fallback: its CPU kernel's view comes back as an
    # openreg view of the same memory.
    library.define("first_row(Tensor(a) x) -> Tensor(a)")
    library.impl("first_row", lambda x: x[0], "CPU")
    x = torch.arange(6.0, device="openreg").reshape(2, 3)
    row = torch.ops.devipc_openreg_test.first_row(x)
    assert row.device == x.device and row.data_ptr() == x.data_ptr() and row.shape == (3,)
    row.add_(10)
    torch.testing.assert_close(x.cpu()[0], torch.tensor([10.0, 11.0, 12.0]))


def test_custom_op_with_a_meta_kernel_runs_on_openreg_and_meta(library):
    library.define("scaled_rows(Tensor x, Tensor rows, float scale) -> Tensor")
    library.impl("scaled_rows", lambda x, rows, scale: x.index_select(0, rows) * scale, "CPU")
    library.impl(
        "scaled_rows",
        lambda x, rows, scale: x.new_empty((rows.shape[0],) + tuple(x.shape[1:])),
        "Meta",
    )
    x, rows = torch.randn(5, 3), torch.tensor([4, 1])
    op = torch.ops.devipc_openreg_test.scaled_rows
    dev = op(x.to("openreg"), rows.to("openreg"), 2.0)
    assert dev.device.type == "openreg"
    torch.testing.assert_close(dev.cpu(), op(x, rows, 2.0))
    meta = op(x.to("meta"), rows.to("meta"), 2.0)
    assert meta.device.type == "meta" and meta.shape == dev.shape


def test_meta_tensors_shaped_like_device_tensors_predict_the_device_results():
    x = torch.randn(2, 3, 9, 9, device="openreg")
    w = torch.randn(4, 3, 3, 3, device="openreg")
    dev = torch.nn.functional.conv2d(x, w, stride=2)
    meta = torch.nn.functional.conv2d(
        torch.empty_like(x, device="meta"), torch.empty_like(w, device="meta"), stride=2
    )
    assert meta.shape == dev.shape and meta.dtype == dev.dtype
    idx = torch.tensor([1, 0, 1], device="openreg")
    assert torch.empty_like(x, device="meta")[idx].shape == x[idx].shape


class _ScaledExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        y = x.exp() * scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y, None


def test_autograd_function_on_openreg():
    x = torch.randn(4, 3)
    grads = []
    for device in ("cpu", "openreg"):
        xd = x.detach().to(device).requires_grad_()
        y = _ScaledExp.apply(xd, 3.0)
        assert y.device.type == device
        (y * torch.arange(12.0, device=device).reshape(4, 3)).sum().backward()
        grads.append(xd.grad)
    assert grads[1].device.type == "openreg"
    torch.testing.assert_close(grads[1].cpu(), grads[0])


def test_errors_name_openreg_not_the_cpu():
    x = torch.ones(4, device="openreg")
    with pytest.raises(NotImplementedError) as error:
        torch.ops.aten._fused_dropout(x, 0.5)  # a CUDA-only op: no CPU kernel either
    assert "'openreg' backend" in str(error.value) and "'CPU' backend" not in str(error.value)


def test_conjugate_and_negative_views_resolve_as_on_the_cpu():
    # copy_ of such views used to recurse until the stack overflowed (conj and neg bits).
    c = torch.complex(torch.arange(4.0), -torch.arange(4.0))
    results = []
    for device in ("cpu", "openreg"):
        z = c.to(device)
        results.append(
            [
                z.conj().resolve_conj(),
                z.conj() * 2,
                z.conj().imag.clone(),
                z.conj().to(torch.complex128),
                torch.empty_like(z).copy_(z.conj()),
            ]
        )
    for cpu, dev in zip(*results):
        assert dev.device.type == "openreg" and not dev.is_conj()
        torch.testing.assert_close(dev.cpu().resolve_neg(), cpu.resolve_neg())
