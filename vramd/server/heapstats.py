"""The C heap of this process, as glibc counts it (mallinfo2), for leak hunting.

RSS alone cannot tell a leak from memory the allocator keeps after a free
(glibc keeps freed heap and, after a large block is freed, serves blocks of
that size from the heap instead of mmap).  `in_use` is what the process's
C code, Python's allocator and the Vulkan driver hold now; `free` is what
glibc keeps without handing it back.  `vramd bench soak` samples both.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
           "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in _FIELDS]


_mallinfo2 = None


def heap_stats() -> dict | None:
    """{"in_use", "free", "mmapped"} in bytes, or None without glibc >= 2.33."""
    global _mallinfo2
    if _mallinfo2 is None:
        try:
            fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
        except (OSError, AttributeError):
            _mallinfo2 = False
            return None
        fn.restype = _MallInfo2
        fn.argtypes = []
        _mallinfo2 = fn
    if _mallinfo2 is False:
        return None
    m = _mallinfo2()
    return {"in_use": int(m.uordblks + m.hblkhd), "free": int(m.fordblks), "mmapped": int(m.hblkhd)}
