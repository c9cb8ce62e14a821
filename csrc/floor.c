/*
 * floor.c - see floor.h.
 */
#include "floor.h"
#include "keys.h"

#include <stdlib.h>
#include <string.h>

bool
cqc_floor_init (cqc_floor_t *f, uint32_t db_count)
{
   *f = (cqc_floor_t){.db_count = db_count};
   f->ts = calloc (db_count ? db_count : 1, sizeof *f->ts);
   f->ns = calloc (db_count ? db_count : 1, sizeof *f->ns);
   f->epoch = calloc (db_count ? db_count : 1, sizeof *f->epoch);
   f->held = calloc (db_count ? db_count : 1, sizeof *f->held);
   f->memo = calloc (CQC_MEMO_BUCKETS * CQC_MEMO_WAYS, sizeof *f->memo);
   if (!f->ts || !f->ns || !f->epoch || !f->held || !f->memo) {
      cqc_floor_free (f);
      return false;
   }
   return true;
}

void
cqc_floor_free (cqc_floor_t *f)
{
   free (f->ts);
   free (f->ns);
   free (f->epoch);
   free (f->held);
   free (f->memo);
   f->ts = f->ns = f->epoch = NULL;
   f->held = NULL;
   f->memo = NULL;
   f->db_count = 0;
}

void
cqc_floor_observe (cqc_floor_t *f, uint32_t db_idx, uint64_t ts, uint64_t ns,
                   uint64_t epoch)
{
   if (db_idx >= f->db_count) {
      return;
   }
   if (ts > f->ts[db_idx]) {
      f->ts[db_idx] = ts;
   }
   if (ns > f->ns[db_idx]) {
      f->ns[db_idx] = ns;
   }
   if (epoch > f->epoch[db_idx]) {
      f->epoch[db_idx] = epoch;
   }
}

void
cqc_floor_hold (cqc_floor_t *f, uint32_t db_idx, bool held)
{
   if (db_idx < f->db_count) {
      f->held[db_idx] = held ? 1 : 0;
   }
}

/* ======================================================================== */
/* Own misses                                                               */
/* ======================================================================== */

static bool
memo_current (const cqc_floor_t *f, const cqc_memo_t *m)
{
   return m->used && m->db_idx < f->db_count && m->floor_ts == f->ts[m->db_idx] &&
          m->epoch == f->epoch[m->db_idx];
}

static bool
memo_allows (const cqc_floor_t *f, uint32_t db_idx, uint64_t hash, uint64_t *value)
{
   const cqc_memo_t *bucket = &f->memo[(hash % CQC_MEMO_BUCKETS) * CQC_MEMO_WAYS];
   uint32_t w;

   for (w = 0; w < CQC_MEMO_WAYS; w++) {
      if (bucket[w].hash == hash && bucket[w].db_idx == db_idx && memo_current (f, &bucket[w])) {
         *value = bucket[w].value;
         return true;
      }
   }
   return false;
}

/* The high and low halves of a * b, folded. */
static inline uint64_t
mum (uint64_t a, uint64_t b)
{
   __uint128_t r = (__uint128_t) a * b;
   return (uint64_t) r ^ (uint64_t) (r >> 64);
}

/* A fingerprint of a value's bytes. It runs on every hit the memo serves
 * (cqc_cache_lookup, lookup_own), so 64-byte blocks go through four
 * independent lanes of one 64x64->128-bit multiply per 16 bytes, which the
 * CPU overlaps: about a fifth of one-lane cqc_hash_bytes's time on a 4 KiB
 * document. Process-private (floor.h), never stored in the arena. */
uint64_t
cqc_floor_value_hash (const uint8_t *value, size_t len, bool not_found)
{
   static const uint64_t k[4] = {0xa0761d6478bd642full, 0xe7037ed1a0b428dbull,
                                 0x8ebc6af09c88c6e3ull, 0x589965cc75374cc3ull};
   uint64_t lane[4] = {k[1], k[2], k[3], k[0]};
   uint64_t w[8];
   int i;

   if (not_found) {
      return 0;
   }
   for (; len >= sizeof w; value += sizeof w, len -= sizeof w) {
      memcpy (w, value, sizeof w);
      for (i = 0; i < 4; i++) {
         lane[i] += mum (w[2 * i] ^ lane[i], w[2 * i + 1] ^ k[i]);
      }
   }
   return cqc_hash_bytes (lane, sizeof lane, cqc_hash_bytes (value, len, 0x6d656d6fu)) | 1u;
}

