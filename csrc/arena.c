/*
 * arena.c - see arena.h for the layout and the rules.
 */
#include "arena.h"
#include "keys.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LOAD(p) __atomic_load_n ((p), __ATOMIC_ACQUIRE)
#define LOAD_RELAXED(p) __atomic_load_n ((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n ((p), (v), __ATOMIC_RELEASE)
/* For fields readers load atomically but whose order nothing depends on:
 * a plain store of them would be a data race, and a compiler may tear it. */
#define STORE_RELAXED(p, v) __atomic_store_n ((p), (v), __ATOMIC_RELAXED)
#define FENCE_ACQ() __atomic_thread_fence (__ATOMIC_ACQUIRE)
#define FENCE_REL() __atomic_thread_fence (__ATOMIC_RELEASE)

#define BLOCK_MAGIC 0x4b4c4243u /* "CBLK" */
#define BLOCK_PAD 0x44415043u   /* "CPAD": rest of the ring is padding */

/* Block header at the start of every ring block. */
typedef struct {
   uint32_t magic;
   uint32_t gen;
   uint32_t len;  /* whole block, header included, multiple of 8 */
   uint32_t slot; /* slot index that references it (writer bookkeeping) */
   cqc_stamp_t stamp; /* of the read that admitted it (arena.h) */
   uint64_t sum;  /* entry_sum () of the entry, its stamp included: a reader
                   * serves a copy only if it matches, so bytes changed in
                   * shared memory by anything but the writer are never
                   * returned */
} block_hdr_t;

_Static_assert (sizeof (block_hdr_t) == CQC_BLOCK_HEADER, "CQC_BLOCK_HEADER is the block header");
_Static_assert (offsetof (block_hdr_t, magic) == 0 && offsetof (block_hdr_t, gen) == 4 &&
                   offsetof (block_hdr_t, len) == 8 && offsetof (block_hdr_t, slot) == 12 &&
                   offsetof (block_hdr_t, stamp) == 16 && offsetof (block_hdr_t, sum) == 56,
                "block_hdr_t layout");

/* Checksum of an entry as a reader returns it: its value bytes and length,
 * the key's length and the flags that change what a hit means ("not
 * found", conflict marker). Fletcher's two running sums over 64-bit words
 * (one add each per 8 bytes: a hit pays about 50 ns per KiB), mixed at the
 * end. It catches corrupted, moved or truncated bytes, not a forger who can
 * write the arena and its sums anyway. */
static uint64_t
entry_sum (uint16_t flags, uint32_t key_len, const void *val, uint32_t val_len,
           const cqc_stamp_t *stamp)
{
   const uint8_t *p = val;
   uint64_t a = 0x656e747279ull ^ ((uint64_t) (flags & (CQC_ENTRY_NOT_FOUND | CQC_ENTRY_CONFLICT)) << 32) ^ key_len;
   uint64_t b = val_len, w, pair[2];
   uint32_t n = val_len;
   const uint64_t stamp_words[5] = {stamp->start_ns, stamp->end_ns, stamp->end_ts, stamp->read_id,
                                    stamp->flags};
   int i;

   for (i = 0; i < 5; i++) { /* the stamp first, as five more words */
      a += stamp_words[i];
      b += a;
   }

   for (; n >= 8; n -= 8, p += 8) {
      memcpy (&w, p, 8);
      a += w;
      b += a;
   }
   w = 0;
   memcpy (&w, p, n);
   a += w ^ ((uint64_t) n << 56);
   b += a;
   pair[0] = a;
   pair[1] = b;
   return cqc_hash_bytes (pair, sizeof pair, 0x73756dull);
}

static uint64_t
align_up (uint64_t v, uint64_t a)
{
   return (v + a - 1) & ~(a - 1);
}

static uint32_t
pow2_at_least (uint32_t v, uint32_t min)
{
   uint32_t p = min;
   while (p < v && p < (1u << 30)) {
      p <<= 1;
   }
   return p;
}

