/*
 * arena.h - the cache arena: one contiguous region of memory holding every
 * cached entry, readable without locks.
 *
 * The same layout is used whether the memory is private to one process
 * (process-local mode) or a shared mapping created by an owner process and
 * mapped read-only by workers (shared mode). Nothing in this file knows which.
 *
 * Layout (all offsets from the start of the arena, all 64-byte aligned):
 *
 *   +---------------------+  0
 *   | cqc_arena_header_t  |  magic, layout version, geometry, writer state
 *   +---------------------+  db_off
 *   | cqc_db_t[db_count]  |  watched databases: stream health, incarnation
 *   +---------------------+  ns_off
 *   | cqc_ns_t[ns_count]  |  namespaces: epoch and write generation
 *   +---------------------+  idgen_off
 *   | uint64_t[idgen_count]  identity generations, indexed by a hash of
 *   |                     |  (namespace, canonical _id)
 *   +---------------------+  slots_off
 *   | cqc_slot_t[slots]   |  open-addressed (linear probing) entry table
 *   +---------------------+  ring_off
 *   | payload ring        |  blocks: header, key bytes, value bytes
 *   +---------------------+  ring_off + ring_bytes <= arena_bytes
 *
 * Invariants:
 *  - Single writer. Every function named cqc_arena_w_* must be called with the
 *    writer's lock held (process-local) or from the owner's writer thread.
 *  - Readers take no lock. A slot's `seq` is odd while the writer changes the
 *    slot; a reader copies what it needs and re-reads `seq`: any change makes
 *    the read a miss. Functions that read the arena without the writer lock are
 *    named cqc_arena_r_* and bounds-check every offset and length they read,
 *    so arbitrary bytes in the arena can cause a miss but never a crash.
 *  - Payload bytes in use (live blocks) never exceed budget_bytes: the ring's
 *    capacity is the budget, and allocation evicts the oldest blocks first.
 *  - Generations only grow. An entry records the generations it was admitted
 *    under; it is valid only while all of them are still current. Invalidation
 *    is therefore O(1): bump a generation, never search for entries.
 */
#ifndef CQC_ARENA_H
#define CQC_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CQC_ARENA_MAGIC 0x414e455241435143ULL /* "CQCARENA" little-endian */
#define CQC_LAYOUT_VERSION 7u

#define CQC_NS_NAME_MAX 256u /* "db.collection", NUL included */
#define CQC_DB_NAME_MAX 72u  /* MongoDB limits names to 63 bytes */
#define CQC_MAX_PROBE 64u    /* longest probe sequence, readers and writer */
#define CQC_NO_CELL 0xffffffffu
#define CQC_BLOCK_HEADER 64u

/* Entry flags (cqc_slot_t.flags). */
#define CQC_ENTRY_IDENTITY 0x1u  /* validated by an identity generation */
#define CQC_ENTRY_NOT_FOUND 0x2u /* cached "no document": value is empty */
#define CQC_ENTRY_CONFLICT 0x4u  /* marker: reads under these generations disagreed;
                                  * never served, refuses admissions until they change */

/* Stream health, stored in cqc_db_t.health. Only HEALTHY serves. */
typedef enum {
   CQC_STREAM_NOT_STARTED = 0,
   CQC_STREAM_CONNECTING = 1,
   CQC_STREAM_HEALTHY = 2,
   CQC_STREAM_RECONNECTING = 3,
   CQC_STREAM_FAILED = 4,
   CQC_STREAM_CLOSED = 5,
   CQC_STREAM_STARTUP_FAILED = 6, /* never opened: the server refused it */
} cqc_stream_state_t;

/* Result of a reader lookup. */
typedef enum {
   CQC_LOOKUP_MISS = 0,     /* no valid entry */
   CQC_LOOKUP_HIT = 1,      /* value copied out */
   CQC_LOOKUP_NOT_FOUND = 2 /* cached "no document" */
} cqc_lookup_t;

/* Geometry chosen at creation; growth means a new arena. */
typedef struct {
   uint64_t budget_bytes; /* payload ring capacity */
   uint32_t slot_count;   /* rounded up to a power of two */
   uint32_t ns_count;     /* power of two */
   uint32_t db_count;
   uint32_t idgen_count; /* power of two */
} cqc_geometry_t;

/* One database followed by a change stream. Written by the stream thread
 * (under the writer lock), read by readers for every lookup. */
