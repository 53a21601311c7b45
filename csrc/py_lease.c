/*
 * py_lease.c: the lease of one expert as a CPython type (colibri._lease).
 *
 * store.lease() is the call an engine makes for every expert of every token,
 * so its hit runs here: the key is parsed, a resident expert is leased while
 * the GIL is held (a hit never waits for a read, only for the layer's
 * mutex), and only a miss drops the GIL for the lookup that may read or
 * wait. __enter__, __exit__, release() and the arrays' getters are C too
 * (each array is built once per slot tenancy and shared). What stays in Python
 * (colibri/store.py, _tenancy.py) is everything off the hit path: the numpy
 * arrays and their lifetime anchors (ExpertLease subclasses LeaseBase), the
 * exception classes, and ending a lease whose arrays were used
 * (Tenancies.leave).
 *
 * The module links none of the C core. It calls it through the entry points
 * table the cffi extension hands over (coli_lease_entry_points()) and
 * releases through the store's own op, so both extensions act on one store.
 * It keeps no state of its own: everything hangs off a Leaser, one per store.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <structmember.h>

#include "coli_store.h"

/* The arrays of one slot tenancy (an expert loaded into a slot), shared by
 * every lease of it; built by colibri._tenancy.TenancyBuilder. */
typedef struct {
    PyObject_HEAD
    unsigned long long generation;
    PyObject *arrays;           /* tuple: gate, up, down, their scales, then extra parts (or None) */
    PyObject *chain;            /* list of every object through which Python reaches the bytes */
    Py_ssize_t *baseline;       /* Py_REFCNT of each, when the tenancy was made */
    Py_ssize_t n_chain;
    Py_ssize_t active;          /* leases using the arrays now */
    PyObject *pin;              /* referenced by every owner: its death ends a deferred lease */
} Tenancy;

/* One store's cached tenancies and the lease counts on them. Join and leave
 * run in C holding the GIL, so they need no lock of their own. (A
 * free-threaded CPython turns the GIL back on for this module: it does not
 * declare Py_mod_gil.) */
typedef struct {
    PyObject_HEAD
    PyObject *by_generation;    /* dict: generation -> Tenancy, oldest first */
    PyObject *build;            /* build(lease) -> Tenancy */
    PyObject *defer;            /* defer(tenancy, lease): hand the C lease to the arrays */
    Py_ssize_t limit;           /* tenancies cached; unused ones beyond it are dropped */
} Tenancies;

typedef struct {
    PyObject_HEAD
    ColiExpertStore *handle;
    const ColiLeaseEntryPoints *api;
    PyObject *handle_owner;     /* the cffi handle; the store lives as long as it does */
    Tenancies *tenancies;       /* the store's */
    PyTypeObject *lease_type;   /* LeaseBase or a subclass: what lease() makes */
    PyObject *error_for;        /* error_for(code, message) -> exception instance */
    PyObject *lease_error;      /* the class raised for a second release */
} Leaser;

typedef struct {
    PyObject_HEAD
    Leaser *leaser;             /* NULL only while being made */
    Tenancy *tenancy;           /* the tenancy whose arrays this lease uses, or NULL */
    int layer, expert;
    char released;
    ColiExpertView view;
} Lease;

static PyTypeObject LeaserType;
static PyTypeObject LeaseBaseType;
static PyTypeObject TenancyType;
static PyTypeObject TenanciesType;

/* ---- errors ---------------------------------------------------------- */

