"""How openreg loads: by `import torch` only where no other accelerator is there, on purpose
by `import devipc_openreg` or DEVIPC_OPENREG=1, and never over another PrivateUse1 backend.

Each case runs a fresh interpreter: what torch registers cannot be undone in this one.
"""

import importlib.metadata
import json
import textwrap

from _support import FRESH_TIMEOUT, json_of, run_python, start_python

SEED_USAGE = """\
import torch

if not torch.openreg.is_available():
    print("OpenReg backend is not available in this build.")
    exit()

print("OpenReg backend is available!")

device = torch.device("openreg")

x = torch.tensor([[1., 2.], [3., 4.]], device=device)
y = x + 2
print("Result y:\\n", y)
print(f"Device of y: {y.device}")

z = y.cpu()
print("Result z:\\n", z)
print(f"Device of z: {z.device}")
"""


# torch's own autoload, run again by hand after the process arranged what the machine has.
AUTOLOAD_AFTER = """
import json, logging, os, torch
logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
{before}
torch._import_device_backends()  # what `import torch` runs for every torch.backends entry point
print(json.dumps({{"privateuse1": torch._C._get_privateuse1_backend_name(),
                   "openreg": hasattr(torch, "openreg"),
                   "works": torch.ones(2).add(1).sum().item()}}))
"""


def autoload_after(before, **env):
    proc = run_python(
        AUTOLOAD_AFTER.format(before=textwrap.dedent(before)),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        **env,
    )
    logs = [line for line in proc.stderr.splitlines() if line.startswith("LOG devipc_openreg")]
    return json.loads(proc.stdout.strip().splitlines()[-1]), logs


def test_entry_point_is_installed():
    values = [ep.value for ep in importlib.metadata.entry_points(group="torch.backends")]
    assert "_devipc_openreg_autoload:autoload" in values, (
        "run `make setup`: devipc-openreg's torch.backends entry point is not installed"
    )


def test_seed_usage_runs_verbatim_with_only_torch_imported():
    out = run_python(SEED_USAGE).stdout
    assert "OpenReg backend is available!" in out
    assert "Device of y: openreg:0" in out
    assert "Device of z: cpu" in out


