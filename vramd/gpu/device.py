"""The Vulkan device context: instance, physical device, logical device,
queues, and what the device can do (extensions, limits, memory heaps).

One `Device` per daemon.  It is the only place that talks to the `vulkan`
binding about setup; the residency core (native) receives its raw handles.

Choice of device: `select` is an index into the enumeration order, a UUID
(hex, dashes optional), or None for the first discrete GPU, else the first
device of any type (Mesa's lavapipe included, which is what CI runs on).

Queues: one compute queue, plus a queue of a dedicated transfer family
(TRANSFER without GRAPHICS or COMPUTE: the copy engine) when the device has
one; with a single queue, as on lavapipe, both roles share it.
"""
from __future__ import annotations

import re

from vramd.errors import DeviceError

INSTALL_HINT = ("install the Vulkan loader and a driver: `apt install libvulkan1 mesa-vulkan-drivers` "
                "(lavapipe, a CPU device) or the GPU vendor's driver")

# Extensions the core uses when present; none is required.  VK_KHR_cooperative_matrix:
# the tensor-core matmul_cm_<type> kernels (vramd/engine/linear.py chooses them).
WANTED_EXTENSIONS = ("VK_EXT_external_memory_host", "VK_EXT_memory_budget", "VK_KHR_timeline_semaphore",
                     "VK_KHR_cooperative_matrix", "VK_EXT_subgroup_size_control",
                     "VK_KHR_shader_integer_dot_product")

# VkComponentTypeKHR / VkScopeKHR values -> names (describe(), linear.py's checks).
_COMPONENTS = {0: "f16", 1: "f32", 2: "f64", 3: "s8", 4: "s16", 5: "s32", 6: "s64", 7: "u8", 8: "u16",
               9: "u32", 10: "u64", 1000141000: "bf16"}
_SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}


def parse_coopmat_shapes(props) -> list[dict]:
    """VkCooperativeMatrixPropertiesKHR entries -> [{m, n, k, a, b, c, result, saturating, scope}]
    (component types and scopes by name; an unknown value keeps its number)."""
    return [{"m": int(p.MSize), "n": int(p.NSize), "k": int(p.KSize),
             "a": _COMPONENTS.get(int(p.AType), int(p.AType)), "b": _COMPONENTS.get(int(p.BType), int(p.BType)),
             "c": _COMPONENTS.get(int(p.CType), int(p.CType)),
             "result": _COMPONENTS.get(int(p.ResultType), int(p.ResultType)),
             "saturating": bool(p.saturatingAccumulation), "scope": _SCOPES.get(int(p.scope), int(p.scope))}
            for p in props]


def _coopmat_shapes(vk, instance, phys) -> list[dict]:
    """The device's cooperative-matrix shapes (vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR,
    an instance-level extension function the binding reaches through vkGetInstanceProcAddr)."""
    name = "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR"
    fn = vk.lib.vkGetInstanceProcAddr(instance, name.encode())
    if fn == vk.ffi.NULL:
        return []
    fn = vk.ffi.cast("PFN_" + name, fn)
    count = vk.ffi.new("uint32_t*")
    if fn(phys, count, vk.ffi.NULL) != vk.VK_SUCCESS or count[0] == 0:
        return []
    props = vk.ffi.new("VkCooperativeMatrixPropertiesKHR[]", count[0])
    for i in range(count[0]):
        props[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
    if fn(phys, count, props) not in (vk.VK_SUCCESS, vk.VK_INCOMPLETE):
        return []
    return parse_coopmat_shapes(props[i] for i in range(count[0]))

_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}


def _vk():
    """The binding, imported late so that a machine without the loader gets
    a DeviceError instead of an import-time OSError."""
    try:
        import vulkan
    except OSError as e:  # the binding raises OSError when libvulkan.so.1 is missing
        raise DeviceError(f"no Vulkan loader (libvulkan.so.1): {INSTALL_HINT}") from e
    except ImportError as e:
        raise DeviceError(f"the Python package `vulkan` is missing: pip install vulkan ({e})") from e
    return vulkan


def _uuid_hex(raw) -> str:
    return bytes(raw).hex()


def _create_instance(vk):
    app = vk.VkApplicationInfo(pApplicationName="vramd", applicationVersion=1, pEngineName="vramd",
                               engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 2, 0))
    info = vk.VkInstanceCreateInfo(pApplicationInfo=app)
    try:
        return vk.vkCreateInstance(info, None)
    except vk.VkErrorIncompatibleDriver as e:
        raise DeviceError(f"no Vulkan driver found: {INSTALL_HINT}") from e
    except vk.VkError as e:
        raise DeviceError(f"vkCreateInstance failed ({type(e).__name__}): {INSTALL_HINT}") from e


