/*
 * keys.h - hashing of cache keys and canonical hashing of _id values.
 *
 * A cache key is opaque bytes built by the caller (module.c): a kind byte,
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

/* Cache key layout (see module.c): kind | ns_idx | filter length | filter |
 * rest. Writes key_len(flen, rlen) bytes to out. */
#define CQC_KEY_FIXED 9u
void cqc_key_write (uint8_t *out, uint8_t kind, uint32_t ns_idx, const uint8_t *filter,
                    uint32_t flen, const uint8_t *rest, uint32_t rlen);

#endif
