/* cubinstore._core._native: a first load's two hot steps in C, optional (cubinstore/_core/native.py).

   A first load is a read and check of a store entry, then three or four driver calls. Made from
   Python, each of those is a chain of calls that costs as much as the work (issue 31: about 25 us
   over a raw load, against a 5 us goal). Here each step is one call. Neither function decides
   anything: the rules (flags, the ownership rule, the record's bytes, what a missing entry point
   means) come from the Python callers, and any case but the plain success returns a code that
   sends the caller down its Python path, which words the error, quarantines, records or fetches.

   read_entry(dir_fd, name, size, flags, touch_after, vouch) -> bytes | int
       Open `name` (one path component) below `dir_fd` with `flags`, fstat, read exactly `size` bytes of a regular file
       of that size (and bump its mtime where older than `touch_after` seconds: gc's clock).
       vouch None: the bytes, unchecked (the caller hashes them).
       vouch (xattr name, record head, xxh3, owner a, owner b, forbidden mode bits): the bytes
       only if the entry is owned by owner a or b, has none of the forbidden mode bits, and its
       xattr equals head + xxh3(bytes) (xxh3: a Python callable returning bytes).
       Else 0 when the name does not exist, 1 for anything else (the caller's Python path decides).

   load_functions(data, entries, context, not_found) -> (library, [function | None, ...]) | int
       With `context` (a CUcontext handle) current, cuLibraryLoadData(data) and each entry's
       function (cuLibraryGetKernel, cuKernelGetFunction); the list ends at the first entry the
       library lacks (cuLibraryGetKernel returns `not_found`) with a None. The previous context is
       current again after. On any other failure the library is unloaded and the CUresult returned;
       -1 when libcuda is not loaded in this process (the caller's bindings load it). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

enum { MISSING = 0, OTHER = 1 };

static int read_all(int fd, char *buf, Py_ssize_t size) {
    Py_ssize_t got = 0;
    while (got < size) {
        ssize_t n = read(fd, buf + got, (size_t)(size - got));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1; /* an error, or shorter than fstat said: the caller's path decides */
        got += n;
    }
    return 0;
}

/* The open entry's stat passes: a regular file of `size` bytes, and where the caller vouches by
   owner, one of the two owners and none of the forbidden mode bits. */
static int entry_ok(const struct stat *st, Py_ssize_t size, int owned, unsigned long owner_a, unsigned long owner_b,
                    unsigned long forbidden) {
    if (!S_ISREG(st->st_mode) || st->st_size != size) return 0;
    return !owned || ((st->st_uid == owner_a || st->st_uid == owner_b) && !(st->st_mode & forbidden));
}

static PyObject *read_entry(PyObject *self, PyObject *args) {
    int dir_fd, flags;
    const char *name;
    Py_ssize_t size;
    double touch_after;
    PyObject *vouch;
    if (!PyArg_ParseTuple(args, "isnidO", &dir_fd, &name, &size, &flags, &touch_after, &vouch)) return NULL;
    if (size <= 0 || strchr(name, '/') != NULL) return PyLong_FromLong(OTHER); /* one name below dir_fd, no path */

    const char *xattr_name = NULL;
    Py_buffer head = {0};
    PyObject *xxh3 = NULL;
    unsigned long owner_a = 0, owner_b = 0, forbidden = 0;
    if (vouch != Py_None
            && !PyArg_ParseTuple(vouch, "sy*Okkk", &xattr_name, &head, &xxh3, &owner_a, &owner_b, &forbidden))
        return NULL;
    const int vouching = xattr_name != NULL;

    /* Open and stat first: nothing is allocated for a name that is missing or not the file asked for. */
    struct stat st;
    int fd, outcome = -1;
    Py_BEGIN_ALLOW_THREADS
    fd = openat(dir_fd, name, flags);
    if (fd < 0) {
        outcome = errno == ENOENT ? MISSING : OTHER;
    } else if (fstat(fd, &st) != 0 || !entry_ok(&st, size, vouching, owner_a, owner_b, forbidden)) {
        close(fd);
        outcome = OTHER;
    }
    Py_END_ALLOW_THREADS
    PyObject *data = outcome < 0 ? PyBytes_FromStringAndSize(NULL, size) : NULL;
    if (data == NULL) {
        if (fd >= 0 && outcome < 0) close(fd); /* the allocation failed */
        PyBuffer_Release(&head);
        return outcome < 0 ? NULL : PyLong_FromLong(outcome);
    }

    unsigned char record[256]; /* the record: the head, then a digest of at most 64 bytes */
    ssize_t record_len = -1;
    Py_BEGIN_ALLOW_THREADS
    if (read_all(fd, PyBytes_AS_STRING(data), size) != 0) {
        outcome = OTHER;
    } else {
        if (vouching) record_len = fgetxattr(fd, xattr_name, record, sizeof record);
        if (vouching && record_len <= head.len) {
            outcome = OTHER; /* none, unreadable, or too short to hold the head and a digest */
        } else {
            struct timespec now;
            if (clock_gettime(CLOCK_REALTIME, &now) == 0 && (double)(now.tv_sec - st.st_mtime) >= touch_after)
                (void)futimens(fd, NULL); /* gc's clock, best effort: a read-only store still serves reads */
        }
    }
    close(fd);
    Py_END_ALLOW_THREADS

    int vouched = outcome < 0 && (!vouching || memcmp(record, head.buf, (size_t)head.len) == 0);
    const Py_ssize_t head_len = head.len;
    PyBuffer_Release(&head);
    if (vouched && vouching) {
        PyObject *digest = PyObject_CallOneArg(xxh3, data);
        if (digest == NULL) {
            Py_DECREF(data);
            return NULL;
        }
        vouched = PyBytes_Check(digest) && PyBytes_GET_SIZE(digest) == record_len - head_len
                  && memcmp(PyBytes_AS_STRING(digest), record + head_len, (size_t)(record_len - head_len)) == 0;
        Py_DECREF(digest);
    }
    if (!vouched) {
        Py_DECREF(data);
        return PyLong_FromLong(OTHER);
    }
    return data;
}

