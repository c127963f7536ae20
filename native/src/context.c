/* The residency context: Vulkan entry points, memory types, the transfer
 * command ring, cross-queue ordering, accounting and the reclaimer. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "internal.h"

#define MiB (1024.0 * 1024.0)

/* ---- errors ------------------------------------------------------------ */

/* Thread-local so that the Python side (cffi releases the GIL during calls)
 * reads the message of its own failed call. */
static _Thread_local char last_error[512];

const char *vramd_last_error(void) { return last_error; }

int vramd_fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

const char *vramd_vkresult(VkResult r) {
    switch (r) {
    case VK_ERROR_OUT_OF_HOST_MEMORY: return "VK_ERROR_OUT_OF_HOST_MEMORY";
    case VK_ERROR_OUT_OF_DEVICE_MEMORY: return "VK_ERROR_OUT_OF_DEVICE_MEMORY";
    case VK_ERROR_INITIALIZATION_FAILED: return "VK_ERROR_INITIALIZATION_FAILED";
    case VK_ERROR_DEVICE_LOST: return "VK_ERROR_DEVICE_LOST";
    case VK_ERROR_MEMORY_MAP_FAILED: return "VK_ERROR_MEMORY_MAP_FAILED";
    case VK_ERROR_INVALID_EXTERNAL_HANDLE: return "VK_ERROR_INVALID_EXTERNAL_HANDLE";
    case VK_ERROR_TOO_MANY_OBJECTS: return "VK_ERROR_TOO_MANY_OBJECTS";
    case VK_TIMEOUT: return "VK_TIMEOUT";
    default: return "VkResult";
    }
}

int vramd_vkfail(VkResult r, const char *what) {
    int status = (r == VK_ERROR_OUT_OF_DEVICE_MEMORY) ? VRAMD_ERR_OOM : VRAMD_ERR_DEVICE;
    return vramd_fail(status, "%s failed: %s (%d)", what, vramd_vkresult(r), (int)r);
}

uint64_t vramd_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- memory types ------------------------------------------------------ */

/* First type allowed by `bits` with all of `want` and none of `avoid`; then
 * the same without `avoid` (lavapipe has a single type with every flag). */
int vramd_find_type(vramd_ctx *ctx, uint32_t bits, VkMemoryPropertyFlags want,
                    VkMemoryPropertyFlags avoid) {
    const VkPhysicalDeviceMemoryProperties *mp = &ctx->memprops;
    for (int pass = 0; pass < 2; pass++)
        for (uint32_t i = 0; i < mp->memoryTypeCount; i++) {
            VkMemoryPropertyFlags f = mp->memoryTypes[i].propertyFlags;
            if (!(bits & (1u << i)) || (f & want) != want) continue;
            if (pass == 0 && (f & avoid)) continue;
            return (int)i;
        }
    return -1;
}

static void account(vramd_ctx *ctx, const vramd_alloc *a, int device, int sign) {
    pthread_mutex_lock(&ctx->lock);
    if (sign > 0) {
        ctx->heap_usage[a->heap] += a->size;
        if (device) ctx->device_bytes += a->size;
    } else {
        ctx->heap_usage[a->heap] -= a->size;
        if (device) ctx->device_bytes -= a->size;
    }
    pthread_mutex_unlock(&ctx->lock);
}

static VkBufferUsageFlags DEVICE_USAGE = VK_BUFFER_USAGE_STORAGE_BUFFER_BIT |
                                         VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
                                         VK_BUFFER_USAGE_TRANSFER_DST_BIT;

static VkResult make_buffer(vramd_ctx *ctx, uint64_t size, VkBufferUsageFlags usage,
                            int concurrent, const void *next, VkBuffer *out) {
    uint32_t fams[2] = {ctx->compute_family, ctx->transfer_family};
    VkBufferCreateInfo bi = {
        .sType = VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
        .pNext = next,
        .size = size,
        .usage = usage,
        .sharingMode = VK_SHARING_MODE_EXCLUSIVE,
    };
    /* Device blocks are written by the transfer queue and read by compute:
     * concurrent sharing spares a queue-family ownership transfer per block. */
    if (concurrent && ctx->compute_family != ctx->transfer_family) {
        bi.sharingMode = VK_SHARING_MODE_CONCURRENT;
        bi.queueFamilyIndexCount = 2;
        bi.pQueueFamilyIndices = fams;
    }
    return ctx->vk.vkCreateBuffer(ctx->device, &bi, NULL, out);
}

/* Whether `size` more bytes fit on the device heap: the driver's budget
 * (VK_EXT_memory_budget counts other processes too), else our own
 * accounting against the heap size; and the context's own cap.  If they
 * fit they are reserved, so that allocator threads running side by side
 * cannot all pass the check for the last free bytes. */
