/* EncodedEvents: one batch's KV events as collectors/_kvwire.c read them from the payload,
 * shared with the residency index's Applier (enricher/core/_blocktable.c), which applies them
 * without a Python object per event. Python sees a read-only sequence of the schemas' event
 * Structs, decoded on first use by the reference decoder (schemas/events.py decode_batch).
 *
 * Only _kvwire.c creates one; the Applier reads the fields below and nothing else. */

#ifndef KVMISS_KVWIRE_H
#define KVMISS_KVWIRE_H

#include <Python.h>
#include <stdint.h>

enum { KV_STORED = 1, KV_REMOVED = 2, KV_CLEARED = 3 };

typedef struct {
    uint8_t kind;       /* KV_STORED, KV_REMOVED, KV_CLEARED */
    uint8_t group_none; /* group_idx was absent or nil */
    uint16_t medium;    /* index into `media` */
    uint32_t n_hashes;
    int64_t group;      /* group_idx when not group_none */
    Py_ssize_t first;   /* index of the first hash in `hashes` */
    uint32_t block_size; /* a BlockStored's block_size when in [0, 2^32), else 0 */
    uint8_t root;       /* a BlockStored with no parent_block_hash (absent or nil) */
} KvPackedEvent;

typedef struct {
    PyObject_HEAD
    PyObject *payload;      /* bytes: the batch as received */
    PyObject *media;        /* tuple of str | None: the distinct media of the batch */
    PyObject *decoded;      /* list of event Structs, NULL until first asked for */
    Py_ssize_t n_events;
    int has_clear;
    KvPackedEvent *events;
    uint64_t *hashes;       /* every event's block hashes, canonical uint64, in order */
    Py_ssize_t n_hashes;
} KvEncodedEvents;

#endif
