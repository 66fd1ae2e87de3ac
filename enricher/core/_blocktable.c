/* BlockTable: the residency records of one medium (and KV-cache group) of one worker epoch.
 *
 * The C twin of enricher/core/residency_table.py (PyBlockTable, the reference model: read that
 * first, it states the rules in a dozen lines; tests/enricher/core/test_residency_table.py checks
 * the two agree on random event streams). This file exists for the numbers of issues #4 and
 * #18: >= 1 M block events/s through the index and <= 32 bytes per resident block. A Python
 * dict pays a slot plus a 36-byte int object per key; here a block costs one 16-byte slot at
 * a load factor between 0.53 and 0.8 (20-30 bytes), and no Python object at all.
 *
 * Layout: open addressing with linear probing over 16-byte slots (four to a cache line, none
 * straddling two), backward-shift deletion (no tombstones), home slot chosen by a 128-bit
 * multiply of the mixed key (any capacity), grown by 1.5x at a load of 0.8.
 *
 * A slot is (key, word). The word holds the block's latest interval when that is all the
 * block has -- resident, or closed and waiting for retention: the two common cases, so an
 * eviction record costs no more than its retention-queue entry -- and otherwise links to the
 * block's records in the arena. Sequence numbers are stored relative to the epoch's first
 * applied batch (`base`), plus one so that 0 can mean "none", in 31 bits: a table spans
 * SEQ_SPAN = 2^31 - 1 batches (residency_table.SEQ_SPAN; ~250 days at 100 batches/s; past it
 * the index starts a fresh view, as it did past 2^40 with the 28-byte slots before).
 *   bits  0-30  S: stored seq + 1 (0: the store predates our history)
 *   bits 31-61  R: resident: live copies (refcount; tiers and recomputes store twice), >= 1
 *                  closed:   removed seq + 1, >= 1
 *   bit  62     closed
 *   bit  63     closed by a clear
 * A word with R = 0 (no interval has one) is a link instead: S is the arena index + 1 of the
 * block's head entry, which holds its latest interval in the same form and chains the older
 * ones behind it, newest first (an entry is that word plus a 4-byte link: 12 bytes). A block
 * gets a link when it is stored (or removed) again while its closed interval is retained --
 * 24 bytes then, 12 for each further interval -- and its slot takes the interval back when
 * retention has dropped every older one. A slot is free when its word is 0.
 *
 * Why these numbers (benchmarks/bench_index_memory.py and bench_table_ops.py, RESULTS.md):
 * the 16-byte slot alone brings the 28-byte one's 35-53 bytes per block to 20-30 at the same
 * load factors, and its probes touch fewer cache lines (store, `in` and as_of measured as fast
 * or faster). A denser table (0.875 maximum load, grown by 1.33x: 18-24 bytes) stored and
 * removed 5-60% slower over three alternating runs, for bytes the target does not need.
 *
 * `ring` is the retention queue: the key of every interval that closed, in apply order, with
 * the engine ts of each run of consecutive closes at one ts in `runs` (a batch's evictions,
 * a clear): 8 bytes a record plus 12 a run. `prune` drops closed intervals older than a
 * horizon and returns their keys so that the caller can remember them in its
 * no-false-negative filter.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "../../collectors/_kvwire.h" /* EncodedEvents: a batch read in C, applied without Structs */

#define SEQ_BITS 31
#define SEQ_MASK ((UINT64_C(1) << SEQ_BITS) - 1) /* the largest S or R; a rel seq < SEQ_MASK fits */
#define CLOSED_BIT (UINT64_C(1) << 62)
#define CLEAR_BIT (UINT64_C(1) << 63)
#define ONE_REF (UINT64_C(1) << SEQ_BITS)
/* Copies of one resident block saturate here: past it stores are not counted, removals still
 * are (so the interval closes early, after REFS_MAX removals). Overridable for the test that
 * builds a variant to reach it. */
