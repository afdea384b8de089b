/* The gateway's per-token hot path in C: vLLM's sha256 block keys and the token-id check.

   Optional: router/native.py falls back to the pure-Python path (router/hashing.py,
   msgspec, struct) when this module was not built, and tests/router/test_native.py
   checks both give the same bytes.

   chain_sha256 hashes what vLLM 0.32 hashes for a block whose extra keys are None:
   sha256 of pickle.dumps((parent, tuple(block), None), protocol=5) ("sha256"), or of
   cbor2.dumps(..., canonical=True) ("sha256_cbor"). It writes those serializations
   directly (the exact bytes CPython's C pickler and cbor2 produce for that shape, see
   the writers below), so a block costs one SHA-256 of ~100 bytes and no Python objects.
   Anything outside the shape it knows (an id that is not an exact int, or beyond the
   encodings below) raises ValueError, and the caller takes the Python path.

   check_ids packs a list of token ids as little-endian int64 after checking each is an
   exact int in [0, 2**63): msgspec.convert's check and struct.pack in one pass.

   prompt_ids finds a completions body's top-level "prompt" and, where it is a flat
   array of plain non-negative integers, reads it straight into packed int64: no Python
   int per id (8k of them cost ~150 us to create here, most of decoding such a body).
   It reads only the common shape and answers None for anything else, so the caller's
   generic decode keeps deciding, and wording, everything unusual.
*/
#define PY_SSIZE_T_CLEAN
/* SHA256_Init/Update/Final: deprecated in OpenSSL 3 in favour of EVP, whose one-shot
   SHA256() fetches the algorithm on every call (about 0.5 us, five times the hash of a
   100-byte block); the low-level calls run the same SHA-NI/AVX2 code without it. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <Python.h>
#include <openssl/sha.h>
#include <stdint.h>
#include <string.h>

/* A block of up to 4096 tokens serializes within this many bytes: at most 10 per id
   (LONG1), and the rest (opcodes, frame, a parent of up to 255 bytes) within 512. */
#define MAX_BLOCK_TOKENS 4096
#define BUF_BYTES (512 + 10 * MAX_BLOCK_TOKENS)

/* One id as an int64, or -1 with ValueError set: exact ints only (bool is a subclass and
   pickles differently), non-negative, within int64. */
static int64_t
id_value(PyObject *item)
{
    if (!PyLong_CheckExact(item)) {
        PyErr_SetString(PyExc_ValueError, "token id is not an int");
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || v < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "token id out of range [0, 2**63)");
        return -1;
    }
    return (int64_t)v;
}

static void
put_le(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void
put_be(unsigned char *p, uint64_t v, int n)
{
    for (int i = 0; i < n; i++)
        p[i] = (unsigned char)(v >> (8 * (n - 1 - i)));
}

/* pickle protocol 5, as CPython's _pickle writes (parent, (ids...), None):
     PROTO 5, FRAME <u64 len>, SHORT_BINBYTES <n> parent, MEMOIZE,
     [MARK ids TUPLE | ids TUPLE1..3], MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP
   ids: BININT1 below 256, BININT2 below 65536, BININT below 2**31, else LONG1 with
   (bit_length >> 3) + 1 little-endian bytes (save_long's length for a positive int). */
static Py_ssize_t
pickle_block(unsigned char *buf, const unsigned char *parent, Py_ssize_t plen,
             const int64_t *ids, Py_ssize_t n)
{
    unsigned char *p = buf;
    *p++ = 0x80; *p++ = 5;
    unsigned char *frame = p;
    p += 9;
    *p++ = 'C'; *p++ = (unsigned char)plen;
    memcpy(p, parent, (size_t)plen); p += plen;
    *p++ = 0x94;
    if (n > 3)
        *p++ = '(';
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)ids[i];
        if (v < 256) {
            *p++ = 'K'; *p++ = (unsigned char)v;
        } else if (v < 65536) {
            *p++ = 'M'; put_le(p, v, 2); p += 2;
        } else if (v < 0x80000000ULL) {
            *p++ = 'J'; put_le(p, v, 4); p += 4;
        } else {
            int bits = 64 - __builtin_clzll(v);
            int nbytes = (bits >> 3) + 1;
            *p++ = 0x8a; *p++ = (unsigned char)nbytes;
            put_le(p, v, nbytes);  /* v < 2**63: at most 8 bytes */
            p += nbytes;
        }
    }
    if (n > 3)
        *p++ = 't';
    else
        *p++ = (unsigned char)(0x85 + n - 1);  /* TUPLE1, TUPLE2, TUPLE3 */
    *p++ = 0x94;
    *p++ = 'N';
    *p++ = 0x87;
    *p++ = 0x94;
    *p++ = '.';
    frame[0] = 0x95;
    put_le(frame + 1, (uint64_t)(p - frame - 9), 8);
    return p - buf;
}

