/* BlockTable: the residency records of one medium (and KV-cache group) of one worker epoch.
 *
 * The C twin of enricher/core/residency_table.py (PyBlockTable, the reference model: read that
 * first, it states the rules in a dozen lines; tests/enricher/core/test_residency_table.py checks
 * the two agree on random event streams). This file exists for two numbers in issue #4:
 * >= 1 M block events/s through the index and <= 64 bytes per resident block. A Python dict
 * pays a slot plus a 36-byte int object per key; here a block costs 28 bytes of parallel
 * slot at a load factor between 0.53 and 0.8, and no Python object at all.
 *
 * Layout: open addressing with linear probing over packed 28-byte slots (one cache line
 * holds a block's whole record, and most probe sequences), backward-shift deletion (no
 * tombstones), home slot chosen by a 128-bit multiply of the mixed key (any capacity,
 * grown by 1.5x at a load of 0.8).
 *
 * A slot holds a block's latest residency interval; older intervals of the same block are
 * chained behind it in `arena`. Sequence numbers are stored relative to the epoch's first
 * applied batch (`base`), plus one so that 0 can mean "none":
 *   stored[i]  = low 40 bits: stored seq + 1 (0: the store predates our history)
 *                high 24 bits: live copies (refcount; tiers and recomputes store twice)
 *   removed[i] = low 40 bits: removed seq + 1 (0: still resident); bit 40: by a clear
 *   prev[i]    = older interval: arena index + 1 (0: none)
 * A slot is occupied when stored | removed != 0 (a resident record has copies >= 1, a
 * closed one has a removal).
 *
 * `ring` is the retention queue: (engine ts, key) of every interval that closed, in apply
 * order; `prune` drops closed intervals older than a horizon and returns their keys so that
 * the caller can remember them in its no-false-negative filter.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "../../collectors/_kvwire.h" /* EncodedEvents: a batch read in C, applied without Structs */

#define SEQ_BITS 40
#define SEQ_MASK ((UINT64_C(1) << SEQ_BITS) - 1)
#define CLEAR_BIT (UINT64_C(1) << SEQ_BITS)
#define REFS_ONE (UINT64_C(1) << SEQ_BITS)
#define REFS_MAX ((UINT64_C(1) << (64 - SEQ_BITS)) - 1)
#define MIN_CAPACITY 16

typedef struct {
    uint64_t stored;  /* seq + 1, no copy count (an older interval is closed) */
    uint64_t removed; /* seq + 1 | CLEAR_BIT */
    uint32_t prev;    /* arena index + 1; for a free entry, the next free one */
    uint32_t _pad;
} Older;

typedef struct {
    double ts;
    uint64_t key;
} Closed;

/* One block's slot; packed to 28 bytes (x86-64 and arm64 load unaligned words at no cost). */
typedef struct __attribute__((packed)) {
    uint64_t key;
    uint64_t stored;
    uint64_t removed;
    uint32_t prev;
} Slot;

typedef struct {
    PyObject_HEAD
    int64_t base;
    Slot *slots;
    size_t cap, len;
    Older *arena;
    uint32_t arena_len, arena_cap, arena_free; /* free: index + 1 of the first free entry */
    size_t arena_live;
    Closed *ring;
    size_t ring_head, ring_len, ring_cap;
} BlockTable;

static inline uint64_t mix(uint64_t x) {
    /* splitmix64's finaliser: engine hashes are uniform already, test keys are not */
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    x ^= x >> 31;
    return x;
}

static inline size_t home_of(uint64_t key, size_t cap) {
    return (size_t)(((__uint128_t)mix(key) * cap) >> 64);
}

static inline int occupied(const BlockTable *t, size_t i) {
    return (t->slots[i].stored | t->slots[i].removed) != 0;
}

/* Slot of `key`, or the empty slot where it would go (*found tells which). */
static inline size_t probe(const BlockTable *t, uint64_t key, int *found) {
    size_t i = home_of(key, t->cap);
    for (;;) {
        if (!occupied(t, i)) {
            *found = 0;
            return i;
        }
        if (t->slots[i].key == key) {
            *found = 1;
            return i;
        }
        if (++i == t->cap)
            i = 0;
    }
}