#ifndef REFS_MAX
#define REFS_MAX SEQ_MASK
#endif
#define MIN_CAPACITY 16
/* Grow by 1/GROW_DIV of the capacity when the load would pass LOAD_NUM/LOAD_DEN (overridable
 * to measure other choices: see the header). */
#ifndef LOAD_NUM
#define LOAD_NUM 4
#define LOAD_DEN 5
#endif
#ifndef GROW_DIV
#define GROW_DIV 2
#endif

/* One block's slot. */
typedef struct {
    uint64_t key;
    uint64_t word;
} Slot;

/* The engine ts of `n` consecutive entries of the retention queue. */
typedef struct __attribute__((packed)) {
    double ts;
    uint32_t n;
} Run;

typedef struct {
    PyObject_HEAD
    int64_t base;
    Slot *slots;
    size_t cap, len;
    /* arena entry k: an interval (the slot word's form, never a link) and the arena index + 1
     * of the next older one (0: none; for a free entry, the next free one) */
    uint64_t *arena_iv;
    uint32_t *arena_prev;
    uint32_t arena_len, arena_cap, arena_free; /* free: index + 1 of the first free entry */
    size_t arena_live, linked;                 /* linked: slots whose word is a link */
    uint64_t *ring;                            /* keys of closed intervals, oldest first */
    size_t ring_head, ring_len, ring_cap;
    Run *runs;                                 /* their engine ts, run-length encoded */
    size_t run_head, run_len, run_cap;
    unsigned int block_size;                   /* the KV-cache group's block size (0: not known) */
} BlockTable;

/* --- interval words ----------------------------------------------------------------------- */

static inline uint64_t iv_stored(uint64_t w) {
    return w & SEQ_MASK;
}

static inline uint64_t iv_r(uint64_t w) {
    return (w >> SEQ_BITS) & SEQ_MASK;
}

static inline int iv_closed(uint64_t w) {
    return (w & CLOSED_BIT) != 0;
}

static inline uint64_t resident_iv(uint64_t stored) {
    return stored | ONE_REF;
}

static inline uint64_t closed_iv(uint64_t stored, uint64_t removed) {
    return stored | removed << SEQ_BITS | CLOSED_BIT;
}

static inline int is_link(uint64_t w) {
    return iv_r(w) == 0;
}

/* --- slots ---------------------------------------------------------------------------------- */

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

/* Slot of `key`, or the empty slot where it would go (*found tells which). */
static inline size_t probe(const BlockTable *t, uint64_t key, int *found) {
    size_t i = home_of(key, t->cap);
    for (;;) {
        const Slot *s = &t->slots[i];
        if (!s->word) {
            *found = 0;
            return i;
        }
        if (s->key == key) {
            *found = 1;
            return i;
        }
        if (++i == t->cap)
            i = 0;
    }
}

/* The block's latest interval: its slot word, or its head entry when that is a link. The
 * pointer lasts until the next arena_push. */
static inline uint64_t *current(BlockTable *t, size_t i) {
    uint64_t *w = &t->slots[i].word;
    return is_link(*w) ? &t->arena_iv[iv_stored(*w) - 1] : w;
}

