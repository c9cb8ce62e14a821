/*
 * cache.c - see cache.h.
 */
#include "cache.h"
#include "shm.h"

#include <mongoc/mongoc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ======================================================================== */
/* Opening                                                                  */
/* ======================================================================== */

static void
quiet_log (mongoc_log_level_t level, const char *domain, const char *message, void *data)
{
   (void) level;
   (void) domain;
   (void) message;
   (void) data;
}

/* Whether this process maps path: a file mongo-c-driver made for this
 * process's counters is mapped by it until exit; one of the same name that
 * it does not map was made by another process (another PID namespace
 * sharing /dev/shm, or a pid reused after a crash) and is not ours. */
static bool
maps_file (const char *path)
{
   FILE *maps = fopen ("/proc/self/maps", "re");
   char line[4096];
   size_t n = strlen (path);
   bool found = false;

   if (!maps) {
      return false;
   }
   while (!found && fgets (line, sizeof line, maps)) {
      /* The path is the last field, maybe followed by " (deleted)". */
      char *at = strstr (line, path);
      found = at && at > line && at[-1] == ' ' &&
              (at[n] == '\n' || at[n] == '\0' || at[n] == ' ');
   }
   fclose (maps);
   return found;
}

void
cqc_cache_init_library (void)
{
   /* mongo-c-driver keeps performance counters in a shared memory file,
    * /dev/shm/mongoc-<pid>, made at its init and removed only at a clean
    * exit: every process killed or leaving through _exit() (a forked child,
    * a worker killed by its server) would leave one behind. The cache reads
    * none of them. MONGOC_DISABLE_SHM keeps mongoc_init from making the
    * file (the environment is left as it was): that is all mongo-c-driver
    * 2.x needs, as it initializes only when mongoc_init is called. 1.x as
    * Debian builds it (ENABLE_AUTOMATIC_INIT_AND_CLEANUP, removed in 2.0)
    * initializes itself when it is loaded, before this runs, and has made
    * the file by then; so has an earlier mongoc_init by other code in the
    * process. Such a file is unlinked: the counters stay mapped, and
    * nothing is left to remove. A file of that name this process does not
    * map is another process's and is left alone. */
   bool was_set = getenv ("MONGOC_DISABLE_SHM") != NULL;
   char path[64];

   if (!was_set) {
      setenv ("MONGOC_DISABLE_SHM", "1", 0);
   }
   mongoc_init ();
   if (!was_set) {
      unsetenv ("MONGOC_DISABLE_SHM");
   }
   snprintf (path, sizeof path, "/dev/shm/mongoc-%d", (int) getpid ());
   if (maps_file (path)) {
      unlink (path);
   }
   mongoc_log_set_handler (quiet_log, NULL);
}

/* Local and owner: format a new arena, in private memory (local), or in a
 * new shared file (arena_path) or the owner's empty memfd (arena_fd). */
static bool
format_arena (cqc_cache_t *c, const cqc_cache_config_t *cfg, bool shared, cqc_error_t *err)
{
   const char *arena_path = cfg->arena_path;
   cqc_geometry_t geo = {.budget_bytes = cfg->budget_bytes, .slot_count = cfg->slot_count};
   /* Written by the format, before the magic: a worker attaching at once
    * sees them (arena.h). */
   cqc_arena_owner_t who = {
      .uid = (uint32_t) getuid (),
      .pid = (uint32_t) getpid (),
      .heartbeat_timeout_ns = shared ? cfg->heartbeat_timeout_ms * 1000000ull : 0,
   };
   uint64_t need = cqc_arena_required_bytes (&geo);
   char msg[256];
   void *mem;

   if (cfg->arena_bytes) {
      if (cfg->arena_bytes < need) {
         cqc_error_set (err, CQC_ERR_VALUE,
                        "arena_bytes (%llu) is smaller than the %llu bytes this budget and "
                        "slot count need",
                        (unsigned long long) cfg->arena_bytes, (unsigned long long) need);
         return false;
      }
      need = cfg->arena_bytes;
   }
   if (shared && cfg->arena_fd >= 0) {
      if (!(mem = cqc_shm_create_fd (cfg->arena_fd, "the arena's memfd", need, err))) {
         return false;
      }
   } else if (shared) {
      if (!(mem = cqc_shm_create (arena_path, need, err))) {
         return false;
      }
   } else {
      /* Private: pages are committed only when touched. */
      mem = mmap (NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) {
         cqc_error_errno (err, "map", "a private arena");
         return false;
      }
   }
   if (!cqc_arena_format (&c->arena, mem, need, &geo, &who, msg, sizeof msg)) {
      munmap (mem, need);
      memset (&c->arena, 0, sizeof c->arena);
      if (shared && cfg->arena_fd < 0) {
         unlink (arena_path);
      }
      cqc_error_set (err, CQC_ERR_VALUE, "%s", msg);
      return false;
   }
   c->mem = mem;
   c->mem_len = need;
   /* The writer's eviction state (arena.c): the ghost, and in a
    * process-local cache the access map its own hits mark (an owner reads
    * its workers' maps instead, owner.c). */
   if (!cqc_arena_w_policy_init (&c->arena) ||
       (!shared && !(c->arena.access = calloc (cqc_access_cells (&geo), sizeof (uint32_t))))) {
      cqc_error_set (err, CQC_ERR_MEMORY, "out of memory");
      return false;
   }
   c->arena.access_mask = shared ? 0 : cqc_access_cells (&geo) - 1u;
   return true;
}