typedef struct {
   uint32_t used;        /* 1 once registered; never cleared */
   uint32_t health;      /* cqc_stream_state_t */
   uint32_t incarnation; /* bumped when the db's entries must all go */
   uint32_t name_len;
   uint64_t progress_ns; /* CLOCK_MONOTONIC of the last stream round trip */
   uint64_t stall_ns;    /* progress older than this is not healthy */
   uint64_t events;      /* change events applied */
   uint64_t reconnects;
   uint64_t history_lost; /* times every entry was dropped for lost history */
   /* Cluster time ((seconds << 32) | increment) up to which every write to
    * the database is reflected: the last applied event's, the time of the
    * postBatchResumeToken of an empty batch (every event up to it has been
    * applied), or the time read before a stream opened without a resume
    * token (its entries were dropped or never existed) once that stream is
    * healthy. Stored with release order after the invalidation it covers;
    * 0 until known. Readers compare it with their process's causal floor
    * (a hit is served only once it reaches the highest cluster time the
    * process has observed from the database), and checkers use it to tell
    * which writes a read must see. */
   uint64_t applied_ts;
   /* CLOCK_MONOTONIC at which the last stream round that came back empty
    * began: every event visible to the server before then has been applied.
    * On a deployment of one member, where every acknowledged write and every
    * read is majority-committed, that covers whatever this host read or
    * wrote before it (module.c, the causal floor). Release order, like
    * applied_ts; 0 until known. */
   uint64_t quiet_ns;
   char name[CQC_DB_NAME_MAX];
} cqc_db_t;

/* The shared layout is fixed: every field at the offset other processes of
 * the same layout version expect, every 64-bit field (all of them read and
 * written with __atomic builtins somewhere) 8-byte aligned. A change here
 * changes CQC_LAYOUT_VERSION. */
_Static_assert (offsetof (cqc_db_t, used) == 0 && offsetof (cqc_db_t, health) == 4 &&
                   offsetof (cqc_db_t, incarnation) == 8 && offsetof (cqc_db_t, name_len) == 12 &&
                   offsetof (cqc_db_t, progress_ns) == 16 && offsetof (cqc_db_t, stall_ns) == 24 &&
                   offsetof (cqc_db_t, events) == 32 && offsetof (cqc_db_t, reconnects) == 40 &&
                   offsetof (cqc_db_t, history_lost) == 48 &&
                   offsetof (cqc_db_t, applied_ts) == 56 && offsetof (cqc_db_t, quiet_ns) == 64 &&
                   offsetof (cqc_db_t, name) == 72 && sizeof (cqc_db_t) == 144,
                "cqc_db_t layout");

/* One namespace ("db.coll"). Entries are never removed: an index handed to
 * a reader stays valid for the arena's life. */
typedef struct {
   uint32_t used;
   uint32_t db_idx;
   uint64_t hash;
   uint64_t epoch;     /* bumped by drop, rename, create, dropDatabase... */
   uint64_t write_gen; /* bumped by every write to the collection */
   uint32_t name_len;
   uint32_t pad_;
   char name[CQC_NS_NAME_MAX];
} cqc_ns_t;

_Static_assert (offsetof (cqc_ns_t, used) == 0 && offsetof (cqc_ns_t, db_idx) == 4 &&
                   offsetof (cqc_ns_t, hash) == 8 && offsetof (cqc_ns_t, epoch) == 16 &&
                   offsetof (cqc_ns_t, write_gen) == 24 && offsetof (cqc_ns_t, name_len) == 32 &&
                   offsetof (cqc_ns_t, name) == 40 && sizeof (cqc_ns_t) == 296,
                "cqc_ns_t layout");

/* One entry of the open-addressed table: exactly one cache line. `seq` comes
 * first and alone in its word, and only slot_begin_w/slot_end_w (arena.c)
 * ever write it: a writer that copies a whole slot over another, even one
 * that restores seq afterwards, shows readers the source's (even) seq on a
 * slot that is half written, and a reader that loads it twice in that window
 * validates a torn entry. */
