"""Builds the reference device: the torch-free runtime `libopenreg.so`, then the PyTorch glue `_C`
linked against it (rpath $ORIGIN), both inside the `devipc_openreg` package."""
import glob
import os
import shutil
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
RUNTIME_SOURCES = sorted(glob.glob(os.path.join(CSRC, "runtime", "*.cpp")))
GLUE_SOURCES = sorted(glob.glob(os.path.join(CSRC, "glue", "*.cpp")))
WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter"]
RUNTIME_FLAGS = ["-O2", "-std=c++17", *WARNINGS]
GLUE_FLAGS = ["-O2", "-std=c++20", *WARNINGS]  # torch 2.13's headers use C++20 features


def build_runtime(out_dir):
    """One g++ call, no torch headers: a few seconds."""
    os.makedirs(out_dir, exist_ok=True)
    target = os.path.join(out_dir, "libopenreg.so")
    tmp = target + ".tmp"
    subprocess.check_call(["c++", *RUNTIME_FLAGS, "-fPIC", "-shared", "-pthread", *RUNTIME_SOURCES,
                           "-o", tmp, "-Wl,-soname,libopenreg.so"], cwd=HERE)
    os.replace(tmp, target)  # atomic: a process using the old library keeps its mapping
    return out_dir


class BuildWithRuntime(BuildExtension):
    def build_extension(self, ext):
        out_dir = os.path.dirname(self.get_ext_fullpath(ext.name))
        build_runtime(out_dir)
        ext.library_dirs = [out_dir, *ext.library_dirs]  # keep torch's own library directory
        super().build_extension(ext)

    def copy_extensions_to_source(self):
        # --inplace and editable installs copy _C back into src/; _C finds libopenreg via $ORIGIN.
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace_file, regular_file = self._get_inplace_equivalent(build_py, ext)
            target = os.path.join(os.path.dirname(inplace_file), "libopenreg.so")
            shutil.copy2(os.path.join(os.path.dirname(regular_file), "libopenreg.so"), target + ".tmp")
            os.replace(target + ".tmp", target)  # atomic, as in build_runtime


setup(
    ext_modules=[
        CppExtension(
            "devipc_openreg._C",
            GLUE_SOURCES,
            include_dirs=[os.path.join(HERE, CSRC, "runtime")],
            libraries=["openreg"],
            extra_compile_args=GLUE_FLAGS,
            extra_link_args=["-Wl,-rpath,$ORIGIN"],
        )
    ],
    cmdclass={"build_ext": BuildWithRuntime.with_options(use_ninja=True)},
)
