/*
 * floor.c - see floor.h.
 */
#include "floor.h"
#include "keys.h"

#include <stdlib.h>
#include <string.h>

bool
cqc_floor_init (cqc_floor_t *f, uint32_t db_count, uint32_t ns_count)
{
   *f = (cqc_floor_t){.db_count = db_count, .ns_count = ns_count};
   f->db = calloc (db_count ? db_count : 1, sizeof *f->db);
   f->db_max_ts = calloc (db_count ? db_count : 1, sizeof *f->db_max_ts);
   f->db_max_ns = calloc (db_count ? db_count : 1, sizeof *f->db_max_ns);
   f->held = calloc (db_count ? db_count : 1, sizeof *f->held);
   f->ns = calloc (ns_count ? ns_count : 1, sizeof *f->ns);
   f->ns_ids = calloc (ns_count ? ns_count : 1, sizeof *f->ns_ids);
   f->ns_db = calloc (ns_count ? ns_count : 1, sizeof *f->ns_db);
   f->cells = calloc (CQC_SEEN_BUCKETS * CQC_SEEN_WAYS, sizeof *f->cells);
   if (!f->db || !f->db_max_ts || !f->db_max_ns || !f->held || !f->ns || !f->ns_ids ||
       !f->ns_db || !f->cells) {
      cqc_floor_free (f);
      return false;
   }
   return true;
}

void
cqc_floor_free (cqc_floor_t *f)
{
   free (f->db);
   free (f->db_max_ts);
   free (f->db_max_ns);
   free (f->held);
   free (f->ns);
   free (f->ns_ids);
   free (f->ns_db);
   free (f->cells);
   *f = (cqc_floor_t){0};
}

void
cqc_floor_hold (cqc_floor_t *f, uint32_t db_idx, bool held)
{
   if (db_idx < f->db_count) {
      f->held[db_idx] = held ? 1 : 0;
   }
}

/* ======================================================================== */
/* One scope's observations                                                 */
/* ======================================================================== */

static inline uint64_t
max64 (uint64_t a, uint64_t b)
{
   return a > b ? a : b;
}

static void
seen_add_result (cqc_seen_t *s, uint64_t ts, uint64_t ns, uint64_t read_id, uint64_t key_hash,
                 uint64_t value_hash)
{
   if (read_id && s->read_id == read_id) {
      s->top_ns = max64 (s->top_ns, ns); /* another batch of the same read */
      s->top_ts = max64 (s->top_ts, ts);
      s->key_hash = s->value_hash = 0; /* no longer one result */
   } else if (value_hash && s->value_hash == value_hash && s->key_hash == key_hash) {
      /* The same result of the same key again (a hit of it, another read of
       * it): (d) treats every read of it alike, so it stays the latest. */
      s->top_ns = max64 (s->top_ns, ns);
      s->top_ts = max64 (s->top_ts, ts);
      s->read_id = read_id;
   } else if (ns >= s->top_ns) {
      s->rest_ns = max64 (s->rest_ns, s->top_ns); /* a newer read: the latest */
      s->rest_ts = max64 (s->rest_ts, s->top_ts);
      s->read_id = read_id;
      s->top_ns = ns;
      s->top_ts = ts;
      s->key_hash = key_hash;
      s->value_hash = value_hash;
   } else {
      s->rest_ns = max64 (s->rest_ns, ns); /* an older one */
      s->rest_ts = max64 (s->rest_ts, ts);
   }
}

static void
seen_add (cqc_seen_t *s, uint64_t ts, uint64_t ns, uint64_t read_id)
{
   seen_add_result (s, ts, ns, read_id, 0, 0);
}

uint64_t
cqc_floor_result_hash (const uint8_t *value, size_t len, bool not_found)
{
   return not_found ? 0x6e6f6e65ull : cqc_hash_bytes (value, len, 0x72657375ull) | 2u;
}

static void
seen_merge (cqc_seen_t *into, const cqc_seen_t *s)
{
   seen_add (into, s->top_ts, s->top_ns, s->read_id);
   seen_add (into, s->rest_ts, s->rest_ns, 0);
}

/* Whether observations bounded by (ts, ns) are covered for an entry read as
 * `stamp` (NULL: for any entry): floor.h's (a), (b) and (c). */
static bool
covered (const cqc_floor_t *f, const cqc_covered_t *cov, uint64_t ts, uint64_t ns,
         const cqc_stamp_t *stamp)
{
   if (!ts && !ns) {
      return true; /* nothing observed */
   }
   if (ts && cov->applied >= ts) {
      return true;
   }
   if (!f->ordered || !ns) {
      return false;
   }
   return cov->quiet >= ns ||
          (stamp && (stamp->flags & CQC_STAMP_ORDERED) && stamp->start_ns >= ns);
}

/* Whether an entry read as `stamp` reflects every observation of `s`,
 * dropping those the stream covers for every entry. */
