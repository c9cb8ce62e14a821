/*
 * race_slot_seq.c - the writer shifting slots back (slot_remove_w) while a
 * reader watches them: a slot's seq is written only by slot_begin_w and
 * slot_end_w (arena.h), so every reader sees each slot's seq only grow, and
 * no copy it validates is torn.
 *
 *   race_slot_seq [SECONDS]     (default 3)
 *
 * Not a libFuzzer target: two threads on one arena. The writer keeps four
 * entries whose keys share a home slot and admits them again in turn; each
 * admission removes the key's entry (shifting the entries behind it back one
 * slot) and appends it at the end of the chain. The reader spins over those
 * slots: it checks that no slot's seq ever goes back, validates copies the
 * way cqc_arena_r_lookup does and checks that each validated live copy is
 * one entry (hash, key and value lengths all of the same key), and looks the
 * keys up, checking every hit's bytes.
 *
 * It is built at -O0 (.ci/fuzz): a writer that copies a whole slot over the
 * hole and restores seq afterwards passes at -O1 and above, where GCC
 * happens to trim the copy of seq, and fails here within a fraction of a
 * second. Exits 0 when the reader saw nothing wrong, 1 otherwise.
 */
#include "arena.h"
#include "keys.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NKEYS 4
#define HOME 5u

typedef struct {
   uint8_t key[32];
   uint32_t key_len;
   uint8_t val[64];
   uint32_t val_len;
   uint64_t hash;
} entry_t;

static cqc_arena_t arena;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static entry_t entries[NKEYS];
static uint32_t ns_idx;
static int stop;
static uint64_t admitted;

static double
elapsed (const struct timespec *t0)
{
   struct timespec now;
   clock_gettime (CLOCK_MONOTONIC, &now);
   return (double) (now.tv_sec - t0->tv_sec) + (double) (now.tv_nsec - t0->tv_nsec) / 1e9;
}

static void
admit (uint32_t k)
{
   cqc_token_t tok;
   const entry_t *e = &entries[k];
   cqc_admit_t r;

   pthread_mutex_lock (&lock);
   cqc_arena_r_capture (&arena, ns_idx, CQC_NO_CELL, &tok);
   r = cqc_arena_w_admit (&arena, &tok, e->hash, e->key, e->key_len, e->val, e->val_len, 0);
   if (r != CQC_ADMIT_OK) {
      fprintf (stderr, "race_slot_seq: admission refused (%d)\n", (int) r);
      exit (2);
   }
   admitted++;
   pthread_mutex_unlock (&lock);
}

static void *
writer (void *arg)
{
   uint32_t k = 0;
   (void) arg;
   while (!__atomic_load_n (&stop, __ATOMIC_RELAXED)) {
      admit (k);
      k = (k + 1) % NKEYS;
      if (k == 0) {
         pthread_mutex_lock (&lock);
         cqc_arena_w_progress (&arena, arena.nss[ns_idx].db_idx); /* stays healthy */
         pthread_mutex_unlock (&lock);
      }
   }
   return NULL;
}

typedef struct {
   uint8_t buf[64];
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

int
main (int argc, char **argv)
{
   double seconds = argc > 1 ? atof (argv[1]) : 3.0;
   cqc_geometry_t geo = {.budget_bytes = 16384, .slot_count = 64, .ns_count = 16,
                         .db_count = 4, .idgen_count = 64};
   uint32_t last[NKEYS + 1] = {0};
   uint64_t reads = 0, validated = 0, hits = 0, backwards = 0, torn = 0, wrong = 0;
   struct timespec t0;
   char err[256];
   uint64_t size = cqc_arena_required_bytes (&geo);
   uint8_t *mem = calloc (1, size);
   pthread_t t;
   uint32_t k;

   if (!mem || !cqc_arena_format (&arena, mem, size, &geo, NULL, err, sizeof err) ||
       !cqc_arena_w_ns_register (&arena, "d", 1, "c", 1, &ns_idx, err, sizeof err)) {
      fprintf (stderr, "race_slot_seq: cannot set up an arena\n");
      return 2;
   }
   cqc_arena_w_set_health (&arena, arena.nss[ns_idx].db_idx, CQC_STREAM_HEALTHY);
   for (k = 0; k < NKEYS; k++) {
      entry_t *e = &entries[k];
      e->key_len = 8 + 4 * k; /* every field of a slot tells the keys apart */
      memset (e->key, 'a' + (int) k, e->key_len);
      e->val_len = 16 + 8 * k;
      memset (e->val, 'A' + (int) k, e->val_len);
      e->hash = ((uint64_t) (k + 1) << 40) | HOME; /* one home slot */
      admit (k);
   }
   if (pthread_create (&t, NULL, writer, NULL) != 0) {
      fprintf (stderr, "race_slot_seq: cannot start a thread\n");
      return 2;
   }
   clock_gettime (CLOCK_MONOTONIC, &t0);
   do {
      int n;
      for (n = 0; n < 10000; n++) {
         uint32_t i = HOME + (uint32_t) n % (NKEYS + 1);
         const cqc_slot_t *s = &arena.slots[i];
         uint32_t seq1 = __atomic_load_n (&s->seq, __ATOMIC_ACQUIRE), seq2;
         cqc_slot_t c;
         copy_t cp;

         reads++;
         if ((int32_t) (seq1 - last[i - HOME]) < 0) {
            backwards++;
         }
         last[i - HOME] = seq1;
         if (!(seq1 & 1u)) {
            memcpy (&c, s, sizeof c);
            __atomic_thread_fence (__ATOMIC_ACQUIRE);
            seq2 = __atomic_load_n (&s->seq, __ATOMIC_RELAXED);
            if (seq2 == seq1 && c.state) {
               bool one = false;
               validated++;
               for (k = 0; k < NKEYS; k++) {
                  one |= c.hash == entries[k].hash && c.key_len == entries[k].key_len &&
                         c.val_len == entries[k].val_len;
               }
               torn += !one;
            }
         }
         k = (uint32_t) n % NKEYS;
         cp.len = 0;
         if (cqc_arena_r_lookup (&arena, ns_idx, entries[k].hash, entries[k].key,
                                 entries[k].key_len, alloc_copy, discard_copy,
                                 &cp) == CQC_LOOKUP_HIT) {
            hits++;
            wrong += cp.len != entries[k].val_len || memcmp (cp.buf, entries[k].val, cp.len);
         }
      }
   } while (elapsed (&t0) < seconds && !backwards && !torn && !wrong);
   __atomic_store_n (&stop, 1, __ATOMIC_RELAXED);
   pthread_join (t, NULL);
   printf ("race_slot_seq: %llu admissions, %llu slot reads, %llu validated, %llu hits; "
           "%llu seq went back, %llu torn copies validated, %llu wrong hits\n",
           (unsigned long long) admitted, (unsigned long long) reads,
           (unsigned long long) validated, (unsigned long long) hits,
           (unsigned long long) backwards, (unsigned long long) torn, (unsigned long long) wrong);
   free (mem);
   return backwards || torn || wrong ? 1 : 0;
}
