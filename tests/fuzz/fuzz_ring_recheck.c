/*
 * fuzz_ring_recheck.c - the owner's drain while the worker (or any process
 * of the user) rewrites the ring: the record bytes change after the drain
 * checked them, and before and while the owner parses and admits them.
 *
 * Input: u8 records (1-8), each: u8 ns, u8 flags (1 identity filter
 *        {_id: id} (else the query {x: id}), 2 not found), u8 id, u8 vlen,
 *        vlen value bytes; then, for each record the drain hands on, u8
 *        patch count and patches (fuzz_common.h) over the ring's header, its
 *        data area, or its first 512 bytes of data (where the records lie).
 *
 * The records are pushed by the real producer with tokens captured from a
 * real arena, then drained by cqc_ring_drain into owner.c's admit_record
 * (static there, so this file includes owner.c), through a callback that
 * first rewrites the segment with the record's patches. Checks:
 *   - the record handed on does not change when the segment does (it is
 *     the consumer's private copy: ring.h), before or after admit_record;
 *   - no crash, no out-of-bounds access (arena and ring are exactly sized);
 *   - afterwards, every hit is byte for byte the value of a record pushed
 *     under that key, and a cached "not found" was pushed as one: bytes
 *     written into the ring after the drain checked them are never served.
 */
#include "../../csrc/owner.c"

#include "fuzz_common.h"

#define NS_N 2
#define REC_MAX 8

static const char *const DB_OF[NS_N] = {"d", "d"};
static const char *const COLL_OF[NS_N] = {"a", "b"};

typedef struct {
   uint8_t key[64];
   uint32_t key_len;
   uint32_t ns;
   bool not_found;
   uint8_t val[300];
   uint32_t val_len;
} rec_t;

typedef struct {
   cqc_arena_t a;
   uint8_t *mem;
   pthread_mutex_t lock;
   uint32_t ns_idx[NS_N], db_idx[NS_N];
   cqc_owner_t owner;
   uint8_t *ring;
   uint64_t ring_size;
   cqc_ring_producer_t prod;
   rec_t rec[REC_MAX];
   uint32_t n;
   cursor_t *c;
   uint64_t handed;
} world_t;

/* A deep copy of a record as handed on. */
typedef struct {
   cqc_ring_record_t r;
   uint8_t *bytes;
} snap_t;

static void
snap_take (snap_t *s, const cqc_ring_record_t *r)
{
   s->r = *r;
   s->bytes = malloc ((size_t) r->flen + r->rlen + r->vlen + 1u);
   FUZZ_CHECK (s->bytes, "out of memory");
   memcpy (s->bytes, r->filter, r->flen);
   memcpy (s->bytes + r->flen, r->rest, r->rlen);
   memcpy (s->bytes + r->flen + r->rlen, r->value, r->vlen);
}

static void
snap_same (const snap_t *s, const cqc_ring_record_t *r, const char *when)
{
   FUZZ_CHECK (r->kind == s->r.kind && r->not_found == s->r.not_found &&
                  !memcmp (&r->token, &s->r.token, sizeof r->token) && r->flen == s->r.flen &&
                  r->rlen == s->r.rlen && r->vlen == s->r.vlen && r->filter == s->r.filter &&
                  r->rest == s->r.rest && r->value == s->r.value &&
                  !memcmp (r->filter, s->bytes, r->flen) &&
                  !memcmp (r->rest, s->bytes + r->flen, r->rlen) &&
                  !memcmp (r->value, s->bytes + r->flen + r->rlen, r->vlen),
               "the record handed on changed %s", when);
}

/* The drain's callback: the segment changes, then the owner admits. */
static void
patch_then_admit (void *ctx, const cqc_ring_record_t *r)
{
   world_t *w = ctx;
   region_t regions[3] = {{0, CQC_RING_DATA_OFF},
                          {CQC_RING_DATA_OFF, w->ring_size - CQC_RING_DATA_OFF},
                          {CQC_RING_DATA_OFF, 512}};
   snap_t s;

   w->handed++;
   snap_take (&s, r);
   apply_patches (w->c, w->ring, w->ring_size, regions, 3, cur_u8 (w->c) % 9u);
   snap_same (&s, r, "when the segment changed");
   admit_record (&w->owner, r);
   snap_same (&s, r, "during admit_record");
   free (s.bytes);
}

