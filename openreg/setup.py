"""Builds the reference device: the torch-free runtime `libopenreg.so`, then the PyTorch glue `_C`
linked against it (rpath $ORIGIN), both inside the `devipc_openreg` package."""

import glob
import os
import shutil
import subprocess
import sys

# Building must not load an installed openreg through torch's autoload: its natives may be the
# stale ones this build replaces.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
RUNTIME_SOURCES = sorted(glob.glob(os.path.join(CSRC, "runtime", "*.cpp")))
# The glue's concerns (csrc/glue/*.cpp) compile as the unity units that include them: each unit
# parses torch's headers anew, the costliest part of the build.
GLUE_SOURCES = sorted(glob.glob(os.path.join(CSRC, "glue", "unity", "*.cpp")))
# Warnings are errors in every build (tests/openreg/test_native.py builds the runtime the same way).
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror"]
# A release build: -g0 overrides the -g of Python's CFLAGS (debug info made _C 7.6 MB and doubled
# its compile time), -s strips at link.
RELEASE = ["-O2", "-g0"]
RUNTIME_FLAGS = [*RELEASE, "-std=c++17", *WARNINGS]
GLUE_FLAGS = [
    *RELEASE,
    "-std=c++20",  # torch 2.13's headers use C++20 features
    *WARNINGS,
    # ATen headers include one header per operator rather than all of NativeFunctions.h, and
    # refuse the all-operator headers: a third less parsing.
    "-DAT_PER_OPERATOR_HEADERS",
    "-DTORCH_ASSERT_ONLY_METHOD_OPERATORS",
]


def build_runtime(out_dir):
    """One g++ call, no torch headers: a few seconds."""
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, "libopenreg.so")
    tmp = target + ".tmp"
    print("runtime: building libopenreg.so", file=sys.stderr, flush=True)
    subprocess.check_call(
        [
            "c++",
            *RUNTIME_FLAGS,
            "-fPIC",
            "-shared",
            "-pthread",
            "-s",
            *RUNTIME_SOURCES,
            "-o",
            tmp,
            "-Wl,-soname,libopenreg.so",
        ],
        cwd=HERE,
    )
    os.replace(tmp, target)  # atomic: a process using the old library keeps its mapping
    return out_dir


# Beside _C: the torch release its glue was compiled against. The package reads it before it
# loads _C, so an import under another torch refuses in words rather than with an undefined
# symbol or a crash (_runtime.load_glue).
BUILT_WITH = "torch-version.txt"
BESIDE_C = ("libopenreg.so", BUILT_WITH)


def record_torch(out_dir):
    import torch

    with open(os.path.join(out_dir, BUILT_WITH), "w") as f:
        f.write(torch.__version__ + "\n")


class BuildWithRuntime(BuildExtension):
    def build_extension(self, ext):
        out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
        build_runtime(out_dir)
        record_torch(out_dir)
        ext.library_dirs = [out_dir, *ext.library_dirs]  # keep torch's own library directory
        super().build_extension(ext)

    def copy_extensions_to_source(self):
        # --inplace and editable installs copy _C back into src/; _C finds libopenreg via $ORIGIN.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            for name in BESIDE_C:
                target = os.path.join(os.path.dirname(inplace_file), name)
                built = os.path.join(os.path.dirname(regular_file), name)
                shutil.copy2(built, target + ".tmp")
                os.replace(target + ".tmp", target)  # atomic, as in build_runtime


# Where the build happens: openreg/build unless the caller names another (one per torch: the
# Makefile builds each torch's venv in its own, so the builds never mix).
BUILD_BASE = os.environ.get("OPENREG_BUILD_BASE")

setup(
    options={"build": {"build_base": BUILD_BASE}} if BUILD_BASE else {},
    ext_modules=[
        CppExtension(
            "devipc_openreg._C",
            GLUE_SOURCES,
            include_dirs=[os.path.join(HERE, CSRC, "runtime")],
            libraries=["openreg"],
            extra_compile_args=GLUE_FLAGS,
            extra_link_args=["-Wl,-rpath,$ORIGIN", "-s"],
        )
    ],
    cmdclass={"build_ext": BuildWithRuntime.with_options(use_ninja=True)},
)
