/*
 * race_evict_move.c - readers racing the eviction policy's copies: while
 * two reader threads look keys up and mark their own access maps, the writer
 * admits more than the arena holds (evicting, promoting small-ring entries
 * to the main ring, moving hot main-ring entries to its head) and
 * invalidates the namespace now and then (dead entries reclaimed at the
 * tails). Every hit must return exactly its key's bytes: a read racing a
 * move is a miss, never torn or another key's value.
 *
 *   race_evict_move [SECONDS]     (default 3)
 *
 * Not a libFuzzer target: three threads on one arena. The writer reads the
 * readers' maps the way an owner reads its workers' (arena.h: `hits`), and
 * a third map, scribbled with random values by the writer itself, stands
 * for a worker that writes nonsense into its map: it may only make the
 * policy copy more (bounded by the move credit), never change a hit's
 * bytes. The run fails if any hit is wrong, or if no entry was ever moved
 * (the race it exists for did not happen). It also runs on aarch64 in the
 * ARM subset (docs/architecture.md, memory ordering). Exits 0 when nothing
 * was wrong.
 */
#include "arena.h"
#include "keys.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NKEYS 2048u
#define READERS 2

typedef struct {
   uint8_t key[24];
   uint32_t key_len;
   uint64_t hash;
   uint32_t val_len;
} entry_t;

static cqc_arena_t arena; /* the writer's view */
static cqc_arena_t views[READERS]; /* each reader's: its own access map */
static uint32_t *maps[READERS + 1]; /* the last one is the scribbler's */
static uint32_t map_mask;
static entry_t entries[NKEYS];
static uint32_t ns_idx, db_idx;
static int stop;
static uint64_t admitted, invalidations;
static uint64_t hits[READERS], wrong[READERS], lookups[READERS];

static double
elapsed (const struct timespec *t0)
{
   struct timespec now;
   clock_gettime (CLOCK_MONOTONIC, &now);
   return (double) (now.tv_sec - t0->tv_sec) + (double) (now.tv_nsec - t0->tv_nsec) / 1e9;
}

/* The value of key k: its length and every byte derive from k. */
static void
fill_value (uint32_t k, uint8_t *out, uint32_t len)
{
   uint32_t i;
   for (i = 0; i < len; i++) {
      out[i] = (uint8_t) (k * 131u + i * 7u);
   }
}

static uint32_t
sum_hits (void *ctx, uint64_t hash, uint32_t block_gen)
{
   uint32_t i, n = 0;
   (void) ctx;
   for (i = 0; i < READERS + 1; i++) {
      n += cqc_access_count (maps[i], map_mask, hash, block_gen);
   }
   return n;
}

/* Zipf-like: small ranks far more often, so some keys are hot. */
static uint32_t
pick (uint64_t *state)
{
   uint64_t x;
   *state = *state * 6364136223846793005ull + 1442695040888963407ull;
   x = *state >> 33;
   return (uint32_t) ((x % NKEYS) * (x % NKEYS) / NKEYS * ((x >> 20) % NKEYS) / NKEYS);
}

static void *
writer (void *arg)
{
   uint8_t val[1024];
   uint64_t rng = 7;
   uint32_t n = 0;
   (void) arg;
   while (!__atomic_load_n (&stop, __ATOMIC_RELAXED)) {
      uint32_t k = pick (&rng);
      const entry_t *e = &entries[k];
      cqc_token_t tok;

      cqc_arena_r_capture (&arena, ns_idx, CQC_NO_CELL, &tok);
      fill_value (k, val, e->val_len);
      (void) cqc_arena_w_admit (&arena, &tok, e->hash, e->key, e->key_len, val, e->val_len, 0);
      admitted++;
      if (++n % 64 == 0) {
         cqc_arena_w_progress (&arena, db_idx); /* stays healthy */
         /* The scribbler: random cells, some of them plausible. */
         maps[READERS][(uint32_t) (rng >> 40) & map_mask] = (uint32_t) rng;
      }
      if (n % 4096 == 0) {
         cqc_arena_w_invalidate_ns (&arena, ns_idx);
         invalidations++;
      }
   }
   return NULL;
}

typedef struct {
   uint8_t buf[1024];
   size_t len;
} copy_t;

static void *
alloc_copy (void *ctx, size_t len)
{
   copy_t *c = ctx;
   c->len = len;
   return len <= sizeof c->buf ? c->buf : NULL;
}

static void
discard_copy (void *ctx)
{
   ((copy_t *) ctx)->len = (size_t) -1;
}

