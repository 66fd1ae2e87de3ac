/* The KV-event ingest path in C: frames off a ZeroMQ socket, batches read from msgpack.
 *
 * schemas/events.py `decode_batch` is the rule for what a payload means; this file is a
 * faster reader of the one form every current engine sends (vLLM >= 0.24, SGLang: a batch
 * [ts, [events...], dp_rank] of tagged maps with uint64 hashes). `scan_batch` either returns
 * exactly what the reference decoder would give for the fields the index applies (kind,
 * block_hashes, medium, group_idx; ts and dp_rank), or None, and the caller asks the
 * reference, which also words every error. It returns None for any value it does not model:
 * a negative or byte-string hash, array-form events (vLLM < 0.24), a non-ASCII string, an
 * ext value, a map inside extra_keys, a duplicate field, nesting deeper than MAX_DEPTH.
 * Every other field is type-checked as the Structs declare it (so that a payload it accepts
 * never fails the reference later) and skipped. tests/collectors/test_kvwire.py checks the
 * contract against decode_batch with hypothesis, hostile encodings included.
 *
 * `recv_messages` drains a ZeroMQ socket pyzmq opened, calling the very libzmq pyzmq loaded
 * (found with dlopen(RTLD_NOLOAD), never a second copy): pyzmq's recv_multipart costs ~5 us
 * per three-frame message in Python calls, this ~1.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "_kvwire.h"

#define MAX_DEPTH 32

/* --- msgpack reading -------------------------------------------------------------------- */

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* Each reader returns 1 when it read a value of the wanted type, 0 when the bytes hold
 * something else or are malformed (the caller gives up: the reference decides). */

static inline int need(const Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = (v << 8) | p[i];
    return v;
}

/* The count of an array or map header at r->p: `fix` is the type's fix-size marker (0x90
 * array, 0x80 map), `wide` its 16-bit form (0xdc, 0xde; the 32-bit form follows it). */
static int read_header(Reader *r, uint8_t fix, uint8_t wide, uint32_t *n) {
    if (!need(r, 1))
        return 0;
    uint8_t b = *r->p;
    if ((b & 0xf0) == fix) {
        *n = b & 0x0f;
        r->p += 1;
    } else if (b == wide && need(r, 3)) {
        *n = (uint32_t)be(r->p + 1, 2);
        r->p += 3;
    } else if (b == wide + 1 && need(r, 5)) {
        *n = (uint32_t)be(r->p + 1, 4);
        r->p += 5;
    } else
        return 0;
    return 1;
}

static inline int read_array(Reader *r, uint32_t *n) { return read_header(r, 0x90, 0xdc, n); }

static inline int read_map(Reader *r, uint32_t *n) { return read_header(r, 0x80, 0xde, n); }

static inline int read_nil(Reader *r) {
    if (need(r, 1) && *r->p == 0xc0) {
        r->p++;
        return 1;
    }
    return 0;
}

/* An integer of any encoding; *neg set when it is below zero (then *u holds the int64). */
static int read_int(Reader *r, uint64_t *u, int *neg) {
    if (!need(r, 1))
        return 0;
    uint8_t b = *r->p;
    *neg = 0;
    if (b <= 0x7f) {
        *u = b;
        r->p += 1;
        return 1;
    }
    if (b >= 0xe0) {
        *u = (uint64_t)(int64_t)(int8_t)b;
        *neg = 1;
        r->p += 1;
        return 1;
    }
    int n;
    switch (b) {
    case 0xcc: case 0xd0: n = 1; break;
    case 0xcd: case 0xd1: n = 2; break;
    case 0xce: case 0xd2: n = 4; break;
    case 0xcf: case 0xd3: n = 8; break;
    default: return 0;
    }
    if (!need(r, 1 + (size_t)n))
        return 0;
    uint64_t v = be(r->p + 1, n);
    if (b >= 0xd0) { /* signed: sign-extend */
        int shift = 64 - 8 * n;
        int64_t s = shift ? (int64_t)(v << shift) >> shift : (int64_t)v;
        v = (uint64_t)s;
        *neg = s < 0;
    }
    *u = v;
    r->p += 1 + n;
    return 1;
}

static inline int read_uint(Reader *r, uint64_t *u) {
    int neg;
    const uint8_t *at = r->p;
    if (!read_int(r, u, &neg))
        return 0;
    if (neg) {
        r->p = at;
        return 0;
    }
    return 1;
}

