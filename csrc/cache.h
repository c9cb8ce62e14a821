/*
 * cache.h - a cache: an arena and whatever writes it, in one of three modes.
 *
 *   local   the arena in process-private memory; this process admits, and
 *           follows the registered databases' changes (stream.h).
 *   owner   the arena in a shared file this process creates (shm.h); it
 *           follows the streams, drains the workers' rings (owner.h) and
 *           publishes a heartbeat. It serves no reads.
 *   worker  an owner's arena mapped read-only; admissions go to this
 *           worker's ring, which the owner drains. Its lookups read the
 *           arena without a lock or a system call, as a local cache's do.
 *
 * Lookups, admissions and the causal floor (floor.h) are the caller's to
 * serialize (the binding holds the GIL); the followers and the drain are
 * threads of their own that write through the writer lock. Which cache a
 * call may be made on is checked by the binding (an owner has no reader).
 */
#ifndef CQC_CACHE_H
#define CQC_CACHE_H

#include "admit.h"
#include "arena.h"
#include "error.h"
#include "floor.h"
#include "keys.h"
#include "owner.h"
#include "ring.h"
#include "stream.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

typedef enum {
   CQC_MODE_LOCAL = 0,
   CQC_MODE_OWNER = 1,
   CQC_MODE_WORKER = 2,
} cqc_mode_t;

/* In the C types the binding parses them into. */
typedef struct {
   unsigned long long budget_bytes;         /* local, owner */
   unsigned int slot_count;                 /* local, owner */
   unsigned long long arena_bytes;          /* owner; 0: what the budget and slots need */
   const char *uri;                         /* local, owner; NULL: no followers */
   const char *tls_ca_file;                 /* local, owner: cqc_trust_t (stream.h) */
   const char *tls_ca_dir;                  /* local, owner; either may be NULL */
   const char *tls_crl_file;                /* local, owner; NULL: none */
   long long max_await_ms;                  /* local, owner */
   int stream_scope;                        /* local, owner: cqc_stream_scope_t */
   const char *arena_path;                  /* owner (created), worker (attached) */
   int arena_fd;                            /* or the arena's memfd (-1: none): the
                                             * owner's, empty; a worker's, handed over */
   unsigned long long heartbeat_timeout_ms; /* owner */
   const char *segment_path;                /* worker: its ring, created */
   int segment_fd;                          /* or its empty memfd (-1: none) */
   unsigned long long ring_bytes;           /* worker */
} cqc_cache_config_t;

typedef struct {
   cqc_mode_t mode;
   cqc_arena_t arena;
   void *mem;
   size_t mem_len;
   pthread_mutex_t lock; /* the single writer's */
   cqc_writer_t writer;
   cqc_owner_t *owner;       /* owner: the drain thread (threads_mu) */
   void *seg;                /* worker: its ring segment */
   size_t seg_len;
   cqc_ring_producer_t ring; /* worker: the producer's private state of seg */
   /* The follower (started with the first registration), each database's
    * last info once it stopped (by db_idx), and the owner's drain: guarded
    * by threads_mu, so a report never reads a thread's state while
    * cqc_cache_stop frees it. */
   pthread_mutex_t threads_mu;
   cqc_stream_t *follower;
   cqc_stream_info_t *final_info;
   bool stopped;
   char *uri; /* NULL: no followers */
   char *tls_ca_file; /* the followers' cqc_trust_t; NULL: none */
   char *tls_ca_dir;
   char *tls_crl_file;
   int64_t max_await_ms;
   cqc_stream_scope_t stream_scope;
   cqc_floor_t floor;
   /* This process's lookups. */
   uint64_t hits;
   uint64_t not_found_hits;
   uint64_t misses;
   uint64_t unhealthy;
   uint64_t behind; /* refused by the causal floor */
} cqc_cache_t;

/* Once per process, before any cache: mongo-c-driver's global state, with
 * its log silenced (followers report their errors in their info) and
 * without its counters file in /dev/shm. */
void cqc_cache_init_library (void);

/* Make a cache of `mode` in *c (zeroed by the caller). On failure, err is
 * set and cqc_cache_release frees what was made. */
bool cqc_cache_open (cqc_cache_t *c, cqc_mode_t mode, const cqc_cache_config_t *cfg,
                     cqc_error_t *err);

/* Stop the followers and the owner's drain, waiting for their threads. */
void cqc_cache_stop (cqc_cache_t *c);

/* Free everything. `threads` false in a forked child: the followers, the
 * drain and the locks belong to the parent's image and are left alone. */
void cqc_cache_release (cqc_cache_t *c, bool threads);