static int resize(BlockTable *t, size_t cap) {
    Slot *slots = PyMem_Calloc(cap, sizeof(Slot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++) {
        if (!occupied(t, i))
            continue;
        size_t j = home_of(t->slots[i].key, cap);
        while (slots[j].stored | slots[j].removed) {
            if (++j == cap)
                j = 0;
        }
        slots[j] = t->slots[i];
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

/* Room for one more key at a load factor <= 0.8. */
static inline int reserve_one(BlockTable *t) {
    if ((t->len + 1) * 5 <= t->cap * 4)
        return 0;
    return resize(t, t->cap + t->cap / 2);
}

/* Backward-shift deletion: close the gap so every probe sequence stays unbroken. */
static void delete_slot(BlockTable *t, size_t i) {
    size_t j = i;
    for (;;) {
        if (++j == t->cap)
            j = 0;
        if (!occupied(t, j))
            break;
        size_t h = home_of(t->slots[j].key, t->cap);
        /* move j back to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays)
            continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    memset(&t->slots[i], 0, sizeof(Slot));
    t->len--;
}

/* --- the arena of older intervals ----------------------------------------------------- */

static uint32_t arena_push(BlockTable *t, uint64_t stored, uint64_t removed, uint32_t prev) {
    uint32_t at;
    if (t->arena_free) {
        at = t->arena_free - 1;
        t->arena_free = t->arena[at].prev;
    } else {
        if (t->arena_len == t->arena_cap) {
            size_t cap = t->arena_cap ? (size_t)t->arena_cap * 2 : 64;
            if (cap > UINT32_MAX - 1)
                cap = UINT32_MAX - 1;
            if (cap <= t->arena_cap) {
                PyErr_SetString(PyExc_MemoryError, "residency history arena full");
                return 0;
            }
            Older *grown = PyMem_Realloc(t->arena, cap * sizeof(Older));
            if (!grown) {
                PyErr_NoMemory();
                return 0;
            }
            t->arena = grown;
            t->arena_cap = (uint32_t)cap;
        }
        at = t->arena_len++;
    }
    t->arena[at].stored = stored;
    t->arena[at].removed = removed;
    t->arena[at].prev = prev;
    t->arena_live++;
    return at + 1;
}

static void arena_free_chain(BlockTable *t, uint32_t link) {
    while (link) {
        uint32_t at = link - 1;
        link = t->arena[at].prev;
        t->arena[at].prev = t->arena_free;
        t->arena_free = at + 1;
        t->arena_live--;
    }
}

/* Push the slot's current (closed) interval behind it, leaving the slot to a new one. */
static int push_current(BlockTable *t, size_t i) {
    uint32_t link = arena_push(t, t->slots[i].stored & SEQ_MASK, t->slots[i].removed, t->slots[i].prev);
    if (!link)
        return -1;
    t->slots[i].prev = link;
    return 0;
}

/* --- retention queue -------------------------------------------------------------------- */

static int ring_push(BlockTable *t, double ts, uint64_t key) {
    if (t->ring_len == t->ring_cap) {
        size_t cap = t->ring_cap ? t->ring_cap * 2 : 256;
        Closed *grown = PyMem_Malloc(cap * sizeof(Closed));
        if (!grown) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t k = 0; k < t->ring_len; k++)
            grown[k] = t->ring[(t->ring_head + k) % t->ring_cap];
        PyMem_Free(t->ring);
        t->ring = grown;
        t->ring_head = 0;
        t->ring_cap = cap;
    }
    t->ring[(t->ring_head + t->ring_len) % t->ring_cap] = (Closed){ts, key};
    t->ring_len++;
    return 0;
}

/* --- argument helpers ------------------------------------------------------------------- */

static int rel_seq(BlockTable *t, PyObject *obj, uint64_t *out) {
    long long seq = PyLong_AsLongLong(obj);
    if (seq == -1 && PyErr_Occurred())
        return -1;
    long long rel = seq - t->base;
    if (rel < 0 || (uint64_t)rel >= SEQ_MASK) {
        PyErr_Format(PyExc_OverflowError,
                     "batch seq %lld outside this epoch's range (first applied seq %lld)", seq,
                     (long long)t->base);
        return -1;
    }
    *out = (uint64_t)rel + 1;
    return 0;
}

/* A batch's (seq, engine ts) arguments, the seq relative to the table as stored. */
static int seq_and_ts(BlockTable *t, PyObject *seq_obj, PyObject *ts_obj, uint64_t *seq, double *ts) {
    if (rel_seq(t, seq_obj, seq) < 0)
        return -1;
    *ts = PyFloat_AsDouble(ts_obj);
    return (*ts == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *abs_seq(BlockTable *t, uint64_t field) {
    uint64_t rel = field & SEQ_MASK;
    if (!rel)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(t->base + (long long)(rel - 1));
}

/* A block hash as uint64, refusing negatives and values of 65+ bits. (PyLong_As-
 * UnsignedLongLong goes through a generic byte-array conversion: 40% of a batch's cost.) */
static inline int key_of(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj))
        goto bad;
#if PY_VERSION_HEX >= 0x030D0000
    Py_ssize_t n = PyLong_AsNativeBytes(obj, out, sizeof(*out),
                                        Py_ASNATIVEBYTES_NATIVE_ENDIAN | Py_ASNATIVEBYTES_UNSIGNED_BUFFER
                                            | Py_ASNATIVEBYTES_REJECT_NEGATIVE);
    if (n < 0) {
        PyErr_Clear();
        goto bad;
    }
    if ((size_t)n > sizeof(*out))
        goto bad;
#else
    if (_PyLong_Sign(obj) < 0 || _PyLong_NumBits(obj) > 64)
        goto bad;
    *out = PyLong_AsUnsignedLongLongMask(obj);
#endif
    return 0;
bad:
    PyErr_SetString(PyExc_OverflowError, "a block hash must be an int in [0, 2**64)");
    return -1;
}

/* --- methods ---------------------------------------------------------------------------- */

/* One block of a BlockStored: 1 when it already had a live copy stored in the same batch
 * (a same-step copy), 0 otherwise, -1 with an exception set. */
static inline int store_key(BlockTable *t, uint64_t key, uint64_t seq) {
    if (reserve_one(t) < 0)
        return -1;
    int found;
    size_t i = probe(t, key, &found);
    if (!found) {
        t->slots[i].key = key;
        t->slots[i].stored = REFS_ONE | seq;
        t->len++;
        return 0;
    }
    if (t->slots[i].removed == 0) { /* another live copy */
        if ((t->slots[i].stored >> SEQ_BITS) < REFS_MAX)
            t->slots[i].stored += REFS_ONE;
        return (t->slots[i].stored & SEQ_MASK) == seq;
    }
    /* stored again after its removal */
    if (push_current(t, i) < 0)
        return -1;
    t->slots[i].stored = REFS_ONE | seq;
    t->slots[i].removed = 0;
    return 0;
}

/* One block of a BlockRemoved: 1 when its interval closed, 0 when a copy is left, -1 with
 * an exception set. */
static inline int remove_key(BlockTable *t, uint64_t key, uint64_t seq, double ts) {
    if (reserve_one(t) < 0)
        return -1;
    int found;
    size_t i = probe(t, key, &found);
    if (!found) { /* stored before our history began */
        t->slots[i].key = key;
        t->slots[i].stored = 0;
        t->slots[i].removed = seq;
        t->len++;
    } else if (t->slots[i].removed != 0) { /* removed again: its store predates our history */
        if (push_current(t, i) < 0)
            return -1;
        t->slots[i].stored = 0;
        t->slots[i].removed = seq;
    } else if ((t->slots[i].stored >> SEQ_BITS) > 1) {
        t->slots[i].stored -= REFS_ONE;
        return 0;
    } else {
        t->slots[i].stored &= SEQ_MASK;
        t->slots[i].removed = seq;
    }
    return ring_push(t, ts, key) < 0 ? -1 : 1;
}

/* One BlockStored: `*same_step` collects hashes that already had a live copy stored in the
 * same batch (created on the first). 0 on success, -1 with an exception set. */
static int table_store(BlockTable *t, PyObject *hashes, uint64_t seq, PyObject **same_step) {
    PyObject *fast = PySequence_Fast(hashes, "block_hashes must be a sequence");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t key;
        int copy;
        if (key_of(items[k], &key) < 0 || (copy = store_key(t, key, seq)) < 0)
            goto fail;
        if (copy) {
            if (!*same_step && !(*same_step = PyList_New(0)))
                goto fail;
            if (PyList_Append(*same_step, items[k]) < 0)
                goto fail;
        }
    }
    Py_DECREF(fast);
    return 0;
fail:
    Py_DECREF(fast);
    return -1;
}

/* One BlockRemoved: returns how many intervals closed, -1 with an exception set. */
static Py_ssize_t table_remove(BlockTable *t, PyObject *hashes, uint64_t seq, double ts) {
    PyObject *fast = PySequence_Fast(hashes, "block_hashes must be a sequence");
    if (!fast)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), closed = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < n; k++) {
        uint64_t key;
        int done;
        if (key_of(items[k], &key) < 0 || (done = remove_key(t, key, seq, ts)) < 0) {
            Py_DECREF(fast);
            return -1;
        }
        closed += done;
    }
    Py_DECREF(fast);
    return closed;
}

PyDoc_STRVAR(store_doc,
"store(hashes, seq) -> list | None\n\n"
"Apply one BlockStored of batch ``seq``. Returns the hashes that already had a live copy\n"
"stored in the same batch (a same-step copy), or None when there were none.");

static PyObject *BlockTable_store(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "store(hashes, seq)");
        return NULL;
    }
    uint64_t seq;
    if (rel_seq(t, args[1], &seq) < 0)
        return NULL;
    PyObject *same_step = NULL;
    if (table_store(t, args[0], seq, &same_step) < 0) {
        Py_XDECREF(same_step);
        return NULL;
    }
    if (same_step)
        return same_step;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(remove_doc,
"remove(hashes, seq, ts) -> int\n\n"
"Apply one BlockRemoved of batch ``seq`` at engine time ``ts``. A block with several live\n"
"copies loses one; its interval closes with the last. A removal of a block we never saw\n"
"stored (it predates our history) is a closed interval with an unknown store.\n"
"Returns how many intervals closed.");

