/* kvstore.net._hot: the compiled part of the small-message path (issue 39).
 *
 * Framing, MAC and encoding only, byte for byte what the pure-Python modules produce:
 *   - Key(key, size): an HMAC-SHA256 key (the channel's session key; MACs cut to size bytes) with its
 *     inner and outer states computed once; Key.mac(frames) is kvstore.net.auth.Channel._mac (over the
 *     frame count, every frame's length and the first frame), Key.seal(...) builds a whole compact frame
 *     [MAC | fields | label | to | key | array] (kvstore.net.compact.pack plus its MAC) and
 *     Key.verify(frame) checks a compact frame's MAC in constant time.
 *   - unpack(body): kvstore.net.compact.unpack's checks, in the same order with the same messages,
 *     returning the message's fields as a tuple (Python makes the Message and its array view).
 * Round semantics never come here.  configure() must be called once (kvstore.net.compact does) with the
 * ProtocolError class and the layout's constants, so they are defined in Python only.
 * SHA-256 is FIPS 180-4, written out here so the module needs no library beyond Python's headers; on x86-64
 * CPUs with the SHA extensions (SHA_EXTENSIONS: 1) its compression uses them, as OpenSSL does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* -- SHA-256 ------------------------------------------------------------------------------------ */

typedef struct {
    uint32_t h[8];
    uint64_t length;  /* bytes absorbed */
    uint8_t block[64];
    size_t used;
} Sha256;

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha_compress(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64], a, b, c, d, e, f, g, k, t1, t2;
    int i;
    for (i = 0; i < 16; i++)
        w[i] = ((uint32_t)p[4 * i] << 24) | ((uint32_t)p[4 * i + 1] << 16) | ((uint32_t)p[4 * i + 2] << 8)
               | (uint32_t)p[4 * i + 3];
    for (i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = h[0]; b = h[1]; c = h[2]; d = h[3]; e = h[4]; f = h[5]; g = h[6]; k = h[7];
    for (i = 0; i < 64; i++) {
        t1 = k + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + K256[i] + w[i];
        t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
}

/* x86-64 with the SHA extensions (checked at import by cpuid): the same compression, 4-5x faster. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#define HOT_SHA_NI 1

__attribute__((target("sha,sse4.1,ssse3"))) static void sha_compress_ni(uint32_t h[8], const uint8_t *p,
                                                                         size_t blocks) {
    const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i state0, state1, tmp, msg, abef, cdgh, w[4];
    size_t b;
    int i;
    tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1);  /* CDAB */
    state1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B);  /* EFGH */
    state0 = _mm_alignr_epi8(tmp, state1, 8);  /* ABEF */
    state1 = _mm_blend_epi16(state1, tmp, 0xF0);  /* CDGH */
    for (b = 0; b < blocks; b++, p += 64) {
        abef = state0;
        cdgh = state1;
        for (i = 0; i < 16; i++) {  /* four rounds each; w[i % 4] holds schedule words 4i..4i+3 */
            __m128i x;
            if (i < 4) {
                x = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * i)), mask);
            } else {
                x = _mm_sha256msg1_epu32(w[i % 4], w[(i + 1) % 4]);
                x = _mm_add_epi32(x, _mm_alignr_epi8(w[(i + 3) % 4], w[(i + 2) % 4], 4));
                x = _mm_sha256msg2_epu32(x, w[(i + 3) % 4]);
            }
            w[i % 4] = x;
            msg = _mm_add_epi32(x, _mm_loadu_si128((const __m128i *)&K256[4 * i]));
            state1 = _mm_sha256rnds2_epu32(state1, state0, msg);
            state0 = _mm_sha256rnds2_epu32(state0, state1, _mm_shuffle_epi32(msg, 0x0E));
        }
        state0 = _mm_add_epi32(state0, abef);
        state1 = _mm_add_epi32(state1, cdgh);
    }
    tmp = _mm_shuffle_epi32(state0, 0x1B);  /* FEBA */
    state1 = _mm_shuffle_epi32(state1, 0xB1);  /* DCHG */
    state0 = _mm_blend_epi16(tmp, state1, 0xF0);  /* DCBA */
    state1 = _mm_alignr_epi8(state1, tmp, 8);  /* HGFE */
    _mm_storeu_si128((__m128i *)&h[0], state0);
    _mm_storeu_si128((__m128i *)&h[4], state1);
}