static void *
reader (void *arg)
{
   int r = (int) (intptr_t) arg;
   uint64_t rng = 1000u + (uint64_t) r;
   uint8_t want[1024];
   copy_t cp;

   while (!__atomic_load_n (&stop, __ATOMIC_RELAXED)) {
      uint32_t k = pick (&rng);
      const entry_t *e = &entries[k];
      lookups[r]++;
      cp.len = 0;
      if (cqc_arena_r_lookup (&views[r], ns_idx, e->hash, e->key, e->key_len, alloc_copy,
                              discard_copy, &cp) == CQC_LOOKUP_HIT) {
         hits[r]++;
         fill_value (k, want, e->val_len);
         if (cp.len != e->val_len || memcmp (cp.buf, want, cp.len) != 0) {
            __atomic_fetch_add (&wrong[r], 1, __ATOMIC_RELAXED);
         }
      }
   }
   return NULL;
}

int
main (int argc, char **argv)
{
   double seconds = argc > 1 ? atof (argv[1]) : 3.0;
   /* 256 KiB of payload for ~1.2 MiB of values: the rings wrap constantly. */
   cqc_geometry_t geo = {.budget_bytes = 256 * 1024, .slot_count = 1024, .ns_count = 16,
                         .db_count = 4, .idgen_count = 64};
   uint64_t size = cqc_arena_required_bytes (&geo);
   uint8_t *mem = calloc (1, size);
   pthread_t w, rd[READERS];
   struct timespec t0;
   char err[256];
   uint32_t k, cells;
   uint64_t total_hits = 0, total_wrong = 0, total_lookups = 0;
   int i, rc = 0;

   if (!mem || !cqc_arena_format (&arena, mem, size, &geo, NULL, err, sizeof err) ||
       !cqc_arena_w_ns_register (&arena, "d", 1, "c", 1, &ns_idx, err, sizeof err) ||
       !cqc_arena_w_policy_init (&arena)) {
      fprintf (stderr, "race_evict_move: cannot set up an arena\n");
      return 2;
   }
   db_idx = arena.nss[ns_idx].db_idx;
   cqc_arena_w_set_health (&arena, db_idx, CQC_STREAM_HEALTHY);
   cells = cqc_access_cells (&arena.geo);
   map_mask = cells - 1u;
   for (i = 0; i < READERS + 1; i++) {
      maps[i] = calloc (cells, sizeof (uint32_t));
      if (!maps[i]) {
         return 2;
      }
   }
   arena.hits = sum_hits;
   for (i = 0; i < READERS; i++) {
      views[i] = arena;
      views[i].hits = NULL;
      views[i].ghost = NULL;
      views[i].access = maps[i];
      views[i].access_mask = map_mask;
   }
   for (k = 0; k < NKEYS; k++) {
      entry_t *e = &entries[k];
      e->key_len = (uint32_t) snprintf ((char *) e->key, sizeof e->key, "key-%u", k);
      e->hash = cqc_hash_bytes (e->key, e->key_len, 0);
      e->val_len = 64u + (k * 37u) % 900u;
   }
   clock_gettime (CLOCK_MONOTONIC, &t0);
   if (pthread_create (&w, NULL, writer, NULL) != 0) {
      return 2;
   }
   for (i = 0; i < READERS; i++) {
      if (pthread_create (&rd[i], NULL, reader, (void *) (intptr_t) i) != 0) {
         return 2;
      }
   }
   while (elapsed (&t0) < seconds) {
      struct timespec pause = {0, 10 * 1000 * 1000};
      nanosleep (&pause, NULL);
      if (__atomic_load_n (&wrong[0], __ATOMIC_RELAXED) ||
          __atomic_load_n (&wrong[1], __ATOMIC_RELAXED)) {
         break;
      }
   }
   __atomic_store_n (&stop, 1, __ATOMIC_RELAXED);
   pthread_join (w, NULL);
   for (i = 0; i < READERS; i++) {
      pthread_join (rd[i], NULL);
      total_hits += hits[i];
      total_wrong += wrong[i];
      total_lookups += lookups[i];
   }
   printf ("race_evict_move: %llu admissions, %llu invalidations, %llu promotions, "
           "%llu reinsertions, %llu forced, %llu lookups, %llu hits, %llu wrong hits\n",
           (unsigned long long) admitted, (unsigned long long) invalidations,
           (unsigned long long) arena.hdr->promotions,
           (unsigned long long) arena.hdr->reinsertions, (unsigned long long) arena.hdr->forced,
           (unsigned long long) total_lookups, (unsigned long long) total_hits,
           (unsigned long long) total_wrong);
   if (total_wrong) {
      rc = 1;
   } else if (!arena.hdr->promotions || !arena.hdr->reinsertions || !total_hits) {
      fprintf (stderr, "race_evict_move: no entry was moved, or nothing was hit: the race "
                       "did not happen\n");
      rc = 1;
   }
   cqc_arena_w_policy_free (&arena);
   for (i = 0; i < READERS + 1; i++) {
      free (maps[i]);
   }
   free (mem);
   return rc;
}