/* CBOR head: major type and argument, shortest form (canonical). */
static unsigned char *
cbor_head(unsigned char *p, int major, uint64_t v)
{
    unsigned char m = (unsigned char)(major << 5);
    if (v < 24) {
        *p++ = m | (unsigned char)v;
    } else if (v < 256) {
        *p++ = m | 24; *p++ = (unsigned char)v;
    } else if (v < 65536) {
        *p++ = m | 25; put_be(p, v, 2); p += 2;
    } else if (v < 0x100000000ULL) {
        *p++ = m | 26; put_be(p, v, 4); p += 4;
    } else {
        *p++ = m | 27; put_be(p, v, 8); p += 8;
    }
    return p;
}

/* cbor2.dumps((parent, (ids...), None), canonical=True): array(3), bytes, array(n) of
   unsigned ints, null. */
static Py_ssize_t
cbor_block(unsigned char *buf, const unsigned char *parent, Py_ssize_t plen,
           const int64_t *ids, Py_ssize_t n)
{
    unsigned char *p = buf;
    *p++ = 0x83;
    p = cbor_head(p, 2, (uint64_t)plen);
    memcpy(p, parent, (size_t)plen); p += plen;
    p = cbor_head(p, 4, (uint64_t)n);
    for (Py_ssize_t i = 0; i < n; i++)
        p = cbor_head(p, 0, (uint64_t)ids[i]);
    *p++ = 0xf6;
    return p - buf;
}

/* chain_sha256(cbor, parent, tokens, start, stop, block_size) -> list[bytes]

   The keys of the full blocks of tokens[start:stop] (a list of ints, or a buffer of
   int64 such as prompt_ids packs), chained from `parent`, for blocks whose extra keys
   are None. */
static PyObject *
chain_sha256(PyObject *Py_UNUSED(self), PyObject *args)
{
    int cbor;
    Py_buffer parent;
    PyObject *tokens;
    Py_ssize_t start, stop, size;
    if (!PyArg_ParseTuple(args, "py*Onnn", &cbor, &parent, &tokens, &start, &stop, &size))
        return NULL;
    PyObject *keys = NULL;
    Py_buffer packed = {0};
    const int64_t *column = NULL;  /* the ids, where given packed */
    Py_ssize_t count;
    if (PyList_Check(tokens)) {
        count = PyList_GET_SIZE(tokens);
    } else {
        if (PyObject_GetBuffer(tokens, &packed, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (packed.itemsize != 8 || packed.format == NULL || strcmp(packed.format, "q") != 0) {
            PyErr_SetString(PyExc_ValueError, "packed tokens must be int64 ('q')");
            goto done;
        }
        column = packed.buf;
        count = packed.len / 8;
    }
    if (size <= 0 || size > MAX_BLOCK_TOKENS || parent.len > 255 || start < 0
        || stop > count || start > stop || (stop - start) % size) {
        PyErr_SetString(PyExc_ValueError, "bad block range or parent");
        goto done;
    }
    Py_ssize_t blocks = (stop - start) / size;
    keys = PyList_New(blocks);
    if (keys == NULL)
        goto done;
    unsigned char buf[BUF_BYTES];
    int64_t ids[MAX_BLOCK_TOKENS];
    unsigned char digest[SHA256_DIGEST_LENGTH];
    const unsigned char *prev = parent.buf;
    Py_ssize_t prev_len = parent.len;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t first = start + b * size;
        for (Py_ssize_t i = 0; i < size; i++) {
            int64_t v;
            if (column != NULL) {
                v = column[first + i];
                if (v < 0)
                    PyErr_SetString(PyExc_ValueError, "token id out of range [0, 2**63)");
            } else {
                v = id_value(PyList_GET_ITEM(tokens, first + i));
            }
            if (v < 0) {
                Py_CLEAR(keys);
                goto done;
            }
            ids[i] = v;
        }
        Py_ssize_t len = cbor ? cbor_block(buf, prev, prev_len, ids, size)
                              : pickle_block(buf, prev, prev_len, ids, size);
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, buf, (size_t)len);
        SHA256_Final(digest, &ctx);
        PyObject *key = PyBytes_FromStringAndSize((const char *)digest, SHA256_DIGEST_LENGTH);
        if (key == NULL) {
            Py_CLEAR(keys);
            goto done;
        }
        PyList_SET_ITEM(keys, b, key);
        prev = (const unsigned char *)PyBytes_AS_STRING(key);
        prev_len = SHA256_DIGEST_LENGTH;
    }
done:
    if (packed.obj != NULL)
        PyBuffer_Release(&packed);
    PyBuffer_Release(&parent);
    return keys;
}

