/* Regions: tensors packed into blocks, host shadows, and the release /
 * restore paths with the semantics of each kind. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

static const char *KIND_NAMES[VRAMD_KIND_COUNT] = {"weights", "state", "encoder", "scratch"};

static uint64_t round_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

static int has_shadow(const vramd_region *r) { return r->kind != VRAMD_KIND_SCRATCH; }

/* Blocks are rounded to this so that each block's slice of one contiguous
 * shadow mapping is a valid import (page-aligned start and size). */
static uint64_t block_granule(const vramd_ctx *ctx) {
    return ctx->import_alignment > 65536 ? ctx->import_alignment : 65536;
}

int vramd_region_create(vramd_ctx *ctx, int kind, const char *name, vramd_region **out) {
    *out = NULL;
    if (kind < 0 || kind >= VRAMD_KIND_COUNT)
        return vramd_fail(VRAMD_ERR_USAGE, "unknown region kind %d (weights=0, state=1, encoder=2, scratch=3)", kind);
    vramd_region *r = calloc(1, sizeof *r);
    if (!r) return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
    if (ctx->n_regions == ctx->cap_regions) {
        uint32_t cap = ctx->cap_regions ? 2 * ctx->cap_regions : 8;
        vramd_region **rs = realloc(ctx->regions, cap * sizeof *rs);
        if (!rs) {
            free(r);
            return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
        }
        ctx->regions = rs;
        ctx->cap_regions = cap;
    }
    r->ctx = ctx;
    r->kind = kind;
    /* State is evicted on release by default: losing a KV cache is what
     * vramd exists to avoid.  The caller may choose to keep it resident. */
    r->evict = 1;
    snprintf(r->name, sizeof r->name, "%s", name ? name : KIND_NAMES[kind]);
    ctx->regions[ctx->n_regions++] = r;
    *out = r;
    return VRAMD_OK;
}

int vramd_region_add_tensor(vramd_region *r, uint64_t nbytes, uint32_t *index) {
    vramd_ctx *ctx = r->ctx;
    if (r->sealed) return vramd_fail(VRAMD_ERR_USAGE, "region '%s' is sealed: add tensors before the first use", r->name);
    if (!nbytes) return vramd_fail(VRAMD_ERR_USAGE, "region '%s': a tensor needs at least one byte", r->name);
    /* A tensor lives in one block, and one block is one allocation.  The
     * size is compared before it is rounded: rounding a size near 2^64 up
     * wraps to a small number that would pass. */
    if (nbytes > ctx->max_allocation || round_up(nbytes, block_granule(ctx)) > ctx->max_allocation)
        return vramd_fail(VRAMD_ERR_USAGE,
                          "region '%s': a tensor of %llu bytes is larger than the device's largest "
                          "allocation (maxMemoryAllocationSize %llu bytes); split it",
                          r->name, (unsigned long long)nbytes, (unsigned long long)ctx->max_allocation);
    if (r->n_tensors == r->cap_tensors) {
        uint32_t cap = r->cap_tensors ? 2 * r->cap_tensors : 16;
        vramd_tensor *ts = realloc(r->tensors, cap * sizeof *ts);
        if (!ts) return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
        r->tensors = ts;
        r->cap_tensors = cap;
    }
    r->tensors[r->n_tensors] = (vramd_tensor){.nbytes = nbytes};
    *index = r->n_tensors++;
    return VRAMD_OK;
}

static void free_shadow(vramd_region *r) {
    vramd_ctx *ctx = r->ctx;
    for (uint32_t b = 0; b < r->n_blocks; b++) {
        vramd_block *k = &r->blocks[b];
        vramd_alloc a = {.buffer = k->shadow_buffer, .memory = k->shadow_memory};
        if (!a.memory) continue;
        /* The accounting needs size and heap: recompute from the type. */
        if (!r->shadow_base) ctx->vk.vkUnmapMemory(ctx->device, a.memory);
        a.size = k->shadow_bytes_accounted;
        a.heap = k->shadow_heap;
        vramd_free_now(ctx, &a);
        k->shadow_buffer = VK_NULL_HANDLE;
        k->shadow_memory = VK_NULL_HANDLE;
        k->shadow_ptr = NULL;
    }
    if (r->shadow_base) munmap(r->shadow_base, r->shadow_bytes);
    r->shadow_base = NULL;
    r->shadow_bytes = 0;
}