/* Worker: map the owner's arena read-only (its file, or the memfd the owner
 * handed over), validate it, and create this worker's ring segment (a new
 * file, or this worker's empty memfd). */
static bool
attach_worker (cqc_cache_t *c, const cqc_cache_config_t *cfg, cqc_error_t *err)
{
   const char *path = cfg->arena_fd >= 0 ? "the arena handed over by its owner" : cfg->arena_path;
   const char *seg_what = cfg->segment_fd >= 0 ? "this worker's ring memfd" : cfg->segment_path;
   uint64_t size = 0, seg_len;
   void *mem = NULL, *seg = NULL;
   char msg[256];
   bool ok = false;

   if (cfg->ring_bytes < CQC_RING_DATA_OFF + 4096u || cfg->ring_bytes > (1u << 30)) {
      cqc_error_set (err, CQC_ERR_VALUE, "ring_bytes out of range");
      goto cleanup;
   }
   if (cfg->arena_fd >= 0
          ? !(mem = cqc_shm_map_fd (cfg->arena_fd, path, false, sizeof (cqc_arena_header_t),
                                    UINT64_MAX, &size, err))
          : !(mem = cqc_shm_map_private (path, false, sizeof (cqc_arena_header_t), UINT64_MAX,
                                         &size, err))) {
      goto cleanup;
   }
   if (!cqc_arena_r_attach (&c->arena, mem, size, msg, sizeof msg)) {
      cqc_error_set (err, CQC_ERR_VALUE, "cannot attach to %s: %s", path, msg);
      goto cleanup;
   }
   if (c->arena.hdr->heartbeat_timeout_ns == 0) {
      /* Every owner sets one before publishing the arena (arena.h). */
      cqc_error_set (err, CQC_ERR_VALUE, "cannot attach to %s: it has no heartbeat timeout", path);
      goto cleanup;
   }
   if (c->arena.hdr->owner_uid != (uint32_t) getuid ()) {
      cqc_error_set (err, CQC_ERR_PERMISSION, "the arena's owner runs as uid %u, not %u",
                     c->arena.hdr->owner_uid, (unsigned) getuid ());
      goto cleanup;
   }
   /* The segment: the ring, then this worker's access map (ring.h), which
    * its hits mark and the owner reads when it evicts. */
   seg_len = cqc_ring_segment_bytes (cfg->ring_bytes, cqc_access_cells (&c->arena.geo));
   if (cfg->segment_fd >= 0 ? !(seg = cqc_shm_create_fd (cfg->segment_fd, seg_what, seg_len, err))
                            : !(seg = cqc_shm_create (cfg->segment_path, seg_len, err))) {
      goto cleanup;
   }
   if (!cqc_ring_format (&c->ring, seg, cfg->ring_bytes, (uint32_t) getpid ())) {
      cqc_error_set (err, CQC_ERR_VALUE, "cannot format the ring %s", seg_what);
      munmap (seg, seg_len);
      if (cfg->segment_fd < 0) {
         unlink (cfg->segment_path);
      }
      goto cleanup;
   }
   c->mem = mem;
   c->mem_len = (size_t) size;
   c->seg = seg;
   c->seg_len = seg_len;
   c->arena.access = (uint32_t *) ((uint8_t *) seg + seg_len) - cqc_access_cells (&c->arena.geo);
   c->arena.access_mask = cqc_access_cells (&c->arena.geo) - 1u;
   ok = true;
cleanup:
   if (!ok) {
      if (mem) {
         munmap (mem, (size_t) size);
      }
      memset (&c->arena, 0, sizeof c->arena);
   }
   return ok;
}

