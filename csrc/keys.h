/*
 * keys.h - hashing of cache keys and canonical hashing of _id values.
 *
 * A cache key is opaque bytes built by the caller (the binding): a kind byte,
 * the namespace index, the filter's BSON and the rest of the read's shape.
 * Two reads share an entry only when their keys are byte-equal.
 *
 * Identity generations are indexed by a hash of (namespace, _id). The hash
 * must be equal for every pair of _id values MongoDB considers equal, or a
 * write would miss the cell a cached read depends on. So values are hashed by
 * their canonical form: all numbers by numeric value (an integral double and
 * an int64 of the same value hash alike; every NaN hashes alike), strings and
 * symbols alike. Decimal128 is not canonicalized: a filter with one is not an
 * identity read, and a write to a document with one invalidates the whole
 * namespace. Types that a filter cannot use for an identity read are still
 * hashed (by type and bytes); no cached entry can depend on their cell.
 */
#ifndef CQC_KEYS_H
#define CQC_KEYS_H

#include <bson/bson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

uint64_t cqc_hash_bytes (const void *p, size_t len, uint64_t seed);

typedef enum {
   CQC_ID_CELL = 0,    /* hashed: use its identity cell */
   CQC_ID_NS_WIDE = 1, /* cannot be canonicalized: invalidate the namespace */
} cqc_id_kind_t;

/* Canonical hash of the _id value at `iter`. `identity_ok` is set when a
 * filter equal to this value may be cached as an identity read. */
cqc_id_kind_t cqc_id_hash (const bson_iter_t *iter, uint64_t *hash, bool *identity_ok);

/* The identity generation cell of (ns_idx, id hash) in a table of `count`
 * cells (a power of two). */
uint32_t cqc_id_cell (uint64_t id_hash, uint32_t ns_idx, uint32_t count);

/* If `filter` (BSON, len bytes) is exactly {"_id": <identity-cacheable
 * value>}, set *id_hash and return true. */
bool cqc_filter_identity (const uint8_t *filter, size_t len, uint64_t *id_hash);

/* ------------------------------------------------------------------------ */
/* Cache keys                                                               */
/* ------------------------------------------------------------------------ */

/* A cache key, byte for byte:
 *
 *   kind (1 byte) | ns_idx (4) | filter length (4) | filter BSON | rest
 *
 * `kind` says which read made it (find_one, find, count, ...), `rest` is the
 * remainder of the read's shape (projection, options), already canonical and
 * encoded by the caller. The identity fast path (read.c's core_try_hit, which
 * encodes {"_id": v} itself with cqc_id_filter_*) and the general path (the
 * filter encoded by PyMongo) build the same bytes for the same read.
 * cqc_key_write writes CQC_KEY_FIXED + flen + rlen bytes to out. */
#define CQC_KEY_FIXED 9u
#define CQC_KEY_MAX 0x7fffffffu
void cqc_key_write (uint8_t *out, uint8_t kind, uint32_t ns_idx, const uint8_t *filter,
                    uint32_t flen, const uint8_t *rest, uint32_t rlen);

/* A built key: on the stack up to CQC_KEY_STACK bytes, on the heap beyond. */
#define CQC_KEY_STACK 512u
typedef struct {
   uint8_t stack[CQC_KEY_STACK];
   uint8_t *buf;
   uint32_t len;
} cqc_key_t;

typedef enum {
   CQC_KEY_OK = 0,
   CQC_KEY_TOO_LARGE = 1, /* longer than CQC_KEY_MAX */
   CQC_KEY_NO_MEMORY = 2,
} cqc_key_status_t;

cqc_key_status_t cqc_key_build (cqc_key_t *k, uint8_t kind, uint32_t ns_idx,
                                const uint8_t *filter, uint32_t flen, const uint8_t *rest,
                                uint32_t rlen);

/* Free what cqc_key_build allocated; safe on a zeroed or freed key. */
void cqc_key_free (cqc_key_t *k);

/* ------------------------------------------------------------------------ */
/* Identity filters                                                         */
/* ------------------------------------------------------------------------ */

/* {"_id": v} encoded as PyMongo encodes it, for the values the fast path
 * takes: an integer (int32 when it fits, else int64), a string without NUL,
 * an ObjectId's 12 bytes. Each writes to `out` (`cap` bytes) and returns the
 * BSON length, or 0 when it does not fit. */
#define CQC_ID_FILTER_FIXED 32u /* bytes around a string's characters */
uint32_t cqc_id_filter_int (uint8_t *out, size_t cap, int64_t v);
uint32_t cqc_id_filter_str (uint8_t *out, size_t cap, const char *s, size_t n);
uint32_t cqc_id_filter_oid (uint8_t *out, size_t cap, const uint8_t oid[12]);

#endif