static int resize(BlockTable *t, size_t cap) {
    Slot *slots = PyMem_Calloc(cap, sizeof(Slot));
    if (!slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < t->cap; i++) {
        if (!t->slots[i].word)
            continue;
        size_t j = home_of(t->slots[i].key, cap);
        while (slots[j].word) {
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

/* Room for one more key at a load factor <= LOAD_NUM/LOAD_DEN. */
static inline int reserve_one(BlockTable *t) {
    if ((t->len + 1) * LOAD_DEN <= t->cap * LOAD_NUM)
        return 0;
    return resize(t, t->cap + t->cap / GROW_DIV);
}

/* Backward-shift deletion: close the gap so every probe sequence stays unbroken. */
static void delete_slot(BlockTable *t, size_t i) {
    size_t j = i;
    for (;;) {
        if (++j == t->cap)
            j = 0;
        if (!t->slots[j].word)
            break;
        size_t h = home_of(t->slots[j].key, t->cap);
        /* move j back to i unless its home lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (stays)
            continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].key = 0;
    t->slots[i].word = 0;
    t->len--;
}

/* --- the arena of linked records -------------------------------------------------------- */

static uint32_t arena_push(BlockTable *t, uint64_t iv, uint32_t prev) {
    uint32_t at;
    if (t->arena_free) {
        at = t->arena_free - 1;
        t->arena_free = t->arena_prev[at];
    } else {
        if (t->arena_len == t->arena_cap) {
            /* a link keeps the index in S: at most SEQ_MASK entries */
            size_t cap = t->arena_cap ? (size_t)t->arena_cap + t->arena_cap / 2 : 64;
            if (cap > SEQ_MASK)
                cap = SEQ_MASK;
            if (cap <= t->arena_cap) {
                PyErr_SetString(PyExc_MemoryError, "residency history arena full");
                return 0;
            }
            uint64_t *ivs = PyMem_Realloc(t->arena_iv, cap * sizeof(uint64_t));
            if (ivs)
                t->arena_iv = ivs;
            uint32_t *prevs = ivs ? PyMem_Realloc(t->arena_prev, cap * sizeof(uint32_t)) : NULL;
            if (!prevs) {
                PyErr_NoMemory();
                return 0;
            }
            t->arena_prev = prevs;
            t->arena_cap = (uint32_t)cap;
        }
        at = t->arena_len++;
    }
    t->arena_iv[at] = iv;
    t->arena_prev[at] = prev;
    t->arena_live++;
    return at + 1;
}

static void arena_free_chain(BlockTable *t, uint32_t link) {
    while (link) {
        uint32_t at = link - 1;
        link = t->arena_prev[at];
        t->arena_prev[at] = t->arena_free;
        t->arena_free = at + 1;
        t->arena_live--;
    }
}

/* The slot's latest (closed) interval moves behind a new one, `iv`. */
static int push_behind(BlockTable *t, size_t i, uint64_t iv) {
    uint64_t w = t->slots[i].word;
    if (is_link(w)) {
        uint32_t head = (uint32_t)iv_stored(w) - 1;
        uint32_t older = arena_push(t, t->arena_iv[head], t->arena_prev[head]);
        if (!older)
            return -1;
        t->arena_iv[head] = iv; /* (indexed anew: the push may have moved the arena) */
        t->arena_prev[head] = older;
        return 0;
    }
    uint32_t older = arena_push(t, w, 0);
    if (!older)
        return -1;
    uint32_t head = arena_push(t, iv, older);
    if (!head) {
        arena_free_chain(t, older);
        return -1;
    }
    t->slots[i].word = head;
    t->linked++;
    return 0;
}

/* --- retention queue -------------------------------------------------------------------- */

/* A full circular buffer of `*cap` items of `size` bytes from `*head`, copied in order into
 * one 1.5x larger (`first` items when empty); NULL with an exception set. */
static void *ring_grow(void *buf, size_t *head, size_t *cap, size_t size, size_t first) {
    size_t grown_cap = *cap ? *cap + *cap / 2 : first;
    char *grown = PyMem_Malloc(grown_cap * size);
    if (!grown) {
        PyErr_NoMemory();
        return NULL;
    }
    if (*cap) {
        memcpy(grown, (char *)buf + *head * size, (*cap - *head) * size);
        memcpy(grown + (*cap - *head) * size, buf, *head * size);
    }
    PyMem_Free(buf);
    *head = 0;
    *cap = grown_cap;
    return grown;
}

static inline size_t ring_at(size_t head, size_t k, size_t cap) {
    size_t at = head + k;
    return at >= cap ? at - cap : at;
}

static int ring_push(BlockTable *t, double ts, uint64_t key) {
    size_t last = t->run_len ? ring_at(t->run_head, t->run_len - 1, t->run_cap) : 0;
    int same_run = t->run_len && t->runs[last].ts == ts && t->runs[last].n < UINT32_MAX;
    if (t->ring_len == t->ring_cap) {
        uint64_t *grown = ring_grow(t->ring, &t->ring_head, &t->ring_cap, sizeof(uint64_t), 256);
        if (!grown)
            return -1;
        t->ring = grown;
    }
    if (!same_run && t->run_len == t->run_cap) {
        Run *grown = ring_grow(t->runs, &t->run_head, &t->run_cap, sizeof(Run), 16);
        if (!grown)
            return -1;
        t->runs = grown;
    }
    t->ring[ring_at(t->ring_head, t->ring_len++, t->ring_cap)] = key;
    if (same_run)
        t->runs[last].n++;
    else
        t->runs[ring_at(t->run_head, t->run_len++, t->run_cap)] = (Run){ts, 1};
    return 0;
}

/* The oldest key of the queue, dropped from it. */
static uint64_t ring_pop(BlockTable *t) {
    uint64_t key = t->ring[t->ring_head];
    t->ring_head = ring_at(t->ring_head, 1, t->ring_cap);
    t->ring_len--;
    if (--t->runs[t->run_head].n == 0) {
        t->run_head = ring_at(t->run_head, 1, t->run_cap);
        t->run_len--;
    }
    return key;
}

/* --- argument helpers ------------------------------------------------------------------- */

static int rel_seq(BlockTable *t, PyObject *obj, uint64_t *out) {
    long long seq = PyLong_AsLongLong(obj);
    if (seq == -1 && PyErr_Occurred())
        return -1;
    /* (unsigned difference: no signed overflow whatever the two are) */
    uint64_t rel = (uint64_t)seq - (uint64_t)t->base;
    if (seq < t->base || rel >= SEQ_MASK) {
        PyErr_Format(PyExc_OverflowError,
                     "batch seq %lld outside this epoch's range (first applied seq %lld)", seq,
                     (long long)t->base);
        return -1;
    }
    *out = rel + 1;
    return 0;
}

/* A bound in S/R form: every field < it is a seq before batch `seq` (and 0 always is). */
static inline uint64_t limit_of(BlockTable *t, long long seq) {
    if (seq < t->base)
        return 1;
    uint64_t rel = (uint64_t)seq - (uint64_t)t->base;
    return (rel < SEQ_MASK ? rel : SEQ_MASK) + 1;
}

/* A batch's (seq, engine ts) arguments, the seq relative to the table as stored. */
static int seq_and_ts(BlockTable *t, PyObject *seq_obj, PyObject *ts_obj, uint64_t *seq, double *ts) {
    if (rel_seq(t, seq_obj, seq) < 0)
        return -1;
    *ts = PyFloat_AsDouble(ts_obj);
    return (*ts == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *abs_seq(BlockTable *t, uint64_t field) {
    if (!field)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(t->base + (long long)(field - 1));
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
        t->slots[i].word = resident_iv(seq);
        t->len++;
        return 0;
    }
    uint64_t *cur = current(t, i);
    if (!iv_closed(*cur)) { /* another live copy */
        if (iv_r(*cur) < REFS_MAX)
            *cur += ONE_REF;
        return iv_stored(*cur) == seq;
    }
    /* stored again after its removal */
    return push_behind(t, i, resident_iv(seq)) < 0 ? -1 : 0;
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
        t->slots[i].word = closed_iv(0, seq);
        t->len++;
    } else {
        uint64_t *cur = current(t, i);
        if (iv_closed(*cur)) { /* removed again: its store predates our history */
            if (push_behind(t, i, closed_iv(0, seq)) < 0)
                return -1;
        } else if (iv_r(*cur) > 1) {
            *cur -= ONE_REF;
            return 0;
        } else {
            *cur = closed_iv(iv_stored(*cur), seq);
        }
    }
    return ring_push(t, ts, key) < 0 ? -1 : 1;
}

/* Whether `key` has a live copy in `t`. */
static inline int resident_key(const BlockTable *t, uint64_t key) {
    int found;
    size_t i = probe(t, key, &found);
    if (!found)
        return 0;
    uint64_t w = t->slots[i].word;
    if (is_link(w))
        w = t->arena_iv[iv_stored(w) - 1];
    return !iv_closed(w);
}

/* A BlockStored the Applier leaves to Python (EpochView._apply_event): one with no parent
 * whose last block is already resident -- vLLM's `kv_cache_report_mode: "full"` re-announces
 * a reused chain that way, and on the wire it is a recomputed duplicate too -- and a store of
 * fewer tokens than its group's blocks (a partial-block store). A store with no hash at all
 * (vLLM's range of null blocks in a window or Mamba group) is left to Python, which counts it. */
static inline int leave_store(const BlockTable *t, int root, unsigned long block_size, uint64_t last, int any) {
    if (block_size && t->block_size && block_size < t->block_size)
        return 1;
    return root && any && resident_key(t, last);
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
        if (!t->slots[i].word)
            continue;
        uint64_t *cur = current(t, i);
        if (iv_closed(*cur))
            continue;
        *cur = closed_iv(iv_stored(*cur), seq) | CLEAR_BIT;
        if (ring_push(t, ts, t->slots[i].key) < 0)
            return NULL;
        closed++;
    }
    return PyLong_FromSsize_t(closed);
}

PyDoc_STRVAR(prune_doc,
"prune(before_ts, horizon_seq, limit=None) -> list\n\n"
"Drop intervals that closed before engine time ``before_ts`` (and before batch\n"
"``horizon_seq``, None for no such batch), with everything older of the same block.\n"
"Resident intervals are never dropped. Returns the hashes that lost records. ``limit``:\n"
"take at most that many entries of the retention queue (the rest wait for the next call).");

static PyObject *BlockTable_prune(BlockTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "prune(before_ts, horizon_seq, limit=None)");
        return NULL;
    }
    Py_ssize_t limit = PY_SSIZE_T_MAX;
    if (nargs == 3 && args[2] != Py_None) {
        limit = PyLong_AsSsize_t(args[2]);
        if (limit == -1 && PyErr_Occurred())
            return NULL;
        if (limit < 0) {
            PyErr_SetString(PyExc_ValueError, "limit must be >= 0 or None");
            return NULL;
        }
    }
    double before = PyFloat_AsDouble(args[0]);
    if (before == -1.0 && PyErr_Occurred())
        return NULL;
    uint64_t horizon = 0; /* 0: no batch at or after the horizon yet: every removal is older */
    if (args[1] != Py_None) {
        long long h = PyLong_AsLongLong(args[1]);
        if (h == -1 && PyErr_Occurred())
            return NULL;
        horizon = limit_of(t, h);
    }
    PyObject *dropped = PyList_New(0);
    if (!dropped)
        return NULL;
    for (Py_ssize_t taken = 0; taken < limit && t->ring_len && t->runs[t->run_head].ts < before; taken++) {
        uint64_t key = ring_pop(t);
        int found;
        size_t i = probe(t, key, &found);
        if (!found)
            continue;
#define OLD_ENOUGH(iv) (iv_closed(iv) && (horizon == 0 || iv_r(iv) < horizon))
        int drop = 0;
        uint64_t w = t->slots[i].word;
        if (OLD_ENOUGH(*current(t, i))) {
            if (is_link(w)) {
                arena_free_chain(t, (uint32_t)iv_stored(w));
                t->linked--;
            }
            delete_slot(t, i);
            drop = 1;
        } else if (is_link(w)) {
            /* walk the older intervals; `holder` is the entry whose prev is `link` */
            uint32_t head = (uint32_t)iv_stored(w) - 1, holder = head;
            uint32_t link = t->arena_prev[head];
            while (link) {
                if (OLD_ENOUGH(t->arena_iv[link - 1])) {
                    arena_free_chain(t, link);
                    t->arena_prev[holder] = 0;
                    drop = 1;
                    break;
                }
                holder = link - 1;
                link = t->arena_prev[holder];
            }
            if (!t->arena_prev[head]) { /* nothing older left: the interval goes back into its slot */
                t->slots[i].word = t->arena_iv[head];
                arena_free_chain(t, head + 1);
                t->linked--;
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
        PyMem_Free(t->arena_iv);
        PyMem_Free(t->arena_prev);
        t->arena_iv = NULL;
        t->arena_prev = NULL;
        t->arena_len = t->arena_cap = t->arena_free = 0;
    }
    if (t->ring_len == 0 && t->ring_cap) {
        PyMem_Free(t->ring);
        PyMem_Free(t->runs);
        t->ring = NULL;
        t->runs = NULL;
        t->ring_head = t->ring_cap = t->run_head = t->run_len = t->run_cap = 0;
    }
    return dropped;
}

static PyObject *interval_tuple(BlockTable *t, uint64_t iv) {
    int closed = iv_closed(iv);
    PyObject *s = abs_seq(t, iv_stored(iv)), *r = abs_seq(t, closed ? iv_r(iv) : 0);
    if (!s || !r) {
        Py_XDECREF(s);
        Py_XDECREF(r);
        return NULL;
    }
    PyObject *by_clear = (iv & CLEAR_BIT) ? Py_True : Py_False;
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
    /* stored field < limit <=> stored before the step (an unknown store, 0, always is) */
    uint64_t limit = limit_of(t, step);
    int found;
    size_t i = probe(t, key, &found);
    if (!found)
        Py_RETURN_NONE;
    uint64_t w = t->slots[i].word;
    if (!is_link(w)) {
        if (iv_stored(w) < limit)
            return interval_tuple(t, w);
        Py_RETURN_NONE;
    }
    for (uint32_t link = (uint32_t)iv_stored(w); link; link = t->arena_prev[link - 1]) {
        if (iv_stored(t->arena_iv[link - 1]) < limit)
            return interval_tuple(t, t->arena_iv[link - 1]);
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
    uint64_t w = t->slots[i].word;
    uint32_t link = 0;
    if (is_link(w)) {
        link = (uint32_t)iv_stored(w);
        w = t->arena_iv[link - 1];
        link = t->arena_prev[link - 1];
    }
    for (;;) {
        PyObject *tup = interval_tuple(t, w);
        if (!tup || PyList_Append(out, tup) < 0) {
            Py_XDECREF(tup);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(tup);
        if (!link)
            break;
        w = t->arena_iv[link - 1];
        link = t->arena_prev[link - 1];
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
    if (!found || iv_closed(*current(t, i)))
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(iv_r(*current(t, i)));
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
    size_t bytes = t->cap * sizeof(Slot) + (size_t)t->arena_cap * (sizeof(uint64_t) + sizeof(uint32_t))
                   + t->ring_cap * sizeof(uint64_t) + t->run_cap * sizeof(Run) + sizeof(BlockTable);
    return PyLong_FromSize_t(bytes);
}

static PyObject *BlockTable_older(BlockTable *t, void *closure) {
    return PyLong_FromSize_t(t->arena_live - t->linked); /* every entry but the heads */
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
    PyMem_Free(t->arena_iv);
    PyMem_Free(t->arena_prev);
    PyMem_Free(t->ring);
    PyMem_Free(t->runs);
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

static PyMemberDef BlockTable_members[] = {
    {"block_size", T_UINT, offsetof(BlockTable, block_size), 0,
     "the KV-cache group's block size, set by the index when it learns it (0: not known): the Applier\n"
     "leaves a store of fewer tokens (a partial-block store) to Python"},
    {NULL, 0, 0, 0, NULL},
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
    .tp_members = BlockTable_members,
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
    Py_ssize_t block_hashes, medium, group_idx, parent, block_size;
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
    unsigned long long same_step_stores; /* same-step copies recorded in `same_step` so far */
    int orphans; /* set by the view while it holds uncounted stores: leave it a removal of a block
                  * with no live copy (the uncounted copy's own removal, EpochView._apply_event) */
} Applier;

static PyObject *str_block_hashes, *str_medium, *str_group_idx, *str_parent, *str_block_size;

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
    at->parent = slot_offset(type, str_parent);
    at->block_size = slot_offset(type, str_block_size);
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
        if (ev->kind == KV_STORED
            && (ev->n_hashes == 0
                || leave_store(t, ev->root, ev->block_size, keys[ev->n_hashes - 1], 1)))
            break;
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
                    a->same_step_stores++;
                }
            }
        } else {
            if (a->orphans && ev->n_hashes && !resident_key(t, keys[0]))
                break;
            for (uint32_t j = 0; j < ev->n_hashes; j++)
                if (remove_key(t, keys[j], seq, ts) < 0)
                    return NULL;
            if (gpu_group0)
                a->gpu_removed += ev->n_hashes;
        }
    }
    return PyLong_FromSsize_t(k);
}

/* `leave_store` for an event Struct: 1 leave it, 0 apply it, -1 with an exception set. */
static int stored_left_to_python(Applier *a, PyObject *event, const BlockTable *t, PyObject *hashes) {
    if (PyList_CheckExact(hashes) && PyList_GET_SIZE(hashes) == 0)
        return 1; /* no hash: counted in Python */
    PyObject *parent = field(event, a->stored_at.parent, str_parent);
    PyObject *size = parent ? field(event, a->stored_at.block_size, str_block_size) : NULL;
    if (!size) {
        Py_XDECREF(parent);
        return -1;
    }
    int root = parent == Py_None;
    Py_DECREF(parent);
    unsigned long block_size = 0;
    if (PyLong_CheckExact(size)) {
        block_size = PyLong_AsUnsignedLong(size);
        if (block_size == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or too large: not a size to compare */
            block_size = 0;
        }
        if (block_size > UINT32_MAX)
            block_size = 0;
    }
    Py_DECREF(size);
    uint64_t last = 0;
    int any = 0;
    if (root && PyList_CheckExact(hashes) && PyList_GET_SIZE(hashes) > 0) {
        if (key_of(PyList_GET_ITEM(hashes, PyList_GET_SIZE(hashes) - 1), &last) < 0) {
            PyErr_Clear(); /* reported when the block is applied */
            return 0;
        }
        any = 1;
    }
    return leave_store(t, root, block_size, last, any);
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
        if (!storing && a->orphans && PyList_CheckExact(hashes) && PyList_GET_SIZE(hashes) > 0) {
            uint64_t first;
            if (key_of(PyList_GET_ITEM(hashes, 0), &first) < 0)
                PyErr_Clear(); /* reported when the block is applied */
            else if (!resident_key(t, first)) {
                Py_DECREF(hashes);
                break;
            }
        }
        if (storing) {
            int leave = stored_left_to_python(a, event, t, hashes);
            if (leave < 0) {
                Py_DECREF(hashes);
                goto fail;
            }
            if (leave) {
                Py_DECREF(hashes);
                break;
            }
        }
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
                a->same_step_stores += (unsigned long long)m;
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
    {"orphans", T_INT, offsetof(Applier, orphans), 0,
     "nonzero: stop at a BlockRemoved whose first block has no live copy (left to Python)"},
    {"gpu_removed", T_ULONGLONG, offsetof(Applier, gpu_removed), READONLY,
     "hashes removed from GPU group-0 tables so far: the evictions what-if sizing counts"},
    {"same_step_stores", T_ULONGLONG, offsetof(Applier, same_step_stores), READONLY,
     "same-step copies put in `same_step` so far (a batch whose count moved is kept in order)"},
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

/* --- the pruned-records filter's insert ---------------------------------------------------
 * enricher/core/index.py `_BloomStage.add` (the rule: positions h1 + i*h2 over the hash's two
 * halves) for every hash retention dropped: at a million events a second, pruning is millions
 * of inserts, seconds of the event loop in Python. */

PyDoc_STRVAR(bloom_add_doc,
"bloom_add(bits, mask, hashes, positions) -> None\n\n"
"_BloomStage.add for each hash of ``hashes`` (ints): set bit (h1 + i*h2) & mask of the\n"
"bytearray ``bits`` for i < positions, h1 the low 32 bits, h2 the high 32 bits | 1.");

static PyObject *bloom_add(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "bloom_add(bits, mask, hashes, positions)");
        return NULL;
    }
    if (!PyByteArray_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "bits must be a bytearray");
        return NULL;
    }
    uint64_t mask = PyLong_AsUnsignedLongLong(args[1]);
    long k = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    uint8_t *bits = (uint8_t *)PyByteArray_AS_STRING(args[0]);
    if (((mask >> 3) + 1) > (uint64_t)PyByteArray_GET_SIZE(args[0]) || k < 0) {
        PyErr_SetString(PyExc_ValueError, "mask must address bits inside the bytearray");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(args[2], "hashes must be a sequence");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t j = 0; j < n; j++) {
        uint64_t h;
        if (key_of(items[j], &h) < 0) {
            Py_DECREF(fast);
            return NULL;
        }
        uint64_t h1 = h & 0xFFFFFFFFu, h2 = (h >> 32) | 1;
        for (long i = 0; i < k; i++) {
            uint64_t p = (h1 + (uint64_t)i * h2) & mask;
            bits[p >> 3] |= (uint8_t)(1u << (p & 7));
        }
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
}

/* --- the fleet view's sweep ----------------------------------------------------------------- */

PyDoc_STRVAR(holding_doc,
"holding(hash, tables) -> list of int\n\n"
"The positions in ``tables`` (a tuple of BlockTable) of the tables with a record of ``hash``\n"
"(``hash in table``). A hash that is not an int in [0, 2**64) is in none.");

/* One call for every other worker of the fleet (enricher/core/evidence.py `FleetRound`): the
 * tables are large and cold, so each probe is a cache miss. The home slots of a chunk are
 * prefetched first and probed after, so the misses overlap instead of queueing. */
#define HOLDING_CHUNK 32

static PyObject *holding(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "holding(hash, tables)");
        return NULL;
    }
    if (!PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "tables must be a tuple of BlockTable");
        return NULL;
    }
    PyObject *tables = args[1];
    Py_ssize_t n = PyTuple_GET_SIZE(tables);
    for (Py_ssize_t j = 0; j < n; j++) {
        if (Py_TYPE(PyTuple_GET_ITEM(tables, j)) != &BlockTableType) {
            PyErr_SetString(PyExc_TypeError, "tables must be a tuple of BlockTable");
            return NULL;
        }
    }
    PyObject *out = PyList_New(0);
    uint64_t key;
    if (!out)
        return NULL;
    if (key_of(args[0], &key) < 0) {
        PyErr_Clear();
        return out;
    }
    uint64_t mixed = mix(key);
    for (Py_ssize_t lo = 0; lo < n; lo += HOLDING_CHUNK) {
        Py_ssize_t hi = lo + HOLDING_CHUNK < n ? lo + HOLDING_CHUNK : n;
        for (Py_ssize_t j = lo; j < hi; j++) {
            const BlockTable *t = (const BlockTable *)PyTuple_GET_ITEM(tables, j);
            __builtin_prefetch(&t->slots[(size_t)(((__uint128_t)mixed * t->cap) >> 64)]); /* home_of */
        }
        for (Py_ssize_t j = lo; j < hi; j++) {
            int found;
            probe((const BlockTable *)PyTuple_GET_ITEM(tables, j), key, &found);
            if (!found)
                continue;
            PyObject *pos = PyLong_FromSsize_t(j);
            if (!pos || PyList_Append(out, pos) < 0) {
                Py_XDECREF(pos);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(pos);
        }
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"bisect_left", (PyCFunction)(void (*)(void))log_bisect_left, METH_FASTCALL, bisect_doc},
    {"bloom_add", (PyCFunction)(void (*)(void))bloom_add, METH_FASTCALL, bloom_add_doc},
    {"holding", (PyCFunction)(void (*)(void))holding, METH_FASTCALL, holding_doc},
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
    str_parent = PyUnicode_InternFromString("parent_block_hash");
    str_block_size = PyUnicode_InternFromString("block_size");
    if (!str_block_hashes || !str_medium || !str_group_idx || !str_parent || !str_block_size)
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
