/* A Vulkan layer for tests: device memory runs out on demand.
 *
 * Loaded into a daemon by the loader (VK_LAYER_PATH + VK_INSTANCE_LAYERS, see
 * tests/gpu/fail_alloc.py), it passes every call through except
 * vkAllocateMemory: while the file named by $VRAMD_TEST_FAIL_ALLOC exists and
 * holds a byte count N, every allocation of N bytes or more fails with
 * VK_ERROR_OUT_OF_DEVICE_MEMORY, as when another process holds the memory.
 * Removing the file gives the memory back.  On lavapipe (no memory budget,
 * device memory is the process's own host memory) this is how a test makes
 * one particular upload fail for real, in the driver call, between two steps
 * that succeed.
 *
 * Build: cc -shared -fPIC -O2 -o libvramd_fail_alloc.so fail_alloc_layer.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#define EXPORT __attribute__((visibility("default")))

static PFN_vkGetInstanceProcAddr next_gipa;
static PFN_vkGetDeviceProcAddr next_gdpa;
static PFN_vkAllocateMemory next_allocate;

static int out_of_memory(VkDeviceSize size) {
    const char *path = getenv("VRAMD_TEST_FAIL_ALLOC");
    if (!path || !*path) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    unsigned long long n = 0;
    int ok = fscanf(f, "%llu", &n) == 1;
    fclose(f);
    return ok && size >= n;
}

static VKAPI_ATTR VkResult VKAPI_CALL fa_AllocateMemory(VkDevice device, const VkMemoryAllocateInfo *info,
                                                        const VkAllocationCallbacks *cb, VkDeviceMemory *mem) {
    if (out_of_memory(info->allocationSize)) return VK_ERROR_OUT_OF_DEVICE_MEMORY;
    return next_allocate(device, info, cb, mem);
}

static VKAPI_ATTR VkResult VKAPI_CALL fa_CreateInstance(const VkInstanceCreateInfo *ci,
                                                        const VkAllocationCallbacks *cb, VkInstance *out) {
    VkLayerInstanceCreateInfo *link = (VkLayerInstanceCreateInfo *)ci->pNext;
    while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO &&
                     link->function == VK_LAYER_LINK_INFO))
        link = (VkLayerInstanceCreateInfo *)link->pNext;
    if (!link) return VK_ERROR_INITIALIZATION_FAILED;
    PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    link->u.pLayerInfo = link->u.pLayerInfo->pNext;
    PFN_vkCreateInstance create = (PFN_vkCreateInstance)gipa(VK_NULL_HANDLE, "vkCreateInstance");
    VkResult r = create(ci, cb, out);
    if (r == VK_SUCCESS) next_gipa = gipa;
    return r;
}

static VKAPI_ATTR VkResult VKAPI_CALL fa_CreateDevice(VkPhysicalDevice phys, const VkDeviceCreateInfo *ci,
                                                      const VkAllocationCallbacks *cb, VkDevice *out) {
    VkLayerDeviceCreateInfo *link = (VkLayerDeviceCreateInfo *)ci->pNext;
    while (link && !(link->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO &&
                     link->function == VK_LAYER_LINK_INFO))
        link = (VkLayerDeviceCreateInfo *)link->pNext;
    if (!link) return VK_ERROR_INITIALIZATION_FAILED;
    PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    PFN_vkGetDeviceProcAddr gdpa = link->u.pLayerInfo->pfnNextGetDeviceProcAddr;
    link->u.pLayerInfo = link->u.pLayerInfo->pNext;
    PFN_vkCreateDevice create = (PFN_vkCreateDevice)gipa(VK_NULL_HANDLE, "vkCreateDevice");
    VkResult r = create(phys, ci, cb, out);
    if (r == VK_SUCCESS) {
        next_gdpa = gdpa;
        next_allocate = (PFN_vkAllocateMemory)gdpa(*out, "vkAllocateMemory");
    }
    return r;
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fa_GetDeviceProcAddr(VkDevice device, const char *name);

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fa_GetInstanceProcAddr(VkInstance instance, const char *name) {
    if (!strcmp(name, "vkGetInstanceProcAddr")) return (PFN_vkVoidFunction)fa_GetInstanceProcAddr;
    if (!strcmp(name, "vkGetDeviceProcAddr")) return (PFN_vkVoidFunction)fa_GetDeviceProcAddr;
    if (!strcmp(name, "vkCreateInstance")) return (PFN_vkVoidFunction)fa_CreateInstance;
    if (!strcmp(name, "vkCreateDevice")) return (PFN_vkVoidFunction)fa_CreateDevice;
    if (!strcmp(name, "vkAllocateMemory")) return (PFN_vkVoidFunction)fa_AllocateMemory;
    return next_gipa ? next_gipa(instance, name) : NULL;
}

EXPORT VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL fa_GetDeviceProcAddr(VkDevice device, const char *name) {
    if (!strcmp(name, "vkGetDeviceProcAddr")) return (PFN_vkVoidFunction)fa_GetDeviceProcAddr;
    if (!strcmp(name, "vkAllocateMemory")) return (PFN_vkVoidFunction)fa_AllocateMemory;
    return next_gdpa ? next_gdpa(device, name) : NULL;
}