typedef struct {
   uint32_t seq;   /* seqlock: odd while the writer changes this slot */
   uint16_t state; /* 0 empty, 1 live */
   uint16_t flags; /* CQC_ENTRY_* */
   uint64_t hash;
   uint32_t block_off; /* offset of the block within the ring */
   uint32_t block_gen; /* must equal the block header's gen */
   uint32_t key_len;
   uint32_t val_len;
   uint32_t ns_idx;
   uint32_t id_cell; /* identity generation cell, CQC_NO_CELL otherwise */
   uint64_t ns_epoch;
   uint64_t gen; /* id cell generation (identity) or ns write_gen */
   uint32_t db_inc;
   uint32_t base; /* writer's: hits the entry carried over from its last
                   * move (eviction, arena.c); readers ignore it */
} cqc_slot_t;

_Static_assert (sizeof (cqc_slot_t) == 64, "a slot is one cache line");
_Static_assert (offsetof (cqc_slot_t, seq) == 0 && offsetof (cqc_slot_t, state) == 4 &&
                   offsetof (cqc_slot_t, flags) == 6 && offsetof (cqc_slot_t, hash) == 8 &&
                   offsetof (cqc_slot_t, block_off) == 16 &&
                   offsetof (cqc_slot_t, block_gen) == 20 && offsetof (cqc_slot_t, key_len) == 24 &&
                   offsetof (cqc_slot_t, val_len) == 28 && offsetof (cqc_slot_t, ns_idx) == 32 &&
                   offsetof (cqc_slot_t, id_cell) == 36 && offsetof (cqc_slot_t, ns_epoch) == 40 &&
                   offsetof (cqc_slot_t, gen) == 48 && offsetof (cqc_slot_t, db_inc) == 56 &&
                   offsetof (cqc_slot_t, base) == 60,
                "cqc_slot_t layout");

/* Header at offset 0. The first block is immutable after creation: every
 * field of it, the owner's identity and heartbeat timeout included, is
 * written before the magic is published with release order
 * (cqc_arena_format), so an attacher that loads the magic with acquire sees
 * them all. */
typedef struct {
   uint64_t magic;
   uint32_t layout_version;
   uint32_t header_bytes;
   uint64_t arena_bytes;
   cqc_geometry_t geo;
   uint64_t db_off, ns_off, idgen_off, slots_off, ring_off, ring_bytes;
   uint32_t owner_uid;
   uint32_t owner_pid;
   uint64_t created_ns;

   /* Writer state (changed only by the writer, read by snapshots). */
   uint64_t ring_head;  /* next allocation offset */
   uint64_t ring_tail;  /* oldest block */
   uint64_t ring_span;  /* bytes between tail and head, dead blocks included */
   uint64_t used_bytes; /* live blocks only; <= geo.budget_bytes */
   uint64_t entries;
   uint64_t block_gen;  /* last block generation handed out */
   uint64_t heartbeat_ns;         /* owner's CLOCK_MONOTONIC, every 100 ms */
   uint64_t heartbeat_timeout_ns; /* 0: no owner (process-local); else readers
                                     stop serving once the heartbeat is older */
   /* Times the owner found itself frozen past its heartbeat timeout and
    * demoted every database (owner.c). Bumped under the writer lock before
    * the heartbeat that follows the freeze is published; a follower promotes
    * its database to HEALTHY only if it has not moved since its catch-up
    * began (stream.c), so a promotion cannot undo a demotion it raced. */
   uint64_t freezes;

   /* Writer counters. */
   uint64_t admissions;
   uint64_t rejected_stale;  /* token no longer current */
   uint64_t rejected_health; /* stream not healthy at admission */
   uint64_t rejected_size;   /* entry larger than the arena accepts */
   uint64_t rejected_probe;  /* no free slot within CQC_MAX_PROBE */
   uint64_t rejected_conflict; /* same generations, other bytes (marker kept) */
   uint64_t evictions;
   uint64_t invalidations;

   /* Eviction (S3-FIFO, arena.c): the payload ring is two rings. The main
    * ring is [0, ring_bytes - small_bytes) with ring_head/ring_tail/
    * ring_span above; the small ring, where new entries start, is the rest,
    * with the three below (offsets relative to its start). Writer state,
    * set at format; small_bytes is 0 for a budget too small to split. */
   uint64_t small_bytes;
   uint64_t small_head;
   uint64_t small_tail;
   uint64_t small_span;
   uint64_t small_entries; /* live entries whose block is in the small ring */
   uint64_t move_credit;   /* bytes the writer may still copy (moves) */
   uint64_t promotions;    /* small-ring entries copied to the main ring */
   uint64_t reinsertions;  /* main-ring entries copied to its head */
   uint64_t forced;        /* evicted while still hot: no credit to move them */
   uint64_t ghost_hits;    /* admitted straight to the main ring */
   uint64_t dead_reclaimed; /* invalidated entries reclaimed at a tail */
} cqc_arena_header_t;

