/*
 * vramd host matvec: y = W x on the CPU, straight from a GGUF tensor's
 * bytes, for the weights --n-cpu-moe keeps in host memory (MoE experts).
 *
 * A job is one matrix of `rows` rows of `cols` elements in a GGUF storage
 * type (rows stored one after another, as in the file) and `n` input
 * vectors: y[v * rows + r] = sum_c W[r, c] * x[v * cols + c], accumulated in
 * float.  One call takes many jobs (all the experts a token selected, or
 * every (expert, tokens) group of a prefill chunk): the rows of all of them
 * are cut into chunks that a persistent pool of threads takes in turn, so a
 * call costs one wake-up of the pool, not one per matrix.
 *
 * The pool starts on the first call, with one thread per CPU the process may
 * run on (sched_getaffinity), at most VRAMD_HOSTMV_DEFAULT_THREADS; the
 * calling thread is one of them.  Calls from several threads are serialised.
 *
 * Errors: a status of residency.h (VRAMD_ERR_USAGE for a job the core cannot
 * run), the reason in vramd_last_error().  Nothing is computed then.
 *
 * The part between the CDEF markers must stay plain C declarations: the
 * Python build feeds it to cffi verbatim, after residency.h's.
 */
#ifndef VRAMD_HOSTMV_H
#define VRAMD_HOSTMV_H

#include <stdint.h>

#include "vramd/residency.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CDEF BEGIN */
/* The storage types the host matvec reads: GGML's type ids, as in GGUF. */
enum {
    VRAMD_HOSTMV_F32 = 0,
    VRAMD_HOSTMV_F16 = 1,
    VRAMD_HOSTMV_Q4_0 = 2,      /* blocks of 32: f16 scale, 16 bytes of nibbles */
    VRAMD_HOSTMV_Q8_0 = 8,      /* blocks of 32: f16 scale, 32 int8 */
    VRAMD_HOSTMV_BF16 = 30,
    VRAMD_HOSTMV_MXFP4 = 39     /* blocks of 32: E8M0 scale byte, 16 bytes of E2M1 nibbles */
};

enum {
    VRAMD_HOSTMV_DEFAULT_THREADS = 16,  /* the pool's size unless set: more cores rarely add bandwidth */
    VRAMD_HOSTMV_MAX_THREADS = 256
};

typedef struct {
    const void *w;      /* rows x row_bytes(type, cols), GGUF layout */
    const float *x;     /* n vectors of cols floats, one after another */
    float *y;           /* n vectors of rows floats; overlaps neither w nor any job's x */
    uint32_t type;      /* VRAMD_HOSTMV_* */
    uint32_t rows;
    uint32_t cols;      /* a multiple of 32 for Q8_0 and Q4_0 */
    uint32_t n;         /* vectors; 0: the job does nothing */
} vramd_hostmv_job;

/* Runs every job; returns when all are done. */
int vramd_hostmv(const vramd_hostmv_job *jobs, uint32_t n_jobs);
/* Bytes of one row of `cols` elements of `type`; 0 for a type the host
 * matvec does not read, or cols not a multiple of its block. */
uint64_t vramd_hostmv_row_bytes(uint32_t type, uint32_t cols);
/* Resizes the pool to `threads` (the caller included); 0: the default.
 * Stops the old workers and starts the new ones: not for every call. */
int vramd_hostmv_set_threads(uint32_t threads);
/* The pool's size: threads a call runs on, the caller included. */
uint32_t vramd_hostmv_threads(void);
/* CDEF END */

#ifdef __cplusplus
}
#endif

#endif /* VRAMD_HOSTMV_H */
