/* Host matvec (vramd/hostmv.h): y = W x on the CPU from GGUF bytes, for the
 * expert tensors --n-cpu-moe leaves in host memory.
 *
 * Speed comes from three things:
 *  - The inner loops use GCC's generic vectors (8 floats) on whole 32-bit
 *    lanes of the weights: a Q8_0 block's 32 int8 are 8 lanes of 4 bytes,
 *    and byte k of every lane comes out with two shifts.  So that lane l of
 *    that vector meets the right x, each input vector is permuted once per
 *    call (x'[k*8 + l] = x[4*l + k]), where a row would otherwise need a
 *    shuffle per block.  Plain shifts, conversions, multiplies and adds are
 *    all the compiler needs: SSE2 in the default build, AVX2 (and F16C/FMA
 *    for what it picks itself) in a clone chosen at load time on CPUs that
 *    have it (target_clones), never -march=native, so one build runs on the
 *    CI machine and on the H200 host alike.
 *  - The rows of all the jobs of a call are cut into chunks of ~64 KiB of
 *    weights that every thread takes from one counter: the work balances
 *    itself over threads and over jobs of different sizes.
 *  - The threads are a persistent pool woken once per call (one condition
 *    broadcast), and the caller works too: a token's 16 expert matrices are
 *    one call, not 16 thread launches. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "vramd/hostmv.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the host matvec reads GGUF's little-endian lanes as native integers"
#endif

/* An AVX2 clone next to the baseline one, picked by the loader (ifunc):
 * x86-64-v3 is AVX2 + FMA + F16C, every x86 server of the last decade; GCC
 * dispatches on that level from GCC 12, older ones get an AVX2-only clone.
 * Needs glibc (ifunc); elsewhere one build.  -DVRAMD_HOSTMV_BASELINE builds
 * the baseline alone, to test it on a CPU that would pick the clone. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && \
    !defined(VRAMD_HOSTMV_BASELINE)
#if __GNUC__ >= 12
#define VRAMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#elif __GNUC__ >= 6
#define VRAMD_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef VRAMD_CLONES
#define VRAMD_CLONES
#endif

#define INLINE static inline __attribute__((always_inline))

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v4u __attribute__((vector_size(16)));

/* Weights per chunk of rows a thread takes at once: large enough that the
 * shared counter is touched every few microseconds, small enough that 16
 * threads get many chunks out of one token's experts (~40 MB). */
#define CHUNK_BYTES 65536u

/* -- element conversions -------------------------------------------------- */

/* IEEE half to float by bits (no F16C in the baseline): exponent rebias for
 * normals, a float subtraction that renormalises subnormals, and Inf/NaN
 * kept at the top exponent.  Exact for every half. */
INLINE float half_to_float(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7fff) << 13, exp = em & (0x1fu << 23), bits;
    float f;
    if (exp == (0x1fu << 23)) {
        bits = em + (224u << 23);
    } else if (exp == 0) {
        bits = em + (113u << 23);
        memcpy(&f, &bits, 4);
        f -= 6.103515625e-05f;  /* 2^-14 */
        memcpy(&bits, &f, 4);
    } else {
        bits = em + (112u << 23);
    }
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

/* The same on 8 halves held in the low 16 bits of each lane. */
INLINE v8f half8_to_float(v8u h) {
    v8u em = (h & 0x7fff) << 13, exp = em & (0x1fu << 23);
    v8u normal = em + (112u << 23), infnan = em + (224u << 23);
    v8f sub = (v8f)(em + (113u << 23)) - 6.103515625e-05f;
    v8u is_zero = (v8u)(exp == 0), is_max = (v8u)(exp == (0x1fu << 23));
    v8u bits = (normal & ~(is_zero | is_max)) | ((v8u)sub & is_zero) | (infnan & is_max);
    return (v8f)(bits | (h & 0x8000) << 16);
}