/* check_ids(ids, count=-1) -> bytes: ids[:count] as little-endian int64, each checked
   to be an exact int in [0, 2**63); ValueError naming the first that is not. */
static PyObject *
check_ids(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *ids;
    Py_ssize_t count = -1;
    if (!PyArg_ParseTuple(args, "O!|n", &PyList_Type, &ids, &count))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids);
    if (count >= 0 && count < n)
        n = count;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = id_value(PyList_GET_ITEM(ids, i));
        if (v < 0) {
            Py_DECREF(out);
            PyErr_Format(PyExc_ValueError, "token id at index %zd is not an integer in "
                         "[0, 2**63)", i);
            return NULL;
        }
        uint64_t le = (uint64_t)v;
#if PY_BIG_ENDIAN
        le = __builtin_bswap64(le);
#endif
        memcpy(p + 8 * i, &le, 8);
    }
    return out;
}

/* JSON whitespace. */
static const unsigned char *
skip_ws(const unsigned char *p, const unsigned char *end)
{
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r'))
        p++;
    return p;
}

/* Past a string starting at p ('"'), or NULL where it does not close. */
static const unsigned char *
skip_string(const unsigned char *p, const unsigned char *end)
{
    for (p++; p < end; p++) {
        if (*p == '\\')
            p++;  /* the escaped character, whatever it is */
        else if (*p == '"')
            return p + 1;
    }
    return NULL;
}

/* Past one value starting at p, or NULL. Not a validator: it only has to find where a
   well-formed value ends (strings read with their escapes, brackets counted); the
   caller's decoder checks the rest of the body. */
static const unsigned char *
skip_value(const unsigned char *p, const unsigned char *end)
{
    if (p >= end)
        return NULL;
    if (*p == '"')
        return skip_string(p, end);
    if (*p == '{' || *p == '[') {
        Py_ssize_t depth = 0;
        while (p < end) {
            unsigned char c = *p;
            if (c == '"') {
                p = skip_string(p, end);
                if (p == NULL)
                    return NULL;
                continue;
            }
            if (c == '{' || c == '[')
                depth++;
            else if (c == '}' || c == ']') {
                if (--depth == 0)
                    return p + 1;
            }
            p++;
        }
        return NULL;
    }
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t'
           && *p != '\n' && *p != '\r')
        p++;
    return p;
}

/* The ids of a flat array of plain non-negative integers starting at p ('['), read
   into out; returns past the array's ']', or NULL for any other shape (empty, negative,
   a fraction or an exponent, a leading zero, beyond int64, nested, a string). One pass:
   up to 18 digits cannot overflow, the 19th is checked, a 20th refused. */
