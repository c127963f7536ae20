"""cffi build of the native core (API mode): `vramd.gpu._residency`.

setup.py names this in `cffi_modules`, so `pip install .` compiles
native/src/*.c into the package: the residency core and the host matvec
(native/src/hostmv.c, the CPU side of --n-cpu-moe).  The declarations cffi
sees are the CDEF sections of the public headers, verbatim: one source of
truth for the C and the Python side.

Vulkan headers: Debian's libvulkan-dev (scripts/setup.sh installs it); set
VULKAN_INCLUDE to another include directory where they live elsewhere.  The
extension does not link libvulkan: it gets every entry point at run time.
"""
import glob
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# hostmv.h uses residency.h's status codes: it comes second.
HEADERS = [os.path.join(HERE, "include", "vramd", name) for name in ("residency.h", "hostmv.h")]


def cdef_text():
    parts = []
    for header in HEADERS:
        text = open(header, encoding="utf-8").read()
        start = text.index("/* CDEF BEGIN */") + len("/* CDEF BEGIN */")
        parts.append(text[start:text.index("/* CDEF END */")])
    return "\n".join(parts)


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
        "".join(f'#include "vramd/{os.path.basename(h)}"\n' for h in HEADERS),
        sources=sorted(fix(p) for p in glob.glob(os.path.join(HERE, "src", "*.c"))),
        include_dirs=include_dirs,
        # -ffp-contract=fast: a*b+c may be one FMA where the CPU has it (hostmv.c's
        # AVX2 clone; ~20% on its Q8_0 rows), as GNU C does by default and ISO C
        # (-std=c11) does not.  -Wno-psabi: hostmv.c's helpers pass 32-byte vectors,
        # always inlined, so the AVX-vs-not calling convention GCC notes never applies.
        extra_compile_args=["-std=c11", "-O2", "-Wall", "-Wno-unused-parameter", "-ffp-contract=fast",
                            "-Wno-psabi"],
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
