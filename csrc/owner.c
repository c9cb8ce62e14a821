/*
 * owner.c - see owner.h.
 */
#include "owner.h"
#include "admit.h"
#include "ring.h"
#include "shm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define MAX_RINGS 256u

typedef struct {
   uint32_t id; /* 0: free */
   void *mem;
   uint64_t size;
   char *path;
   const uint32_t *access; /* the worker's access map; NULL: none */
} ring_slot_t;

struct cqc_owner {
   cqc_writer_t w;
   pthread_t thread;
   bool thread_started;
   pthread_mutex_t mu; /* guards rings, stop, stats */
   bool stop;
   ring_slot_t rings[MAX_RINGS];
   uint32_t next_id;
   cqc_owner_stats_t stats;
};

/* ======================================================================== */
/* Admission of one record                                                  */
/* ======================================================================== */

/* `rec` is the drain's private copy of a record whose lengths and sum it
 * checked (ring.c): nothing here reads the worker's segment, so nothing
 * checked can change under the parse of the filter or the value. The token
 * came from a worker: cqc_admit checks it as it checks a local one. */
static void
admit_record (void *ctx, const cqc_ring_record_t *rec)
{
   cqc_owner_t *o = ctx;
   uint64_t key_hash;

   o->stats.records++;
   (void) cqc_admit (&o->w, rec, &key_hash);
}

/* The arena's eviction asks how often the workers hit a block (arena.c).
 * It evicts only while the drain admits, with o->mu held, so the rings
 * cannot come or go under this loop. The maps are the workers' memory:
 * each cell is loaded once and only compared (cqc_access_count). */
static uint32_t
worker_hits (void *ctx, uint64_t hash, uint32_t block_gen)
{
   cqc_owner_t *o = ctx;
   uint32_t mask = cqc_access_cells (&o->w.arena->geo) - 1u;
   uint32_t i, n = 0;

   for (i = 0; i < MAX_RINGS && n < 3u; i++) {
      if (o->rings[i].id && o->rings[i].access) {
         n += cqc_access_count (o->rings[i].access, mask, hash, block_gen);
      }
   }
   return n;
}

/* ======================================================================== */
/* The drain thread                                                         */
/* ======================================================================== */

static void
sleep_ns (uint64_t ns)
{
   struct timespec ts = {.tv_sec = (time_t) (ns / 1000000000ull),
                         .tv_nsec = (long) (ns % 1000000000ull)};
   nanosleep (&ts, NULL);
}

/* The drain thread polls: a worker's push costs no syscall and no wake-up.
 * After a pass that drained records it looks again a millisecond later,
 * draining whatever came meanwhile in one pass (admission is not urgent: a
 * later hit is all it buys, and the token check makes a late admission
 * safe); after each pass that found none it waits twice as long as the time
 * before, up to 10 ms. A steady stream of misses is so admitted within
 * about a millisecond, and 15 ms after the last record the thread is down
 * to 100 wake-ups a second. A poll that restarted at a few microseconds
 * after each record cost several wake-ups per admission, a CPU bill paid
 * on the cores the workers and the database share; one that stayed at a
 * millisecond for a second after the last record woke a thousand times in
 * that second, each wake-up on a busy machine a preemption of some worker's
 * read (the shared cache's hot p99, docs/benchmarks.md). */
#define DRAIN_BUSY_NS 1000000ull
#define DRAIN_IDLE_NS 10000000ull

/* The owner was frozen (stopped, starved) past the heartbeat timeout:
 * workers stopped trusting it, and its streams' backlog may hold
 * invalidations of writes acknowledged meanwhile. Demote every healthy
 * database before the heartbeat is fresh again (readers load the heartbeat
 * before the health, arena.c); each follower serves again once it has
 * caught up (stream.c). The freeze count moves in the same hold of the
 * writer lock: a follower that was catching up when the freeze began must
 * not promote its database on what it read before it, and it checks the
 * count in the hold of the lock that promotes. */
static void
demote_after_freeze (cqc_owner_t *o)
{
   cqc_arena_t *a = o->w.arena;
   uint32_t i;

   pthread_mutex_lock (o->w.lock);
   __atomic_store_n (&a->hdr->freezes, a->hdr->freezes + 1u, __ATOMIC_RELAXED);
   for (i = 0; i < a->geo.db_count && a->dbs[i].used; i++) {
      if (a->dbs[i].health == CQC_STREAM_HEALTHY) {
         cqc_arena_w_set_health (a, i, CQC_STREAM_RECONNECTING);
      }
   }
   pthread_mutex_unlock (o->w.lock);
}

static void *
drain_main (void *arg)
{
   cqc_owner_t *o = arg;
   uint64_t last_beat = 0, pause = DRAIN_BUSY_NS;

   for (;;) {
      uint64_t n = 0, now;
      uint32_t i;

      pthread_mutex_lock (&o->mu);
      if (o->stop) {
         pthread_mutex_unlock (&o->mu);
         break;
      }
      for (i = 0; i < MAX_RINGS; i++) {
         if (o->rings[i].id) {
            n += cqc_ring_drain (o->rings[i].mem, o->rings[i].size, admit_record, o);
         }
      }
      pthread_mutex_unlock (&o->mu);

      now = cqc_now_ns ();
      if (now - last_beat >= CQC_HEARTBEAT_PERIOD_NS) {
         if (last_beat && now - last_beat > o->w.arena->hdr->heartbeat_timeout_ns) {
            demote_after_freeze (o);
         }
         __atomic_store_n (&o->w.arena->hdr->heartbeat_ns, now, __ATOMIC_RELEASE);
         last_beat = now;
      }
      pause = n ? DRAIN_BUSY_NS : (pause * 2 < DRAIN_IDLE_NS ? pause * 2 : DRAIN_IDLE_NS);
      sleep_ns (pause);
   }
   return NULL;
}