INLINE uint16_t load16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Unaligned loads: Q8_0 blocks are 34 bytes, so nothing after the first is aligned. */
INLINE v8f load8f(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE v8u load8u(const void *p) {
    v8u v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Byte k (0..3) of every lane, sign-extended, as floats. */
INLINE v8f sbyte(v8u q, int k) {
    return __builtin_convertvector((v8i)(q << (24 - 8 * k)) >> 24, v8f);
}

INLINE float hsum(v8f a) {
    float s0 = (a[0] + a[4]) + (a[2] + a[6]), s1 = (a[1] + a[5]) + (a[3] + a[7]);
    return s0 + s1;
}

/* -- row kernels: y[v*rows + r] for rows r0..r1 of one job ----------------- */
/* Rows outer, vectors inner: a row is read from memory once and stays in L1
 * for the other vectors of the job. */

VRAMD_CLONES static void rows_f32(const vramd_hostmv_job *j, const float *x, uint32_t r0, uint32_t r1) {
    const uint32_t cols = j->cols, body = cols & ~7u;
    for (uint32_t r = r0; r < r1; r++) {
        const float *row = (const float *)j->w + (size_t)r * cols;
        for (uint32_t v = 0; v < j->n; v++) {
            const float *xv = x + (size_t)v * cols;
            v8f acc = {0};
            for (uint32_t c = 0; c < body; c += 8) acc += load8f(row + c) * load8f(xv + c);
            float s = hsum(acc);
            for (uint32_t c = body; c < cols; c++) s += row[c] * xv[c];
            j->y[(size_t)v * j->rows + r] = s;
        }
    }
}

/* F16 and BF16: 16 elements are 8 lanes of two halves; x is permuted in
 * groups of 16 so that x'[l] meets the low half of lane l, x'[8 + l] the high. */
VRAMD_CLONES static void rows_f16(const vramd_hostmv_job *j, const float *x, uint32_t r0, uint32_t r1) {
    const uint32_t cols = j->cols, body = cols & ~15u;
    for (uint32_t r = r0; r < r1; r++) {
        const uint16_t *row = (const uint16_t *)((const uint8_t *)j->w + (size_t)r * cols * 2);
        for (uint32_t v = 0; v < j->n; v++) {
            const float *xv = x + (size_t)v * cols;
            v8f acc = {0};
            for (uint32_t c = 0; c < body; c += 16) {
                v8u h = load8u(row + c);
                acc += half8_to_float(h & 0xffff) * load8f(xv + c) + half8_to_float(h >> 16) * load8f(xv + c + 8);
            }
            float s = hsum(acc);
            for (uint32_t c = body; c < cols; c++) s += half_to_float(row[c]) * xv[c];
            j->y[(size_t)v * j->rows + r] = s;
        }
    }
}

VRAMD_CLONES static void rows_bf16(const vramd_hostmv_job *j, const float *x, uint32_t r0, uint32_t r1) {
    const uint32_t cols = j->cols, body = cols & ~15u;
    for (uint32_t r = r0; r < r1; r++) {
        const uint16_t *row = (const uint16_t *)((const uint8_t *)j->w + (size_t)r * cols * 2);
        for (uint32_t v = 0; v < j->n; v++) {
            const float *xv = x + (size_t)v * cols;
            v8f acc = {0};
            for (uint32_t c = 0; c < body; c += 16) {
                v8u h = load8u(row + c);
                acc += (v8f)(h << 16) * load8f(xv + c) + (v8f)(h & 0xffff0000u) * load8f(xv + c + 8);
            }
            float s = hsum(acc);
            for (uint32_t c = body; c < cols; c++) {
                uint32_t bits = (uint32_t)row[c] << 16;
                float w;
                memcpy(&w, &bits, 4);
                s += w * xv[c];
            }
            j->y[(size_t)v * j->rows + r] = s;
        }
    }
}

/* Q8_0: 34-byte blocks, an f16 scale and 32 int8; x permuted per block so
 * that x'[k*8 + l] = x[4*l + k] (byte k of lane l). */
VRAMD_CLONES static void rows_q8_0(const vramd_hostmv_job *j, const float *x, uint32_t r0, uint32_t r1) {
    const uint32_t cols = j->cols, nb = cols / 32;
    for (uint32_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)j->w + (size_t)r * nb * 34;
        for (uint32_t v = 0; v < j->n; v++) {
            const float *xb = x + (size_t)v * cols;
            v8f acc = {0};
            for (uint32_t b = 0; b < nb; b++, xb += 32) {
                const uint8_t *blk = row + (size_t)b * 34;
                v8u q = load8u(blk + 2);
                v8f t = sbyte(q, 0) * load8f(xb) + sbyte(q, 1) * load8f(xb + 8) + sbyte(q, 2) * load8f(xb + 16) +
                        sbyte(q, 3) * load8f(xb + 24);
                acc += half_to_float(load16(blk)) * t;
            }
            j->y[(size_t)v * j->rows + r] = hsum(acc);
        }
    }
}

/* Q4_0: 18-byte blocks, an f16 scale and 16 bytes whose low nibbles are
 * elements 0..15 and high nibbles 16..31, each minus 8.  The 16 bytes are
 * 4 lanes; lanes 4..7 repeat them shifted by 4 (the high nibbles), so
 * nibble k of lane l is element 4l+k (l < 4) or 16+4(l-4)+k (l >= 4). */
VRAMD_CLONES static void rows_q4_0(const vramd_hostmv_job *j, const float *x, uint32_t r0, uint32_t r1) {
    const uint32_t cols = j->cols, nb = cols / 32;
    for (uint32_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)j->w + (size_t)r * nb * 18;
        for (uint32_t v = 0; v < j->n; v++) {
            const float *xb = x + (size_t)v * cols;
            v8f acc = {0};
            for (uint32_t b = 0; b < nb; b++, xb += 32) {
                const uint8_t *blk = row + (size_t)b * 18;
                union { v8u v; v4u h[2]; } q;
                memcpy(&q.h[0], blk + 2, 16);
                q.h[1] = q.h[0] >> 4;
                v8f t = {0};
                for (int k = 0; k < 4; k++)
                    t += __builtin_convertvector((v8i)((q.v >> (8 * k)) & 0xf) - 8, v8f) * load8f(xb + 8 * k);
                acc += half_to_float(load16(blk)) * t;
            }
            j->y[(size_t)v * j->rows + r] = hsum(acc);
        }
    }
}

