/*
 * race_ring_capacity.c - a worker changing its ring's header while the owner
 * drains it: the consumer must use the values it checked.
 *
 *   race_ring_capacity [SECONDS]     (default 3)
 *
 * Not a libFuzzer target: two threads. One flips the header's capacity
 * between a valid value and 2^40 as fast as it can; the other publishes one
 * record far into the counter space (tail = 2^30) and drains, over and
 * over. A consumer that checks h->capacity but computes positions from an
 * earlier read of it reads 1 GiB past the segment within a fraction of a
 * second (ASan reports it, or the process faults); .ci/fuzz runs this for
 * a few seconds. Exits 0 when no drain went out of bounds.
 */
#include "ring.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define SEG (CQC_RING_DATA_OFF + 8192u)

static uint8_t *mem;
static int stop;

static void *
flip_capacity (void *arg)
{
   cqc_ring_header_t *h = (cqc_ring_header_t *) mem;
   (void) arg;
   while (!__atomic_load_n (&stop, __ATOMIC_RELAXED)) {
      __atomic_store_n (&h->capacity, 1ull << 40, __ATOMIC_RELAXED);
      __atomic_store_n (&h->capacity, (uint64_t) SEG - CQC_RING_DATA_OFF, __ATOMIC_RELAXED);
   }
   return NULL;
}

static void
ignore (void *ctx, const cqc_ring_record_t *rec)
{
   (void) ctx;
   (void) rec;
}

int
main (int argc, char **argv)
{
   double seconds = argc > 1 ? atof (argv[1]) : 3.0;
   cqc_ring_header_t *h;
   pthread_t t;
   uint64_t drains = 0, malformed;
   cqc_ring_producer_t prod;
   struct timespec t0, now;

   mem = calloc (1, SEG);
   if (!mem || !cqc_ring_format (&prod, mem, SEG, 1)) {
      fprintf (stderr, "race_ring_capacity: cannot format a ring\n");
      return 2;
   }
   h = (cqc_ring_header_t *) mem;
   if (pthread_create (&t, NULL, flip_capacity, NULL) != 0) {
      fprintf (stderr, "race_ring_capacity: cannot start a thread\n");
      return 2;
   }
   clock_gettime (CLOCK_MONOTONIC, &t0);
   do {
      int k;
      for (k = 0; k < 100000; k++) {
         __atomic_store_n (&h->tail, 1ull << 30, __ATOMIC_RELAXED);
         __atomic_store_n (&h->head, (1ull << 30) + 64u, __ATOMIC_RELEASE);
         cqc_ring_drain (mem, SEG, ignore, NULL);
      }
      drains += 100000;
      clock_gettime (CLOCK_MONOTONIC, &now);
   } while ((double) (now.tv_sec - t0.tv_sec) + (double) (now.tv_nsec - t0.tv_nsec) / 1e9 <
            seconds);
   __atomic_store_n (&stop, 1, __ATOMIC_RELAXED);
   pthread_join (t, NULL);
   malformed = h->malformed;
   printf ("race_ring_capacity: %llu drains, %llu malformed, none out of bounds\n",
           (unsigned long long) drains, (unsigned long long) malformed);
   free (mem);
   return 0;
}