static PyObject *BlockTable_remove(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "remove(hashes, seq, ts)");
        return NULL;
    }
    uint64_t seq;
    double ts;
    if (seq_and_ts(t, args[1], args[2], &seq, &ts) < 0)
        return NULL;
    Py_ssize_t closed = table_remove(t, args[0], seq, ts);
    return closed < 0 ? NULL : PyLong_FromSsize_t(closed);
}

PyDoc_STRVAR(clear_doc,
"clear(seq, ts) -> int\n\n"
"AllBlocksCleared in batch ``seq``: every resident interval closes, marked as by a clear.\n"
"O(capacity), like every peer's handling of a clear, and rare. Returns how many closed.");

static PyObject *BlockTable_clear(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "clear(seq, ts)");
        return NULL;
    }
    uint64_t seq;
    double ts;
    if (seq_and_ts(t, args[0], args[1], &seq, &ts) < 0)
        return NULL;
    Py_ssize_t closed = 0;
    for (size_t i = 0; i < t->cap; i++) {
        if (!occupied(t, i) || t->slots[i].removed != 0)
            continue;
        t->slots[i].stored &= SEQ_MASK;
        t->slots[i].removed = seq | CLEAR_BIT;
        if (ring_push(t, ts, t->slots[i].key) < 0)
            return NULL;
        closed++;
    }
    return PyLong_FromSsize_t(closed);
}

PyDoc_STRVAR(prune_doc,
"prune(before_ts, horizon_seq) -> list\n\n"
"Drop intervals that closed before engine time ``before_ts`` (and before batch\n"
"``horizon_seq``, None for no such batch), with everything older of the same block.\n"
"Resident intervals are never dropped. Returns the hashes that lost records.");

