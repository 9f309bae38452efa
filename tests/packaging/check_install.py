"""Installs both distributions as a user would, into a fresh venv, and uses them there.

`pip wheel` builds the core in pip's build isolation and devipc-openreg, a torch C++ extension,
with `--no-build-isolation` against the torch running this script, as its README tells users. The
wheels are checked (the runtime library inside, no sources, stripped, metadata with readme and
license), then installed into a new venv beside that same torch release:
devipc alone first (importing it must register no device), then devipc-openreg beside it (`import
torch` loads openreg, and a tensor crosses processes without LD_LIBRARY_PATH). `make check-install`.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TIMEOUT = 900  # seconds for one pip command: the openreg wheel compiles C++
TORCH_RELEASE = torch.__version__.split("+")[0]  # what the openreg wheel is built against

CORE_ONLY = """
import json, sys, torch
before = (str(torch.accelerator.current_accelerator()), torch._C._get_privateuse1_backend_name())
import devipc
after = (str(torch.accelerator.current_accelerator()), torch._C._get_privateuse1_backend_name())
assert before == after and before[1] == "privateuseone", (before, after)  # CUDA builds: "cuda"
assert not devipc.rfc.installed() and not hasattr(torch, "openreg")
assert not any("openreg" in name for name in sys.modules), sorted(sys.modules)
print("devipc", devipc.__version__, "alone: no device registered, torch.accelerator unchanged")
"""

WITH_OPENREG = """
import os
import torch, torch.multiprocessing as mp
import devipc, devipc_openreg

def consumer(queue, done):
    t = queue.get(timeout=60)
    t.fill_(7)  # writes into the producer's memory
    torch.accelerator.synchronize()
    done.put(devipc.received_via_ipc(t))

if __name__ == "__main__":
    assert "LD_LIBRARY_PATH" not in os.environ
    assert torch.accelerator.current_accelerator() == torch.device("openreg")
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(queue, done), daemon=True)
    proc.start()
    try:
        t = torch.zeros(1024, device="openreg")
        queue.put(t)
        assert done.get(timeout=60) is True
        assert t.sum().item() == 7 * 1024, "the consumer's write is not visible: not zero-copy"
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    where = os.path.dirname(devipc_openreg.__file__)
    print("devipc-openreg", devipc_openreg.__version__, "in", where)
    print("openreg tensor shared zero-copy with a spawned process")
"""


def run(*cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, timeout=TIMEOUT, **kwargs)


def check_wheel(path, must_have, must_not_end):
    names = zipfile.ZipFile(path).namelist()
    for needed in must_have:
        assert any(name.endswith(needed) or needed in name for name in names), (
            f"{os.path.basename(path)} lacks {needed}: {names}"
        )
    stray = [name for name in names if name.endswith(must_not_end)]
    assert not stray, f"{os.path.basename(path)} holds sources: {stray}"
    metadata = zipfile.ZipFile(path).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in metadata and "Description-Content-Type" in metadata
    return names


def check_stripped(wheel, tmp):
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.endswith(".so"):
                target = archive.extract(name, tmp)
                sections = subprocess.run(
                    ["readelf", "-S", "-W", target], check=True, capture_output=True, text=True
                ).stdout
                assert ".debug_info" not in sections, f"{name} carries debug info"
                assert ".symtab" not in sections, f"{name} is not stripped"
                print(f"  {name}: {os.path.getsize(target) / 1e6:.2f} MB, stripped")


def main():
    with tempfile.TemporaryDirectory(prefix="devipc-install-") as tmp:
        wheels, venv = os.path.join(tmp, "wheels"), os.path.join(tmp, "venv")
        build_base = os.path.join(tmp, "openreg-build")  # not the checkout's openreg/build
        pip = [sys.executable, "-m", "pip"]
        start = time.monotonic()
        run(*pip, "wheel", "-q", "--no-deps", "-w", wheels, ROOT)
        core_built = time.monotonic()
        run(
            *pip,
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            wheels,
            os.path.join(ROOT, "openreg"),
            env=dict(os.environ, OPENREG_BUILD_BASE=build_base),
        )
        openreg_built = time.monotonic()
        print(
            f"wheels built: devipc {core_built - start:.0f} s, devipc-openreg (against torch "
            f"{torch.__version__}) {openreg_built - core_built:.0f} s"
        )
        (core,) = (os.path.join(wheels, w) for w in os.listdir(wheels) if w.startswith("devipc-"))
        (openreg,) = (
            os.path.join(wheels, w) for w in os.listdir(wheels) if w.startswith("devipc_openreg-")
        )
        names = check_wheel(core, ["devipc/__init__.py", "licenses/LICENSE"], (".so", ".cpp", ".h"))
        assert not any("openreg" in name for name in names), "the core wheel holds the device"
        declared = [
            zipfile.ZipFile(core).read(n).decode() for n in names if n.endswith("entry_points.txt")
        ]
        sections = re.findall(r"^\[(.+)\]$", "".join(declared), re.M)
        # the `devipc` command, and the plug-in that vLLM alone loads (it registers a
        # weight-transfer backend, no device): never `torch.backends`, which import torch runs
        assert set(sections) <= {"console_scripts", "vllm.general_plugins"}, (
            f"the core wheel has an entry point other than the `devipc` command and vLLM's "
            f"plug-in: {sections}"
        )
        check_wheel(
            openreg,
            [
                "devipc_openreg/libopenreg.so",
                "devipc_openreg/_C",
                "devipc_openreg/torch-version.txt",
                "_devipc_openreg_autoload.py",
                "entry_points.txt",
            ],
            (".cpp", ".h"),
        )
        check_stripped(openreg, tmp)

        run(sys.executable, "-m", "venv", venv)
        python = os.path.join(venv, "bin", "python")
        # torch pinned and alone first: an unpinned resolve would fetch a CUDA build. The pin is
        # this venv's constraints file, in place of any machine-wide one (which may cap torch).
        pin = os.path.join(tmp, "torch-pin.txt")
        with open(pin, "w") as f:
            f.write(f"torch=={TORCH_RELEASE}\n")
        os.environ["PIP_CONSTRAINT"] = pin
        run(python, "-m", "pip", "install", "-q", f"torch=={TORCH_RELEASE}")
        run(python, "-m", "pip", "install", "-q", core)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("LD_LIBRARY_PATH", "PYTHONPATH")
            and not k.startswith(("OPENREG_", "DEVIPC_"))
        }
        run(python, "-c", CORE_ONLY, env=env, cwd=tmp)
        run(python, "-m", "pip", "install", "-q", openreg)
        script = os.path.join(tmp, "with_openreg.py")
        with open(script, "w") as f:
            f.write(WITH_OPENREG)
        run(python, script, env=env, cwd=tmp)
        run(os.path.join(venv, "bin", "devipc"), "doctor", env=env, cwd=tmp)  # the console script
    print(f"check-install passed in {time.monotonic() - start:.0f} s")


if __name__ == "__main__":
    main()
