/* The least a FUSE daemon can do: libfuse's low-level API, one thread, one file "f" in the
 * root, answered from constants. scripts/bench_floor.py times a request through it to find
 * what the kernel's FUSE round trip itself costs on this machine (no Python, no metadata).
 *
 *     fuse_floor MOUNTPOINT      (stays in the foreground; fusermount3 -u ends it)
 */
#define FUSE_USE_VERSION 317
#include <errno.h>
#include <fuse_lowlevel.h>
#include <string.h>
#include <sys/stat.h>

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

static const struct fuse_lowlevel_ops operations = {
    .lookup = floor_lookup,
    .getattr = floor_getattr,
};

int main(int argc, char *argv[])
{
    char *options[] = {argv[0], "-o", "fsname=fuse-floor", NULL};
    struct fuse_args args = FUSE_ARGS_INIT(3, options);
    struct fuse_session *session;
    int failed;

    if (argc != 2)
        return 2;
    session = fuse_session_new(&args, &operations, sizeof operations, NULL);
    if (session == NULL || fuse_session_mount(session, argv[1]) != 0)
        return 1;
    failed = fuse_session_loop(session);
    fuse_session_unmount(session);
    fuse_session_destroy(session);
    return failed ? 1 : 0;
}