/* A str's bytes, unchecked. */
static inline int read_str(Reader *r, const char **s, uint32_t *len) {
    if (!need(r, 1))
        return 0;
    uint8_t b = *r->p;
    uint32_t n;
    size_t head;
    if (b >= 0xa0 && b <= 0xbf) {
        n = b & 0x1f;
        head = 1;
    } else if (b == 0xd9 && need(r, 2)) {
        n = r->p[1];
        head = 2;
    } else if (b == 0xda && need(r, 3)) {
        n = (uint32_t)be(r->p + 1, 2);
        head = 3;
    } else if (b == 0xdb && need(r, 5)) {
        n = (uint32_t)be(r->p + 1, 4);
        head = 5;
    } else
        return 0;
    if (!need(r, head + n))
        return 0;
    *s = (const char *)r->p + head;
    *len = n;
    r->p += head + n;
    return 1;
}

static inline int is_ascii(const char *s, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if ((unsigned char)s[i] & 0x80)
            return 0;
    return 1;
}

/* A str, ASCII only (the reference checks UTF-8; engines send ASCII in every field read here). */
static inline int read_ascii(Reader *r, const char **s, uint32_t *len) {
    const uint8_t *at = r->p;
    if (read_str(r, s, len) && is_ascii(*s, *len))
        return 1;
    r->p = at;
    return 0;
}

/* Size of the fixed-size scalar a byte starts (ints, nil, bools, floats), 0 for anything
 * else: token ids are runs of ints, skipped with a table lookup each. Filled at init. */
static uint8_t FIXED_WIDTH[256];

static void fill_fixed_width(void) {
    for (int b = 0; b < 256; b++) {
        uint8_t w = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3)
            w = 1;
        else if (b == 0xcc || b == 0xd0)
            w = 2;
        else if (b == 0xcd || b == 0xd1)
            w = 3;
        else if (b == 0xce || b == 0xd2 || b == 0xca)
            w = 5;
        else if (b == 0xcf || b == 0xd3 || b == 0xcb)
            w = 9;
        FIXED_WIDTH[b] = w;
    }
}

static int skip(Reader *r, int depth, int plain);

/* The k items of an array (token ids: runs of integers, skipped without a call each). */
static int skip_items(Reader *r, uint64_t k, int depth, int plain) {
    for (uint64_t i = 0; i < k; i++) {
        size_t w = r->p < r->end ? FIXED_WIDTH[*r->p] : 0;
        if (w && (size_t)(r->end - r->p) >= w) {
            r->p += w;
            continue;
        }
        if (!skip(r, depth + 1, plain))
            return 0;
    }
    return 1;
}

/* Skip one well-formed value. `plain`: refuse ext values and maps (for `Any` fields, whose
 * decoded form could fail the reference: an unhashable map key, an unknown ext). */
static int skip(Reader *r, int depth, int plain) {
    if (depth > MAX_DEPTH || !need(r, 1))
        return 0;
    uint8_t b = *r->p;
    size_t n = 0, head = 1;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
        r->p += 1;
        return 1;
    }
    if (b >= 0xa0 && b <= 0xbf) {
        n = b & 0x1f;
    } else if (b >= 0x90 && b <= 0x9f) {
        uint32_t k = b & 0x0f;
        r->p += 1;
        return skip_items(r, k, depth, plain);
    } else if (b >= 0x80 && b <= 0x8f) {
        if (plain)
            return 0;
        uint32_t k = b & 0x0f;
        r->p += 1;
        for (uint32_t i = 0; i < 2 * k; i++)
            if (!skip(r, depth + 1, plain))
                return 0;
        return 1;
    } else {
        switch (b) {
        case 0xcc: case 0xd0: n = 1; break;
        case 0xcd: case 0xd1: n = 2; break;
        case 0xce: case 0xd2: case 0xca: n = 4; break;
        case 0xcf: case 0xd3: case 0xcb: n = 8; break;
        case 0xc4: case 0xd9:
            if (!need(r, 2)) return 0;
            n = r->p[1]; head = 2; break;
        case 0xc5: case 0xda:
            if (!need(r, 3)) return 0;
            n = be(r->p + 1, 2); head = 3; break;
        case 0xc6: case 0xdb:
            if (!need(r, 5)) return 0;
            n = be(r->p + 1, 4); head = 5; break;
        case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8:
            if (plain) return 0;
            n = 1 + ((size_t)1 << (b - 0xd4)); break; /* type byte + 1..16 data bytes */
        case 0xc7:
            if (plain || !need(r, 2)) return 0;
            n = 1 + (size_t)r->p[1]; head = 2; break;
        case 0xc8:
            if (plain || !need(r, 3)) return 0;
            n = 1 + be(r->p + 1, 2); head = 3; break;
        case 0xc9:
            if (plain || !need(r, 5)) return 0;
            n = 1 + be(r->p + 1, 4); head = 5; break;
        case 0xdc: case 0xdd: case 0xde: case 0xdf: {
            if (plain && b >= 0xde)
                return 0;
            uint32_t k;
            if (!(b >= 0xde ? read_map(r, &k) : read_array(r, &k)))
                return 0;
            if (b < 0xde)
                return skip_items(r, k, depth, plain);
            for (uint64_t i = 0; i < 2 * (uint64_t)k; i++)
                if (!skip(r, depth + 1, plain))
                    return 0;
            return 1;
        }
        default:
            return 0; /* 0xc1: never used */
        }
    }
    if (!need(r, head + n))
        return 0;
    if (plain && ((b >= 0xa0 && b <= 0xbf) || (b >= 0xd9 && b <= 0xdb))) {
        /* a str the reference decodes (and checks as UTF-8): ASCII only here */
        for (size_t i = 0; i < n; i++)
            if (r->p[head + i] & 0x80)
                return 0;
    }
    r->p += head + n;
    return 1;
}

