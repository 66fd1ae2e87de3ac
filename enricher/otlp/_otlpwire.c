/* OTLP trace requests on the wire: the facts kvmiss reads from an ExportTraceServiceRequest,
 * straight from its protobuf bytes, and the same bytes with the verdicts written in.
 *
 * The C twin of `SpanReader.scanner` and of `upsert_marked` / `strip_marked` on the parsed
 * message (enricher/otlp/spans.py, the reference: read it first, the rules are stated there
 * once). This file exists for issue #5's throughput target: the Python reader pays a upb
 * wrapper object and a getattr for every attribute key and value it looks at (~2.5k
 * instructions per attribute, ~400 per element of a 64-block hash chain), and writing into
 * the message then serializing it again costs as much as parsing it; here a key costs a
 * hash and a memcmp, only the spans that carry an attribute of interest produce a Python
 * object at all, and only the messages around an edited span are re-encoded.
 * tests/enricher/otlp/test_span_scan.py checks both against the reference on random requests,
 * including encodings only a hostile sender would write.
 *
 * The receiver has already parsed the same bytes with upb (which validated UTF-8, nesting
 * and lengths), so this file never decides whether a request is valid. It only has to
 * agree with what upb made of the bytes, and where protobuf's merge rules would make the
 * two differ it does not try: a repeated singular message field (KeyValue.value), a second
 * AnyValue oneof member, a known field with an unexpected wire type, a group -- `scan`
 * then returns None and the caller reads the parsed message instead. A value whose type
 * the fact does not take directly (an int sent as a string, an array with a non-int or
 * nested element...) is left to the reference rules per span: the span's entry carries
 * None instead of its values.
 *
 * Scanner(keys, entries, facts, lookup_name):
 *   keys     tuple of str: every attribute name of interest
 *   entries  tuple, per key: (fact index or -1, rank, access, mark flags)
 *   facts    tuple of str: fact names (the keys of the values dicts)
 *   lookup_name  bytes: the span name that marks an engine lookup span
 * Scanner.scan(body) -> list of
 *   (resource index, scope index, span index, trace id, values dict | None (a block-hash
 *    chain in it as array('Q')),
 *    marks list of (attribute position, key) | None, attribute count, raw-mark count,
 *    start_time_unix_nano, end_time_unix_nano, is engine lookup)
 * for each span with at least one attribute of interest, in wire order; or None.
 * count_spans(body) -> (spans, spans with a trace id not 16 bytes or a span id not 8) | None
 * encode_attributes(values) -> the Span.attributes bytes of str -> str/int/bool/float, or None
 *   for anything else (the Python encoder decides).
 * rewrite(body, edits) -> bytes, edits a list of (resource, scope, span index, attribute
 *   positions to delete (ascending), Span.attributes bytes to append), in wire order, one per
 *   span; ValueError for an edit that does not fit.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_FACTS 64

/* Wire types */
#define WT_VARINT 0
#define WT_I64 1
#define WT_LEN 2
#define WT_I32 5

/* How a fact's value is taken (spans.py: _STR, _INT, _FLOAT, _HASHES, _INTS, _OTHER) */
enum { ACCESS_STR, ACCESS_INT, ACCESS_FLOAT, ACCESS_HASHES, ACCESS_INTS, ACCESS_OTHER };
#define MARK_RAW 1
#define MARK_OUTPUT 2

/* Scan outcome inside the walk: go on, not modelled here (answer None), or a Python error */
enum { OK = 0, BAIL = 1, FAIL = 2 };

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Cursor;

static inline int read_varint(Cursor *c, uint64_t *out) {
    if (c->p < c->end && *c->p < 0x80) { /* one byte: every tag here, most lengths */
        *out = *c->p++;
        return OK;
    }
    if (c->end - c->p >= 2 && c->p[1] < 0x80) { /* two: lengths up to 16 KiB */
        *out = (uint64_t)(c->p[0] & 0x7F) | (uint64_t)c->p[1] << 7;
        c->p += 2;
        return OK;
    }
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (c->p >= c->end)
            return BAIL;
        uint8_t b = *c->p++;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return OK;
        }
    }
    return BAIL; /* more than 10 bytes */
}

static inline int read_tag(Cursor *c, uint32_t *field, int *wt) {
    uint64_t tag;
    if (read_varint(c, &tag) != OK || tag > UINT32_MAX)
        return BAIL;
    *field = (uint32_t)(tag >> 3);
    *wt = (int)(tag & 7);
    return *field ? OK : BAIL;
}

/* A length-delimited payload as a sub-cursor; the outer cursor moves past it. */
static inline int read_len(Cursor *c, Cursor *sub) {
    uint64_t n;
    if (read_varint(c, &n) != OK || n > (uint64_t)(c->end - c->p))
        return BAIL;
    sub->p = c->p;
    sub->end = c->p + n;
    c->p += n;
    return OK;
}

