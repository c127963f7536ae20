"""The Python face of the native residency core (native/include/vramd/residency.h).

    dev = Device()
    res = Residency(dev)
    w = res.region("weights", "backbone", {"tok_embd": 4096 * 2048, "out": 8192})
    w.tensors["tok_embd"].host()[:] = ...    # load straight into the shadow
    res.restore(["weights"])                   # pipelined upload
    ...compute...
    res.release(["weights", "state"])          # weights: free; state: copy back, free
    res.breakdown()   # {"weights": {"device": 0, "host": ...}, "state": {...}, ...}

Names match the C side: `Residency.restore` is `vramd_restore`, `Region.release`
is `vramd_region_release`, `Tensor.write` is `vramd_tensor_write`, and so on.
Every native call goes through `check`, which turns a status into the matching
vramd error carrying the native message.
"""
from __future__ import annotations

import numpy as np

from vramd import failpoints
from vramd.errors import DeviceError, OutOfDeviceMemory, UsageError

try:
    from vramd.gpu._residency import ffi, lib
except ImportError as e:  # pragma: no cover - only on a broken install
    raise DeviceError("the native residency core is not built: run `pip install -e .` "
                      f"(needs gcc and the Vulkan headers, Debian libvulkan-dev): {e}") from e


def _arm_native_failpoint(name: str, action: int, at: int) -> None:
    check(lib.vramd_failpoint_arm(name.encode(), action, at))


def native_failpoints() -> list[str]:
    """The failpoint names the native core knows (vramd/failpoints.py lists them too)."""
    names = []
    while (p := lib.vramd_failpoint_name(len(names))) != ffi.NULL:
        names.append(ffi.string(p).decode())
    return names


KINDS = ("weights", "state", "encoder", "scratch")
_KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
_ERRORS = {lib.VRAMD_ERR_USAGE: UsageError, lib.VRAMD_ERR_OOM: OutOfDeviceMemory,
           lib.VRAMD_ERR_DEVICE: DeviceError}


def check(status: int) -> None:
    """Raises the vramd error for a native status, with the native message."""
    if status == lib.VRAMD_OK:
        return
    message = ffi.string(lib.vramd_last_error()).decode(errors="replace")
    raise _ERRORS.get(status, DeviceError)(message or f"native residency core failed ({status})")


def kind_mask(kinds) -> int:
    """A kind name or an iterable of names as the core's bit mask."""
    if isinstance(kinds, str):
        kinds = [kinds]
    mask = 0
    for k in kinds:
        if k not in _KIND_INDEX:
            raise UsageError(f"unknown region kind {k!r}: one of {', '.join(KINDS)}")
        mask |= 1 << _KIND_INDEX[k]
    return mask


failpoints.register_native(_arm_native_failpoint)