static PyObject *BlockTable_prune(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "prune(before_ts, horizon_seq)");
        return NULL;
    }
    double before = PyFloat_AsDouble(args[0]);
    if (before == -1.0 && PyErr_Occurred())
        return NULL;
    uint64_t horizon = 0; /* 0: no batch at or after the horizon yet: every removal is older */
    if (args[1] != Py_None) {
        long long h = PyLong_AsLongLong(args[1]);
        if (h == -1 && PyErr_Occurred())
            return NULL;
        long long rel = h - t->base;
        horizon = rel < 0 ? 1 : ((uint64_t)rel >= SEQ_MASK ? SEQ_MASK : (uint64_t)rel + 1);
    }
    PyObject *dropped = PyList_New(0);
    if (!dropped)
        return NULL;
    while (t->ring_len && t->ring[t->ring_head].ts < before) {
        uint64_t key = t->ring[t->ring_head].key;
        t->ring_head = (t->ring_head + 1) % t->ring_cap;
        t->ring_len--;
        int found;
        size_t i = probe(t, key, &found);
        if (!found)
            continue;
#define OLD_ENOUGH(rem) ((rem) != 0 && (horizon == 0 || ((rem) & SEQ_MASK) < horizon))
        int drop = 0;
        if (OLD_ENOUGH(t->slots[i].removed)) {
            arena_free_chain(t, t->slots[i].prev);
            delete_slot(t, i);
            drop = 1;
        } else {
            /* walk the older intervals; `holder` is the one whose prev is `link` (NULL: the slot) */
            Older *holder = NULL;
            uint32_t link = t->slots[i].prev;
            while (link) {
                Older *o = &t->arena[link - 1];
                if (OLD_ENOUGH(o->removed)) {
                    arena_free_chain(t, link);
                    if (holder)
                        holder->prev = 0;
                    else
                        t->slots[i].prev = 0;
                    drop = 1;
                    break;
                }
                holder = o;
                link = o->prev;
            }
        }
#undef OLD_ENOUGH
        if (drop) {
            PyObject *k = PyLong_FromUnsignedLongLong(key);
            if (!k || PyList_Append(dropped, k) < 0) {
                Py_XDECREF(k);
                Py_DECREF(dropped);
                return NULL;
            }
            Py_DECREF(k);
        }
    }
    if (t->len * 5 < t->cap && t->cap > MIN_CAPACITY) { /* shrink after a mass expiry */
        size_t cap = t->len * 2 > MIN_CAPACITY ? t->len * 2 : MIN_CAPACITY;
        if (resize(t, cap) < 0) {
            Py_DECREF(dropped);
            return NULL;
        }
    }
    /* Give back what a burst left behind once it has fully aged out. */
    if (t->arena_live == 0 && t->arena_cap) {
        PyMem_Free(t->arena);
        t->arena = NULL;
        t->arena_len = t->arena_cap = t->arena_free = 0;
    }
    if (t->ring_len == 0 && t->ring_cap) {
        PyMem_Free(t->ring);
        t->ring = NULL;
        t->ring_head = t->ring_cap = 0;
    }
    return dropped;
}

static PyObject *interval_tuple(BlockTable *t, uint64_t stored, uint64_t removed) {
    PyObject *s = abs_seq(t, stored), *r = abs_seq(t, removed);
    if (!s || !r) {
        Py_XDECREF(s);
        Py_XDECREF(r);
        return NULL;
    }
    PyObject *by_clear = (removed & CLEAR_BIT) ? Py_True : Py_False;
    Py_INCREF(by_clear);
    PyObject *tup = PyTuple_New(3);
    if (!tup) {
        Py_DECREF(s);
        Py_DECREF(r);
        Py_DECREF(by_clear);
        return NULL;
    }
    PyTuple_SET_ITEM(tup, 0, s);
    PyTuple_SET_ITEM(tup, 1, r);
    PyTuple_SET_ITEM(tup, 2, by_clear);
    return tup;
}

PyDoc_STRVAR(as_of_doc,
"as_of(hash, step_seq) -> (stored_seq, removed_seq, by_clear) | None\n\n"
"The latest interval of ``hash`` whose store happened before batch ``step_seq`` (a store\n"
"in the lookup's own step came after the lookup); an unknown store (None) counts as before.");