static int cpu_has_sha(void) {
    unsigned int a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19)) || !(c & (1u << 9)))  /* SSE4.1, SSSE3 */
        return 0;
    if (__get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1;  /* SHA */
}
#endif

static int use_sha_ni = 0;  /* set at import */

static void sha_blocks(uint32_t h[8], const uint8_t *p, size_t blocks) {
#ifdef HOT_SHA_NI
    if (use_sha_ni) {
        sha_compress_ni(h, p, blocks);
        return;
    }
#endif
    for (; blocks; blocks--, p += 64)
        sha_compress(h, p);
}

static void sha_init(Sha256 *s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->h, iv, sizeof iv);
    s->length = 0;
    s->used = 0;
}

static void sha_update(Sha256 *s, const uint8_t *p, size_t n) {
    s->length += n;
    if (s->used) {
        size_t take = 64 - s->used < n ? 64 - s->used : n;
        memcpy(s->block + s->used, p, take);
        s->used += take; p += take; n -= take;
        if (s->used < 64)
            return;
        sha_blocks(s->h, s->block, 1);
        s->used = 0;
    }
    if (n >= 64) {
        sha_blocks(s->h, p, n / 64);
        p += n & ~(size_t)63;
        n &= 63;
    }
    memcpy(s->block, p, n);
    s->used = n;
}

static void sha_final(Sha256 *s, uint8_t out[32]) {
    uint64_t bits = s->length * 8;
    uint8_t pad[72] = {0x80};
    size_t padn = (s->used < 56 ? 56 : 120) - s->used;
    int i;
    for (i = 0; i < 8; i++)
        pad[padn + i] = (uint8_t)(bits >> (56 - 8 * i));
    sha_update(s, pad, padn + 8);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24); out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8); out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

/* -- module state: set once by configure() ------------------------------------------------------- */

static PyObject *ProtocolError = NULL;
static int version = -1, marker = -1, nodtype = 255;
static Py_ssize_t fields_size = 49, max_bytes = 0;
static int op_ok = -1, op_push = -1, op_pull = -1, op_pushpull = -1;
static Py_ssize_t itemsizes[64];
static int ndtypes = 0;
static PyObject *dtype_names = NULL;  /* a tuple of str, by code */
static PyObject *str_keys, *str_sizes, *str_rounds;

static PyObject *protocol_error(const char *format, ...) {
    va_list args;
    PyObject *text;
    va_start(args, format);
    text = PyUnicode_FromFormatV(format, args);
    va_end(args);
    if (text != NULL) {
        PyErr_SetObject(ProtocolError, text);
        Py_DECREF(text);
    }
    return NULL;
}

/* -- Key -------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Sha256 inner, outer;  /* after the key's ipad and opad blocks */
    Py_ssize_t size;  /* MAC bytes kept (the digest's first ones) */
} KeyObject;

static int Key_init(KeyObject *self, PyObject *args, PyObject *kwds) {
    Py_buffer key;
    uint8_t block[64], digest[32];
    const uint8_t *k;
    size_t n;
    int i;
    Py_ssize_t size;
    static char *names[] = {"key", "size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*n", names, &key, &size))
        return -1;
    if (size < 1 || size > 32) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "a MAC keeps 1 to 32 bytes");
        return -1;
    }
    self->size = size;
    k = key.buf;
    n = (size_t)key.len;
    if (n > 64) {  /* HMAC: a key longer than a block is hashed first */
        Sha256 s;
        sha_init(&s);
        sha_update(&s, k, n);
        sha_final(&s, digest);
        k = digest;
        n = 32;
    }
    memset(block, 0, 64);
    memcpy(block, k, n);
    PyBuffer_Release(&key);
    for (i = 0; i < 64; i++)
        block[i] ^= 0x36;
    sha_init(&self->inner);
    sha_update(&self->inner, block, 64);
    for (i = 0; i < 64; i++)
        block[i] ^= 0x36 ^ 0x5c;
    sha_init(&self->outer);
    sha_update(&self->outer, block, 64);
    return 0;
}