class Tensor:
    """A tensor placed in a region: one block, an offset in it, a size."""

    def __init__(self, region: Region, name: str, index: int):
        self.region, self.name, self.index = region, name, index
        place = ffi.new("vramd_tensor_place*")
        check(lib.vramd_tensor_place_get(region._r, index, place))
        self.block, self.offset, self.nbytes = int(place.block), int(place.offset), int(place.nbytes)

    def host(self) -> np.ndarray:
        """The tensor's bytes in the host shadow, as a writable uint8 array.
        Valid until the region is destroyed.  Write here to load a model
        before the first restore (zero copy from the file's reader)."""
        p = ffi.new("void**")
        check(lib.vramd_tensor_host(self.region._r, self.index, p))
        return np.frombuffer(ffi.buffer(p[0], self.nbytes), dtype=np.uint8)

    def write(self, data, offset: int = 0) -> None:
        """Puts bytes into the tensor: the shadow, and the device if resident."""
        buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        check(lib.vramd_tensor_write(self.region._r, self.index, offset, ffi.from_buffer(buf), buf.nbytes))

    def read(self, dtype=np.uint8, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """The tensor's bytes: from the device when resident, else the shadow."""
        n = self.nbytes - offset if nbytes is None else nbytes
        out = np.empty(n, dtype=np.uint8)
        check(lib.vramd_tensor_read(self.region._r, self.index, offset, ffi.from_buffer(out), n))
        return out.view(dtype)

    upload = write
    download = read

    def buffer(self) -> tuple[int, int]:
        """(VkBuffer handle, byte offset) of the tensor on the device.  Scratch
        is allocated here if released; other kinds must be resident."""
        b = ffi.new("uint64_t*")
        o = ffi.new("uint64_t*")
        check(lib.vramd_tensor_buffer(self.region._r, self.index, b, o))
        return int(b[0]), int(o[0])

    def views(self) -> list[tuple[int, int, int]]:
        """(buffer, offset, nbytes) pieces covering the tensor, each within
        maxStorageBufferRange and starting at a storage-aligned offset, so a
        shader can bind every piece.  One piece unless the tensor is larger
        than the range."""
        buf, off = self.buffer()
        lim = self.region.residency.limits
        step = lim["max_storage_range"] // lim["storage_alignment"] * lim["storage_alignment"]
        return [(buf, off + start, min(step, self.nbytes - start)) for start in range(0, self.nbytes, step)]

    def __repr__(self):
        return f"Tensor({self.region.name}/{self.name}, {self.nbytes} B, block {self.block} +{self.offset})"


class Region:
    """Tensors of one kind that are released and restored together."""

    def __init__(self, residency: Residency, kind: str, name: str, tensors, evict: bool = True):
        if kind not in _KIND_INDEX:
            raise UsageError(f"unknown region kind {kind!r}: one of {', '.join(KINDS)}")
        items = list(tensors.items()) if isinstance(tensors, dict) else list(tensors)
        if not items:
            raise UsageError(f"region {name!r} needs at least one tensor")
        self.residency, self.kind, self.name = residency, kind, name
        p = ffi.new("vramd_region**")
        check(lib.vramd_region_create(residency._ctx, _KIND_INDEX[kind], name.encode(), p))
        self._r = p[0]
        try:
            idx = ffi.new("uint32_t*")
            for tname, nbytes in items:
                if int(nbytes) <= 0:
                    raise UsageError(f"region {name!r}: tensor {tname!r} has {nbytes} bytes")
                check(lib.vramd_region_add_tensor(self._r, int(nbytes), idx))
            check(lib.vramd_region_seal(self._r))
            check(lib.vramd_region_set_evict(self._r, 1 if evict else 0))
            self.tensors = {tname: Tensor(self, tname, i) for i, (tname, _) in enumerate(items)}
        except BaseException:
            lib.vramd_region_destroy(self._r)
            self._r = None
            raise

    def info(self) -> dict:
        i = ffi.new("vramd_region_info*")
        check(lib.vramd_region_info_get(self._r, i))
        return {"kind": KINDS[i.kind], "resident": bool(i.resident), "evict": bool(i.evict),
                "tensors": int(i.n_tensors), "blocks": int(i.n_blocks), "bytes": int(i.bytes),
                "device": int(i.device_bytes), "host": int(i.host_bytes),
                # The shadow is the last complete copy (a state region's generation counts the
                # evictions completed into it); not valid only after an eviction failed mid-copy.
                "shadow_generation": int(i.shadow_generation), "shadow_valid": bool(i.shadow_valid)}

    @property
    def resident(self) -> bool:
        return self.info()["resident"]

    @property
    def evict(self) -> bool:
        return self.info()["evict"]

    @evict.setter
    def evict(self, value: bool):
        check(lib.vramd_region_set_evict(self._r, 1 if value else 0))

    def restore(self) -> None:
        self.residency.generation += 1
        check(lib.vramd_region_restore(self._r))

    def release(self) -> None:
        """Releases this region; state is copied back whatever its policy."""
        self.residency.generation += 1
        check(lib.vramd_region_release(self._r))

    def destroy(self) -> None:
        if self._r is not None:
            self.residency.generation += 1
            lib.vramd_region_destroy(self._r)
            self._r = None
            self.residency.regions.remove(self)

    def __repr__(self):
        return f"Region({self.kind} {self.name!r}, {len(self.tensors)} tensors)"


class Residency:
    """The residency core for one device: regions, release/restore, accounting."""

    def __init__(self, device, block_bytes: int = 0, device_limit: int = 0, alloc_threads: int = 0,
                 flags: int = 0):
        self.device = device
        desc = ffi.new("vramd_ctx_desc*")
        h = device.handle
        desc.instance, desc.physical_device, desc.device = h(device.instance), h(device.physical), h(device.device)
        desc.compute_queue, desc.compute_family = h(device.compute_queue), device.compute_family
        desc.transfer_queue, desc.transfer_family = h(device.transfer_queue), device.transfer_family
        desc.timeline, desc.host_import = int(device.timeline), int(device.host_import)
        desc.memory_budget = int(device.memory_budget)
        desc.block_bytes, desc.device_limit = int(block_bytes), int(device_limit)
        desc.alloc_threads, desc.flags = int(alloc_threads), int(flags)
        p = ffi.new("vramd_ctx**")
        check(lib.vramd_ctx_create(desc, p))
        self._ctx = p[0]
        self.regions: list[Region] = []
        # Bumped by every release and restore (and region destroy): device
        # buffers may have moved since, so a command buffer recorded with
        # the old ones must be re-recorded (the model's decode graphs).
        self.generation = 0
        lim = ffi.new("vramd_limits*")
        check(lib.vramd_ctx_limits(self._ctx, lim))
        self.limits = {"max_allocation": int(lim.max_allocation), "max_storage_range": int(lim.max_storage_range),
                       "storage_alignment": max(1, int(lim.storage_alignment)), "block_bytes": int(lim.block_bytes),
                       "device_heap": int(lim.device_heap), "shadow_imported": bool(lim.shadow_imported)}

    def region(self, kind: str, name: str, tensors, evict: bool = True) -> Region:
        """A new region of `kind` holding `tensors` ({name: nbytes} or pairs),
        laid out and with its host shadow allocated.  It starts released."""
        r = Region(self, kind, name, tensors, evict)
        self.regions.append(r)
        return r

    def restore(self, kinds=("weights", "state")) -> None:
        """Uploads the released regions of `kinds` (encoder and scratch are
        brought in on use: vramd/engine/vision.py's `VisionEncoder.session`
        and `Tensor.buffer`).  Raises
        OutOfDeviceMemory with every touched region released, shadows intact."""
        self.generation += 1
        check(lib.vramd_restore(self._ctx, kind_mask(kinds)))

    def release(self, kinds=KINDS) -> None:
        """Releases the resident regions of `kinds` once in-flight compute is
        done: weights, encoder and scratch are freed, state is copied back
        (unless its region keeps it resident).  Device memory returns to the
        driver in the background; `drain` waits for that."""
        self.generation += 1
        check(lib.vramd_release(self._ctx, kind_mask(kinds)))

    def breakdown(self) -> dict:
        b = ffi.new("vramd_breakdown_t*")
        check(lib.vramd_breakdown(self._ctx, b))
        return {k: {"device": int(b.device[i]), "host": int(b.host[i])} for i, k in enumerate(KINDS)}

    def heap_usage(self) -> dict:
        out = {}
        n = ffi.new("uint64_t*")
        for h in self.device.heaps:
            check(lib.vramd_ctx_heap_usage(self._ctx, h["index"], n))
            out[h["index"]] = int(n[0])
        return out

    def budget(self) -> list[dict]:
        """Per heap size, budget and usage (the driver's, else our own)."""
        return self.device.budget(self.heap_usage())

    def set_device_limit(self, nbytes: int) -> None:
        """Caps the device bytes this core may hold (0: no cap)."""
        check(lib.vramd_ctx_set_device_limit(self._ctx, int(nbytes)))

    def sync(self) -> None:
        check(lib.vramd_ctx_sync(self._ctx))

    def drain(self) -> None:
        check(lib.vramd_ctx_drain(self._ctx))

    def reset_peak(self) -> None:
        """Start `stats()["device_peak"]` again from the bytes held now."""
        check(lib.vramd_ctx_reset_peak(self._ctx))

    def stats(self) -> dict:
        s = ffi.new("vramd_stats*")
        check(lib.vramd_ctx_stats(self._ctx, s))
        return {name: int(getattr(s, name)) for name, _ in ffi.typeof("vramd_stats").fields}

    def submit_compute(self, command_buffer) -> None:
        check(lib.vramd_submit_compute(self._ctx, self.device.handle(command_buffer)))

    def link_probe(self, nbytes: int, reps: int = 5) -> dict:
        out = ffi.new("double[4]")
        check(lib.vramd_link_probe(self._ctx, int(nbytes), int(reps), out))
        return {"h2d_gbps": out[0], "d2h_gbps": out[1], "h2d_best_gbps": out[2], "d2h_best_gbps": out[3]}

    def close(self) -> None:
        if getattr(self, "_ctx", None) is not None:
            for r in list(self.regions):
                r.destroy()
            lib.vramd_ctx_destroy(self._ctx)
            self._ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
