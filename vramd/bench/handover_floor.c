/* The floor for `vramd bench handover`: the same hand-over in C, nothing else.
 *
 * Two of these ping-pong the token of one arena.  A request is: ring
 * doorbell/<pid>, block in flock(LOCK_EX); a serve is: wait for a foreign
 * ring with inotify, flock(LOCK_UN).  The one started with `first` serves
 * first; each does ROUNDS requests, timed from the ring to the lock, and
 * prints them in nanoseconds, one per line.  Between its serve and its next
 * request a process sleeps GAP_US, so the partner is settled in its serve
 * when the ring comes (the vramd side does the same).
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
#include <time.h>
#include <unistd.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int foreign_ring(int ifd, const char *self) {
    char buf[16384] __attribute__((aligned(__alignof__(struct inotify_event))));
    int found = 0;
    ssize_t n;
    while ((n = read(ifd, buf, sizeof buf)) > 0) {
        for (char *p = buf; p < buf + n;) {
            struct inotify_event *ev = (struct inotify_event *)p;
            if (ev->len > 0 && strcmp(ev->name, self) != 0)
                found = 1;
            p += sizeof(struct inotify_event) + ev->len;
        }
    }
    return found;
}

static void serve(int ifd, int lock_fd, const char *self) {
    struct pollfd pfd = {ifd, POLLIN, 0};
    while (!foreign_ring(ifd, self))
        poll(&pfd, 1, -1);
    flock(lock_fd, LOCK_UN);
}

static long long request(int lock_fd, const char *ring_path) {
    long long t0 = now_ns();
    int fd = open(ring_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd >= 0) {
        if (write(fd, "1", 1) < 0) {}
        close(fd);
    }
    while (flock(lock_fd, LOCK_EX) != 0 && errno == EINTR) {}
    return now_ns() - t0;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s ARENA ROUNDS first|second GAP_US\n", argv[0]);
        return 2;
    }
    const char *arena = argv[1];
    int rounds = atoi(argv[2]);
    int first = strcmp(argv[3], "first") == 0;
    useconds_t gap = (useconds_t)atoi(argv[4]);
    char token[4096], doorbell[4096], ring_path[4200], self[32];
    snprintf(token, sizeof token, "%s/token.lock", arena);
    snprintf(doorbell, sizeof doorbell, "%s/doorbell", arena);
    snprintf(self, sizeof self, "%d", (int)getpid());
    snprintf(ring_path, sizeof ring_path, "%s/%s", doorbell, self);

    int lock_fd = open(token, O_RDONLY | O_CLOEXEC);
    int ifd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (lock_fd < 0 || ifd < 0 || inotify_add_watch(ifd, doorbell, IN_CLOSE_WRITE) < 0) {
        perror("handover_floor");
        return 1;
    }
    long long *lat = calloc((size_t)rounds, sizeof *lat);
    if (first)
        flock(lock_fd, LOCK_EX);
    printf("ready\n");
    fflush(stdout);
    for (int i = 0; i < rounds; i++) {
        if (first) {
            serve(ifd, lock_fd, self);
            usleep(gap);
            lat[i] = request(lock_fd, ring_path);
        } else {
            lat[i] = request(lock_fd, ring_path);
            serve(ifd, lock_fd, self);
            usleep(gap);
        }
    }
    if (first)
        flock(lock_fd, LOCK_UN);
    for (int i = 0; i < rounds; i++)
        printf("%lld\n", lat[i]);
    unlink(ring_path);
    return 0;
}