/* The MAC of one message: HMAC(key, be32(count) || be64(len) for each part || head), truncated. */
static void frames_mac(KeyObject *self, Py_ssize_t count, const Py_ssize_t *lengths, const uint8_t *head,
                       Py_ssize_t head_len, uint8_t out[32]) {
    Sha256 s = self->inner;
    uint8_t word[8], digest[32];
    Py_ssize_t i;
    int j;
    for (j = 0; j < 4; j++)
        word[j] = (uint8_t)((uint64_t)count >> (24 - 8 * j));
    sha_update(&s, word, 4);
    for (i = 0; i < count; i++) {
        for (j = 0; j < 8; j++)
            word[j] = (uint8_t)((uint64_t)lengths[i] >> (56 - 8 * j));
        sha_update(&s, word, 8);
    }
    sha_update(&s, head, (size_t)head_len);
    sha_final(&s, digest);
    s = self->outer;
    sha_update(&s, digest, 32);
    sha_final(&s, out);
}

static PyObject *Key_mac(KeyObject *self, PyObject *frames) {
    PyObject *seq, *result = NULL;
    Py_ssize_t count, i, stack[8], *lengths = stack;
    Py_buffer head;
    uint8_t digest[32];
    if (self->size == 0) {
        PyErr_SetString(PyExc_RuntimeError, "this Key was not initialised");
        return NULL;
    }
    seq = PySequence_Fast(frames, "frames must be a list of buffers");
    if (seq == NULL)
        return NULL;
    count = PySequence_Fast_GET_SIZE(seq);
    if (count < 1) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "a MAC needs at least one frame");
        return NULL;
    }
    if (count > 8 && (lengths = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)count)) == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (i = 0; i < count; i++) {  /* memoryview(frame).nbytes of every frame, any layout */
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &view, PyBUF_RECORDS_RO) < 0)
            goto done;
        lengths[i] = view.len;
        PyBuffer_Release(&view);
    }
    if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, 0), &head, PyBUF_SIMPLE) < 0)
        goto done;
    frames_mac(self, count, lengths, head.buf, head.len, digest);
    PyBuffer_Release(&head);
    result = PyBytes_FromStringAndSize((const char *)digest, self->size);
done:
    if (lengths != stack)
        PyMem_Free(lengths);
    Py_DECREF(seq);
    return result;
}