static int reserve(vramd_ctx *ctx, uint64_t size, char *why, size_t whylen) {
    uint32_t h = ctx->device_heap;
    uint64_t budget = ctx->memprops.memoryHeaps[h].size, driver_usage = 0;
    if (ctx->memory_budget) {
        VkPhysicalDeviceMemoryBudgetPropertiesEXT b = {
            .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
        VkPhysicalDeviceMemoryProperties2 p2 = {
            .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2, .pNext = &b};
        ctx->vk.vkGetPhysicalDeviceMemoryProperties2(ctx->phys, &p2);
        budget = b.heapBudget[h];
        driver_usage = b.heapUsage[h];
    }
    pthread_mutex_lock(&ctx->lock);
    uint64_t dev = ctx->device_bytes + ctx->reserved;
    /* The driver's usage lags our in-flight reservations; ours does not. */
    uint64_t usage = ctx->memory_budget ? driver_usage + ctx->reserved : ctx->heap_usage[h] + ctx->reserved;
    int ok = 1;
    if (ctx->device_limit && dev + size > ctx->device_limit) {
        snprintf(why, whylen, "the device limit of %.1f MiB is reached (%.1f MiB held, %.1f MiB more needed)",
                 ctx->device_limit / MiB, dev / MiB, size / MiB);
        ok = 0;
    } else if (usage + size > budget) {
        snprintf(why, whylen, "heap %u has %.1f MiB of %.1f MiB in use, %.1f MiB more needed", h, usage / MiB,
                 budget / MiB, size / MiB);
        ok = 0;
    }
    if (ok) {
        ctx->reserved += size;
        /* The peak is what a budget must hold: held plus reserved, at the moment of each reservation. */
        if (dev + size > ctx->stats.device_peak) ctx->stats.device_peak = dev + size;
    }
    pthread_mutex_unlock(&ctx->lock);
    return ok;
}

static void unreserve(vramd_ctx *ctx, uint64_t size, const vramd_alloc *held) {
    pthread_mutex_lock(&ctx->lock);
    ctx->reserved -= size;
    if (held) {
        ctx->heap_usage[held->heap] += held->size;
        ctx->device_bytes += held->size;
    }
    pthread_mutex_unlock(&ctx->lock);
}

int vramd_alloc_device(vramd_ctx *ctx, uint64_t size, vramd_alloc *out) {
    memset(out, 0, sizeof *out);
    VkResult r = make_buffer(ctx, size, DEVICE_USAGE, 1, NULL, &out->buffer);
    if (r) return vramd_vkfail(r, "vkCreateBuffer (device block)");
    VkMemoryRequirements req;
    ctx->vk.vkGetBufferMemoryRequirements(ctx->device, out->buffer, &req);
    out->size = req.size;
    out->heap = ctx->device_heap;
    char why[256];
    for (int attempt = 0;; attempt++) {
        int ok = reserve(ctx, req.size, why, sizeof why);
        if (ok) {
            /* Dedicated: on the H200 (driver 580) a plain allocation of
             * 16 GiB in 256 MiB blocks costs ~370 ms and slows a DMA running
             * beside it to ~80 % of the link; dedicated ones cost ~35 ms and
             * leave the link alone (docs/benchmarks.md). */
            VkMemoryDedicatedAllocateInfo ded = {.sType = VK_STRUCTURE_TYPE_MEMORY_DEDICATED_ALLOCATE_INFO,
                                                 .buffer = out->buffer};
            VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                                       .pNext = (ctx->flags & VRAMD_CTX_NOT_DEDICATED) ? NULL : &ded,
                                       .allocationSize = req.size,
                                       .memoryTypeIndex = (uint32_t)ctx->device_type};
            r = ctx->vk.vkAllocateMemory(ctx->device, &ai, NULL, &out->memory);
            out->is_device = 1;
            unreserve(ctx, req.size, r == VK_SUCCESS ? out : NULL);
            if (r == VK_SUCCESS) break;
            out->memory = VK_NULL_HANDLE;
            snprintf(why, sizeof why, "vkAllocateMemory of %.1f MiB: %s", req.size / MiB,
                     vramd_vkresult(r));
            if (r != VK_ERROR_OUT_OF_DEVICE_MEMORY && r != VK_ERROR_OUT_OF_HOST_MEMORY) {
                ctx->vk.vkDestroyBuffer(ctx->device, out->buffer, NULL);
                memset(out, 0, sizeof *out);
                return vramd_fail(VRAMD_ERR_DEVICE, "%s", why);
            }
        }
        /* Memory we released may still be on its way back to the driver:
         * wait for the reclaimer once before calling it out of memory. */
        pthread_mutex_lock(&ctx->lock);
        uint64_t pending = ctx->pending;
        pthread_mutex_unlock(&ctx->lock);
        if (attempt == 0 && pending) {
            vramd_ctx_drain(ctx);
            continue;
        }
        ctx->vk.vkDestroyBuffer(ctx->device, out->buffer, NULL);
        memset(out, 0, sizeof *out);
        return vramd_fail(VRAMD_ERR_OOM, "out of device memory: %s", why);
    }
    r = ctx->vk.vkBindBufferMemory(ctx->device, out->buffer, out->memory, 0);
    if (r) {
        vramd_free_now(ctx, out);
        return vramd_vkfail(r, "vkBindBufferMemory");
    }
    return VRAMD_OK;
}

int vramd_alloc_host(vramd_ctx *ctx, uint64_t size, vramd_alloc *out, void **ptr) {
    memset(out, 0, sizeof *out);
    if (ctx->shadow_type < 0) return vramd_fail(VRAMD_ERR_DEVICE, "the device has no host-visible memory type");
    VkResult r = make_buffer(ctx, size, VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                             0, NULL, &out->buffer);
    if (r) return vramd_vkfail(r, "vkCreateBuffer (host)");
    VkMemoryRequirements req;
    ctx->vk.vkGetBufferMemoryRequirements(ctx->device, out->buffer, &req);
    VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                               .allocationSize = req.size,
                               .memoryTypeIndex = (uint32_t)ctx->shadow_type};
    r = ctx->vk.vkAllocateMemory(ctx->device, &ai, NULL, &out->memory);
    if (r == VK_SUCCESS) r = ctx->vk.vkBindBufferMemory(ctx->device, out->buffer, out->memory, 0);
    if (r == VK_SUCCESS) r = ctx->vk.vkMapMemory(ctx->device, out->memory, 0, VK_WHOLE_SIZE, 0, ptr);
    if (r) {
        if (out->memory) ctx->vk.vkFreeMemory(ctx->device, out->memory, NULL);
        ctx->vk.vkDestroyBuffer(ctx->device, out->buffer, NULL);
        memset(out, 0, sizeof *out);
        return vramd_fail(r == VK_ERROR_OUT_OF_DEVICE_MEMORY ? VRAMD_ERR_OOM : VRAMD_ERR_DEVICE,
                          "host-visible allocation of %.1f MiB failed: %s", size / MiB, vramd_vkresult(r));
    }
    out->size = req.size;
    out->heap = ctx->memprops.memoryTypes[ctx->shadow_type].heapIndex;
    account(ctx, out, 0, +1);
    return VRAMD_OK;
}

