"""What VK_EXT_memory_budget says about another process's device memory.

One process watches the device's budget while a second one (a foreign GPU
user, tests/gpu/foreign_user.py) allocates and frees device memory.  Prints,
per step, heapBudget and heapUsage of the device-local heap as the watcher
sees them, and vramd's reading of them (vramd/gpu/memview.py: free =
budget - usage, others = size - free - own).  Needs only the `vulkan`
binding (no native build, no model):

    python3 scripts/foreign_vram_probe.py [GiB]     # default 8

On lavapipe (Mesa 22.3) the extension is absent and the script says so.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vramd.gpu.device import Device  # noqa: E402

GiB = 1 << 30


def main() -> None:
    size = int(float(sys.argv[1]) * GiB) if len(sys.argv) > 1 else 8 * GiB
    dev = Device()
    print(json.dumps({"device": dev.name, "extensions": sorted(dev.extensions), "heaps": dev.heaps}))
    if not dev.memory_budget:
        print("no VK_EXT_memory_budget on this device: the driver says nothing about other processes")
        return
    child = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "gpu", "foreign_user.py")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"

    def ask(line):
        child.stdin.write(line + "\n")
        child.stdin.flush()
        return child.stdout.readline().strip()

    def show(step):
        for h in dev.budget():
            if h["device_local"]:
                free = h["budget"] - h["usage"]
                print(f"{step:>16}  heap {h['heap']}: size {h['size'] / GiB:7.2f} GiB"
                      f"  budget {h['budget'] / GiB:7.2f}  usage {h['usage'] / GiB:7.2f}"
                      f"  -> free {free / GiB:7.2f}  others {(h['size'] - free) / GiB:7.2f}")

    show("before")
    print("foreign:", ask(f"alloc {size}"))
    show(f"foreign +{size / GiB:g} GiB")
    print("foreign sees:", ask("budget"))
    print("foreign:", ask("free"))
    show("foreign freed")
    ask("quit")
    child.wait()
    dev.close()


if __name__ == "__main__":
    main()
