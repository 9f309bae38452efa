"""OPENREG_DEVICE_COUNT and OPENREG_VISIBLE_DEVICES: values that make no sense are refused at first
use with the value echoed, never turned silently into some number of devices.

The variables are read once per process, so every case runs a fresh interpreter.
"""

import textwrap

import pytest
from _support import json_of

PROBE = textwrap.dedent("""
    import json, torch

    def attempt(fn):
        try:
            return ["ok", fn()]
        except Exception as error:
            return [type(error).__name__, str(error)]

    print(json.dumps({
        "device_count": attempt(torch.openreg.device_count),
        "allocate": attempt(lambda: torch.ones(2, device="openreg").sum().item()),
        "set_device": attempt(lambda: torch.openreg.set_device(0)),
        "accelerator_count": attempt(torch.accelerator.device_count),  # asks torch.openreg
    }))
""")


@pytest.mark.parametrize(
    "name, value",
    [
        ("OPENREG_DEVICE_COUNT", "two"),
        ("OPENREG_DEVICE_COUNT", "-1"),
        ("OPENREG_DEVICE_COUNT", "3x"),
        ("OPENREG_DEVICE_COUNT", ""),
        ("OPENREG_DEVICE_COUNT", "100000"),
        ("OPENREG_VISIBLE_DEVICES", "0,0"),
        ("OPENREG_VISIBLE_DEVICES", "2"),
        ("OPENREG_VISIBLE_DEVICES", "-1"),
        ("OPENREG_VISIBLE_DEVICES", "1,,0"),
        ("OPENREG_VISIBLE_DEVICES", "0,"),
        ("OPENREG_VISIBLE_DEVICES", "gpu0"),
    ],
)
def test_nonsense_is_refused_with_the_value_echoed(name, value):
    out = json_of(PROBE, **{name: value})
    for call in ("device_count", "allocate", "set_device", "accelerator_count"):
        kind, message = out[call]
        assert kind == "RuntimeError", (call, out[call])
        assert f"{name}='{value}' is not valid" in message, (call, message)


@pytest.mark.parametrize(
    "env, count",
    [
        ({"OPENREG_DEVICE_COUNT": "0"}, 0),
        ({"OPENREG_DEVICE_COUNT": " 3 "}, 3),
        ({"OPENREG_VISIBLE_DEVICES": ""}, 0),  # hides every device, as CUDA_VISIBLE_DEVICES does
        ({"OPENREG_VISIBLE_DEVICES": " 1 , 0 "}, 2),
        ({"OPENREG_DEVICE_COUNT": "4", "OPENREG_VISIBLE_DEVICES": "3,1"}, 2),
    ],
)
def test_sensible_values_are_accepted(env, count):
    out = json_of(PROBE, **env)
    assert out["device_count"] == ["ok", count]
    assert out["accelerator_count"] == ["ok", count]
    if count:
        assert out["allocate"] == ["ok", 2.0]
    else:  # no device: a plain "does not exist", not an environment complaint
        assert out["allocate"][0] == "RuntimeError" and "not valid" not in out["allocate"][1]


def test_import_survives_a_refused_environment():
    """torch's autoload imports openreg: a bad value must surface at use, not break `import`."""
    out = json_of(
        "import json, torch; print(json.dumps(torch.openreg.is_initialized()))",
        OPENREG_DEVICE_COUNT="nonsense",
    )
    assert out is False
