"""A foreign GPU user: a real Vulkan process that is not a vramd peer.

It opens the device, then allocates and frees device memory on command,
ignoring the arena (no token, no ring, no record), as a training job or a
game would.  One command per line on stdin, one reply per line on stdout:

    alloc BYTES   -> "ok BYTES" (device-local memory, touched so that it is really held)
    free          -> "ok 0"     (everything it allocated)
    budget        -> "budget {json}" (the device's budget as this process sees it)
    quit

Run: python tests/gpu/foreign_user.py   (VK_DRIVER_FILES picks the driver, as for vramd)
"""
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from vramd.gpu.device import Device  # noqa: E402

CHUNK = 256 << 20


def main() -> None:
    dev = Device()
    vk, ffi = dev.vk, dev.ffi
    types = dev.memory_types
    local = [t for t in types if t["flags"] & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT]
    # Prefer device-local memory the host cannot see (real VRAM on a GPU); on
    # lavapipe the only type is host-visible, so map it and write every page.
    pick = next((t for t in local if not t["flags"] & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT), None) or local[0]
    visible = bool(pick["flags"] & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT)
    held = []
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        try:
            if not cmd:
                continue
            if cmd[0] == "alloc":
                left = int(cmd[1])
                while left > 0:
                    n = min(CHUNK, left)
                    mem = vk.vkAllocateMemory(dev.device, vk.VkMemoryAllocateInfo(
                        allocationSize=n, memoryTypeIndex=pick["index"]), None)
                    held.append(mem)
                    if visible:
                        p = vk.vkMapMemory(dev.device, mem, 0, n, 0)
                        ctypes.memset(int(ffi.cast("uintptr_t", ffi.from_buffer(p))), 0x5A, n)
                        vk.vkUnmapMemory(dev.device, mem)
                    left -= n
                print(f"ok {cmd[1]}", flush=True)
            elif cmd[0] == "free":
                while held:
                    vk.vkFreeMemory(dev.device, held.pop(), None)
                print("ok 0", flush=True)
            elif cmd[0] == "budget":
                print("budget " + json.dumps(dev.budget()), flush=True)
            elif cmd[0] == "quit":
                break
            else:
                print(f"err unknown command {cmd[0]!r}", flush=True)
        except Exception as e:  # one line, the caller decides
            print(f"err {type(e).__name__}: {e}", flush=True)
    while held:
        vk.vkFreeMemory(dev.device, held.pop(), None)
    dev.close()


if __name__ == "__main__":
    main()