/* Wraps existing host memory (page-aligned, ours) as a transfer buffer: the
 * DMA engine then reads the shadow itself, with no staging copy. */
int vramd_import_host(vramd_ctx *ctx, void *ptr, uint64_t size, vramd_alloc *out) {
    memset(out, 0, sizeof *out);
    VkExternalMemoryBufferCreateInfo ext = {
        .sType = VK_STRUCTURE_TYPE_EXTERNAL_MEMORY_BUFFER_CREATE_INFO,
        .handleTypes = VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT};
    VkResult r = make_buffer(ctx, size, VK_BUFFER_USAGE_TRANSFER_SRC_BIT | VK_BUFFER_USAGE_TRANSFER_DST_BIT,
                             0, &ext, &out->buffer);
    if (r) return vramd_vkfail(r, "vkCreateBuffer (imported)");
    VkMemoryRequirements req;
    ctx->vk.vkGetBufferMemoryRequirements(ctx->device, out->buffer, &req);
    VkMemoryHostPointerPropertiesEXT hp = {.sType = VK_STRUCTURE_TYPE_MEMORY_HOST_POINTER_PROPERTIES_EXT};
    r = ctx->vk.vkGetMemoryHostPointerPropertiesEXT(
        ctx->device, VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT, ptr, &hp);
    int type = -1;
    if (r == VK_SUCCESS)
        /* Coherent only: the core never maps imported memory, so it could not
         * flush or invalidate a non-coherent one. */
        type = vramd_find_type(ctx, hp.memoryTypeBits & req.memoryTypeBits,
                               VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, 0);
    if (type < 0) {
        ctx->vk.vkDestroyBuffer(ctx->device, out->buffer, NULL);
        out->buffer = VK_NULL_HANDLE;
        return vramd_fail(VRAMD_ERR_DEVICE, "host memory import: no coherent memory type (%s)",
                          vramd_vkresult(r));
    }
    VkImportMemoryHostPointerInfoEXT imp = {
        .sType = VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT,
        .handleType = VK_EXTERNAL_MEMORY_HANDLE_TYPE_HOST_ALLOCATION_BIT_EXT,
        .pHostPointer = ptr};
    VkMemoryAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                               .pNext = &imp,
                               .allocationSize = size,
                               .memoryTypeIndex = (uint32_t)type};
    r = ctx->vk.vkAllocateMemory(ctx->device, &ai, NULL, &out->memory);
    if (r == VK_SUCCESS) r = ctx->vk.vkBindBufferMemory(ctx->device, out->buffer, out->memory, 0);
    if (r) {
        if (out->memory) ctx->vk.vkFreeMemory(ctx->device, out->memory, NULL);
        ctx->vk.vkDestroyBuffer(ctx->device, out->buffer, NULL);
        memset(out, 0, sizeof *out);
        return vramd_vkfail(r, "host memory import (vkAllocateMemory)");
    }
    out->size = size;
    out->heap = ctx->memprops.memoryTypes[type].heapIndex;
    account(ctx, out, 0, +1);
    return VRAMD_OK;
}

void vramd_free_now(vramd_ctx *ctx, vramd_alloc *a) {
    if (a->buffer) ctx->vk.vkDestroyBuffer(ctx->device, a->buffer, NULL);
    if (a->memory) {
        ctx->vk.vkFreeMemory(ctx->device, a->memory, NULL);
        account(ctx, a, (int)a->is_device, -1);
    }
    memset(a, 0, sizeof *a);
}

/* ---- the reclaimer ------------------------------------------------------ */

/* Freeing is slow: on the H200 16 GiB of dedicated blocks take ~110 ms to
 * free (plain allocations ~300 ms), far over the 20 ms a release may take.
 * Release hands blocks to this thread and returns; vramd_ctx_drain waits. */
static void *reclaimer_main(void *arg) {
    vramd_ctx *ctx = arg;
    pthread_mutex_lock(&ctx->lock);
    for (;;) {
        while (!ctx->graves && !ctx->stopping) pthread_cond_wait(&ctx->cond, &ctx->lock);
        if (!ctx->graves) break;
        vramd_grave *g = ctx->graves;
        ctx->graves = g->next;
        pthread_mutex_unlock(&ctx->lock);
        uint64_t t0 = vramd_now_ns();
        ctx->vk.vkDestroyBuffer(ctx->device, g->alloc.buffer, NULL);
        ctx->vk.vkFreeMemory(ctx->device, g->alloc.memory, NULL);
        uint64_t dt = vramd_now_ns() - t0;
        pthread_mutex_lock(&ctx->lock);
        ctx->heap_usage[g->alloc.heap] -= g->alloc.size;
        if (g->alloc.is_device) {
            ctx->device_bytes -= g->alloc.size;
            ctx->pending_device -= g->alloc.size;
        }
        ctx->stats.reclaim_free_ns += dt;
        ctx->pending--;
        free(g);
        pthread_cond_broadcast(&ctx->cond);
    }
    pthread_mutex_unlock(&ctx->lock);
    return NULL;
}