/* Raises error_for(code, message); returns NULL. */
static PyObject *raise_code(Leaser *lr, int code, PyObject *message) {
    if (!message) return NULL;
    PyObject *exc = PyObject_CallFunction(lr->error_for, "iO", code, message);
    Py_DECREF(message);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *raise_c_error(Leaser *lr, int code, const char *err) {
    return raise_code(lr, code, PyUnicode_DecodeUTF8(err, (Py_ssize_t)strnlen(err, COLI_ERR_LEN), "replace"));
}

/* ---- Tenancy --------------------------------------------------------- */

/* Tenancy(generation, arrays, chain, pin). The reference counts of chain's
 * objects are taken now as the baseline: the caller must hold no transient
 * reference to any of them (TenancyBuilder.build sees to it). */
static PyObject *tenancy_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"generation", "arrays", "chain", "pin", NULL};
    unsigned long long generation;
    PyObject *arrays, *chain, *pin;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KO!O!O:Tenancy", names, &generation,
                                     &PyTuple_Type, &arrays, &PyList_Type, &chain, &pin))
        return NULL;
    if (PyTuple_GET_SIZE(arrays) < COLI_ROLE_PARTS) {
        PyErr_Format(PyExc_ValueError, "Tenancy: arrays must hold at least %d entries", (int)COLI_ROLE_PARTS);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(chain);
    Py_ssize_t *baseline = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (!baseline) return PyErr_NoMemory();
    Tenancy *self = (Tenancy *)type->tp_alloc(type, 0);
    if (!self) {
        PyMem_Free(baseline);
        return NULL;
    }
    self->generation = generation;
    self->arrays = Py_NewRef(arrays);
    /* The builder's own list, not a copy: a copy's references would be
     * counted now, and the builder's list would be gone at a check. */
    self->chain = Py_NewRef(chain);
    self->pin = Py_NewRef(pin);
    self->baseline = baseline;
    self->n_chain = n;
    for (Py_ssize_t i = 0; i < n; i++) baseline[i] = Py_REFCNT(PyList_GET_ITEM(self->chain, i));
    return (PyObject *)self;
}

/* True when anything besides the tenancy refers to an object of its chain:
 * a count can only rise above its baseline, and only from outside. */
static int tenancy_escaped(const Tenancy *t) {
    for (Py_ssize_t i = 0; i < t->n_chain; i++)
        if (Py_REFCNT(PyList_GET_ITEM(t->chain, i)) != t->baseline[i]) return 1;
    return 0;
}

static int tenancy_traverse(Tenancy *self, visitproc visit, void *arg) {
    Py_VISIT(self->arrays);
    Py_VISIT(self->chain);
    Py_VISIT(self->pin);
    return 0;
}

static int tenancy_clear(Tenancy *self) {
    Py_CLEAR(self->arrays);
    Py_CLEAR(self->chain);
    Py_CLEAR(self->pin);
    return 0;
}