/* MXFP4 (gpt-oss's experts): 17-byte blocks, an E8M0 scale byte then Q4_0's
 * nibble layout (so Q4_0's permutation of x), each nibble an E2M1 value kept
 * doubled as a small integer (ggml's kvalues_mxfp4), the scale 2^(e - 128)
 * (half of 2^(e - 127), undoing the doubling; e < 2 a denormal). */
static float mxfp4_scale(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, 4);
    return d;
}

VRAMD_CLONES static void rows_mxfp4(const vramd_hostmv_job *j, const float *x, uint32_t r0, uint32_t r1) {
    static const float kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const uint32_t cols = j->cols, nb = cols / 32;
    for (uint32_t r = r0; r < r1; r++) {
        const uint8_t *row = (const uint8_t *)j->w + (size_t)r * nb * 17;
        for (uint32_t v = 0; v < j->n; v++) {
            const float *xb = x + (size_t)v * cols;
            v8f acc = {0};
            for (uint32_t b = 0; b < nb; b++, xb += 32) {
                const uint8_t *blk = row + (size_t)b * 17;
                v8f t = {0};
                for (int k = 0; k < 4; k++) {  /* nibble k of lane l: element 4l+k (l < 4), 16+4(l-4)+k */
                    v8f wv;
                    for (int l = 0; l < 4; l++) {
                        uint8_t q = blk[1 + 4 * l + k];
                        wv[l] = kv[q & 15];
                        wv[l + 4] = kv[q >> 4];
                    }
                    t += wv * load8f(xb + 8 * k);
                }
                acc += mxfp4_scale(blk[0]) * t;
            }
            j->y[(size_t)v * j->rows + r] = hsum(acc);
        }
    }
}

/* -- types ---------------------------------------------------------------- */

uint64_t vramd_hostmv_row_bytes(uint32_t type, uint32_t cols) {
    switch (type) {
    case VRAMD_HOSTMV_F32: return (uint64_t)cols * 4;
    case VRAMD_HOSTMV_F16:
    case VRAMD_HOSTMV_BF16: return (uint64_t)cols * 2;
    case VRAMD_HOSTMV_Q8_0: return cols % 32 ? 0 : (uint64_t)cols / 32 * 34;
    case VRAMD_HOSTMV_Q4_0: return cols % 32 ? 0 : (uint64_t)cols / 32 * 18;
    case VRAMD_HOSTMV_MXFP4: return cols % 32 ? 0 : (uint64_t)cols / 32 * 17;
    default: return 0;
    }
}

/* How a type wants x permuted (jobs of one permutation share a permuted x). */
enum { PERM_NONE, PERM_PAIRS, PERM_Q8_0, PERM_Q4_0 };

