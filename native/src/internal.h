/* Internal declarations of the residency core: the Vulkan entry points it
 * loads, the context and region structures, and helpers shared by
 * context.c and region.c. */
#ifndef VRAMD_INTERNAL_H
#define VRAMD_INTERNAL_H

/* No prototypes: every entry point comes from vkGet*ProcAddr, so the shared
 * object needs no libvulkan at link time and uses whichever loader the
 * process (Python's `vulkan` binding) already has open. */
#define VK_NO_PROTOTYPES
#include <vulkan/vulkan.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "vramd/residency.h"

#define VRAMD_INSTANCE_FUNCS(X)                \
    X(vkGetDeviceProcAddr)                     \
    X(vkGetPhysicalDeviceProperties)           \
    X(vkGetPhysicalDeviceProperties2)          \
    X(vkGetPhysicalDeviceMemoryProperties)     \
    X(vkGetPhysicalDeviceMemoryProperties2)

#define VRAMD_DEVICE_FUNCS(X)                  \
    X(vkAllocateMemory)                        \
    X(vkFreeMemory)                            \
    X(vkMapMemory)                             \
    X(vkUnmapMemory)                           \
    X(vkCreateBuffer)                          \
    X(vkDestroyBuffer)                         \
    X(vkGetBufferMemoryRequirements)           \
    X(vkBindBufferMemory)                      \
    X(vkCreateCommandPool)                     \
    X(vkDestroyCommandPool)                    \
    X(vkAllocateCommandBuffers)                \
    X(vkResetCommandBuffer)                    \
    X(vkBeginCommandBuffer)                    \
    X(vkEndCommandBuffer)                      \
    X(vkCmdCopyBuffer)                         \
    X(vkCmdPipelineBarrier)                    \
    X(vkQueueSubmit)                           \
    X(vkQueueWaitIdle)                         \
    X(vkCreateFence)                           \
    X(vkDestroyFence)                          \
    X(vkResetFences)                           \
    X(vkWaitForFences)                         \
    X(vkGetFenceStatus)                        \
    X(vkCreateSemaphore)                       \
    X(vkDestroySemaphore)

/* Optional: present only with the extension / feature. */
#define VRAMD_OPTIONAL_DEVICE_FUNCS(X)         \
    X(vkWaitSemaphores)                        \
    X(vkGetSemaphoreCounterValue)              \
    X(vkGetMemoryHostPointerPropertiesEXT)

typedef struct {
#define X(name) PFN_##name name;
    VRAMD_INSTANCE_FUNCS(X)
    VRAMD_DEVICE_FUNCS(X)
    VRAMD_OPTIONAL_DEVICE_FUNCS(X)
#undef X
} vramd_vk;

/* One device allocation with the buffer bound to all of it. */
typedef struct {
    VkBuffer buffer;
    VkDeviceMemory memory;
    uint64_t size;      /* allocation size (memory requirements), for accounting */
    uint32_t heap;
    uint32_t is_device; /* counts towards the device bytes and the device limit */
} vramd_alloc;

/* Command buffers for transfers, reused round-robin.  Each slot remembers
 * its fence so that reuse waits exactly for the copy that used it last:
 * this is what bounds how far allocation may run ahead of the copy engine. */
#define VRAMD_RING 16

typedef struct {
    VkCommandBuffer cmd;
    VkFence fence;
    int busy;           /* submitted and the fence not yet seen signalled */
} vramd_slot;

/* A released allocation waiting for the reclaimer. */
typedef struct vramd_grave {
    vramd_alloc alloc;
    struct vramd_grave *next;
} vramd_grave;

struct vramd_ctx {
    vramd_vk vk;
    VkInstance instance;
    VkPhysicalDevice phys;
    VkDevice device;
    VkQueue compute_queue, transfer_queue;
    uint32_t compute_family, transfer_family;
    int timeline, host_import, memory_budget;

    VkPhysicalDeviceMemoryProperties memprops;
    uint64_t max_allocation, max_storage_range, storage_alignment;
    uint64_t import_alignment;
    uint64_t block_bytes, device_limit;
    int device_type;            /* memory type index for device blocks */
    uint32_t device_heap;
    int shadow_type;            /* host-visible cached type for non-imported shadows */

    /* Ordering between the two queues.  With timeline semaphores every
     * transfer waits for the last compute value and every compute waits for
     * the last transfer value, on the GPU.  Without them the core waits on
     * the host (fences), which is slower but equally correct. */
    VkSemaphore transfer_sem, compute_sem;
    uint64_t transfer_value, compute_value;
    VkFence compute_fence;      /* fallback without timeline semaphores */
    int compute_fence_busy;

    VkCommandPool pool;         /* transfer family */
    vramd_slot ring[VRAMD_RING];
    uint32_t ring_next;

