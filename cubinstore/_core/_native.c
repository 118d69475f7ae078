/* cubinstore._core._native: a first load's two hot steps, and a launch, in C; optional (cubinstore/_core/native.py).

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
       -1 when libcuda is not loaded in this process (the caller's bindings load it).

   launch_config(grid, block, shared_mem, cluster, cluster_id, pdl_id) -> bytes
       A launch's geometry and attributes (a cluster shape or None; programmatic stream
       serialization where pdl_id >= 0), laid out for cuLaunchKernelEx; the ids are the bindings'.

   launch(function, config, stream, context, params, plan, values) -> int
       Write each of `values` where `plan` says (address, kind: 1 a pointer, 2 a 128-byte tensor map),
       then with `context` current, cuLaunchKernelEx(config on `stream`, function, params); the previous
       context is current again after. The CUresult; -1 before anything is launched when a value is
       not one it writes (the caller packs and checks every value, then calls again with an empty
       plan); -2 when libcuda is not loaded. A prepared launch costs about as much in Python as the
       driver's launch itself (issue 32: host time per call against torch.mm). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stddef.h>
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
typedef void *CUlibrary, *CUkernel, *CUfunction, *CUcontext, *CUstream;

/* cuLaunchKernelEx's config and attributes, laid out as cuda.h lays out CUlaunchConfig and
   CUlaunchAttribute (CUDA 12.0 on; tests/core/test_native.py compares with cuda.h). The attribute ids
   are the caller's, from the bindings' enum. */
typedef struct { unsigned int x, y, z; } Dim3;
typedef union {
    char pad[64];
    Dim3 clusterDim;
    int programmaticStreamSerializationAllowed;
} LaunchAttributeValue;
typedef struct {
    int id;
    char pad[8 - sizeof(int)];
    LaunchAttributeValue value;
} LaunchAttribute;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    LaunchAttribute *attrs;
    unsigned int numAttrs;
} LaunchConfig;
/* What launch_config returns, as bytes: the config (stream and attribute pointer set per launch) and
   its attributes. */
typedef struct {
    LaunchConfig config;
    LaunchAttribute attrs[2];
} LaunchBlob;

static CUresult (*cu_library_load_data)(CUlibrary *, const void *, void *, void **, unsigned, void *, void **, unsigned);
static CUresult (*cu_library_unload)(CUlibrary);
static CUresult (*cu_library_get_kernel)(CUkernel *, CUlibrary, const char *);
static CUresult (*cu_kernel_get_function)(CUfunction *, CUkernel);
static CUresult (*cu_ctx_get_current)(CUcontext *);
static CUresult (*cu_launch_kernel_ex)(const LaunchConfig *, CUfunction, void **, void **);
static CUresult (*cu_ctx_set_current)(CUcontext);
static int bind_failed; /* a libcuda without one of them (older than CUDA 12.0): not asked again */

/* The libcuda the caller's bindings loaded (RTLD_NOLOAD: never a second driver library). Called with the GIL held. */
static int bind_driver(void) {
    if (cu_ctx_set_current != NULL) return 0;
    if (bind_failed) return -1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) return -1; /* not loaded yet: the callers run after the bindings' cuInit, which loads it */
    cu_library_load_data = dlsym(lib, "cuLibraryLoadData");
    cu_library_unload = dlsym(lib, "cuLibraryUnload");
    cu_library_get_kernel = dlsym(lib, "cuLibraryGetKernel");
    cu_kernel_get_function = dlsym(lib, "cuKernelGetFunction");
    cu_ctx_get_current = dlsym(lib, "cuCtxGetCurrent");
    cu_launch_kernel_ex = dlsym(lib, "cuLaunchKernelEx");
    CUresult (*set)(CUcontext) = dlsym(lib, "cuCtxSetCurrent");
    if (!cu_library_load_data || !cu_library_unload || !cu_library_get_kernel || !cu_kernel_get_function
            || !cu_ctx_get_current || !cu_launch_kernel_ex || !set) {
        bind_failed = 1;
        return -1;
    }
    cu_ctx_set_current = set; /* last: it marks the table complete */
    return 0;
}

#define MAX_ENTRIES 64

/* The driver's current context made `want` for a call (enter), and the caller's put back after it (leave).
   Both run without the GIL. enter returns the first error; leave returns the restore's. */
typedef struct {
    CUcontext before;
    int switched;
} ContextGuard;