/* ======================================================================== */
/* Public API                                                               */
/* ======================================================================== */

cqc_owner_t *
cqc_owner_start (cqc_writer_t *w, char *err, size_t errlen)
{
   cqc_owner_t *o = calloc (1, sizeof *o);
   if (!o) {
      snprintf (err, errlen, "out of memory");
      return NULL;
   }
   o->w = *w;
   o->next_id = 1;
   pthread_mutex_init (&o->mu, NULL);
   pthread_mutex_lock (w->lock);
   w->arena->hits = worker_hits;
   w->arena->hits_ctx = o;
   pthread_mutex_unlock (w->lock);
   __atomic_store_n (&w->arena->hdr->heartbeat_ns, cqc_now_ns (), __ATOMIC_RELEASE);
   if (pthread_create (&o->thread, NULL, drain_main, o) != 0) {
      snprintf (err, errlen, "could not start the drain thread");
      cqc_owner_destroy (o);
      return NULL;
   }
   o->thread_started = true;
   return o;
}

uint32_t
cqc_owner_attach (cqc_owner_t *o, const char *path, int fd, char *err, size_t errlen)
{
   cqc_error_t e;
   uint64_t size = 0;
   char *copy = NULL;
   const uint32_t *access = NULL;
   uint32_t i, id = 0, cells;
   void *mem = path ? cqc_shm_map_private (path, true, CQC_RING_DATA_OFF + 4096u, 1u << 30, &size,
                                           &e)
                    : cqc_shm_map_fd (fd, "the worker's memfd", true, CQC_RING_DATA_OFF + 4096u,
                                      1u << 30, &size, &e);

   if (!mem) {
      snprintf (err, errlen, "the worker's ring: %s", e.msg);
      goto cleanup;
   }
   if (!cqc_ring_check (mem, size)) {
      snprintf (err, errlen, "the worker's ring is not formatted");
      goto cleanup;
   }
   copy = path ? strdup (path) : NULL;
   if (path && !copy) {
      snprintf (err, errlen, "out of memory");
      goto cleanup;
   }
   /* The access map closes the segment (ring.h); a segment too small for
    * one contributes no hits. */
   cells = cqc_access_cells (&o->w.arena->geo);
   if (size >= (uint64_t) cells * sizeof (uint32_t) + CQC_RING_DATA_OFF + 4096u && size % 4u == 0) {
      access = (const uint32_t *) ((const uint8_t *) mem + size) - cells;
   }
   pthread_mutex_lock (&o->mu);
   for (i = 0; i < MAX_RINGS; i++) {
      if (!o->rings[i].id) {
         id = o->next_id++;
         o->rings[i] = (ring_slot_t){id, mem, size, copy, access};
         o->stats.rings++;
         mem = NULL;
         copy = NULL;
         break;
      }
   }
   pthread_mutex_unlock (&o->mu);
   if (!id) {
      snprintf (err, errlen, "too many attached workers (%u)", MAX_RINGS);
   }
cleanup:
   if (mem) {
      munmap (mem, (size_t) size);
   }
   free (copy);
   return id;
}

static void
release_ring_locked (cqc_owner_t *o, ring_slot_t *r)
{
   const cqc_ring_header_t *h = r->mem;
   cqc_ring_drain (r->mem, r->size, admit_record, o);
   o->stats.dropped += __atomic_load_n (&h->dropped, __ATOMIC_RELAXED);
   o->stats.damaged += __atomic_load_n (&h->damaged, __ATOMIC_RELAXED);
   o->stats.malformed += __atomic_load_n (&h->malformed, __ATOMIC_RELAXED);
   munmap (r->mem, (size_t) r->size);
   if (r->path) {
      unlink (r->path);
      free (r->path);
   }
   memset (r, 0, sizeof *r);
   o->stats.rings--;
}

void
cqc_owner_detach (cqc_owner_t *o, uint32_t id)
{
   uint32_t i;
   pthread_mutex_lock (&o->mu);
   for (i = 0; i < MAX_RINGS; i++) {
      if (id && o->rings[i].id == id) {
         release_ring_locked (o, &o->rings[i]);
         break;
      }
   }
   pthread_mutex_unlock (&o->mu);
}

void
cqc_owner_get_stats (cqc_owner_t *o, cqc_owner_stats_t *out)
{
   uint32_t i;
   pthread_mutex_lock (&o->mu);
   *out = o->stats;
   for (i = 0; i < MAX_RINGS; i++) {
      if (o->rings[i].id) {
         const cqc_ring_header_t *h = o->rings[i].mem;
         out->dropped += __atomic_load_n (&h->dropped, __ATOMIC_RELAXED);
         out->damaged += __atomic_load_n (&h->damaged, __ATOMIC_RELAXED);
         out->malformed += __atomic_load_n (&h->malformed, __ATOMIC_RELAXED);
      }
   }
   pthread_mutex_unlock (&o->mu);
}

void
cqc_owner_destroy (cqc_owner_t *o)
{
   uint32_t i;
   if (!o) {
      return;
   }
   pthread_mutex_lock (&o->mu);
   o->stop = true;
   pthread_mutex_unlock (&o->mu);
   if (o->thread_started) {
      pthread_join (o->thread, NULL);
   }
   for (i = 0; i < MAX_RINGS; i++) {
      if (o->rings[i].id) {
         release_ring_locked (o, &o->rings[i]);
      }
   }
   pthread_mutex_lock (o->w.lock);
   o->w.arena->hits = NULL;
   o->w.arena->hits_ctx = NULL;
   pthread_mutex_unlock (o->w.lock);
   pthread_mutex_destroy (&o->mu);
   free (o);
}