bool
cqc_cache_open (cqc_cache_t *c, cqc_mode_t mode, const cqc_cache_config_t *cfg,
                cqc_error_t *err)
{
   char msg[256];
   uint32_t dbs;

   c->mode = mode;
   pthread_mutex_init (&c->lock, NULL);
   pthread_mutex_init (&c->threads_mu, NULL);
   c->writer.arena = &c->arena;
   c->writer.lock = &c->lock;
   if (mode != CQC_MODE_LOCAL && !cfg->arena_path && cfg->arena_fd < 0) {
      cqc_error_set (err, CQC_ERR_VALUE, "a shared arena needs arena_path or arena_fd");
      return false;
   }
   if (mode == CQC_MODE_WORKER && !cfg->segment_path && cfg->segment_fd < 0) {
      cqc_error_set (err, CQC_ERR_VALUE, "a worker needs segment_path or segment_fd");
      return false;
   }
   if (mode == CQC_MODE_WORKER ? !attach_worker (c, cfg, err)
                               : !format_arena (c, cfg, mode == CQC_MODE_OWNER, err)) {
      return false;
   }
   dbs = c->arena.geo.db_count;
   c->final_info = calloc (dbs, sizeof (cqc_stream_info_t));
   /* A worker follows nothing: the owner does. */
   c->uri = mode != CQC_MODE_WORKER && cfg->uri ? strdup (cfg->uri) : NULL;
   c->tls_ca_file = c->uri && cfg->tls_ca_file ? strdup (cfg->tls_ca_file) : NULL;
   c->tls_ca_dir = c->uri && cfg->tls_ca_dir ? strdup (cfg->tls_ca_dir) : NULL;
   c->tls_crl_file = c->uri && cfg->tls_crl_file ? strdup (cfg->tls_crl_file) : NULL;
   if (!c->final_info || !cqc_floor_init (&c->floor, dbs, c->arena.geo.ns_count) ||
       (mode != CQC_MODE_WORKER && cfg->uri && !c->uri) ||
       (c->uri && cfg->tls_ca_file && !c->tls_ca_file) ||
       (c->uri && cfg->tls_ca_dir && !c->tls_ca_dir) ||
       (c->uri && cfg->tls_crl_file && !c->tls_crl_file)) {
      cqc_error_set (err, CQC_ERR_MEMORY, "out of memory");
      return false;
   }
   c->max_await_ms = cfg->max_await_ms;
   c->stream_scope = cfg->stream_scope == CQC_STREAM_SCOPE_DATABASE ? CQC_STREAM_SCOPE_DATABASE
                                                                     : CQC_STREAM_SCOPE_DEPLOYMENT;
   if (mode == CQC_MODE_OWNER && !(c->owner = cqc_owner_start (&c->writer, msg, sizeof msg))) {
      cqc_error_set (err, CQC_ERR_RUNTIME, "%s", msg);
      return false;
   }
   return true;
}

/* ======================================================================== */
/* Stopping and releasing                                                   */
/* ======================================================================== */

void
cqc_cache_stop (cqc_cache_t *c)
{
   cqc_stream_t *follower;
   cqc_owner_t *owner;
   uint32_t i;

   pthread_mutex_lock (&c->threads_mu);
   follower = c->follower;
   c->follower = NULL;
   pthread_mutex_unlock (&c->threads_mu);
   if (follower) {
      /* Joined outside threads_mu: reports wait for nothing meanwhile, and
       * read final_info only once stopped is set below. */
      cqc_stream_destroy_keep_info (follower, c->final_info);
      for (i = 0; i < c->arena.geo.db_count; i++) {
         c->final_info[i].state = CQC_STREAM_CLOSED;
      }
   }
   pthread_mutex_lock (&c->threads_mu);
   c->stopped = true;
   owner = c->owner;
   c->owner = NULL;
   pthread_mutex_unlock (&c->threads_mu);
   cqc_owner_destroy (owner);
}