static void
push (world_t *w, cursor_t *c)
{
   uint32_t ns = cur_u8 (c) % NS_N;
   uint8_t flags = cur_u8 (c);
   int32_t id = cur_u8 (c);
   uint32_t vlen = cur_u8 (c);
   bool identity = flags & 1;
   uint8_t raw[255];
   bson_t filter = BSON_INITIALIZER;
   cqc_token_t tok;
   uint32_t cell = CQC_NO_CELL;
   rec_t *r = &w->rec[w->n];

   memset (r, 0, sizeof *r);
   cur_bytes (c, raw, vlen);
   r->ns = ns;
   r->not_found = flags & 2;
   BSON_APPEND_INT32 (&filter, identity ? "_id" : "x", id);
   if (!r->not_found) {
      bson_t v = BSON_INITIALIZER;
      BSON_APPEND_INT32 (&v, "_id", id);
      BSON_APPEND_BINARY (&v, "p", BSON_SUBTYPE_BINARY, raw, vlen);
      memcpy (r->val, bson_get_data (&v), v.len);
      r->val_len = v.len;
      bson_destroy (&v);
   }
   if (identity) {
      uint64_t h = 0;
      FUZZ_CHECK (cqc_filter_identity (bson_get_data (&filter), filter.len, &h),
                  "{_id: int} refused");
      cell = cqc_id_cell (h, w->ns_idx[ns], w->a.geo.idgen_count);
   }
   cqc_arena_r_capture (&w->a, w->ns_idx[ns], cell, &tok);
   r->key_len = CQC_KEY_FIXED + filter.len;
   cqc_key_write (r->key, 1, w->ns_idx[ns], bson_get_data (&filter), filter.len, NULL, 0);
   if (cqc_ring_push (&w->prod, 1, r->not_found, &tok, bson_get_data (&filter), filter.len,
                      NULL, 0, r->not_found ? NULL : r->val, r->val_len) == CQC_RING_PUSHED) {
      w->n++;
   }
   bson_destroy (&filter);
}

static void
check_hits (world_t *w)
{
   uint32_t i, j;
   for (i = 0; i < w->n; i++) {
      const rec_t *r = &w->rec[i];
      copy_t cp;
      bool fine = false;
      cqc_lookup_t res = lookup_copy (&w->a, w->ns_idx[r->ns],
                                      cqc_hash_bytes (r->key, r->key_len, 0), r->key, r->key_len,
                                      &cp);
      if (res == CQC_LOOKUP_MISS) {
         continue;
      }
      for (j = 0; j < w->n; j++) {
         const rec_t *o = &w->rec[j];
         if (o->key_len != r->key_len || memcmp (o->key, r->key, r->key_len)) {
            continue;
         }
         fine |= res == CQC_LOOKUP_NOT_FOUND
                    ? o->not_found
                    : !o->not_found && o->val_len == cp.len && !memcmp (o->val, cp.buf, cp.len);
      }
      FUZZ_CHECK (fine, "record %u: served %zu bytes (%s) no record pushed under its key holds",
                  i, cp.len, res == CQC_LOOKUP_NOT_FOUND ? "not found" : "a document");
      free (cp.buf);
   }
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   cursor_t c = {data, size};
   world_t *w = calloc (1, sizeof *w);
   uint64_t arena_size, n;
   uint32_t count, k;

   FUZZ_CHECK (w, "out of memory");
   w->mem = new_arena (&w->a, small_geometry (1), &arena_size, DB_OF, COLL_OF, NS_N, w->ns_idx,
                       w->db_idx);
   pthread_mutex_init (&w->lock, NULL);
   w->owner.w.arena = &w->a;
   w->owner.w.lock = &w->lock;
   w->ring_size = CQC_RING_DATA_OFF + 8192u;
   w->ring = calloc (1, w->ring_size);
   FUZZ_CHECK (w->ring && cqc_ring_format (&w->prod, w->ring, w->ring_size, 1), "no ring");
   w->c = &c;

   count = 1u + cur_u8 (&c) % REC_MAX;
   for (k = 0; k < count; k++) {
      push (w, &c);
   }
   n = cqc_ring_drain (w->ring, w->ring_size, patch_then_admit, w);
   FUZZ_CHECK (n == w->handed && w->owner.stats.records == n, "drained %llu, handed %llu",
               (unsigned long long) n, (unsigned long long) w->handed);
   check_hits (w);

   pthread_mutex_destroy (&w->lock);
   free (w->ring);
   free (w->mem);
   free (w);
   return 0;
}