static int perm_of(uint32_t type) {
    switch (type) {
    case VRAMD_HOSTMV_F16:
    case VRAMD_HOSTMV_BF16: return PERM_PAIRS;
    case VRAMD_HOSTMV_Q8_0: return PERM_Q8_0;
    case VRAMD_HOSTMV_Q4_0:
    case VRAMD_HOSTMV_MXFP4: return PERM_Q4_0;  /* the same nibble layout */
    default: return PERM_NONE;
    }
}

/* x'[i] = x[src(i)] within each group; see the kernels for why. */
static uint32_t perm_src(int perm, uint32_t i) {
    uint32_t k = i / 8, l = i % 8;
    switch (perm) {
    case PERM_PAIRS: return 2 * l + k;
    case PERM_Q8_0: return 4 * l + k;
    default: return l < 4 ? 4 * l + k : 16 + 4 * (l - 4) + k;
    }
}

/* Permutes n vectors of cols floats; a tail shorter than a group stays as it is. */
static void permute(int perm, const float *x, float *out, uint32_t cols, uint32_t n) {
    const uint32_t group = perm == PERM_PAIRS ? 16 : 32, body = cols / group * group;
    uint32_t src[32];
    for (uint32_t i = 0; i < group; i++) src[i] = perm_src(perm, i);
    for (uint32_t v = 0; v < n; v++, x += cols, out += cols) {
        for (uint32_t g = 0; g < body; g += group)
            for (uint32_t i = 0; i < group; i++) out[g + i] = x[g + src[i]];
        memcpy(out + body, x + body, (size_t)(cols - body) * sizeof *x);
    }
}

typedef void (*rows_fn)(const vramd_hostmv_job *, const float *, uint32_t, uint32_t);

static rows_fn kernel_of(uint32_t type) {
    switch (type) {
    case VRAMD_HOSTMV_F32: return rows_f32;
    case VRAMD_HOSTMV_F16: return rows_f16;
    case VRAMD_HOSTMV_BF16: return rows_bf16;
    case VRAMD_HOSTMV_Q8_0: return rows_q8_0;
    case VRAMD_HOSTMV_MXFP4: return rows_mxfp4;
    default: return rows_q4_0;
    }
}

/* -- one call's work ------------------------------------------------------ */

typedef struct {
    const vramd_hostmv_job *jobs;
    const float **xs;       /* per job: the x its kernel reads (a permuted copy, or the job's own) */
    uint64_t *first;        /* per job: its first chunk; first[n_jobs]: the number of chunks */
    uint32_t *step;         /* per job: rows per chunk */
    uint32_t n_jobs;
    uint64_t next;          /* the next chunk to take; every thread takes from here */
} work;

/* Takes chunks until none is left.  The chunks a thread gets only grow, so
 * its job index only moves forward. */
static void run_chunks(work *w) {
    uint32_t j = 0;
    for (;;) {
        uint64_t c = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (c >= w->first[w->n_jobs]) return;
        while (w->first[j + 1] <= c) j++;
        const vramd_hostmv_job *job = &w->jobs[j];
        uint32_t r0 = (uint32_t)(c - w->first[j]) * w->step[j];
        uint32_t r1 = job->rows - r0 < w->step[j] ? job->rows : r0 + w->step[j];
        kernel_of(job->type)(job, w->xs[j], r0, r1);
    }
}

/* -- the pool ------------------------------------------------------------- */

static struct {
    pthread_mutex_t call;   /* held through a whole call (and a resize): one user at a time */
    pthread_mutex_t lock;   /* guards the fields below up to the scratch */
    pthread_cond_t wake;    /* workers wait here for a new generation */
    pthread_cond_t idle;    /* the caller waits here for the workers to leave its work */
    uint64_t generation;    /* bumped per call that wakes the workers */
    work *current;          /* the call's work; NULL between calls */
    uint32_t inside;        /* workers running chunks of `current` */
    int stopping;
    uint32_t size;          /* threads a call runs on, the caller included; 0: not started */
    uint32_t n_workers;
    pthread_t workers[VRAMD_HOSTMV_MAX_THREADS];
    /* Per-call scratch, grown as needed and kept (under `call`). */
    void *scratch;
    size_t scratch_bytes;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
           .idle = PTHREAD_COND_INITIALIZER};