static void put_le(uint8_t *p, uint64_t v, int n) {
    int i;
    for (i = 0; i < n; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    int i;
    for (i = n - 1; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* seal(op, kind, code, label, to, key, seq, sender, n, size, round, array): the whole compact frame. */
static PyObject *Key_seal(KeyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int op, kind, code;
    const char *label, *to, *keyp = NULL;
    Py_ssize_t nl, nt, nk = 0, total;
    uint8_t keybytes[8], digest[32], *p;
    unsigned long long seq, n;
    long long sender, size, round_;
    Py_buffer array = {0};
    PyObject *out;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "seal takes 12 arguments");
        return NULL;
    }
    if (self->size == 0 || ProtocolError == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an initialised Key and kvstore.net._hot.configure() are needed");
        return NULL;
    }
    op = (int)PyLong_AsLong(args[0]);
    kind = (int)PyLong_AsLong(args[1]);
    code = (int)PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if ((label = PyUnicode_AsUTF8AndSize(args[3], &nl)) == NULL || (to = PyUnicode_AsUTF8AndSize(args[4], &nt)) == NULL)
        return NULL;
    if (nl > 255 || nt > 255)
        return protocol_error("a channel label or addressee over 255 bytes cannot be sent compact");
    if (kind == 1) {
        unsigned long long k = PyLong_AsUnsignedLongLong(args[5]);
        if (k == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        put_le(keybytes, k, 8);
        keyp = (const char *)keybytes;
        nk = 8;
    } else if (kind == 2) {
        if ((keyp = PyUnicode_AsUTF8AndSize(args[5], &nk)) == NULL)
            return NULL;
        if (nk > 0xffff) {
            PyErr_SetString(PyExc_OverflowError, "key too long");
            return NULL;
        }
    }
    seq = PyLong_AsUnsignedLongLong(args[6]);
    sender = PyLong_AsLongLong(args[7]);
    n = PyLong_AsUnsignedLongLong(args[8]);
    size = PyLong_AsLongLong(args[9]);
    round_ = PyLong_AsLongLong(args[10]);
    if (PyErr_Occurred())
        return NULL;
    if (args[11] != Py_None && PyObject_GetBuffer(args[11], &array, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    total = self->size + fields_size + nl + nt + nk + array.len;
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        if (array.obj)
            PyBuffer_Release(&array);
        return NULL;
    }
    p = (uint8_t *)PyBytes_AS_STRING(out) + self->size;
    p[0] = (uint8_t)marker; p[1] = (uint8_t)version; p[2] = (uint8_t)op; p[3] = (uint8_t)kind;
    p[4] = (uint8_t)code; p[5] = (uint8_t)nl; p[6] = (uint8_t)nt;
    put_le(p + 7, (uint64_t)nk, 2);
    put_le(p + 9, seq, 8);
    put_le(p + 17, (uint64_t)sender, 8);
    put_le(p + 25, n, 8);
    put_le(p + 33, (uint64_t)size, 8);
    put_le(p + 41, (uint64_t)round_, 8);
    p += fields_size;
    memcpy(p, label, (size_t)nl); p += nl;
    memcpy(p, to, (size_t)nt); p += nt;
    if (nk)
        memcpy(p, keyp, (size_t)nk);
    p += nk;
    if (array.obj) {
        memcpy(p, array.buf, (size_t)array.len);
        PyBuffer_Release(&array);
    }
    {
        Py_ssize_t body = total - self->size;
        uint8_t *frame = (uint8_t *)PyBytes_AS_STRING(out);
        frames_mac(self, 1, &body, frame + self->size, body, digest);
        memcpy(frame, digest, (size_t)self->size);
    }
    return out;
}

/* verify(frame): whether a compact frame's first 16 bytes are the MAC of the rest (constant time). */
static PyObject *Key_verify(KeyObject *self, PyObject *frame) {
    Py_buffer view;
    uint8_t digest[32], diff = 0;
    Py_ssize_t body, i;
    if (self->size == 0) {
        PyErr_SetString(PyExc_RuntimeError, "this Key was not initialised");
        return NULL;
    }
    if (PyObject_GetBuffer(frame, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len < self->size) {
        PyBuffer_Release(&view);
        Py_RETURN_FALSE;
    }
    body = view.len - self->size;
    frames_mac(self, 1, &body, (const uint8_t *)view.buf + self->size, body, digest);
    for (i = 0; i < self->size; i++)
        diff |= digest[i] ^ ((const uint8_t *)view.buf)[i];
    PyBuffer_Release(&view);
    return PyBool_FromLong(diff == 0);
}

static PyMethodDef Key_methods[] = {
    {"mac", (PyCFunction)Key_mac, METH_O, "The header MAC of frames (auth.Channel._mac)."},
    {"seal", (PyCFunction)(void (*)(void))Key_seal, METH_FASTCALL, "A whole compact frame, MAC first."},
    {"verify", (PyCFunction)Key_verify, METH_O, "Whether a compact frame's MAC holds."},
    {NULL}};

static PyTypeObject KeyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvstore.net._hot.Key",
    .tp_basicsize = sizeof(KeyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An HMAC-SHA256 key with its padded states computed once.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Key_init,
    .tp_methods = Key_methods,
};

/* -- unpack ------------------------------------------------------------------------------------------ */

/* unpack(body) -> (op, body, code, array_start, seq, sender, label, n, to); raises ProtocolError. */
static PyObject *hot_unpack(PyObject *module, PyObject *arg) {
    Py_buffer view;
    const uint8_t *p;
    Py_ssize_t len, start, end, nl, nt, nk, rest;
    int op, kind, code;
    unsigned long long seq, n;
    long long sender, size, round_;
    PyObject *label = NULL, *to = NULL, *key = NULL, *body = NULL, *sender_obj = NULL, *result = NULL;
    (void)module;
    if (ProtocolError == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvstore.net._hot.configure() was not called");
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return protocol_error("a compact message is not a contiguous byte buffer");
    }
    p = view.buf;
    len = view.len;
    if (len < fields_size || len > max_bytes) {
        protocol_error("a compact message of %zd bytes (at least %zd, at most %zd)", len, fields_size, max_bytes);
        goto done;
    }
    if (p[0] != marker || p[1] != version) {
        protocol_error("compact protocol version %d is not supported (this node speaks version %d); run the "
                       "same kvstore version everywhere", (int)p[1], version);
        goto done;
    }
    op = p[2]; kind = p[3]; code = p[4]; nl = p[5]; nt = p[6];
    nk = (Py_ssize_t)get_le(p + 7, 2);
    seq = get_le(p + 9, 8);
    sender = (long long)get_le(p + 17, 8);
    n = get_le(p + 25, 8);
    size = (long long)get_le(p + 33, 8);
    round_ = (long long)get_le(p + 41, 8);
    start = fields_size;
    end = start + nl + nt + nk;
    if (end > len) {
        protocol_error("a compact message is shorter than its fields declare");
        goto done;
    }
    label = PyUnicode_DecodeUTF8((const char *)p + start, nl, "strict");
    if (label != NULL)
        to = PyUnicode_DecodeUTF8((const char *)p + start + nl, nt, "strict");
    if (to != NULL) {
        const uint8_t *k = p + start + nl + nt;
        if (kind == 0) {
            if (nk) {
                protocol_error("a compact reply carries no key");
                goto done;
            }
            key = Py_NewRef(Py_None);
        } else if (kind == 1) {
            if (nk != 8) {
                protocol_error("a compact int key takes 8 bytes");
                goto done;
            }
            key = PyLong_FromUnsignedLongLong(get_le(k, 8));
        } else if (kind == 2) {
            key = PyUnicode_DecodeUTF8((const char *)k, nk, "strict");
        } else {
            protocol_error("unknown compact key kind %d", kind);
            goto done;
        }
    }
    if (key == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            protocol_error("a compact message's label, addressee or key is not UTF-8");
        }
        goto done;
    }
    if (!(((op == op_push || op == op_pull || op == op_pushpull) && kind) || (op == op_ok && !kind))) {
        protocol_error("op %d with key kind %d has no compact layout", op, kind);
        goto done;
    }
    if (kind == 0) {
        if (size != -1 || round_ != -1) {
            protocol_error("a compact reply carries no size or round");
            goto done;
        }
        body = PyDict_New();
    } else {
        PyObject *list;
        if (size < 0 || round_ < -1) {
            protocol_error("a compact request's size %lld or round %lld is negative", size, round_);
            goto done;
        }
        if ((body = PyDict_New()) == NULL)
            goto done;
        if ((list = PyList_New(1)) == NULL)
            goto done;
        PyList_SET_ITEM(list, 0, Py_NewRef(key));
        if (PyDict_SetItem(body, str_keys, list) < 0) { Py_DECREF(list); goto done; }
        Py_DECREF(list);
        if ((list = Py_BuildValue("[L]", size)) == NULL)
            goto done;
        if (PyDict_SetItem(body, str_sizes, list) < 0) { Py_DECREF(list); goto done; }
        Py_DECREF(list);
        if (round_ != -1) {
            if ((list = Py_BuildValue("[L]", round_)) == NULL)
                goto done;
            if (PyDict_SetItem(body, str_rounds, list) < 0) { Py_DECREF(list); goto done; }
            Py_DECREF(list);
        }
    }
    if (body == NULL)
        goto done;
    rest = len - end;
    if (code == nodtype) {
        if (rest) {
            protocol_error("a compact message without an array carries array bytes");
            goto done;
        }
    } else if (code >= ndtypes) {
        protocol_error("unknown compact dtype %d", code);
        goto done;
    } else if (rest % itemsizes[code]) {
        protocol_error("%zd array bytes are not a whole number of %U", rest,
                       PyTuple_GET_ITEM(dtype_names, code));
        goto done;
    }
    if (sender == -1) {
        sender_obj = Py_NewRef(Py_None);
    } else if (sender < 0) {
        protocol_error("sender %lld is negative", sender);
        goto done;
    } else {
        sender_obj = PyLong_FromLongLong(sender);
        if (sender_obj == NULL)
            goto done;
    }
    result = Py_BuildValue("iOinKOOKO", op, body, code, end, seq, sender_obj, label, n, to);
done:
    Py_XDECREF(label);
    Py_XDECREF(to);
    Py_XDECREF(key);
    Py_XDECREF(body);
    Py_XDECREF(sender_obj);
    PyBuffer_Release(&view);
    return result;
}

/* configure(error, version, marker, nodtype, fields_size, max_bytes, ok, push, pull, pushpull,
 *           names, itemsizes): the layout's constants, from kvstore.net.compact (names: a tuple of str). */
static PyObject *hot_configure(PyObject *module, PyObject *args) {
    PyObject *error, *names, *sizes, *seq;
    Py_ssize_t i, n, fsize, maxb, sz[64];
    int ver, mark, nodt, ok, push, pull, pushpull;
    (void)module;
    if (!PyArg_ParseTuple(args, "OiiinniiiiO!O", &error, &ver, &mark, &nodt, &fsize, &maxb, &ok, &push, &pull,
                          &pushpull, &PyTuple_Type, &names, &sizes))
        return NULL;
    if (fsize != 49) {
        PyErr_SetString(PyExc_ValueError, "this build of kvstore.net._hot knows a 49-byte field layout only");
        return NULL;
    }
    if (maxb < fsize) {
        PyErr_SetString(PyExc_ValueError, "max_bytes is below the field layout's size");
        return NULL;
    }
    if ((seq = PySequence_Fast(sizes, "itemsizes must be a sequence")) == NULL)
        return NULL;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > 64 || n != PyTuple_GET_SIZE(names)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "itemsizes must be one per dtype name, at most 64");
        return NULL;
    }
    for (i = 0; i < n; i++) {
        sz[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, i));
        if (sz[i] < 1) {
            Py_DECREF(seq);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "every itemsize must be positive");
            return NULL;
        }
    }
    Py_DECREF(seq);
    version = ver; marker = mark; nodtype = nodt; fields_size = fsize; max_bytes = maxb;
    op_ok = ok; op_push = push; op_pull = pull; op_pushpull = pushpull;
    memcpy(itemsizes, sz, sizeof(Py_ssize_t) * (size_t)n);
    ndtypes = (int)n;
    Py_XSETREF(dtype_names, Py_NewRef(names));
    Py_XSETREF(ProtocolError, Py_NewRef(error));
    Py_RETURN_NONE;
}