static PyObject *BlockTable_as_of(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "as_of(hash, step_seq)");
        return NULL;
    }
    uint64_t key;
    if (key_of(args[0], &key) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE; /* not a block hash: never stored */
    }
    long long step = PyLong_AsLongLong(args[1]);
    if (step == -1 && PyErr_Occurred())
        return NULL;
    long long rel = step - t->base;
    /* stored field < limit <=> stored before the step (an unknown store, 0, always is) */
    uint64_t limit = rel < 0 ? 1 : ((uint64_t)rel >= SEQ_MASK ? SEQ_MASK : (uint64_t)rel + 1);
    int found;
    size_t i = probe(t, key, &found);
    if (!found)
        Py_RETURN_NONE;
    uint64_t s = t->slots[i].stored & SEQ_MASK;
    if (s < limit)
        return interval_tuple(t, s, t->slots[i].removed);
    for (uint32_t link = t->slots[i].prev; link; link = t->arena[link - 1].prev) {
        Older *o = &t->arena[link - 1];
        if (o->stored < limit)
            return interval_tuple(t, o->stored, o->removed);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(chain_doc,
"chain(hash) -> list of (stored_seq, removed_seq, by_clear), newest first");

static PyObject *BlockTable_chain(BlockTable *t, PyObject *arg) {
    uint64_t key;
    if (key_of(arg, &key) < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    int found;
    size_t i = probe(t, key, &found);
    if (!found)
        return out;
    uint64_t s = t->slots[i].stored & SEQ_MASK, r = t->slots[i].removed;
    uint32_t link = t->slots[i].prev;
    for (;;) {
        PyObject *tup = interval_tuple(t, s, r);
        if (!tup || PyList_Append(out, tup) < 0) {
            Py_XDECREF(tup);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(tup);
        if (!link)
            break;
        s = t->arena[link - 1].stored;
        r = t->arena[link - 1].removed;
        link = t->arena[link - 1].prev;
    }
    return out;
}

PyDoc_STRVAR(copies_doc, "copies(hash) -> int: live copies of a resident block (0 when not resident)");

static PyObject *BlockTable_copies(BlockTable *t, PyObject *arg) {
    uint64_t key;
    if (key_of(arg, &key) < 0)
        return NULL;
    int found;
    size_t i = probe(t, key, &found);
    if (!found || t->slots[i].removed != 0)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(t->slots[i].stored >> SEQ_BITS);
}

static int BlockTable_contains(BlockTable *t, PyObject *arg) {
    uint64_t v;
    if (key_of(arg, &v) < 0) {
        PyErr_Clear();
        return 0;
    }
    int found;
    probe(t, v, &found);
    return found;
}

static Py_ssize_t BlockTable_len(BlockTable *t) {
    return (Py_ssize_t)t->len;
}

static PyObject *BlockTable_nbytes(BlockTable *t, void *closure) {
    size_t bytes = t->cap * sizeof(Slot) + (size_t)t->arena_cap * sizeof(Older)
                   + t->ring_cap * sizeof(Closed) + sizeof(BlockTable);
    return PyLong_FromSize_t(bytes);
}

static PyObject *BlockTable_older(BlockTable *t, void *closure) {
    return PyLong_FromSize_t(t->arena_live);
}

static PyObject *BlockTable_retained(BlockTable *t, void *closure) {
    return PyLong_FromSize_t(t->ring_len);
}

static PyObject *BlockTable_base(BlockTable *t, void *closure) {
    return PyLong_FromLongLong(t->base);
}

static PyObject *BlockTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"base_seq", NULL};
    long long base = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|L", kwlist, &base))
        return NULL;
    BlockTable *t = (BlockTable *)type->tp_alloc(type, 0);
    if (!t)
        return NULL;
    t->base = base;
    t->cap = MIN_CAPACITY;
    if (!(t->slots = PyMem_Calloc(t->cap, sizeof(Slot)))) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

static void BlockTable_dealloc(BlockTable *t) {
    PyMem_Free(t->slots);
    PyMem_Free(t->arena);
    PyMem_Free(t->ring);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef BlockTable_methods[] = {
    {"store", (PyCFunction)(void (*)(void))BlockTable_store, METH_FASTCALL, store_doc},
    {"remove", (PyCFunction)(void (*)(void))BlockTable_remove, METH_FASTCALL, remove_doc},
    {"clear", (PyCFunction)(void (*)(void))BlockTable_clear, METH_FASTCALL, clear_doc},
    {"prune", (PyCFunction)(void (*)(void))BlockTable_prune, METH_FASTCALL, prune_doc},
    {"as_of", (PyCFunction)(void (*)(void))BlockTable_as_of, METH_FASTCALL, as_of_doc},
    {"chain", (PyCFunction)BlockTable_chain, METH_O, chain_doc},
    {"copies", (PyCFunction)BlockTable_copies, METH_O, copies_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BlockTable_getset[] = {
    {"nbytes", (getter)BlockTable_nbytes, NULL, "bytes held (slots, older intervals, retention queue)", NULL},
    {"older", (getter)BlockTable_older, NULL, "older intervals chained behind current ones", NULL},
    {"retained", (getter)BlockTable_retained, NULL, "closed intervals waiting for retention", NULL},
    {"base_seq", (getter)BlockTable_base, NULL, "the epoch's first applied seq", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods BlockTable_as_sequence = {
    .sq_length = (lenfunc)BlockTable_len,
    .sq_contains = (objobjproc)BlockTable_contains,
};

static PyTypeObject BlockTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvmiss.enricher.core._blocktable.BlockTable",
    .tp_doc = PyDoc_STR("Residency intervals of one medium of one worker epoch, keyed by uint64 block hash."),
    .tp_basicsize = sizeof(BlockTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = BlockTable_new,
    .tp_dealloc = (destructor)BlockTable_dealloc,
    .tp_methods = BlockTable_methods,
    .tp_getset = BlockTable_getset,
    .tp_as_sequence = &BlockTable_as_sequence,
};

/* --- Applier: a batch's events into a worker epoch's tables, in one call ------------------
 *
 * EpochView.apply's loop in C (its Python form stays in enricher/core/index.py for the reference
 * model). It knows the event Structs' field names (block_hashes, medium, group_idx) and
 * nothing else: tables are looked up in the view's own dict, keyed (raw medium, group), whose
 * values are (gpu_group0, BlockTable). It stops at the first event it cannot handle -- a
 * clear, any other type, or a (medium, group) with no table yet -- and returns its index, so
 * the view handles that one in Python and calls again from the next: order is kept and the
 * applier holds no reference back to the view. */

/* Where a field of an event type lives: msgspec Structs keep fields in slots, so a member
 * descriptor's offset reads them without a getattr (-1: use getattr). */
typedef struct {
    Py_ssize_t block_hashes, medium, group_idx;
} FieldOffsets;

typedef struct {
    PyObject_HEAD
    FieldOffsets stored_at, removed_at;
    PyObject *tables;       /* dict (medium, group) -> (bool, BlockTable) */
    PyObject *same_step;    /* dict hash -> seq: same-step copies on GPU, group 0 */
    PyObject *stored_type;  /* BlockStored */
    PyObject *removed_type; /* BlockRemoved */
    PyObject *note;         /* callable(event, seq) for GPU group-0 stores, or None */
    PyObject *recent;       /* the table the last call used (for prefetching), or NULL */
    unsigned long long gpu_removed; /* hashes removed from GPU group-0 tables so far (evictions) */
} Applier;

static PyObject *str_block_hashes, *str_medium, *str_group_idx;

static Py_ssize_t slot_offset(PyObject *type, PyObject *name) {
    PyObject *d = PyObject_GetAttr(type, name);
    Py_ssize_t offset = -1;
    if (!d) {
        PyErr_Clear();
        return -1;
    }
    if (Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)d)->d_member;
        if (member->type == T_OBJECT_EX && !(member->flags & READ_RESTRICTED))
            offset = member->offset;
    }
    Py_DECREF(d);
    return offset;
}

static void find_offsets(PyObject *type, FieldOffsets *at) {
    at->block_hashes = slot_offset(type, str_block_hashes);
    at->medium = slot_offset(type, str_medium);
    at->group_idx = slot_offset(type, str_group_idx);
}

/* A field of `obj` as a new reference: straight from its slot when the offset is known. */
static inline PyObject *field(PyObject *obj, Py_ssize_t offset, PyObject *name) {
    if (offset >= 0) {
        PyObject *v = *(PyObject **)((char *)obj + offset);
        if (v) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, name);
}

/* kvmiss.collectors._kvwire.EncodedEvents, looked up when the first Applier is made; NULL
 * when that module is not built (every batch then arrives as Structs). */
static PyTypeObject *encoded_type;
static int encoded_type_looked_up;

static void look_up_encoded_type(void) {
    if (encoded_type_looked_up)
        return;
    encoded_type_looked_up = 1;
    PyObject *mod = PyImport_ImportModule("kvmiss.collectors._kvwire");
    PyObject *type = mod ? PyObject_GetAttrString(mod, "EncodedEvents") : NULL;
    Py_XDECREF(mod);
    if (type && PyType_Check(type) && ((PyTypeObject *)type)->tp_basicsize == sizeof(KvEncodedEvents))
        encoded_type = (PyTypeObject *)type; /* kept for the process's life */
    else
        Py_XDECREF(type);
    PyErr_Clear();
}

static PyObject *Applier_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"tables", "same_step", "stored_type", "removed_type", "note", NULL};
    PyObject *tables, *same_step, *stored_type, *removed_type, *note = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO|O", kwlist, &PyDict_Type, &tables, &PyDict_Type,
                                     &same_step, &stored_type, &removed_type, &note))
        return NULL;
    Applier *a = (Applier *)type->tp_alloc(type, 0);
    if (!a)
        return NULL;
    Py_INCREF(tables);
    Py_INCREF(same_step);
    Py_INCREF(stored_type);
    Py_INCREF(removed_type);
    Py_INCREF(note);
    a->tables = tables;
    a->same_step = same_step;
    a->stored_type = stored_type;
    a->removed_type = removed_type;
    a->note = note;
    find_offsets(stored_type, &a->stored_at);
    find_offsets(removed_type, &a->removed_at);
    look_up_encoded_type();
    return (PyObject *)a;
}

static void Applier_dealloc(Applier *a) {
    Py_XDECREF(a->recent);
    Py_XDECREF(a->tables);
    Py_XDECREF(a->same_step);
    Py_XDECREF(a->stored_type);
    Py_XDECREF(a->removed_type);
    Py_XDECREF(a->note);
    Py_TYPE(a)->tp_free((PyObject *)a);
}

/* The (gpu_group0, table) entry of (medium, group), NULL (no exception) when the view has
 * none yet. Borrowed from the tables dict. */
static PyObject *entry_of(Applier *a, PyObject *medium, PyObject *group) {
    PyObject *key = PyTuple_Pack(2, medium, group);
    if (!key)
        return NULL;
    PyObject *entry = PyDict_GetItemWithError(a->tables, key);
    Py_DECREF(key);
    return entry;
}

/* Same medium and group as the previous event (the common case: one medium per engine)? */
static inline int same_place(PyObject *m1, PyObject *g1, PyObject *m2, PyObject *g2) {
    if (m1 != m2) {
        if (!PyUnicode_CheckExact(m1) || !PyUnicode_CheckExact(m2) || PyUnicode_Compare(m1, m2) != 0)
            return 0;
    }
    if (g1 != g2) {
        if (!PyLong_CheckExact(g1) || !PyLong_CheckExact(g2)
            || PyObject_RichCompareBool(g1, g2, Py_EQ) != 1)
            return 0;
    }
    return 1;
}

/* Touch the home slot of every block of events[start:] in `t` before applying any: the
 * probes are random accesses into a table far larger than the caches, and issued together
 * their misses overlap instead of queueing one behind another. */
static void prefetch_batch(Applier *a, BlockTable *t, PyObject **items, Py_ssize_t start, Py_ssize_t n) {
    for (Py_ssize_t k = start; k < n; k++) {
        PyObject *cls = (PyObject *)Py_TYPE(items[k]);
        const FieldOffsets *at = cls == a->stored_type ? &a->stored_at : cls == a->removed_type ? &a->removed_at : NULL;
        if (!at || at->block_hashes < 0)
            continue;
        PyObject *hashes = *(PyObject **)((char *)items[k] + at->block_hashes);
        if (!hashes || !PyList_CheckExact(hashes))
            continue;
        Py_ssize_t m = PyList_GET_SIZE(hashes);
        for (Py_ssize_t j = 0; j < m; j++) {
            uint64_t v;
            if (key_of(PyList_GET_ITEM(hashes, j), &v) < 0) {
                PyErr_Clear(); /* reported when the block is applied */
                continue;
            }
            const char *slot = (const char *)&t->slots[home_of(v, t->cap)];
            __builtin_prefetch(slot);
            __builtin_prefetch(slot + sizeof(Slot) - 1);
        }
    }
}

/* Take the (gpu_group0, table) entry of the next events' place: the table, its flag, the
 * batch's seq relative to it. 0, or -1 with an exception set. */
static int enter_table(Applier *a, PyObject *entry, PyObject *seq_obj, BlockTable **t, int *gpu_group0,
                       uint64_t *seq) {
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2
        || Py_TYPE(PyTuple_GET_ITEM(entry, 1)) != &BlockTableType) {
        PyErr_SetString(PyExc_TypeError, "tables values must be (bool, BlockTable)");
        return -1;
    }
    *gpu_group0 = PyTuple_GET_ITEM(entry, 0) == Py_True;
    *t = (BlockTable *)PyTuple_GET_ITEM(entry, 1);
    if ((PyObject *)*t != a->recent) {
        Py_INCREF(*t);
        Py_XSETREF(a->recent, (PyObject *)*t);
    }
    return rel_seq(*t, seq_obj, seq);
}

