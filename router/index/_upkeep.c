/* The in-process index's per-block upkeep in C: MemoryIndex._put's and _forget's loops.

   Optional: router/index/memory.py runs the same loops in Python where this module was
   not built (or CACHEROUTE_NATIVE=0), and tests/router/test_index_upkeep.py drives both
   through random histories and compares every structure they leave.

   Why: a KV-event batch names every block a replica stored or evicted, one by one. A
   cold 8k-token prompt at block size 16 is 512 stored and, on a full cache, as many
   evicted: in Python about 1.4 us a block (some ten dict operations and the loop's own
   bytecode), about 40% of the gateway's CPU on cold prompts (py-spy). Here the same dict
   operations run without the interpreter between them.

   The structures stay the Python ones MemoryIndex owns (it reads them for lookups):
     holders  dict: block key -> dict replica -> expiry
     lru      OrderedDict: block key -> parent key or None, least recently touched first
     kids     dict: parent key -> how many held blocks name it
   Writes to the OrderedDict go through the mapping protocol (PyObject_SetItem,
   PyObject_DelItem), never PyDict_SetItem, which would bypass its linked order. Reads
   may use the dict API: an OrderedDict is a dict.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *str_move_to_end;

/* kids.get(key, 0) as a C integer, or -1 with an exception set. */
static Py_ssize_t
kid_count(PyObject *kids, PyObject *key)
{
    PyObject *n = PyDict_GetItemWithError(kids, key); /* borrowed */
    if (n == NULL)
        return PyErr_Occurred() ? -1 : 0;
    return PyLong_AsSsize_t(n);
}

static int
set_count(PyObject *kids, PyObject *key, Py_ssize_t n)
{
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL)
        return -1;
    int rc = PyDict_SetItem(kids, key, v);
    Py_DECREF(v);
    return rc;
}

/* put(holders, lru, kids, keys, replica, expiry, parent) -> the change in orphans.

   Exactly MemoryIndex._put_blocks: tail first, so block 0 ends most recently touched;
   a block already held is only touched; a new one records its parent (the previous
   key, or `parent` for the first) and keeps the kid and orphan counts exact. */
static PyObject *
put(PyObject *self, PyObject *args)
{
    PyObject *holders, *lru, *kids, *keys_in, *replica, *expiry, *parent;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOO", &PyDict_Type, &holders, &PyDict_Type, &lru,
                          &PyDict_Type, &kids, &keys_in, &replica, &expiry, &parent))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be a sequence");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t orphans = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *key = items[i];
        PyObject *held = PyDict_GetItemWithError(holders, key); /* borrowed */
        if (held == NULL) {
            if (PyErr_Occurred())
                goto fail;
            PyObject *fresh = PyDict_New();
            if (fresh == NULL)
                goto fail;
            if (PyDict_SetItem(fresh, replica, expiry) < 0 ||
                PyDict_SetItem(holders, key, fresh) < 0) {
                Py_DECREF(fresh);
                goto fail;
            }
            Py_DECREF(fresh);
        }
        else if (!PyDict_Check(held) || PyDict_SetItem(held, replica, expiry) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "holders' values must be dicts");
            goto fail;
        }
        int in_lru = PyDict_Contains(lru, key);
        if (in_lru < 0)
            goto fail;
        if (in_lru) {
            PyObject *r = PyObject_CallMethodOneArg(lru, str_move_to_end, key);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
            continue;
        }
        PyObject *up = i ? items[i - 1] : parent;
        if (PyObject_SetItem(lru, key, up) < 0)
            goto fail;
        Py_ssize_t had = kid_count(kids, key); /* its held children have their parent */
        if (had < 0)
            goto fail;
        orphans -= had;
        if (up != Py_None) {
            Py_ssize_t c = kid_count(kids, up);
            if (c < 0 || set_count(kids, up, c + 1) < 0)
                goto fail;
            int up_held = PyDict_Contains(lru, up);
            if (up_held < 0)
                goto fail;
            if (!up_held)
                orphans += 1;
        }
    }
    Py_DECREF(keys);
    return PyLong_FromSsize_t(orphans);
fail:
    Py_DECREF(keys);
    return NULL;
}

/* forget(holders, lru, kids, keys, replica) -> the change in orphans.

   Exactly MemoryIndex._forget_blocks: each key the replica holds leaves its LRU and its
   holder entry (the entry goes when no replica is left), its held children become
   orphans, and its parent loses a kid. */
static PyObject *
forget(PyObject *self, PyObject *args)
{
    PyObject *holders, *lru, *kids, *keys_in, *replica;
    if (!PyArg_ParseTuple(args, "O!O!O!OO", &PyDict_Type, &holders, &PyDict_Type, &lru,
                          &PyDict_Type, &kids, &keys_in, &replica))
        return NULL;
    PyObject *keys = PySequence_Fast(keys_in, "keys must be iterable");
    if (keys == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t orphans = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        PyObject *up = PyDict_GetItemWithError(lru, key); /* borrowed, from the dict side */
        if (up == NULL) {
            if (PyErr_Occurred())
                goto fail;
            continue;
        }
        Py_INCREF(up);
        if (PyObject_DelItem(lru, key) < 0) {
            Py_DECREF(up);
            goto fail;
        }
        PyObject *held = PyDict_GetItemWithError(holders, key);
        if (held == NULL && PyErr_Occurred()) {
            Py_DECREF(up);
            goto fail;
        }
        if (held != NULL && PyDict_Check(held)) {
            int has = PyDict_Contains(held, replica);
            if (has < 0 || (has && PyDict_DelItem(held, replica) < 0) ||
                (PyDict_GET_SIZE(held) == 0 && PyDict_DelItem(holders, key) < 0)) {
                Py_DECREF(up);
                goto fail;
            }
        }
        Py_ssize_t had = kid_count(kids, key); /* its held children lose their parent */
        if (had < 0) {
            Py_DECREF(up);
            goto fail;
        }
        orphans += had;
        if (up != Py_None) {
            Py_ssize_t left = kid_count(kids, up);
            if (left < 0) {
                Py_DECREF(up);
                goto fail;
            }
            left -= 1;
            int rc;
            if (left > 0)
                rc = set_count(kids, up, left);
            else {
                rc = PyDict_Contains(kids, up);
                if (rc > 0)
                    rc = PyDict_DelItem(kids, up);
            }
            int up_held = rc < 0 ? -1 : PyDict_Contains(lru, up);
            Py_DECREF(up);
            if (up_held < 0)
                goto fail;
            if (!up_held)
                orphans -= 1; /* it was one itself */
        }
        else
            Py_DECREF(up);
    }
    Py_DECREF(keys);
    return PyLong_FromSsize_t(orphans);
fail:
    Py_DECREF(keys);
    return NULL;
}

static PyMethodDef methods[] = {
    {"put", put, METH_VARARGS,
     "put(holders, lru, kids, keys, replica, expiry, parent) -> change in orphans"},
    {"forget", forget, METH_VARARGS,
     "forget(holders, lru, kids, keys, replica) -> change in orphans"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_upkeep",
    "MemoryIndex's per-block upkeep in C (see router/index/_upkeep.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__upkeep(void)
{
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    if (str_move_to_end == NULL)
        return NULL;
    return PyModule_Create(&module);
}
