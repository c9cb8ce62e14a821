/*
 * fuzz_ring_admit.c - what the owner does with a worker's ring: drain it
 * with owner.c's admit_record (static there, so this file includes
 * owner.c) into a real arena, while writes land in between.
 *
 * Input: u8 ops... (0xff ends) | u8 patch count | patches
 *   push   u8 ns, u8 flags, u8 id, u8 vlen, vlen value bytes; flags:
 *          1 identity filter {_id: id} (else the query {x: id}),
 *          2 rebind (find_one by a unique key, validated by the document's
 *            _id: the value becomes {_id: <value's first byte>, p: bytes}),
 *          4 not found, 8 a raw 40-byte token from the input instead of a
 *          captured one, 16 the value is raw bytes, not BSON
 *   write  u8 ns, u8 id: a change event for _id id (cqc_arena_w_invalidate_id)
 *   drain  cqc_ring_drain (..., admit_record, owner)
 *   check  look every pushed key up
 * Patches (after the program, then a last drain and check) go into the
 * ring's header or data.
 *
 * Each record remembers whether a write that its entry depends on came
 * after its token was captured: a write to the namespace for a query entry,
 * to the same identity cell for an identity entry, and for a rebound entry
 * any write to the namespace before the owner drained it (its token is
 * then a namespace token) or one to its document's cell after. Checks:
 *   - no crash, no out-of-bounds access (arena and ring are exactly sized),
 *     no hang; the owner counts every record drained;
 *   - while the ring is unpatched, a hit is byte for byte the value of a
 *     record pushed under that key that no later write made stale; keys
 *     pushed with a raw token (generations as the input says) or rebound
 *     with a raw value (whether it holds an _id is the code's call) are
 *     not judged.
 */
#include "../../csrc/owner.c"

#include "fuzz_common.h"

#define NS_N 3
#define REC_MAX 64

static const char *const DB_OF[NS_N] = {"d", "d", "o"};
static const char *const COLL_OF[NS_N] = {"a", "b", "a"};

typedef enum { M_IDENTITY, M_QUERY, M_REBIND, M_UNJUDGED } model_t;

typedef struct {
   uint8_t key[64];
   uint32_t key_len;
   uint32_t ns;
   model_t model;
   uint32_t cell;  /* M_IDENTITY: the filter's cell; M_REBIND: the document's */
   bool drained;   /* handed to admit_record */
   bool not_found;
   bool stale;     /* a write it depends on came after its capture */
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
   bool patched;
   bool untracked;
} world_t;

static uint32_t
id_cell (const world_t *w, uint32_t ns, int32_t id)
{
   bson_t f = BSON_INITIALIZER;
   uint64_t h = 0;
   BSON_APPEND_INT32 (&f, "_id", id);
   FUZZ_CHECK (cqc_filter_identity (bson_get_data (&f), f.len, &h), "{_id: int} refused");
   bson_destroy (&f);
   return cqc_id_cell (h, w->ns_idx[ns], w->a.geo.idgen_count);
}

static void
op_push (world_t *w, cursor_t *c)
{
   uint32_t ns = cur_u8 (c) % NS_N;
   uint8_t flags = cur_u8 (c);
   int32_t id = cur_u8 (c);
   uint32_t vlen = cur_u8 (c);
   uint8_t raw[255], kind;
   bool identity = flags & 1, rebind = (flags & 2) && !identity, raw_value = flags & 16;
   bson_t filter = BSON_INITIALIZER;
   cqc_token_t tok;
   rec_t scratch, *r = w->n < REC_MAX ? &w->rec[w->n] : &scratch;

   memset (r, 0, sizeof *r);
   cur_bytes (c, raw, vlen);
   r->ns = ns;
   r->not_found = flags & 4;
   BSON_APPEND_INT32 (&filter, identity ? "_id" : "x", id);
   kind = identity || rebind ? 1 : 2;
   if (!r->not_found && raw_value) {
      memcpy (r->val, raw, vlen);
      r->val_len = vlen;
   } else if (!r->not_found) {
      bson_t v = BSON_INITIALIZER;
      BSON_APPEND_INT32 (&v, "_id", vlen ? raw[0] : 0);
      BSON_APPEND_BINARY (&v, "p", BSON_SUBTYPE_BINARY, raw, vlen);
      memcpy (r->val, bson_get_data (&v), v.len);
      r->val_len = v.len;
      bson_destroy (&v);
   }
   if (identity) {
      r->model = M_IDENTITY;
      r->cell = id_cell (w, ns, id);
   } else if (rebind && !r->not_found && raw_value) {
      r->model = M_UNJUDGED; /* whether bytes hold an _id is the code's call */
   } else if (rebind && !r->not_found) {
      r->model = M_REBIND;
      r->cell = id_cell (w, ns, vlen ? raw[0] : 0);
   } else {
      r->model = M_QUERY; /* a "not found" is never rebound (owner.c) */
   }
   if (flags & 8) {
      r->model = M_UNJUDGED; /* its generations are whatever the input says */
      cur_bytes (c, (uint8_t *) &tok, sizeof tok);
   } else {
      cqc_arena_r_capture (&w->a, w->ns_idx[ns], identity ? r->cell : CQC_NO_CELL, &tok);
   }
   r->key_len = CQC_KEY_FIXED + filter.len;
   cqc_key_write (r->key, kind, w->ns_idx[ns], bson_get_data (&filter), filter.len, NULL, 0);
   if (cqc_ring_push (&w->prod, (uint8_t) (kind | (rebind ? CQC_KIND_REBIND : 0)), r->not_found,
                      &tok, bson_get_data (&filter), filter.len, NULL, 0,
                      r->not_found ? NULL : r->val, r->val_len) == CQC_RING_PUSHED) {
      if (r == &scratch) {
         w->untracked = true; /* a record the model does not know: stop judging */
      } else {
         w->n++;
      }
   }
   bson_destroy (&filter);
}