/* --- one event ---------------------------------------------------------------------------- */

typedef struct {
    KvPackedEvent *events;
    Py_ssize_t n_events, cap_events;
    uint64_t *hashes;
    Py_ssize_t n_hashes, cap_hashes;
    const char *media[8];
    uint32_t media_len[8];
    int n_media;
    int has_clear;
} Scan;

static int grow_hashes(Scan *s, Py_ssize_t more) {
    if (s->n_hashes + more <= s->cap_hashes)
        return 1;
    Py_ssize_t cap = s->cap_hashes ? s->cap_hashes : 64;
    while (cap < s->n_hashes + more)
        cap *= 2;
    uint64_t *h = PyMem_Realloc(s->hashes, (size_t)cap * sizeof(uint64_t));
    if (!h)
        return -1;
    s->hashes = h;
    s->cap_hashes = cap;
    return 1;
}

/* Which field a key names; the bit it takes in `seen` (a duplicate gives up). */
enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA_KEYS, F_GROUP, F_SPEC_KIND, F_SPEC_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION,
    F_SALT, F_LOOKAHEAD, F_DIGESTS, F_OTHER
};

/* Short names: a loop beats a call to memcmp (nine keys per event, every event). */
static inline int same_bytes(const char *a, const char *b, uint32_t n) {
    for (uint32_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return 0;
    return 1;
}

static inline int field_of(const char *key, uint32_t len) {
#define IS(name, f) if (same_bytes(key, name, len)) return f
    switch (len) { /* every field name of the two Structs, by length */
    case 4: IS("type", F_TYPE); break;
    case 6: IS("medium", F_MEDIUM); break;
    case 7: IS("lora_id", F_LORA_ID); break;
    case 8: IS("locality", F_LOCALITY); break;
    case 9: IS("group_idx", F_GROUP); IS("token_ids", F_TOKENS); IS("lora_name", F_LORA_NAME);
            IS("ownership", F_OWNERSHIP); break;
    case 10: IS("block_size", F_BLOCK_SIZE); IS("extra_keys", F_EXTRA_KEYS); IS("session_id", F_SESSION);
             IS("cache_salt", F_SALT); break;
    case 12: IS("block_hashes", F_HASHES); break;
    case 13: IS("block_digests", F_DIGESTS); break;
    case 17: IS("parent_block_hash", F_PARENT); break;
    case 18: IS("kv_cache_spec_kind", F_SPEC_KIND); break;
    case 19: IS("lookahead_token_ids", F_LOOKAHEAD); break;
    case 28: IS("kv_cache_spec_sliding_window", F_SPEC_WINDOW); break;
    }
#undef IS
    return F_OTHER;
}

/* Which fields each event type has (others are unknown keys: skipped, as the reference does). */
#define BIT(f) (1u << (f))
static const uint32_t STORED_FIELDS = 0x3ffffu; /* all of F_TYPE..F_DIGESTS */
static const uint32_t REMOVED_FIELDS = BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP)
                                       | BIT(F_LOCALITY) | BIT(F_OWNERSHIP) | BIT(F_DIGESTS);

static inline int nil_or_int(Reader *r) {
    uint64_t u;
    int neg;
    return read_nil(r) || read_int(r, &u, &neg);
}

static inline int nil_or_ascii(Reader *r) {
    const char *s;
    uint32_t n;
    return read_nil(r) || read_ascii(r, &s, &n);
}

