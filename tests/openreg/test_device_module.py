"""torch.openreg beyond the basics, the paths torch takes through a device module: RNG state
(fork_rng, activation checkpointing), AMP (autocast, GradScaler), device information and memory
info, ipc_collect, pinned host memory.
"""

import os
from multiprocessing.reduction import ForkingPickler

import _native as native
import pytest
import torch
import torch.nn.functional as F
from _support import keep_collector_out
from torch.utils.checkpoint import checkpoint

import devipc_openreg  # noqa: F401  (registers the device where autoload is off)
from devipc_openreg import _runtime


# ---- RNG state ----
@pytest.mark.parametrize(
    "draw",
    [
        lambda: torch.rand(64, device="openreg"),
        lambda: torch.randn(8, 8, device="openreg"),
        lambda: F.dropout(torch.ones(256, device="openreg"), 0.5),
    ],
)
def test_rng_state_round_trip_repeats_the_numbers(draw):
    state = torch.openreg.get_rng_state()
    assert state.device.type == "cpu" and state.dtype == torch.uint8
    first = draw().cpu()
    assert not torch.equal(draw().cpu(), first)  # the generator moved on
    torch.openreg.set_rng_state(state)
    assert torch.equal(draw().cpu(), first)


def test_rng_state_is_per_device_and_all_variants_round_trip():
    states = torch.openreg.get_rng_state_all()
    assert len(states) == torch.openreg.device_count() == 2
    on_1 = torch.rand(16, device="openreg:1").cpu()
    on_0 = torch.rand(16, device="openreg:0").cpu()
    torch.openreg.set_rng_state(states[1], "openreg:1")
    assert torch.equal(torch.rand(16, device="openreg:1").cpu(), on_1)
    torch.openreg.set_rng_state_all(states)
    assert torch.equal(torch.rand(16, device="openreg:0").cpu(), on_0)
    assert torch.equal(torch.rand(16, device="openreg:1").cpu(), on_1)


def test_seed_and_seed_all_reseed_non_deterministically():
    torch.openreg.manual_seed_all(5)
    torch.openreg.seed()
    assert torch.openreg.initial_seed() != 5
    torch.openreg.seed_all()
    seeds = [_runtime.initial_seed(d) for d in range(torch.openreg.device_count())]
    assert len(set(seeds)) == 1 and seeds[0] != 5


def test_set_rng_state_refuses_a_bad_state():
    with pytest.raises(RuntimeError):
        torch.openreg.set_rng_state(torch.zeros(3, dtype=torch.uint8))


def test_dropout_draws_from_openregs_generator_as_cpu_draws_from_its_own():
    x = torch.randn(1000)
    torch.manual_seed(9)
    expected = F.dropout(x, 0.3)  # the CPU generator moves on, openreg's stays seeded with 9
    got = F.dropout(x.to("openreg"), 0.3)
    assert torch.equal(got.cpu(), expected)
    for p, train in [(0.3, False), (1.0, True), (0.0, True)]:
        out, mask = torch.native_dropout(x.to("openreg"), p, train)
        cpu_out, cpu_mask = torch.native_dropout(x, p, train)
        assert torch.equal(out.cpu(), cpu_out) and torch.equal(mask.cpu(), cpu_mask)
    out, mask = torch.native_dropout(torch.ones(0, device="openreg"), 0.5, True)
    assert out.numel() == mask.numel() == 0 and mask.dtype == torch.float32  # as on CPU


def test_fork_rng_restores_the_device_generators():
    torch.manual_seed(0)
    with torch.random.fork_rng(devices=[0, 1], device_type="openreg"):
        inside = torch.rand(8, device="openreg").cpu()
        torch.rand(8, device="openreg:1")
    after = torch.rand(8, device="openreg").cpu()
    assert torch.equal(inside, after)  # as if the block had drawn nothing


def _net():
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 8)
    ).to("openreg")