void
cqc_cache_release (cqc_cache_t *c, bool threads)
{
   if (threads) {
      cqc_cache_stop (c);
      pthread_mutex_destroy (&c->lock);
      pthread_mutex_destroy (&c->threads_mu);
   }
   if (c->seg) {
      munmap (c->seg, c->seg_len);
   }
   if (c->mem) {
      munmap (c->mem, c->mem_len);
   }
   if (c->mode != CQC_MODE_WORKER) {
      free (c->arena.access); /* a worker's is in its segment */
   }
   cqc_arena_w_policy_free (&c->arena);
   free (c->final_info);
   cqc_floor_free (&c->floor);
   if (c->uri) {
      memset (c->uri, 0, strlen (c->uri));
      free (c->uri);
   }
   free (c->tls_ca_file);
   free (c->tls_ca_dir);
   free (c->tls_crl_file);
   memset (c, 0, sizeof *c);
}

/* ======================================================================== */
/* Registration                                                             */
/* ======================================================================== */

bool
cqc_cache_register (cqc_cache_t *c, const char *db, size_t db_len, const char *coll,
                    size_t coll_len, uint32_t *ns_idx, uint32_t *db_idx, cqc_error_t *err)
{
   char msg[256];
   bool ok;

   if (c->mode == CQC_MODE_WORKER) {
      cqc_error_set (err, CQC_ERR_RUNTIME, "a worker registers namespaces through its owner");
      return false;
   }
   pthread_mutex_lock (&c->lock);
   ok = cqc_arena_w_ns_register (&c->arena, db, db_len, coll, coll_len, ns_idx, msg, sizeof msg);
   if (ok) {
      *db_idx = c->arena.nss[*ns_idx].db_idx;
   }
   pthread_mutex_unlock (&c->lock);
   if (!ok) {
      cqc_error_set (err, CQC_ERR_VALUE, "%s", msg);
      return false;
   }
   pthread_mutex_lock (&c->threads_mu);
   if (c->uri && !c->stopped) {
      if (!c->follower) {
         cqc_trust_t trust = {c->tls_ca_file, c->tls_ca_dir, c->tls_crl_file};
         c->follower = cqc_stream_start (&c->writer, c->stream_scope, c->uri, &trust,
                                         c->max_await_ms, msg, sizeof msg);
      }
      ok = c->follower &&
           cqc_stream_add (c->follower, *db_idx, c->arena.dbs[*db_idx].name, msg, sizeof msg);
   }
   pthread_mutex_unlock (&c->threads_mu);
   if (!ok) {
      cqc_error_set (err, CQC_ERR_RUNTIME, "%s", msg);
   }
   return ok;
}

/* ======================================================================== */
/* Reads and admissions                                                     */
/* ======================================================================== */

/* A lookup's copy, seen on its way to the caller's buffer (the floor's (d)
 * may compare it with a result this process read). */
typedef struct {
   cqc_alloc_fn alloc;
   cqc_discard_fn discard;
   cqc_held_fn held;
   void *ctx;
   const uint8_t *buf;
   size_t len;
} seen_copy_t;

static void *
seen_alloc (void *ctx, size_t len)
{
   seen_copy_t *s = ctx;

   s->len = len;
   s->buf = s->alloc (s->ctx, len);
   return (void *) s->buf;
}

static void
seen_discard (void *ctx)
{
   seen_copy_t *s = ctx;

   s->buf = NULL;
   s->discard (s->ctx);
}

static bool
seen_held (void *ctx, cqc_entry_id_t *id)
{
   seen_copy_t *s = ctx;

   return s->held (s->ctx, id);
}

