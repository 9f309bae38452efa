"""The public surface, by audience: `devipc` for users, `devipc.hooks` for vendors, `devipc.rfc`
for torch's plumbing, `devipc.p2p` for transfers; each name documented in the README."""

import pathlib
import pickle
import re
import subprocess
import sys
import types

import pytest

import devipc
import devipc.p2p

README = pathlib.Path(__file__).parent.parent / "README.md"
AUDIENCES = (devipc, devipc.hooks, devipc.rfc, devipc.p2p)


def test_every_public_name_is_exported_once():
    for module in AUDIENCES:
        assert len(module.__all__) == len(set(module.__all__)), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    public = {
        name
        for name, value in vars(devipc).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(devipc.__all__) - {"hooks", "rfc"}


def test_vendor_and_rfc_names_asked_of_devipc_say_where_they_live():
    for module in (devipc.hooks, devipc.rfc):
        for name in module.__all__:
            where = rf"devipc\.{name} is {module.__name__}\.{name}"
            with pytest.raises(AttributeError, match=where):
                getattr(devipc, name)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        devipc.no_such_name  # noqa: B018


def test_public_objects_report_the_module_users_import_them_from():
    for module in AUDIENCES:
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, types.ModuleType):
                continue
            assert value.__module__ in ("devipc", module.__name__), (module.__name__, name)
            assert pickle.loads(pickle.dumps(value)) is value, name  # pickled by that name
    assert repr(devipc.Handle) == "<class 'devipc.Handle'>"
    assert devipc.p2p.NotRegisteredError.__module__ == "devipc.p2p"


def test_the_readme_documents_every_public_name():
    spans = [
        span for line in README.read_text().splitlines() for span in re.findall(r"`([^`]+)`", line)
    ]
    documented = {name for span in spans for name in re.findall(r"[A-Za-z_]\w*", span)}
    for module in AUDIENCES:
        missing = set(module.__all__) - documented
        assert not missing, f"{module.__name__}: {sorted(missing)} not in the README"


def test_importing_off_linux_says_devipc_needs_linux():
    script = "import sys; sys.platform = 'darwin'; import devipc"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "ImportError: devipc needs Linux" in result.stderr and "darwin" in result.stderr