static void tenancy_dealloc(Tenancy *self) {
    PyObject_GC_UnTrack(self);
    tenancy_clear(self);
    PyMem_Free(self->baseline);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef tenancy_members[] = {
    {"generation", T_ULONGLONG, offsetof(Tenancy, generation), READONLY, "The slot tenancy."},
    {"arrays", T_OBJECT, offsetof(Tenancy, arrays), READONLY,
     "gate, up, down, their scales, then the extra parts."},
    {"pin", T_OBJECT, offsetof(Tenancy, pin), READONLY, "Referenced by every array's owner."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject TenancyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._lease.Tenancy",
    .tp_doc = "The arrays of one slot tenancy, shared by its leases.",
    .tp_basicsize = sizeof(Tenancy),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = tenancy_new,
    .tp_dealloc = (destructor)tenancy_dealloc,
    .tp_traverse = (traverseproc)tenancy_traverse,
    .tp_clear = (inquiry)tenancy_clear,
    .tp_members = tenancy_members,
};

/* ---- Tenancies -------------------------------------------------------- */

static PyObject *tenancies_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"build", "defer", "limit", NULL};
    PyObject *build, *defer;
    Py_ssize_t limit;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOn:Tenancies", names, &build, &defer, &limit))
        return NULL;
    if (!PyCallable_Check(build) || !PyCallable_Check(defer) || limit < 1) {
        PyErr_SetString(PyExc_ValueError, "Tenancies: build and defer must be callables, limit >= 1");
        return NULL;
    }
    Tenancies *self = (Tenancies *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->by_generation = PyDict_New();
    self->build = Py_NewRef(build);
    self->defer = Py_NewRef(defer);
    self->limit = limit;
    if (!self->by_generation) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int tenancies_traverse(Tenancies *self, visitproc visit, void *arg) {
    Py_VISIT(self->by_generation);
    Py_VISIT(self->build);
    Py_VISIT(self->defer);
    return 0;
}

static int tenancies_clear(Tenancies *self) {
    Py_CLEAR(self->by_generation);
    Py_CLEAR(self->build);
    Py_CLEAR(self->defer);
    return 0;
}

static void tenancies_dealloc(Tenancies *self) {
    PyObject_GC_UnTrack(self);
    tenancies_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Drops the oldest unused tenancies, up to half of the cache. Nobody can
 * reach an unused cached tenancy's arrays (its last lease saw none escape),
 * so dropping one is always safe. The victims die after the dict is
 * consistent again. */
static int tenancies_prune(Tenancies *self) {
    Py_ssize_t budget = PyDict_GET_SIZE(self->by_generation) / 2, pos = 0;
    PyObject *key, *value, *victims = PyList_New(0);
    if (!victims) return -1;
    while (budget > 0 && PyDict_Next(self->by_generation, &pos, &key, &value)) {
        if (((Tenancy *)value)->active == 0) {
            if (PyList_Append(victims, key) < 0) goto fail;
            budget--;
        }
    }
    PyObject *doomed = PyList_New(0);   /* keeps the victims alive until the end */
    if (!doomed) goto fail;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(victims); i++) {
        PyObject *k = PyList_GET_ITEM(victims, i);
        PyObject *t = PyDict_GetItemWithError(self->by_generation, k);
        if ((t && PyList_Append(doomed, t) < 0) || (t && PyDict_DelItem(self->by_generation, k) < 0)) {
            Py_DECREF(doomed);
            goto fail;
        }
    }
    Py_DECREF(victims);
    Py_DECREF(doomed);
    return 0;
fail:
    Py_DECREF(victims);
    return -1;
}

/* The tenancy of lease's slot (built on first use, then cached), counted as
 * used by one more lease. New reference, or NULL with an exception. */
static Tenancy *tenancies_join(Tenancies *self, PyObject *lease, unsigned long long generation) {
    PyObject *key = PyLong_FromUnsignedLongLong(generation);
    if (!key) return NULL;
    PyObject *found = PyDict_GetItemWithError(self->by_generation, key);
    if (!found) {
        if (PyErr_Occurred()) goto fail;
        /* Python builds the arrays; another thread may cache the same
         * generation meanwhile, and then that one is used. */
        PyObject *built = PyObject_CallOneArg(self->build, lease);
        if (!built) goto fail;
        if (!Py_IS_TYPE(built, &TenancyType) || ((Tenancy *)built)->generation != generation) {
            PyErr_SetString(PyExc_TypeError, "Tenancies: build() must return this generation's Tenancy");
            Py_DECREF(built);
            goto fail;
        }
        found = PyDict_SetDefault(self->by_generation, key, built);
        Py_DECREF(built);   /* the dict holds it, or holds the one cached first */
        if (!found) goto fail;
    }
    Tenancy *t = (Tenancy *)Py_NewRef(found);
    Py_DECREF(key);
    t->active++;
    if (PyDict_GET_SIZE(self->by_generation) > self->limit && tenancies_prune(self) < 0) {
        t->active--;
        Py_DECREF(t);
        return NULL;
    }
    return t;
fail:
    Py_DECREF(key);
    return NULL;
}

/* lease, which used t's arrays, is being released. Returns 1 when its C
 * lease may end now (another lease still pins the slot, or nothing
 * escaped), 0 when the C lease was handed to the escaped arrays (defer), -1
 * with an exception (the C lease then stays: leaked, never freed under a
 * reader). */
static int tenancies_leave(Tenancies *self, PyObject *lease, Tenancy *t) {
    if (--t->active > 0 || !tenancy_escaped(t)) return 1;
    PyObject *key = PyLong_FromUnsignedLongLong(t->generation);
    if (!key) return -1;
    PyObject *cached = PyDict_GetItemWithError(self->by_generation, key);
    int rc = 0;
    if (cached == (PyObject *)t) rc = PyDict_DelItem(self->by_generation, key);
    else if (!cached && PyErr_Occurred()) rc = -1;
    Py_DECREF(key);
    if (rc < 0) return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(self->defer, (PyObject *)t, lease, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *tenancies_clear_cache(Tenancies *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *old = self->by_generation;
    self->by_generation = PyDict_New();
    if (!self->by_generation) {
        self->by_generation = old;
        return NULL;
    }
    Py_DECREF(old);
    Py_RETURN_NONE;
}

static Py_ssize_t tenancies_len(Tenancies *self) {
    return PyDict_GET_SIZE(self->by_generation);
}

static PyMethodDef tenancies_methods[] = {
    {"clear", (PyCFunction)tenancies_clear_cache, METH_NOARGS,
     "Forget every cached tenancy (the store's memory is gone)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods tenancies_as_sequence = {
    .sq_length = (lenfunc)tenancies_len,
};

static PyTypeObject TenanciesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._lease.Tenancies",
    .tp_doc = "One store's cached tenancies: Tenancies(build, defer, limit).",
    .tp_basicsize = sizeof(Tenancies),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = tenancies_new,
    .tp_dealloc = (destructor)tenancies_dealloc,
    .tp_traverse = (traverseproc)tenancies_traverse,
    .tp_clear = (inquiry)tenancies_clear,
    .tp_methods = tenancies_methods,
    .tp_as_sequence = &tenancies_as_sequence,
};

/* ---- Leaser ---------------------------------------------------------- */

/* An int object as a C int; -1 with an exception when it does not fit. */
static int as_int(PyObject *o, int *out) {
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v > INT_MAX || v < INT_MIN) {
        PyErr_SetString(PyExc_OverflowError, "does not fit a C int");
        return -1;
    }
    *out = (int)v;
    return 0;
}

static void *address_of(PyObject *number, const char *what) {
    void *p = PyLong_AsVoidPtr(number);
    if (!p && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "Leaser: %s is NULL", what);
    return p;
}

static PyObject *leaser_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"handle_owner", "handle", "entry_points", "tenancies", "lease_type",
                            "error_for", "lease_error", NULL};
    PyObject *owner, *handle, *api, *tenancies, *lease_type, *error_for, *lease_error;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOO:Leaser", names, &owner, &handle, &api,
                                     &tenancies, &lease_type, &error_for, &lease_error))
        return NULL;
    if (!PyType_Check(lease_type) || !PyType_IsSubtype((PyTypeObject *)lease_type, &LeaseBaseType)) {
        PyErr_SetString(PyExc_TypeError, "Leaser: lease_type must be LeaseBase or a subclass");
        return NULL;
    }
    if (!Py_IS_TYPE(tenancies, &TenanciesType)) {
        PyErr_SetString(PyExc_TypeError, "Leaser: tenancies must be a Tenancies");
        return NULL;
    }
    ColiExpertStore *h = address_of(handle, "handle");
    const ColiLeaseEntryPoints *ep = h ? address_of(api, "entry_points") : NULL;
    if (!ep) return NULL;
    Leaser *self = (Leaser *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->handle = h;
    self->api = ep;
    self->handle_owner = Py_NewRef(owner);
    self->tenancies = (Tenancies *)Py_NewRef(tenancies);
    self->lease_type = (PyTypeObject *)Py_NewRef(lease_type);
    self->error_for = Py_NewRef(error_for);
    self->lease_error = Py_NewRef(lease_error);
    return (PyObject *)self;
}