static inline int skip(Cursor *c, int wt) {
    uint64_t v;
    Cursor sub;
    switch (wt) {
    case WT_VARINT:
        return read_varint(c, &v);
    case WT_I64:
        if (c->end - c->p < 8)
            return BAIL;
        c->p += 8;
        return OK;
    case WT_LEN:
        return read_len(c, &sub);
    case WT_I32:
        if (c->end - c->p < 4)
            return BAIL;
        c->p += 4;
        return OK;
    default: /* groups: upb keeps them as unknown fields; not modelled */
        return BAIL;
    }
}

static PyObject *array_type; /* array.array, for block-hash chains */

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* protobuf fixed64 is little-endian, as are x86-64 and arm64 */
    return v;
}

/* --- the key table: attribute name -> entry ---------------------------------------------- */

typedef struct {
    const char *key; /* UTF-8 of keys[i], owned by the tuple */
    Py_ssize_t len;
    PyObject *key_obj; /* borrowed from the keys tuple */
    int fact;          /* index into facts, or -1 */
    int rank;
    int access;
    int mark;
} Entry;

typedef struct {
    PyObject_HEAD
    PyObject *keys;  /* tuple of str */
    PyObject *facts; /* tuple of str */
    PyObject *lookup_name;
    Entry *entries;
    Py_ssize_t n_entries;
    int32_t *slots; /* open addressing: entry index + 1, 0 empty */
    uint64_t mask;
    int n_facts;
} Scanner;

/* Attribute names of interest differ in length or in their first or last 8 bytes, so the
 * hash reads only those: O(1) per key whatever its length (memcmp settles equality). */
static inline uint64_t hash_key(const uint8_t *p, Py_ssize_t n) {
    uint64_t head = 0, tail = 0;
    if (n >= 8) {
        memcpy(&head, p, 8);
        memcpy(&tail, p + n - 8, 8);
    } else {
        memcpy(&head, p, (size_t)n);
    }
    uint64_t h = (head ^ (tail * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)n) * 0xFF51AFD7ED558CCDULL;
    return h ^ (h >> 32);
}

static inline const Entry *find(const Scanner *s, const uint8_t *key, Py_ssize_t len) {
    uint64_t i = hash_key(key, len) & s->mask;
    for (;;) {
        int32_t slot = s->slots[i];
        if (!slot)
            return NULL;
        const Entry *e = &s->entries[slot - 1];
        if (e->len == len && memcmp(e->key, key, (size_t)len) == 0)
            return e;
        i = (i + 1) & s->mask;
    }
}

/* --- values ------------------------------------------------------------------------------ */

/* One AnyValue, as far as the scanner reads it: which oneof member (the field number, 0
 * for none) and where its payload is. */
typedef struct {
    int kind;
    uint64_t scalar; /* varint / fixed64 payload */
    Cursor data;     /* length-delimited payload */
} Any;

static int read_any(Cursor c, Any *out) {
    out->kind = 0;
    if (c.p < c.end && *c.p == 0x18) { /* int_value alone, as every encoder writes it */
        Cursor v = {c.p + 1, c.end};
        if (read_varint(&v, &out->scalar) == OK && v.p == c.end) {
            out->kind = 3;
            return OK;
        }
    }
    while (c.p < c.end) {
        uint32_t field;
        int wt;
        if (read_tag(&c, &field, &wt) != OK)
            return BAIL;
        if (field < 1 || field > 7) {
            if (skip(&c, wt) != OK)
                return BAIL;
            continue;
        }
        if (out->kind) /* a second member (or the same one twice): upb's merge rules apply */
            return BAIL;
        out->kind = (int)field;
        int expect = field == 2 || field == 3 ? WT_VARINT : field == 4 ? WT_I64 : WT_LEN;
        if (wt != expect)
            return BAIL;
        if (wt == WT_VARINT) {
            if (read_varint(&c, &out->scalar) != OK)
                return BAIL;
        } else if (wt == WT_I64) {
            if (c.end - c.p < 8)
                return BAIL;
            out->scalar = load64(c.p);
            c.p += 8;
        } else if (read_len(&c, &out->data) != OK) {
            return BAIL;
        }
    }
    return OK;
}

/* The next element of an ArrayValue (its repeated field 1): 1 with *any set, 0 at the
 * end, -1 for an encoding not modelled. */
static int next_element(Cursor *c, Any *any) {
    while (c->p < c->end) {
        uint32_t field;
        int wt;
        Cursor item;
        if (read_tag(c, &field, &wt) != OK)
            return -1;
        if (field != 1) {
            if (skip(c, wt) != OK)
                return -1;
            continue;
        }
        if (wt != WT_LEN || read_len(c, &item) != OK || read_any(item, any) != OK)
            return -1;
        return 1;
    }
    return 0;
}

/* Every element of an ArrayValue as an int: a list of int64 (token ids), or for a block-hash
 * chain an ``array('Q')`` of their uint64 two's complements (what the verdict reads of a
 * chain is its length and one or two elements; 64 Python ints per request were the scan's
 * largest cost and as much again to free). *value stays NULL when an element is not an int
 * or the array is empty (the reference rules decide then). One pass into a buffer (on the
 * stack for a chain of up to 256 blocks). */
