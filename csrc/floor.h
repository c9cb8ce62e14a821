/*
 * floor.h - the causal floor: what a process may be served, given what it
 * has already read and written (DESIGN.md, rule 7; docs/consistency.md
 * states the rule and its proof).
 *
 * Observations. Everything the process learns from MongoDB through a view
 * is an observation: a miss's read (each batch of it), a bypass, a write,
 * a command a CausalListener reports, and a hit (of what the entry's read
 * saw). Each has a scope, the entries whose result it may contradict:
 *   - an identity of a namespace (a read or a write of {"_id": v}, a hit
 *     of an identity entry): the identity entries of that _id (by the
 *     value's 64-bit hash, not the arena's shared invalidation cell: a read
 *     of one document says nothing of another's), and every entry of the
 *     namespace that is not an identity entry;
 *   - a namespace (any other read or write of it): all its entries;
 *   - a database (a command whose namespace is not known, a transaction's
 *     commit, a pipeline writing into it): all its entries.
 * and three bounds: the read's id, CLOCK_MONOTONIC after its reply (`ns`),
 * and the client's cluster time after it (`ts`), both at or after the
 * snapshot it read.
 *
 * The rule. An entry found by a lookup is served only if, for every
 * observation O in a scope of the entry, one of these holds:
 *   (a) the database's applied time (cqc_db_t.applied_ts) has reached O's
 *       ts: every write O could have seen has been applied, and the entry,
 *       still valid, reflects them;
 *   (b) on a deployment of one member (f->ordered): a stream round that
 *       began after O's ns came back empty (cqc_db_t.quiet_ns): every write
 *       committed before O's reply is applied;
 *   (c) on a deployment of one member: the entry's read began after O's
 *       reply (stamp.start_ns >= O's ns): its snapshot is at least O's;
 *   (d) O is a batch of the entry's own read (same read id): the entry holds
 *       what that read returned; or O's read returned one result of the
 *       entry's key, byte for byte the entry's (another read of the same
 *       result, by another worker or before the entry was renewed).
 * So the process never reads a version older than one it has already been
 * given. Per scope the observations are folded into a cqc_seen_t: the
 * latest read's bounds and the highest of all other reads' (which (d)
 * needs), raised, never lowered, except when (a) or (b) covers all of them.
 *
 * Transactions (held). A write through a view inside a transaction becomes
 * visible at the commit, which the views do not see: until the caller finds
 * the transaction ended, every entry of the database is refused
 * (cqc_floor_hold); then it observes the database.
 *
 * Process-private memory, changed and read by one thread at a time (the
 * binding holds the GIL). The arena is read through cqc_arena_r_* only.
 */
#ifndef CQC_FLOOR_H
#define CQC_FLOOR_H

#include "arena.h"

#include <stdbool.h>
#include <stdint.h>

#define CQC_SEEN_BUCKETS 2048u
#define CQC_SEEN_WAYS 8u

/* The observations of one scope, folded. */
typedef struct {
   uint64_t read_id; /* the latest observation's read (0: none) */
   uint64_t key_hash;   /* that read's key and result (cqc_floor_result_hash), */
   uint64_t value_hash; /* 0 when not one result of one key */
   uint64_t top_ns;  /* its bounds (and of every earlier batch of that read) */
   uint64_t top_ts;
   uint64_t rest_ns; /* the highest bounds of every other read's */
   uint64_t rest_ts;
} cqc_seen_t;

/* An identity's observations (the _id value's hash, cqc_filter_identity). */
typedef struct {
   uint64_t id_hash;
   uint32_t ns_idx;
   uint32_t used;
   cqc_seen_t seen;
} cqc_cell_seen_t;

/* A write of this process through a view that its cache could not
 * invalidate itself (a shared cache's worker): of one document (has_id) or
 * anywhere in a namespace, bounded like an observation. */
typedef struct {
   uint32_t ns_idx;
   uint32_t used;
   uint32_t has_id;
   uint32_t db_idx;
   uint64_t id_hash;
   uint64_t ts;
   uint64_t ns;
} cqc_own_write_t;

#define CQC_OWN_WRITES 64u

typedef struct {
   uint32_t db_count;
   uint32_t ns_count;
   bool ordered;      /* the deployment has one member: (b) and (c) apply */
   cqc_seen_t *db;    /* by db_idx */
   uint64_t *db_max_ts; /* by db_idx: the highest bounds of every observation */
   uint64_t *db_max_ns; /* of the database, whatever its scope */
   cqc_seen_t *ns;    /* by ns_idx: observations of the whole namespace */
   cqc_seen_t *ns_ids; /* by ns_idx: every identity observation of it */
   uint32_t *ns_db;   /* by ns_idx: its db_idx (+1; 0: not seen yet) */
   uint8_t *held;     /* by db_idx: a transaction wrote there */
   cqc_cell_seen_t *cells; /* CQC_SEEN_BUCKETS * CQC_SEEN_WAYS */
   uint32_t cell_next; /* the way replaced when a bucket has none free */
   cqc_own_write_t own[CQC_OWN_WRITES]; /* the latest, in turn */
   uint32_t own_next;
} cqc_floor_t;