_Static_assert (offsetof (cqc_geometry_t, budget_bytes) == 0 &&
                   offsetof (cqc_geometry_t, slot_count) == 8 &&
                   offsetof (cqc_geometry_t, ns_count) == 12 &&
                   offsetof (cqc_geometry_t, db_count) == 16 &&
                   offsetof (cqc_geometry_t, idgen_count) == 20 && sizeof (cqc_geometry_t) == 24,
                "cqc_geometry_t layout");
_Static_assert (offsetof (cqc_arena_header_t, magic) == 0 &&
                   offsetof (cqc_arena_header_t, layout_version) == 8 &&
                   offsetof (cqc_arena_header_t, header_bytes) == 12 &&
                   offsetof (cqc_arena_header_t, arena_bytes) == 16 &&
                   offsetof (cqc_arena_header_t, geo) == 24 &&
                   offsetof (cqc_arena_header_t, db_off) == 48 &&
                   offsetof (cqc_arena_header_t, ns_off) == 56 &&
                   offsetof (cqc_arena_header_t, idgen_off) == 64 &&
                   offsetof (cqc_arena_header_t, slots_off) == 72 &&
                   offsetof (cqc_arena_header_t, ring_off) == 80 &&
                   offsetof (cqc_arena_header_t, ring_bytes) == 88 &&
                   offsetof (cqc_arena_header_t, owner_uid) == 96 &&
                   offsetof (cqc_arena_header_t, owner_pid) == 100 &&
                   offsetof (cqc_arena_header_t, created_ns) == 104 &&
                   offsetof (cqc_arena_header_t, ring_head) == 112 &&
                   offsetof (cqc_arena_header_t, ring_tail) == 120 &&
                   offsetof (cqc_arena_header_t, ring_span) == 128 &&
                   offsetof (cqc_arena_header_t, used_bytes) == 136 &&
                   offsetof (cqc_arena_header_t, entries) == 144 &&
                   offsetof (cqc_arena_header_t, block_gen) == 152 &&
                   offsetof (cqc_arena_header_t, heartbeat_ns) == 160 &&
                   offsetof (cqc_arena_header_t, heartbeat_timeout_ns) == 168 &&
                   offsetof (cqc_arena_header_t, freezes) == 176 &&
                   offsetof (cqc_arena_header_t, admissions) == 184 &&
                   offsetof (cqc_arena_header_t, invalidations) == 240 &&
                   offsetof (cqc_arena_header_t, small_bytes) == 248 &&
                   offsetof (cqc_arena_header_t, dead_reclaimed) == 328 &&
                   sizeof (cqc_arena_header_t) == 336,
                "cqc_arena_header_t layout");

/* When, and by which read, an entry's result was read: what the causal
 * floor (floor.h) compares with what a process has observed. start_ns is
 * CLOCK_MONOTONIC before the read's first command was sent, end_ns after its
 * last reply (a result spread over several batches lies between the two),
 * end_ts the client's cluster time after it ((seconds << 32) | increment),
 * read_id the read's id, unique among the processes of the host (floor.h).
 * A later read of the same result moves start_ns on past end_ns (the
 * result was current at both; cqc_arena_w_admit).
 * CQC_STAMP_ORDERED: the reading process knows its deployment to be of one
 * member, where a read that began after another ended read at least what it
 * read; only then are the times compared with other reads' (cqc_arena_w_admit,
 * floor.c). All zero: nothing known, the entry waits for the stream. */
#define CQC_STAMP_ORDERED 0x1u
typedef struct {
   uint64_t start_ns;
   uint64_t end_ns;
   uint64_t end_ts;
   uint64_t read_id;
   uint32_t flags;
   uint32_t pad_;
} cqc_stamp_t;

_Static_assert (offsetof (cqc_stamp_t, start_ns) == 0 && offsetof (cqc_stamp_t, end_ns) == 8 &&
                   offsetof (cqc_stamp_t, end_ts) == 16 && offsetof (cqc_stamp_t, read_id) == 24 &&
                   offsetof (cqc_stamp_t, flags) == 32 && sizeof (cqc_stamp_t) == 40,
                "cqc_stamp_t layout");