    /* Staging for byte access to scratch and for reads of resident regions;
     * never on the release/restore path. */
    vramd_alloc staging;
    void *staging_ptr;
    uint64_t staging_size;

    /* Accounting: bytes this context holds per heap, and device bytes. */
    pthread_mutex_t lock;       /* guards accounting and the grave list */
    pthread_cond_t cond;
    uint64_t heap_usage[VK_MAX_MEMORY_HEAPS];
    uint64_t device_bytes;
    uint64_t reserved;          /* device bytes being allocated right now (checked, not yet held) */
    vramd_grave *graves;
    uint64_t pending;           /* graves not yet freed, including ones in progress */
    uint64_t pending_device;    /* their device bytes (still in device_bytes until freed) */
    int stopping;
    uint32_t alloc_threads, flags;
#define VRAMD_MAX_THREADS 8
    pthread_t reclaimers[VRAMD_MAX_THREADS];
    int reclaimer_started;      /* how many reclaimer threads run */

    vramd_region **regions;
    uint32_t n_regions, cap_regions;

    vramd_stats stats;
};

typedef struct {
    uint64_t offset;            /* inside the region (the shadow is contiguous when imported) */
    uint64_t size;
    vramd_alloc dev;            /* buffer/memory zero while released */
    VkBuffer shadow_buffer;     /* transfer source/destination on the host side */
    VkDeviceMemory shadow_memory;
    void *shadow_ptr;
    uint64_t shadow_bytes_accounted;
    uint32_t shadow_heap;
} vramd_block;

typedef struct {
    uint32_t block;
    uint64_t offset;            /* inside the block */
    uint64_t nbytes;
} vramd_tensor;

struct vramd_region {
    vramd_ctx *ctx;
    int kind;
    char name[64];
    int sealed, resident, evict;
    vramd_tensor *tensors;
    uint32_t n_tensors, cap_tensors;
    vramd_block *blocks;
    uint32_t n_blocks;
    void *shadow_base;          /* mmap of the whole shadow when imported */
    uint64_t shadow_bytes, bytes;
    /* The shadow's standing: valid while it holds a complete copy (as
     * loaded, or as of the last completed eviction: generation counts
     * those); cleared while an eviction copy is in flight and left cleared
     * if one fails mid-copy (the region then stays resident: its device
     * copy is the only good one, and a restore refuses the shadow). */
    int shadow_valid;
    uint64_t shadow_generation;
};

/* Failpoints (native/src/failpoint.c): the names are vramd/failpoints.py's.
 * Unarmed, VRAMD_FAILPOINT costs one load and a branch predicted not taken;
 * armed, it may SIGKILL the process or return an error status. */
enum { VRAMD_FP_RESTORE_MID, VRAMD_FP_EVICT_MID, VRAMD_FP_EVICT_COPIED, VRAMD_FP_RELEASE_MID, VRAMD_FP_COUNT };
extern int vramd_fp_armed;
int vramd_failpoint_hit(int id);
#define VRAMD_FAILPOINT(id) \
    (__builtin_expect(__atomic_load_n(&vramd_fp_armed, __ATOMIC_RELAXED) != 0, 0) ? vramd_failpoint_hit(id) : VRAMD_OK)

/* errors */
int vramd_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int vramd_vkfail(VkResult r, const char *what);
const char *vramd_vkresult(VkResult r);
uint64_t vramd_now_ns(void);

/* context.c helpers for region.c */
int vramd_find_type(vramd_ctx *ctx, uint32_t bits, VkMemoryPropertyFlags want,
                    VkMemoryPropertyFlags avoid);
int vramd_alloc_device(vramd_ctx *ctx, uint64_t size, vramd_alloc *out);
int vramd_alloc_host(vramd_ctx *ctx, uint64_t size, vramd_alloc *out, void **ptr);
int vramd_import_host(vramd_ctx *ctx, void *ptr, uint64_t size, vramd_alloc *out);
void vramd_free_now(vramd_ctx *ctx, vramd_alloc *a);
void vramd_bury(vramd_ctx *ctx, vramd_alloc *a);
int vramd_slot_acquire(vramd_ctx *ctx, vramd_slot **out);
int vramd_submit_transfer(vramd_ctx *ctx, vramd_slot *slot);
int vramd_wait_transfers(vramd_ctx *ctx);
int vramd_wait_compute(vramd_ctx *ctx);
int vramd_staging(vramd_ctx *ctx, uint64_t want);
int vramd_copy_sync(vramd_ctx *ctx, VkBuffer src, uint64_t src_off, VkBuffer dst,
                    uint64_t dst_off, uint64_t n, int to_host);
void vramd_ctx_forget_region(vramd_ctx *ctx, vramd_region *r);

#endif