static int int_array(Cursor array, int unsigned_, PyObject **value) {
    uint64_t local[256];
    uint64_t *ints = local;
    Py_ssize_t count = 0, capacity = 256;
    Any any;
    int more, rc = OK;
    *value = NULL;
    while ((more = next_element(&array, &any)) == 1) {
        if (any.kind != 3)
            goto done; /* not all ints: the reference rules */
        if (count == capacity) {
            uint64_t *grown = PyMem_Malloc(sizeof(uint64_t) * (size_t)capacity * 2);
            if (!grown) {
                PyErr_NoMemory();
                rc = FAIL;
                goto done;
            }
            memcpy(grown, ints, sizeof(uint64_t) * (size_t)count);
            if (ints != local)
                PyMem_Free(ints);
            ints = grown;
            capacity *= 2;
        }
        ints[count++] = any.scalar;
    }
    if (more < 0) {
        rc = BAIL;
        goto done;
    }
    if (!count)
        goto done;
    if (unsigned_) { /* a block-hash chain: one array('Q'), not a Python int per block */
        *value = PyObject_CallFunction(array_type, "Cy#", 'Q', (const char *)ints, count * (Py_ssize_t)sizeof(uint64_t));
        rc = *value ? OK : FAIL;
        goto done;
    }
    PyObject *list = PyList_New(count);
    if (!list) {
        rc = FAIL;
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *n = PyLong_FromLongLong((int64_t)ints[i]);
        if (!n) {
            Py_DECREF(list);
            rc = FAIL;
            goto done;
        }
        PyList_SET_ITEM(list, i, n);
    }
    *value = list;
done:
    if (ints != local)
        PyMem_Free(ints);
    return rc;
}

/* The fact's value from one AnyValue by the fact's access; *value NULL: not directly. */
static int convert(Cursor c, int access, PyObject **value) {
    Any any;
    *value = NULL;
    if (read_any(c, &any) != OK)
        return BAIL;
    switch (access) {
    case ACCESS_STR:
        if (any.kind == 1) {
            *value = PyUnicode_DecodeUTF8((const char *)any.data.p, any.data.end - any.data.p, NULL);
            if (!*value) { /* upb checked UTF-8 already; should it not have, read the message */
                PyErr_Clear();
                return BAIL;
            }
        }
        return OK;
    case ACCESS_INT:
        if (any.kind == 3 && !(*value = PyLong_FromLongLong((int64_t)any.scalar)))
            return FAIL;
        return OK;
    case ACCESS_FLOAT: {
        if (any.kind == 4) {
            double d;
            memcpy(&d, &any.scalar, 8);
            if (!(*value = PyFloat_FromDouble(d)))
                return FAIL;
        }
        return OK;
    }
    case ACCESS_HASHES:
    case ACCESS_INTS:
        if (any.kind == 5)
            return int_array(any.data, access == ACCESS_HASHES, value);
        return OK;
    default:
        return OK;
    }
}

/* --- the walk ---------------------------------------------------------------------------- */

typedef struct {
    PyObject *values[MAX_FACTS];
    int ranks[MAX_FACTS];
    int order[MAX_FACTS];
    int n_order;
    PyObject *marks;
    Py_ssize_t attributes;
    Py_ssize_t raw;
    int deferred;
    int interesting;
} SpanState;

static void span_state_clear(SpanState *st) {
    for (int i = 0; i < st->n_order; i++)
        Py_CLEAR(st->values[st->order[i]]);
    st->n_order = 0;
    Py_CLEAR(st->marks);
}

static int scan_attribute(const Scanner *s, Cursor kv, SpanState *st) {
    Cursor key = {NULL, NULL}, value = {NULL, NULL};
    int has_value = 0;
    while (kv.p < kv.end) {
        uint32_t field;
        int wt;
        if (read_tag(&kv, &field, &wt) != OK)
            return BAIL;
        if (field == 1 || field == 2) {
            Cursor *target = field == 1 ? &key : &value;
            if (wt != WT_LEN)
                return BAIL;
            if (field == 2) {
                if (has_value) /* a singular message twice: upb merges the two */
                    return BAIL;
                has_value = 1;
            }
            if (read_len(&kv, target) != OK)
                return BAIL;
        } else if (skip(&kv, wt) != OK) {
            return BAIL;
        }
    }
    Py_ssize_t position = st->attributes++;
    const Entry *e = find(s, key.p ? key.p : (const uint8_t *)"", key.p ? key.end - key.p : 0);
    if (!e)
        return OK;
    st->interesting = 1;
    if (e->mark) {
        if (!st->marks && !(st->marks = PyList_New(0)))
            return FAIL;
        PyObject *pair = Py_BuildValue("(nO)", position, e->key_obj);
        if (!pair || PyList_Append(st->marks, pair) < 0) {
            Py_XDECREF(pair);
            return FAIL;
        }
        Py_DECREF(pair);
        if (e->mark & MARK_RAW)
            st->raw++;
    }
    if (e->fact < 0 || st->deferred)
        return OK;
    int f = e->fact;
    if (st->values[f] && st->ranks[f] <= e->rank)
        return OK; /* a better-ranked name already gave this fact */
    PyObject *converted = NULL;
    if (e->access == ACCESS_OTHER) {
        st->deferred = 1;
        return OK;
    }
    if (!has_value) { /* no value: the reference rules (an unusable value) */
        st->deferred = 1;
        return OK;
    }
    int rc = convert(value, e->access, &converted);
    if (rc != OK)
        return rc;
    if (!converted) {
        st->deferred = 1;
        return OK;
    }
    if (st->values[f]) {
        Py_SETREF(st->values[f], converted);
    } else {
        st->values[f] = converted;
        st->order[st->n_order++] = f;
    }
    st->ranks[f] = e->rank;
    return OK;
}