def test_direct_import_without_autoload():
    out = json_of(
        textwrap.dedent("""
        import json, torch
        assert not hasattr(torch, "openreg")
        import devipc_openreg
        import devipc_openreg  # idempotent
        x = torch.ones(2, device="openreg") * 3
        print(json.dumps({"device": str(x.device), "sum": x.sum().item(),
                          "accelerator": str(torch.accelerator.current_accelerator())}))
    """),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert out == {"device": "openreg:0", "sum": 6.0, "accelerator": "openreg"}


def test_import_devipc_before_torch():
    """devipc imports torch, whose autoload registers openreg's hooks while devipc is half done."""
    out = json_of(
        "import json, devipc, torch; t = torch.ones(1, device='openreg'); "
        "print(json.dumps([str(t.device), devipc.hooks.device_supports_ipc('openreg'), "
        "devipc.rfc.installed()]))"
    )
    assert out == ["openreg:0", True, True]


def test_no_other_accelerator_loads_it_quietly():
    state, logs = autoload_after("")
    assert state == {"privateuse1": "openreg", "openreg": True, "works": 4.0}
    assert logs == []


def test_steps_aside_for_another_privateuse1_backend():
    state, logs = autoload_after('torch.utils.rename_privateuse1_backend("vendordev")')
    assert state == {"privateuse1": "vendordev", "openreg": False, "works": 4.0}
    assert len(logs) == 1 and "'vendordev'" in logs[0] and "DEVIPC_OPENREG=0" in logs[0]


def test_another_privateuse1_backend_wins_even_when_forced():
    state, logs = autoload_after(
        'torch.utils.rename_privateuse1_backend("vendordev")', DEVIPC_OPENREG="1"
    )
    assert state["privateuse1"] == "vendordev" and not state["openreg"]
    assert len(logs) == 1


def test_steps_aside_for_an_available_cuda():
    state, logs = autoload_after("torch.cuda.is_available = lambda: True")
    assert state == {"privateuse1": "privateuseone", "openreg": False, "works": 4.0}
    assert len(logs) == 1 and "cuda is available" in logs[0] and "DEVIPC_OPENREG=1" in logs[0]


def test_switch_loads_it_next_to_cuda():
    state, logs = autoload_after("torch.cuda.is_available = lambda: True", DEVIPC_OPENREG="1")
    assert state["privateuse1"] == "openreg" and state["openreg"] and logs == []


def test_switch_off_never_loads_it():
    state, logs = autoload_after("", DEVIPC_OPENREG="0")
    assert state["privateuse1"] == "privateuseone" and not state["openreg"] and logs == []


def test_explicit_import_over_another_backend_says_why():
    proc = run_python(
        textwrap.dedent("""
        import torch
        torch.utils.rename_privateuse1_backend("vendordev")
        try:
            import devipc_openreg
        except RuntimeError as error:
            print("refused:", error)
    """),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert "refused: cannot load openreg" in proc.stdout and "'vendordev'" in proc.stdout


def test_switch_values_other_than_documented_are_refused_with_the_value(monkeypatch):
    import _devipc_openreg_autoload as autoload

    for value in ("false", "off", "no", " 0", "0 ", "true", "2"):
        monkeypatch.setenv("DEVIPC_OPENREG", value)
        try:
            autoload.switch_value()
        except ValueError as error:
            assert f"DEVIPC_OPENREG={value!r}" in str(error) and "=1" in str(error)
        else:
            raise AssertionError(f"DEVIPC_OPENREG={value!r} was accepted")
    for value in ("", "0", "1"):
        monkeypatch.setenv("DEVIPC_OPENREG", value)
        assert autoload.switch_value() == value


def test_a_refused_switch_stops_import_torch_loudly():
    proc = start_python("import torch", DEVIPC_OPENREG="false")
    _, err = proc.communicate(timeout=FRESH_TIMEOUT)
    assert proc.returncode != 0 and "DEVIPC_OPENREG='false' is not understood" in err


def test_a_glue_built_against_another_torch_is_refused_in_one_line():
    """The torch release _C was built against (torch-version.txt beside it) is checked before _C
    is loaded: `import torch` goes on without openreg and says how to rebuild; an explicit import
    raises that line."""
    out, logs = autoload_after("torch.__version__ = '2.99.0'  # as if torch were upgraded")
    assert out["openreg"] is False and out["privateuse1"] == "privateuseone" and out["works"] == 4
    assert len(logs) == 1 and "built against torch 2.1" in logs[0] and "2.99.0" in logs[0]
    assert "pip install --no-build-isolation --force-reinstall --no-deps devipc-openreg" in logs[0]
    out = json_of(
        textwrap.dedent("""
        import json, torch
        torch.__version__ = "2.99.0"
        try:
            import devipc_openreg
        except ImportError as error:
            print(json.dumps({"error": str(error), "name": error.name}))
    """),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
    )
    assert out["name"] == "devipc_openreg._C" and "\n" not in out["error"]
    assert "but this is torch 2.99.0; rebuild it against this torch: `make setup`" in out["error"]


def test_builds_of_one_torch_release_share_its_abi():
    from devipc_openreg import _runtime

    _runtime.check_glue_torch("2.14.1+cu128", "2.14.1")  # the CUDA build and the CPU build
    for built, running in (("2.13.0+cpu", "2.15.0"), ("2.15.0", "2.15.1")):
        try:
            _runtime.check_glue_torch(built, running)
        except ImportError as error:
            assert error.name == "devipc_openreg._C"
        else:
            raise AssertionError(f"{built} accepted under {running}")
