/* A FUSE daemon that answers LOOKUP of names in its root, for scripts/bench_uring.py: what
 * FUSE over io_uring would give kvfs. libfuse >= 3.18's low-level API, built by that script.
 *
 *     fuse_ring_floor MOUNTPOINT [--io-uring] [--python MODULE SPEC]
 *
 * --io-uring: ask for FUSE over io_uring (the kernel's fuse.enable_uring must be on). libfuse
 *   then serves requests on one thread per CPU, pinned, and the kernel queues each request
 *   on the queue of the CPU its caller runs on: the request is served where the caller
 *   waits, with no wake-up of another CPU. Without it, one thread reads /dev/fuse.
 * --python: LOOKUP calls MODULE.lookup(parent, name) -> (ino, mode, size) or None, with the
 *   GIL, on whatever thread serves it, after MODULE.setup(SPEC) (scripts/ring_lookup.py).
 *   Without it, "f" in the root is answered from constants.
 * The first LOOKUP logs to stderr whether it came through io_uring (bench_uring.py checks).
 */
#define FUSE_USE_VERSION 318
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fuse_lowlevel.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

static const double FOREVER = 86400.0;
static bool want_uring;
static PyObject *python_lookup;  /* NULL: constants */
static atomic_bool told;

static void attributes(fuse_ino_t ino, mode_t mode, off_t size, struct stat *st)
{
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_mode = mode;
    st->st_nlink = 1;
    st->st_size = size;
}

static void ring_init(void *userdata, struct fuse_conn_info *conn)
{
    (void)userdata;
    if (want_uring && !fuse_set_feature_flag(conn, FUSE_CAP_OVER_IO_URING))
        fprintf(stderr, "fuse_ring_floor: the kernel does not offer io_uring\n");
}

/* This thread's Python thread state, made at its first request and kept: a thread state
 * made and dropped per request (PyGILState_Ensure/Release) costs more than the request. */
static __thread PyThreadState *thread_state;

static void take_gil(void)
{
    if (thread_state == NULL) {
        PyGILState_Ensure();  /* never released: the state stays this thread's */
        thread_state = PyThreadState_Get();
    } else {
        PyEval_RestoreThread(thread_state);
    }
}

/* Whether `name` in `parent` exists, and its entry, from Python. */
static bool python_entry(fuse_ino_t parent, const char *name, struct fuse_entry_param *entry)
{
    unsigned long long ino = 0, mode = 0, size = 0;
    PyObject *found;

    take_gil();
    found = PyObject_CallFunction(python_lookup, "Ky", (unsigned long long)parent,
                                            name);

    if (found == NULL)
        PyErr_Print();
    else if (found != Py_None && !PyArg_ParseTuple(found, "KKK", &ino, &mode, &size))
        PyErr_Print();
    Py_XDECREF(found);
    PyEval_SaveThread();
    attributes(ino, mode, size, &entry->attr);
    entry->ino = ino;
    return ino != 0;
}

static void ring_lookup(fuse_req_t req, fuse_ino_t parent, const char *name)
{
    struct fuse_entry_param entry;
    bool found;

    if (!atomic_exchange(&told, true))
        fprintf(stderr, "fuse_ring_floor: io_uring %s\n", fuse_req_is_uring(req) ? "on" : "off");
    memset(&entry, 0, sizeof entry);
    if (python_lookup != NULL) {
        found = python_entry(parent, name, &entry);
    } else {
        found = parent == FUSE_ROOT_ID && strcmp(name, "f") == 0;
        entry.ino = 2;
        attributes(entry.ino, S_IFREG | 0644, 0, &entry.attr);
    }
    if (!found) {
        fuse_reply_err(req, ENOENT);
        return;
    }
    entry.attr_timeout = entry.entry_timeout = FOREVER;
    fuse_reply_entry(req, &entry);
}

static void ring_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi)
{
    struct stat st;

    (void)fi;
    attributes(ino, ino == FUSE_ROOT_ID ? S_IFDIR | 0755 : S_IFREG | 0644, 0, &st);
    fuse_reply_attr(req, &st, FOREVER);
}

static const struct fuse_lowlevel_ops operations = {
    .init = ring_init,
    .lookup = ring_lookup,
    .getattr = ring_getattr,
};

/* MODULE.setup(SPEC); MODULE.lookup then answers. The GIL is released on return. */
static int start_python(const char *module_name, const char *spec)
{
    PyObject *module, *result;

    Py_Initialize();
    module = PyImport_ImportModule(module_name);
    result = module ? PyObject_CallMethod(module, "setup", "s", spec) : NULL;
    python_lookup = result ? PyObject_GetAttrString(module, "lookup") : NULL;
    if (python_lookup == NULL) {
        PyErr_Print();
        return -1;
    }
    Py_DECREF(result);
    PyEval_SaveThread();
    return 0;
}

int main(int argc, char *argv[])
{
    char *options[] = {argv[0], "-o", "fsname=fuse-ring-floor", "-o", "io_uring", NULL};
    struct fuse_args args;
    struct fuse_session *session;
    int failed;

    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--io-uring") == 0) {
            want_uring = true;
        } else if (strcmp(argv[i], "--python") == 0 && i + 2 < argc) {
            if (start_python(argv[i + 1], argv[i + 2]) != 0)
                return 1;
            i += 2;
        } else {
            fprintf(stderr, "usage: %s MOUNTPOINT [--io-uring] [--python MODULE SPEC]\n",
                    argv[0]);
            return 2;
        }
    }
    if (argc < 2)
        return 2;
    args = (struct fuse_args)FUSE_ARGS_INIT(want_uring ? 5 : 3, options);
    session = fuse_session_new(&args, &operations, sizeof operations, NULL);
    if (session == NULL || fuse_session_mount(session, argv[1]) != 0)
        return 1;
    failed = fuse_session_loop(session);
    fuse_session_unmount(session);
    fuse_session_destroy(session);
    return failed ? 1 : 0;
}