def _grads(net, x, **checkpoint_kwargs):
    torch.openreg.manual_seed(42)
    out = checkpoint(net, x, **checkpoint_kwargs) if checkpoint_kwargs else net(x)
    out.square().sum().backward()
    grads = [p.grad.cpu() for p in net.parameters()]
    net.zero_grad()
    return grads


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointing_with_dropout_gives_the_gradients_of_a_plain_run(use_reentrant):
    net, x = _net(), torch.randn(16, 32, device="openreg", requires_grad=True)
    assert torch.openreg._initialized  # what checkpoint reads before stashing the RNG state
    plain = _grads(net, x)
    preserved = _grads(net, x, use_reentrant=use_reentrant)
    assert all(torch.allclose(a, b) for a, b in zip(plain, preserved))
    # Without preserving the state, the recomputed dropout masks differ: the check can fail.
    lost = _grads(net, x, use_reentrant=use_reentrant, preserve_rng_state=False)
    assert not all(torch.allclose(a, b) for a, b in zip(plain, lost))


# ---- AMP ----
@pytest.mark.parametrize("dtype", torch.openreg.get_amp_supported_dtype())
def test_autocast_casts_matmuls_and_keeps_sensitive_ops_in_float32(dtype):
    a = torch.randn(8, 8, device="openreg")
    with torch.autocast("openreg", dtype=dtype):
        assert (a @ a).dtype == dtype
        assert F.linear(a, a).dtype == dtype
        assert torch.softmax(a.to(dtype), 0).dtype == torch.float32
        assert (a + a).dtype == torch.float32  # not on any list: untouched
    assert (a @ a).dtype == torch.float32
    cpu = a.cpu()
    with torch.autocast("cpu", dtype=dtype):
        expected = cpu @ cpu
    with torch.autocast("openreg", dtype=dtype):
        assert torch.equal((a @ a).cpu(), expected)


def test_autocast_default_dtype_and_unsupported_dtype():
    assert torch.openreg.is_bf16_supported()
    with torch.autocast("openreg"):
        assert torch.get_autocast_dtype("openreg") in torch.openreg.get_amp_supported_dtype()
    with pytest.warns(UserWarning, match="openreg"), torch.autocast("openreg", dtype=torch.int8):
        assert not torch.is_autocast_enabled("openreg")  # torch disables it with a warning


def test_grad_scaler_step_end_to_end():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to("openreg")
    before = [p.detach().cpu().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("openreg", init_scale=1024.0)
    with torch.autocast("openreg", dtype=torch.float16):
        loss = model(torch.randn(3, 4, device="openreg")).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1024.0  # finite gradients: the scale stays
    assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters()))
    # An overflow skips the step and halves the scale.
    after = [p.detach().cpu().clone() for p in model.parameters()]
    (
        model(torch.full((3, 4), float("inf"), device="openreg")).sum() * scaler.get_scale()
    ).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    assert all(torch.equal(a, p.detach().cpu()) for a, p in zip(after, model.parameters()))


# ---- device information and memory ----
def test_device_name_and_properties():
    assert torch.openreg.get_device_name() == torch.openreg.get_device_name(1) == "openreg"
    props = torch.openreg.get_device_properties("openreg:1")
    assert props.name == "openreg" and props.index == 1
    assert props.uuid == _runtime.device_uuid(1)
    assert props.total_memory == torch.openreg.mem_get_info(1)[1] > 0
    with pytest.raises(ValueError, match="does not exist"):
        torch.openreg.get_device_properties(7)


QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
NAME_ONLY = {getattr(torch, f"{kind}{bits}") for kind in ("int", "uint") for bits in range(1, 8)}


def test_device_capability_lists_the_dtypes_openreg_holds_and_converts():
    dtypes = torch.accelerator.get_device_capability("openreg:1")["supported_dtypes"]
    assert dtypes == torch.accelerator.get_device_capability()["supported_dtypes"]
    assert {
        torch.float32,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.bool,
        torch.uint64,
        torch.complex128,
        torch.bits8,
        torch.float4_e2m1fn_x2,
    } <= dtypes
    assert not dtypes & (QUANTIZED | NAME_ONLY)
    raw = torch.arange(16, dtype=torch.uint8)
    for dtype in dtypes:  # each one held: its bytes go there and back
        held = raw.view(dtype).to("openreg")
        assert held.dtype == dtype and torch.equal(held.cpu().view(torch.uint8), raw), dtype
        packed = dtype == torch.float4_e2m1fn_x2  # two values a byte: no conversion, as on CPU
        if (dtype.is_floating_point and not packed) or dtype in (torch.bool, torch.int32):
            ones = torch.ones(3).to(dtype)  # and converted on the device
            assert torch.equal(ones.to("openreg").to(torch.float32).cpu(), torch.ones(3)), dtype
    for dtype in (torch.qint8, torch.quint8, torch.qint32):  # what is left out fails
        with pytest.raises(NotImplementedError):
            torch.quantize_per_tensor(torch.ones(3), 0.1, 0, dtype).to("openreg")


