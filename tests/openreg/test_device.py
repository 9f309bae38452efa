"""openreg as torch sees it: autoload, devices, streams, events, memory statistics, generators.

Environment variables are read once per process, so those tests run fresh interpreters.
"""

import textwrap
import time

import _native as native
import pytest
import torch
from _support import json_of

import devipc_openreg  # noqa: F401  (registers the device where autoload is off)
from devipc_openreg import _runtime


# ---- loading: tests/openreg/test_autoload.py ----
def test_is_the_current_accelerator_with_two_devices():
    assert torch.accelerator.current_accelerator() == torch.device("openreg")
    assert torch.accelerator.device_count() == torch.openreg.device_count() == 2
    assert torch.openreg.is_available()
    assert torch.device("openreg", 1).type == "openreg"
    assert torch.ones(1, device="openreg").is_openreg  # generated methods


# ---- devices ----
@pytest.fixture
def restore_device():
    previous = torch.accelerator.current_device_index()
    yield
    torch.accelerator.set_device_index(previous)


def test_set_device_index_moves_new_tensors(restore_device):
    torch.accelerator.set_device_index(1)
    assert torch.accelerator.current_device_index() == torch.openreg.current_device() == 1
    assert torch.empty(3, device="openreg").device == torch.device("openreg", 1)
    torch.openreg.set_device("openreg:0")
    assert torch.empty(3, device="openreg").device == torch.device("openreg", 0)


def test_device_context_manager(restore_device):
    with torch.openreg.device(1):
        assert torch.zeros(1, device="openreg").device.index == 1
    assert torch.openreg.current_device() == 0


def test_invalid_device_index_is_a_clear_error():
    with pytest.raises(RuntimeError, match="invalid device index 5"):
        torch.openreg.set_device(5)


def test_pointer_names_its_device():
    x = torch.empty(8, device="openreg:1")
    assert native.pointer_attributes(x.data_ptr())[0] == 1  # runtime memory of device 1


@pytest.mark.parametrize(
    "env, count",
    [
        ({"OPENREG_DEVICE_COUNT": "3"}, 3),
        ({"OPENREG_VISIBLE_DEVICES": "1"}, 1),
        ({"OPENREG_VISIBLE_DEVICES": ""}, 0),
    ],
)
def test_device_count_follows_environment(env, count):
    out = json_of(
        textwrap.dedent("""
        import json, torch
        print(json.dumps({"openreg": torch.openreg.device_count(),
                          "accelerator": torch.accelerator.device_count(),
                          "available": torch.openreg.is_available()}))
    """),
        **env,
    )
    assert out == {"openreg": count, "accelerator": count, "available": count > 0}


def test_visible_devices_renumber():
    physical_1 = json_of(
        "import json, torch, _native; print(json.dumps(_native.device_uuid(1)))",
        PYTHONPATH=native.PYTHONPATH,
    )
    out = json_of(
        textwrap.dedent("""
        import json, torch, _native
        x = torch.ones(4, device="openreg:0")
        print(json.dumps({"uuid": _native.device_uuid(x.device.index),
                          "device": str(x.device), "sum": x.sum().item()}))
    """),
        OPENREG_VISIBLE_DEVICES="1",
        PYTHONPATH=native.PYTHONPATH,
    )
    assert out == {"uuid": physical_1, "device": "openreg:0", "sum": 4.0}


# ---- streams and events ----
def test_stream_ids_name_device_streams_and_context_makes_current():
    default = torch.accelerator.current_stream()
    assert default.stream_id == 0 and default.device == torch.device("openreg", 0)
    side = torch.Stream(device="openreg")
    assert side.stream_id != 0
    assert native.stream_id(_runtime.stream_from_id(0, side.stream_id)) == side.stream_id
    with side:
        assert torch.accelerator.current_stream() == side
        assert torch.openreg.current_stream() == side
    assert torch.accelerator.current_stream() == default
    torch.accelerator.set_stream(side)
    try:
        assert torch.openreg.current_stream(0) == side
    finally:
        torch.accelerator.set_stream(default)


def test_streams_on_the_second_device():
    side = torch.Stream(device="openreg:1")
    assert side.device_index == 1
    with side:
        assert torch.openreg.current_stream(1) == side
        assert torch.openreg.current_stream(0).stream_id == 0
    side.synchronize()
    assert side.query()