/* Generations captured before a miss reads MongoDB (coherence rule 1), and
 * the stamp of that read (filled in once it has ended; the arena keeps it
 * with the entry). */
typedef struct {
   uint32_t ns_idx;
   uint32_t db_idx;
   uint32_t id_cell; /* CQC_NO_CELL for non-identity reads */
   uint32_t db_inc;
   uint64_t ns_epoch;
   uint64_t gen;
   uint32_t healthy; /* stream was healthy at capture */
   uint32_t pad_;
   cqc_stamp_t stamp;
} cqc_token_t;

/* Tokens travel in workers' rings (ring.h) as these 80 bytes. */
_Static_assert (offsetof (cqc_token_t, ns_idx) == 0 && offsetof (cqc_token_t, db_idx) == 4 &&
                   offsetof (cqc_token_t, id_cell) == 8 && offsetof (cqc_token_t, db_inc) == 12 &&
                   offsetof (cqc_token_t, ns_epoch) == 16 && offsetof (cqc_token_t, gen) == 24 &&
                   offsetof (cqc_token_t, healthy) == 32 && offsetof (cqc_token_t, stamp) == 40 &&
                   sizeof (cqc_token_t) == 80,
                "cqc_token_t layout");

/* A view of an arena in memory; what a process holds, not what is shared. */
typedef struct {
   uint8_t *base;
   uint64_t size;
   /* Geometry as validated when the view was made. Readers use these, never
    * the header's copy, so bytes changed in the arena later cannot move a
    * bound. */
   cqc_geometry_t geo;
   uint64_t ring_bytes;
   cqc_arena_header_t *hdr;
   cqc_db_t *dbs;
   cqc_ns_t *nss;
   uint64_t *idgen;
   cqc_slot_t *slots;
   uint8_t *ring;
   /* Eviction's view of hits (arena.c). `access`: this process's access
    * map, marked by its hits (NULL: it serves none, or marks none); the
    * map has access_mask + 1 cells. The writer sums a hit count over every
    * reader's map: `hits(hits_ctx, ...)` when set (an owner, over its
    * workers' maps), else `access` (a process-local cache). `ghost`: the
    * writer's private memory of keys recently evicted from the small ring
    * (cqc_arena_w_policy_init); NULL: none. */
   uint32_t *access;
   uint32_t access_mask;
   uint32_t (*hits) (void *ctx, uint64_t hash, uint32_t block_gen);
   void *hits_ctx;
   uint64_t *ghost;
   uint32_t ghost_mask;
   uint32_t ghost_seq;
} cqc_arena_t;

/* ------------------------------------------------------------------------ */
/* Creation and attachment                                                   */
/* ------------------------------------------------------------------------ */

/* Bytes an arena of this geometry needs (geometry is normalized in place). */
uint64_t cqc_arena_required_bytes (cqc_geometry_t *geo);

/* Who writes a shared arena: recorded in its header by cqc_arena_format,
 * before the magic, so that no attacher ever sees a formatted arena without
 * them (a uid of 0 refused as the wrong owner, a timeout of 0 that checks no
 * liveness). */
typedef struct {
   uint32_t uid;
   uint32_t pid;
   uint64_t heartbeat_timeout_ns; /* 0: process-local, nobody to watch */
} cqc_arena_owner_t;

/* Format `mem` (size bytes, zeroed) as a new arena written by `owner`. */
bool cqc_arena_format (cqc_arena_t *a, void *mem, uint64_t size, const cqc_geometry_t *geo,
                       const cqc_arena_owner_t *owner, char *err, size_t errlen);

/* Validate an existing arena (shared memory read by an attacher): magic,
 * layout version, and that every offset fits in `size`. */
bool cqc_arena_r_attach (cqc_arena_t *a, void *mem, uint64_t size, char *err, size_t errlen);

/* ------------------------------------------------------------------------ */
/* Reader API: lock-free, bounds-checked                                     */
/* ------------------------------------------------------------------------ */

uint64_t cqc_now_ns (void);

/* State of a database as a reader sees it: HEALTHY only when the stream is
 * established and has made progress within its stall bound. */
cqc_stream_state_t cqc_arena_r_db_state (const cqc_arena_t *a, uint32_t db_idx, bool *stalled);