static int leaser_traverse(Leaser *self, visitproc visit, void *arg) {
    Py_VISIT(self->handle_owner);
    Py_VISIT(self->tenancies);
    Py_VISIT(self->lease_type);
    Py_VISIT(self->error_for);
    Py_VISIT(self->lease_error);
    return 0;
}

static int leaser_clear(Leaser *self) {
    Py_CLEAR(self->handle_owner);
    Py_CLEAR(self->tenancies);
    Py_CLEAR(self->lease_type);
    Py_CLEAR(self->error_for);
    Py_CLEAR(self->lease_error);
    return 0;
}

static void leaser_dealloc(Leaser *self) {
    PyObject_GC_UnTrack(self);
    leaser_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* One int of a key: any integer (numpy's too), as Python's operator.index
 * takes it. Returns 0 and *out when it fits a C int; 1 when it does not
 * (*index keeps the integer, for the message); -1 with an exception. */
static int key_part(PyObject *o, int *out, PyObject **index) {
    PyObject *i = PyNumber_Index(o);
    if (!i) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(i, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(i);
        return -1;
    }
    if (overflow || v > INT_MAX || v < -INT_MAX) {
        *index = i;
        return 1;
    }
    Py_DECREF(i);
    *out = (int)v;
    return 0;
}

/* A new lease object holding no lease yet (released, so that losing it
 * early ends nothing). */
static Lease *new_lease(Leaser *lr, int layer, int expert) {
    Lease *lease = (Lease *)lr->lease_type->tp_alloc(lr->lease_type, 0);
    if (!lease) return NULL;
    lease->leaser = (Leaser *)Py_NewRef(lr);
    lease->layer = layer;
    lease->expert = expert;
    lease->released = 1;
    return lease;
}

static PyObject *leaser_lease(Leaser *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "lease() takes a layer and an expert (%zd given)", nargs);
        return NULL;
    }
    int layer = 0, expert = 0;
    PyObject *big_layer = NULL, *big_expert = NULL;
    int a = key_part(args[0], &layer, &big_layer);
    int b = a < 0 ? -1 : key_part(args[1], &expert, &big_expert);
    if (a < 0 || b < 0 || a > 0 || b > 0) {
        PyObject *msg = NULL;
        if (a >= 0 && b >= 0)   /* beyond any C int: no such expert, said like the C core does */
            msg = PyUnicode_FromFormat("layer %S has no expert %S", big_layer ? big_layer : args[0],
                                       big_expert ? big_expert : args[1]);
        Py_XDECREF(big_layer);
        Py_XDECREF(big_expert);
        return msg ? raise_code(self, COLI_ENOTFOUND, msg) : NULL;
    }
    /* Made before the lookup: once the C lease is taken nothing may fail. */
    Lease *lease = new_lease(self, layer, expert);
    if (!lease) return NULL;
    int rc = self->api->lookup_resident(self->handle, layer, expert, &lease->view);
    if (rc == COLI_EAGAIN) {
        char err[COLI_ERR_LEN];
        err[0] = '\0';
        Py_BEGIN_ALLOW_THREADS
        rc = self->api->lookup(self->handle, layer, expert, &lease->view, err, sizeof err);
        Py_END_ALLOW_THREADS
        if (rc != COLI_OK) {
            Py_DECREF(lease);
            return raise_c_error(self, rc, err);
        }
    }
    lease->released = 0;
    return (PyObject *)lease;
}