typedef int CUresult;
typedef void *CUlibrary, *CUkernel, *CUfunction, *CUcontext;
static CUresult (*cu_library_load_data)(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned);
static CUresult (*cu_library_unload)(CUlibrary);
static CUresult (*cu_library_get_kernel)(CUkernel *, CUlibrary, const char *);
static CUresult (*cu_kernel_get_function)(CUfunction *, CUkernel);
static CUresult (*cu_ctx_get_current)(CUcontext *);
static CUresult (*cu_ctx_set_current)(CUcontext);

/* The libcuda the caller's bindings loaded (RTLD_NOLOAD: never a second driver library). Called with the GIL held. */
static int bind_driver(void) {
    if (cu_ctx_set_current != NULL) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) return -1;
    cu_library_load_data = dlsym(lib, "cuLibraryLoadData");
    cu_library_unload = dlsym(lib, "cuLibraryUnload");
    cu_library_get_kernel = dlsym(lib, "cuLibraryGetKernel");
    cu_kernel_get_function = dlsym(lib, "cuKernelGetFunction");
    cu_ctx_get_current = dlsym(lib, "cuCtxGetCurrent");
    CUresult (*set)(CUcontext) = dlsym(lib, "cuCtxSetCurrent");
    if (!cu_library_load_data || !cu_library_unload || !cu_library_get_kernel || !cu_kernel_get_function
            || !cu_ctx_get_current || !set)
        return -1;
    cu_ctx_set_current = set; /* last: it marks the table complete */
    return 0;
}

#define MAX_ENTRIES 64

static PyObject *load_functions(PyObject *self, PyObject *args) {
    Py_buffer data;
    PyObject *entries;
    unsigned long long context;
    int not_found;
    if (!PyArg_ParseTuple(args, "y*O!Ki", &data, &PyTuple_Type, &entries, &context, &not_found)) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(entries);
    const char *names[MAX_ENTRIES];
    if (count > MAX_ENTRIES || bind_driver() < 0) {
        PyBuffer_Release(&data);
        return PyLong_FromLong(-1);
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        names[i] = PyUnicode_AsUTF8(PyTuple_GET_ITEM(entries, i));
        if (names[i] == NULL) {
            PyBuffer_Release(&data);
            return NULL;
        }
    }
    CUfunction functions[MAX_ENTRIES];
    Py_ssize_t found = 0;
    CUlibrary library = NULL;
    CUcontext before = NULL, want = (CUcontext)(uintptr_t)context;
    CUresult err;
    Py_BEGIN_ALLOW_THREADS
    err = cu_ctx_get_current(&before);
    int switched = err == 0 && before != want;
    if (switched) err = cu_ctx_set_current(want);
    if (err == 0) {
        err = cu_library_load_data(&library, data.buf, NULL, NULL, 0, NULL, NULL, 0);
        for (; err == 0 && found < count; found++) {
            CUkernel kernel;
            err = cu_library_get_kernel(&kernel, library, names[found]);
            if (err == not_found) {
                err = 0;
                break;
            }
            if (err == 0) err = cu_kernel_get_function(&functions[found], kernel);
        }
        if (err != 0 && library != NULL) (void)cu_library_unload(library);
    }
    if (switched) {
        CUresult restored = cu_ctx_set_current(before);
        if (err == 0 && restored != 0) {
            (void)cu_library_unload(library);
            err = restored;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (err != 0) return PyLong_FromLong(err);

    PyObject *list = PyList_New(found < count ? found + 1 : count);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < found; i++) {
        PyObject *handle = PyLong_FromVoidPtr(functions[i]);
        if (handle == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, handle);
    }
    if (found < count) PyList_SET_ITEM(list, found, Py_NewRef(Py_None));
    return Py_BuildValue("(NN)", PyLong_FromVoidPtr(library), list);
}

static PyMethodDef methods[] = {
    {"read_entry", read_entry, METH_VARARGS, "Read (and, vouched, check) one store entry: bytes, or 0 (absent) or 1 (anything else)."},
    {"load_functions", load_functions, METH_VARARGS, "Load a CUBIN and its entries' functions: (library, functions), or a CUresult."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_native", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