static bool
seen_allows (const cqc_floor_t *f, cqc_seen_t *s, const cqc_stamp_t *stamp,
             const cqc_covered_t *cov, cqc_found_t *found)
{
   uint64_t ns = max64 (s->top_ns, s->rest_ns), ts = max64 (s->top_ts, s->rest_ts);

   if (covered (f, cov, ts, ns, NULL)) {
      *s = (cqc_seen_t){0};
      return true;
   }
   if (covered (f, cov, s->rest_ts, s->rest_ns, stamp)) {
      /* (d): the latest read is the entry's own, or returned its bytes */
      if (stamp->read_id && s->read_id == stamp->read_id) {
         return true;
      }
      if (s->value_hash && found && s->key_hash == found->key_hash) {
         if (!found->value_hash) {
            found->value_hash = cqc_floor_result_hash (found->value, found->len, found->not_found);
         }
         if (found->value_hash == s->value_hash) {
            return true;
         }
      }
   }
   return covered (f, cov, ts, ns, stamp);
}

/* ======================================================================== */
/* Identities                                                               */
/* ======================================================================== */

static cqc_cell_seen_t *
cell_bucket (cqc_floor_t *f, uint32_t ns_idx, uint64_t id_hash)
{
   uint64_t h = (id_hash ^ ((uint64_t) ns_idx * 0xc2b2ae3d27d4eb4full)) * 0x9e3779b97f4a7c15ull;

   return &f->cells[(h >> 40) % CQC_SEEN_BUCKETS * CQC_SEEN_WAYS];
}

static cqc_cell_seen_t *
cell_find (cqc_floor_t *f, uint32_t ns_idx, uint64_t id_hash)
{
   cqc_cell_seen_t *b = cell_bucket (f, ns_idx, id_hash);
   uint32_t w;

   for (w = 0; w < CQC_SEEN_WAYS; w++) {
      if (b[w].used && b[w].ns_idx == ns_idx && b[w].id_hash == id_hash) {
         return &b[w];
      }
   }
   return NULL;
}

/* The identity's record, made if needed. A full bucket gives up a way: one
 * the stream has covered, else the next in turn, whose observations then
 * bind its whole namespace (never fewer entries than before). */
static cqc_cell_seen_t *
cell_make (cqc_floor_t *f, const cqc_arena_t *a, uint32_t ns_idx, uint64_t id_hash)
{
   cqc_cell_seen_t *b = cell_bucket (f, ns_idx, id_hash), *slot;
   cqc_covered_t cov;
   uint32_t w;

   if ((slot = cell_find (f, ns_idx, id_hash))) {
      return slot;
   }
   for (w = 0; w < CQC_SEEN_WAYS; w++) {
      if (!b[w].used) {
         goto found;
      }
   }
   for (w = 0; w < CQC_SEEN_WAYS; w++) {
      const cqc_seen_t *s = &b[w].seen;
      uint32_t db = f->ns_db[b[w].ns_idx] - 1;

      cqc_floor_covered (a, db, &cov);
      if (db < f->db_count &&
          covered (f, &cov, max64 (s->top_ts, s->rest_ts), max64 (s->top_ns, s->rest_ns), NULL)) {
         goto found;
      }
   }
   w = f->cell_next++ % CQC_SEEN_WAYS;
   seen_merge (&f->ns[b[w].ns_idx], &b[w].seen);
found:
   b[w] = (cqc_cell_seen_t){.ns_idx = ns_idx, .id_hash = id_hash, .used = 1};
   return &b[w];
}

/* The _id of an identity entry, from its key's filter: false when it is not
 * one (or no longer parses as one: then the namespace's identity
 * observations, a superset, bind it). */
static bool
found_id (cqc_found_t *found)
{
   uint32_t flen;

   if (!found->identity) {
      return false;
   }
   if (!found->id_known) {
      found->id_known = true;
      if (found->key_len < CQC_KEY_FIXED) {
         found->identity = false;
         return false;
      }
      memcpy (&flen, found->key + 5, 4);
      if (flen > found->key_len - CQC_KEY_FIXED ||
          !cqc_filter_identity (found->key + CQC_KEY_FIXED, flen, &found->id_hash)) {
         found->identity = false;
      }
   }
   return found->identity;
}

/* ======================================================================== */
/* Observations and the check                                               */
/* ======================================================================== */

void
cqc_floor_observe (cqc_floor_t *f, const cqc_arena_t *a, int scope, uint32_t db_idx,
                   uint32_t ns_idx, uint64_t id_hash, uint64_t ts, uint64_t ns, uint64_t read_id)
{
   cqc_floor_observe_result (f, a, scope, db_idx, ns_idx, id_hash, ts, ns, read_id, 0, 0);
}