/* Queues a device allocation for freeing.  The caller has made sure no
 * submitted work uses it any more. */
void vramd_bury(vramd_ctx *ctx, vramd_alloc *a) {
    vramd_grave *g = malloc(sizeof *g);
    if (!g || ctx->reclaimer_started == 0) {
        /* No memory for the list node: free inline, slower but correct. */
        free(g);
        ctx->vk.vkDestroyBuffer(ctx->device, a->buffer, NULL);
        ctx->vk.vkFreeMemory(ctx->device, a->memory, NULL);
        pthread_mutex_lock(&ctx->lock);
        ctx->heap_usage[a->heap] -= a->size;
        if (a->is_device) ctx->device_bytes -= a->size;
        pthread_mutex_unlock(&ctx->lock);
    } else {
        g->alloc = *a;
        pthread_mutex_lock(&ctx->lock);
        g->next = ctx->graves;
        ctx->graves = g;
        ctx->pending++;
        if (a->is_device) ctx->pending_device += a->size;
        pthread_cond_broadcast(&ctx->cond);
        pthread_mutex_unlock(&ctx->lock);
    }
    memset(a, 0, sizeof *a);
}

int vramd_ctx_drain(vramd_ctx *ctx) {
    pthread_mutex_lock(&ctx->lock);
    while (ctx->pending) pthread_cond_wait(&ctx->cond, &ctx->lock);
    pthread_mutex_unlock(&ctx->lock);
    return VRAMD_OK;
}

/* ---- submission and ordering ------------------------------------------- */

static int wait_fence(vramd_ctx *ctx, VkFence f) {
    VkResult r = ctx->vk.vkWaitForFences(ctx->device, 1, &f, VK_TRUE, UINT64_MAX);
    return r ? vramd_vkfail(r, "vkWaitForFences") : VRAMD_OK;
}

int vramd_slot_acquire(vramd_ctx *ctx, vramd_slot **out) {
    vramd_slot *s = &ctx->ring[ctx->ring_next++ % VRAMD_RING];
    if (s->busy) {
        uint64_t t0 = vramd_now_ns();
        int rc = wait_fence(ctx, s->fence);
        ctx->stats.restore_stall_ns += vramd_now_ns() - t0;
        if (rc) return rc;
        s->busy = 0;
    }
    VkResult r = ctx->vk.vkResetFences(ctx->device, 1, &s->fence);
    if (!r) r = ctx->vk.vkResetCommandBuffer(s->cmd, 0);
    VkCommandBufferBeginInfo bi = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                                   .flags = VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT};
    if (!r) r = ctx->vk.vkBeginCommandBuffer(s->cmd, &bi);
    if (r) return vramd_vkfail(r, "command buffer reset/begin");
    *out = s;
    return VRAMD_OK;
}

int vramd_wait_compute(vramd_ctx *ctx) {
    if (ctx->timeline) {
        if (!ctx->compute_value) return VRAMD_OK;
        VkSemaphoreWaitInfo wi = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_WAIT_INFO,
                                  .semaphoreCount = 1,
                                  .pSemaphores = &ctx->compute_sem,
                                  .pValues = &ctx->compute_value};
        VkResult r = ctx->vk.vkWaitSemaphores(ctx->device, &wi, UINT64_MAX);
        return r ? vramd_vkfail(r, "vkWaitSemaphores (compute)") : VRAMD_OK;
    }
    if (ctx->compute_fence_busy) {
        int rc = wait_fence(ctx, ctx->compute_fence);
        if (rc) return rc;
        ctx->compute_fence_busy = 0;
    }
    return VRAMD_OK;
}

int vramd_wait_transfers(vramd_ctx *ctx) {
    for (int i = 0; i < VRAMD_RING; i++)
        if (ctx->ring[i].busy) {
            int rc = wait_fence(ctx, ctx->ring[i].fence);
            if (rc) return rc;
            ctx->ring[i].busy = 0;
        }
    return VRAMD_OK;
}

/* Ends and submits a transfer slot.  It runs after every compute submitted
 * so far (an eviction must read what the last step wrote) and signals the
 * next transfer value, which the next compute waits for. */
int vramd_submit_transfer(vramd_ctx *ctx, vramd_slot *s) {
    VkResult r = ctx->vk.vkEndCommandBuffer(s->cmd);
    if (r) return vramd_vkfail(r, "vkEndCommandBuffer");
    VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO,
                       .commandBufferCount = 1,
                       .pCommandBuffers = &s->cmd};
    VkPipelineStageFlags stage = VK_PIPELINE_STAGE_ALL_COMMANDS_BIT;
    uint64_t signal = ctx->transfer_value + 1, wait = ctx->compute_value;
    VkTimelineSemaphoreSubmitInfo ti = {.sType = VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                                        .waitSemaphoreValueCount = 1,
                                        .pWaitSemaphoreValues = &wait,
                                        .signalSemaphoreValueCount = 1,
                                        .pSignalSemaphoreValues = &signal};
    if (ctx->timeline) {
        si.pNext = &ti;
        si.waitSemaphoreCount = 1;
        si.pWaitSemaphores = &ctx->compute_sem;
        si.pWaitDstStageMask = &stage;
        si.signalSemaphoreCount = 1;
        si.pSignalSemaphores = &ctx->transfer_sem;
    } else {
        int rc = vramd_wait_compute(ctx);
        if (rc) return rc;
    }
    r = ctx->vk.vkQueueSubmit(ctx->transfer_queue, 1, &si, s->fence);
    if (r) return vramd_vkfail(r, "vkQueueSubmit (transfer)");
    s->busy = 1;
    ctx->transfer_value = signal;
    return VRAMD_OK;
}

