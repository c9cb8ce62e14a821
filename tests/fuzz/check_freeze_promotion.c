/*
 * check_freeze_promotion.c - a follower's promotion racing the owner's
 * demotion after a freeze, both orders forced (issue 16).
 *
 *   check_freeze_promotion
 *
 * Not a fuzzer: a deterministic check on one arena, with stream.c's
 * become_healthy and owner.c's demote_after_freeze (static there, so this
 * file includes both). A follower that began catching up before the owner
 * was frozen must not promote its database after the owner demoted it on
 * waking: what it took for caught up predates the freeze. Orders checked:
 *   1. demotion, then the promotion: refused, the database stays
 *      RECONNECTING and the follower starts its catch-up over;
 *   2. promotion, then the demotion: RECONNECTING (the demotion wins);
 *   3. a catch-up begun after the demotion promotes.
 * Exits 0 when all hold, 1 otherwise. The follower's catch-up reads the
 * deployment's time from a server that refuses connections (it fails fast
 * and leaves no open time).
 */
#include "../../csrc/owner.c"
#include "../../csrc/stream.c"

#include <stdio.h>

static int failures;

#define CHECK(cond, what)                                                    \
   do {                                                                      \
      if (!(cond)) {                                                         \
         fprintf (stderr, "check_freeze_promotion: %s (%s)\n", what, #cond); \
         failures++;                                                         \
      }                                                                      \
   } while (0)

static uint32_t
health (const cqc_arena_t *a, uint32_t db_idx)
{
   return __atomic_load_n (&a->dbs[db_idx].health, __ATOMIC_ACQUIRE);
}

int
main (void)
{
   cqc_geometry_t geo = {.budget_bytes = 16384, .slot_count = 64, .ns_count = 16,
                         .db_count = 4, .idgen_count = 64};
   cqc_arena_owner_t who = {1000, 42, 500000000ull};
   uint64_t size = cqc_arena_required_bytes (&geo);
   uint8_t *mem = calloc (1, size);
   cqc_arena_t arena;
   pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
   cqc_stream_t s;
   cqc_owner_t o;
   follow_t f;
   mongoc_client_t *client;
   uint32_t ns_idx, db;
   char err[256];

   mongoc_init ();
   client = mongoc_client_new ("mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=100"
                               "&connectTimeoutMS=100");
   if (!mem || !client || !cqc_arena_format (&arena, mem, size, &geo, &who, err, sizeof err) ||
       !cqc_arena_w_ns_register (&arena, "d", 1, "c", 1, &ns_idx, err, sizeof err)) {
      fprintf (stderr, "check_freeze_promotion: cannot set up\n");
      return 2;
   }
   db = arena.nss[ns_idx].db_idx;
   memset (&s, 0, sizeof s);
   s.w.arena = &arena;
   s.w.lock = &lock;
   s.client = client;
   s.cap = s.n_dbs = 1;
   s.dbs = calloc (1, sizeof *s.dbs);
   if (!s.dbs) {
      return 2;
   }
   s.dbs[0].db_idx = db;
   pthread_mutex_init (&s.mu, NULL);
   pthread_cond_init (&s.cv, NULL);
   memset (&o, 0, sizeof o);
   o.w = s.w;

   /* 1. The follower began catching up (its freeze count noted), the owner
    * was frozen and demoted on waking, then the follower thinks it caught
    * up. */
   cqc_arena_w_set_health (&arena, db, CQC_STREAM_RECONNECTING);
   memset (&f, 0, sizeof f);
   f.lo = 0;
   f.hi = 1;
   f.backoff = 7;
   f.freezes = __atomic_load_n (&arena.hdr->freezes, __ATOMIC_ACQUIRE);
   f.caught_up = true;
   demote_after_freeze (&o);
   become_healthy (&s, &f);
   CHECK (!s.dbs[0].serving && !f.serving, "a promotion after a demotion it raced");
   CHECK (health (&arena, db) == CQC_STREAM_RECONNECTING, "the database serves again");
   CHECK (!f.caught_up && f.backoff == 7 && !s.dbs[0].ever_healthy,
          "the catch-up did not start over");
   CHECK (f.freezes == arena.hdr->freezes, "the new catch-up did not note the freeze");

   /* 3. That new catch-up, begun after the demotion, promotes. */
   f.caught_up = true;
   become_healthy (&s, &f);
   CHECK (s.dbs[0].serving && f.serving == 1, "a catch-up after the freeze refused");
   CHECK (health (&arena, db) == CQC_STREAM_HEALTHY && f.backoff == 0, "not healthy");

   /* 2. Promoted first, then demoted: the demotion stands. */
   demote_after_freeze (&o);
   CHECK (health (&arena, db) == CQC_STREAM_RECONNECTING, "a demotion after a promotion lost");

   printf ("check_freeze_promotion: %s\n", failures ? "FAILED" : "both orders hold");
   mongoc_client_destroy (client);
   mongoc_cleanup ();
   pthread_mutex_destroy (&s.mu);
   pthread_cond_destroy (&s.cv);
   free (s.dbs);
   free (mem);
   return failures ? 1 : 0;
}
