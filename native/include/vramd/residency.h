/*
 * vramd residency core: moves a model's buffers between VRAM and a host
 * shadow the DMA engine reads directly, at the speed of the host link.
 *
 * The caller owns the Vulkan instance and device (vramd creates them in
 * Python, a C/C++ engine can create its own) and hands the raw handles over;
 * the core loads every entry point through vkGetInstanceProcAddr /
 * vkGetDeviceProcAddr, so this library never links libvulkan.
 *
 * Handles cross this API as uint64_t: dispatchable handles are pointers,
 * non-dispatchable ones are 64-bit on every platform vramd targets, and
 * plain integers keep the header free of vulkan.h (so a binding generator,
 * cffi included, can read it as is).
 *
 * Every function that can fail returns a vramd_status; the reason is in
 * vramd_last_error() (thread-local), one line meant for a user.
 *
 * Threading: one thread drives a context at a time.  The core runs threads
 * of its own: a reclaimer, which returns released device memory to the
 * driver in the background (freeing 16 GiB takes ~110 ms on the H200, a
 * release may take 20 ms), and, during a restore, an allocator, so that
 * allocating block i+1 overlaps the copy of block i.
 *
 * The part between the CDEF markers must stay plain C declarations: the
 * Python build feeds it to cffi verbatim.
 */
#ifndef VRAMD_RESIDENCY_H
#define VRAMD_RESIDENCY_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF BEGIN */
typedef enum {
    VRAMD_OK = 0,
    VRAMD_ERR_USAGE = -1,   /* bad argument, or a call in the wrong state */
    VRAMD_ERR_OOM = -2,     /* device memory did not fit; nothing was lost */
    VRAMD_ERR_DEVICE = -3   /* a Vulkan call failed (device lost, host memory, ...) */
} vramd_status;

/* Region kinds: what happens to a region's bytes on release and restore. */
typedef enum {
    VRAMD_KIND_WEIGHTS = 0, /* read-only; shadow captured once; release frees, no copy */
    VRAMD_KIND_STATE = 1,   /* read-write; release copies device->shadow when evict is set */
    VRAMD_KIND_ENCODER = 2, /* like weights, but kept released except around an encode */
    VRAMD_KIND_SCRATCH = 3, /* no shadow; release frees; re-created lazily on next use */
    VRAMD_KIND_COUNT = 4
} vramd_kind;

typedef struct vramd_ctx vramd_ctx;
typedef struct vramd_region vramd_region;

typedef struct {
    uint64_t get_instance_proc_addr; /* PFN_vkGetInstanceProcAddr; 0: dlopen libvulkan.so.1 */
    uint64_t instance;               /* VkInstance */
    uint64_t physical_device;        /* VkPhysicalDevice */
    uint64_t device;                 /* VkDevice, created by the caller */
    uint64_t compute_queue;          /* VkQueue */
    uint32_t compute_family;
    uint32_t transfer_family;        /* == compute_family when there is no dedicated one */
    uint64_t transfer_queue;         /* may equal compute_queue */
    uint32_t timeline;               /* the timelineSemaphore feature is enabled */
    uint32_t host_import;            /* VK_EXT_external_memory_host is enabled */
    uint32_t memory_budget;          /* VK_EXT_memory_budget is enabled */
    uint32_t alloc_threads;          /* threads allocating device blocks in a restore; 0: 1 */
    uint64_t block_bytes;            /* target suballocation block; 0: 256 MiB */
    uint64_t device_limit;           /* cap on device bytes held by this context; 0: none */
    uint32_t flags;                  /* VRAMD_CTX_* below; 0 for normal use */
    uint32_t reserved;
} vramd_ctx_desc;

/* Diagnostic switches (the benchmark uses them to show what each part of
 * the restore pipeline is worth). */
enum {
    VRAMD_CTX_SERIAL_RESTORE = 1,    /* allocate every block first, then copy: no overlap */
    VRAMD_CTX_NO_RAMP = 2,           /* regions sealed later use full-size first blocks */
    VRAMD_CTX_NOT_DEDICATED = 4      /* device blocks as plain, not dedicated, allocations */
};

