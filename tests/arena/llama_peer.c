/* A peer that speaks only the llama.cpp VRAM-arbiter conventions (flock + doorbell).
 *
 * It is what a llama-server started with LLAMA_SLEEP_VRAM_ONLY does, and no
 * more: no tickets, no member record.  Tests drive it over stdin:
 *
 *   warm   ring doorbell/<pid>, block in flock(LOCK_EX); print "warm <t>"
 *   serve  block until a ring from another pid arrives, then LOCK_UN; print "cold <t>"
 *   exit   leave
 *
 * Like llama.cpp's warden, rings that arrive while it is cold are dropped:
 * a peer that wants the token from it must ring while it holds it.
 * <t> is CLOCK_MONOTONIC in seconds, the clock Python's time.monotonic() reads.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void ring(const char *doorbell, const char *pid) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", doorbell, pid);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (fd >= 0) {
        ssize_t w = write(fd, "1", 1);
        (void)w;
        close(fd);
    }
}

/* Read what inotify has; return 1 if a ring from another pid is among it. */
static int foreign_ring(int ifd, const char *pid) {
    char buf[65536] __attribute__((aligned(__alignof__(struct inotify_event))));
    int found = 0;
    for (;;) {
        ssize_t n = read(ifd, buf, sizeof buf);
        if (n <= 0)
            return found;
        for (char *p = buf; p < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)p;
            if (ev->len > 0 && strcmp(ev->name, pid) != 0)
                found = 1;
            p += sizeof(struct inotify_event) + ev->len;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s ARENA\n", argv[0]);
        return 2;
    }
    char token[4096], doorbell[4096], pid[32];
    snprintf(token, sizeof token, "%s/token.lock", argv[1]);
    snprintf(doorbell, sizeof doorbell, "%s/doorbell", argv[1]);
    snprintf(pid, sizeof pid, "%d", (int)getpid());
    mkdir(argv[1], 0777);
    mkdir(doorbell, 0777);
    int lock_fd = open(token, O_RDWR | O_CREAT, 0666);
    int ifd = inotify_init1(IN_NONBLOCK);
    if (lock_fd < 0 || ifd < 0 || inotify_add_watch(ifd, doorbell, IN_CLOSE_WRITE) < 0) {
        perror("llama_peer");
        return 1;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready %s\n", pid);

    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "warm", 4) == 0) {
            ring(doorbell, pid);
            while (flock(lock_fd, LOCK_EX) != 0 && errno == EINTR) {}
            foreign_ring(ifd, pid); /* drop rings heard while cold, as llama.cpp does */
            printf("warm %.6f\n", now());
        } else if (strncmp(line, "serve", 5) == 0) {
            for (;;) {
                struct pollfd pfd = {ifd, POLLIN, 0};
                if (poll(&pfd, 1, -1) > 0 && foreign_ring(ifd, pid))
                    break;
            }
            flock(lock_fd, LOCK_UN);
            printf("cold %.6f\n", now());
        } else if (strncmp(line, "exit", 4) == 0) {
            break;
        }
    }
    return 0;
}