/* Applier_call for events read by _kvwire.scan_batch: the same loop over packed events. */
static PyObject *apply_encoded(Applier *a, KvEncodedEvents *e, PyObject *seq_obj, double ts, Py_ssize_t start) {
    Py_ssize_t n = e->n_events, k;
    BlockTable *t = NULL;
    int gpu_group0 = 0, last_medium = -1, last_none = 0;
    int64_t last_group = 0;
    uint64_t seq = 0;
    if (a->recent) {
        BlockTable *r = (BlockTable *)a->recent;
        for (Py_ssize_t j = start < n ? e->events[start].first : e->n_hashes; j < e->n_hashes; j++) {
            const char *slot = (const char *)&r->slots[home_of(e->hashes[j], r->cap)];
            __builtin_prefetch(slot);
            __builtin_prefetch(slot + sizeof(Slot) - 1);
        }
    }
    for (k = start; k < n; k++) {
        const KvPackedEvent *ev = &e->events[k];
        if (ev->kind == KV_CLEARED)
            break;
        if (!t || ev->medium != last_medium || ev->group_none != last_none || (!ev->group_none && ev->group != last_group)) {
            PyObject *group = ev->group_none ? Py_NewRef(Py_None) : PyLong_FromLongLong(ev->group);
            if (!group)
                return NULL;
            PyObject *entry = entry_of(a, PyTuple_GET_ITEM(e->media, ev->medium), group);
            Py_DECREF(group);
            last_medium = ev->medium;
            last_none = ev->group_none;
            last_group = ev->group;
            if (!entry) {
                if (PyErr_Occurred())
                    return NULL;
                break; /* no table yet: the view creates it */
            }
            if (enter_table(a, entry, seq_obj, &t, &gpu_group0, &seq) < 0)
                return NULL;
        }
        const uint64_t *keys = e->hashes + ev->first;
        if (ev->kind == KV_STORED) {
            if (gpu_group0 && a->note != Py_None) {
                PyObject *event = PySequence_GetItem((PyObject *)e, k);
                PyObject *r = event ? PyObject_CallFunctionObjArgs(a->note, event, seq_obj, NULL) : NULL;
                Py_XDECREF(event);
                if (!r)
                    return NULL;
                Py_DECREF(r);
            }
            for (uint32_t j = 0; j < ev->n_hashes; j++) {
                int copy = store_key(t, keys[j], seq);
                if (copy < 0)
                    return NULL;
                if (copy && gpu_group0) {
                    PyObject *key = PyLong_FromUnsignedLongLong(keys[j]);
                    int failed = !key || PyDict_SetItem(a->same_step, key, seq_obj) < 0;
                    Py_XDECREF(key);
                    if (failed)
                        return NULL;
                }
            }
        } else {
            for (uint32_t j = 0; j < ev->n_hashes; j++)
                if (remove_key(t, keys[j], seq, ts) < 0)
                    return NULL;
            if (gpu_group0)
                a->gpu_removed += ev->n_hashes;
        }
    }
    return PyLong_FromSsize_t(k);
}