/* A value checked (and skipped) as the Struct field declares it; 0: not modelled here. */
static int check_field(Reader *r, int f) {
    uint32_t n;
    switch (f) {
    case F_PARENT: {
        uint64_t u;
        return read_nil(r) || read_uint(r, &u);
    }
    case F_TOKENS: /* msgspec.Raw: any one value */
        return skip(r, 2, 0);
    case F_BLOCK_SIZE: { /* int, not optional */
        uint64_t u;
        int neg;
        return read_int(r, &u, &neg);
    }
    case F_LORA_ID: case F_SPEC_WINDOW: case F_GROUP:
        return nil_or_int(r);
    case F_MEDIUM: case F_LORA_NAME: case F_SPEC_KIND: case F_LOCALITY: case F_OWNERSHIP:
    case F_SESSION: case F_SALT:
        return nil_or_ascii(r);
    case F_EXTRA_KEYS: /* list[Any] | None */
        if (read_nil(r))
            return 1;
        if (!read_array(r, &n))
            return 0;
        for (uint32_t i = 0; i < n; i++)
            if (!skip(r, 3, 1))
                return 0;
        return 1;
    case F_LOOKAHEAD: /* list[list[int]] | None */
        if (read_nil(r))
            return 1;
        if (!read_array(r, &n))
            return 0;
        for (uint32_t i = 0; i < n; i++) {
            uint32_t m;
            if (!read_array(r, &m))
                return 0;
            for (uint32_t j = 0; j < m; j++) {
                uint64_t u;
                int neg;
                if (!read_int(r, &u, &neg))
                    return 0;
            }
        }
        return 1;
    default: /* block_digests is not a wire field: leave it to the reference */
        return 0;
    }
}

/* One event map; 1 read into `s`, 0 not modelled, -1 out of memory. */
static int scan_event(Reader *r, Scan *s) {
    uint32_t pairs;
    if (!read_map(r, &pairs))
        return 0;
    const uint8_t *hashes_at = NULL;
    int kind = 0;
    uint32_t seen = 0;
    const char *medium = NULL;
    uint32_t medium_len = 0;
    int medium_nil = 1, group_none = 1, root = 1;
    int64_t group = 0;
    uint32_t block_size = 0;
    /* The tag may come anywhere in the map: first pass reads every value, the type's field
     * set is checked once the tag is known. */
    for (uint32_t i = 0; i < pairs; i++) {
        const char *key;
        uint32_t len;
        if (!read_str(r, &key, &len))
            return 0;
        int f = field_of(key, len);
        if (f == F_OTHER && !is_ascii(key, len))
            return 0;
        if (f != F_OTHER) {
            if (seen & BIT(f))
                return 0;
            seen |= BIT(f);
        }
        if (f == F_TYPE) {
            const char *t;
            uint32_t tl;
            if (!read_ascii(r, &t, &tl))
                return 0;
            if (tl == 11 && same_bytes(t, "BlockStored", 11))
                kind = KV_STORED;
            else if (tl == 12 && same_bytes(t, "BlockRemoved", 12))
                kind = KV_REMOVED;
            else if (tl == 16 && same_bytes(t, "AllBlocksCleared", 16))
                kind = KV_CLEARED;
            else
                return 0;
        } else if (f == F_HASHES) {
            hashes_at = r->p;
            uint32_t m;
            if (!read_array(r, &m))
                return 0;
            for (uint32_t j = 0; j < m; j++) {
                uint64_t u;
                if (!read_uint(r, &u))
                    return 0;
            }
        } else if (f == F_MEDIUM) {
            if (read_nil(r))
                medium_nil = 1;
            else if (read_ascii(r, &medium, &medium_len))
                medium_nil = 0;
            else
                return 0;
        } else if (f == F_GROUP) {
            uint64_t u;
            int neg;
            if (read_nil(r))
                group_none = 1;
            else if (read_int(r, &u, &neg) && (neg || u <= (uint64_t)INT64_MAX)) {
                group_none = 0;
                group = (int64_t)u;
            } else
                return 0;
        } else if (f == F_PARENT) {
            uint64_t u;
            if (read_nil(r))
                root = 1;
            else if (read_uint(r, &u))
                root = 0;
            else
                return 0;
        } else if (f == F_BLOCK_SIZE) { /* int, not optional */
            uint64_t u;
            int neg;
            if (!read_int(r, &u, &neg))
                return 0;
            block_size = !neg && u <= UINT32_MAX ? (uint32_t)u : 0;
        } else if (f == F_OTHER) {
            if (!skip(r, 2, 0))
                return 0;
        } else if (!check_field(r, f)) {
            return 0;
        }
    }
    if (kind == 0)
        return 0;
    if (kind == KV_CLEARED) {
        /* AllBlocksCleared has no fields: every key was an unknown one, skipped */
        seen = 0;
        medium_nil = group_none = 1;
    } else {
        uint32_t allowed = kind == KV_STORED ? STORED_FIELDS : REMOVED_FIELDS;
        if (!(seen & BIT(F_HASHES)))
            return 0; /* required */
        if (seen & ~allowed & ~BIT(F_TYPE)) {
            /* a BlockStored-only key on a BlockRemoved: unknown there, so skipped by the
             * reference -- but this reader type-checked it as a BlockStored field, which the
             * reference would not: give up rather than reason about it */
            return 0;
        }
    }
    if (s->n_events == s->cap_events) {
        Py_ssize_t cap = s->cap_events ? 2 * s->cap_events : 16;
        KvPackedEvent *e = PyMem_Realloc(s->events, (size_t)cap * sizeof(KvPackedEvent));
        if (!e)
            return -1;
        s->events = e;
        s->cap_events = cap;
    }
    KvPackedEvent *ev = &s->events[s->n_events++];
    ev->kind = (uint8_t)kind;
    ev->group_none = (uint8_t)group_none;
    ev->root = kind == KV_STORED && root;
    ev->block_size = kind == KV_STORED ? block_size : 0;
    ev->group = group;
    ev->first = s->n_hashes;
    ev->n_hashes = 0;
    ev->medium = 0;
    if (kind == KV_CLEARED) {
        s->has_clear = 1;
    } else {
        int m;
        for (m = 0; m < s->n_media; m++) {
            int same = medium_nil ? s->media[m] == NULL
                                  : s->media[m] && s->media_len[m] == medium_len
                                        && memcmp(s->media[m], medium, medium_len) == 0;
            if (same)
                break;
        }
        if (m == s->n_media) {
            if (m == 8)
                return 0; /* more media in one batch than any engine has */
            s->media[m] = medium_nil ? NULL : medium;
            s->media_len[m] = medium_len;
            s->n_media++;
        }
        ev->medium = (uint16_t)m;
        Reader h = {hashes_at, r->end};
        uint32_t count;
        read_array(&h, &count);
        if (grow_hashes(s, count) < 0)
            return -1;
        for (uint32_t j = 0; j < count; j++)
            read_uint(&h, &s->hashes[s->n_hashes++]);
        ev->n_hashes = count;
    }
    return 1;
}