int vramd_submit_compute(vramd_ctx *ctx, uint64_t command_buffer) {
    VkCommandBuffer cmd = (VkCommandBuffer)(uintptr_t)command_buffer;
    VkSubmitInfo si = {.sType = VK_STRUCTURE_TYPE_SUBMIT_INFO,
                       .commandBufferCount = 1,
                       .pCommandBuffers = &cmd};
    VkPipelineStageFlags stage = VK_PIPELINE_STAGE_ALL_COMMANDS_BIT;
    uint64_t signal = ctx->compute_value + 1, wait = ctx->transfer_value;
    VkTimelineSemaphoreSubmitInfo ti = {.sType = VK_STRUCTURE_TYPE_TIMELINE_SEMAPHORE_SUBMIT_INFO,
                                        .waitSemaphoreValueCount = 1,
                                        .pWaitSemaphoreValues = &wait,
                                        .signalSemaphoreValueCount = 1,
                                        .pSignalSemaphoreValues = &signal};
    VkFence fence = VK_NULL_HANDLE;
    if (ctx->timeline) {
        /* The GPU orders compute after the restore's last copy; the host
         * does not wait for the restore to finish. */
        si.pNext = &ti;
        si.waitSemaphoreCount = 1;
        si.pWaitSemaphores = &ctx->transfer_sem;
        si.pWaitDstStageMask = &stage;
        si.signalSemaphoreCount = 1;
        si.pSignalSemaphores = &ctx->compute_sem;
    } else {
        int rc = vramd_wait_transfers(ctx);
        if (!rc) rc = vramd_wait_compute(ctx);
        if (rc) return rc;
        VkResult r = ctx->vk.vkResetFences(ctx->device, 1, &ctx->compute_fence);
        if (r) return vramd_vkfail(r, "vkResetFences");
        fence = ctx->compute_fence;
    }
    VkResult r = ctx->vk.vkQueueSubmit(ctx->compute_queue, 1, &si, fence);
    if (r) return vramd_vkfail(r, "vkQueueSubmit (compute)");
    ctx->compute_value = signal;
    if (!ctx->timeline) ctx->compute_fence_busy = 1;
    return VRAMD_OK;
}

int vramd_ctx_sync(vramd_ctx *ctx) {
    int rc = vramd_wait_transfers(ctx);
    if (!rc) rc = vramd_wait_compute(ctx);
    return rc;
}

/* One synchronous copy through a ring slot; for byte access and the probe. */
int vramd_copy_sync(vramd_ctx *ctx, VkBuffer src, uint64_t src_off, VkBuffer dst, uint64_t dst_off,
                    uint64_t n, int to_host) {
    vramd_slot *s;
    int rc = vramd_slot_acquire(ctx, &s);
    if (rc) return rc;
    VkBufferCopy c = {.srcOffset = src_off, .dstOffset = dst_off, .size = n};
    ctx->vk.vkCmdCopyBuffer(s->cmd, src, dst, 1, &c);
    if (to_host) {
        /* Device writes must be made visible to host reads explicitly; the
         * fence wait alone does not (Vulkan memory model). */
        VkMemoryBarrier mb = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                              .srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT,
                              .dstAccessMask = VK_ACCESS_HOST_READ_BIT};
        ctx->vk.vkCmdPipelineBarrier(s->cmd, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_HOST_BIT, 0, 1,
                                     &mb, 0, NULL, 0, NULL);
    }
    rc = vramd_submit_transfer(ctx, s);
    if (rc) return rc;
    rc = wait_fence(ctx, s->fence);
    if (!rc) s->busy = 0;
    return rc;
}

int vramd_staging(vramd_ctx *ctx, uint64_t want) {
    if (ctx->staging.buffer) return VRAMD_OK;
    uint64_t size = 16ull << 20;
    (void)want;
    int rc = vramd_alloc_host(ctx, size, &ctx->staging, &ctx->staging_ptr);
    if (rc) return rc;
    ctx->staging_size = size;
    return VRAMD_OK;
}

/* ---- context ----------------------------------------------------------- */

