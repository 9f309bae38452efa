"""Device facts (`_devices`): the one place devipc asks torch about a device's streams, on the
accelerator (openreg here) by index, and through the device's module otherwise."""

import torch

from devipc._core import _devices


def test_the_current_stream_is_torchs_for_the_device_asked():
    device = torch.device("openreg", 1)
    stream = torch.Stream(device=device)
    with torch.openreg.stream(stream):  # the current stream of openreg:1, not of openreg:0
        assert _devices.current_stream(device) == stream
        assert _devices.accelerator_streams()(1) == stream
        assert _devices.current_stream(torch.device("openreg", 0)) != stream
    assert _devices.current_stream(device) == torch.accelerator.current_stream(1)
    assert (
        _devices.current_stream(torch.device("openreg")) == torch.accelerator.current_stream()
    )  # no index: the current device's, by its module


def test_synchronize_waits_for_the_work_queued_on_the_device():
    device = torch.device("openreg", 0)
    source = torch.arange(1 << 16, dtype=torch.float32, device=device)
    square = torch.rand(512, 512, device=device)
    for _ in range(8):  # queued: far from done when the loop ends
        square = square @ square / 512
    event = torch.Event(device=device)
    target = source * 2
    event.record(_devices.current_stream(device))
    _devices.synchronize(device)
    assert event.query()
    _devices.synchronize(torch.device("openreg"))  # no index: through the device's module
    assert torch.equal(target.cpu(), torch.arange(1 << 16, dtype=torch.float32) * 2)


def test_only_the_accelerators_devices_have_an_accelerator_index():
    assert _devices.accelerator_index(torch.device("openreg", 1)) == 1
    assert _devices.accelerator_index(torch.device("cpu")) is None
