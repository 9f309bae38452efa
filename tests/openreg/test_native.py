"""The runtime's native test (native/runtime_test.cpp): its C API from C++ threads and a second
process, against the libopenreg.so this package ships, built with warnings as errors. `make
sanitize` builds the same test with the runtime's sources under ASan, UBSan and TSan."""

import pathlib
import subprocess

from _support import TIMEOUT

import devipc_openreg

SOURCE = pathlib.Path(__file__).parent / "native" / "runtime_test.cpp"
HEADERS = pathlib.Path(__file__).parents[2] / "openreg" / "csrc" / "runtime"
PACKAGE = pathlib.Path(devipc_openreg.__file__).parent


def test_the_runtime_passes_its_native_test(tmp_path):
    program = tmp_path / "runtime_test"
    subprocess.run(
        [
            "c++",
            "-std=c++17",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pthread",
            f"-I{HEADERS}",
            str(SOURCE),
            f"-L{PACKAGE}",
            "-lopenreg",
            f"-Wl,-rpath,{PACKAGE}",
            "-o",
            str(program),
        ],
        check=True,
        timeout=TIMEOUT,
    )
    run = subprocess.run([str(program)], capture_output=True, text=True, timeout=TIMEOUT)
    assert (run.returncode, run.stdout) == (0, "ok\n"), run.stderr