static PyObject *span_hit(const Scanner *s, SpanState *st, Py_ssize_t r, Py_ssize_t sc, Py_ssize_t i,
                          Cursor trace_id, uint64_t start, uint64_t end, Cursor name) {
    PyObject *values;
    if (st->deferred) {
        values = Py_NewRef(Py_None);
    } else {
        values = PyDict_New();
        if (!values)
            return NULL;
        for (int k = 0; k < st->n_order; k++) {
            int f = st->order[k];
            if (PyDict_SetItem(values, PyTuple_GET_ITEM(s->facts, f), st->values[f]) < 0) {
                Py_DECREF(values);
                return NULL;
            }
        }
    }
    Py_ssize_t lookup_len = PyBytes_GET_SIZE(s->lookup_name);
    int lookup = name.p && name.end - name.p == lookup_len &&
                 memcmp(name.p, PyBytes_AS_STRING(s->lookup_name), (size_t)lookup_len) == 0;
    PyObject *trace = PyBytes_FromStringAndSize((const char *)trace_id.p, trace_id.p ? trace_id.end - trace_id.p : 0);
    PyObject *hit = trace ? Py_BuildValue("(nnnNNOnnKKO)", r, sc, i, trace, values, st->marks ? st->marks : Py_None,
                                          st->attributes, st->raw, (unsigned long long)start,
                                          (unsigned long long)end, lookup ? Py_True : Py_False)
                          : NULL;
    if (!trace)
        Py_DECREF(values);
    return hit;
}

static int scan_span(const Scanner *s, Cursor c, PyObject *out, Py_ssize_t r, Py_ssize_t sc, Py_ssize_t i) {
    SpanState st;
    st.n_order = 0;
    st.marks = NULL;
    st.attributes = st.raw = 0;
    st.deferred = st.interesting = 0;
    memset(st.values, 0, sizeof(PyObject *) * (size_t)s->n_facts);
    Cursor trace_id = {NULL, NULL}, name = {NULL, NULL};
    uint64_t start = 0, end = 0;
    int rc = OK;
    while (c.p < c.end && rc == OK) {
        uint32_t field;
        int wt;
        if (read_tag(&c, &field, &wt) != OK) {
            rc = BAIL;
            break;
        }
        if (field == 1 || field == 5) { /* trace_id, name: the last one wins, as in upb */
            if (wt != WT_LEN || read_len(&c, field == 1 ? &trace_id : &name) != OK)
                rc = BAIL;
        } else if (field == 7 || field == 8) { /* start_time_unix_nano, end_time_unix_nano */
            if (wt != WT_I64 || c.end - c.p < 8) {
                rc = BAIL;
            } else {
                *(field == 7 ? &start : &end) = load64(c.p);
                c.p += 8;
            }
        } else if (field == 9) { /* attributes */
            Cursor kv;
            if (wt != WT_LEN || read_len(&c, &kv) != OK)
                rc = BAIL;
            else
                rc = scan_attribute(s, kv, &st);
        } else if (skip(&c, wt) != OK) {
            rc = BAIL;
        }
    }
    if (rc == OK && st.interesting) {
        PyObject *hit = span_hit(s, &st, r, sc, i, trace_id, start, end, name);
        if (!hit || PyList_Append(out, hit) < 0)
            rc = FAIL;
        Py_XDECREF(hit);
    }
    span_state_clear(&st);
    return rc;
}

/* The next child message of one level of the request -> ResourceSpans -> ScopeSpans -> Span
 * walk: field ``child`` (length-delimited), other fields skipped, except that ``sibling`` (the
 * level's own sub-message: Resource, InstrumentationScope; 0 for none) must be one too.
 * 1 with *out set, 0 at the end, -1 for an encoding not modelled. */
static int next_child(Cursor *c, uint32_t child, uint32_t sibling, Cursor *out) {
    while (c->p < c->end) {
        uint32_t field;
        int wt;
        if (read_tag(c, &field, &wt) != OK)
            return -1;
        if (field == child) {
            return wt == WT_LEN && read_len(c, out) == OK ? 1 : -1;
        }
        if ((field == sibling && wt != WT_LEN) || skip(c, wt) != OK)
            return -1;
    }
    return 0;
}

/* Walks request -> ResourceSpans (field 1) -> ScopeSpans (2) -> Span (2), calling
 * ``on_span`` for each span; a known field with another wire type is not modelled. */
typedef int (*SpanFn)(void *ctx, Cursor span, Py_ssize_t r, Py_ssize_t s, Py_ssize_t i);