def test_mem_get_info_is_the_hosts_memory_and_torch_accelerator_agrees():
    free, total = torch.openreg.mem_get_info()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= total
    acc_free, acc_total = torch.accelerator.get_memory_info()
    assert acc_total == total and 0 < acc_free <= total


def test_memory_summary_reports_the_statistics():
    x = torch.empty(1 << 20, dtype=torch.uint8, device="openreg")
    summary = torch.openreg.memory_summary()
    allocated = torch.openreg.memory_allocated()
    assert "openreg:0" in summary and f"{allocated:,}" in summary
    del x


def test_ipc_collect_runs_devipcs_collection(monkeypatch):
    keep_collector_out(monkeypatch)  # else its rounds might end the send first
    torch.openreg.synchronize()
    torch.openreg.ipc_collect()  # sends of earlier tests out of the way
    sent = torch.ones(1 << 20, dtype=torch.uint8, device="openreg")
    received = ForkingPickler.loads(ForkingPickler.dumps(sent))  # a send to this process itself
    del sent, received
    torch.openreg.synchronize()  # the receiver's release is due: its work on the memory is done
    held = torch.openreg.memory_allocated()
    assert torch.openreg.ipc_collect() == 1  # the one send, released, ends
    assert torch.openreg.memory_allocated() == held - (1 << 20)  # and its memory is freed
    assert torch.openreg.ipc_collect() == 0


# ---- pinned host memory ----
def test_pin_memory_pins_in_runtime_host_memory():
    cpu = torch.arange(1000.0)
    pinned = cpu.pin_memory()
    assert pinned.is_pinned() and not cpu.is_pinned()
    assert pinned.device.type == "cpu" and torch.equal(pinned, cpu)
    device, base, size, offset = native.pointer_attributes(pinned.data_ptr())
    assert device == -1 and size >= cpu.nbytes and offset == pinned.data_ptr() - base
    assert pinned[10:].is_pinned()  # interior pointers too
    assert not torch.ones(3, device="openreg").cpu().is_pinned()
    assert torch.ones(3, device="openreg").to("cpu", non_blocking=True).is_pinned()


def test_copy_from_pinned_memory_is_asynchronous_on_the_stream(gate):
    side = torch.Stream(device="openreg")
    gate.hold_torch_stream(side)
    pinned = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    with side:
        dev = pinned.to("openreg", non_blocking=True)  # returns while the stream is held
        assert not side.query()
        gate.open()
        assert torch.equal(dev.cpu(), torch.arange(1 << 16, dtype=torch.float32))
    side.synchronize()


def test_dataloader_pin_memory_pins_batches():
    data = torch.utils.data.TensorDataset(torch.arange(12.0).reshape(6, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=3, pin_memory=True)
    batches = [batch for (batch,) in loader]
    assert len(batches) == 2 and all(b.is_pinned() for b in batches)
    assert torch.equal(torch.cat(batches), data.tensors[0])


@pytest.mark.skipif(
    not hasattr(torch.accelerator, "random"), reason="torch.accelerator.random came with torch 2.14"
)
def test_torch_accelerator_random_reads_openreg_generators():
    torch.manual_seed(5)
    assert torch.accelerator.random.initial_seed() == 5
    states = torch.accelerator.random.get_rng_state_all()
    assert len(states) == torch.openreg.device_count()
    for index, state in enumerate(states):
        assert torch.equal(state, torch.openreg.get_rng_state(index))
    torch.rand(4, device="openreg")  # draws move the generator
    assert not torch.equal(torch.accelerator.random.get_rng_state(), states[0])