static PyObject *Applier_call(Applier *a, PyObject *args, PyObject *kwds) {
    PyObject *events, *seq_obj;
    double ts;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTuple(args, "OOd|n", &events, &seq_obj, &ts, &start))
        return NULL;
    if (encoded_type && Py_IS_TYPE(events, encoded_type))
        return apply_encoded(a, (KvEncodedEvents *)events, seq_obj, ts, start);
    PyObject *fast = PySequence_Fast(events, "events must be a sequence");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), k;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    /* the previous event's place and table: new references to medium and group */
    PyObject *last_medium = NULL, *last_group = NULL;
    BlockTable *t = NULL;
    int gpu_group0 = 0;
    uint64_t seq = 0;
    if (a->recent)
        prefetch_batch(a, (BlockTable *)a->recent, items, start, n);
    for (k = start; k < n; k++) {
        PyObject *event = items[k], *cls = (PyObject *)Py_TYPE(event);
        int storing = cls == a->stored_type;
        if (!storing && cls != a->removed_type)
            break; /* a clear, or a type this loop does not know */
        const FieldOffsets *at = storing ? &a->stored_at : &a->removed_at;
        PyObject *medium = field(event, at->medium, str_medium);
        PyObject *group = medium ? field(event, at->group_idx, str_group_idx) : NULL;
        if (!group) {
            Py_XDECREF(medium);
            goto fail;
        }
        if (!t || !same_place(medium, group, last_medium, last_group)) {
            PyObject *entry = entry_of(a, medium, group);
            Py_XDECREF(last_medium);
            Py_XDECREF(last_group);
            last_medium = medium;
            last_group = group;
            if (!entry) {
                if (PyErr_Occurred())
                    goto fail;
                break; /* no table yet: the view creates it */
            }
            if (enter_table(a, entry, seq_obj, &t, &gpu_group0, &seq) < 0)
                goto fail;
        } else {
            Py_DECREF(medium);
            Py_DECREF(group);
        }
        PyObject *hashes = field(event, at->block_hashes, str_block_hashes);
        if (!hashes)
            goto fail;
        int failed;
        if (storing) {
            if (gpu_group0 && a->note != Py_None) {
                PyObject *r = PyObject_CallFunctionObjArgs(a->note, event, seq_obj, NULL);
                if (!r) {
                    Py_DECREF(hashes);
                    goto fail;
                }
                Py_DECREF(r);
            }
            PyObject *same_step = NULL;
            failed = table_store(t, hashes, seq, &same_step) < 0;
            if (!failed && same_step && gpu_group0) {
                Py_ssize_t m = PyList_GET_SIZE(same_step);
                for (Py_ssize_t j = 0; j < m && !failed; j++)
                    failed = PyDict_SetItem(a->same_step, PyList_GET_ITEM(same_step, j), seq_obj) < 0;
            }
            Py_XDECREF(same_step);
        } else {
            failed = table_remove(t, hashes, seq, ts) < 0;
            if (!failed && gpu_group0) {
                Py_ssize_t m = PyList_CheckExact(hashes) ? PyList_GET_SIZE(hashes) : PyObject_Length(hashes);
                if (m > 0)
                    a->gpu_removed += (unsigned long long)m;
                else
                    PyErr_Clear();
            }
        }
        Py_DECREF(hashes);
        if (failed)
            goto fail;
    }
    Py_XDECREF(last_medium);
    Py_XDECREF(last_group);
    Py_DECREF(fast);
    return PyLong_FromSsize_t(k);