static int walk(Cursor c, SpanFn on_span, void *ctx) {
    Cursor rs, ss, span;
    int more;
    for (Py_ssize_t r = 0; (more = next_child(&c, 1, 0, &rs)) == 1; r++) {
        int more_scopes;
        for (Py_ssize_t sc = 0; (more_scopes = next_child(&rs, 2, 1, &ss)) == 1; sc++) {
            int more_spans;
            for (Py_ssize_t i = 0; (more_spans = next_child(&ss, 2, 1, &span)) == 1; i++) {
                int rc = on_span(ctx, span, r, sc, i);
                if (rc != OK)
                    return rc;
            }
            if (more_spans < 0)
                return BAIL;
        }
        if (more_scopes < 0)
            return BAIL;
    }
    return more < 0 ? BAIL : OK;
}

typedef struct {
    const Scanner *scanner;
    PyObject *out;
} ScanCtx;

static int scan_one(void *ctx, Cursor span, Py_ssize_t r, Py_ssize_t s, Py_ssize_t i) {
    ScanCtx *sc = ctx;
    return scan_span(sc->scanner, span, sc->out, r, s, i);
}

static PyObject *Scanner_scan(Scanner *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out) {
        PyBuffer_Release(&view);
        return NULL;
    }
    ScanCtx ctx = {self, out};
    Cursor c = {view.buf, (const uint8_t *)view.buf + view.len};
    int rc = walk(c, scan_one, &ctx);
    PyBuffer_Release(&view);
    if (rc == OK)
        return out;
    Py_DECREF(out);
    if (rc == FAIL)
        return NULL;
    Py_RETURN_NONE;
}

typedef struct {
    Py_ssize_t spans;
    Py_ssize_t invalid;
} CountCtx;

static int count_one(void *ctx, Cursor c, Py_ssize_t r, Py_ssize_t s, Py_ssize_t i) {
    (void)r, (void)s, (void)i;
    CountCtx *cc = ctx;
    Py_ssize_t trace = 0, span = 0; /* lengths; an absent field is empty */
    while (c.p < c.end) {
        uint32_t field;
        int wt;
        if (read_tag(&c, &field, &wt) != OK)
            return BAIL;
        if (field == 1 || field == 2) {
            Cursor id;
            if (wt != WT_LEN || read_len(&c, &id) != OK)
                return BAIL;
            *(field == 1 ? &trace : &span) = id.end - id.p; /* the last one wins */
        } else if (skip(&c, wt) != OK) {
            return BAIL;
        }
    }
    cc->spans++;
    cc->invalid += trace != 16 || span != 8;
    return OK;
}

static PyObject *count_spans(PyObject *module, PyObject *arg) {
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    CountCtx ctx = {0, 0};
    Cursor c = {view.buf, (const uint8_t *)view.buf + view.len};
    int rc = walk(c, count_one, &ctx);
    PyBuffer_Release(&view);
    if (rc != OK)
        Py_RETURN_NONE;
    return Py_BuildValue("(nn)", ctx.spans, ctx.invalid);
}

/* --- rewriting: the received bytes with the verdicts written and raw inputs removed ------- */

/* An output buffer; a sub-message whose length changes is written after a 10-byte gap for
 * its length prefix, then moved down to close it (the payload is copied once more). */
typedef struct {
    uint8_t *buf;
    Py_ssize_t len, cap;
} Out;

static int out_put(Out *o, const void *data, Py_ssize_t n) {
    if (o->len + n > o->cap) {
        Py_ssize_t cap = o->cap * 2 > o->len + n ? o->cap * 2 : o->len + n + 4096;
        uint8_t *grown = PyMem_Realloc(o->buf, (size_t)cap);
        if (!grown) {
            PyErr_NoMemory();
            return FAIL;
        }
        o->buf = grown;
        o->cap = cap;
    }
    if (n)
        memcpy(o->buf + o->len, data, (size_t)n);
    o->len += n;
    return OK;
}

static inline int encode_varint(uint8_t tmp[10], uint64_t v) {
    int n = 0;
    while (v > 0x7F) {
        tmp[n++] = (uint8_t)(v & 0x7F) | 0x80;
        v >>= 7;
    }
    tmp[n++] = (uint8_t)v;
    return n;
}

static int put_varint(Out *o, uint64_t v) {
    uint8_t tmp[10];
    return out_put(o, tmp, encode_varint(tmp, v));
}

/* Opens field ``field``'s sub-message: its tag, then room for the length. Returns where the
 * room starts (for `close_message`), or -1. */
static Py_ssize_t open_message(Out *o, uint32_t field) {
    static const uint8_t room[10] = {0};
    if (put_varint(o, (uint64_t)field << 3 | WT_LEN) != OK)
        return -1;
    Py_ssize_t at = o->len;
    return out_put(o, room, 10) == OK ? at : -1;
}

static void close_message(Out *o, Py_ssize_t at) {
    Py_ssize_t start = at + 10, n = o->len - start;
    uint8_t tmp[10];
    int k = encode_varint(tmp, (uint64_t)n);
    memmove(o->buf + at + k, o->buf + start, (size_t)n);
    memcpy(o->buf + at, tmp, (size_t)k);
    o->len = at + k + n;
}