/* The (layer, list of experts) arguments of lease_many and lease_hits:
 * 0 and *layer, or -1 with a TypeError naming the call. */
static int layer_and_list(PyObject *const *args, Py_ssize_t nargs, const char *call, int *layer) {
    if (nargs != 2 || !PyLong_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s() takes a layer and a list of experts", call);
        return -1;
    }
    return as_int(args[0], layer);
}

/* lease_many(layer, experts): experts is a list of ints the caller checked
 * to fit a C int, at least one. Returns a tuple of leases, in order. */
static PyObject *leaser_lease_many(Leaser *self, PyObject *const *args, Py_ssize_t nargs) {
    int layer;
    if (layer_and_list(args, nargs, "lease_many", &layer) < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(args[1]);
    if (count < 1 || count > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_many(): between 1 and INT_MAX experts");
        return NULL;
    }
    int *ids = PyMem_Malloc(sizeof(int) * (size_t)count);
    ColiExpertView *views = PyMem_Calloc((size_t)count, sizeof(ColiExpertView));
    PyObject *out = PyTuple_New(count);
    if (!ids || !views || !out) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (as_int(PyList_GET_ITEM(args[1], i), &ids[i]) < 0) goto fail;
        Lease *lease = new_lease(self, layer, ids[i]);
        if (!lease) goto fail;
        PyTuple_SET_ITEM(out, i, (PyObject *)lease);
    }
    char err[COLI_ERR_LEN];
    err[0] = '\0';
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = self->api->lookup_many(self->handle, layer, ids, (int)count, views, err, sizeof err);
    Py_END_ALLOW_THREADS
    if (rc != COLI_OK) {
        raise_c_error(self, rc, err);
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        Lease *lease = (Lease *)PyTuple_GET_ITEM(out, i);
        lease->view = views[i];   /* a lease is named by its slot and generation: a copy holds it */
        lease->released = 0;
    }
    PyMem_Free(ids);
    PyMem_Free(views);
    return out;
fail:
    PyMem_Free(ids);
    PyMem_Free(views);
    Py_XDECREF(out);
    return NULL;
}

static void end_c_lease(Lease *self);

/* lease_hits(layer, experts): of experts (a list of ints the caller checked
 * to fit a C int, no repeats), leases those resident now and returns them,
 * in order; never waits for a read, so the caller can start the others'
 * reads and compute with these meanwhile. */
static PyObject *leaser_lease_hits(Leaser *self, PyObject *const *args, Py_ssize_t nargs) {
    int layer;
    if (layer_and_list(args, nargs, "lease_hits", &layer) < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(args[1]);
    /* Every lease object is made before the first lookup: once C leases are
     * taken, only the result tuple can still fail, and then they go back. */
    PyObject *all = PyTuple_New(count);
    if (!all) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        int expert;
        Lease *lease = NULL;
        if (as_int(PyList_GET_ITEM(args[1], i), &expert) < 0 ||
            !(lease = new_lease(self, layer, expert))) {
            Py_DECREF(all);
            return NULL;
        }
        PyTuple_SET_ITEM(all, i, (PyObject *)lease);
    }
    Py_ssize_t hits = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Lease *lease = (Lease *)PyTuple_GET_ITEM(all, i);
        if (self->api->lookup_resident(self->handle, layer, lease->expert, &lease->view) == COLI_OK) {
            lease->released = 0;
            hits++;
        }
    }
    PyObject *out = PyTuple_New(hits);
    for (Py_ssize_t i = 0, j = 0; i < count; i++) {
        Lease *lease = (Lease *)PyTuple_GET_ITEM(all, i);
        if (lease->released) continue;
        if (out) {
            PyTuple_SET_ITEM(out, j++, Py_NewRef(lease));
        } else {
            lease->released = 1;
            end_c_lease(lease);
        }
    }
    Py_DECREF(all);
    return out;
}