typedef struct {
    uint64_t max_allocation;     /* maxMemoryAllocationSize: a block is never larger */
    uint64_t max_storage_range;  /* maxStorageBufferRange: a tensor view is never larger */
    uint64_t storage_alignment;  /* minStorageBufferOffsetAlignment */
    uint64_t block_bytes;        /* the block target in use */
    uint64_t device_limit;       /* 0: none */
    uint32_t device_heap;        /* heap the device blocks come from */
    uint32_t shadow_imported;    /* 1: shadows are imported host memory; 0: host-visible cached */
} vramd_limits;

typedef struct {
    uint64_t device[4];          /* device bytes per vramd_kind; released regions count 0 */
    uint64_t host[4];            /* host shadow bytes per vramd_kind */
} vramd_breakdown_t;

typedef struct {
    uint32_t kind;
    uint32_t resident;
    uint32_t evict;
    uint32_t n_tensors;
    uint32_t n_blocks;
    uint32_t reserved;
    uint64_t bytes;              /* sum of block sizes (tensors, alignment included) */
    uint64_t device_bytes;       /* device memory held now */
    uint64_t host_bytes;         /* host shadow held */
    uint64_t shadow_generation;  /* state: evictions completed into the shadow (0: as loaded) */
    uint32_t shadow_valid;       /* 1: the shadow holds a complete copy; 0: no shadow (scratch), or an
                                    eviction failed mid-copy and the device copy is the only good one */
    uint32_t reserved2;
} vramd_region_info;

typedef struct {
    uint32_t block;              /* index of the block holding the tensor */
    uint32_t reserved;
    uint64_t offset;             /* byte offset inside the block */
    uint64_t nbytes;
} vramd_tensor_place;

/* Timings of the last restore / release, for the benchmark's diagnosis. */
typedef struct {
    uint64_t restore_bytes;
    uint64_t restore_blocks;
    uint64_t restore_alloc_ns;   /* vkCreateBuffer/vkAllocateMemory/bind, summed over threads */
    uint64_t restore_alloc_wait_ns; /* submitter waiting for the next block: allocation behind */
    uint64_t restore_submit_ns;  /* time spent recording and submitting copies */
    uint64_t restore_stall_ns;   /* waiting for a free command buffer: copy engine behind */
    uint64_t release_wait_ns;    /* waiting for in-flight compute and transfers */
    uint64_t evict_bytes;
    uint64_t evict_copy_ns;      /* device->host copy, submit to completion */
    uint64_t reclaim_pending;    /* blocks queued for the reclaimer now */
    uint64_t reclaim_free_ns;    /* total time the reclaimer spent in vkFreeMemory */
    uint64_t device_peak;        /* most device bytes held (or reserved) at once since the last reset */
    uint64_t reclaim_pending_bytes; /* device bytes released but not yet back with the driver (the
                                       reclaimer's queue); no region counts them any more */
} vramd_stats;

const char *vramd_last_error(void);

int vramd_ctx_create(const vramd_ctx_desc *desc, vramd_ctx **out);
/* Waits for all work and frees every region and all core objects. */
void vramd_ctx_destroy(vramd_ctx *ctx);
int vramd_ctx_limits(vramd_ctx *ctx, vramd_limits *out);
int vramd_ctx_set_device_limit(vramd_ctx *ctx, uint64_t bytes);
/* Bytes this context holds on a memory heap (its own accounting). */
int vramd_ctx_heap_usage(vramd_ctx *ctx, uint32_t heap, uint64_t *bytes);
/* Waits until every transfer and compute submitted through the core is done. */
int vramd_ctx_sync(vramd_ctx *ctx);
/* Waits until the reclaimer has returned all released memory to the driver. */
int vramd_ctx_drain(vramd_ctx *ctx);
int vramd_ctx_stats(vramd_ctx *ctx, vramd_stats *out);
/* Starts device_peak again from what is held now. */
int vramd_ctx_reset_peak(vramd_ctx *ctx);