static const unsigned char *
read_ids(const unsigned char *p, const unsigned char *end, int64_t *out, Py_ssize_t *count)
{
    Py_ssize_t n = 0;
    p = skip_ws(p + 1, end);
    if (p < end && *p == ']')
        return NULL;
    for (;;) {
        if (p >= end || (unsigned)(*p - '0') > 9)
            return NULL;
        const unsigned char *first = p;
        uint64_t v = 0;
        while (p < end && (unsigned)(*p - '0') <= 9 && p - first < 18)
            v = v * 10 + (unsigned)(*p++ - '0');
        if (p < end && (unsigned)(*p - '0') <= 9) {  /* a 19th digit */
            unsigned d = (unsigned)(*p++ - '0');
            if (v > (((uint64_t)INT64_MAX) - d) / 10)
                return NULL;
            v = v * 10 + d;
            if (p < end && (unsigned)(*p - '0') <= 9)
                return NULL;
        }
        if (*first == '0' && p - first > 1)
            return NULL;  /* a leading zero: not JSON */
        out[n++] = (int64_t)v;
        if (p < end && *p == ',') {
            p++;
        } else {
            p = skip_ws(p, end);
            if (p < end && *p == ']') {
                *count = n;
                return p + 1;
            }
            if (p >= end || *p != ',')
                return NULL;
            p++;
        }
        if (p < end && (unsigned)(*p - '0') > 9)
            p = skip_ws(p, end);
    }
}

/* prompt_ids(body) -> (start, stop, packed) | None

   Where `body` (bytes-like) is a JSON object whose one top-level "prompt" is a flat
   array of plain non-negative integers: the array's byte span and its ids as native
   int64. None for every other body: no "prompt", a text or batched or empty one, a key
   written with escapes, a second "prompt", anything after the object. */
static PyObject *
prompt_ids(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer raw;
    if (!PyArg_ParseTuple(args, "y*", &raw))
        return NULL;
    const unsigned char *buf = raw.buf;
    const unsigned char *end = buf + raw.len;
    const unsigned char *vstart = NULL, *vend = NULL;
    PyObject *packed = NULL;
    Py_ssize_t n = 0;
    int failed = 0;  /* an exception is set: not a None answer */
    const unsigned char *p = skip_ws(buf, end);
    if (p >= end || *p != '{')
        goto none;
    p = skip_ws(p + 1, end);
    if (p < end && *p == '}')
        goto none;
    for (;;) {
        if (p >= end || *p != '"')
            goto none;
        const unsigned char *key = p + 1;
        p = skip_string(p, end);
        if (p == NULL || memchr(key, '\\', (size_t)(p - 1 - key)) != NULL)
            goto none;
        int is_prompt = (p - 1 - key) == 6 && memcmp(key, "prompt", 6) == 0;
        p = skip_ws(p, end);
        if (p >= end || *p != ':')
            goto none;
        p = skip_ws(p + 1, end);
        if (!is_prompt) {
            p = skip_value(p, end);
        } else {
            if (vstart != NULL || p >= end || *p != '[')
                goto none;
            /* Every id takes at least one digit and one separator, but the last. */
            packed = PyBytes_FromStringAndSize(NULL, ((end - p) / 2 + 1) * 8);
            if (packed == NULL) {
                failed = 1;
                goto none;
            }
            vstart = p;
            p = vend = read_ids(p, end, (int64_t *)PyBytes_AS_STRING(packed), &n);
        }
        if (p == NULL)
            goto none;
        p = skip_ws(p, end);
        if (p < end && *p == ',') {
            p = skip_ws(p + 1, end);
            continue;
        }
        if (p < end && *p == '}')
            break;
        goto none;
    }
    if (vstart == NULL || skip_ws(p + 1, end) != end)
        goto none;
    PyBuffer_Release(&raw);
    if (_PyBytes_Resize(&packed, n * 8) < 0)
        return NULL;
    return Py_BuildValue("(nnN)", (Py_ssize_t)(vstart - buf), (Py_ssize_t)(vend - buf),
                         packed);
none:
    Py_XDECREF(packed);
    PyBuffer_Release(&raw);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"chain_sha256", chain_sha256, METH_VARARGS,
     "chain_sha256(cbor, parent, tokens, start, stop, block_size) -> list[bytes]"},
    {"check_ids", check_ids, METH_VARARGS,
     "check_ids(ids, count=-1) -> bytes: little-endian int64, each id checked"},
    {"prompt_ids", prompt_ids, METH_VARARGS,
     "prompt_ids(body) -> (start, stop, packed int64) | None: a flat token-id prompt"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "router._keys",
    "vLLM's sha256 block keys and the token-id check in C (router/native.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__keys(void)
{
    return PyModule_Create(&module);
}