static PyMethodDef leaser_methods[] = {
    {"lease", (PyCFunction)(void (*)(void))leaser_lease, METH_FASTCALL,
     "lease(layer, expert) -> a lease of that expert (see Store.lease)"},
    {"lease_many", (PyCFunction)(void (*)(void))leaser_lease_many, METH_FASTCALL,
     "lease_many(layer, experts: list[int]) -> tuple of leases, all or nothing"},
    {"lease_hits", (PyCFunction)(void (*)(void))leaser_lease_hits, METH_FASTCALL,
     "lease_hits(layer, experts: list[int]) -> tuple of leases of those resident now"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LeaserType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._lease.Leaser",
    .tp_doc = "Makes the leases of one store.",
    .tp_basicsize = sizeof(Leaser),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = leaser_new,
    .tp_dealloc = (destructor)leaser_dealloc,
    .tp_traverse = (traverseproc)leaser_traverse,
    .tp_clear = (inquiry)leaser_clear,
    .tp_methods = leaser_methods,
};

/* ---- LeaseBase ------------------------------------------------------- */

static int lease_traverse(Lease *self, visitproc visit, void *arg) {
    Py_VISIT(self->leaser);
    Py_VISIT(self->tenancy);
    return 0;
}

static int lease_clear(Lease *self) {
    Py_CLEAR(self->tenancy);
    Py_CLEAR(self->leaser);
    return 0;
}

static PyObject *lease_release(Lease *self, PyObject *Py_UNUSED(ignored));

/* A lease dropped without release() is released then, with a
 * ResourceWarning, as Python does for a file left open: otherwise its slot
 * would stay leased for good. Its arrays, if any escaped, still keep the C
 * lease (Tenancies.leave). */
static void lease_finalize(Lease *self) {
    if (self->released || !self->leaser) return;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *pending = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
#endif
    if (PyErr_WarnFormat(PyExc_ResourceWarning, 1,
                         "lease of layer %d expert %d was never released; released as garbage",
                         self->layer, self->expert) < 0)
        PyErr_WriteUnraisable((PyObject *)self);
    PyObject *r = lease_release(self, NULL);
    if (r) Py_DECREF(r);
    else PyErr_WriteUnraisable((PyObject *)self);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(pending);
#else
    PyErr_Restore(type, value, tb);
#endif
}

static void lease_dealloc(Lease *self) {
    /* A Python subclass's instance comes here from subtype_dealloc, which
     * drops the reference to its (heap) type itself. */
    PyObject_GC_UnTrack(self);
    lease_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Ends the C lease now. Safe to call again: a zeroed view is ignored. */
static void end_c_lease(Lease *self) {
    if (self->leaser && self->view.lease) coli_expert_release(self->leaser->handle, &self->view);
}

static PyObject *lease_release(Lease *self, PyObject *Py_UNUSED(ignored)) {
    if (self->released) {
        PyErr_Format(self->leaser->lease_error, "lease of layer %d expert %d was already released",
                     self->layer, self->expert);
        return NULL;
    }
    self->released = 1;
    Tenancy *tenancy = self->tenancy;
    self->tenancy = NULL;
    /* Its arrays were used: the C lease ends now unless they escaped. */
    int now = tenancy ? tenancies_leave(self->leaser->tenancies, (PyObject *)self, tenancy) : 1;
    Py_XDECREF(tenancy);
    if (now < 0) return NULL;
    if (now) end_c_lease(self);
    Py_RETURN_NONE;
}

static PyObject *lease_enter(Lease *self, PyObject *Py_UNUSED(ignored)) {
    return Py_NewRef((PyObject *)self);
}

static PyObject *lease_exit(Lease *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    if (self->released) Py_RETURN_NONE;
    PyObject *r = lease_release(self, NULL);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

/* For defer(): the C lease of a released lease whose arrays escaped ends
 * when the last of them dies. Never ends one the lease still holds. */
static PyObject *lease_end_c_lease(Lease *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->released) {
        PyErr_Format(PyExc_RuntimeError, "layer %d expert %d: the lease is still held", self->layer,
                     self->expert);
        return NULL;
    }
    end_c_lease(self);
    Py_RETURN_NONE;
}

_Static_assert(COLI_VIEW_LAYOUT_LEN == 8, "lease_layout builds a tuple of 8");

static PyObject *lease_layout(Lease *self, PyObject *Py_UNUSED(ignored)) {
    uint64_t out[COLI_VIEW_LAYOUT_LEN];
    if (!self->leaser || self->leaser->api->view_layout(&self->view, out) != COLI_OK) {
        PyErr_Format(PyExc_RuntimeError, "layer %d expert %d: the lease holds no C lease",
                     self->layer, self->expert);
        return NULL;
    }
    return Py_BuildValue("(KKKKKKKK)", (unsigned long long)out[0], (unsigned long long)out[1],
                         (unsigned long long)out[2], (unsigned long long)out[3],
                         (unsigned long long)out[4], (unsigned long long)out[5],
                         (unsigned long long)out[6], (unsigned long long)out[7]);
}

static PyMethodDef lease_methods[] = {
    {"release", (PyCFunction)lease_release, METH_NOARGS,
     "End the lease. Releasing twice is a LeaseError."},
    {"__enter__", (PyCFunction)lease_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))lease_exit, METH_FASTCALL, NULL},
    {"_end_c_lease", (PyCFunction)lease_end_c_lease, METH_NOARGS,
     "End a released lease's C lease now (defer's callback; ending twice is harmless)."},
    {"_layout", (PyCFunction)lease_layout, METH_NOARGS,
     "coli_view_layout of the lease's view: (base, span, 6 offsets)."},
    {NULL, NULL, 0, NULL},
};

