"""Builds the native residency core into vramd.gpu._residency (cffi, API
mode) and ships the compiled shaders (native/shaders/*.spv) inside the
package as vramd/gpu/shaders/.  Everything else is in pyproject.toml."""
import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class build_py_with_shaders(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return  # a checkout finds native/shaders itself (vramd/gpu/kernels.py)
        target = os.path.join(self.build_lib, "vramd", "gpu", "shaders")
        os.makedirs(target, exist_ok=True)
        for spv in glob.glob(os.path.join("native", "shaders", "*.spv")):
            shutil.copy(spv, target)


setup(cffi_modules=["native/build_ffi.py:ffibuilder"], cmdclass={"build_py": build_py_with_shaders})