def list_devices() -> list[dict]:
    """The Vulkan devices this process can see: index, name, type, UUID."""
    vk = _vk()
    inst = _create_instance(vk)
    try:
        return [_describe(vk, i, p) for i, p in enumerate(_enumerate(vk, inst))]
    finally:
        vk.vkDestroyInstance(inst, None)


def _enumerate(vk, inst):
    try:
        return list(vk.vkEnumeratePhysicalDevices(inst))
    except vk.VkError:
        return []


def _describe(vk, index, phys) -> dict:
    idp = vk.VkPhysicalDeviceIDProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES)
    p2 = vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=idp)
    vk.vkGetPhysicalDeviceProperties2(phys, p2)
    props = p2.properties
    return {"index": index, "name": vk.ffi.string(props.deviceName).decode(),
            "type": _TYPES.get(props.deviceType, "other"), "uuid": _uuid_hex(idp.deviceUUID),
            "api": "%d.%d" % (props.apiVersion >> 22, (props.apiVersion >> 12) & 0x3FF)}


def _pick(vk, phys: list, select) -> int:
    if not phys:
        raise DeviceError(f"no Vulkan device found: {INSTALL_HINT}")
    descs = [_describe(vk, i, p) for i, p in enumerate(phys)]
    if select is None or select == "":
        for d in descs:
            if d["type"] == "discrete":
                return d["index"]
        return 0
    if isinstance(select, int) or (isinstance(select, str) and select.isdigit()):
        i = int(select)
        if not 0 <= i < len(phys):
            raise DeviceError(f"no Vulkan device {i}: this machine has {len(phys)} "
                              f"({', '.join(d['name'] for d in descs)})")
        return i
    want = re.sub(r"[^0-9a-f]", "", str(select).lower())
    for d in descs:
        if d["uuid"] == want:
            return d["index"]
    raise DeviceError(f"no Vulkan device with UUID {select}: this machine has "
                      + ", ".join(f"{d['name']} {d['uuid']}" for d in descs))


