"""The public surface, by audience: `devipc` for users, `devipc.hooks` for vendors, `devipc.rfc`
for torch's plumbing, `devipc.p2p` for transfers; each name documented in the README."""
import pathlib
import re
import subprocess
import sys
import types

import devipc
import devipc.p2p

README = pathlib.Path(__file__).parent.parent / "README.md"
AUDIENCES = (devipc, devipc.hooks, devipc.rfc, devipc.p2p)


def test_every_public_name_is_exported_once():
    for module in AUDIENCES:
        assert len(module.__all__) == len(set(module.__all__)), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    public = {name for name, value in vars(devipc).items()
              if not name.startswith("_") and not isinstance(value, types.ModuleType)}
    synonyms = set(devipc.hooks.__all__) | set(devipc.rfc.__all__)
    assert public - synonyms == set(devipc.__all__) - {"hooks", "rfc"}


def test_vendor_and_rfc_names_in_devipc_are_the_same_objects():
    for module in (devipc.hooks, devipc.rfc):
        for name in module.__all__:
            if name not in ("SharedStorage", "IpcMemHandle"):  # newer than the synonyms
                assert getattr(devipc, name) is getattr(module, name), name


def test_the_readme_documents_every_public_name():
    spans = [span for line in README.read_text().splitlines()
             for span in re.findall(r"`([^`]+)`", line)]
    documented = {name for span in spans for name in re.findall(r"[A-Za-z_]\w*", span)}
    for module in AUDIENCES:
        missing = set(module.__all__) - documented
        assert not missing, f"{module.__name__}: {sorted(missing)} not in the README"


def test_importing_off_linux_says_devipc_needs_linux():
    script = "import sys; sys.platform = 'darwin'; import devipc"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert "ImportError: devipc needs Linux" in result.stderr and "darwin" in result.stderr
