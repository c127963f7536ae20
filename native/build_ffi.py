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


def builder(absolute: bool = False) -> FFI:
    """The FFI builder.  setuptools wants source paths relative to setup.py;
    a direct compile (below) runs in a temporary directory and needs them
    absolute."""
    root = os.path.dirname(HERE)
    fix = (lambda p: p) if absolute else (lambda p: os.path.relpath(p, root))
    include_dirs = [fix(os.path.join(HERE, "include")), fix(os.path.join(HERE, "src"))]
    if os.environ.get("VULKAN_INCLUDE"):
        include_dirs.append(os.environ["VULKAN_INCLUDE"])
    ffi = FFI()
    ffi.cdef(cdef_text())
    ffi.set_source(
        "vramd.gpu._residency",
        '#include "vramd/residency.h"',
        sources=sorted(fix(p) for p in glob.glob(os.path.join(HERE, "src", "*.c"))),
        include_dirs=include_dirs,
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wno-unused-parameter"],
        libraries=["dl", "pthread"],
    )
    return ffi


ffibuilder = builder()

if __name__ == "__main__":
    # Build without setuptools' packaging (`python native/build_ffi.py`):
    # compiles in build/cffi and copies the extension next to vramd/gpu, as
    # `pip install -e .` would.  Used on machines with only a bare Python.
    import shutil

    root = os.path.dirname(HERE)
    so = builder(absolute=True).compile(tmpdir=os.path.join(root, "build", "cffi"), verbose=False)
    dest = os.path.join(root, "vramd", "gpu", os.path.basename(so))
    shutil.copy(so, dest)
    print(dest)
