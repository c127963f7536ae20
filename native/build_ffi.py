"""cffi build of the residency core (API mode): `vramd.gpu._residency`.

setup.py names this in `cffi_modules`, so `pip install .` compiles
native/src/*.c into the package.  The declarations cffi sees are the
CDEF section of the public header, verbatim: one source of truth for the C
and the Python side.

Vulkan headers: Debian's libvulkan-dev (scripts/setup.sh installs it); set
VULKAN_INCLUDE to another include directory where they live elsewhere.  The
extension does not link libvulkan: it gets every entry point at run time.
"""
import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "include", "vramd", "residency.h")


def cdef_text():
    text = open(HEADER, encoding="utf-8").read()
    start = text.index("/* CDEF BEGIN */") + len("/* CDEF BEGIN */")
    return text[start:text.index("/* CDEF END */")]


ffibuilder = FFI()
ffibuilder.cdef(cdef_text())

include_dirs = [os.path.join(HERE, "include"), os.path.join(HERE, "src")]
if os.environ.get("VULKAN_INCLUDE"):
    include_dirs.append(os.environ["VULKAN_INCLUDE"])

# Paths relative to setup.py's directory: setuptools wants them relative.
root = os.path.dirname(HERE)
sources = sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(HERE, "src", "*.c")))

ffibuilder.set_source(
    "vramd.gpu._residency",
    '#include "vramd/residency.h"',
    sources=sources,
    include_dirs=[os.path.relpath(p, root) if p.startswith(root) else p for p in include_dirs],
    extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wno-unused-parameter"],
    libraries=["dl", "pthread"],
)

if __name__ == "__main__":
    os.chdir(root)
    ffibuilder.compile(verbose=True)
