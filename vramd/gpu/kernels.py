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
import struct
from pathlib import Path

from vramd.errors import UsageError

_HERE = Path(__file__).resolve().parent
# Installed: copied into the package by setup.py; in a checkout: the sources.
SHADER_DIRS = (_HERE / "shaders", _HERE.parent.parent / "native" / "shaders")
LOCAL_SIZE = 256
_MAX_IN_FLIGHT = 64


def shader_path(name: str) -> Path:
    for d in SHADER_DIRS:
        p = d / f"{name}.spv"
        if p.is_file():
            return p
    raise UsageError(f"no compiled shader {name}.spv in " + " or ".join(str(d) for d in SHADER_DIRS))


class Kernel:
    """A compute pipeline with `n_buffers` storage buffers (set 0, bindings
    0..n-1) and `push_bytes` of push constants."""

    def __init__(self, residency, name: str, n_buffers: int, push_bytes: int):
        self.residency = residency
        dev = residency.device
        vk, ffi = self.vk, self.ffi = dev.vk, dev.ffi
        self.dev = dev.device
        self.n_buffers, self.push_bytes = n_buffers, push_bytes
        self.max_groups = dev.limits["maxComputeWorkGroupCount"]
        code = shader_path(name).read_bytes()
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
        stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=self.module,
                                                   pName="main")
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


class StateStep(Kernel):
    """native/shaders/state_step.comp: words = words * mul + add (uint32)."""

    def __init__(self, residency):
        super().__init__(residency, "state_step", n_buffers=1, push_bytes=12)

    def __call__(self, tensor, mul: int, add: int) -> None:
        """One step over the whole tensor, one dispatch per storage view."""
        for view in tensor.views():
            words = view[2] // 4
            self.dispatch([view], struct.pack("<III", words, mul & 0xFFFFFFFF, add & 0xFFFFFFFF), words)


def glslc_command(source: os.PathLike, output: os.PathLike) -> list[str]:
    """The exact command that produced each committed .spv."""
    return ["glslc", "-O", "--target-env=vulkan1.2", "-o", str(output), str(source)]