static CUresult enter_context(ContextGuard *guard, CUcontext want) {
    guard->before = NULL;
    CUresult err = cu_ctx_get_current(&guard->before);
    guard->switched = err == 0 && guard->before != want;
    if (guard->switched) err = cu_ctx_set_current(want);
    return err;
}

static CUresult leave_context(const ContextGuard *guard) {
    return guard->switched ? cu_ctx_set_current(guard->before) : 0;
}

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
    ContextGuard guard;
    CUresult err;
    Py_BEGIN_ALLOW_THREADS
    err = enter_context(&guard, (CUcontext)(uintptr_t)context);
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
    CUresult restored = leave_context(&guard);
    if (err == 0 && restored != 0) { /* loaded in the caller's context's stead: not handed over */
        (void)cu_library_unload(library);
        err = restored;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (err != 0) return PyLong_FromLong(err);

    /* The result, whole before it is handed over; out of memory on the way, the library is unloaded
       again (nothing else refers to it). */
    PyObject *list = PyList_New(found < count ? found + 1 : count);
    PyObject *handle = list != NULL ? PyLong_FromVoidPtr(library) : NULL;
    PyObject *result = handle != NULL ? PyTuple_New(2) : NULL;
    int ok = result != NULL;
    for (Py_ssize_t i = 0; ok && i < found; i++) {
        PyObject *function = PyLong_FromVoidPtr(functions[i]);
        if (function == NULL) ok = 0;
        else PyList_SET_ITEM(list, i, function);
    }
    if (!ok) {
        Py_XDECREF(list);
        Py_XDECREF(handle);
        Py_XDECREF(result);
        (void)cu_library_unload(library);
        return NULL;
    }
    if (found < count) PyList_SET_ITEM(list, found, Py_NewRef(Py_None));
    PyTuple_SET_ITEM(result, 0, handle);
    PyTuple_SET_ITEM(result, 1, list);
    return result;
}

/* An O& converter: an int in [0, 2**32), else OverflowError (PyArg's "I" wraps silently). */
static int as_uint(PyObject *value, void *out) {
    unsigned long v = PyLong_AsUnsignedLong(value);
    if (PyErr_Occurred()) return 0;
    if (v > 0xffffffffUL) {
        PyErr_SetString(PyExc_OverflowError, "a launch dimension or size above 2**32 - 1");
        return 0;
    }
    *(unsigned int *)out = (unsigned int)v;
    return 1;
}

static PyObject *launch_config(PyObject *self, PyObject *args) {
    LaunchBlob blob;
    memset(&blob, 0, sizeof blob);
    LaunchConfig *c = &blob.config;
    PyObject *cluster;
    int cluster_id, pdl_id;
    if (!PyArg_ParseTuple(args, "(O&O&O&)(O&O&O&)O&Oii", as_uint, &c->gridDimX, as_uint, &c->gridDimY, as_uint,
                          &c->gridDimZ, as_uint, &c->blockDimX, as_uint, &c->blockDimY, as_uint, &c->blockDimZ,
                          as_uint, &c->sharedMemBytes, &cluster, &cluster_id, &pdl_id))
        return NULL;
    if (cluster != Py_None) {
        Dim3 *dim = &blob.attrs[c->numAttrs].value.clusterDim;
        blob.attrs[c->numAttrs++].id = cluster_id;
        if (!PyArg_ParseTuple(cluster, "O&O&O&", as_uint, &dim->x, as_uint, &dim->y, as_uint, &dim->z)) return NULL;
    }
    if (pdl_id >= 0) {
        LaunchAttribute *attr = &blob.attrs[c->numAttrs++];
        attr->id = pdl_id;
        attr->value.programmaticStreamSerializationAllowed = 1;
    }
    return PyBytes_FromStringAndSize((const char *)&blob, sizeof blob);
}

enum { ARG_POINTER = 1, ARG_TENSORMAP = 2, TENSORMAP_BYTES = 128 };
enum { NOT_WRITTEN = -1, UNBOUND = -2 };

/* Write each changing argument the plan says how to: a pointer (an exact int in [0, 2**64)) or a
   tensor map (bytes of exactly 128); 0, or -1 for any other value (the caller packs them all). */