/* Regions: create, add tensors, seal (lays out blocks, allocates the shadow).
 * A sealed region starts released: the first restore uploads it. */
int vramd_region_create(vramd_ctx *ctx, int kind, const char *name, vramd_region **out);
int vramd_region_add_tensor(vramd_region *r, uint64_t nbytes, uint32_t *index);
int vramd_region_seal(vramd_region *r);
int vramd_region_set_evict(vramd_region *r, int evict);
int vramd_region_info_get(vramd_region *r, vramd_region_info *out);
/* Waits for work on the region, frees its device memory and its shadow. */
void vramd_region_destroy(vramd_region *r);

int vramd_tensor_place_get(vramd_region *r, uint32_t index, vramd_tensor_place *out);
/* The tensor's bytes in the host shadow (weights, state, encoder): a loader
 * writes a model file straight into it before the first restore. */
int vramd_tensor_host(vramd_region *r, uint32_t index, void **ptr);
/* The VkBuffer and offset of the tensor's block on the device.  Weights,
 * state and encoder must be resident; scratch is allocated here if needed. */
int vramd_tensor_buffer(vramd_region *r, uint32_t index, uint64_t *buffer, uint64_t *offset);
/* Byte access for loaders and tests; resident regions go through the device. */
int vramd_tensor_write(vramd_region *r, uint32_t index, uint64_t offset, const void *src, uint64_t n);
int vramd_tensor_read(vramd_region *r, uint32_t index, uint64_t offset, void *dst, uint64_t n);

/* kinds: a bit mask, bit k for vramd_kind k.  Regions are taken in creation
 * order.  Restore is pipelined and returns once every copy is submitted;
 * compute submitted through vramd_submit_compute waits for it on the GPU.
 * A restore that does not fit frees what it allocated and leaves every
 * region it touched released (shadow intact): VRAMD_ERR_OOM. */
int vramd_restore(vramd_ctx *ctx, uint32_t kinds);
int vramd_region_restore(vramd_region *r);
/* Release waits for in-flight compute, evicts state whose evict flag is set,
 * and queues the device memory for the reclaimer. */
int vramd_release(vramd_ctx *ctx, uint32_t kinds);
int vramd_region_release(vramd_region *r);
int vramd_breakdown(vramd_ctx *ctx, vramd_breakdown_t *out);

/* Submits a recorded compute command buffer on the compute queue, after
 * every transfer submitted so far; release waits for it. */
int vramd_submit_compute(vramd_ctx *ctx, uint64_t command_buffer);

/* The raw link rate: one vkCmdCopyBuffer of nbytes between host memory of
 * the kind shadows use and device memory, each way; best and median of reps
 * in bytes per second are written to gbps[0..3] as h2d_median, d2h_median,
 * h2d_best, d2h_best (GB/s). */
int vramd_link_probe(vramd_ctx *ctx, uint64_t nbytes, uint32_t reps, double *gbps);
/* Failpoints: fault injection for tests.  vramd/failpoints.py arms them
 * from $VRAMD_FAILPOINTS (docs/architecture.md lists every name); unarmed,
 * each costs one predictable branch.  KILL sends the process SIGKILL, RAISE
 * makes the call fail with VRAMD_ERR_DEVICE ("failpoint NAME: injected
 * fault"), LOG prints "vramd: failpoint NAME reached" on stderr at every hit. */
enum { VRAMD_FP_OFF = 0, VRAMD_FP_KILL = 1, VRAMD_FP_RAISE = 2, VRAMD_FP_LOG = 3 };
/* Arms `name` to act on its `at`-th hit from now (0 or 1: the first). */
int vramd_failpoint_arm(const char *name, int action, uint32_t at);
/* The native failpoints' names by index from 0; NULL past the last. */
const char *vramd_failpoint_name(uint32_t index);
/* CDEF END */

#ifdef __cplusplus
}
#endif

#endif /* VRAMD_RESIDENCY_H */
