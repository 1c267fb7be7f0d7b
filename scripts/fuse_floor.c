/* The least a FUSE daemon can do: libfuse's low-level API, one thread, one file "f" in the
 * root, answered from constants. scripts/bench_floor.py times a request through it to find
 * what the kernel's FUSE round trip itself costs on this machine (no Python, no metadata).
 *
 *     fuse_floor MOUNTPOINT [POLL_US]   (stays in the foreground; fusermount3 -u ends it)
 *
 * With POLL_US > 0, the daemon polls its non-blocking /dev/fuse descriptor that long after
 * each request before it sleeps in poll(): the round trip of a daemon that never sleeps.
 */
#define FUSE_USE_VERSION 317
#include <errno.h>
#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

static const double FOREVER = 86400.0;

static void attributes(fuse_ino_t ino, struct stat *st)
{
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_mode = ino == FUSE_ROOT_ID ? S_IFDIR | 0755 : S_IFREG | 0644;
    st->st_nlink = 1;
}

static void floor_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param entry;

    if (parent != FUSE_ROOT_ID || strcmp(name, "f") != 0) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    memset(&entry, 0, sizeof entry);
    entry.ino = 2;
    entry.attr_timeout = entry.entry_timeout = FOREVER;
    attributes(entry.ino, &entry.attr);
    fuse_reply_entry(req, &entry);
}

static void floor_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;

    (void)fi;
    attributes(ino, &st);
    fuse_reply_attr(req, &st, FOREVER);
}

static long monotonic_ns(void)
{
    struct timespec now;

    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000000000L + now.tv_nsec;
}

/* fuse_session_loop, but polling the descriptor for poll_ns before each sleep. */
static int polling_loop(struct fuse_session *session, long poll_ns)
{
    struct fuse_buf buf = {0};
    int fd = fuse_session_fd(session);
    int res = 0;

    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    while (!fuse_session_exited(session)) {
        long until = monotonic_ns() + poll_ns;

        while ((res = fuse_session_receive_buf(session, &buf)) == -EAGAIN &&
               monotonic_ns() < until)
            ;
        if (res == -EAGAIN) {
            struct pollfd readable = {fd, POLLIN, 0};

            poll(&readable, 1, -1);
            continue;
        }
        if (res == -EINTR)
            continue;
        if (res <= 0)
            break;
        fuse_session_process_buf(session, &buf);
    }
    free(buf.mem);
    return res < 0 ? res : 0;
}

static const struct fuse_lowlevel_ops operations = {
    .lookup = floor_lookup,
    .getattr = floor_getattr,
};

int main(int argc, char *argv[])
{
    char *options[] = {argv[0], "-o", "fsname=fuse-floor", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, options);
    struct fuse_session *session;
    long poll_us;
    int failed;

    if (argc != 2 && argc != 3)
        return 2;
    session = fuse_session_new(&args, &operations, sizeof operations, NULL);
    if (session == NULL || fuse_session_mount(session, argv[1]) != 0)
        return 1;
    poll_us = argc == 3 ? atol(argv[2]) : 0;
    failed = poll_us > 0 ? polling_loop(session, poll_us * 1000) : fuse_session_loop(session);
    fuse_session_unmount(session);
    fuse_session_destroy(session);
    return failed ? 1 : 0;
}