static int write_args(PyObject *plan, PyObject *values) {
    if (!PyTuple_CheckExact(plan) || !PyTuple_CheckExact(values) || PyTuple_GET_SIZE(plan) != 2 * PyTuple_GET_SIZE(values))
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(values); i++) {
        PyObject *value = PyTuple_GET_ITEM(values, i);
        void *at = PyLong_AsVoidPtr(PyTuple_GET_ITEM(plan, 2 * i));
        long kind = PyLong_AsLong(PyTuple_GET_ITEM(plan, 2 * i + 1));
        if (PyErr_Occurred()) return -1;
        if (kind == ARG_POINTER && PyLong_CheckExact(value)) {
            unsigned long long pointer = PyLong_AsUnsignedLongLong(value);
            if (PyErr_Occurred()) return -1; /* negative or too large: the caller words it */
            memcpy(at, &pointer, sizeof pointer); /* little-endian, as the kernel's parameter space */
        } else if (kind == ARG_TENSORMAP && PyBytes_CheckExact(value) && PyBytes_GET_SIZE(value) == TENSORMAP_BYTES) {
            memcpy(at, PyBytes_AS_STRING(value), TENSORMAP_BYTES);
        } else {
            return -1;
        }
    }
    return 0;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyBytes_CheckExact(args[1]) || PyBytes_GET_SIZE(args[1]) != (Py_ssize_t)sizeof(LaunchBlob)) {
        PyErr_SetString(PyExc_TypeError, "launch(function, config, stream, context, params, plan, values)");
        return NULL;
    }
    CUfunction function = PyLong_AsVoidPtr(args[0]);
    CUstream stream = PyLong_AsVoidPtr(args[2]);
    CUcontext want = PyLong_AsVoidPtr(args[3]);
    void **params = PyLong_AsVoidPtr(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (write_args(args[5], args[6]) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(NOT_WRITTEN);
    }
    if (bind_driver() < 0) return PyLong_FromLong(UNBOUND);
    LaunchBlob *blob = (LaunchBlob *)PyBytes_AS_STRING(args[1]);
    LaunchConfig config = blob->config;
    config.hStream = stream;
    config.attrs = config.numAttrs ? blob->attrs : NULL; /* in the immutable bytes, alive for the call */
    CUresult err;
    Py_BEGIN_ALLOW_THREADS
    ContextGuard guard;
    err = enter_context(&guard, want);
    if (err == 0) err = cu_launch_kernel_ex(&config, function, params, NULL);
    CUresult restored = leave_context(&guard);
    if (err == 0) err = restored;
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

/* Whether the helper found the driver's entry points in the libcuda the caller's bindings loaded. */
static PyObject *bind(PyObject *self, PyObject *unused) { return PyBool_FromLong(bind_driver() == 0); }

/* Sizes and offsets of the launch structs as compiled here, for the test that compares them with cuda.h. */
static PyObject *launch_layout(PyObject *self, PyObject *unused) {
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "CUlaunchConfig", (Py_ssize_t)sizeof(LaunchConfig),
        "CUlaunchConfig.sharedMemBytes", (Py_ssize_t)offsetof(LaunchConfig, sharedMemBytes),
        "CUlaunchConfig.hStream", (Py_ssize_t)offsetof(LaunchConfig, hStream),
        "CUlaunchConfig.attrs", (Py_ssize_t)offsetof(LaunchConfig, attrs),
        "CUlaunchConfig.numAttrs", (Py_ssize_t)offsetof(LaunchConfig, numAttrs),
        "CUlaunchAttribute", (Py_ssize_t)sizeof(LaunchAttribute),
        "CUlaunchAttribute.value", (Py_ssize_t)offsetof(LaunchAttribute, value),
        "CUlaunchAttributeValue.clusterDim.z", (Py_ssize_t)offsetof(LaunchAttributeValue, clusterDim.z),
        "CUlaunchAttributeValue.programmaticStreamSerializationAllowed",
        (Py_ssize_t)offsetof(LaunchAttributeValue, programmaticStreamSerializationAllowed));
}

static PyMethodDef methods[] = {
    {"read_entry", read_entry, METH_VARARGS, "Read (and, vouched, check) one store entry: bytes, or 0 (absent) or 1 (anything else)."},
    {"load_functions", load_functions, METH_VARARGS, "Load a CUBIN and its entries' functions: (library, functions), or a CUresult."},
    {"launch_config", launch_config, METH_VARARGS, "A launch's geometry and attributes, packed for launch."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL,
     "Write the changing arguments and launch: a CUresult, -1 (a value it does not write: nothing launched), -2 (no libcuda)."},
    {"bind", bind, METH_NOARGS, "Whether libcuda (loaded by the caller's bindings) has every entry point the helper calls."},
    {"launch_layout", launch_layout, METH_NOARGS, "The launch structs' sizes and offsets as compiled (for a test)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_native", .m_doc = NULL, .m_size = -1, .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