/* One span's edit: delete these attribute positions (ascending), append these bytes. */
typedef struct {
    Py_ssize_t r, s, i;
    PyObject *deletes; /* tuple of int */
    Py_buffer append;
} Edit;

typedef struct {
    Edit *edits;
    Py_ssize_t n, next;
} Edits;

/* The span with the edit's attributes deleted and its new ones placed right after the last
 * attribute (before the first later field when it has none), where the parsed message's
 * serialization puts them: the same bytes as upb's for a canonically encoded span. */
static int rewrite_span(Out *o, Cursor c, const Edit *e) {
    const uint8_t *insert_at = NULL; /* the new attributes go in before this byte */
    Cursor pass = c;
    while (pass.p < pass.end) {
        const uint8_t *field_start = pass.p;
        uint32_t field;
        int wt;
        if (read_tag(&pass, &field, &wt) != OK || skip(&pass, wt) != OK)
            return BAIL;
        if (field == 9)
            insert_at = pass.p;
        else if (field > 9 && !insert_at)
            insert_at = field_start;
    }
    Py_ssize_t attribute = 0, k = 0, n_deletes = PyTuple_GET_SIZE(e->deletes);
    Py_ssize_t skip_at = n_deletes ? PyLong_AsSsize_t(PyTuple_GET_ITEM(e->deletes, 0)) : -1;
    int appended = 0;
    while (c.p < c.end) {
        if (c.p == insert_at) {
            if (out_put(o, e->append.buf, e->append.len) != OK)
                return FAIL;
            appended = 1;
        }
        const uint8_t *field_start = c.p;
        uint32_t field;
        int wt;
        if (read_tag(&c, &field, &wt) != OK || skip(&c, wt) != OK) /* (checked by the first pass) */
            return BAIL;
        if (field == 9 && attribute++ == skip_at) {
            k++;
            skip_at = k < n_deletes ? PyLong_AsSsize_t(PyTuple_GET_ITEM(e->deletes, k)) : -1;
            continue;
        }
        if (out_put(o, field_start, c.p - field_start) != OK)
            return FAIL;
    }
    if (k != n_deletes) { /* a position past the span's attributes */
        PyErr_SetString(PyExc_ValueError, "an attribute position to delete is not in the span");
        return FAIL;
    }
    return appended ? OK : out_put(o, e->append.buf, e->append.len);
}

/* Copies message ``c`` (at ``level``: 0 request, 1 ResourceSpans, 2 ScopeSpans) field by
 * field, rewriting the children that hold an edited span; ``path`` is the (r, s) so far. */
static int rewrite_level(Out *o, Cursor c, int level, Py_ssize_t r, Py_ssize_t s, Edits *ed) {
    uint32_t child_field = level == 0 ? 1 : 2;
    Py_ssize_t index = 0;
    while (c.p < c.end) {
        const uint8_t *field_start = c.p;
        uint32_t field;
        int wt;
        Cursor sub;
        if (read_tag(&c, &field, &wt) != OK)
            return BAIL;
        if (field != child_field || wt != WT_LEN) {
            if (skip(&c, wt) != OK || out_put(o, field_start, c.p - field_start) != OK)
                return BAIL;
            continue;
        }
        if (read_len(&c, &sub) != OK)
            return BAIL;
        Py_ssize_t at_index = index++;
        const Edit *e = ed->next < ed->n ? &ed->edits[ed->next] : NULL;
        int edited = e && (level == 0 ? e->r == at_index
                                      : level == 1 ? e->r == r && e->s == at_index
                                                   : e->r == r && e->s == s && e->i == at_index);
        if (!edited) {
            if (out_put(o, field_start, c.p - field_start) != OK)
                return FAIL;
            continue;
        }
        Py_ssize_t at = open_message(o, child_field);
        if (at < 0)
            return FAIL;
        int rc;
        if (level == 2) {
            rc = rewrite_span(o, sub, e);
            ed->next++;
        } else {
            rc = rewrite_level(o, sub, level + 1, level == 0 ? at_index : r, level == 1 ? at_index : s, ed);
        }
        if (rc != OK)
            return rc;
        close_message(o, at);
    }
    return OK;
}

static void edits_release(Edits *ed) {
    for (Py_ssize_t k = 0; k < ed->n; k++) {
        Py_XDECREF(ed->edits[k].deletes);
        if (ed->edits[k].append.obj)
            PyBuffer_Release(&ed->edits[k].append);
    }
    PyMem_Free(ed->edits);
}

