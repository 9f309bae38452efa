"""Ops without an openreg kernel run on the CPU through the fallback and still give openreg
tensors, with the same values as on the CPU."""

import warnings

import pytest
import torch

import devipc_openreg  # noqa: F401  (registers the device where autoload is off)


def both(make):
    cpu = make("cpu")
    dev = make("openreg")
    assert dev.device.type == "openreg"
    return cpu, dev.cpu()


@pytest.mark.parametrize(
    "op",
    [
        lambda d: torch.arange(12.0, device=d).reshape(3, 4) @ torch.ones(4, 2, device=d),
        lambda d: torch.arange(12.0, device=d).reshape(3, 4).sum(dim=0),
        lambda d: torch.arange(12.0, device=d).reshape(3, 4).t().contiguous().exp(),
        lambda d: torch.where(torch.arange(6, device=d) > 2, 1.0, -1.0),
        lambda d: torch.cat([torch.ones(2, device=d), torch.zeros(3, device=d)]),
        lambda d: torch.arange(10, device=d)[torch.tensor([1, 3, 5], device=d)],
        lambda d: torch.linspace(0, 1, 5, device=d).to(torch.float16),
    ],
    ids=["matmul", "sum", "exp_transposed", "where", "cat", "index", "linspace_half"],
)
def test_matches_cpu(op):
    cpu, dev = both(op)
    assert torch.equal(cpu, dev)


def test_in_place_and_out_variants_write_device_memory():
    x = torch.ones(2, 3, device="openreg")
    x.mul_(3).add_(1)
    out = torch.empty(0, device="openreg")
    torch.add(x, x, out=out)
    assert out.shape == (2, 3) and torch.equal(out.cpu(), torch.full((2, 3), 8.0))


def test_tensors_on_the_second_device():
    a = torch.arange(4.0, device="openreg:1")
    b = (a * 2).sum()
    assert b.device == torch.device("openreg", 1) and b.item() == 12


def test_random_ops_are_reproducible_with_manual_seed():
    def draw():
        torch.manual_seed(1234)
        return [
            torch.randn(3, device="openreg").cpu(),
            torch.rand(3, device="openreg").cpu(),
            torch.randint(0, 10, (4,), device="openreg").cpu(),
            torch.empty(4, device="openreg").normal_(2, 3).cpu(),
            torch.nn.functional.dropout(torch.ones(8, device="openreg"), 0.5).cpu(),
        ]

    first, second = draw(), draw()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_autograd_through_fallback_ops():
    w = torch.randn(3, 3, device="openreg", requires_grad=True)
    (w @ w).sum().backward()
    wc = w.detach().cpu().requires_grad_()
    (wc @ wc).sum().backward()
    assert w.grad.device.type == "openreg"
    torch.testing.assert_close(w.grad.cpu(), wc.grad)


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


def test_structured_reductions_match_cpu_without_resize_warnings():
    # Structured ops used to reach the CPU through their .out variant, with an output the meta
    # function had sized on openreg; mse_loss's out kernel re-sizes it and warned "An output with
    # one or more elements was resized".
    torch.manual_seed(0)
    x, t = torch.randn(64, 1), torch.randn(64, 1)
    logits, labels = torch.randn(8, 5), torch.randint(0, 5, (8,))

    def run(device):
        xd = x.detach().to(device).requires_grad_()
        loss = torch.nn.functional.mse_loss(xd, t.to(device))
        loss.backward()
        ld = logits.detach().to(device).requires_grad_()
        ce = torch.nn.functional.cross_entropy(ld, labels.to(device))
        ce.backward()
        return [
            loss,
            xd.grad,
            ce,
            ld.grad,
            torch.sum(x.to(device), dim=0),
            torch.mean(x.to(device)),
            torch.nn.functional.smooth_l1_loss(xd, t.to(device)),
            torch.nn.functional.huber_loss(xd, t.to(device), reduction="sum"),
        ]

    cpu = _no_warnings(lambda: run("cpu"))
    dev = _no_warnings(lambda: run("openreg"))
    for c, d in zip(cpu, dev):
        assert d.device.type == "openreg" and d.shape == c.shape
        torch.testing.assert_close(d.detach().cpu(), c.detach())


def test_out_variants_without_resize_warnings():
    x = torch.arange(12.0).reshape(3, 4)
    xd = x.to("openreg")
    out = torch.empty(4, device="openreg")
    _no_warnings(lambda: torch.sum(xd, dim=0, out=out))
    torch.testing.assert_close(out.cpu(), x.sum(0))
    scalar = torch.empty((), device="openreg")
    _no_warnings(lambda: torch.mean(xd, dim=(0, 1), out=scalar))
    torch.testing.assert_close(scalar.cpu(), x.mean())


def test_outputs_land_on_the_openreg_device_of_the_inputs():
    x = torch.arange(3.0, device="openreg:1")
    for y in [torch.tensor(2.0) * x, torch.where(torch.tensor(True), torch.tensor(1.0), x)]:
        assert y.device == torch.device("openreg", 1)


def test_mixing_devices_raises():
    a = torch.ones(2, device="openreg:0")
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(2, device="openreg:1")
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(()).add_(torch.ones((), device="openreg"))


def test_a_cpu_generator_is_refused_as_cuda_refuses_it():
    x = torch.empty(3, device="openreg")
    with pytest.raises(RuntimeError, match="Expected a 'openreg' device type for generator"):
        x.normal_(generator=torch.Generator())
    generator = torch.Generator(device="openreg")
    generator.manual_seed(1)
    first = torch.randn(3, device="openreg", generator=generator).cpu()
    generator.manual_seed(1)
    assert torch.equal(torch.randn(3, device="openreg", generator=generator).cpu(), first)