/* --- EncodedEvents ------------------------------------------------------------------------ */

static PyTypeObject EncodedEventsType;
static PyObject *decode_batch_fn; /* kvmiss.schemas.events.decode_batch, imported on first use */

static void EncodedEvents_dealloc(KvEncodedEvents *e) {
    Py_XDECREF(e->payload);
    Py_XDECREF(e->media);
    Py_XDECREF(e->decoded);
    PyMem_Free(e->events);
    PyMem_Free(e->hashes);
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static Py_ssize_t EncodedEvents_len(KvEncodedEvents *e) { return e->n_events; }

/* The reference decoder's events, once: what every consumer but the Applier reads. */
static PyObject *decoded(KvEncodedEvents *e) {
    if (e->decoded)
        return e->decoded;
    if (!decode_batch_fn) {
        PyObject *mod = PyImport_ImportModule("kvmiss.schemas.events");
        if (!mod)
            return NULL;
        decode_batch_fn = PyObject_GetAttrString(mod, "decode_batch");
        Py_DECREF(mod);
        if (!decode_batch_fn)
            return NULL;
    }
    PyObject *batch = PyObject_CallOneArg(decode_batch_fn, e->payload);
    if (!batch)
        return NULL;
    PyObject *events = PyObject_GetAttrString(batch, "events");
    Py_DECREF(batch);
    if (!events)
        return NULL;
    if (!PyList_CheckExact(events) || PyList_GET_SIZE(events) != e->n_events) {
        Py_DECREF(events);
        PyErr_SetString(PyExc_AssertionError, "scan_batch and decode_batch disagree on this payload");
        return NULL;
    }
    e->decoded = events;
    return events;
}

static PyObject *EncodedEvents_item(KvEncodedEvents *e, Py_ssize_t i) {
    if (i < 0 || i >= e->n_events) {
        PyErr_SetString(PyExc_IndexError, "event index out of range");
        return NULL;
    }
    PyObject *events = decoded(e);
    if (!events)
        return NULL;
    PyObject *item = PyList_GET_ITEM(events, i);
    Py_INCREF(item);
    return item;
}

static PyObject *EncodedEvents_iter(KvEncodedEvents *e) {
    PyObject *events = decoded(e);
    return events ? PyObject_GetIter(events) : NULL;
}

static PyObject *EncodedEvents_richcompare(KvEncodedEvents *e, PyObject *other, int op) {
    if (op != Py_EQ && op != Py_NE)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *events = decoded(e);
    if (!events)
        return NULL;
    PyObject *theirs = other;
    if (Py_IS_TYPE(other, &EncodedEventsType) && !(theirs = decoded((KvEncodedEvents *)other)))
        return NULL;
    return PyObject_RichCompare(events, theirs, op);
}

static PyObject *EncodedEvents_repr(KvEncodedEvents *e) {
    return PyUnicode_FromFormat("<EncodedEvents: %zd events, %zd block hashes>", e->n_events, e->n_hashes);
}

static PyObject *EncodedEvents_has_clear(KvEncodedEvents *e, void *closure) {
    return PyBool_FromLong(e->has_clear);
}

static PyObject *EncodedEvents_payload(KvEncodedEvents *e, void *closure) {
    Py_INCREF(e->payload);
    return e->payload;
}

static PyObject *EncodedEvents_n_hashes(KvEncodedEvents *e, void *closure) {
    return PyLong_FromSsize_t(e->n_hashes);
}

static PyObject *EncodedEvents_packed(KvEncodedEvents *e, PyObject *unused) {
    static const char *names[] = {NULL, "BlockStored", "BlockRemoved", "AllBlocksCleared"};
    PyObject *out = PyList_New(e->n_events);
    if (!out)
        return NULL;
    for (Py_ssize_t k = 0; k < e->n_events; k++) {
        const KvPackedEvent *ev = &e->events[k];
        PyObject *hashes = PyList_New(ev->n_hashes);
        if (!hashes) {
            Py_DECREF(out);
            return NULL;
        }
        for (uint32_t j = 0; j < ev->n_hashes; j++) {
            PyObject *h = PyLong_FromUnsignedLongLong(e->hashes[ev->first + j]);
            if (!h) {
                Py_DECREF(hashes);
                Py_DECREF(out);
                return NULL;
            }
            PyList_SET_ITEM(hashes, j, h);
        }
        PyObject *medium = ev->kind == KV_CLEARED ? Py_None : PyTuple_GET_ITEM(e->media, ev->medium);
        PyObject *group = ev->group_none ? Py_NewRef(Py_None) : PyLong_FromLongLong(ev->group);
        PyObject *item = group ? Py_BuildValue("(sONNOk)", names[ev->kind], medium, group, hashes,
                                               ev->root ? Py_True : Py_False, (unsigned long)ev->block_size)
                               : NULL;
        if (!item) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, item);
    }
    return out;
}