static PyObject *rewrite(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer view;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "y*O!:rewrite", &view, &PyList_Type, &list))
        return NULL;
    Edits ed = {NULL, PyList_GET_SIZE(list), 0};
    Out o = {NULL, 0, 0};
    PyObject *result = NULL;
    ed.edits = PyMem_Calloc((size_t)(ed.n ? ed.n : 1), sizeof(Edit));
    if (!ed.edits) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < ed.n; k++) {
        Edit *e = &ed.edits[k];
        PyObject *deletes;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(list, k), "nnnO!y*:edit", &e->r, &e->s, &e->i, &PyTuple_Type, &deletes,
                              &e->append))
            goto done;
        e->deletes = Py_NewRef(deletes);
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(deletes); d++) {
            Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(deletes, d));
            Py_ssize_t prev = d ? PyLong_AsSsize_t(PyTuple_GET_ITEM(deletes, d - 1)) : -1;
            if (pos < 0 || pos <= prev) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "positions to delete must be ascending, >= 0");
                goto done;
            }
        }
        if (k) { /* in wire order, one edit per span */
            const Edit *p = &ed.edits[k - 1];
            if (p->r > e->r || (p->r == e->r && (p->s > e->s || (p->s == e->s && p->i >= e->i)))) {
                PyErr_SetString(PyExc_ValueError, "edits must be sorted by (resource, scope, span), one per span");
                goto done;
            }
        }
    }
    o.cap = view.len + 4096;
    o.buf = PyMem_Malloc((size_t)o.cap);
    if (!o.buf) {
        PyErr_NoMemory();
        goto done;
    }
    Cursor c = {view.buf, (const uint8_t *)view.buf + view.len};
    int rc = rewrite_level(&o, c, 0, -1, -1, &ed);
    if (rc == BAIL) {
        PyErr_SetString(PyExc_ValueError, "not an ExportTraceServiceRequest this scanner reads");
    } else if (rc == OK && ed.next != ed.n) {
        PyErr_SetString(PyExc_ValueError, "an edit names a span that is not in the request");
    } else if (rc == OK) {
        result = PyBytes_FromStringAndSize((const char *)o.buf, o.len);
    }
done:
    PyMem_Free(o.buf);
    edits_release(&ed);
    PyBuffer_Release(&view);
    return result;
}

/* --- encoding output attributes ----------------------------------------------------------- */

/* Appends field ``field`` (length-delimited) holding ``n`` bytes at ``data``. */
static int put_bytes_field(Out *o, uint32_t field, const void *data, Py_ssize_t n) {
    if (put_varint(o, (uint64_t)field << 3 | WT_LEN) != OK || put_varint(o, (uint64_t)n) != OK)
        return FAIL;
    return out_put(o, data, n);
}

/* An AnyValue's fields for ``value``: 1 written, 0 a type left to Python, -1 an error. */
static int put_any(Out *o, PyObject *value) {
    PyTypeObject *type = Py_TYPE(value);
    if (type == &PyUnicode_Type) {
        Py_ssize_t n;
        const char *utf8 = PyUnicode_AsUTF8AndSize(value, &n);
        if (!utf8) { /* a lone surrogate: Python's encoder raises what it raises */
            PyErr_Clear();
            return 0;
        }
        return put_bytes_field(o, 1, utf8, n) == OK ? 1 : -1;
    }
    if (type == &PyBool_Type) {
        uint8_t b[2] = {0x10, value == Py_True};
        return out_put(o, b, 2) == OK ? 1 : -1;
    }
    if (type == &PyLong_Type) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow)
            return 0; /* outside int64: Python's encoder refuses it */
        if (v == -1 && PyErr_Occurred())
            return -1;
        uint8_t tag = 0x18;
        return out_put(o, &tag, 1) == OK && put_varint(o, (uint64_t)v) == OK ? 1 : -1;
    }
    if (type == &PyFloat_Type) {
        uint8_t b[9] = {0x21};
        double d = PyFloat_AS_DOUBLE(value);
        memcpy(b + 1, &d, 8);
        return out_put(o, b, 9) == OK ? 1 : -1;
    }
    return 0;
}

/* ``values`` (str -> str / int / bool / float) as Span.attributes wire bytes, or None where a
 * key or value is of another type (or not encodable): `spans.encode_attributes` then
 * decides, with the same rules. */
static PyObject *encode_attributes(PyObject *module, PyObject *values) {
    (void)module;
    if (!PyDict_Check(values)) {
        PyErr_SetString(PyExc_TypeError, "encode_attributes takes a dict");
        return NULL;
    }
    Out o = {NULL, 0, 0}, kv = {NULL, 0, 0};
    PyObject *key, *value, *result = NULL;
    Py_ssize_t pos = 0;
    int handled = 1;
    while (handled && PyDict_Next(values, &pos, &key, &value)) {
        Py_ssize_t n;
        const char *utf8 = Py_TYPE(key) == &PyUnicode_Type ? PyUnicode_AsUTF8AndSize(key, &n) : NULL;
        if (!utf8) {
            PyErr_Clear();
            handled = 0;
            break;
        }
        kv.len = 0;
        if (put_bytes_field(&kv, 1, utf8, n) != OK) /* KeyValue.key */
            goto done;
        Py_ssize_t at = open_message(&kv, 2); /* KeyValue.value */
        if (at < 0)
            goto done;
        int rc = put_any(&kv, value);
        if (rc < 0)
            goto done;
        handled = rc;
        close_message(&kv, at);
        if (handled && put_bytes_field(&o, 9, kv.buf, kv.len) != OK) /* Span.attributes */
            goto done;
    }
    if (!handled) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyBytes_FromStringAndSize(o.buf ? (const char *)o.buf : "", o.len);
    }
done:
    PyMem_Free(o.buf);
    PyMem_Free(kv.buf);
    return result;
}

