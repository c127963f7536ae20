/* Failpoints: named places in the release and restore paths where a test
 * can make the process die (SIGKILL) or the call fail, to prove that every
 * step leaves the model consistent.  vramd/failpoints.py parses
 * $VRAMD_FAILPOINTS once and arms the native ones here; the names are the
 * same on both sides of the Python/C boundary.
 *
 * Unarmed (production), a failpoint is one load of a global and a branch
 * predicted not taken (VRAMD_FAILPOINT in internal.h). */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

typedef struct {
    const char *name;
    int action;         /* VRAMD_FP_* */
    uint32_t at;        /* act on this hit (1: the first); LOG acts on every hit */
    uint32_t hits;
} failpoint;

static failpoint points[VRAMD_FP_COUNT] = {
    [VRAMD_FP_RESTORE_MID] = {"restore.mid"},
    [VRAMD_FP_EVICT_MID] = {"evict.mid"},
    [VRAMD_FP_EVICT_COPIED] = {"evict.copied"},
    [VRAMD_FP_RELEASE_MID] = {"release.mid"},
};

int vramd_fp_armed;

const char *vramd_failpoint_name(uint32_t index) {
    return index < VRAMD_FP_COUNT ? points[index].name : NULL;
}

int vramd_failpoint_arm(const char *name, int action, uint32_t at) {
    if (action < VRAMD_FP_OFF || action > VRAMD_FP_LOG)
        return vramd_fail(VRAMD_ERR_USAGE, "failpoint %s: unknown action %d", name ? name : "?", action);
    for (int i = 0; i < VRAMD_FP_COUNT; i++) {
        if (!name || strcmp(points[i].name, name)) continue;
        __atomic_store_n(&points[i].hits, 0, __ATOMIC_RELAXED);
        points[i].at = at ? at : 1;
        __atomic_store_n(&points[i].action, action, __ATOMIC_RELEASE);
        int any = 0;
        for (int j = 0; j < VRAMD_FP_COUNT; j++) any |= points[j].action != VRAMD_FP_OFF;
        __atomic_store_n(&vramd_fp_armed, any, __ATOMIC_RELEASE);
        return VRAMD_OK;
    }
    return vramd_fail(VRAMD_ERR_USAGE, "no native failpoint named '%s'", name ? name : "");
}

int vramd_failpoint_hit(int id) {
    failpoint *f = &points[id];
    int action = __atomic_load_n(&f->action, __ATOMIC_ACQUIRE);
    if (action == VRAMD_FP_OFF) return VRAMD_OK;
    uint32_t n = __atomic_add_fetch(&f->hits, 1, __ATOMIC_RELAXED);
    if (action == VRAMD_FP_LOG) {
        fprintf(stderr, "vramd: failpoint %s reached\n", f->name);
        return VRAMD_OK;
    }
    if (n != f->at) return VRAMD_OK;
    if (action == VRAMD_FP_KILL) {
        fprintf(stderr, "vramd: failpoint %s: SIGKILL\n", f->name);
        fflush(stderr);
        kill(getpid(), SIGKILL);
        pause(); /* SIGKILL is delivered before kill() returns to user space, in practice */
    }
    fprintf(stderr, "vramd: failpoint %s: injected fault\n", f->name);
    return vramd_fail(VRAMD_ERR_DEVICE, "failpoint %s: injected fault", f->name);
}