static PyMethodDef EncodedEvents_methods[] = {
    {"packed", (PyCFunction)EncodedEvents_packed, METH_NOARGS,
     "packed() -> list of (type, medium, group_idx, block_hashes, root, block_size): the events as the index\n"
     "reads them (root: a BlockStored without a parent)"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods EncodedEvents_as_sequence = {
    .sq_length = (lenfunc)EncodedEvents_len,
    .sq_item = (ssizeargfunc)EncodedEvents_item,
};

static PyGetSetDef EncodedEvents_getset[] = {
    {"has_clear", (getter)EncodedEvents_has_clear, NULL, "an AllBlocksCleared is among the events", NULL},
    {"payload", (getter)EncodedEvents_payload, NULL, "the msgpack batch the events were read from", NULL},
    {"n_hashes", (getter)EncodedEvents_n_hashes, NULL, "block hashes over all events", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EncodedEventsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvmiss.collectors._kvwire.EncodedEvents",
    .tp_doc = PyDoc_STR("A batch's events read from its payload: a read-only sequence of the event Structs\n"
                        "(decoded by schemas.events.decode_batch on first use); the index applies it without them."),
    .tp_basicsize = sizeof(KvEncodedEvents),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)EncodedEvents_dealloc,
    .tp_as_sequence = &EncodedEvents_as_sequence,
    .tp_iter = (getiterfunc)EncodedEvents_iter,
    .tp_richcompare = (richcmpfunc)EncodedEvents_richcompare,
    .tp_repr = (reprfunc)EncodedEvents_repr,
    .tp_getset = EncodedEvents_getset,
    .tp_methods = EncodedEvents_methods,
};

/* --- scan_batch ----------------------------------------------------------------------------- */

PyDoc_STRVAR(scan_batch_doc,
"scan_batch(payload: bytes) -> (ts, dp_rank, EncodedEvents) | None\n\n"
"Read a batch payload of the current wire form; None when the reference decoder\n"
"(schemas.events.decode_batch) must decide.");

static PyObject *scan_batch(PyObject *module, PyObject *payload) {
    if (!PyBytes_CheckExact(payload)) {
        PyErr_SetString(PyExc_TypeError, "payload must be bytes");
        return NULL;
    }
    Reader r = {(const uint8_t *)PyBytes_AS_STRING(payload), NULL};
    r.end = r.p + PyBytes_GET_SIZE(payload);
    uint32_t top, n;
    if (!read_array(&r, &top) || top < 2 || top > 3 || !need(&r, 1))
        Py_RETURN_NONE;
    double ts;
    if (*r.p == 0xcb && need(&r, 9)) {
        uint64_t bits = be(r.p + 1, 8);
        memcpy(&ts, &bits, 8);
        r.p += 9;
    } else if (*r.p == 0xca && need(&r, 5)) {
        uint32_t bits = (uint32_t)be(r.p + 1, 4);
        float f;
        memcpy(&f, &bits, 4);
        ts = f;
        r.p += 5;
    } else
        Py_RETURN_NONE;
    if (!read_array(&r, &n))
        Py_RETURN_NONE;
    Scan s = {0};
    PyObject *result = NULL;
    for (uint32_t i = 0; i < n; i++) {
        int got = scan_event(&r, &s);
        if (got < 0) {
            PyErr_NoMemory();
            goto done;
        }
        if (got == 0)
            goto give_up;
    }
    PyObject *dp_rank = Py_None;
    Py_INCREF(dp_rank);
    if (top == 3 && !read_nil(&r)) {
        uint64_t u;
        int neg;
        if (!read_int(&r, &u, &neg)) {
            Py_DECREF(dp_rank);
            goto give_up;
        }
        Py_DECREF(dp_rank);
        dp_rank = neg ? PyLong_FromLongLong((long long)u) : PyLong_FromUnsignedLongLong(u);
        if (!dp_rank)
            goto done;
    }
    if (r.p != r.end) { /* trailing bytes: the reference refuses them */
        Py_DECREF(dp_rank);
        goto give_up;
    }
    KvEncodedEvents *e = PyObject_New(KvEncodedEvents, &EncodedEventsType);
    if (!e) {
        Py_DECREF(dp_rank);
        goto done;
    }
    e->payload = payload;
    Py_INCREF(payload);
    e->decoded = NULL;
    e->n_events = s.n_events;
    e->has_clear = s.has_clear;
    e->events = s.events;
    e->hashes = s.hashes;
    e->n_hashes = s.n_hashes;
    s.events = NULL;
    s.hashes = NULL;
    e->media = PyTuple_New(s.n_media);
    if (!e->media) {
        Py_DECREF(e);
        Py_DECREF(dp_rank);
        goto done;
    }
    for (int m = 0; m < s.n_media; m++) {
        PyObject *name = s.media[m] ? PyUnicode_FromStringAndSize(s.media[m], s.media_len[m]) : Py_NewRef(Py_None);
        if (!name) {
            Py_DECREF(e);
            Py_DECREF(dp_rank);
            goto done;
        }
        if (s.media[m])
            PyUnicode_InternInPlace(&name);
        PyTuple_SET_ITEM(e->media, m, name);
    }
    result = Py_BuildValue("(dNN)", ts, dp_rank, (PyObject *)e);
    goto done;
give_up:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(s.events);
    PyMem_Free(s.hashes);
    return result;
}

/* --- receiving from ZeroMQ ------------------------------------------------------------------- */

typedef struct {
    _Alignas(8) unsigned char _[64];
} zmq_msg_t; /* libzmq's opaque message, same size and alignment */

static struct {
    int (*msg_init)(zmq_msg_t *);
    int (*msg_recv)(zmq_msg_t *, void *, int);
    int (*msg_close)(zmq_msg_t *);
    void *(*msg_data)(zmq_msg_t *);
    size_t (*msg_size)(const zmq_msg_t *);
    int (*msg_more)(const zmq_msg_t *);
    int (*errno_)(void);
} zmq;
static int zmq_bound;

#define ZMQ_DONTWAIT 1

PyDoc_STRVAR(bind_libzmq_doc,
"bind_libzmq(path) -> bool\n\n"
"Use the libzmq already loaded from ``path`` (pyzmq's own); False when it is not loaded\n"
"or lacks a needed function. Nothing is loaded that was not.");

static PyObject *bind_libzmq(PyObject *module, PyObject *arg) {
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(arg, &path))
        return NULL;
    void *lib = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_NOLOAD);
    Py_DECREF(path);
    if (!lib)
        Py_RETURN_FALSE;
    zmq.msg_init = (int (*)(zmq_msg_t *))dlsym(lib, "zmq_msg_init");
    zmq.msg_recv = (int (*)(zmq_msg_t *, void *, int))dlsym(lib, "zmq_msg_recv");
    zmq.msg_close = (int (*)(zmq_msg_t *))dlsym(lib, "zmq_msg_close");
    zmq.msg_data = (void *(*)(zmq_msg_t *))dlsym(lib, "zmq_msg_data");
    zmq.msg_size = (size_t (*)(const zmq_msg_t *))dlsym(lib, "zmq_msg_size");
    zmq.msg_more = (int (*)(const zmq_msg_t *))dlsym(lib, "zmq_msg_more");
    zmq.errno_ = (int (*)(void))dlsym(lib, "zmq_errno");
    zmq_bound = zmq.msg_init && zmq.msg_recv && zmq.msg_close && zmq.msg_data && zmq.msg_size
                && zmq.msg_more && zmq.errno_;
    /* the handle stays open: pyzmq holds the library for the process's life anyway */
    return PyBool_FromLong(zmq_bound);
}