/* Register a namespace (local, owner) and have the follower follow its
 * database. */
bool cqc_cache_register (cqc_cache_t *c, const char *db, size_t db_len, const char *coll,
                         size_t coll_len, uint32_t *ns_idx, uint32_t *db_idx, cqc_error_t *err);

typedef enum {
   CQC_SERVE_HIT = 0,
   CQC_SERVE_NOT_FOUND = 1, /* a hit: the cached "no document" */
   CQC_SERVE_MISS = 2,
   CQC_SERVE_UNHEALTHY = 3, /* the database's stream does not serve */
   CQC_SERVE_BEHIND = 4,    /* found, but behind the causal floor: not served */
} cqc_served_t;

/* Look a built key up (indexes in range; key_hash: cqc_hash_bytes of its
 * bytes, seed 0); on a hit the value went to alloc's buffer, or `held` (may
 * be NULL) said the reader holds the entry (cqc_arena_r_lookup_entry), and
 * *id is the entry's. Counts the outcome. */
cqc_served_t cqc_cache_lookup (cqc_cache_t *c, uint32_t ns_idx, uint32_t db_idx,
                               const cqc_key_t *k, uint64_t key_hash, cqc_alloc_fn alloc,
                               cqc_discard_fn discard, cqc_held_fn held, void *ctx,
                               cqc_entry_id_t *id);

/* The admission token of a read of ns_idx with this filter; false when the
 * stream does not serve (the read then bypasses). */
bool cqc_cache_capture (const cqc_cache_t *c, uint32_t ns_idx, const uint8_t *filter,
                        uint32_t flen, cqc_token_t *tok);

/* This process's own write of ns_idx went to MongoDB (filter {"_id": v}:
 * that document's identity entries and the namespace's query entries; NULL
 * or any other filter: the query entries), observed with bounds (ts, ns):
 * those entries are invalid until the write's change events have been
 * applied. A process-local cache invalidates them at once, as the events
 * will; a worker, which cannot write the owner's arena, remembers the
 * write (cqc_floor_own_write), and its lookups of them are misses, not
 * floor refusals (cqc_floor_superseded). Either way the process's next
 * read of them goes to MongoDB as a miss, and what that read returns is
 * admitted. */
void cqc_cache_invalidate_written (cqc_cache_t *c, uint32_t db_idx, uint32_t ns_idx,
                                   const uint8_t *filter, uint32_t flen, uint64_t ts, uint64_t ns);

/* A worker's results, beyond cqc_admit's. */
#define CQC_ADMIT_QUEUED 16  /* pushed to the ring; the owner admits it */
#define CQC_ADMIT_DROPPED 17 /* the ring was full or damaged */

/* Admit a miss's result, stamped (adm->token.stamp): locally (cqc_admit),
 * or through a worker's ring after the same check (CQC_ADMIT_TOO_LARGE: the
 * record could never fit the ring). */
int cqc_cache_admit (cqc_cache_t *c, const cqc_admission_t *adm);

typedef struct {
   const char *name;
   uint64_t value;
} cqc_stat_t;

#define CQC_STATS_MAX 40

/* The counters of stats(): the arena's, this process's, and the rings'
 * (a worker's own, or an owner's summed over them). Returns how many. */
size_t cqc_cache_stats (cqc_cache_t *c, cqc_stat_t out[CQC_STATS_MAX]);

typedef struct {
   char name[CQC_DB_NAME_MAX];
   uint32_t name_len;
   cqc_stream_info_t info; /* the follower's, or as the owner published it */
   bool followed;          /* info (its scope too) is this process's follower's */
   bool stalled;
   uint32_t incarnation;
   uint64_t applied;
} cqc_db_report_t;

/* The report of registered database db_idx; false past the last one. */
bool cqc_cache_db_report (cqc_cache_t *c, uint32_t db_idx, cqc_db_report_t *out);

/* Owner: start draining a worker's ring, its file at path or (path NULL)
 * the memfd fd it handed over (its id, or 0 with err set), or drain what is
 * left of it, unmap it and unlink its file. */
uint32_t cqc_cache_attach_ring (cqc_cache_t *c, const char *path, int fd, cqc_error_t *err);
void cqc_cache_detach_ring (cqc_cache_t *c, uint32_t id);

/* A follower state's name, as streams() reports it. */
const char *cqc_cache_state_name (cqc_stream_state_t st);

/* What a collection probe's verdict is valid for: the namespace's epoch and
 * its database's incarnation, read from the arena. */
void cqc_cache_ns_epoch (const cqc_cache_t *c, uint32_t ns_idx, uint64_t *epoch,
                         uint32_t *incarnation);

#endif