def test_event_record_query_synchronize_elapsed_time():
    start = torch.Event(device="openreg", enable_timing=True)
    end = torch.Event(device="openreg", enable_timing=True)
    before = time.perf_counter()
    start.record()
    x = torch.randn(256, 256, device="openreg")
    y = x @ x
    end.record()
    end.synchronize()
    wall_ms = (time.perf_counter() - before) * 1e3
    assert start.query() and end.query()
    # the records ran in order, within the time around them (steady_clock and perf_counter
    # are both CLOCK_MONOTONIC)
    assert 0 < start.elapsed_time(end) <= wall_ms, (start.elapsed_time(end), wall_ms)
    assert y.shape == (256, 256)


def test_event_orders_streams():
    side = torch.Stream(device="openreg")
    done = torch.Event(device="openreg")
    with side:
        x = torch.arange(1000.0).to("openreg", non_blocking=True)
        done.record(side)
    torch.accelerator.current_stream().wait_event(done)
    assert x.sum().item() == sum(range(1000))
    torch.accelerator.synchronize()
    torch.openreg.synchronize(1)


# ---- memory ----
def test_memory_stats_follow_allocations_and_empty_cache_releases():
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    base = torch.accelerator.memory_allocated()
    x = torch.empty(1 << 20, dtype=torch.uint8, device="openreg")
    assert torch.accelerator.memory_allocated() == base + (1 << 20)
    assert torch.openreg.memory_allocated(0) == torch.accelerator.memory_allocated()
    assert torch.accelerator.memory_reserved() >= base + (1 << 20)
    assert torch.accelerator.max_memory_allocated() >= base + (1 << 20)
    del x
    assert torch.accelerator.memory_allocated() == base
    assert torch.accelerator.memory_reserved() > 0  # cached
    torch.accelerator.empty_cache()
    if base == 0:
        assert torch.accelerator.memory_reserved() == 0
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.accelerator.memory_allocated()


def test_memory_stats_agree_with_torch_accelerator():
    """torch.openreg reads the runtime, torch.accelerator the glue's allocator: the same numbers."""
    count = torch.openreg.device_count()
    xs = [torch.empty(3 << 20, dtype=torch.uint8, device=f"openreg:{d}") for d in range(count)]
    for device in range(count):
        ours = torch.openreg.memory_stats(device)
        theirs = torch.accelerator.memory_stats(device)
        assert len(ours) == 7 and ours == {key: theirs[key] for key in ours}
        assert ours["allocated_bytes.all.current"] >= 3 << 20
    del xs


def test_memory_stats_are_per_device():
    before = torch.openreg.memory_allocated(1)
    x = torch.empty(4096, dtype=torch.uint8, device="openreg:1")
    assert torch.openreg.memory_allocated(1) == before + 4096
    del x


def test_allocation_failure_is_out_of_memory_error():
    with pytest.raises(torch.OutOfMemoryError, match="openreg:0"):
        torch.empty(1 << 62, dtype=torch.uint8, device="openreg")


# ---- generators ----
def test_manual_seed_makes_random_ops_reproducible_and_equal_to_cpu():
    torch.manual_seed(7)
    a = torch.randn(5, device="openreg")
    torch.manual_seed(7)
    b = torch.randn(5, device="openreg")
    cpu = torch.randn(5, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.cpu(), b.cpu()) and torch.equal(a.cpu(), cpu)
    assert torch.openreg.initial_seed() == 7


def test_module_manual_seed_and_explicit_generator():
    torch.openreg.manual_seed(3)
    a = torch.rand(4, device="openreg")
    torch.openreg.manual_seed(3)
    b = torch.rand(4, device="openreg")
    assert torch.equal(a.cpu(), b.cpu())
    g = torch.Generator(device="openreg").manual_seed(11)
    assert g.device == torch.device("openreg", 0)
    c = torch.randint(0, 100, (6,), device="openreg", generator=g)
    g.manual_seed(11)
    d = torch.randint(0, 100, (6,), device="openreg", generator=g)
    assert torch.equal(c.cpu(), d.cpu())
