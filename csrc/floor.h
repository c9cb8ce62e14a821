/*
 * floor.h - the causal floor: what a process may be served, given what it
 * has already read and written (DESIGN.md, rule 7).
 *
 * Kept per process and per database, in two parts (cqc_floor_observe): the
 * highest cluster time the process has observed from the database, and, on
 * a deployment of one member, the CLOCK_MONOTONIC time it observed it at (0
 * elsewhere). An entry found by a lookup is served only once the database's
 * applied time (cqc_db_t.applied_ts) has reached the first, or a stream
 * round that began after the second came back empty (cqc_db_t.quiet_ns); so
 * a process never reads a version older than one it has already been
 * given. Floors are raised, never lowered.
 *
 * Two refinements keep the floor from refusing what it need not:
 *  - Own misses (the memo). On a deployment of one member, a miss whose own
 *    read is the newest thing the process observed from its database
 *    reflects everything the process has seen there: its entry may be
 *    served before the stream catches up. MEMO_WAYS entries per bucket,
 *    matched by the key's 64-bit hash, and only for the very result the
 *    miss admitted (a hash of its bytes; in a shared cache the entry under
 *    the key may be another worker's admission of an older read, admitted
 *    while this one waited in its ring). An entry stands while its
 *    database's floor and memo epoch are the ones its miss ended with. The caller
 *    moves the epoch on when it observes something of an operation that
 *    overlapped another: that operation may have returned something newer
 *    than a miss that ended meanwhile (its reply may even be what raised
 *    the floor the miss ended with).
 *  - One-document writes (pending). A write through a view to one document
 *    ({"_id": v}) tells the process nothing about other documents: instead
 *    of the database's floor it holds back only the entries that may depend
 *    on that document (its identity cell's, and every entry of its
 *    namespace that is not an identity entry) until the stream has applied
 *    it. Up to CQC_PENDING_MAX at once; beyond, the caller raises the floor.
 *  - Transactions (held). A write through a view inside a transaction has
 *    no cluster time of its own: it becomes visible at the commit, which the
 *    views do not see. Until the caller finds the transaction ended, every
 *    entry of the database is refused (cqc_floor_hold); then it raises the
 *    database's floor past the commit.
 *
 * Process-private memory, changed and read by one thread at a time (the
 * binding holds the GIL). The arena is read through cqc_arena_r_* only.
 */
#ifndef CQC_FLOOR_H
#define CQC_FLOOR_H

#include "arena.h"

#include <stdbool.h>
#include <stdint.h>

#define CQC_MEMO_BUCKETS 1024u
#define CQC_MEMO_WAYS 8u
#define CQC_PENDING_MAX 64u

typedef struct {
   uint64_t hash;
   uint64_t floor_ts;
   uint64_t epoch; /* the memo epoch its miss ended with */
   uint64_t value; /* cqc_floor_value_hash of the result it admitted */
   uint32_t db_idx;
   uint32_t used;
} cqc_memo_t;

typedef struct {
   uint64_t ts;    /* the write's cluster time (the client's, after it) */
   uint64_t quiet; /* CLOCK_MONOTONIC after it, one-member proof (0: none) */
   uint32_t db_idx;
   uint32_t ns_idx;
   uint32_t cell; /* the document's identity cell */
   uint32_t used;
} cqc_pending_t;

typedef struct {
   uint32_t db_count;
   uint64_t *ts; /* by db_idx */
   uint64_t *ns; /* by db_idx */
   uint64_t *epoch; /* by db_idx: the highest memo epoch told */
   uint8_t *held;   /* by db_idx: a transaction wrote there (cqc_floor_hold) */
   cqc_memo_t *memo; /* CQC_MEMO_BUCKETS * CQC_MEMO_WAYS */
   uint32_t memo_next; /* the way replaced when a bucket has none free */
   uint32_t pending_used;
   cqc_pending_t pending[CQC_PENDING_MAX];
} cqc_floor_t;

/* Allocate the floors of db_count databases, all zero. */
bool cqc_floor_init (cqc_floor_t *f, uint32_t db_count);
void cqc_floor_free (cqc_floor_t *f);

/* Raise the database's floor to cluster time `ts` ((seconds << 32) |
 * increment) observed at `ns` (0: no one-member proof), and its memo epoch
 * to `epoch` (the caller's count; see the memo above). */
void cqc_floor_observe (cqc_floor_t *f, uint32_t db_idx, uint64_t ts, uint64_t ns,
                        uint64_t epoch);

/* Refuse every entry of the database (held) or stop refusing them: a
 * transaction of this process wrote there and has not ended. */
void cqc_floor_hold (cqc_floor_t *f, uint32_t db_idx, bool held);

/* Record a write of this process to the one document {"_id": v} of ns_idx
 * (`filter`). False when the filter is not an identity filter or no slot
 * is free: the caller then raises the database's floor instead. */
bool cqc_floor_observe_id (cqc_floor_t *f, const cqc_arena_t *a, uint32_t db_idx,
                           uint32_t ns_idx, const uint8_t *filter, uint32_t flen, uint64_t ts,
                           uint64_t ns);

/* Whether an entry found under this key (hash, namespace, filter) may be
 * older than what the process has observed, and so must not be served:
 * CQC_FLOOR_SERVE, CQC_FLOOR_BEHIND, or CQC_FLOOR_IF_OWN: served only if it
 * is the result the process's own miss admitted, whose
 * cqc_floor_value_hash is then in *value. Reads the database's applied and
 * quiet times (acquire): the lookup made after this call sees every
 * invalidation they cover. */
#define CQC_FLOOR_SERVE 0
#define CQC_FLOOR_BEHIND 1
#define CQC_FLOOR_IF_OWN 2
int cqc_floor_behind (cqc_floor_t *f, const cqc_arena_t *a, uint32_t ns_idx, uint32_t db_idx,
                      uint64_t key_hash, const uint8_t *filter, uint32_t flen, uint64_t *value);

/* The hash a memo keeps of a result: of its bytes, or 0 for "not found". */
uint64_t cqc_floor_value_hash (const uint8_t *value, size_t len, bool not_found);

/* Remember a key this process's own miss admitted, with the database floor
 * its read stands for (0: none; see the memo above), the memo epoch it
 * ended with, and the cqc_floor_value_hash of what it admitted. */
void cqc_floor_memo (cqc_floor_t *f, uint32_t db_idx, uint64_t key_hash, uint64_t floor_ts,
                     uint64_t epoch, uint64_t value);

#endif
