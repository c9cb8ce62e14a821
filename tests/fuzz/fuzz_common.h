/*
 * fuzz_common.h - what the fuzz targets share: reading a fuzzer input as a
 * stream of small fields, a check that aborts (so libFuzzer records the
 * input), patching a memory image, and building a small arena with the
 * writer API.
 *
 * Every target reads its input through a cursor: reading past the end
 * yields zeros, so every input, however short, is a valid program.
 */
#ifndef CQC_FUZZ_COMMON_H
#define CQC_FUZZ_COMMON_H

#include "arena.h"
#include "keys.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A failed property: print it and abort, so the fuzzer keeps the input. */
#define FUZZ_CHECK(cond, ...)                                                 \
   do {                                                                       \
      if (!(cond)) {                                                          \
         fprintf (stderr, "fuzz check failed at %s:%d: %s: ", __FILE__,       \
                  __LINE__, #cond);                                           \
         fprintf (stderr, __VA_ARGS__);                                       \
         fputc ('\n', stderr);                                                \
         abort ();                                                            \
      }                                                                       \
   } while (0)

typedef struct {
   const uint8_t *p;
   size_t n;
} cursor_t;

static inline uint8_t
cur_u8 (cursor_t *c)
{
   uint8_t v = 0;
   if (c->n) {
      v = *c->p++;
      c->n--;
   }
   return v;
}

static inline uint16_t
cur_u16 (cursor_t *c)
{
   uint16_t lo = cur_u8 (c);
   return (uint16_t) (lo | (uint16_t) cur_u8 (c) << 8);
}

static inline uint32_t
cur_u32 (cursor_t *c)
{
   uint32_t lo = cur_u16 (c);
   return lo | (uint32_t) cur_u16 (c) << 16;
}

/* Copy up to len bytes into out; the rest of out is zero. */
static inline void
cur_bytes (cursor_t *c, uint8_t *out, size_t len)
{
   size_t k = len < c->n ? len : c->n;
   memcpy (out, c->p, k);
   memset (out + k, 0, len - k);
   c->p += k;
   c->n -= k;
}

/* ------------------------------------------------------------------------ */
/* Patching a memory image                                                  */
/* ------------------------------------------------------------------------ */

/* A region of an image a patch can aim at. */
typedef struct {
   uint64_t off;
   uint64_t len;
} region_t;

/* Apply `count` patches read from the cursor to base[0, size). A patch is
 * (region selector, offset within the region, length <= 16, bytes); the
 * selector picks one of `regions` (the last selector value means the whole
 * image). Returns a bit mask of the regions written (bit nregions: whole
 * image). */
static inline uint32_t
apply_patches (cursor_t *c, uint8_t *base, uint64_t size, const region_t *regions,
               uint32_t nregions, uint32_t count)
{
   uint32_t touched = 0;
   uint32_t k;

   for (k = 0; k < count && c->n; k++) {
      uint32_t sel = cur_u8 (c) % (nregions + 1);
      uint32_t off = cur_u32 (c);
      uint32_t len = cur_u8 (c) % 17u;
      uint64_t start, rlen;
      uint8_t buf[16];

      if (sel < nregions) {
         start = regions[sel].off;
         rlen = regions[sel].len;
      } else {
         start = 0;
         rlen = size;
      }
      cur_bytes (c, buf, len);
      if (rlen == 0 || len == 0) {
         continue;
      }
      start += off % rlen;
      if (start + len > size) {
         len = (uint32_t) (size - start);
      }
      memcpy (base + start, buf, len);
      touched |= 1u << (sel < nregions ? sel : nregions);
   }
   return touched;
}

/* ------------------------------------------------------------------------ */
/* A small arena                                                            */
/* ------------------------------------------------------------------------ */

/* Small geometry, so that patches land on meaningful bytes: a few
 * databases, 16 namespaces, 64 identity cells, 64 or 128 slots and a ring
 * of 4 to 16 KiB. */
static inline cqc_geometry_t
small_geometry (uint8_t sel)
{
   cqc_geometry_t geo = {0};
   geo.slot_count = (sel & 1) ? 128 : 64;
   /* 4, 8, 16 or 32 KiB: from 16 KiB on, two rings (arena.c, eviction). */
   geo.budget_bytes = 4096u << ((sel >> 1) % 4u);
   geo.ns_count = 16;
   geo.db_count = 4;
   geo.idgen_count = 64;
   return geo;
}

/* Format a zeroed arena of exactly the bytes `geo` needs (so that ASan sees
 * any read past it) and register namespaces db[i].coll[i], each database's
 * stream healthy. Returns the memory; fills ns_idx[] and db_idx[]. */
static inline uint8_t *
new_arena (cqc_arena_t *a, cqc_geometry_t geo, uint64_t *size, const char *const *dbs,
           const char *const *colls, uint32_t n, uint32_t *ns_idx, uint32_t *db_idx)
{
   char err[256];
   uint8_t *mem;
   uint32_t i;

   *size = cqc_arena_required_bytes (&geo);
   mem = calloc (1, *size);
   FUZZ_CHECK (mem, "out of memory");
   FUZZ_CHECK (cqc_arena_format (a, mem, *size, &geo, NULL, err, sizeof err), "%s", err);
   for (i = 0; i < n; i++) {
      FUZZ_CHECK (cqc_arena_w_ns_register (a, dbs[i], strlen (dbs[i]), colls[i],
                                           strlen (colls[i]), &ns_idx[i], err, sizeof err),
                  "%s", err);
      db_idx[i] = a->nss[ns_idx[i]].db_idx;
      cqc_arena_w_set_health (a, db_idx[i], CQC_STREAM_HEALTHY);
   }
   return mem;
}

/* The regions of a formatted arena, in the order the patch selectors use. */
enum { R_HEADER, R_DBS, R_NSS, R_IDGEN, R_SLOTS, R_RING, R_COUNT };

static inline void
arena_regions (const cqc_arena_t *a, region_t *r)
{
   const cqc_arena_header_t *h = a->hdr;
   r[R_HEADER] = (region_t){0, sizeof (cqc_arena_header_t)};
   r[R_DBS] = (region_t){h->db_off, (uint64_t) a->geo.db_count * sizeof (cqc_db_t)};
   r[R_NSS] = (region_t){h->ns_off, (uint64_t) a->geo.ns_count * sizeof (cqc_ns_t)};
   r[R_IDGEN] = (region_t){h->idgen_off, (uint64_t) a->geo.idgen_count * 8u};
   r[R_SLOTS] = (region_t){h->slots_off, (uint64_t) a->geo.slot_count * sizeof (cqc_slot_t)};
   r[R_RING] = (region_t){h->ring_off, a->ring_bytes};
}

/* A view made by cqc_arena_r_attach must lie inside the mapping it was
 * made from, whatever the header said. */
static inline void
check_view_in_bounds (const cqc_arena_t *a, const uint8_t *mem, uint64_t size)
{
   const uint8_t *end = mem + size;
#define IN_BOUNDS(ptr, bytes)                                                 \
   FUZZ_CHECK ((const uint8_t *) (ptr) >= mem &&                              \
                  (uint64_t) (end - (const uint8_t *) (ptr)) >= (uint64_t) (bytes), \
               "%s outside the mapping", #ptr)
   IN_BOUNDS (a->hdr, sizeof (cqc_arena_header_t));
   IN_BOUNDS (a->dbs, (uint64_t) a->geo.db_count * sizeof (cqc_db_t));
   IN_BOUNDS (a->nss, (uint64_t) a->geo.ns_count * sizeof (cqc_ns_t));
   IN_BOUNDS (a->idgen, (uint64_t) a->geo.idgen_count * 8u);
   IN_BOUNDS (a->slots, (uint64_t) a->geo.slot_count * sizeof (cqc_slot_t));
   IN_BOUNDS (a->ring, a->ring_bytes);
#undef IN_BOUNDS
   FUZZ_CHECK (a->geo.slot_count && !(a->geo.slot_count & (a->geo.slot_count - 1)),
               "slot_count %u is not a power of two", a->geo.slot_count);
   FUZZ_CHECK (a->geo.ns_count && !(a->geo.ns_count & (a->geo.ns_count - 1)),
               "ns_count %u is not a power of two", a->geo.ns_count);
   FUZZ_CHECK (a->geo.idgen_count && !(a->geo.idgen_count & (a->geo.idgen_count - 1)),
               "idgen_count %u is not a power of two", a->geo.idgen_count);
}

/* ------------------------------------------------------------------------ */
/* A reader's copy                                                          */
/* ------------------------------------------------------------------------ */

/* The alloc/discard pair a reader passes to cqc_arena_r_lookup, like
 * a hit's copy (build.c): one private buffer per lookup. */
typedef struct {
   uint8_t *buf;
   size_t len;
   uint64_t limit; /* no copy may be longer than the ring */
   int allocs;
} copy_t;

static inline void *
copy_alloc (void *ctx, size_t len)
{
   copy_t *c = ctx;
   FUZZ_CHECK (len <= c->limit, "copy of %zu bytes from a ring of %llu", len,
               (unsigned long long) c->limit);
   FUZZ_CHECK (c->allocs == 0, "two copies in one lookup");
   c->allocs++;
   c->buf = malloc (len ? len : 1);
   c->len = len;
   return c->buf;
}

static inline void
copy_discard (void *ctx)
{
   copy_t *c = ctx;
   free (c->buf);
   c->buf = NULL;
   c->len = 0;
}

static inline cqc_lookup_t
lookup_copy (const cqc_arena_t *a, uint32_t ns_idx, uint64_t hash, const uint8_t *key,
             uint32_t key_len, copy_t *out)
{
   cqc_lookup_t r;
   memset (out, 0, sizeof *out);
   out->limit = a->ring_bytes;
   r = cqc_arena_r_lookup (a, ns_idx, hash, key, key_len, copy_alloc, copy_discard, out);
   if (r != CQC_LOOKUP_HIT) {
      FUZZ_CHECK (out->buf == NULL, "a copy was kept by a lookup that returned %d", (int) r);
   } else {
      FUZZ_CHECK (out->buf != NULL, "a hit without a copy");
   }
   return r;
}

/* Lookups aimed at whatever the slot table holds now (each live slot's
 * hash, namespace and the key bytes its block holds): the probe, bounds and
 * copy paths on arbitrary slots. */
static inline void
probe_every_slot (const cqc_arena_t *a)
{
   uint32_t i;
   for (i = 0; i < a->geo.slot_count && i < 4096; i++) {
      cqc_slot_t s;
      uint8_t key[512];
      copy_t cp;

      memcpy (&s, &a->slots[i], sizeof s);
      if (!s.state || s.key_len > sizeof key) {
         continue;
      }
      memset (key, 0, s.key_len);
      if ((uint64_t) s.block_off + CQC_BLOCK_HEADER + s.key_len <= a->ring_bytes) {
         memcpy (key, a->ring + s.block_off + CQC_BLOCK_HEADER, s.key_len);
      }
      (void) lookup_copy (a, s.ns_idx, s.hash, key, s.key_len, &cp);
      free (cp.buf);
   }
}

#endif