PyDoc_STRVAR(recv_messages_doc,
"recv_messages(socket_address, max_messages) -> list[list[bytes]]\n\n"
"Up to ``max_messages`` whole messages that are waiting on the socket (``Socket.underlying``),\n"
"without blocking; [] when none. Raises OSError(errno) when libzmq fails otherwise; call\n"
"only from the thread that owns the socket, after `bind_libzmq`.");

static PyObject *recv_messages(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "recv_messages(socket_address, max_messages)");
        return NULL;
    }
    if (!zmq_bound) {
        PyErr_SetString(PyExc_RuntimeError, "bind_libzmq was not called or failed");
        return NULL;
    }
    void *sock = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t max = PyLong_AsSsize_t(args[1]);
    if ((!sock || max < 0) && PyErr_Occurred())
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    zmq_msg_t msg;
    for (Py_ssize_t k = 0; k < max; k++) {
        PyObject *frames = NULL;
        for (;;) {
            zmq.msg_init(&msg);
            if (zmq.msg_recv(&msg, sock, ZMQ_DONTWAIT) < 0) {
                int err = zmq.errno_();
                zmq.msg_close(&msg);
                /* Nothing more waiting, or an error after some messages: return those (the
                 * error comes back on the next call). A message's parts arrive together, so
                 * a failure between two parts is a real error. */
                if (frames == NULL && (err == EAGAIN || err == EINTR || PyList_GET_SIZE(out) > 0))
                    return out;
                Py_XDECREF(frames);
                Py_DECREF(out);
                errno = err;
                return PyErr_SetFromErrno(PyExc_OSError);
            }
            PyObject *frame = PyBytes_FromStringAndSize(zmq.msg_data(&msg), (Py_ssize_t)zmq.msg_size(&msg));
            int more = zmq.msg_more(&msg);
            zmq.msg_close(&msg);
            if (!frame || (!frames && !(frames = PyList_New(0))) || PyList_Append(frames, frame) < 0) {
                Py_XDECREF(frame);
                Py_XDECREF(frames);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(frame);
            if (!more)
                break;
        }
        int failed = PyList_Append(out, frames) < 0;
        Py_DECREF(frames);
        if (failed) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

/* --- module ---------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"scan_batch", (PyCFunction)scan_batch, METH_O, scan_batch_doc},
    {"bind_libzmq", (PyCFunction)bind_libzmq, METH_O, bind_libzmq_doc},
    {"recv_messages", (PyCFunction)(void (*)(void))recv_messages, METH_FASTCALL, recv_messages_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kvwire_module = {
    PyModuleDef_HEAD_INIT, "_kvwire",
    "KV-event ingest in C: batches read from msgpack, frames off ZeroMQ (see collectors/_kvwire.c).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__kvwire(void) {
    fill_fixed_width();
    if (PyType_Ready(&EncodedEventsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&kvwire_module);
    if (!m)
        return NULL;
    Py_INCREF(&EncodedEventsType);
    if (PyModule_AddObject(m, "EncodedEvents", (PyObject *)&EncodedEventsType) < 0) {
        Py_DECREF(&EncodedEventsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