static int load_functions(vramd_ctx *ctx, PFN_vkGetInstanceProcAddr gipa) {
#define X(name)                                                                          \
    ctx->vk.name = (PFN_##name)gipa(ctx->instance, #name);                               \
    if (!ctx->vk.name) return vramd_fail(VRAMD_ERR_DEVICE, "Vulkan entry point %s is missing", #name);
    VRAMD_INSTANCE_FUNCS(X)
#undef X
#define X(name)                                                                          \
    ctx->vk.name = (PFN_##name)ctx->vk.vkGetDeviceProcAddr(ctx->device, #name);          \
    if (!ctx->vk.name) return vramd_fail(VRAMD_ERR_DEVICE, "Vulkan entry point %s is missing", #name);
    VRAMD_DEVICE_FUNCS(X)
#undef X
    /* Core 1.2 names first, then the KHR aliases of older drivers. */
    ctx->vk.vkWaitSemaphores = (PFN_vkWaitSemaphores)ctx->vk.vkGetDeviceProcAddr(ctx->device, "vkWaitSemaphores");
    if (!ctx->vk.vkWaitSemaphores)
        ctx->vk.vkWaitSemaphores = (PFN_vkWaitSemaphores)ctx->vk.vkGetDeviceProcAddr(ctx->device, "vkWaitSemaphoresKHR");
    ctx->vk.vkGetSemaphoreCounterValue =
        (PFN_vkGetSemaphoreCounterValue)ctx->vk.vkGetDeviceProcAddr(ctx->device, "vkGetSemaphoreCounterValue");
    if (!ctx->vk.vkGetSemaphoreCounterValue)
        ctx->vk.vkGetSemaphoreCounterValue = (PFN_vkGetSemaphoreCounterValue)ctx->vk.vkGetDeviceProcAddr(
            ctx->device, "vkGetSemaphoreCounterValueKHR");
    ctx->vk.vkGetMemoryHostPointerPropertiesEXT = (PFN_vkGetMemoryHostPointerPropertiesEXT)
        ctx->vk.vkGetDeviceProcAddr(ctx->device, "vkGetMemoryHostPointerPropertiesEXT");
    return VRAMD_OK;
}

static int make_timeline(vramd_ctx *ctx, VkSemaphore *out) {
    VkSemaphoreTypeCreateInfo ti = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_TYPE_CREATE_INFO,
                                    .semaphoreType = VK_SEMAPHORE_TYPE_TIMELINE,
                                    .initialValue = 0};
    VkSemaphoreCreateInfo si = {.sType = VK_STRUCTURE_TYPE_SEMAPHORE_CREATE_INFO, .pNext = &ti};
    VkResult r = ctx->vk.vkCreateSemaphore(ctx->device, &si, NULL, out);
    return r ? vramd_vkfail(r, "vkCreateSemaphore (timeline)") : VRAMD_OK;
}

static int setup(vramd_ctx *ctx, const vramd_ctx_desc *d) {
    PFN_vkGetInstanceProcAddr gipa = (PFN_vkGetInstanceProcAddr)(uintptr_t)d->get_instance_proc_addr;
    if (!gipa) {
        /* The Python binding already opened the loader; dlopen returns the
         * same copy, so the handles we were given are valid here. */
        void *lib = dlopen("libvulkan.so.1", RTLD_NOW | RTLD_GLOBAL);
        if (!lib) return vramd_fail(VRAMD_ERR_DEVICE, "cannot load libvulkan.so.1: install the Vulkan loader (libvulkan1)");
        gipa = (PFN_vkGetInstanceProcAddr)dlsym(lib, "vkGetInstanceProcAddr");
        if (!gipa) return vramd_fail(VRAMD_ERR_DEVICE, "libvulkan.so.1 has no vkGetInstanceProcAddr");
    }
    int rc = load_functions(ctx, gipa);
    if (rc) return rc;
    if (ctx->timeline && !(ctx->vk.vkWaitSemaphores && ctx->vk.vkGetSemaphoreCounterValue)) ctx->timeline = 0;
    if (ctx->host_import && !ctx->vk.vkGetMemoryHostPointerPropertiesEXT) ctx->host_import = 0;

    ctx->vk.vkGetPhysicalDeviceMemoryProperties(ctx->phys, &ctx->memprops);
    VkPhysicalDeviceMaintenance3Properties m3 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES};
    VkPhysicalDeviceExternalMemoryHostPropertiesEXT hp = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_EXTERNAL_MEMORY_HOST_PROPERTIES_EXT};
    if (ctx->host_import) m3.pNext = &hp;
    VkPhysicalDeviceProperties2 p2 = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &m3};
    ctx->vk.vkGetPhysicalDeviceProperties2(ctx->phys, &p2);
    ctx->max_allocation = m3.maxMemoryAllocationSize ? m3.maxMemoryAllocationSize : (1ull << 30);
    ctx->max_storage_range = p2.properties.limits.maxStorageBufferRange;
    ctx->storage_alignment = p2.properties.limits.minStorageBufferOffsetAlignment;
    ctx->import_alignment = ctx->host_import ? hp.minImportedHostPointerAlignment : 4096;
    if (ctx->import_alignment < 4096) ctx->import_alignment = 4096;

    ctx->block_bytes = d->block_bytes ? d->block_bytes : (256ull << 20);
    if (ctx->block_bytes > ctx->max_allocation) ctx->block_bytes = ctx->max_allocation;
    ctx->device_limit = d->device_limit;

    /* Memory types: probe a device block to learn which types suit it. */
    VkBuffer probe;
    VkResult r = make_buffer(ctx, 65536, DEVICE_USAGE, 1, NULL, &probe);
    if (r) return vramd_vkfail(r, "vkCreateBuffer (probe)");
    VkMemoryRequirements req;
    ctx->vk.vkGetBufferMemoryRequirements(ctx->device, probe, &req);
    ctx->vk.vkDestroyBuffer(ctx->device, probe, NULL);
    /* Device-local without host visibility: the NVIDIA BAR type is
     * device-local too, but small and meant for host writes. */
    ctx->device_type = vramd_find_type(ctx, req.memoryTypeBits, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT,
                                       VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT);
    if (ctx->device_type < 0) ctx->device_type = vramd_find_type(ctx, req.memoryTypeBits, 0, 0);
    if (ctx->device_type < 0) return vramd_fail(VRAMD_ERR_DEVICE, "no memory type for device buffers");
    ctx->device_heap = ctx->memprops.memoryTypes[ctx->device_type].heapIndex;
    /* Host shadows without import: cached (CPU reads of evicted state are
     * fast) and coherent (no flush/invalidate on the hot path). */
    VkMemoryPropertyFlags hv = VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | VK_MEMORY_PROPERTY_HOST_COHERENT_BIT;
    ctx->shadow_type = vramd_find_type(ctx, ~0u, hv | VK_MEMORY_PROPERTY_HOST_CACHED_BIT,
                                       VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);
    if (ctx->shadow_type < 0) ctx->shadow_type = vramd_find_type(ctx, ~0u, hv, VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT);

    if (ctx->timeline) {
        if ((rc = make_timeline(ctx, &ctx->transfer_sem))) return rc;
        if ((rc = make_timeline(ctx, &ctx->compute_sem))) return rc;
    } else {
        VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
        r = ctx->vk.vkCreateFence(ctx->device, &fi, NULL, &ctx->compute_fence);
        if (r) return vramd_vkfail(r, "vkCreateFence");
    }
    VkCommandPoolCreateInfo pi = {.sType = VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                                  .flags = VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
                                  .queueFamilyIndex = ctx->transfer_family};
    r = ctx->vk.vkCreateCommandPool(ctx->device, &pi, NULL, &ctx->pool);
    if (r) return vramd_vkfail(r, "vkCreateCommandPool");
    VkCommandBuffer cmds[VRAMD_RING];
    VkCommandBufferAllocateInfo ai = {.sType = VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                                      .commandPool = ctx->pool,
                                      .level = VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                                      .commandBufferCount = VRAMD_RING};
    r = ctx->vk.vkAllocateCommandBuffers(ctx->device, &ai, cmds);
    if (r) return vramd_vkfail(r, "vkAllocateCommandBuffers");
    for (int i = 0; i < VRAMD_RING; i++) {
        ctx->ring[i].cmd = cmds[i];
        VkFenceCreateInfo fi = {.sType = VK_STRUCTURE_TYPE_FENCE_CREATE_INFO};
        r = ctx->vk.vkCreateFence(ctx->device, &fi, NULL, &ctx->ring[i].fence);
        if (r) return vramd_vkfail(r, "vkCreateFence");
    }
    /* One reclaimer: four freeing side by side were no faster on the H200. */
    for (uint32_t i = 0; i < 1; i++)
        if (pthread_create(&ctx->reclaimers[ctx->reclaimer_started], NULL, reclaimer_main, ctx) == 0) {
            /* Named, so an operator (top -H) and the tests can tell it apart. */
            pthread_setname_np(ctx->reclaimers[ctx->reclaimer_started], "vramd-reclaim");
            ctx->reclaimer_started++;
        }
    return VRAMD_OK;
}