/* sha_extensions(on): use the CPU's SHA extensions (where it has them) or the portable code; returns
 * whether they were in use before (tests check both against hashlib). */
static PyObject *hot_sha_extensions(PyObject *module, PyObject *arg) {
    int on = PyObject_IsTrue(arg), was = use_sha_ni;
    (void)module;
    if (on < 0)
        return NULL;
#ifdef HOT_SHA_NI
    use_sha_ni = on && cpu_has_sha();
#endif
    return PyBool_FromLong(was);
}

static PyMethodDef hot_methods[] = {
    {"sha_extensions", hot_sha_extensions, METH_O, "Use the CPU's SHA extensions where it has them (or not)."},
    {"unpack", hot_unpack, METH_O, "The fields of a compact body (compact.unpack's checks)."},
    {"configure", hot_configure, METH_VARARGS, "Set the layout's constants and ProtocolError."},
    {NULL}};

static struct PyModuleDef hot_module = {PyModuleDef_HEAD_INIT, "_hot", "The compiled small-message path.", -1,
                                        hot_methods, NULL, NULL, NULL, NULL};

/* What kvstore.net.native expects (native.ABI): raised whenever a function's arguments or results change,
 * so that a build left from an older source (an editable install not rebuilt) is not used. */
#define HOT_ABI 1

PyMODINIT_FUNC PyInit__hot(void) {
    PyObject *m;
    if (PyType_Ready(&KeyType) < 0)
        return NULL;
    str_keys = PyUnicode_InternFromString("keys");
    str_sizes = PyUnicode_InternFromString("sizes");
    str_rounds = PyUnicode_InternFromString("rounds");
    if (str_keys == NULL || str_sizes == NULL || str_rounds == NULL)
        return NULL;
#ifdef HOT_SHA_NI
    use_sha_ni = cpu_has_sha();
#endif
    m = PyModule_Create(&hot_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Key", (PyObject *)&KeyType) < 0
        || PyModule_AddIntConstant(m, "SHA_EXTENSIONS", use_sha_ni) < 0
        || PyModule_AddIntConstant(m, "ABI", HOT_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