static const char *const PART_NAMES[] = {"gate", "up", "down", "gate_scale", "up_scale", "down_scale"};

/* One of the lease's arrays (None for a scale the checkpoint has not). The
 * first asks the store's Tenancies for the arrays of this slot tenancy. */
static PyObject *lease_part(Lease *self, void *closure) {
    Py_ssize_t i = (Py_ssize_t)(intptr_t)closure;
    if (self->released) {
        PyErr_Format(self->leaser->lease_error, "layer %d expert %d: .%s used after its lease was released",
                     self->layer, self->expert, PART_NAMES[i]);
        return NULL;
    }
    if (!self->tenancy) {
        self->tenancy = tenancies_join(self->leaser->tenancies, (PyObject *)self,
                                       self->view.lease_generation);
        if (!self->tenancy) return NULL;
    }
    return Py_NewRef(PyTuple_GET_ITEM(self->tenancy->arrays, i));
}

/* Every array of the lease (gate, up, down, scales, extra parts; None where
 * absent) in a new tuple: a tuple the caller keeps holds references of its
 * own to the arrays, which the escape check sees. */
static PyObject *lease_all_parts(Lease *self, void *Py_UNUSED(closure)) {
    if (self->released) {
        PyErr_Format(self->leaser->lease_error, "layer %d expert %d: .parts used after its lease was released",
                     self->layer, self->expert);
        return NULL;
    }
    if (!self->tenancy) {
        self->tenancy = tenancies_join(self->leaser->tenancies, (PyObject *)self,
                                       self->view.lease_generation);
        if (!self->tenancy) return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(self->tenancy->arrays);
    PyObject *out = PyTuple_New(n);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(out, i, Py_NewRef(PyTuple_GET_ITEM(self->tenancy->arrays, i)));
    return out;
}

static PyObject *lease_get_released(Lease *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->released);
}

static PyObject *lease_get_generation(Lease *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(self->view.lease_generation);
}

/* Where the lease's C view is, for a kernel call through cffi: the lease
 * object keeps it at one address for life. 0 once released. */
static PyObject *lease_get_view_address(Lease *self, void *Py_UNUSED(closure)) {
    return PyLong_FromVoidPtr(self->released ? NULL : (void *)&self->view);
}

static PyObject *lease_get_tenancies(Lease *self, void *Py_UNUSED(closure)) {
    if (!self->leaser) Py_RETURN_NONE;
    return Py_NewRef((PyObject *)self->leaser->tenancies);
}