void
cqc_floor_observe_result (cqc_floor_t *f, const cqc_arena_t *a, int scope, uint32_t db_idx,
                          uint32_t ns_idx, uint64_t id_hash, uint64_t ts, uint64_t ns,
                          uint64_t read_id, uint64_t key_hash, uint64_t value_hash)
{
   if (db_idx >= f->db_count) {
      return;
   }
   f->db_max_ts[db_idx] = max64 (f->db_max_ts[db_idx], ts);
   f->db_max_ns[db_idx] = max64 (f->db_max_ns[db_idx], ns);
   if (scope != CQC_SCOPE_DB && ns_idx < f->ns_count) {
      f->ns_db[ns_idx] = db_idx + 1;
      if (scope == CQC_SCOPE_CELL) {
         seen_add_result (&cell_make (f, a, ns_idx, id_hash)->seen, ts, ns, read_id, key_hash,
                          value_hash);
         seen_add (&f->ns_ids[ns_idx], ts, ns, read_id);
      } else {
         seen_add_result (&f->ns[ns_idx], ts, ns, read_id, key_hash, value_hash);
      }
      return;
   }
   seen_add (&f->db[db_idx], ts, ns, read_id);
}

void
cqc_floor_covered (const cqc_arena_t *a, uint32_t db_idx, cqc_covered_t *cov)
{
   cov->applied = cqc_arena_r_applied (a, db_idx);
   cov->quiet = cqc_arena_r_quiet (a, db_idx);
}

bool
cqc_floor_covers (const cqc_floor_t *f, const cqc_covered_t *cov, uint64_t ts, uint64_t ns)
{
   return covered (f, cov, ts, ns, NULL);
}

bool
cqc_floor_allows (cqc_floor_t *f, uint32_t db_idx, uint32_t ns_idx, const cqc_stamp_t *stamp,
                  const cqc_covered_t *cov, cqc_found_t *found)
{
   if (db_idx >= f->db_count || ns_idx >= f->ns_count || f->held[db_idx]) {
      return false;
   }
   /* The steady state: the stream has passed every observation of the
    * database, whatever its scope (one load of each bound). */
   if (covered (f, cov, f->db_max_ts[db_idx], f->db_max_ns[db_idx], NULL)) {
      return true;
   }
   if (!seen_allows (f, &f->db[db_idx], stamp, cov, NULL) ||
       !seen_allows (f, &f->ns[ns_idx], stamp, cov, found)) {
      return false;
   }
   if (!found_id (found)) {
      return seen_allows (f, &f->ns_ids[ns_idx], stamp, cov, NULL);
   }
   cqc_cell_seen_t *c = cell_find (f, ns_idx, found->id_hash);
   if (c && !seen_allows (f, &c->seen, stamp, cov, found)) {
      return false;
   }
   if (c && !c->seen.top_ns && !c->seen.top_ts && !c->seen.rest_ns && !c->seen.rest_ts) {
      c->used = 0; /* covered for good */
   }
   return true;
}

void
cqc_floor_served (cqc_floor_t *f, const cqc_arena_t *a, uint32_t db_idx, uint32_t ns_idx,
                  const cqc_stamp_t *stamp, const cqc_covered_t *cov, cqc_found_t *found)
{
   bool identity;

   if (covered (f, cov, stamp->end_ts, stamp->end_ns, NULL)) {
      return; /* what it read, the stream has applied (or it has no stamp) */
   }
   if (!found->value_hash) {
      found->value_hash = cqc_floor_result_hash (found->value, found->len, found->not_found);
   }
   identity = found_id (found);
   cqc_floor_observe_result (f, a, identity ? CQC_SCOPE_CELL : CQC_SCOPE_NS, db_idx, ns_idx,
                             identity ? found->id_hash : 0, stamp->end_ts ? stamp->end_ts : 1,
                             stamp->end_ns, stamp->read_id, found->key_hash, found->value_hash);
}

void
cqc_floor_own_write (cqc_floor_t *f, uint32_t db_idx, uint32_t ns_idx, bool has_id,
                     uint64_t id_hash, uint64_t ts, uint64_t ns)
{
   if (db_idx >= f->db_count || ns_idx >= f->ns_count) {
      return;
   }
   f->own[f->own_next++ % CQC_OWN_WRITES] = (cqc_own_write_t){
      .ns_idx = ns_idx,
      .used = 1,
      .has_id = has_id ? 1 : 0,
      .db_idx = db_idx,
      .id_hash = has_id ? id_hash : 0,
      .ts = ts,
      .ns = ns,
   };
}

bool
cqc_floor_superseded (cqc_floor_t *f, uint32_t ns_idx, const cqc_stamp_t *stamp,
                      const cqc_covered_t *cov, cqc_found_t *found)
{
   uint32_t i;
   bool identity = found_id (found);

   for (i = 0; i < CQC_OWN_WRITES; i++) {
      cqc_own_write_t *w = &f->own[i];

      if (!w->used || w->ns_idx != ns_idx) {
         continue;
      }
      if (covered (f, cov, w->ts, w->ns, NULL)) {
         w->used = 0; /* the stream has applied it: the entry is current */
         continue;
      }
      if (stamp->start_ns < w->ns &&
          (!identity || (w->has_id && w->id_hash == found->id_hash))) {
         return true;
      }
   }
   return false;
}