fail:
    Py_XDECREF(last_medium);
    Py_XDECREF(last_group);
    Py_DECREF(fast);
    return NULL;
}

static PyMemberDef Applier_members[] = {
    {"gpu_removed", T_ULONGLONG, offsetof(Applier, gpu_removed), READONLY,
     "hashes removed from GPU group-0 tables so far: the evictions what-if sizing counts"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ApplierType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvmiss.enricher.core._blocktable.Applier",
    .tp_doc = PyDoc_STR("Applier(tables, same_step, stored_type, removed_type, note=None)(events, seq, ts, start=0) -> index\n\n"
                        "Apply events[start:] to the tables; returns the index of the first event left to the caller."),
    .tp_basicsize = sizeof(Applier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Applier_new,
    .tp_dealloc = (destructor)Applier_dealloc,
    .tp_call = (ternaryfunc)Applier_call,
    .tp_members = Applier_members,
};

/* --- the batch log's bisect -------------------------------------------------------------
 * bisect.bisect_left on an array.array boxes every probed item into a Python object (~1.5 us
 * on a 50k-entry log); these read the buffer directly. */

PyDoc_STRVAR(bisect_doc,
"bisect_left(log, x) -> int\n\n"
"bisect.bisect_left for an array.array('d') or array.array('q'), without boxing.");

static PyObject *log_bisect_left(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "bisect_left(log, x)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    Py_ssize_t lo = 0, hi = 0;
    int ok = 1;
    if (view.format && view.itemsize == 8 && !strcmp(view.format, "d")) {
        double x = PyFloat_AsDouble(args[1]);
        if (x == -1.0 && PyErr_Occurred())
            ok = 0;
        const double *v = view.buf;
        for (hi = view.len / 8; ok && lo < hi;) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (v[mid] < x)
                lo = mid + 1;
            else
                hi = mid;
        }
    } else if (view.format && view.itemsize == 8 && (!strcmp(view.format, "q") || !strcmp(view.format, "l"))) {
        long long x = PyLong_AsLongLong(args[1]);
        if (x == -1 && PyErr_Occurred())
            ok = 0;
        const int64_t *v = view.buf;
        for (hi = view.len / 8; ok && lo < hi;) {
            Py_ssize_t mid = lo + (hi - lo) / 2;
            if (v[mid] < x)
                lo = mid + 1;
            else
                hi = mid;
        }
    } else {
        PyErr_SetString(PyExc_TypeError, "bisect_left needs an array of 'd' or 'q'");
        ok = 0;
    }
    PyBuffer_Release(&view);
    return ok ? PyLong_FromSsize_t(lo) : NULL;
}

static PyMethodDef module_methods[] = {
    {"bisect_left", (PyCFunction)(void (*)(void))log_bisect_left, METH_FASTCALL, bisect_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvmiss.enricher.core._blocktable",
    .m_doc = "Compact residency table (see enricher/core/residency_table.py for the reference model).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__blocktable(void) {
    if (PyType_Ready(&BlockTableType) < 0 || PyType_Ready(&ApplierType) < 0)
        return NULL;
    str_block_hashes = PyUnicode_InternFromString("block_hashes");
    str_medium = PyUnicode_InternFromString("medium");
    str_group_idx = PyUnicode_InternFromString("group_idx");
    if (!str_block_hashes || !str_medium || !str_group_idx)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&BlockTableType);
    if (PyModule_AddObject(m, "BlockTable", (PyObject *)&BlockTableType) < 0) {
        Py_DECREF(&BlockTableType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ApplierType);
    if (PyModule_AddObject(m, "Applier", (PyObject *)&ApplierType) < 0) {
        Py_DECREF(&ApplierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