int vramd_ctx_create(const vramd_ctx_desc *d, vramd_ctx **out) {
    *out = NULL;
    if (!d || !d->instance || !d->physical_device || !d->device || !d->compute_queue)
        return vramd_fail(VRAMD_ERR_USAGE, "vramd_ctx_create: instance, physical device, device and compute queue are required");
    vramd_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
    pthread_mutex_init(&ctx->lock, NULL);
    pthread_cond_init(&ctx->cond, NULL);
    ctx->instance = (VkInstance)(uintptr_t)d->instance;
    ctx->phys = (VkPhysicalDevice)(uintptr_t)d->physical_device;
    ctx->device = (VkDevice)(uintptr_t)d->device;
    ctx->compute_queue = (VkQueue)(uintptr_t)d->compute_queue;
    ctx->transfer_queue = d->transfer_queue ? (VkQueue)(uintptr_t)d->transfer_queue : ctx->compute_queue;
    ctx->compute_family = d->compute_family;
    ctx->transfer_family = d->transfer_queue ? d->transfer_family : d->compute_family;
    ctx->timeline = d->timeline != 0;
    ctx->host_import = d->host_import != 0;
    ctx->memory_budget = d->memory_budget != 0;
    /* One allocator: on the H200 two or more allocating side by side
     * slowed the copy engine to half the link rate (docs/benchmarks.md). */
    ctx->alloc_threads = d->alloc_threads ? d->alloc_threads : 1;
    ctx->flags = d->flags;
    if (ctx->alloc_threads > VRAMD_MAX_THREADS) ctx->alloc_threads = VRAMD_MAX_THREADS;
    int rc = setup(ctx, d);
    if (rc) {
        char keep[512];
        snprintf(keep, sizeof keep, "%s", last_error);
        vramd_ctx_destroy(ctx);
        vramd_fail(rc, "%s", keep);
        return rc;
    }
    *out = ctx;
    return VRAMD_OK;
}

void vramd_ctx_forget_region(vramd_ctx *ctx, vramd_region *r) {
    for (uint32_t i = 0; i < ctx->n_regions; i++)
        if (ctx->regions[i] == r) {
            memmove(&ctx->regions[i], &ctx->regions[i + 1], (ctx->n_regions - i - 1) * sizeof *ctx->regions);
            ctx->n_regions--;
            return;
        }
}