void
cqc_floor_memo (cqc_floor_t *f, uint32_t db_idx, uint64_t key_hash, uint64_t floor_ts,
                uint64_t epoch, uint64_t value)
{
   cqc_memo_t *bucket, *slot = NULL;
   uint32_t w;

   if (!floor_ts || db_idx >= f->db_count) {
      return;
   }
   bucket = &f->memo[(key_hash % CQC_MEMO_BUCKETS) * CQC_MEMO_WAYS];
   for (w = 0; w < CQC_MEMO_WAYS && !slot; w++) {
      if (bucket[w].hash == key_hash && bucket[w].db_idx == db_idx) {
         slot = &bucket[w]; /* the same key again */
      }
   }
   for (w = 0; w < CQC_MEMO_WAYS && !slot; w++) {
      if (!memo_current (f, &bucket[w])) {
         slot = &bucket[w];
      }
   }
   if (!slot) {
      slot = &bucket[f->memo_next++ % CQC_MEMO_WAYS];
   }
   *slot = (cqc_memo_t){key_hash, floor_ts, epoch, value, db_idx, 1};
}

/* ======================================================================== */
/* One-document writes                                                      */
/* ======================================================================== */

static bool
pending_applied (const cqc_pending_t *p, uint64_t applied, uint64_t quiet)
{
   return applied >= p->ts || (p->quiet && quiet >= p->quiet);
}

bool
cqc_floor_observe_id (cqc_floor_t *f, const cqc_arena_t *a, uint32_t db_idx, uint32_t ns_idx,
                      const uint8_t *filter, uint32_t flen, uint64_t ts, uint64_t ns)
{
   uint64_t id_hash;
   uint32_t i;

   if (db_idx >= f->db_count || !cqc_filter_identity (filter, flen, &id_hash)) {
      return false;
   }
   for (i = 0; i < CQC_PENDING_MAX; i++) {
      cqc_pending_t *p = &f->pending[i];
      if (p->used && pending_applied (p, cqc_arena_r_applied (a, p->db_idx),
                                      cqc_arena_r_quiet (a, p->db_idx))) {
         p->used = 0;
         f->pending_used--;
      }
      if (!p->used) {
         *p = (cqc_pending_t){ts, ns, db_idx, ns_idx,
                              cqc_id_cell (id_hash, ns_idx, a->geo.idgen_count), 1};
         f->pending_used++;
         return true;
      }
   }
   return false;
}

/* Whether a pending write may make the entry of this lookup (namespace,
 * filter) older than what the process wrote. Frees the pending writes of
 * the database that the stream has applied. */
static bool
pending_blocks (cqc_floor_t *f, const cqc_arena_t *a, uint32_t ns_idx, uint32_t db_idx,
                const uint8_t *filter, uint32_t flen)
{
   uint64_t applied = 0, quiet = 0, id_hash;
   bool loaded = false, classified = false, identity = false;
   uint32_t cell = CQC_NO_CELL, i;

   for (i = 0; i < CQC_PENDING_MAX && f->pending_used; i++) {
      cqc_pending_t *p = &f->pending[i];
      if (!p->used || p->db_idx != db_idx) {
         continue;
      }
      if (!loaded) {
         applied = cqc_arena_r_applied (a, db_idx);
         quiet = cqc_arena_r_quiet (a, db_idx);
         loaded = true;
      }
      if (pending_applied (p, applied, quiet)) {
         p->used = 0; /* the entries reflect it */
         f->pending_used--;
         continue;
      }
      if (p->ns_idx != ns_idx) {
         continue;
      }
      if (!classified) {
         identity = cqc_filter_identity (filter, flen, &id_hash);
         if (identity) {
            cell = cqc_id_cell (id_hash, ns_idx, a->geo.idgen_count);
         }
         classified = true;
      }
      if (!identity || cell == p->cell) {
         return true;
      }
   }
   return false;
}

/* ======================================================================== */
/* The check                                                                */
/* ======================================================================== */

int
cqc_floor_behind (cqc_floor_t *f, const cqc_arena_t *a, uint32_t ns_idx, uint32_t db_idx,
                  uint64_t key_hash, const uint8_t *filter, uint32_t flen, uint64_t *value)
{
   int verdict = CQC_FLOOR_SERVE;

   if (db_idx >= f->db_count || f->held[db_idx]) {
      return CQC_FLOOR_BEHIND;
   }
   if (cqc_arena_r_applied (a, db_idx) < f->ts[db_idx] &&
       (!f->ns[db_idx] || cqc_arena_r_quiet (a, db_idx) < f->ns[db_idx])) {
      if (!memo_allows (f, db_idx, key_hash, value)) {
         return CQC_FLOOR_BEHIND;
      }
      verdict = CQC_FLOOR_IF_OWN;
   }
   if (f->pending_used && pending_blocks (f, a, ns_idx, db_idx, filter, flen)) {
      return CQC_FLOOR_BEHIND;
   }
   return verdict;
}