static PyGetSetDef lease_getset[] = {
    {"gate", (getter)lease_part, NULL, "The gate projection, shape (intermediate, hidden) as stored.",
     (void *)0},
    {"up", (getter)lease_part, NULL, "The up projection, shape (intermediate, hidden) as stored.",
     (void *)1},
    {"down", (getter)lease_part, NULL, "The down projection, shape (hidden, intermediate) as stored.",
     (void *)2},
    {"gate_scale", (getter)lease_part, NULL,
     "Block scales of gate (fp8 block-scaled checkpoints), else None.", (void *)3},
    {"up_scale", (getter)lease_part, NULL, "Block scales of up, else None.", (void *)4},
    {"down_scale", (getter)lease_part, NULL, "Block scales of down, else None.", (void *)5},
    {"_all_parts", (getter)lease_all_parts, NULL,
     "Every array in the C core's order (a new tuple; None where absent).", NULL},
    {"released", (getter)lease_get_released, NULL, "True once release() ran.", NULL},
    {"_generation", (getter)lease_get_generation, NULL, "The slot tenancy leased.", NULL},
    {"_tenancies", (getter)lease_get_tenancies, NULL, "The store's Tenancies.", NULL},
    {"_view_address", (getter)lease_get_view_address, NULL,
     "The address of the lease's ColiExpertView (0 once released).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef lease_members[] = {
    {"layer", T_INT, offsetof(Lease, layer), READONLY, "The model's layer index."},
    {"expert", T_INT, offsetof(Lease, expert), READONLY, "The expert's index in its layer."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject LeaseBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "colibri._lease.LeaseBase",
    .tp_doc = "One leased expert; made only by a Leaser.",
    .tp_basicsize = sizeof(Lease),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .tp_dealloc = (destructor)lease_dealloc,
    .tp_finalize = (destructor)lease_finalize,
    .tp_traverse = (traverseproc)lease_traverse,
    .tp_clear = (inquiry)lease_clear,
    .tp_methods = lease_methods,
    .tp_getset = lease_getset,
    .tp_members = lease_members,
};

/* ---- module ---------------------------------------------------------- */

/* copy_views(leases, address): the ColiExpertView of each lease of the
 * sequence, in order, into the array at address (len(leases) views: the
 * caller's buffer), for one kernel call over a batch. A released lease, or
 * anything not a lease, is an error and nothing is written past it. */
static PyObject *module_copy_views(PyObject *Py_UNUSED(module), PyObject *const *args,
                                   Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "copy_views(leases, address)");
        return NULL;
    }
    ColiExpertView *out = PyLong_AsVoidPtr(args[1]);
    if (!out) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "copy_views: address is NULL");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[0], "copy_views: leases must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyObject_TypeCheck(items[i], &LeaseBaseType)) {
            PyErr_Format(PyExc_TypeError, "copy_views: item %zd is a %.80s, not a lease", i,
                         Py_TYPE(items[i])->tp_name);
            Py_DECREF(seq);
            return NULL;
        }
        Lease *lease = (Lease *)items[i];
        if (lease->released) {
            PyErr_Format(lease->leaser->lease_error, "layer %d expert %d: used after its lease "
                         "was released", lease->layer, lease->expert);
            Py_DECREF(seq);
            return NULL;
        }
        out[i] = lease->view;   /* read by the kernel call only; the lease stays the lease's */
    }
    Py_DECREF(seq);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef module_methods[] = {
    {"copy_views", (PyCFunction)(void (*)(void))module_copy_views, METH_FASTCALL,
     "copy_views(leases, address): the leases' C views into the array at address."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef lease_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "colibri._lease",
    .m_doc = "colibri's lease hit path in C (see csrc/py_lease.c).",
    .m_size = 0,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__lease(void) {
    if (PyType_Ready(&LeaseBaseType) < 0 || PyType_Ready(&LeaserType) < 0 ||
        PyType_Ready(&TenancyType) < 0 || PyType_Ready(&TenanciesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&lease_module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "LeaseBase", (PyObject *)&LeaseBaseType) < 0 ||
        PyModule_AddObjectRef(m, "Leaser", (PyObject *)&LeaserType) < 0 ||
        PyModule_AddObjectRef(m, "Tenancy", (PyObject *)&TenancyType) < 0 ||
        PyModule_AddObjectRef(m, "Tenancies", (PyObject *)&TenanciesType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