cqc_served_t
cqc_cache_lookup (cqc_cache_t *c, uint32_t ns_idx, uint32_t db_idx, const cqc_key_t *k,
                  uint64_t key_hash, cqc_alloc_fn alloc, cqc_discard_fn discard,
                  cqc_held_fn held, void *ctx, cqc_entry_id_t *id)
{
   bool stalled;
   cqc_lookup_t r;
   cqc_covered_t cov;
   cqc_stamp_t stamp;
   uint32_t cell;
   seen_copy_t copy = {alloc, discard, held, ctx, NULL, 0};
   cqc_found_t found = {0};

   if (cqc_arena_r_db_state (&c->arena, db_idx, &stalled) != CQC_STREAM_HEALTHY) {
      c->unhealthy++;
      return CQC_SERVE_UNHEALTHY;
   }
   /* What the stream has covered, loaded (acquire) before the lookup: the
    * entry it then validates reflects every invalidation this covers. */
   cqc_floor_covered (&c->arena, db_idx, &cov);
   found.key_hash = key_hash;
   id->held = false;
   r = cqc_arena_r_lookup_entry (&c->arena, ns_idx, found.key_hash, k->buf, k->len, seen_alloc,
                                 seen_discard, held ? seen_held : NULL, &copy, &stamp, &cell, id);
   if (r == CQC_LOOKUP_MISS) {
      c->misses++;
      return CQC_SERVE_MISS;
   }
   /* The causal floor (floor.h): an entry that may be older than what the
    * process has seen is not served. */
   found.key = k->buf;
   found.key_len = k->len;
   found.identity = cell != CQC_NO_CELL;
   found.value = copy.buf;
   found.len = copy.len;
   found.not_found = r == CQC_LOOKUP_NOT_FOUND;
   /* Held, the entry was not copied: the reader kept its value's hash. */
   found.value_hash = id->held ? id->value_hash : 0;
   if (!cqc_floor_allows (&c->floor, db_idx, ns_idx, &stamp, &cov, &found)) {
      if (r == CQC_LOOKUP_HIT && !id->held) {
         discard (ctx);
      }
      if (cqc_floor_superseded (&c->floor, ns_idx, &stamp, &cov, &found)) {
         c->misses++; /* invalid: the process's own write changed it */
         return CQC_SERVE_MISS;
      }
      c->behind++;
      return CQC_SERVE_BEHIND;
   }
   cqc_floor_served (&c->floor, &c->arena, db_idx, ns_idx, &stamp, &cov, &found);
   c->hits++;
   if (r == CQC_LOOKUP_NOT_FOUND) {
      c->not_found_hits++;
      return CQC_SERVE_NOT_FOUND;
   }
   return CQC_SERVE_HIT;
}

bool
cqc_cache_capture (const cqc_cache_t *c, uint32_t ns_idx, const uint8_t *filter, uint32_t flen,
                   cqc_token_t *tok)
{
   uint32_t cell = CQC_NO_CELL;
   uint64_t id_hash;

   if (cqc_filter_identity (filter, flen, &id_hash)) {
      cell = cqc_id_cell (id_hash, ns_idx, c->arena.geo.idgen_count);
   }
   cqc_arena_r_capture (&c->arena, ns_idx, cell, tok);
   return tok->healthy != 0;
}

void
cqc_cache_invalidate_written (cqc_cache_t *c, uint32_t db_idx, uint32_t ns_idx,
                              const uint8_t *filter, uint32_t flen, uint64_t ts, uint64_t ns)
{
   uint64_t id_hash = 0;
   bool has_id = filter && cqc_filter_identity (filter, flen, &id_hash);

   if (ns_idx >= c->arena.geo.ns_count) {
      return;
   }
   if (c->mode != CQC_MODE_LOCAL) {
      cqc_floor_own_write (&c->floor, db_idx, ns_idx, has_id, id_hash, ts, ns);
      return;
   }
   /* A document's write: its identity entries and the namespace's query
    * entries, as its change event does. Any other write: the query entries
    * only (the documents it wrote are not known; their identity entries
    * wait for the events, refused by the floor meanwhile). */
   pthread_mutex_lock (&c->lock);
   cqc_arena_w_invalidate_id (&c->arena, ns_idx,
                              has_id ? cqc_id_cell (id_hash, ns_idx, c->arena.geo.idgen_count)
                                     : CQC_NO_CELL);
   pthread_mutex_unlock (&c->lock);
}

/* A worker's admission: checked as the owner will check it, then pushed to
 * the ring. */
