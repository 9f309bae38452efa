"""Ops without an openreg kernel run on the CPU through the fallback and still give openreg
tensors, with the same values as on the CPU."""
import pytest
import torch

import devipc.openreg  # noqa: F401  (registers the device where autoload is off)


def both(make):
    cpu = make("cpu")
    dev = make("openreg")
    assert dev.device.type == "openreg"
    return cpu, dev.cpu()


@pytest.mark.parametrize("op", [
    lambda d: torch.arange(12.0, device=d).reshape(3, 4) @ torch.ones(4, 2, device=d),
    lambda d: torch.arange(12.0, device=d).reshape(3, 4).sum(dim=0),
    lambda d: torch.arange(12.0, device=d).reshape(3, 4).t().contiguous().exp(),
    lambda d: torch.where(torch.arange(6, device=d) > 2, 1.0, -1.0),
    lambda d: torch.cat([torch.ones(2, device=d), torch.zeros(3, device=d)]),
    lambda d: torch.arange(10, device=d)[torch.tensor([1, 3, 5], device=d)],
    lambda d: torch.linspace(0, 1, 5, device=d).to(torch.float16),
], ids=["matmul", "sum", "exp_transposed", "where", "cat", "index", "linspace_half"])
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
        return [torch.randn(3, device="openreg").cpu(), torch.rand(3, device="openreg").cpu(),
                torch.randint(0, 10, (4,), device="openreg").cpu(),
                torch.empty(4, device="openreg").normal_(2, 3).cpu(),
                torch.nn.functional.dropout(torch.ones(8, device="openreg"), 0.5).cpu()]
    first, second = draw(), draw()
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_autograd_through_fallback_ops():
    w = torch.randn(3, 3, device="openreg", requires_grad=True)
    (w @ w).sum().backward()
    wc = w.detach().cpu().requires_grad_()
    (wc @ wc).sum().backward()
    assert w.grad.device.type == "openreg"
    torch.testing.assert_close(w.grad.cpu(), wc.grad)