/* --- the type ---------------------------------------------------------------------------- */

static void Scanner_dealloc(Scanner *self) {
    PyMem_Free(self->entries);
    PyMem_Free(self->slots);
    Py_XDECREF(self->keys);
    Py_XDECREF(self->facts);
    Py_XDECREF(self->lookup_name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Scanner_init(Scanner *self, PyObject *args, PyObject *kwargs) {
    PyObject *keys, *entries, *facts, *lookup_name;
    static char *kwlist[] = {"keys", "entries", "facts", "lookup_name", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!O!:Scanner", kwlist, &PyTuple_Type, &keys, &PyTuple_Type,
                                     &entries, &PyTuple_Type, &facts, &PyBytes_Type, &lookup_name))
        return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(entries) != n) {
        PyErr_SetString(PyExc_ValueError, "keys and entries differ in length");
        return -1;
    }
    if (PyTuple_GET_SIZE(facts) > MAX_FACTS) {
        PyErr_Format(PyExc_ValueError, "at most %d facts", MAX_FACTS);
        return -1;
    }
    if (self->entries) { /* __init__ called again */
        PyErr_SetString(PyExc_RuntimeError, "Scanner is already initialised");
        return -1;
    }
    uint64_t capacity = 8;
    while (capacity < (uint64_t)n * 4)
        capacity <<= 1;
    self->entries = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Entry));
    self->slots = PyMem_Calloc((size_t)capacity, sizeof(int32_t));
    if (!self->entries || !self->slots) {
        PyErr_NoMemory();
        return -1;
    }
    self->mask = capacity - 1;
    self->n_entries = n;
    self->n_facts = (int)PyTuple_GET_SIZE(facts);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyTuple_GET_ITEM(keys, i);
        Entry *e = &self->entries[i];
        if (!PyUnicode_Check(key)) {
            PyErr_SetString(PyExc_TypeError, "keys must be str");
            return -1;
        }
        e->key = PyUnicode_AsUTF8AndSize(key, &e->len);
        if (!e->key)
            return -1;
        e->key_obj = key;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(entries, i), "iiii:entry", &e->fact, &e->rank, &e->access, &e->mark))
            return -1;
        if (e->fact >= self->n_facts || e->fact < -1 || e->access < ACCESS_STR || e->access > ACCESS_OTHER) {
            PyErr_SetString(PyExc_ValueError, "entry out of range");
            return -1;
        }
        uint64_t slot = hash_key((const uint8_t *)e->key, e->len) & self->mask;
        while (self->slots[slot]) {
            const Entry *other = &self->entries[self->slots[slot] - 1];
            if (other->len == e->len && memcmp(other->key, e->key, (size_t)e->len) == 0) {
                PyErr_Format(PyExc_ValueError, "key %R given twice", key);
                return -1;
            }
            slot = (slot + 1) & self->mask;
        }
        self->slots[slot] = (int32_t)(i + 1);
    }
    for (Py_ssize_t f = 0; f < self->n_facts; f++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(facts, f))) {
            PyErr_SetString(PyExc_TypeError, "facts must be str");
            return -1;
        }
    }
    self->keys = Py_NewRef(keys);
    self->facts = Py_NewRef(facts);
    self->lookup_name = Py_NewRef(lookup_name);
    return 0;
}

static PyObject *Scanner_call_scan(Scanner *self, PyObject *arg) {
    if (!self->entries) {
        PyErr_SetString(PyExc_RuntimeError, "Scanner was not initialised");
        return NULL;
    }
    return Scanner_scan(self, arg);
}

static PyMethodDef Scanner_methods[] = {
    {"scan", (PyCFunction)Scanner_call_scan, METH_O,
     "scan(body) -> list of span entries, or None where the encoding is not modelled"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvmiss.enricher.otlp._otlpwire.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reads kvmiss's span facts from OTLP protobuf bytes (see enricher/otlp/spans.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Scanner_init,
    .tp_dealloc = (destructor)Scanner_dealloc,
    .tp_methods = Scanner_methods,
};

static PyMethodDef module_methods[] = {
    {"count_spans", (PyCFunction)count_spans, METH_O,
     "count_spans(body) -> (spans, spans with a bad trace or span id length), or None"},
    {"encode_attributes", (PyCFunction)encode_attributes, METH_O,
     "encode_attributes(values) -> Span.attributes bytes, or None for a type left to Python"},
    {"rewrite", (PyCFunction)rewrite, METH_VARARGS,
     "rewrite(body, edits) -> bytes; edits: [(resource, scope, span, deletes, append)] in wire order"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvmiss.enricher.otlp._otlpwire",
    .m_doc = "OTLP trace requests on the wire: span facts read, verdicts written (see enricher/otlp/spans.py).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__otlpwire(void) {
    if (PyType_Ready(&ScannerType) < 0)
        return NULL;
    PyObject *array_module = PyImport_ImportModule("array");
    if (!array_module)
        return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (!array_type)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&ScannerType);
    if (PyModule_AddObject(m, "Scanner", (PyObject *)&ScannerType) < 0) {
        Py_DECREF(&ScannerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