/* Scopes of cqc_floor_observe. */
#define CQC_SCOPE_DB 0
#define CQC_SCOPE_NS 1
#define CQC_SCOPE_CELL 2

/* Allocate the floors of an arena's geometry, all empty. */
bool cqc_floor_init (cqc_floor_t *f, uint32_t db_count, uint32_t ns_count);
void cqc_floor_free (cqc_floor_t *f);

/* Record an observation (see above): of a database, a namespace (ns_idx),
 * or an identity of it (CQC_SCOPE_CELL: the _id's hash, id_hash). `ts` must
 * not be 0. */
void cqc_floor_observe (cqc_floor_t *f, const cqc_arena_t *a, int scope, uint32_t db_idx,
                        uint32_t ns_idx, uint64_t id_hash, uint64_t ts, uint64_t ns,
                        uint64_t read_id);

/* The same for a read that returned one whole result of one key: (d)
 * then also serves another read's entry holding exactly that result. */
void cqc_floor_observe_result (cqc_floor_t *f, const cqc_arena_t *a, int scope, uint32_t db_idx,
                               uint32_t ns_idx, uint64_t id_hash, uint64_t ts, uint64_t ns,
                               uint64_t read_id, uint64_t key_hash, uint64_t value_hash);

/* A result's fingerprint for (d): of its bytes, or of "not found". */
uint64_t cqc_floor_result_hash (const uint8_t *value, size_t len, bool not_found);

/* Refuse every entry of the database (held) or stop refusing them: a
 * transaction of this process wrote there and has not ended. */
void cqc_floor_hold (cqc_floor_t *f, uint32_t db_idx, bool held);

/* What a database's stream has covered, as a reader loads it (acquire)
 * before its lookup: the entry validated after it reflects every
 * invalidation these cover. */
typedef struct {
   uint64_t applied;
   uint64_t quiet;
} cqc_covered_t;

void cqc_floor_covered (const cqc_arena_t *a, uint32_t db_idx, cqc_covered_t *cov);

/* What a lookup found: its key (keys.h) and that key's hash, for (d) its
 * bytes (the lookup's private copy), and whether it is an identity entry;
 * the value's and the _id's hashes are computed only when needed. */
typedef struct {
   const uint8_t *key;
   uint32_t key_len;
   bool identity;
   bool id_known; /* id_hash computed (identity stays true if it parsed) */
   uint64_t id_hash;
   uint64_t key_hash;
   const uint8_t *value;
   size_t len;
   bool not_found;
   uint64_t value_hash; /* 0: not computed yet */
} cqc_found_t;

/* Whether the rule above lets the process be served the entry `found` of
 * ns_idx, read as `stamp`, with `cov` loaded before the lookup. */
bool cqc_floor_allows (cqc_floor_t *f, uint32_t db_idx, uint32_t ns_idx,
                       const cqc_stamp_t *stamp, const cqc_covered_t *cov, cqc_found_t *found);

/* A hit of that entry was served: observe what its read saw (nothing to
 * record when cov already covers it). */
void cqc_floor_served (cqc_floor_t *f, const cqc_arena_t *a, uint32_t db_idx, uint32_t ns_idx,
                       const cqc_stamp_t *stamp, const cqc_covered_t *cov, cqc_found_t *found);

/* Remember a write of this process that its cache cannot invalidate (a
 * worker's: the owner's stream will): of the document id_hash (has_id), or
 * somewhere in namespace ns_idx. Its bounds as its observation's. */
void cqc_floor_own_write (cqc_floor_t *f, uint32_t db_idx, uint32_t ns_idx, bool has_id,
                          uint64_t id_hash, uint64_t ts, uint64_t ns);

/* Whether an entry the rule refused is one such a write superseded: its read
 * began before the write came back, and it is that document's identity
 * entry or a query entry of the namespace (any write may change a query's
 * result). Such an entry is invalid, its invalidation on its way from the
 * stream: the lookup is a miss, not a refusal. Writes the stream has
 * covered are forgotten. */
bool cqc_floor_superseded (cqc_floor_t *f, uint32_t ns_idx, const cqc_stamp_t *stamp,
                           const cqc_covered_t *cov, cqc_found_t *found);

/* Whether an observation bounded by (ts, ns), e.g. an after() token taken
 * at ns, is covered by the database's stream as cov says. */
bool cqc_floor_covers (const cqc_floor_t *f, const cqc_covered_t *cov, uint64_t ts, uint64_t ns);

#endif