/* The database's applied time (cqc_db_t.applied_ts), loaded with acquire
 * order: entries found after this load reflect every invalidation it covers.
 * 0 for an index out of range. */
uint64_t cqc_arena_r_applied (const cqc_arena_t *a, uint32_t db_idx);

/* The database's quiet time (cqc_db_t.quiet_ns), acquire; 0 out of range. */
uint64_t cqc_arena_r_quiet (const cqc_arena_t *a, uint32_t db_idx);

/* Find a namespace by name without the lock. Returns false if absent. */
bool cqc_arena_r_ns_find (const cqc_arena_t *a, const char *name, size_t len, uint32_t *idx);

/* Look a key up. On HIT, calls sink(ctx, value, len) with a private copy
 * target obtained from alloc(ctx, len); the copy is verified against the
 * slot's seqlock after the fact, and `discard(ctx)` is called if the copy
 * raced a writer. */
typedef void *(*cqc_alloc_fn) (void *ctx, size_t len);
typedef void (*cqc_discard_fn) (void *ctx);
cqc_lookup_t cqc_arena_r_lookup (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash,
                                 const uint8_t *key, uint32_t key_len, cqc_alloc_fn alloc,
                                 cqc_discard_fn discard, void *ctx);

/* The same, and on HIT or NOT_FOUND the entry's stamp in *stamp (checked
 * with the copy against the writer's sum) and its identity cell in *cell
 * (CQC_NO_CELL for an entry that is not an identity entry). */
cqc_lookup_t cqc_arena_r_lookup_stamped (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash,
                                         const uint8_t *key, uint32_t key_len, cqc_alloc_fn alloc,
                                         cqc_discard_fn discard, void *ctx, cqc_stamp_t *stamp,
                                         uint32_t *cell);

/* What identifies one admitted entry's bytes, for a reader that keeps what
 * it made of them (build.h's templates): its key's hash, its slot, its
 * block with the block's generation, its value's size, and the writer's sum
 * over its value and stamp. */
typedef struct {
   uint64_t key_hash;
   uint32_t slot, block_off, block_gen, val_len;
   uint64_t sum;
   bool held;           /* the lookup took no copy: the reader holds the entry */
   uint64_t value_hash; /* set by the reader when it holds the entry: the causal
                         * floor's hash of the value (cqc_floor_result_hash) */
} cqc_entry_id_t;

/* Called by a lookup with the entry it found, before it copies the value:
 * true when the reader holds what it made of an entry with this very id
 * (it then sets id->value_hash), and the copy is skipped. It runs inside
 * the lookup's seqlock read: no waiting, and nothing that may call back. */
typedef bool (*cqc_held_fn) (void *ctx, cqc_entry_id_t *id);

/* cqc_arena_r_lookup_stamped, and on HIT the entry's id in *id; with
 * `held` (may be NULL) asked first whether the copy is needed: on a HIT
 * without a copy id->held is true, and the slot and block were checked as
 * for a copy, the block's sum against id->sum. */
cqc_lookup_t cqc_arena_r_lookup_entry (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash,
                                       const uint8_t *key, uint32_t key_len, cqc_alloc_fn alloc,
                                       cqc_discard_fn discard, cqc_held_fn held, void *ctx,
                                       cqc_stamp_t *stamp, uint32_t *cell, cqc_entry_id_t *id);

/* Hints for a lookup about to run, so that its loads overlap: the home
 * slot of `hash` and its access cell (cqc_arena_r_prefetch), the header and
 * key of the block at block_off when it lies in the ring (a block a reader
 * saw there before: cqc_arena_r_prefetch_block). Prefetches only: nothing
 * is read, and an address that no longer holds what it did costs a wasted
 * load, never a wrong result. */
void cqc_arena_r_prefetch (const cqc_arena_t *a, uint64_t hash);
void cqc_arena_r_prefetch_block (const cqc_arena_t *a, uint64_t block_off);

/* Whether the entry `id` names is still in its slot and current (its
 * generations, its namespace's epoch, its database's incarnation): how a
 * reader finds what it keeps of entries since invalidated or evicted. */
bool cqc_arena_r_entry_live (const cqc_arena_t *a, const cqc_entry_id_t *id);

/* Capture an admission token for a read of ns_idx (id_cell or CQC_NO_CELL). */
void cqc_arena_r_capture (const cqc_arena_t *a, uint32_t ns_idx, uint32_t id_cell,
                          cqc_token_t *tok);