uint64_t
cqc_now_ns (void)
{
   struct timespec ts;
   clock_gettime (CLOCK_MONOTONIC, &ts);
   return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

/* ======================================================================== */
/* Creation and attachment                                                  */
/* ======================================================================== */

uint64_t
cqc_arena_required_bytes (cqc_geometry_t *geo)
{
   uint64_t off;

   geo->slot_count = pow2_at_least (geo->slot_count, 64);
   geo->ns_count = pow2_at_least (geo->ns_count ? geo->ns_count : 1024, 16);
   geo->idgen_count = pow2_at_least (geo->idgen_count ? geo->idgen_count : 65536, 64);
   if (geo->db_count == 0) {
      geo->db_count = 1024;
   }
   geo->budget_bytes = align_up (geo->budget_bytes, 64);

   off = align_up (sizeof (cqc_arena_header_t), 64);
   off += align_up ((uint64_t) geo->db_count * sizeof (cqc_db_t), 64);
   off += align_up ((uint64_t) geo->ns_count * sizeof (cqc_ns_t), 64);
   off += align_up ((uint64_t) geo->idgen_count * sizeof (uint64_t), 64);
   off += align_up ((uint64_t) geo->slot_count * sizeof (cqc_slot_t), 64);
   off += geo->budget_bytes;
   return off;
}

/* Make the view from header values `h` (the writer's own header, or an
 * attacher's validated private copy of one). */
static void
bind_view (cqc_arena_t *a, void *mem, uint64_t size, const cqc_arena_header_t *h)
{
   a->base = mem;
   a->size = size;
   a->hdr = mem;
   a->geo = h->geo;
   a->ring_bytes = h->ring_bytes;
   a->dbs = (cqc_db_t *) (a->base + h->db_off);
   a->nss = (cqc_ns_t *) (a->base + h->ns_off);
   a->idgen = (uint64_t *) (a->base + h->idgen_off);
   a->slots = (cqc_slot_t *) (a->base + h->slots_off);
   a->ring = a->base + h->ring_off;
}

bool
cqc_arena_format (cqc_arena_t *a, void *mem, uint64_t size, const cqc_geometry_t *geo_in,
                  const cqc_arena_owner_t *owner, char *err, size_t errlen)
{
   cqc_geometry_t geo = *geo_in;
   cqc_arena_header_t *h = mem;
   uint64_t need, off;

   if (geo.budget_bytes < 4096 || geo.budget_bytes > 0xF0000000ull) {
      snprintf (err, errlen, "budget_bytes must be between 4096 and %llu",
                (unsigned long long) 0xF0000000ull);
      return false;
   }
   need = cqc_arena_required_bytes (&geo);
   if (need > size) {
      snprintf (err, errlen, "arena of %llu bytes is smaller than the %llu bytes required",
                (unsigned long long) size, (unsigned long long) need);
      return false;
   }

   memset (a, 0, sizeof *a);
   h->layout_version = CQC_LAYOUT_VERSION;
   h->header_bytes = (uint32_t) sizeof (cqc_arena_header_t);
   h->arena_bytes = size;
   h->geo = geo;
   off = align_up (sizeof (cqc_arena_header_t), 64);
   h->db_off = off;
   off += align_up ((uint64_t) geo.db_count * sizeof (cqc_db_t), 64);
   h->ns_off = off;
   off += align_up ((uint64_t) geo.ns_count * sizeof (cqc_ns_t), 64);
   h->idgen_off = off;
   off += align_up ((uint64_t) geo.idgen_count * sizeof (uint64_t), 64);
   h->slots_off = off;
   off += align_up ((uint64_t) geo.slot_count * sizeof (cqc_slot_t), 64);
   h->ring_off = off;
   h->ring_bytes = geo.budget_bytes;
   /* A tenth of the payload for the small ring (eviction), when that is
    * room for a few entries; else one ring. */
   h->small_bytes = geo.budget_bytes / 10u >= 1024u ? align_up (geo.budget_bytes / 10u, 64) : 0;
   h->created_ns = cqc_now_ns ();
   if (owner) {
      h->owner_uid = owner->uid;
      h->owner_pid = owner->pid;
      h->heartbeat_timeout_ns = owner->heartbeat_timeout_ns;
   }
   bind_view (a, mem, size, h);
   /* The magic goes last: an attacher that sees it sees a formatted arena,
    * its owner's uid, pid and heartbeat timeout included. */
   STORE (&h->magic, CQC_ARENA_MAGIC);
   return true;
}

bool
cqc_arena_r_attach (cqc_arena_t *a, void *mem, uint64_t size, char *err, size_t errlen)
{
   cqc_arena_header_t h; /* a private copy: validated once, used to bind */
   cqc_geometry_t geo;
   uint64_t need;

   if (size < sizeof (cqc_arena_header_t)) {
      snprintf (err, errlen, "arena is too small to hold a header");
      return false;
   }
   if (LOAD ((const uint64_t *) mem) != CQC_ARENA_MAGIC) {
      snprintf (err, errlen, "arena has a bad magic number");
      return false;
   }
   memcpy (&h, mem, sizeof h);
   if (h.layout_version != CQC_LAYOUT_VERSION) {
      snprintf (err, errlen, "arena layout version %u, expected %u", h.layout_version,
                CQC_LAYOUT_VERSION);
      return false;
   }
   geo = h.geo;
   need = cqc_arena_required_bytes (&geo);
   if (memcmp (&geo, &h.geo, sizeof geo) != 0 || need > size || h.arena_bytes != size ||
       h.ring_bytes != geo.budget_bytes || h.db_off > size || h.ns_off > size ||
       h.idgen_off > size || h.slots_off > size || h.ring_off > size ||
       h.ring_bytes > size - h.ring_off ||
       h.db_off < sizeof (cqc_arena_header_t) ||
       h.db_off + (uint64_t) geo.db_count * sizeof (cqc_db_t) > h.ns_off ||
       h.ns_off + (uint64_t) geo.ns_count * sizeof (cqc_ns_t) > h.idgen_off ||
       h.idgen_off + (uint64_t) geo.idgen_count * 8u > h.slots_off ||
       h.slots_off + (uint64_t) geo.slot_count * sizeof (cqc_slot_t) > h.ring_off ||
       h.db_off % 64 || h.ns_off % 64 || h.idgen_off % 64 || h.slots_off % 64 ||
       h.ring_off % 64) {
      snprintf (err, errlen, "arena geometry is inconsistent with its size");
      return false;
   }
   memset (a, 0, sizeof *a);
   bind_view (a, mem, size, &h);
   return true;
}

/* ======================================================================== */
/* Reader API                                                               */
/* ======================================================================== */

cqc_stream_state_t
cqc_arena_r_db_state (const cqc_arena_t *a, uint32_t db_idx, bool *stalled)
{
   const cqc_db_t *d;
   uint32_t st;
   uint64_t progress, stall, now, beat, beat_timeout;

   *stalled = false;
   if (db_idx >= a->geo.db_count) {
      return CQC_STREAM_FAILED;
   }
   d = &a->dbs[db_idx];
   /* The heartbeat first (acquire), the health after it. An owner waking
    * from a freeze demotes its databases and only then publishes a fresh
    * heartbeat (owner.c, both under release order), so a reader that sees
    * the fresh heartbeat sees the demotion too. Loaded the other way round,
    * a HEALTHY from before the freeze could pair with a heartbeat from after
    * it: a state that never existed, serving entries whose invalidations
    * are still queued. */
   beat_timeout = LOAD_RELAXED (&a->hdr->heartbeat_timeout_ns);
   beat = LOAD (&a->hdr->heartbeat_ns);
   st = LOAD (&d->health);
   if (st != CQC_STREAM_HEALTHY) {
      return st > CQC_STREAM_STARTUP_FAILED ? CQC_STREAM_FAILED : (cqc_stream_state_t) st;
   }
   now = cqc_now_ns ();
   if (beat_timeout && now > beat + beat_timeout) {
      /* The owner stopped publishing: nobody applies invalidations. */
      *stalled = true;
      return CQC_STREAM_RECONNECTING;
   }
   progress = LOAD (&d->progress_ns);
   stall = LOAD_RELAXED (&d->stall_ns);
   if (now > progress + stall) {
      *stalled = true;
      return CQC_STREAM_RECONNECTING;
   }
   return CQC_STREAM_HEALTHY;
}

uint64_t
cqc_arena_r_applied (const cqc_arena_t *a, uint32_t db_idx)
{
   if (db_idx >= a->geo.db_count) {
      return 0;
   }
   return LOAD (&a->dbs[db_idx].applied_ts);
}

uint64_t
cqc_arena_r_quiet (const cqc_arena_t *a, uint32_t db_idx)
{
   if (db_idx >= a->geo.db_count) {
      return 0;
   }
   return LOAD (&a->dbs[db_idx].quiet_ns);
}

bool
cqc_arena_r_ns_find (const cqc_arena_t *a, const char *name, size_t len, uint32_t *idx)
{
   uint32_t mask = a->geo.ns_count - 1;
   uint64_t h = cqc_hash_bytes (name, len, 0x6e73u);
   uint32_t i, n;

   if (len >= CQC_NS_NAME_MAX) {
      return false;
   }
   for (n = 0, i = (uint32_t) h & mask; n <= mask; n++, i = (i + 1) & mask) {
      const cqc_ns_t *ns = &a->nss[i];
      if (!LOAD (&ns->used)) {
         return false;
      }
      if (ns->hash == h && ns->name_len == len && memcmp (ns->name, name, len) == 0) {
         *idx = i;
         return true;
      }
   }
   return false;
}

/* Whether an entry's recorded generations are all still current. Reads the
 * namespace, database and identity tables; every index is bounds-checked. */
static bool
entry_current_r (const cqc_arena_t *a, uint32_t ns_idx, uint32_t id_cell, uint16_t flags,
                 uint64_t ns_epoch, uint64_t gen, uint32_t db_inc)
{
   const cqc_ns_t *ns;
   uint32_t db_idx;

   if (ns_idx >= a->geo.ns_count) {
      return false;
   }
   ns = &a->nss[ns_idx];
   if (LOAD (&ns->epoch) != ns_epoch) {
      return false;
   }
   db_idx = LOAD_RELAXED (&ns->db_idx);
   if (db_idx >= a->geo.db_count || LOAD (&a->dbs[db_idx].incarnation) != db_inc) {
      return false;
   }
   if (flags & CQC_ENTRY_IDENTITY) {
      if (id_cell >= a->geo.idgen_count) {
         return false;
      }
      return LOAD (&a->idgen[id_cell]) == gen;
   }
   return LOAD (&ns->write_gen) == gen;
}

/* Reader: a hit of the block of generation `gen`. One load from this
 * process's own map, and a store only when the count can still grow. */
static void
access_mark (const cqc_arena_t *a, uint64_t hash, uint32_t gen)
{
   uint32_t *cell = &a->access[(uint32_t) (hash >> 32) & a->access_mask];
   uint32_t v = LOAD_RELAXED (cell);
   uint32_t tag = gen << 2;

   if ((v & ~3u) != tag) {
      STORE_RELAXED (cell, tag | 1u);
   } else if ((v & 3u) != 3u) {
      STORE_RELAXED (cell, v + 1u);
   }
}

void
cqc_arena_r_prefetch (const cqc_arena_t *a, uint64_t hash)
{
   __builtin_prefetch (&a->slots[(uint32_t) hash & (a->geo.slot_count - 1)], 0, 3);
   if (a->access) {
      __builtin_prefetch (&a->access[(uint32_t) (hash >> 32) & a->access_mask], 1, 3);
   }
}

void
cqc_arena_r_prefetch_block (const cqc_arena_t *a, uint64_t block_off)
{
   if (block_off + CQC_BLOCK_HEADER < a->ring_bytes) {
      __builtin_prefetch (a->ring + block_off, 0, 3);
      __builtin_prefetch (a->ring + block_off + CQC_BLOCK_HEADER, 0, 3);
   }
}

cqc_lookup_t
cqc_arena_r_lookup (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash, const uint8_t *key,
                    uint32_t key_len, cqc_alloc_fn alloc, cqc_discard_fn discard, void *ctx)
{
   cqc_stamp_t stamp;
   uint32_t cell;

   return cqc_arena_r_lookup_stamped (a, ns_idx, hash, key, key_len, alloc, discard, ctx,
                                      &stamp, &cell);
}

cqc_lookup_t
cqc_arena_r_lookup_stamped (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash,
                            const uint8_t *key, uint32_t key_len, cqc_alloc_fn alloc,
                            cqc_discard_fn discard, void *ctx, cqc_stamp_t *stamp,
                            uint32_t *cell)
{
   cqc_entry_id_t id;

   return cqc_arena_r_lookup_entry (a, ns_idx, hash, key, key_len, alloc, discard, NULL, ctx,
                                    stamp, cell, &id);
}

cqc_lookup_t
cqc_arena_r_lookup_entry (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash,
                          const uint8_t *key, uint32_t key_len, cqc_alloc_fn alloc,
                          cqc_discard_fn discard, cqc_held_fn held, void *ctx, cqc_stamp_t *stamp,
                          uint32_t *cell, cqc_entry_id_t *id)
{
   uint32_t mask = a->geo.slot_count - 1;
   uint64_t ring_bytes = a->ring_bytes;
   uint32_t i, n;

   for (n = 0, i = (uint32_t) hash & mask; n < CQC_MAX_PROBE; n++, i = (i + 1) & mask) {
      const cqc_slot_t *s = &a->slots[i];
      uint32_t seq1 = LOAD (&s->seq);
      cqc_slot_t c;
      const block_hdr_t *bh;
      void *dst = NULL;
      uint64_t sum;

      if (seq1 & 1u) {
         return CQC_LOOKUP_MISS; /* writer busy here: a miss is always safe */
      }
      memcpy (&c, s, sizeof c);
      FENCE_ACQ ();
      if (LOAD_RELAXED (&s->seq) != seq1) {
         return CQC_LOOKUP_MISS;
      }
      if (c.state == 0) {
         return CQC_LOOKUP_MISS; /* end of the probe chain */
      }
      if (c.hash != hash || c.key_len != key_len || c.ns_idx != ns_idx) {
         continue;
      }
      /* Bounds: the block, its key and its value lie inside the ring, and
       * the block is where the writer puts blocks (8-byte aligned), so its
       * header can be read as one. */
      if ((uint64_t) c.block_off + CQC_BLOCK_HEADER + (uint64_t) c.key_len + c.val_len >
             ring_bytes ||
          c.block_off % 8u != 0) {
         return CQC_LOOKUP_MISS;
      }
      bh = (const block_hdr_t *) (a->ring + c.block_off);
      if (LOAD_RELAXED (&bh->gen) != c.block_gen ||
          memcmp (a->ring + c.block_off + CQC_BLOCK_HEADER, key, key_len) != 0) {
         continue;
      }
      if ((c.flags & CQC_ENTRY_CONFLICT) ||
          !entry_current_r (a, c.ns_idx, c.id_cell, c.flags, c.ns_epoch, c.gen, c.db_inc)) {
         return CQC_LOOKUP_MISS;
      }
      *id = (cqc_entry_id_t){.key_hash = hash,     .slot = i,       .block_off = c.block_off,
                             .block_gen = c.block_gen, .val_len = c.val_len, .sum = bh->sum};
      if (!(c.flags & CQC_ENTRY_NOT_FOUND)) {
         /* A reader that holds what it made of this entry's bytes (the same
          * block, generation, size and sum) takes no copy: the checks below
          * prove that the sum it compared was the block's while the slot
          * named it, and a block's bytes do not change while it does. */
         id->held = held && held (ctx, id);
         if (!id->held) {
            dst = alloc (ctx, c.val_len);
            if (!dst) {
               return CQC_LOOKUP_MISS;
            }
            memcpy (dst, a->ring + c.block_off + CQC_BLOCK_HEADER + c.key_len, c.val_len);
         }
      }
      memcpy (stamp, &bh->stamp, sizeof *stamp);
      sum = bh->sum;
      FENCE_ACQ ();
      /* The copy is private now. Both the slot and the block must be the
       * ones it was taken from: the slot's seq has not moved (the writer
       * removes a block's slot, moving its seq with release order, before it
       * reuses the block's bytes; the fence above makes a copy that saw any
       * reused byte see that seq), and the block header still carries the
       * generation the slot names, a second witness that costs one load.
       * Then the copy is checked against the writer's sum. */
      if (LOAD_RELAXED (&s->seq) != seq1 || LOAD_RELAXED (&bh->gen) != c.block_gen ||
          (id->held ? sum != id->sum
                    : entry_sum (c.flags, c.key_len, dst ? dst : "", dst ? c.val_len : 0, stamp) !=
                         sum)) {
         if (dst) {
            discard (ctx);
         }
         return CQC_LOOKUP_MISS;
      }
      *cell = (c.flags & CQC_ENTRY_IDENTITY) ? c.id_cell : CQC_NO_CELL;
      if (a->access) {
         access_mark (a, hash, c.block_gen);
      }
      return (c.flags & CQC_ENTRY_NOT_FOUND) ? CQC_LOOKUP_NOT_FOUND : CQC_LOOKUP_HIT;
   }
   return CQC_LOOKUP_MISS;
}

bool
cqc_arena_r_entry_live (const cqc_arena_t *a, const cqc_entry_id_t *id)
{
   const cqc_slot_t *s;
   uint32_t seq1;
   cqc_slot_t c;
   bool live;

   if (id->slot >= a->geo.slot_count) {
      return false;
   }
   s = &a->slots[id->slot];
   seq1 = LOAD (&s->seq);
   memcpy (&c, s, sizeof c);
   FENCE_ACQ ();
   live = !(seq1 & 1u) && c.state != 0 && c.hash == id->key_hash && c.block_off == id->block_off &&
          c.block_gen == id->block_gen && c.val_len == id->val_len &&
          !(c.flags & CQC_ENTRY_CONFLICT) &&
          entry_current_r (a, c.ns_idx, c.id_cell, c.flags, c.ns_epoch, c.gen, c.db_inc);
   return live && LOAD_RELAXED (&s->seq) == seq1;
}

void
cqc_arena_r_capture (const cqc_arena_t *a, uint32_t ns_idx, uint32_t id_cell, cqc_token_t *tok)
{
   const cqc_ns_t *ns;
   bool stalled;

   memset (tok, 0, sizeof *tok);
   tok->ns_idx = ns_idx;
   tok->id_cell = id_cell;
   if (ns_idx >= a->geo.ns_count) {
      return; /* healthy stays 0: the admission will be refused */
   }
   ns = &a->nss[ns_idx];
   tok->db_idx = LOAD_RELAXED (&ns->db_idx);
   if (tok->db_idx >= a->geo.db_count) {
      return;
   }
   /* Health first: generations read after a healthy check are at least as
    * new as the state that check saw. */
   tok->healthy = cqc_arena_r_db_state (a, tok->db_idx, &stalled) == CQC_STREAM_HEALTHY;
   tok->db_inc = LOAD (&a->dbs[tok->db_idx].incarnation);
   tok->ns_epoch = LOAD (&ns->epoch);
   if (id_cell != CQC_NO_CELL && id_cell < a->geo.idgen_count) {
      tok->gen = LOAD (&a->idgen[id_cell]);
   } else {
      tok->id_cell = CQC_NO_CELL;
      tok->gen = LOAD (&ns->write_gen);
   }
}

/* ======================================================================== */
/* Writer: registration                                                     */
/* ======================================================================== */

static bool
db_find_w (const cqc_arena_t *a, const char *name, size_t len, uint32_t *idx)
{
   uint32_t i;
   for (i = 0; i < a->geo.db_count; i++) {
      const cqc_db_t *d = &a->dbs[i];
      if (!d->used) {
         return false;
      }
      if (d->name_len == len && memcmp (d->name, name, len) == 0) {
         *idx = i;
         return true;
      }
   }
   return false;
}

bool
cqc_arena_w_db_register (cqc_arena_t *a, const char *name, size_t len, uint32_t *idx,
                         char *err, size_t errlen)
{
   uint32_t i;

   if (len == 0 || len >= CQC_DB_NAME_MAX || memchr (name, '\0', len)) {
      snprintf (err, errlen, "invalid database name");
      return false;
   }
   if (db_find_w (a, name, len, idx)) {
      return true;
   }
   for (i = 0; i < a->geo.db_count; i++) {
      cqc_db_t *d = &a->dbs[i];
      if (!d->used) {
         memcpy (d->name, name, len);
         d->name[len] = '\0';
         d->name_len = (uint32_t) len;
         STORE_RELAXED (&d->stall_ns, 5000000000ull);
         STORE (&d->health, (uint32_t) CQC_STREAM_NOT_STARTED);
         STORE (&d->used, 1u);
         *idx = i;
         return true;
      }
   }
   snprintf (err, errlen, "the arena's database table is full (%u databases)",
             a->geo.db_count);
   return false;
}

static size_t
ns_name (char *out, const char *db, size_t db_len, const char *coll, size_t coll_len)
{
   if (db_len + 1 + coll_len >= CQC_NS_NAME_MAX) {
      return 0;
   }
   memcpy (out, db, db_len);
   out[db_len] = '.';
   memcpy (out + db_len + 1, coll, coll_len);
   out[db_len + 1 + coll_len] = '\0';
   return db_len + 1 + coll_len;
}

bool
cqc_arena_w_ns_lookup (const cqc_arena_t *a, const char *db, size_t db_len, const char *coll,
                       size_t coll_len, uint32_t *idx)
{
   char name[CQC_NS_NAME_MAX];
   size_t len = ns_name (name, db, db_len, coll, coll_len);
   return len && cqc_arena_r_ns_find (a, name, len, idx);
}

bool
cqc_arena_w_ns_register (cqc_arena_t *a, const char *db, size_t db_len, const char *coll,
                         size_t coll_len, uint32_t *idx, char *err, size_t errlen)
{
   char name[CQC_NS_NAME_MAX];
   size_t len = ns_name (name, db, db_len, coll, coll_len);
   uint32_t mask = a->geo.ns_count - 1;
   uint32_t db_idx, i, n;
   uint64_t h;

   if (!len || coll_len == 0 || memchr (coll, '\0', coll_len)) {
      snprintf (err, errlen, "invalid namespace name");
      return false;
   }
   if (cqc_arena_r_ns_find (a, name, len, idx)) {
      return true;
   }
   if (!cqc_arena_w_db_register (a, db, db_len, &db_idx, err, errlen)) {
      return false;
   }
   h = cqc_hash_bytes (name, len, 0x6e73u);
   for (n = 0, i = (uint32_t) h & mask; n <= mask / 4 * 3; n++, i = (i + 1) & mask) {
      cqc_ns_t *ns = &a->nss[i];
      if (!ns->used) {
         memcpy (ns->name, name, len + 1);
         ns->name_len = (uint32_t) len;
         ns->hash = h;
         ns->db_idx = db_idx;
         STORE (&ns->used, 1u);
         *idx = i;
         return true;
      }
   }
   snprintf (err, errlen, "the arena's namespace table is full (%u namespaces)",
             a->geo.ns_count);
   return false;
}

/* ======================================================================== */
/* Writer: slot table                                                       */
/* ======================================================================== */

static void
slot_begin_w (cqc_slot_t *s)
{
   STORE (&s->seq, s->seq + 1u); /* odd */
   FENCE_REL ();
}

static void
slot_end_w (cqc_slot_t *s)
{
   STORE (&s->seq, s->seq + 1u); /* even */
}

static block_hdr_t *
block_at_w (cqc_arena_t *a, uint64_t off)
{
   return (block_hdr_t *) (a->ring + off);
}

static bool
in_small_w (const cqc_arena_t *a, uint64_t off)
{
   return off >= a->hdr->ring_bytes - a->hdr->small_bytes;
}

/* Copy every field of src but seq into dst, between slot_begin_w and
 * slot_end_w on dst: seq is written by those two only (see cqc_slot_t).
 * memcpy never writes outside [dst, dst + n), so the first 4 bytes stay
 * untouched whatever the compiler makes of it. */
#define SLOT_BODY_OFF offsetof (cqc_slot_t, state)
_Static_assert (offsetof (cqc_slot_t, seq) == 0 && SLOT_BODY_OFF == sizeof (uint32_t),
                "seq is alone in the first word of a slot");

static void
slot_copy_body_w (cqc_slot_t *dst, const cqc_slot_t *src)
{
   memcpy ((uint8_t *) dst + SLOT_BODY_OFF, (const uint8_t *) src + SLOT_BODY_OFF,
           sizeof *dst - SLOT_BODY_OFF);
}

/* Remove the entry in slot i, keeping the probe chains intact by shifting
 * later entries back (no tombstones). Concurrent readers may miss an entry
 * while it moves, which is safe. */
static void
slot_remove_w (cqc_arena_t *a, uint32_t i)
{
   uint32_t mask = a->geo.slot_count - 1;
   uint32_t j = i;
   cqc_slot_t *hole = &a->slots[i];

   a->hdr->used_bytes -= block_at_w (a, hole->block_off)->len;
   a->hdr->entries--;
   if (in_small_w (a, hole->block_off)) {
      a->hdr->small_entries--;
   }

   for (;;) {
      cqc_slot_t *sj;
      uint32_t k;

      j = (j + 1) & mask;
      sj = &a->slots[j];
      if (sj->state == 0) {
         break;
      }
      k = (uint32_t) sj->hash & mask;
      /* sj stays if its home k lies cyclically in (i, j]. */
      if ((i <= j) ? (i < k && k <= j) : (i < k || k <= j)) {
         continue;
      }
      hole = &a->slots[i];
      slot_begin_w (hole);
      slot_copy_body_w (hole, sj);
      slot_end_w (hole);
      block_at_w (a, hole->block_off)->slot = i;
      i = j;
   }
   hole = &a->slots[i];
   slot_begin_w (hole);
   hole->state = 0;
   hole->hash = 0;
   slot_end_w (hole);
}

static bool
slot_find_w (const cqc_arena_t *a, uint64_t hash, const uint8_t *key, uint32_t key_len,
             uint32_t ns_idx, uint32_t *out)
{
   uint32_t mask = a->geo.slot_count - 1;
   uint32_t i, n;
   for (n = 0, i = (uint32_t) hash & mask; n < CQC_MAX_PROBE; n++, i = (i + 1) & mask) {
      const cqc_slot_t *s = &a->slots[i];
      if (s->state == 0) {
         return false;
      }
      if (s->hash == hash && s->key_len == key_len && s->ns_idx == ns_idx &&
          memcmp (a->ring + s->block_off + CQC_BLOCK_HEADER, key, key_len) == 0) {
         *out = i;
         return true;
      }
   }
   return false;
}

/* ======================================================================== */
/* Writer: payload rings and eviction                                       */
/* ======================================================================== */

/*
 * S3-FIFO (Yang et al., SOSP 2023) on two rings. A new entry goes to the
 * small ring (a tenth of the budget); when the small ring's tail reaches
 * it, an entry hit at least SMALL_TO_MAIN times since admission is copied to
 * the main ring's head, any other is evicted and its key hash remembered in
 * the ghost. A key found in the ghost is admitted straight to the main
 * ring. At the main ring's tail an entry hit since its last move is copied
 * to the head with one hit fewer (a 2-bit clock), any other is evicted.
 * Entries that can no longer be served (invalidated, replaced) are
 * reclaimed at either tail and never copied.
 *
 * Hits never write the arena: each reading process marks its own access
 * map (access_mark), and the writer reads the maps (a->hits, or
 * a->access) only when it judges a tail block. Cells are tagged with the
 * block's generation, so a move (new generation) forgets the old marks
 * without writing anyone's map, and a cell another key's hit overwrote
 * loses hits but never invents them. What a map holds is never trusted: a
 * forged count can only keep an entry longer, and every copy is paid from
 * move_credit (at most twice the bytes admitted), so a process that marks
 * every entry hot costs the group its hit ratio, never unbounded work.
 *
 * A move copies the block to its new place and rewrites the slot between
 * slot_begin_w and slot_end_w, as an admission does: a reader racing it
 * sees the seq move (or the block's generation), a miss, never torn bytes.
 */
#define SMALL_TO_MAIN 2u
#define MOVE_CREDIT_PER_BYTE 2u

typedef struct {
   uint64_t base; /* offset of the ring within the payload region */
   uint64_t cap;
   uint64_t *head, *tail, *span; /* relative to base */
   bool small;
} wring_t;

static wring_t
main_ring (cqc_arena_t *a)
{
   cqc_arena_header_t *h = a->hdr;
   return (wring_t){0, h->ring_bytes - h->small_bytes, &h->ring_head, &h->ring_tail,
                    &h->ring_span, false};
}

static wring_t
small_ring (cqc_arena_t *a)
{
   cqc_arena_header_t *h = a->hdr;
   return (wring_t){h->ring_bytes - h->small_bytes, h->small_bytes, &h->small_head,
                    &h->small_tail, &h->small_span, true};
}

uint32_t
cqc_access_cells (const cqc_geometry_t *geo)
{
   return geo->slot_count; /* a power of two (cqc_arena_required_bytes) */
}

uint32_t
cqc_access_count (const uint32_t *map, uint32_t mask, uint64_t hash, uint32_t block_gen)
{
   uint32_t v = LOAD_RELAXED (&map[(uint32_t) (hash >> 32) & mask]);
   return (v & ~3u) == (block_gen << 2) ? (v & 3u) : 0u;
}

/* Hits of the entry in slot s (block generation gen) since its last move,
 * with what it carried over: 0-3. */
static uint32_t
hits_w (const cqc_arena_t *a, const cqc_slot_t *s)
{
   uint32_t n = s->base > 3u ? 3u : s->base;
   if (a->hits) {
      n += a->hits (a->hits_ctx, s->hash, s->block_gen);
   } else if (a->access) {
      n += cqc_access_count (a->access, a->access_mask, s->hash, s->block_gen);
   }
   return n > 3u ? 3u : n;
}

bool
cqc_arena_w_policy_init (cqc_arena_t *a)
{
   /* Direct-mapped, two cells per slot: a key hash's top 40 bits and the
    * ghost's insertion count (24 bits) when it was evicted. */
   uint32_t cells = a->geo.slot_count * 2u;
   a->ghost = calloc (cells, sizeof (uint64_t));
   if (!a->ghost) {
      return false;
   }
   a->ghost_mask = cells - 1u;
   a->ghost_seq = 0;
   return true;
}

void
cqc_arena_w_policy_free (cqc_arena_t *a)
{
   free (a->ghost);
   a->ghost = NULL;
   a->ghost_mask = 0;
}

#define GHOST_SEQ_MASK 0xffffffu

static void
ghost_add_w (cqc_arena_t *a, uint64_t hash)
{
   if (a->ghost) {
      a->ghost_seq = (a->ghost_seq + 1u) & GHOST_SEQ_MASK;
      a->ghost[(uint32_t) (hash >> 32) & a->ghost_mask] =
         (hash & ~(uint64_t) GHOST_SEQ_MASK) | a->ghost_seq;
   }
}

/* Whether the key was evicted from the small ring recently: within nine
 * tenths as many small-ring evictions as the cache holds entries (the
 * ghost's capacity, S3-FIFO's 0.9 of the cache; a ghost that remembered
 * more sent more one-time keys to the main ring: 1.035 against 1.021 of
 * libCacheSim's best on benchmarks.eviction's zipf11 at 1%). Forgets it. */
static bool
ghost_take_w (cqc_arena_t *a, uint64_t hash)
{
   uint64_t *cell, v;
   uint32_t age;

   if (!a->ghost) {
      return false;
   }
   cell = &a->ghost[(uint32_t) (hash >> 32) & a->ghost_mask];
   v = *cell;
   if (!v || (v & ~(uint64_t) GHOST_SEQ_MASK) != (hash & ~(uint64_t) GHOST_SEQ_MASK)) {
      return false;
   }
   age = (a->ghost_seq - (uint32_t) (v & GHOST_SEQ_MASK)) & GHOST_SEQ_MASK;
   *cell = 0;
   return age <= a->hdr->entries * 9u / 10u;
}

/* Free `need` bytes at ring r's head without reclaiming anything: where
 * the block goes, or false if they are not free. Pads the end of the ring
 * when the block does not fit before it. */
static bool
ring_take_w (cqc_arena_t *a, const wring_t *r, uint64_t need, uint64_t *off)
{
   if (*r->span == 0) {
      *r->head = *r->tail = 0;
   }
   if (*r->span < r->cap && *r->head >= *r->tail) {
      /* Free space is [head, cap) then [0, tail). */
      if (r->cap - *r->head < need) {
         if (*r->tail < need) {
            return false;
         }
         if (r->cap - *r->head >= CQC_BLOCK_HEADER) {
            block_at_w (a, r->base + *r->head)->magic = BLOCK_PAD;
         }
         *r->span += r->cap - *r->head;
         *r->head = 0;
      }
   } else if (*r->span >= r->cap || *r->tail - *r->head < need) {
      return false; /* free space is [head, tail) */
   }
   *off = r->base + *r->head;
   *r->head += need;
   *r->span += need;
   if (*r->head == r->cap) {
      *r->head = 0;
   }
   return true;
}

/* Whether ring r has `need` contiguous bytes free at its head (or at its
 * start, past a pad): ring_take_w without taking them. */
static bool
ring_fits_w (const wring_t *r, uint64_t need)
{
   if (*r->span == 0) {
      return need <= r->cap;
   }
   if (*r->span < r->cap && *r->head >= *r->tail) {
      return r->cap - *r->head >= need || *r->tail >= need;
   }
   return *r->span < r->cap && *r->tail - *r->head >= need;
}

/* Advance ring r's tail past a block of len bytes. */
static void
ring_release_w (const wring_t *r, uint64_t len)
{
   *r->tail += len;
   *r->span -= len;
   if (*r->tail == r->cap) {
      *r->tail = 0;
   }
}

static bool ring_alloc_w (cqc_arena_t *a, const wring_t *r, uint64_t need, uint64_t *off);

/* Copy the block at `from` (len bytes, named by slot i) to `to`, give it a
 * new generation and point the slot at it. The slot's seq is odd from
 * before the first byte is written until the slot names the new block. */
static void
move_block_w (cqc_arena_t *a, uint32_t i, uint64_t from, uint64_t to, uint64_t len,
              uint32_t base)
{
   cqc_slot_t *s = &a->slots[i];
   block_hdr_t *bh;

   slot_begin_w (s);
   if (to != from) {
      memmove (a->ring + to, a->ring + from, len);
      if (to + len <= from || from + len <= to) {
         block_at_w (a, from)->magic = 0;
      }
   }
   bh = block_at_w (a, to);
   bh->magic = BLOCK_MAGIC;
   STORE_RELAXED (&bh->gen, (uint32_t) ++a->hdr->block_gen);
   bh->slot = i;
   s->block_off = (uint32_t) to;
   s->block_gen = bh->gen;
   s->base = base;
   slot_end_w (s);
}

/* Reclaim the block at ring r's tail: drop it if nothing can serve it,
 * move it if its hits earn it (and the credit allows), else evict it. */
static void
ring_pop_w (cqc_arena_t *a, const wring_t *r)
{
   cqc_arena_header_t *h = a->hdr;
   uint64_t tail = *r->tail, at = r->base + tail, len, to;
   block_hdr_t *bh;
   cqc_slot_t *s;
   uint32_t i, hits;

   if (r->cap - tail < CQC_BLOCK_HEADER || block_at_w (a, at)->magic == BLOCK_PAD) {
      *r->span -= r->cap - tail;
      *r->tail = 0;
      return;
   }
   bh = block_at_w (a, at);
   if (bh->magic != BLOCK_MAGIC || bh->len < CQC_BLOCK_HEADER || bh->len > *r->span ||
       bh->len > r->cap - tail) {
      /* The writer's own bookkeeping is inconsistent: start over. */
      cqc_arena_w_clear (a);
      return;
   }
   len = bh->len;
   i = bh->slot;
   s = i < h->geo.slot_count ? &a->slots[i] : NULL;
   if (!s || !s->state || s->block_off != at || s->block_gen != bh->gen) {
      bh->magic = 0; /* a hole: its entry was replaced or removed */
      ring_release_w (r, len);
      return;
   }
   if ((s->flags & CQC_ENTRY_CONFLICT) ||
       !entry_current_r (a, s->ns_idx, s->id_cell, s->flags, s->ns_epoch, s->gen, s->db_inc)) {
      /* Invalidated: nothing will serve it again, and it may hold a hot
       * key's old bytes. Conflict markers go too: the write they wait for
       * moves their generations on. */
      if (!(s->flags & CQC_ENTRY_CONFLICT)) {
         h->dead_reclaimed++;
      }
      slot_remove_w (a, i);
      bh->magic = 0;
      ring_release_w (r, len);
      return;
   }
   hits = hits_w (a, s);
   if (hits >= (r->small ? SMALL_TO_MAIN : 1u) && h->move_credit >= len) {
      h->move_credit -= len;
      if (r->small) {
         wring_t m = main_ring (a);
         /* Room in the main ring first: its evictions may move this
          * block's slot (backward shift), never the block, and the block
          * records where its slot went. */
         if (!ring_alloc_w (a, &m, len, &to)) {
            return; /* cannot happen: an entry is at most a quarter of the ring */
         }
         i = bh->slot;
         s = i < h->geo.slot_count ? &a->slots[i] : NULL;
         if (*r->tail == tail && *r->span >= len && s && s->state && s->block_off == at &&
             s->block_gen == bh->gen) {
            move_block_w (a, i, at, to, len, 0);
            h->small_entries--;
            h->promotions++;
            ring_release_w (r, len);
            return;
         }
         /* The arena was cleared under us (cqc_arena_w_clear, on bookkeeping
          * it found inconsistent): what was taken in the main ring becomes
          * a hole its tail reclaims, and this ring is left as the clear
          * left it. */
         bh = block_at_w (a, to);
         bh->magic = BLOCK_MAGIC;
         STORE_RELAXED (&bh->gen, 0u);
         bh->len = (uint32_t) len;
         bh->slot = CQC_NO_CELL;
         return;
      } else {
         /* The block leaves the tail for the head of the same ring: once
          * its bytes are released, they and the free space before them
          * always hold it (the ring had no room, so head and tail meet at
          * its free space), and memmove copies within overlapping ranges. */
         ring_release_w (r, len);
         if (ring_take_w (a, r, len, &to)) {
            move_block_w (a, i, at, to, len, hits - 1u);
            h->reinsertions++;
            return;
         }
         /* Unreachable by the argument above; evicted if it ever is. */
         slot_remove_w (a, i);
         h->evictions++;
         return;
      }
   }
   if (hits >= (r->small ? SMALL_TO_MAIN : 1u)) {
      h->forced++;
   }
   if (r->small) {
      ghost_add_w (a, s->hash);
   }
   slot_remove_w (a, i);
   h->evictions++;
   bh->magic = 0;
   ring_release_w (r, len);
}

/* Allocate `need` contiguous bytes at ring r's head, reclaiming from its
 * tail. */
static bool
ring_alloc_w (cqc_arena_t *a, const wring_t *r, uint64_t need, uint64_t *off)
{
   if (need > r->cap) {
      return false;
   }
   while (!ring_take_w (a, r, need, off)) {
      if (*r->span == 0) {
         return false; /* cannot happen: an empty ring holds need */
      }
      ring_pop_w (a, r);
   }
   return true;
}

/* Free one slot: reclaim at the small ring's tail while it holds a tenth
 * of the entries or more, else at the main ring's. */
static void
evict_one_w (cqc_arena_t *a)
{
   cqc_arena_header_t *h = a->hdr;
   wring_t sm = small_ring (a), m = main_ring (a);

   if (h->small_span && (h->small_entries * 10u >= h->entries || h->ring_span == 0)) {
      ring_pop_w (a, &sm);
   } else if (h->ring_span) {
      ring_pop_w (a, &m);
   } else if (h->small_span) {
      ring_pop_w (a, &sm);
   }
}

void
cqc_arena_w_clear (cqc_arena_t *a)
{
   uint32_t i;
   for (i = 0; i < a->geo.slot_count; i++) {
      cqc_slot_t *s = &a->slots[i];
      if (s->state) {
         slot_begin_w (s);
         s->state = 0;
         s->hash = 0;
         slot_end_w (s);
      }
   }
   a->hdr->ring_head = a->hdr->ring_tail = a->hdr->ring_span = 0;
   a->hdr->small_head = a->hdr->small_tail = a->hdr->small_span = 0;
   a->hdr->used_bytes = 0;
   a->hdr->entries = 0;
   a->hdr->small_entries = 0;
}

void
cqc_arena_r_bytes (const cqc_arena_t *a, uint64_t *live, uint64_t *dead)
{
   uint64_t sum = 0, span;
   uint32_t i;

   for (i = 0; i < a->geo.slot_count; i++) {
      const cqc_slot_t *s = &a->slots[i];
      uint16_t flags = LOAD_RELAXED (&s->flags);
      if (LOAD_RELAXED (&s->state) && !(flags & CQC_ENTRY_CONFLICT) &&
          entry_current_r (a, LOAD_RELAXED (&s->ns_idx), LOAD_RELAXED (&s->id_cell), flags,
                           LOAD_RELAXED (&s->ns_epoch), LOAD_RELAXED (&s->gen),
                           LOAD_RELAXED (&s->db_inc))) {
         sum += align_up ((uint64_t) CQC_BLOCK_HEADER + LOAD_RELAXED (&s->key_len) +
                             LOAD_RELAXED (&s->val_len),
                          8);
      }
   }
   span = LOAD_RELAXED (&a->hdr->ring_span) + LOAD_RELAXED (&a->hdr->small_span);
   if (sum > span) {
      sum = span; /* a racing writer, or bytes someone else wrote */
   }
   *live = sum;
   *dead = span - sum;
}

/* ======================================================================== */
/* Writer: admission                                                        */
/* ======================================================================== */

static bool
token_current_w (const cqc_arena_t *a, const cqc_token_t *tok)
{
   uint16_t flags = tok->id_cell != CQC_NO_CELL ? CQC_ENTRY_IDENTITY : 0;
   return entry_current_r (a, tok->ns_idx, tok->id_cell, flags, tok->ns_epoch, tok->gen,
                           tok->db_inc);
}

static bool
same_generations_w (const cqc_slot_t *s, const cqc_token_t *tok)
{
   return s->ns_epoch == tok->ns_epoch && s->gen == tok->gen && s->db_inc == tok->db_inc &&
          s->id_cell == tok->id_cell;
}

/* A later read returned the entry of slot i again: the result was current
 * when that read began too, so the entry's start moves on to it (floor.h
 * (c) then serves it after observations made in between) and it becomes
 * that read's (its own read, floor.h (d)), while its end and cluster time
 * stay the earlier of the two reads': what a hit of it shows is no newer
 * than then. Stamp and sum change between slot_begin_w and slot_end_w, so
 * a reader that copied either while they changed sees the slot's seq move
 * (a miss). */
static void
refresh_stamp_w (cqc_arena_t *a, uint32_t i, const cqc_stamp_t *stamp)
{
   cqc_slot_t *s = &a->slots[i];
   block_hdr_t *bh = block_at_w (a, s->block_off);

   if (stamp->start_ns <= bh->stamp.start_ns || stamp->end_ns < stamp->start_ns ||
       !bh->stamp.end_ns) {
      return;
   }
   slot_begin_w (s);
   bh->stamp.start_ns = stamp->start_ns;
   bh->stamp.read_id = stamp->read_id;
   bh->stamp.flags &= stamp->flags;
   if (stamp->end_ns < bh->stamp.end_ns) {
      bh->stamp.end_ns = stamp->end_ns;
   }
   if (stamp->end_ts && stamp->end_ts < bh->stamp.end_ts) {
      bh->stamp.end_ts = stamp->end_ts;
   }
   bh->sum = entry_sum (s->flags, s->key_len,
                        s->val_len ? (const void *) (a->ring + s->block_off + CQC_BLOCK_HEADER +
                                                     s->key_len)
                                   : "",
                        s->val_len, &bh->stamp);
   slot_end_w (s);
}

/* Which of two reads under the same generations that returned different
 * results is the newer. Known only on a deployment of one member (both
 * stamps CQC_STAMP_ORDERED), where a read that began after another ended
 * read at least what that one read (floor.h); reads that overlapped are not
 * ordered. */
typedef enum { ORDER_UNKNOWN, ORDER_NEW_IS_NEWER, ORDER_OLD_IS_NEWER } order_t;

static order_t
order_w (const cqc_stamp_t *old, const cqc_stamp_t *new)
{
   if (!(old->flags & new->flags & CQC_STAMP_ORDERED) || !old->end_ns || !new->end_ns) {
      return ORDER_UNKNOWN;
   }
   /* A renewed entry's start lies past its end (refresh_stamp_w): it was
    * current at both. */
   if (new->start_ns >= old->end_ns && new->start_ns >= old->start_ns) {
      return ORDER_NEW_IS_NEWER;
   }
   if (old->start_ns >= new->end_ns) {
      return ORDER_OLD_IS_NEWER;
   }
   return ORDER_UNKNOWN;
}

/* Two reads captured under the same generations returned different results
 * only if a write landed between them whose event is not applied yet. The
 * order of their admissions says nothing about the order of the reads, so
 * neither result may be served: the newer one may already have been
 * returned to a caller that would then read back in time. */
static bool
other_result_w (const cqc_arena_t *a, const cqc_slot_t *s, uint16_t flags, const uint8_t *val,
                uint32_t val_len)
{
   if ((s->flags & CQC_ENTRY_NOT_FOUND) != (flags & CQC_ENTRY_NOT_FOUND) ||
       s->val_len != val_len) {
      return true;
   }
   return val_len != 0 &&
          memcmp (a->ring + s->block_off + CQC_BLOCK_HEADER + s->key_len, val, val_len) != 0;
}

bool
cqc_arena_w_rebind (const cqc_arena_t *a, cqc_token_t *tok, const uint8_t *doc, uint32_t len)
{
   bson_iter_t it;
   uint64_t hash;
   bool ok = false;
   uint32_t cell;

   if (tok->id_cell != CQC_NO_CELL || !doc || !token_current_w (a, tok)) {
      return false; /* an identity token already, or stale: admit refuses it */
   }
   /* The cell the change stream bumps for this _id (see stream.c). */
   if (!bson_iter_init_from_data (&it, doc, len) || !bson_iter_find (&it, "_id") ||
       cqc_id_hash (&it, &hash, &ok) != CQC_ID_CELL) {
      return false; /* no _id, or one the stream invalidates namespace-wide */
   }
   cell = cqc_id_cell (hash, tok->ns_idx, a->geo.idgen_count);
   if (cell >= a->geo.idgen_count) {
      return false;
   }
   /* The write generation has not moved since the capture, so no document
    * of the namespace was written since: the document's identity generation
    * now is the one it had when it was read. */
   tok->id_cell = cell;
   tok->gen = LOAD (&a->idgen[cell]);
   return true;
}

cqc_admit_t
cqc_arena_w_admit (cqc_arena_t *a, const cqc_token_t *tok, uint64_t hash, const uint8_t *key,
                   uint32_t key_len, const uint8_t *val, uint32_t val_len, uint16_t flags)
{
   cqc_arena_header_t *h = a->hdr;
   uint32_t mask = h->geo.slot_count - 1;
   uint64_t need = align_up ((uint64_t) CQC_BLOCK_HEADER + key_len + val_len, 8);
   uint64_t off;
   uint32_t i, n, existing;
   block_hdr_t *bh;
   cqc_slot_t *s;
   bool stalled;
   bool conflict = false;
   bool to_main = false;
   wring_t r;
   cqc_stamp_t stamp = tok->stamp;

   if (!tok->healthy || tok->db_idx >= h->geo.db_count ||
       cqc_arena_r_db_state (a, tok->db_idx, &stalled) != CQC_STREAM_HEALTHY) {
      h->rejected_health++;
      return CQC_ADMIT_UNHEALTHY;
   }
   if (!token_current_w (a, tok)) {
      h->rejected_stale++;
      return CQC_ADMIT_STALE;
   }
   /* One entry may use at most a quarter of the ring, so that admitting it
    * never flushes the whole cache. */
   if (need > h->ring_bytes / 4) {
      h->rejected_size++;
      return CQC_ADMIT_TOO_LARGE;
   }
   if (tok->id_cell != CQC_NO_CELL) {
      flags |= CQC_ENTRY_IDENTITY;
   }
   if (slot_find_w (a, hash, key, key_len, tok->ns_idx, &existing)) {
      const cqc_slot_t *e = &a->slots[existing];

      if (same_generations_w (e, tok)) {
         if (e->flags & CQC_ENTRY_CONFLICT) {
            /* A third read under these generations cannot tell which of the
             * disagreeing results is the newer: the marker stays until the
             * pending event moves the generations on. */
            h->rejected_conflict++;
            return CQC_ADMIT_CONFLICT;
         }
         conflict = other_result_w (a, e, flags, val, val_len);
         if (!conflict) {
            /* The same result under the same generations: another read of
             * it (several workers missing one document before its first
             * admission lands, or a read the causal floor sent to MongoDB)
             * is already cached. Writing it again would only move the ring
             * on, evicting live entries early and touching pages no entry
             * needs; a read that began later only moves the entry's stamp
             * on (the result was current then too). */
            refresh_stamp_w (a, existing, &stamp);
            h->admissions++;
            return CQC_ADMIT_OK;
         }
         /* The newer result of two ordered reads replaces the older one,
          * and the older one is not admitted over the newer. */
         switch (order_w (&block_at_w (a, e->block_off)->stamp, &stamp)) {
         case ORDER_OLD_IS_NEWER:
            h->rejected_stale++;
            return CQC_ADMIT_STALE;
         case ORDER_NEW_IS_NEWER:
            conflict = false;
            break;
         default:
            break;
         }
      }
      /* An entry the main ring holds keeps its place in it when a write
       * replaces it: the key was hot. */
      to_main = !in_small_w (a, e->block_off);
      slot_remove_w (a, existing);
      if (conflict) {
         /* Replace the entry by a marker: no value, never served. */
         flags = (uint16_t) ((flags & CQC_ENTRY_IDENTITY) | CQC_ENTRY_CONFLICT);
         val = NULL;
         val_len = 0;
         stamp = (cqc_stamp_t){0};
         need = align_up ((uint64_t) CQC_BLOCK_HEADER + key_len, 8);
      }
   }
   /* Moves are paid from what admissions bring (ring_pop_w). */
   h->move_credit += MOVE_CREDIT_PER_BYTE * need;
   if (h->move_credit > h->ring_bytes / 4) {
      h->move_credit = h->ring_bytes / 4;
   }
   /* Keep the table at most 3/4 full so probe chains stay short. */
   while (h->entries >= (uint64_t) h->geo.slot_count / 4 * 3 && (h->ring_span || h->small_span)) {
      evict_one_w (a);
   }
   /* New keys start in the small ring once the main ring is full; a key
    * evicted from the small ring recently (the ghost), and an entry too
    * large for it, go to the main ring. */
   r = main_ring (a);
   if (!to_main && (need > h->small_bytes / 2 || ring_fits_w (&r, need))) {
      to_main = true;
   }
   if (!to_main && ghost_take_w (a, hash)) {
      to_main = true;
      h->ghost_hits++;
   }
   r = to_main ? main_ring (a) : small_ring (a);
   if (!ring_alloc_w (a, &r, need, &off)) {
      h->rejected_size++;
      return CQC_ADMIT_TOO_LARGE;
   }
   bh = block_at_w (a, off);
   bh->magic = BLOCK_MAGIC;
   STORE_RELAXED (&bh->gen, (uint32_t) ++h->block_gen);
   bh->len = (uint32_t) need;
   bh->slot = CQC_NO_CELL;
   memcpy (a->ring + off + CQC_BLOCK_HEADER, key, key_len);
   if (val_len) {
      memcpy (a->ring + off + CQC_BLOCK_HEADER + key_len, val, val_len);
   }
   bh->stamp = stamp;
   bh->sum = entry_sum (flags, key_len, val_len ? (const void *) val : "", val_len, &stamp);

   for (n = 0, i = (uint32_t) hash & mask; n < CQC_MAX_PROBE; n++, i = (i + 1) & mask) {
      if (a->slots[i].state == 0) {
         break;
      }
   }
   if (n == CQC_MAX_PROBE) {
      /* The block stays unreferenced; the tail reclaims it. */
      h->rejected_probe++;
      return CQC_ADMIT_NO_SLOT;
   }
   bh->slot = i;
   s = &a->slots[i];
   slot_begin_w (s);
   s->state = 1;
   s->flags = flags;
   s->hash = hash;
   s->block_off = (uint32_t) off;
   s->block_gen = bh->gen;
   s->key_len = key_len;
   s->val_len = val_len;
   s->ns_idx = tok->ns_idx;
   s->id_cell = tok->id_cell;
   s->ns_epoch = tok->ns_epoch;
   s->gen = tok->gen;
   s->db_inc = tok->db_inc;
   s->base = 0;
   slot_end_w (s);
   h->used_bytes += need;
   h->entries++;
   if (!to_main) {
      h->small_entries++;
   }
   if (conflict) {
      h->rejected_conflict++;
      return CQC_ADMIT_CONFLICT;
   }
   h->admissions++;
   return CQC_ADMIT_OK;
}

/* ======================================================================== */
/* Writer: invalidation and health                                          */
/* ======================================================================== */

void
cqc_arena_w_invalidate_id (cqc_arena_t *a, uint32_t ns_idx, uint32_t id_cell)
{
   if (id_cell < a->geo.idgen_count) {
      STORE (&a->idgen[id_cell], a->idgen[id_cell] + 1u);
   }
   if (ns_idx < a->geo.ns_count) {
      STORE (&a->nss[ns_idx].write_gen, a->nss[ns_idx].write_gen + 1u);
   }
   a->hdr->invalidations++;
}

void
cqc_arena_w_invalidate_ns (cqc_arena_t *a, uint32_t ns_idx)
{
   if (ns_idx < a->geo.ns_count) {
      cqc_ns_t *ns = &a->nss[ns_idx];
      STORE (&ns->epoch, ns->epoch + 1u);
      STORE (&ns->write_gen, ns->write_gen + 1u);
   }
   a->hdr->invalidations++;
}

void
cqc_arena_w_invalidate_db (cqc_arena_t *a, uint32_t db_idx)
{
   if (db_idx < a->geo.db_count) {
      STORE (&a->dbs[db_idx].incarnation, a->dbs[db_idx].incarnation + 1u);
   }
   a->hdr->invalidations++;
}

void
cqc_arena_w_set_health (cqc_arena_t *a, uint32_t db_idx, cqc_stream_state_t st)
{
   if (db_idx < a->geo.db_count) {
      if (st == CQC_STREAM_HEALTHY) {
         STORE (&a->dbs[db_idx].progress_ns, cqc_now_ns ());
      }
      STORE (&a->dbs[db_idx].health, (uint32_t) st);
   }
}

void
cqc_arena_w_progress (cqc_arena_t *a, uint32_t db_idx)
{
   if (db_idx < a->geo.db_count) {
      STORE (&a->dbs[db_idx].progress_ns, cqc_now_ns ());
   }
}