static int
push_admission (cqc_cache_t *c, const cqc_admission_t *adm)
{
   if (!cqc_admission_valid (&c->arena, adm)) {
      return CQC_ADMIT_INVALID;
   }
   switch (cqc_ring_push (&c->ring, adm->kind, adm->not_found, &adm->token, adm->filter,
                          adm->flen, adm->rest, adm->rlen, adm->value, adm->vlen)) {
   case CQC_RING_PUSHED:
      return CQC_ADMIT_QUEUED;
   case CQC_RING_TOO_LARGE:
      return CQC_ADMIT_TOO_LARGE;
   default:
      return CQC_ADMIT_DROPPED;
   }
}

int
cqc_cache_admit (cqc_cache_t *c, const cqc_admission_t *adm)
{
   uint64_t key_hash = 0;

   return c->mode == CQC_MODE_WORKER ? push_admission (c, adm)
                                     : cqc_admit (&c->writer, adm, &key_hash);
}

/* ======================================================================== */
/* Reports                                                                  */
/* ======================================================================== */

size_t
cqc_cache_stats (cqc_cache_t *c, cqc_stat_t out[CQC_STATS_MAX])
{
   cqc_arena_header_t h;
   cqc_owner_stats_t os = {0};
   uint64_t live, dead;
   size_t n = 0;

   if (c->mode == CQC_MODE_WORKER) {
      memcpy (&h, c->arena.hdr, sizeof h); /* the owner's counters, racy */
      /* The producer's own counts, not the segment's copy of them. */
      out[n++] = (cqc_stat_t){"ring_pushed", c->ring.pushed};
      out[n++] = (cqc_stat_t){"ring_dropped", c->ring.dropped};
      out[n++] = (cqc_stat_t){"ring_damaged", c->ring.damaged};
      out[n++] = (cqc_stat_t){"ring_oversize", c->ring.oversize};
   } else {
      pthread_mutex_lock (&c->lock);
      memcpy (&h, c->arena.hdr, sizeof h);
      pthread_mutex_unlock (&c->lock);
   }
   cqc_arena_r_bytes (&c->arena, &live, &dead);
   pthread_mutex_lock (&c->threads_mu);
   if (c->owner) {
      cqc_owner_get_stats (c->owner, &os);
   }
   pthread_mutex_unlock (&c->threads_mu);
   if (c->mode == CQC_MODE_OWNER) {
      out[n++] = (cqc_stat_t){"attached_rings", os.rings};
      out[n++] = (cqc_stat_t){"ring_records", os.records};
      out[n++] = (cqc_stat_t){"ring_dropped", os.dropped};
      out[n++] = (cqc_stat_t){"ring_malformed", os.malformed};
      out[n++] = (cqc_stat_t){"ring_damaged", os.damaged};
   }
   {
      const cqc_stat_t all[] = {
         {"owner_pid", h.owner_pid},
         {"created_ns", h.created_ns},
         {"heartbeat_ns", h.heartbeat_ns},
         {"hits", c->hits},
         {"not_found_hits", c->not_found_hits},
         {"misses", c->misses},
         {"unhealthy_lookups", c->unhealthy},
         {"behind_lookups", c->behind},
         {"admissions", h.admissions},
         {"rejected_stale", h.rejected_stale},
         {"rejected_unhealthy", h.rejected_health},
         {"rejected_too_large", h.rejected_size},
         {"rejected_no_slot", h.rejected_probe},
         {"rejected_conflict", h.rejected_conflict},
         {"evictions", h.evictions},
         {"promotions", h.promotions},
         {"reinsertions", h.reinsertions},
         {"forced_evictions", h.forced},
         {"ghost_hits", h.ghost_hits},
         {"dead_reclaimed", h.dead_reclaimed},
         {"live_bytes", live},
         {"dead_bytes", dead},
         {"invalidations", h.invalidations},
         {"used_bytes", h.used_bytes},
         {"budget_bytes", h.geo.budget_bytes},
         {"entries", h.entries},
         {"slot_count", h.geo.slot_count},
         {"arena_bytes", h.arena_bytes},
      };
      _Static_assert (sizeof all / sizeof all[0] + 5 <= CQC_STATS_MAX, "CQC_STATS_MAX");
      memcpy (out + n, all, sizeof all);
      n += sizeof all / sizeof all[0];
   }
   return n;
}