/* ------------------------------------------------------------------------ */
/* Writer API: single writer                                                 */
/* ------------------------------------------------------------------------ */

typedef enum {
   CQC_ADMIT_OK = 0,
   CQC_ADMIT_STALE = 1,
   CQC_ADMIT_UNHEALTHY = 2,
   CQC_ADMIT_TOO_LARGE = 3,
   CQC_ADMIT_NO_SLOT = 4,
   /* An entry admitted under the same generations holds other bytes: a write
    * landed between the two reads and its event is not applied yet. The entry
    * is replaced by a conflict marker that is never served and refuses every
    * admission under those generations, so that no reader goes back from the
    * newer result to the older one. */
   CQC_ADMIT_CONFLICT = 5,
} cqc_admit_t;

/* Writer, under the writer lock, right before cqc_arena_w_admit: turn a
 * namespace token (a find_one by the fields of a unique index) into the
 * identity token of the document it found, if the namespace's write
 * generation is still the token's. Returns whether it did. */
#define CQC_KIND_REBIND 0x80u /* kind bit: rebind before admitting */
bool cqc_arena_w_rebind (const cqc_arena_t *a, cqc_token_t *tok, const uint8_t *doc,
                         uint32_t len);

bool cqc_arena_w_db_register (cqc_arena_t *a, const char *name, size_t len, uint32_t *idx,
                              char *err, size_t errlen);
bool cqc_arena_w_ns_register (cqc_arena_t *a, const char *db, size_t db_len, const char *coll,
                              size_t coll_len, uint32_t *idx, char *err, size_t errlen);
/* Find a namespace under the writer lock ("db" "." "coll"). */
bool cqc_arena_w_ns_lookup (const cqc_arena_t *a, const char *db, size_t db_len,
                            const char *coll, size_t coll_len, uint32_t *idx);

/* Admit under tok's generations, with tok's stamp. Under the same
 * generations as an entry already there: the same result keeps that entry
 * (CQC_ADMIT_OK); another one replaces it if both stamps are
 * CQC_STAMP_ORDERED and the new read began after the old one ended, is
 * refused (CQC_ADMIT_STALE) if it ended before the old one began, and
 * otherwise leaves a conflict marker (CQC_ADMIT_CONFLICT). */
cqc_admit_t cqc_arena_w_admit (cqc_arena_t *a, const cqc_token_t *tok, uint64_t hash,
                               const uint8_t *key, uint32_t key_len, const uint8_t *val,
                               uint32_t val_len, uint16_t flags);

/* Invalidation. */
void cqc_arena_w_invalidate_id (cqc_arena_t *a, uint32_t ns_idx, uint32_t id_cell);
void cqc_arena_w_invalidate_ns (cqc_arena_t *a, uint32_t ns_idx);
void cqc_arena_w_invalidate_db (cqc_arena_t *a, uint32_t db_idx);

/* ------------------------------------------------------------------------ */
/* Eviction: access maps and the ghost                                       */
/* ------------------------------------------------------------------------ */

/* Cells of an access map for this geometry (a power of two). */
uint32_t cqc_access_cells (const cqc_geometry_t *geo);

/* A map's count for the block of generation `block_gen` with key hash
 * `hash` (0-3). Any cell value is harmless: a stale or forged cell only
 * moves the count. */
uint32_t cqc_access_count (const uint32_t *map, uint32_t mask, uint64_t hash, uint32_t block_gen);

/* Writer: allocate the ghost (false: out of memory; eviction then works
 * without one), and free it. */
bool cqc_arena_w_policy_init (cqc_arena_t *a);
void cqc_arena_w_policy_free (cqc_arena_t *a);

/* Bytes of the payload rings held by entries a lookup could serve
 * (*live), and by everything else: invalidated or replaced entries,
 * conflict markers, padding (*dead). A scan of the slot table without the
 * lock: a statistic. */
void cqc_arena_r_bytes (const cqc_arena_t *a, uint64_t *live, uint64_t *dead);

/* Remove every entry from the table and reset the ring. */
void cqc_arena_w_clear (cqc_arena_t *a);

/* Stream health, published for readers. */
void cqc_arena_w_set_health (cqc_arena_t *a, uint32_t db_idx, cqc_stream_state_t st);
void cqc_arena_w_progress (cqc_arena_t *a, uint32_t db_idx);

#endif