static void *worker_main(void *arg) {
    uint64_t seen = (uint64_t)(uintptr_t)arg;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        /* A worker that wakes after its call ended finds `current` NULL and
         * waits for the next; it only ever enters work it saw under the lock. */
        while (!pool.stopping && (pool.generation == seen || !pool.current)) pthread_cond_wait(&pool.wake, &pool.lock);
        if (pool.stopping) break;
        seen = pool.generation;
        work *w = pool.current;
        pool.inside++;
        pthread_mutex_unlock(&pool.lock);
        run_chunks(w);
        pthread_mutex_lock(&pool.lock);
        if (--pool.inside == 0) pthread_cond_signal(&pool.idle);
    }
    pthread_mutex_unlock(&pool.lock);
    return NULL;
}

static uint32_t default_threads(void) {
    cpu_set_t set;
    long n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    return n > VRAMD_HOSTMV_DEFAULT_THREADS ? VRAMD_HOSTMV_DEFAULT_THREADS : (uint32_t)n;
}

static void stop_workers(void) {
    pthread_mutex_lock(&pool.lock);
    pool.stopping = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (uint32_t i = 0; i < pool.n_workers; i++) pthread_join(pool.workers[i], NULL);
    pool.n_workers = 0;
    pool.stopping = 0;
    pool.size = 0;
}

/* A forked child has none of the parent's threads, and the fork may have
 * come while another thread held the locks: the child starts from nothing. */
static void after_fork_child(void) {
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.idle, NULL);
    pool.current = NULL;
    pool.inside = 0;
    pool.stopping = 0;
    pool.size = 0;
    pool.n_workers = 0;
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Starts size-1 workers (the caller is the last thread).  A worker that
 * cannot be created leaves a smaller pool, not an error: the work still
 * gets done, by fewer threads. */