bool
cqc_cache_db_report (cqc_cache_t *c, uint32_t db_idx, cqc_db_report_t *out)
{
   const cqc_db_t *db;
   cqc_stream_state_t seen;

   if (!c->arena.hdr || db_idx >= c->arena.geo.db_count || !c->arena.dbs[db_idx].used) {
      return false;
   }
   db = &c->arena.dbs[db_idx];
   memset (out, 0, sizeof *out);
   out->info.state = CQC_STREAM_NOT_STARTED;
   seen = cqc_arena_r_db_state (&c->arena, db_idx, &out->stalled);
   out->stalled = out->stalled && seen != CQC_STREAM_HEALTHY;
   pthread_mutex_lock (&c->threads_mu);
   if (c->follower && cqc_stream_get_info (c->follower, db_idx, &out->info)) {
      out->followed = true;
   } else if (c->stopped && c->mode != CQC_MODE_WORKER && c->uri) {
      out->info = c->final_info[db_idx];
      out->info.state = CQC_STREAM_CLOSED;
      out->followed = true;
   }
   pthread_mutex_unlock (&c->threads_mu);
   if (c->mode == CQC_MODE_WORKER) {
      /* The owner's followers, as published in the arena. */
      out->info.state = (cqc_stream_state_t) __atomic_load_n (&db->health, __ATOMIC_ACQUIRE);
      if (out->info.state > CQC_STREAM_STARTUP_FAILED) {
         out->info.state = CQC_STREAM_FAILED;
      }
      out->info.events = __atomic_load_n (&db->events, __ATOMIC_ACQUIRE);
      out->info.reconnects = db->reconnects;
      out->info.history_lost = db->history_lost;
   }
   /* The name is read from the arena: bounded, never trusted to end. */
   out->name_len = db->name_len < CQC_DB_NAME_MAX ? db->name_len : 0;
   memcpy (out->name, db->name, out->name_len);
   out->incarnation = __atomic_load_n (&db->incarnation, __ATOMIC_ACQUIRE);
   out->applied = cqc_arena_r_applied (&c->arena, db_idx);
   return true;
}

uint32_t
cqc_cache_attach_ring (cqc_cache_t *c, const char *path, int fd, cqc_error_t *err)
{
   char msg[256];
   uint32_t id = 0;

   pthread_mutex_lock (&c->threads_mu);
   if (!c->owner) {
      cqc_error_set (err, CQC_ERR_RUNTIME, "only a running owner drains rings");
   } else if (!(id = cqc_owner_attach (c->owner, path, fd, msg, sizeof msg))) {
      cqc_error_set (err, CQC_ERR_VALUE, "%s", msg);
   }
   pthread_mutex_unlock (&c->threads_mu);
   return id;
}

void
cqc_cache_detach_ring (cqc_cache_t *c, uint32_t id)
{
   pthread_mutex_lock (&c->threads_mu);
   if (c->owner) {
      cqc_owner_detach (c->owner, id);
   }
   pthread_mutex_unlock (&c->threads_mu);
}

const char *
cqc_cache_state_name (cqc_stream_state_t st)
{
   static const char *const names[] = {
      [CQC_STREAM_NOT_STARTED] = "not_started", [CQC_STREAM_CONNECTING] = "connecting",
      [CQC_STREAM_HEALTHY] = "healthy",         [CQC_STREAM_RECONNECTING] = "reconnecting",
      [CQC_STREAM_FAILED] = "failed",           [CQC_STREAM_CLOSED] = "closed",
      [CQC_STREAM_STARTUP_FAILED] = "startup_failed",
   };
   return (unsigned) st < sizeof names / sizeof names[0] && names[st] ? names[st] : "closed";
}

void
cqc_cache_ns_epoch (const cqc_cache_t *c, uint32_t ns_idx, uint64_t *epoch,
                    uint32_t *incarnation)
{
   const cqc_ns_t *ns = &c->arena.nss[ns_idx];
   uint32_t db_idx = ns->db_idx;

   *epoch = __atomic_load_n (&ns->epoch, __ATOMIC_ACQUIRE);
   *incarnation = db_idx < c->arena.geo.db_count
                     ? __atomic_load_n (&c->arena.dbs[db_idx].incarnation, __ATOMIC_ACQUIRE)
                     : 0;
}