static int alloc_shadow(vramd_region *r) {
    vramd_ctx *ctx = r->ctx;
    int rc = VRAMD_OK;
    if (ctx->host_import) {
        /* One anonymous mapping for the whole region, imported block by
         * block: the loader sees one contiguous shadow and the DMA engine
         * reads it in place. */
        void *base = mmap(NULL, r->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (base == MAP_FAILED)
            return vramd_fail(VRAMD_ERR_DEVICE, "region '%s': cannot map %llu bytes of host memory for its shadow",
                              r->name, (unsigned long long)r->bytes);
        r->shadow_base = base;
        r->shadow_bytes = r->bytes;
        for (uint32_t b = 0; b < r->n_blocks && !rc; b++) {
            vramd_block *k = &r->blocks[b];
            vramd_alloc a;
            k->shadow_ptr = (char *)base + k->offset;
            rc = vramd_import_host(ctx, k->shadow_ptr, k->size, &a);
            if (!rc) {
                k->shadow_buffer = a.buffer;
                k->shadow_memory = a.memory;
                k->shadow_bytes_accounted = a.size;
                k->shadow_heap = a.heap;
            }
        }
    } else {
        for (uint32_t b = 0; b < r->n_blocks && !rc; b++) {
            vramd_block *k = &r->blocks[b];
            vramd_alloc a;
            rc = vramd_alloc_host(ctx, k->size, &a, &k->shadow_ptr);
            if (!rc) {
                k->shadow_buffer = a.buffer;
                k->shadow_memory = a.memory;
                k->shadow_bytes_accounted = a.size;
                k->shadow_heap = a.heap;
                r->shadow_bytes += k->size;
            }
        }
    }
    if (rc) {
        char keep[512];
        snprintf(keep, sizeof keep, "region '%s' shadow: %s", r->name, vramd_last_error());
        free_shadow(r);
        return vramd_fail(rc, "%s", keep);
    }
    return VRAMD_OK;
}

/* Packs tensors in order into blocks of at most block_bytes (a larger
 * tensor gets a block of its own), so thousands of tensors make a few
 * allocations, and no tensor straddles two allocations. */
int vramd_region_seal(vramd_region *r) {
    vramd_ctx *ctx = r->ctx;
    if (r->sealed) return VRAMD_OK;
    if (!r->n_tensors) return vramd_fail(VRAMD_ERR_USAGE, "region '%s' has no tensors", r->name);
    uint64_t align = ctx->storage_alignment > 256 ? ctx->storage_alignment : 256;
    uint64_t granule = block_granule(ctx);
    vramd_block *blocks = calloc(r->n_tensors, sizeof *blocks);
    if (!blocks) return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
    uint32_t nb = 0;
    uint64_t used = 0, region_off = 0;
    for (uint32_t i = 0; i < r->n_tensors; i++) {
        vramd_tensor *t = &r->tensors[i];
        uint64_t at = round_up(used, align);
        /* The first blocks ramp up from 16 MiB: the copy engine idles until
         * the first allocation returns, and a small one returns sooner. */
        uint64_t target = ctx->block_bytes;
        if (!(ctx->flags & VRAMD_CTX_NO_RAMP) && nb > 0 && nb <= 8 && (16ull << 20 << (nb - 1)) < target)
            target = 16ull << 20 << (nb - 1);
        if (nb == 0 || (used > 0 && at + t->nbytes > target) ||
            round_up(at + t->nbytes, granule) > ctx->max_allocation) {
            if (nb > 0) {
                blocks[nb - 1].size = round_up(used, granule);
                region_off += blocks[nb - 1].size;
            }
            blocks[nb].offset = region_off;
            nb++;
            at = 0;
        }
        t->block = nb - 1;
        t->offset = at;
        used = at + t->nbytes;
    }
    blocks[nb - 1].size = round_up(used, granule);
    region_off += blocks[nb - 1].size;
    r->blocks = blocks;
    r->n_blocks = nb;
    r->bytes = region_off;
    if (has_shadow(r)) {
        int rc = alloc_shadow(r);
        if (rc) {
            free(r->blocks);
            r->blocks = NULL;
            r->n_blocks = 0;
            return rc;
        }
    }
    r->sealed = 1;
    r->shadow_valid = has_shadow(r);
    return VRAMD_OK;
}

int vramd_region_set_evict(vramd_region *r, int evict) {
    r->evict = evict != 0;
    return VRAMD_OK;
}

static uint64_t device_held(const vramd_region *r) {
    uint64_t n = 0;
    for (uint32_t b = 0; b < r->n_blocks; b++) n += r->blocks[b].dev.size;
    return n;
}

int vramd_region_info_get(vramd_region *r, vramd_region_info *out) {
    memset(out, 0, sizeof *out);
    out->kind = (uint32_t)r->kind;
    out->resident = (uint32_t)r->resident;
    out->evict = (uint32_t)r->evict;
    out->n_tensors = r->n_tensors;
    out->n_blocks = r->n_blocks;
    out->bytes = r->bytes;
    out->device_bytes = device_held(r);
    out->host_bytes = r->shadow_bytes;
    out->shadow_generation = r->shadow_generation;
    out->shadow_valid = (uint32_t)r->shadow_valid;
    return VRAMD_OK;
}

/* ---- restore ------------------------------------------------------------- */

/* Gives back the device memory of regions made resident by a restore that
 * then failed.  Their shadows are still the truth (nothing ran on the new
 * copies), so no copy back is needed. */
static void roll_back(vramd_ctx *ctx, vramd_region **rs, uint32_t n) {
    vramd_wait_transfers(ctx); /* no copy may still write into what we free */
    for (uint32_t i = 0; i < n; i++) {
        for (uint32_t b = 0; b < rs[i]->n_blocks; b++)
            if (rs[i]->blocks[b].dev.memory) vramd_bury(ctx, &rs[i]->blocks[b].dev);
        rs[i]->resident = 0;
    }
    /* The caller may retry at once (after freeing something else): leave
     * the budget as it was before this restore. */
    vramd_ctx_drain(ctx);
}

/* Allocation work shared by the submitting thread and the allocator
 * threads of one restore.  Blocks are claimed in order; the submitter takes
 * block i as soon as it is ready and claims it itself when no allocator has
 * yet, so the pipeline also runs (slower) with no threads at all. */
typedef struct {
    vramd_ctx *ctx;
    vramd_block **blocks;
    uint32_t n, next;
    uint8_t *ready;             /* 0: pending, 1: allocated, 2: failed */
    int failed, fail_rc;
    char fail_msg[512];
    uint64_t alloc_ns;
    pthread_mutex_t m;
    pthread_cond_t c;
} alloc_job;

static void alloc_one(alloc_job *j, uint32_t i) {
    uint64_t t0 = vramd_now_ns();
    int rc = vramd_alloc_device(j->ctx, j->blocks[i]->size, &j->blocks[i]->dev);
    uint64_t dt = vramd_now_ns() - t0;
    pthread_mutex_lock(&j->m);
    j->alloc_ns += dt;
    j->ready[i] = rc ? 2 : 1;
    if (rc && !j->failed) {
        j->failed = 1;
        j->fail_rc = rc;
        /* The message is thread-local: carry it to the submitter. */
        snprintf(j->fail_msg, sizeof j->fail_msg, "%s", vramd_last_error());
    }
    pthread_cond_broadcast(&j->c);
    pthread_mutex_unlock(&j->m);
}

static void *allocator_main(void *arg) {
    alloc_job *j = arg;
    for (;;) {
        pthread_mutex_lock(&j->m);
        if (j->failed || j->next >= j->n) {
            pthread_mutex_unlock(&j->m);
            return NULL;
        }
        uint32_t i = j->next++;
        pthread_mutex_unlock(&j->m);
        alloc_one(j, i);
    }
}

/* Waits until block i is allocated (or allocates it); 0 when it is. */
static int take_block(alloc_job *j, uint32_t i, uint64_t *wait_ns) {
    uint64_t t0 = vramd_now_ns();
    pthread_mutex_lock(&j->m);
    while (!j->ready[i] && !j->failed) {
        if (j->next == i) {
            j->next++;
            pthread_mutex_unlock(&j->m);
            alloc_one(j, i);
            pthread_mutex_lock(&j->m);
        } else {
            pthread_cond_wait(&j->c, &j->m);
        }
    }
    int ok = j->ready[i] == 1 && !j->failed;
    pthread_mutex_unlock(&j->m);
    *wait_ns += vramd_now_ns() - t0;
    return ok ? 0 : -1;
}

/* The pipeline: block i's copy runs on the copy engine while later blocks
 * are being allocated, by one allocator thread beside this (submitting)
 * thread.  Measured on the H200 (docs/benchmarks.md): plain allocations of
 * 16 GiB took ~330 ms, as long as the DMA, and slowed the DMA beside them;
 * dedicated ones (context.c) take ~30 ms and the copy engine never waits.
 * More allocator threads made the DMA slower, not faster.  Each block's
 * copy is its own submission, so the engine starts as soon as the first
 * (small: see the ramp in vramd_region_seal) block exists. */
static int restore_list(vramd_ctx *ctx, vramd_region **rs, uint32_t n) {
    uint32_t total = 0;
    for (uint32_t i = 0; i < n; i++) {
        /* Never upload a shadow an eviction left half-written (that region
         * stayed resident, so this is a caller's error, but a cheap check). */
        if (has_shadow(rs[i]) && !rs[i]->shadow_valid)
            return vramd_fail(VRAMD_ERR_USAGE, "region '%s': its shadow is incomplete (an eviction failed "
                              "mid-copy); its device copy is the only good one", rs[i]->name);
        total += rs[i]->n_blocks;
    }
    vramd_block **blocks = malloc(total * sizeof *blocks);
    uint8_t *ready = calloc(total, 1);
    vramd_region **owner = malloc(total * sizeof *owner);
    if (!blocks || !ready || !owner) {
        free(blocks);
        free(ready);
        free(owner);
        return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t b = 0; b < rs[i]->n_blocks; b++, k++) {
            blocks[k] = &rs[i]->blocks[b];
            owner[k] = rs[i];
        }
    alloc_job job = {.ctx = ctx, .blocks = blocks, .n = total, .ready = ready};
    pthread_mutex_init(&job.m, NULL);
    pthread_cond_init(&job.c, NULL);
    pthread_t threads[VRAMD_MAX_THREADS];
    uint64_t t_wait = 0;
    uint32_t started = 0, want = total > 1 ? ctx->alloc_threads : 0;
    if (ctx->flags & VRAMD_CTX_SERIAL_RESTORE) {
        /* Diagnosis only: every allocation before the first copy. */
        want = 0;
        for (uint32_t i = 0; i < total; i++)
            if (take_block(&job, i, &t_wait)) break;
    }
    if (want > total - 1) want = total - 1;
    for (uint32_t t = 0; t < want; t++)
        if (pthread_create(&threads[started], NULL, allocator_main, &job) == 0) started++;

    uint64_t t_submit = 0, bytes = 0, copies = 0;
    ctx->stats.restore_stall_ns = 0;
    int rc = VRAMD_OK;
    for (uint32_t i = 0; i < total && !rc; i++) {
        /* Half the blocks are uploading, the rest not yet allocated. */
        if (total > 1 && i == total / 2 && (rc = VRAMD_FAILPOINT(VRAMD_FP_RESTORE_MID))) break;
        if (take_block(&job, i, &t_wait)) {
            rc = job.fail_rc ? job.fail_rc : VRAMD_ERR_DEVICE;
            break;
        }
        if (!has_shadow(owner[i])) continue; /* scratch: allocate only */
        uint64_t t0 = vramd_now_ns();
        vramd_slot *s;
        rc = vramd_slot_acquire(ctx, &s);
        if (rc) break;
        VkBufferCopy c = {.srcOffset = 0, .dstOffset = 0, .size = blocks[i]->size};
        ctx->vk.vkCmdCopyBuffer(s->cmd, blocks[i]->shadow_buffer, blocks[i]->dev.buffer, 1, &c);
        rc = vramd_submit_transfer(ctx, s);
        t_submit += vramd_now_ns() - t0;
        bytes += blocks[i]->size;
        copies++;
    }
    char keep[512];
    if (rc) {
        /* Stop the allocators before anything is freed. */
        pthread_mutex_lock(&job.m);
        if (!job.failed) {
            job.failed = 1;
            snprintf(job.fail_msg, sizeof job.fail_msg, "%s", vramd_last_error());
        }
        pthread_mutex_unlock(&job.m);
    }
    for (uint32_t t = 0; t < started; t++) pthread_join(threads[t], NULL);
    if (rc) snprintf(keep, sizeof keep, "%s", job.fail_msg);
    pthread_cond_destroy(&job.c);
    pthread_mutex_destroy(&job.m);
    free(blocks);
    free(ready);
    free(owner);
    ctx->stats.restore_alloc_ns = job.alloc_ns;
    ctx->stats.restore_alloc_wait_ns = t_wait;
    if (rc) {
        roll_back(ctx, rs, n);
        const char *what = n == 1 ? rs[0]->name : "the requested regions";
        return vramd_fail(rc, "restore of %s failed, left released with the shadow intact: %s", what, keep);
    }
    for (uint32_t i = 0; i < n; i++) rs[i]->resident = 1;
    ctx->stats.restore_bytes = bytes;
    ctx->stats.restore_blocks = copies;
    ctx->stats.restore_submit_ns = t_submit;
    return VRAMD_OK;
}

static int collect(vramd_ctx *ctx, uint32_t kinds, int resident, vramd_region ***out, uint32_t *n) {
    *n = 0;
    *out = NULL;
    if (kinds >> VRAMD_KIND_COUNT) return vramd_fail(VRAMD_ERR_USAGE, "kinds mask 0x%x has unknown bits", kinds);
    if (!ctx->n_regions) return VRAMD_OK;
    vramd_region **rs = malloc(ctx->n_regions * sizeof *rs);
    if (!rs) return vramd_fail(VRAMD_ERR_DEVICE, "out of host memory");
    for (uint32_t i = 0; i < ctx->n_regions; i++) {
        vramd_region *r = ctx->regions[i];
        if (!(kinds & (1u << r->kind)) || !r->sealed || r->resident != resident) continue;
        rs[(*n)++] = r;
    }
    *out = rs;
    return VRAMD_OK;
}

int vramd_restore(vramd_ctx *ctx, uint32_t kinds) {
    vramd_region **rs;
    uint32_t n;
    /* Scratch is not restored: it is re-created lazily on its next use. */
    int rc = collect(ctx, kinds & ~(1u << VRAMD_KIND_SCRATCH), 0, &rs, &n);
    if (rc) return rc;
    rc = n ? restore_list(ctx, rs, n) : VRAMD_OK; /* already resident: a no-op */
    free(rs);
    return rc;
}

static int require_sealed(vramd_region *r) {
    /* Sealing is implicit on first use: the layout is fixed from then on. */
    return r->sealed ? VRAMD_OK : vramd_region_seal(r);
}

int vramd_region_restore(vramd_region *r) {
    int rc = require_sealed(r);
    if (rc || r->resident) return rc;
    return restore_list(r->ctx, &r, 1);
}

/* ---- release ------------------------------------------------------------- */

static int release_list(vramd_ctx *ctx, vramd_region **rs, uint32_t n) {
    if (!n) return VRAMD_OK;
    /* Nothing may be freed, nor copied back, while a compute step or a copy
     * still uses it. */
    uint64_t t0 = vramd_now_ns();
    int rc = vramd_wait_compute(ctx);
    if (!rc) rc = vramd_wait_transfers(ctx);
    ctx->stats.release_wait_ns = vramd_now_ns() - t0;
    if (rc) return rc;

    /* State: one submission with every block's device->host copy, so the
     * engine streams at the link rate; only then is device memory freed.
     * The shadow is marked incomplete while the copy runs and complete (a
     * new generation) once it is done, so it is always either the previous
     * complete copy or the new one, never a mix that anyone would use. */
    uint64_t evict_bytes = 0;
    uint32_t state_blocks = 0, recorded = 0;
    for (uint32_t i = 0; i < n; i++)
        if (rs[i]->kind == VRAMD_KIND_STATE) state_blocks += rs[i]->n_blocks;
    vramd_slot *s = NULL;
    for (uint32_t i = 0; i < n; i++) {
        vramd_region *r = rs[i];
        if (r->kind != VRAMD_KIND_STATE) continue;
        if (!s && (rc = vramd_slot_acquire(ctx, &s))) return rc;
        for (uint32_t b = 0; b < r->n_blocks; b++) {
            VkBufferCopy c = {.srcOffset = 0, .dstOffset = 0, .size = r->blocks[b].size};
            ctx->vk.vkCmdCopyBuffer(s->cmd, r->blocks[b].dev.buffer, r->blocks[b].shadow_buffer, 1, &c);
            evict_bytes += r->blocks[b].size;
            /* Half the copies recorded, nothing submitted: the slot is
             * simply reset by its next user. */
            if (++recorded == (state_blocks + 1) / 2 && (rc = VRAMD_FAILPOINT(VRAMD_FP_EVICT_MID))) return rc;
        }
    }
    if (s) {
        VkMemoryBarrier mb = {.sType = VK_STRUCTURE_TYPE_MEMORY_BARRIER,
                              .srcAccessMask = VK_ACCESS_TRANSFER_WRITE_BIT,
                              .dstAccessMask = VK_ACCESS_HOST_READ_BIT};
        ctx->vk.vkCmdPipelineBarrier(s->cmd, VK_PIPELINE_STAGE_TRANSFER_BIT, VK_PIPELINE_STAGE_HOST_BIT, 0, 1, &mb,
                                     0, NULL, 0, NULL);
        for (uint32_t i = 0; i < n; i++)
            if (rs[i]->kind == VRAMD_KIND_STATE) rs[i]->shadow_valid = 0;
        uint64_t t1 = vramd_now_ns();
        rc = vramd_submit_transfer(ctx, s);
        if (rc) {
            /* A failed vkQueueSubmit leaves the resources it names untouched
             * (Vulkan spec): the shadows are still the previous copy. */
            for (uint32_t i = 0; i < n; i++)
                if (rs[i]->kind == VRAMD_KIND_STATE) rs[i]->shadow_valid = 1;
            return rc;
        }
        rc = vramd_wait_transfers(ctx);
        ctx->stats.evict_copy_ns = vramd_now_ns() - t1;
        ctx->stats.evict_bytes = evict_bytes;
        /* A failed copy keeps the state resident and its shadow marked
         * incomplete: the device copy is still the only good one. */
        if (rc) return rc;
        for (uint32_t i = 0; i < n; i++)
            if (rs[i]->kind == VRAMD_KIND_STATE) {
                rs[i]->shadow_valid = 1;
                rs[i]->shadow_generation++;
            }
        /* Copied, nothing freed: device and shadow both hold the state. */
        if ((rc = VRAMD_FAILPOINT(VRAMD_FP_EVICT_COPIED))) return rc;
    }
    /* Region by region: a failure between two leaves each one either fully
     * released or fully resident. */
    for (uint32_t i = 0; i < n; i++) {
        if (n > 1 && i == n / 2 && (rc = VRAMD_FAILPOINT(VRAMD_FP_RELEASE_MID))) return rc;
        for (uint32_t b = 0; b < rs[i]->n_blocks; b++)
            if (rs[i]->blocks[b].dev.memory) vramd_bury(ctx, &rs[i]->blocks[b].dev);
        rs[i]->resident = 0;
    }
    return VRAMD_OK;
}

int vramd_release(vramd_ctx *ctx, uint32_t kinds) {
    vramd_region **rs;
    uint32_t n, m = 0;
    int rc = collect(ctx, kinds, 1, &rs, &n);
    if (rc) return rc;
    /* State whose policy is "keep" stays resident. */
    for (uint32_t i = 0; i < n; i++)
        if (rs[i]->kind != VRAMD_KIND_STATE || rs[i]->evict) rs[m++] = rs[i];
    rc = release_list(ctx, rs, m);
    free(rs);
    return rc;
}

int vramd_region_release(vramd_region *r) {
    if (!r->resident) return VRAMD_OK;
    return release_list(r->ctx, &r, 1);
}

int vramd_breakdown(vramd_ctx *ctx, vramd_breakdown_t *out) {
    memset(out, 0, sizeof *out);
    for (uint32_t i = 0; i < ctx->n_regions; i++) {
        vramd_region *r = ctx->regions[i];
        out->device[r->kind] += r->resident ? device_held(r) : 0;
        out->host[r->kind] += r->shadow_bytes;
    }
    return VRAMD_OK;
}

/* ---- tensors ------------------------------------------------------------- */

static int tensor_at(vramd_region *r, uint32_t index, uint64_t offset, uint64_t n, vramd_tensor **t) {
    int rc = require_sealed(r);
    if (rc) return rc;
    if (index >= r->n_tensors)
        return vramd_fail(VRAMD_ERR_USAGE, "region '%s' has no tensor %u (it has %u)", r->name, index, r->n_tensors);
    *t = &r->tensors[index];
    if (offset > (*t)->nbytes || n > (*t)->nbytes - offset)
        return vramd_fail(VRAMD_ERR_USAGE, "region '%s' tensor %u: bytes %llu..%llu are outside its %llu bytes",
                          r->name, index, (unsigned long long)offset, (unsigned long long)(offset + n),
                          (unsigned long long)(*t)->nbytes);
    return VRAMD_OK;
}

int vramd_tensor_place_get(vramd_region *r, uint32_t index, vramd_tensor_place *out) {
    vramd_tensor *t = NULL;
    int rc = tensor_at(r, index, 0, 0, &t);
    if (rc) return rc;
    out->block = t->block;
    out->reserved = 0;
    out->offset = t->offset;
    out->nbytes = t->nbytes;
    return VRAMD_OK;
}

int vramd_tensor_host(vramd_region *r, uint32_t index, void **ptr) {
    vramd_tensor *t = NULL;
    int rc = tensor_at(r, index, 0, 0, &t);
    if (rc) return rc;
    if (!has_shadow(r)) return vramd_fail(VRAMD_ERR_USAGE, "region '%s' is scratch: it has no host shadow", r->name);
    *ptr = (char *)r->blocks[t->block].shadow_ptr + t->offset;
    return VRAMD_OK;
}

static int ensure_device(vramd_region *r) {
    if (r->resident) return VRAMD_OK;
    if (r->kind == VRAMD_KIND_SCRATCH) return restore_list(r->ctx, &r, 1);
    return vramd_fail(VRAMD_ERR_USAGE, "region '%s' (%s) is released: restore it first", r->name, KIND_NAMES[r->kind]);
}

int vramd_tensor_buffer(vramd_region *r, uint32_t index, uint64_t *buffer, uint64_t *offset) {
    vramd_tensor *t = NULL;
    int rc = tensor_at(r, index, 0, 0, &t);
    if (!rc) rc = ensure_device(r);
    if (rc) return rc;
    *buffer = (uint64_t)(uintptr_t)r->blocks[t->block].dev.buffer;
    *offset = t->offset;
    return VRAMD_OK;
}

int vramd_tensor_write(vramd_region *r, uint32_t index, uint64_t offset, const void *src, uint64_t n) {
    vramd_ctx *ctx = r->ctx;
    vramd_tensor *t = NULL;
    int rc = tensor_at(r, index, offset, n, &t);
    if (rc || !n) return rc;
    vramd_block *k = &r->blocks[t->block];
    uint64_t at = t->offset + offset;
    if (has_shadow(r)) {
        /* The shadow gets the bytes in every case: for weights it is the
         * truth; for state it is what the next restore uploads. */
        memcpy((char *)k->shadow_ptr + at, src, n);
        if (!r->resident) return VRAMD_OK;
        return vramd_copy_sync(ctx, k->shadow_buffer, at, k->dev.buffer, at, n, 0);
    }
    if ((rc = ensure_device(r)) || (rc = vramd_staging(ctx, n))) return rc;
    for (uint64_t done = 0; done < n && !rc; done += ctx->staging_size) {
        uint64_t m = n - done < ctx->staging_size ? n - done : ctx->staging_size;
        memcpy(ctx->staging_ptr, (const char *)src + done, m);
        rc = vramd_copy_sync(ctx, ctx->staging.buffer, 0, k->dev.buffer, at + done, m, 0);
    }
    return rc;
}

int vramd_tensor_read(vramd_region *r, uint32_t index, uint64_t offset, void *dst, uint64_t n) {
    vramd_ctx *ctx = r->ctx;
    vramd_tensor *t = NULL;
    int rc = tensor_at(r, index, offset, n, &t);
    if (rc || !n) return rc;
    vramd_block *k = &r->blocks[t->block];
    uint64_t at = t->offset + offset;
    if (!r->resident) {
        if (!has_shadow(r))
            return vramd_fail(VRAMD_ERR_USAGE, "region '%s' is scratch and released: it has no content", r->name);
        memcpy(dst, (const char *)k->shadow_ptr + at, n);
        return VRAMD_OK;
    }
    /* Resident: read the device copy itself (through staging, so a read
     * never touches a read-only shadow). */
    if ((rc = vramd_staging(ctx, n))) return rc;
    for (uint64_t done = 0; done < n && !rc; done += ctx->staging_size) {
        uint64_t m = n - done < ctx->staging_size ? n - done : ctx->staging_size;
        rc = vramd_copy_sync(ctx, k->dev.buffer, at + done, ctx->staging.buffer, 0, m, 1);
        if (!rc) memcpy((char *)dst + done, ctx->staging_ptr, m);
    }
    return rc;
}

void vramd_region_destroy(vramd_region *r) {
    if (!r) return;
    vramd_ctx *ctx = r->ctx;
    vramd_ctx_sync(ctx);
    for (uint32_t b = 0; b < r->n_blocks; b++)
        if (r->blocks[b].dev.memory) vramd_bury(ctx, &r->blocks[b].dev);
    free_shadow(r);
    vramd_ctx_forget_region(ctx, r);
    free(r->blocks);
    free(r->tensors);
    free(r);
}