void vramd_ctx_destroy(vramd_ctx *ctx) {
    if (!ctx) return;
    if (ctx->vk.vkQueueWaitIdle) {
        /* Everything we submitted must finish before its memory goes. */
        ctx->vk.vkQueueWaitIdle(ctx->transfer_queue);
        ctx->vk.vkQueueWaitIdle(ctx->compute_queue);
    }
    while (ctx->n_regions) vramd_region_destroy(ctx->regions[ctx->n_regions - 1]);
    free(ctx->regions);
    if (ctx->reclaimer_started) {
        pthread_mutex_lock(&ctx->lock);
        ctx->stopping = 1;
        pthread_cond_broadcast(&ctx->cond);
        pthread_mutex_unlock(&ctx->lock);
        for (int i = 0; i < ctx->reclaimer_started; i++) pthread_join(ctx->reclaimers[i], NULL);
    }
    if (ctx->staging.memory) {
        ctx->vk.vkUnmapMemory(ctx->device, ctx->staging.memory);
        vramd_free_now(ctx, &ctx->staging);
    }
    for (int i = 0; i < VRAMD_RING; i++)
        if (ctx->ring[i].fence) ctx->vk.vkDestroyFence(ctx->device, ctx->ring[i].fence, NULL);
    if (ctx->pool) ctx->vk.vkDestroyCommandPool(ctx->device, ctx->pool, NULL);
    if (ctx->compute_fence) ctx->vk.vkDestroyFence(ctx->device, ctx->compute_fence, NULL);
    if (ctx->transfer_sem) ctx->vk.vkDestroySemaphore(ctx->device, ctx->transfer_sem, NULL);
    if (ctx->compute_sem) ctx->vk.vkDestroySemaphore(ctx->device, ctx->compute_sem, NULL);
    pthread_cond_destroy(&ctx->cond);
    pthread_mutex_destroy(&ctx->lock);
    free(ctx);
}

int vramd_ctx_limits(vramd_ctx *ctx, vramd_limits *out) {
    memset(out, 0, sizeof *out);
    out->max_allocation = ctx->max_allocation;
    out->max_storage_range = ctx->max_storage_range;
    out->storage_alignment = ctx->storage_alignment;
    out->block_bytes = ctx->block_bytes;
    out->device_limit = ctx->device_limit;
    out->device_heap = ctx->device_heap;
    out->shadow_imported = (uint32_t)ctx->host_import;
    return VRAMD_OK;
}

int vramd_ctx_set_device_limit(vramd_ctx *ctx, uint64_t bytes) {
    ctx->device_limit = bytes;
    return VRAMD_OK;
}

int vramd_ctx_heap_usage(vramd_ctx *ctx, uint32_t heap, uint64_t *bytes) {
    if (heap >= ctx->memprops.memoryHeapCount)
        return vramd_fail(VRAMD_ERR_USAGE, "heap %u does not exist (the device has %u)", heap,
                          ctx->memprops.memoryHeapCount);
    pthread_mutex_lock(&ctx->lock);
    *bytes = ctx->heap_usage[heap];
    pthread_mutex_unlock(&ctx->lock);
    return VRAMD_OK;
}

int vramd_ctx_reset_peak(vramd_ctx *ctx) {
    pthread_mutex_lock(&ctx->lock);
    ctx->stats.device_peak = ctx->device_bytes + ctx->reserved;
    pthread_mutex_unlock(&ctx->lock);
    return VRAMD_OK;
}

int vramd_ctx_stats(vramd_ctx *ctx, vramd_stats *out) {
    pthread_mutex_lock(&ctx->lock);
    *out = ctx->stats;
    out->reclaim_pending = ctx->pending;
    out->reclaim_pending_bytes = ctx->pending_device;
    pthread_mutex_unlock(&ctx->lock);
    return VRAMD_OK;
}

/* ---- the raw link rate --------------------------------------------------- */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int vramd_link_probe(vramd_ctx *ctx, uint64_t nbytes, uint32_t reps, double *gbps) {
    if (!reps || reps > 64) return vramd_fail(VRAMD_ERR_USAGE, "link probe: reps must be 1..64");
    if (nbytes > ctx->max_allocation) nbytes = ctx->max_allocation;
    nbytes &= ~(ctx->import_alignment - 1);
    if (!nbytes) return vramd_fail(VRAMD_ERR_USAGE, "link probe: size too small");
    /* Host memory of the same kind the shadows use, so the ratio compares
     * like with like. */
    vramd_alloc host = {0}, dev = {0};
    void *ptr = NULL, *map = NULL;
    int rc;
    if (ctx->host_import) {
        map = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (map == MAP_FAILED) return vramd_fail(VRAMD_ERR_DEVICE, "link probe: mmap failed");
        memset(map, 0x5a, nbytes);
        rc = vramd_import_host(ctx, map, nbytes, &host);
    } else {
        rc = vramd_alloc_host(ctx, nbytes, &host, &ptr);
        if (!rc) memset(ptr, 0x5a, nbytes);
    }
    if (!rc) rc = vramd_alloc_device(ctx, nbytes, &dev);
    double t[2][64];
    for (uint32_t i = 0; !rc && i < reps; i++)
        for (int dir = 0; !rc && dir < 2; dir++) {
            uint64_t t0 = vramd_now_ns();
            rc = dir == 0 ? vramd_copy_sync(ctx, host.buffer, 0, dev.buffer, 0, nbytes, 0)
                          : vramd_copy_sync(ctx, dev.buffer, 0, host.buffer, 0, nbytes, 1);
            t[dir][i] = (double)nbytes / (double)(vramd_now_ns() - t0);
        }
    if (!rc)
        for (int dir = 0; dir < 2; dir++) {
            qsort(t[dir], reps, sizeof(double), cmp_double);
            gbps[dir] = reps % 2 ? t[dir][reps / 2] : 0.5 * (t[dir][reps / 2 - 1] + t[dir][reps / 2]);
            gbps[2 + dir] = t[dir][reps - 1];
        }
    if (host.memory) {
        if (ptr) ctx->vk.vkUnmapMemory(ctx->device, host.memory);
        vramd_free_now(ctx, &host);
    }
    if (dev.memory) vramd_free_now(ctx, &dev);
    if (map) munmap(map, nbytes);
    return rc;
}