class Device:
    """An open Vulkan device with a compute queue and, where one exists, a
    dedicated transfer queue.  Close it (or use it as a context manager)."""

    def __init__(self, select=None, transfer_queue: bool = True, timeline: bool = True):
        """`transfer_queue=False` keeps copies on the compute queue even where
        a dedicated transfer family exists (for comparison); `timeline=False`
        leaves timeline semaphores off, as on a device without them (the
        core then orders its queues with fences on the host)."""
        vk = self.vk = _vk()
        self.ffi = vk.ffi
        self.instance = _create_instance(vk)
        self.device = None
        try:
            self._open(select, transfer_queue, timeline)
        except BaseException:
            self.close()
            raise

    def _open(self, select, transfer_queue, timeline):
        vk = self.vk
        phys = _enumerate(vk, self.instance)
        self.index = _pick(vk, phys, select)
        self.physical = phys[self.index]
        desc = _describe(vk, self.index, self.physical)
        self.name, self.type, self.uuid, self.api = desc["name"], desc["type"], desc["uuid"], desc["api"]
        props = vk.vkGetPhysicalDeviceProperties(self.physical)
        lim = props.limits
        self.limits = {
            "maxStorageBufferRange": int(lim.maxStorageBufferRange),
            "minStorageBufferOffsetAlignment": int(lim.minStorageBufferOffsetAlignment),
            "maxComputeWorkGroupCount": [int(x) for x in lim.maxComputeWorkGroupCount],
            "maxPushConstantsSize": int(lim.maxPushConstantsSize),
        }
        available = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(self.physical, None)}
        api_12 = props.apiVersion >= vk.VK_MAKE_VERSION(1, 2, 0)

        # Queue families: compute first; a transfer-only family is the copy
        # engine, which runs DMA beside compute.
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(self.physical)
        compute = [i for i, q in enumerate(families) if q.queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not compute:
            raise DeviceError(f"Vulkan device {self.name} has no compute queue")
        transfer = [i for i, q in enumerate(families)
                    if q.queueFlags & vk.VK_QUEUE_TRANSFER_BIT
                    and not q.queueFlags & (vk.VK_QUEUE_GRAPHICS_BIT | vk.VK_QUEUE_COMPUTE_BIT)]
        self.compute_family = compute[0]
        self.dedicated_transfer = bool(transfer) and transfer_queue
        self.transfer_family = transfer[0] if self.dedicated_transfer else self.compute_family

        # Timeline semaphores: core in 1.2 (feature bit), else the KHR extension.
        # With them: f16 arithmetic, 16-bit storage and cooperative matrices (queried in one chain).
        # And the subgroup size control (matmul_cm_<type> asks for subgroups of 32 lanes).
        has_ssc = "VK_EXT_subgroup_size_control" in available
        sscf = vk.VkPhysicalDeviceSubgroupSizeControlFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES)
        cmf = vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR,
            pNext=sscf if has_ssc else None)
        # Integer dot products (OpSDot of packed int8: the matvec_q8_0_dp decode kernel).
        has_idp = "VK_KHR_shader_integer_dot_product" in available
        idpf = vk.VkPhysicalDeviceShaderIntegerDotProductFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES,
            pNext=cmf if "VK_KHR_cooperative_matrix" in available else (sscf if has_ssc else None))
        s16 = vk.VkPhysicalDevice16BitStorageFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES,
            pNext=idpf if has_idp else (cmf if "VK_KHR_cooperative_matrix" in available else (sscf if has_ssc else None)))
        f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES, pNext=s16)
        tl = vk.VkPhysicalDeviceTimelineSemaphoreFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES, pNext=f16)
        f2 = vk.VkPhysicalDeviceFeatures2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=tl)
        vk.vkGetPhysicalDeviceFeatures2(self.physical, f2)
        self.float16 = api_12 and bool(f16.shaderFloat16)
        self.storage16 = api_12 and bool(s16.storageBuffer16BitAccess)
        self.integer_dot = api_12 and has_idp and bool(idpf.shaderIntegerDotProduct)
        sscp = vk.VkPhysicalDeviceSubgroupSizeControlProperties(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_PROPERTIES)
        sub = vk.VkPhysicalDeviceSubgroupProperties(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_PROPERTIES,
                                                    pNext=sscp if has_ssc else None)
        vk.vkGetPhysicalDeviceProperties2(
            self.physical, vk.VkPhysicalDeviceProperties2(sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2,
                                                          pNext=sub))
        self.subgroup_size = int(sub.subgroupSize)
        # Subgroup sizes a compute pipeline may require (VK_EXT_subgroup_size_control, core in
        # 1.3): (min, max), or None; full_subgroups: every subgroup of a work group complete.
        ssc = (has_ssc and api_12 and bool(sscf.subgroupSizeControl)
               and bool(sscp.requiredSubgroupSizeStages & vk.VK_SHADER_STAGE_COMPUTE_BIT))
        self.subgroup_sizes = (int(sscp.minSubgroupSize), int(sscp.maxSubgroupSize)) if ssc else None
        self.full_subgroups = ssc and bool(sscf.computeFullSubgroups)
        self.limits["maxComputeSharedMemorySize"] = int(lim.maxComputeSharedMemorySize)
        # Cooperative matrices: the extension and its feature, on a device with f16 arithmetic
        # (the kernels' tiles are f16); the shapes it offers (linear.py picks by them).
        self.coopmat = ([] if not (api_12 and self.float16 and "VK_KHR_cooperative_matrix" in available
                                   and cmf.cooperativeMatrix)
                        else _coopmat_shapes(vk, self.instance, self.physical))
        self.timeline = (timeline and bool(tl.timelineSemaphore)
                         and (api_12 or "VK_KHR_timeline_semaphore" in available))
        exts = [e for e in WANTED_EXTENSIONS if e in available]
        if not self.coopmat and "VK_KHR_cooperative_matrix" in exts:
            exts.remove("VK_KHR_cooperative_matrix")
        if not self.integer_dot and "VK_KHR_shader_integer_dot_product" in exts:
            exts.remove("VK_KHR_shader_integer_dot_product")
        if self.subgroup_sizes is None and "VK_EXT_subgroup_size_control" in exts:
            exts.remove("VK_EXT_subgroup_size_control")
        if api_12 and "VK_KHR_timeline_semaphore" in exts:
            exts.remove("VK_KHR_timeline_semaphore")  # core: the feature bit is enough
        self.extensions = frozenset(exts)
        self.host_import = "VK_EXT_external_memory_host" in exts
        self.memory_budget = "VK_EXT_memory_budget" in exts

        # Keep every nested struct in a local until vkCreateDevice returns:
        # the binding does not keep them alive (brief §6).
        prio = [1.0]
        qinfos = [vk.VkDeviceQueueCreateInfo(queueFamilyIndex=f, queueCount=1, pQueuePriorities=prio)
                  for f in sorted({self.compute_family, self.transfer_family})]
        on = lambda b: vk.VK_TRUE if b else vk.VK_FALSE  # noqa: E731
        enable_ssc = (vk.VkPhysicalDeviceSubgroupSizeControlFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SUBGROUP_SIZE_CONTROL_FEATURES,
            subgroupSizeControl=vk.VK_TRUE, computeFullSubgroups=on(self.full_subgroups))
            if self.subgroup_sizes else None)
        enable_cm = (vk.VkPhysicalDeviceCooperativeMatrixFeaturesKHR(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR, cooperativeMatrix=vk.VK_TRUE,
            pNext=enable_ssc)
            if self.coopmat else enable_ssc)
        enable_idp = (vk.VkPhysicalDeviceShaderIntegerDotProductFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_INTEGER_DOT_PRODUCT_FEATURES,
            shaderIntegerDotProduct=vk.VK_TRUE, pNext=enable_cm)
            if self.integer_dot else enable_cm)
        enable_s16 = vk.VkPhysicalDevice16BitStorageFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_16BIT_STORAGE_FEATURES, pNext=enable_idp,
            storageBuffer16BitAccess=on(self.storage16))
        enable_f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_SHADER_FLOAT16_INT8_FEATURES, pNext=enable_s16,
            shaderFloat16=on(self.float16))
        enable_tl = vk.VkPhysicalDeviceTimelineSemaphoreFeatures(
            sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_TIMELINE_SEMAPHORE_FEATURES, pNext=enable_f16,
            timelineSemaphore=on(self.timeline))
        info = vk.VkDeviceCreateInfo(pNext=enable_tl, pQueueCreateInfos=qinfos,
                                     ppEnabledExtensionNames=list(exts))
        try:
            self.device = vk.vkCreateDevice(self.physical, info, None)
        except vk.VkError as e:
            raise DeviceError(f"vkCreateDevice on {self.name} failed ({type(e).__name__})") from e
        self.compute_queue = vk.vkGetDeviceQueue(self.device, self.compute_family, 0)
        self.transfer_queue = vk.vkGetDeviceQueue(self.device, self.transfer_family, 0)

        mp = vk.vkGetPhysicalDeviceMemoryProperties(self.physical)
        self.heaps = [{"index": i, "size": int(mp.memoryHeaps[i].size),
                       "device_local": bool(mp.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)}
                      for i in range(mp.memoryHeapCount)]
        self.memory_types = [{"index": i, "flags": int(mp.memoryTypes[i].propertyFlags),
                              "heap": int(mp.memoryTypes[i].heapIndex)} for i in range(mp.memoryTypeCount)]

    def handle(self, obj) -> int:
        """A Vulkan handle as the integer the native core takes."""
        return int(self.ffi.cast("uintptr_t", obj))

    def budget(self, own_usage: dict | None = None) -> list[dict]:
        """Per heap: size, budget and usage in bytes.  With VK_EXT_memory_budget
        the driver's figures (they count other processes too); without it the
        budget is the heap size and the usage is `own_usage` (heap -> bytes,
        the residency core's accounting)."""
        vk = self.vk
        own_usage = own_usage or {}
        out = []
        if self.memory_budget:
            b = self.ffi.new("VkPhysicalDeviceMemoryBudgetPropertiesEXT*")
            b.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT
            p2 = self.ffi.new("VkPhysicalDeviceMemoryProperties2*")
            p2.sType = vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2
            p2.pNext = b
            vk.lib.vkGetPhysicalDeviceMemoryProperties2(self.physical, p2)
        for h in self.heaps:
            i = h["index"]
            entry = {"heap": i, "size": h["size"], "device_local": h["device_local"]}
            if self.memory_budget:
                entry.update(budget=int(b.heapBudget[i]), usage=int(b.heapUsage[i]), source="driver")
            else:
                entry.update(budget=h["size"], usage=int(own_usage.get(i, 0)), source="own")
            out.append(entry)
        return out

    def describe(self) -> dict:
        return {"index": self.index, "name": self.name, "type": self.type, "uuid": self.uuid, "api": self.api,
                "compute_family": self.compute_family, "transfer_family": self.transfer_family,
                "dedicated_transfer": self.dedicated_transfer, "timeline": self.timeline,
                "extensions": sorted(self.extensions), "limits": self.limits, "heaps": self.heaps,
                "float16": self.float16, "storage16": self.storage16, "subgroup_size": self.subgroup_size,
                "subgroup_sizes": list(self.subgroup_sizes) if self.subgroup_sizes else None,
                "coopmat": self.coopmat, "integer_dot": self.integer_dot}

    def wait_idle(self):
        if self.device is not None:
            self.vk.vkDeviceWaitIdle(self.device)

    def close(self):
        vk = self.vk
        if self.device is not None:
            vk.vkDeviceWaitIdle(self.device)
            vk.vkDestroyDevice(self.device, None)
            self.device = None
        if self.instance is not None:
            vk.vkDestroyInstance(self.instance, None)
            self.instance = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