/* A change event for {_id: id} in ns: what it makes stale (arena.h). */
static void
op_write (world_t *w, cursor_t *c)
{
   uint32_t ns = cur_u8 (c) % NS_N, i;
   uint32_t cell = id_cell (w, ns, cur_u8 (c));

   pthread_mutex_lock (&w->lock);
   cqc_arena_w_invalidate_id (&w->a, w->ns_idx[ns], cell);
   pthread_mutex_unlock (&w->lock);
   for (i = 0; i < w->n; i++) {
      rec_t *r = &w->rec[i];
      switch (r->model) {
      case M_IDENTITY:
         /* The identity table is shared: a cell may name entries of any
          * namespace. */
         r->stale |= r->cell == cell;
         break;
      case M_QUERY:
         r->stale |= r->ns == ns;
         break;
      case M_REBIND:
         /* Before the owner rebinds it, its token is a namespace token;
          * after, only a write to its document's cell reaches it. */
         r->stale |= r->drained ? r->cell == cell : r->ns == ns;
         break;
      case M_UNJUDGED:
         break;
      }
   }
}

static void
op_drain (world_t *w)
{
   uint64_t before = w->owner.stats.records;
   uint64_t n = cqc_ring_drain (w->ring, w->ring_size, admit_record, &w->owner);
   uint32_t i;

   for (i = 0; i < w->n; i++) {
      w->rec[i].drained = true;
   }
   FUZZ_CHECK (w->owner.stats.records - before == n, "drained %llu, admitted %llu",
               (unsigned long long) n, (unsigned long long) (w->owner.stats.records - before));
}

static void
op_check (world_t *w)
{
   uint32_t i, j;
   for (i = 0; i < w->n; i++) {
      const rec_t *r = &w->rec[i];
      copy_t cp;
      cqc_lookup_t res;
      bool judged = true, fine = false;

      res = lookup_copy (&w->a, w->ns_idx[r->ns], cqc_hash_bytes (r->key, r->key_len, 0),
                         r->key, r->key_len, &cp);
      for (j = 0; j < w->n; j++) {
         const rec_t *o = &w->rec[j];
         if (o->key_len != r->key_len || memcmp (o->key, r->key, r->key_len)) {
            continue;
         }
         if (o->model == M_UNJUDGED) {
            judged = false;
         }
         if (!o->stale && res != CQC_LOOKUP_MISS &&
             (res == CQC_LOOKUP_NOT_FOUND ? o->not_found
                                          : !o->not_found && o->val_len == cp.len &&
                                               !memcmp (o->val, cp.buf, cp.len))) {
            fine = true;
         }
      }
      if (res != CQC_LOOKUP_MISS && judged && !w->patched && !w->untracked) {
         FUZZ_CHECK (fine, "record %u: served %zu bytes no current record holds", i, cp.len);
      }
      free (cp.buf);
   }
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   cursor_t c = {data, size};
   world_t *w = calloc (1, sizeof *w);
   uint64_t arena_size;
   uint32_t steps;
   region_t regions[2];

   FUZZ_CHECK (w, "out of memory");
   w->mem = new_arena (&w->a, small_geometry (1), &arena_size, DB_OF, COLL_OF, NS_N, w->ns_idx,
                       w->db_idx);
   pthread_mutex_init (&w->lock, NULL);
   w->owner.w.arena = &w->a;
   w->owner.w.lock = &w->lock;
   w->ring_size = CQC_RING_DATA_OFF + 8192u;
   w->ring = calloc (1, w->ring_size);
   FUZZ_CHECK (w->ring && cqc_ring_format (&w->prod, w->ring, w->ring_size, 1), "no ring");

   for (steps = 0; steps < 96 && c.n; steps++) {
      uint8_t op = cur_u8 (&c);
      if (op == 0xff) {
         break;
      }
      switch (op % 4) {
      case 0:
         op_push (w, &c);
         break;
      case 1:
         op_write (w, &c);
         break;
      case 2:
         op_drain (w);
         break;
      default:
         op_check (w);
         break;
      }
   }
   regions[0] = (region_t){0, CQC_RING_DATA_OFF};
   regions[1] = (region_t){CQC_RING_DATA_OFF, w->ring_size - CQC_RING_DATA_OFF};
   w->patched = apply_patches (&c, w->ring, w->ring_size, regions, 2, cur_u8 (&c) % 9u) != 0;
   op_drain (w);
   op_check (w);

   pthread_mutex_destroy (&w->lock);
   free (w->ring);
   free (w->mem);
   free (w);
   return 0;
}