static void start_workers(uint32_t size) {
    pthread_once(&fork_once, register_fork);
    /* Workers block every signal: they belong to the thread that called in
     * (Python runs its handlers there; a worker must not take them). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    uint64_t gen = pool.generation;
    while (pool.n_workers + 1 < size &&
           pthread_create(&pool.workers[pool.n_workers], NULL, worker_main, (void *)(uintptr_t)gen) == 0)
        pool.n_workers++;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pool.size = pool.n_workers + 1;
}

int vramd_hostmv_set_threads(uint32_t threads) {
    if (threads > VRAMD_HOSTMV_MAX_THREADS)
        return vramd_fail(VRAMD_ERR_USAGE, "host matvec: %u threads asked, at most %u", threads,
                          (unsigned)VRAMD_HOSTMV_MAX_THREADS);
    pthread_mutex_lock(&pool.call);
    stop_workers();
    start_workers(threads ? threads : default_threads());
    pthread_mutex_unlock(&pool.call);
    return VRAMD_OK;
}

uint32_t vramd_hostmv_threads(void) {
    pthread_mutex_lock(&pool.call);
    if (!pool.size) start_workers(default_threads());
    uint32_t n = pool.size;
    pthread_mutex_unlock(&pool.call);
    return n;
}

/* -- a call --------------------------------------------------------------- */

static int check_job(const vramd_hostmv_job *j, uint32_t i) {
    if (!vramd_hostmv_row_bytes(j->type, 32))
        return vramd_fail(VRAMD_ERR_USAGE, "host matvec job %u: type %u is not one the host matvec reads "
                          "(F32 0, F16 1, Q4_0 2, Q8_0 8, BF16 30, MXFP4 39)", i, j->type);
    if (!j->cols || !vramd_hostmv_row_bytes(j->type, j->cols))
        return vramd_fail(VRAMD_ERR_USAGE, "host matvec job %u: %u columns of type %u (Q8_0, Q4_0 and MXFP4 rows "
                          "are whole blocks of 32)", i, j->cols, j->type);
    if (j->n && j->rows && (!j->w || !j->x || !j->y))
        return vramd_fail(VRAMD_ERR_USAGE, "host matvec job %u: a NULL matrix, input or output", i);
    return VRAMD_OK;
}

/* Lays out the call's scratch: per job its x pointer, first chunk and step,
 * then the permuted copies of x (jobs that read the same x with the same
 * permutation share one: a token's gate and up of every expert read one h). */
static int prepare(work *w, const vramd_hostmv_job *jobs, uint32_t n_jobs) {
    size_t floats = 0, head = (size_t)n_jobs * (sizeof(float *) + sizeof(uint32_t)) +
                              ((size_t)n_jobs + 1) * sizeof(uint64_t);
    head = (head + 63) & ~(size_t)63;
    for (uint32_t i = 0; i < n_jobs; i++) {
        if (perm_of(jobs[i].type) == PERM_NONE) continue;
        size_t more = (size_t)jobs[i].n * jobs[i].cols;
        if (more > (SIZE_MAX - head) / sizeof(float) - floats)
            return vramd_fail(VRAMD_ERR_USAGE, "host matvec: the jobs' inputs overflow the address space");
        floats += more;
    }
    size_t need = head + floats * sizeof(float);
    if (need > pool.scratch_bytes) {
        void *p = NULL;
        if (posix_memalign(&p, 64, need)) return vramd_fail(VRAMD_ERR_DEVICE, "host matvec: out of host memory "
                                                            "(%zu bytes of scratch)", need);
        free(pool.scratch);
        pool.scratch = p;
        pool.scratch_bytes = need;
    }
    char *s = pool.scratch;
    w->first = (uint64_t *)s;
    w->xs = (const float **)(s + ((size_t)n_jobs + 1) * sizeof(uint64_t));
    w->step = (uint32_t *)(w->xs + n_jobs);
    float *xbuf = (float *)(s + head);
    w->jobs = jobs;
    w->n_jobs = n_jobs;
    w->next = 0;
    uint64_t chunks = 0;
    for (uint32_t i = 0; i < n_jobs; i++) {
        const vramd_hostmv_job *j = &jobs[i];
        /* A row costs its bytes once per vector (each vector converts it again). */
        uint64_t step = CHUNK_BYTES / vramd_hostmv_row_bytes(j->type, j->cols) / (j->n ? j->n : 1);
        if (!step) step = 1;
        if (step >= 16) step &= ~(uint64_t)15;   /* chunks' outputs on their own cache lines */
        if (step > j->rows) step = j->rows ? j->rows : 1;
        w->step[i] = (uint32_t)step;
        w->first[i] = chunks;
        chunks += j->n ? (j->rows + step - 1) / step : 0;
        w->xs[i] = j->x;
        int perm = perm_of(j->type);
        if (perm == PERM_NONE || !j->n || !j->rows) continue;
        /* A recent job with the same x read the same way: share its copy. */
        uint32_t back = i < 64 ? i : 64, k;
        for (k = 1; k <= back; k++) {
            const vramd_hostmv_job *o = &jobs[i - k];
            if (o->x == j->x && perm_of(o->type) == perm && o->cols == j->cols && o->n == j->n && o->rows) break;
        }
        if (k <= back) {
            w->xs[i] = w->xs[i - k];
            continue;
        }
        permute(perm, j->x, xbuf, j->cols, j->n);
        w->xs[i] = xbuf;
        xbuf += (size_t)j->n * j->cols;
    }
    w->first[n_jobs] = chunks;
    return VRAMD_OK;
}

int vramd_hostmv(const vramd_hostmv_job *jobs, uint32_t n_jobs) {
    if (n_jobs && !jobs) return vramd_fail(VRAMD_ERR_USAGE, "host matvec: %u jobs at NULL", n_jobs);
    for (uint32_t i = 0; i < n_jobs; i++) {
        int rc = check_job(&jobs[i], i);
        if (rc) return rc;
    }
    pthread_mutex_lock(&pool.call);
    if (!pool.size) start_workers(default_threads());
    work w;
    int rc = prepare(&w, jobs, n_jobs);
    if (rc) {
        pthread_mutex_unlock(&pool.call);
        return rc;
    }
    /* Work of a chunk or two is not worth waking anyone. */
    int wake = pool.n_workers && w.first[n_jobs] > 1;
    if (wake) {
        pthread_mutex_lock(&pool.lock);
        pool.current = &w;
        pool.generation++;
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.lock);
    }
    run_chunks(&w);
    if (wake) {
        /* Every chunk is taken; wait for the workers still running one. */
        pthread_mutex_lock(&pool.lock);
        while (pool.inside) pthread_cond_wait(&pool.idle, &pool.lock);
        pool.current = NULL;
        pthread_mutex_unlock(&pool.lock);
    }
    pthread_mutex_unlock(&pool.call);
    return VRAMD_OK;
}
