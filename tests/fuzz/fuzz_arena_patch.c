/*
 * fuzz_arena_patch.c - the arena's lock-free reader against a corrupted
 * arena that a real writer built.
 *
 * Input, read as a stream (see fuzz_common.h):
 *   u8 geometry | ops... | 0xff | u8 patch count | patches... | u8 name len | name
 * An op is u8 opcode then its operands:
 *   admit       u8 key, u8 flags (1 not found, 2 invalidate between capture
 *               and admission), u8 len, len value bytes
 *   inval_id    u8 key, u8 cell        inval_ns   u8 key
 *   inval_db    u8 key                 health     u8 key, u8 state
 *   clear       lookup      u8 key (a hit marks the access map)
 *   scribble    u8 cell, u32 value (anything written into the access map)
 * A patch is (region, u32 offset, u8 length, bytes) into one of the
 * header, database, namespace, identity, slot or ring regions, or anywhere.
 *
 * The harness keeps a model: for each of 24 keys (3 namespaces in 2
 * databases; per namespace 4 identity keys find_one {_id: i} and 4 query
 * keys count_documents {x: i}) the value last admitted, whether it is still
 * valid (no invalidation it depends on since), and every value ever admitted
 * under the key. Then it reads through the writer's own view (process-local
 * mode) and through a view made by cqc_arena_r_attach (a worker), and checks:
 *
 *   always            no crash, no out-of-bounds access (ASan; the arena is
 *                     exactly the size the geometry needs), no hang, no copy
 *                     longer than the ring, attach's view inside the mapping,
 *                     captured tokens with in-range indexes;
 *   no patch          a hit is the key's last admission, still valid, byte
 *                     for byte; a "not found" hit is a valid cached miss;
 *                     every registered namespace is found at its index;
 *   patches only in the header, databases, namespaces or identity cells
 *                     (what the reader validates): a hit is byte for byte a
 *                     value once admitted under that key (rolled-back
 *                     generations may serve an older one); for the attached
 *                     view the header must be untouched, since it moves
 *                     every region;
 *   patches also in the ring, none on a live block's checksum: the same. A
 *                     reader serves a copy only if it matches the sum the
 *                     writer stored in the block header, so changed value
 *                     bytes, a moved or truncated value are never served;
 *   patches in slots, anywhere, or on a block's checksum: memory safety
 *                     only. Those can forge an entry (point a slot at bytes
 *                     laid out as a block, with the sum of what follows):
 *                     the sum catches corruption, not a forger
 *                     (docs/fuzzing.md).
 */
#include "fuzz_common.h"

#define NS_N 3
#define KEYS_PER_NS 8
#define KEY_N (NS_N * KEYS_PER_NS)
#define STEPS_MAX 160 /* writer ops per input */
#define HIST_MAX STEPS_MAX /* every admission of a program is remembered */
#define VAL_MAX 255

typedef struct {
   uint8_t key[64];
   uint32_t key_len;
   uint64_t hash;
   uint32_t ns; /* model namespace 0..NS_N-1 */
   bool identity;
   uint32_t cell; /* identity cell, CQC_NO_CELL otherwise */
   /* model */
   bool valid;
   bool not_found;
   uint8_t val[VAL_MAX];
   uint32_t val_len;
} key_model_t;

typedef struct {
   uint32_t key;
   bool not_found;
   uint8_t val[VAL_MAX];
   uint32_t val_len;
} admitted_t;

typedef struct {
   cqc_arena_t a;
   uint8_t *mem;
   uint64_t size;
   uint32_t ns_idx[NS_N];
   uint32_t db_idx[NS_N];
   key_model_t keys[KEY_N];
   admitted_t hist[HIST_MAX];
   uint32_t nhist;
} world_t;

static const char *const DB_OF[NS_N] = {"d0", "d0", "d1"};
static const char *const COLL_OF[NS_N] = {"a", "b", "a"};

/* {"<field>": int32 v} */
static uint32_t
int_filter (uint8_t *out, const char *field, int32_t v)
{
   size_t fl = strlen (field);
   uint32_t len = (uint32_t) (4 + 1 + fl + 1 + 4 + 1);
   uint8_t *p = out;
   memcpy (p, &len, 4);
   p += 4;
   *p++ = 0x10;
   memcpy (p, field, fl + 1);
   p += fl + 1;
   memcpy (p, &v, 4);
   p += 4;
   *p = 0;
   return len;
}

static void
build_world (world_t *w, uint8_t geo_sel)
{
   uint32_t k;

   memset (w, 0, sizeof *w);
   w->mem = new_arena (&w->a, small_geometry (geo_sel), &w->size, DB_OF, COLL_OF, NS_N,
                       w->ns_idx, w->db_idx);
   /* The eviction policy's state, as a process-local cache has it. */
   w->a.access = calloc (cqc_access_cells (&w->a.geo), sizeof (uint32_t));
   w->a.access_mask = cqc_access_cells (&w->a.geo) - 1u;
   FUZZ_CHECK (w->a.access && cqc_arena_w_policy_init (&w->a), "out of memory");
   for (k = 0; k < KEY_N; k++) {
      key_model_t *km = &w->keys[k];
      uint8_t filter[32];
      uint32_t i = k % KEYS_PER_NS, flen;
      uint64_t id_hash;

      km->ns = k / KEYS_PER_NS;
      km->identity = i < 4;
      flen = int_filter (filter, km->identity ? "_id" : "x", (int32_t) i);
      km->cell = CQC_NO_CELL;
      if (cqc_filter_identity (filter, flen, &id_hash)) {
         km->cell = cqc_id_cell (id_hash, w->ns_idx[km->ns], w->a.geo.idgen_count);
      }
      FUZZ_CHECK ((km->cell != CQC_NO_CELL) == km->identity,
                  "{_id: %u} is not an identity filter", i);
      km->key_len = CQC_KEY_FIXED + flen;
      cqc_key_write (km->key, km->identity ? 1 : 2, w->ns_idx[km->ns], filter, flen, NULL, 0);
      km->hash = cqc_hash_bytes (km->key, km->key_len, 0);
   }
}

/* ------------------------------------------------------------------------ */
/* Writer program                                                           */
/* ------------------------------------------------------------------------ */

static void
model_invalidate (world_t *w, bool (*hit) (const world_t *, const key_model_t *, uint32_t),
                  uint32_t arg)
{
   uint32_t k;
   for (k = 0; k < KEY_N; k++) {
      if (hit (w, &w->keys[k], arg)) {
         w->keys[k].valid = false;
      }
   }
}

/* What each invalidation makes stale (arena.h: generations). */
static bool
by_cell_or_ns_writes (const world_t *w, const key_model_t *km, uint32_t arg)
{
   uint32_t ns = arg >> 16, cell = arg & 0xffffu;
   (void) w;
   return km->identity ? km->cell == cell : km->ns == ns;
}

static bool
by_ns (const world_t *w, const key_model_t *km, uint32_t ns)
{
   (void) w;
   return km->ns == ns;
}

static bool
by_db (const world_t *w, const key_model_t *km, uint32_t db_idx)
{
   return w->db_idx[km->ns] == db_idx;
}

static bool
any_key (const world_t *w, const key_model_t *km, uint32_t arg)
{
   (void) w;
   (void) km;
   (void) arg;
   return true;
}

static void
op_admit (world_t *w, cursor_t *c)
{
   key_model_t *km = &w->keys[cur_u8 (c) % KEY_N];
   uint8_t flags = cur_u8 (c);
   bool not_found = flags & 1;
   uint32_t len = cur_u8 (c);
   uint8_t val[VAL_MAX];
   uint32_t ns_idx = w->ns_idx[km->ns];
   cqc_token_t tok;
   cqc_admit_t r;
   bool stale = flags & 2;

   cur_bytes (c, val, len);
   if (not_found) {
      len = 0;
   }
   cqc_arena_r_capture (&w->a, ns_idx, km->cell, &tok);
   if (stale) {
      /* A write lands between the capture and the admission. */
      cqc_arena_w_invalidate_id (&w->a, ns_idx, km->cell);
      model_invalidate (w, by_cell_or_ns_writes, km->ns << 16 | (km->cell & 0xffffu));
   }
   r = cqc_arena_w_admit (&w->a, &tok, km->hash, km->key, km->key_len, not_found ? NULL : val,
                          len, not_found ? CQC_ENTRY_NOT_FOUND : 0);
   if (stale) {
      FUZZ_CHECK (r == CQC_ADMIT_STALE || r == CQC_ADMIT_UNHEALTHY,
                  "a token captured before a write was admitted (%d)", (int) r);
   }
   if (r == CQC_ADMIT_CONFLICT) {
      km->valid = false;
   }
   if (r != CQC_ADMIT_OK) {
      return;
   }
   km->valid = true;
   km->not_found = not_found;
   memcpy (km->val, val, len);
   km->val_len = len;
   if (w->nhist < HIST_MAX) {
      admitted_t *h = &w->hist[w->nhist++];
      h->key = (uint32_t) (km - w->keys);
      h->not_found = not_found;
      memcpy (h->val, val, len);
      h->val_len = len;
   }
}

static void
run_writer (world_t *w, cursor_t *c)
{
   uint32_t steps;

   for (steps = 0; steps < STEPS_MAX && c->n; steps++) {
      uint8_t op = cur_u8 (c);
      key_model_t *km;
      uint32_t ns_idx;

      if (op == 0xff) {
         return; /* end of the program */
      }
      switch (op % 9) {
      case 0:
      case 1:
         op_admit (w, c);
         break;
      case 2: {
         uint32_t cell;
         km = &w->keys[cur_u8 (c) % KEY_N];
         ns_idx = w->ns_idx[km->ns];
         cell = km->identity ? km->cell : cur_u8 (c) % w->a.geo.idgen_count;
         cqc_arena_w_invalidate_id (&w->a, ns_idx, cell);
         model_invalidate (w, by_cell_or_ns_writes, km->ns << 16 | cell);
         break;
      }
      case 3:
         km = &w->keys[cur_u8 (c) % KEY_N];
         cqc_arena_w_invalidate_ns (&w->a, w->ns_idx[km->ns]);
         model_invalidate (w, by_ns, km->ns);
         break;
      case 4:
         km = &w->keys[cur_u8 (c) % KEY_N];
         cqc_arena_w_invalidate_db (&w->a, w->db_idx[km->ns]);
         model_invalidate (w, by_db, w->db_idx[km->ns]);
         break;
      case 5:
         km = &w->keys[cur_u8 (c) % KEY_N];
         cqc_arena_w_set_health (&w->a, w->db_idx[km->ns],
                                 (cqc_stream_state_t) (cur_u8 (c) % 6u));
         break;
      case 6:
         cqc_arena_w_clear (&w->a);
         model_invalidate (w, any_key, 0);
         break;
      case 7: {
         /* A hit marks the writer's access map: later evictions move the
          * entry instead (arena.c, S3-FIFO). */
         copy_t cp;
         km = &w->keys[cur_u8 (c) % KEY_N];
         (void) lookup_copy (&w->a, w->ns_idx[km->ns], km->hash, km->key, km->key_len, &cp);
         free (cp.buf);
         break;
      }
      case 8: {
         /* A process that writes anything into its map: eviction may
          * choose differently, a hit must still be exact. */
         uint32_t cell = cur_u8 (c), v = 0, b;
         for (b = 0; b < 4; b++) {
            v |= (uint32_t) cur_u8 (c) << (8 * b);
         }
         w->a.access[cell & w->a.access_mask] = v;
         break;
      }
      }
   }
}

/* ------------------------------------------------------------------------ */
/* Reader checks                                                            */
/* ------------------------------------------------------------------------ */

typedef enum { TRUST_EXACT, TRUST_ADMITTED, TRUST_NONE } trust_t;

static bool
was_admitted (const world_t *w, uint32_t key, const copy_t *cp, cqc_lookup_t r)
{
   uint32_t i;
   for (i = 0; i < w->nhist; i++) {
      const admitted_t *h = &w->hist[i];
      if (h->key != key) {
         continue;
      }
      if (r == CQC_LOOKUP_NOT_FOUND ? h->not_found
                                    : (!h->not_found && h->val_len == cp->len &&
                                       memcmp (h->val, cp->buf, cp->len) == 0)) {
         return true;
      }
   }
   return false;
}

static void
check_key_lookups (const world_t *w, const cqc_arena_t *view, trust_t trust)
{
   uint32_t k;

   for (k = 0; k < KEY_N; k++) {
      const key_model_t *km = &w->keys[k];
      bool stalled;
      copy_t cp;
      cqc_lookup_t r;

      (void) cqc_arena_r_db_state (view, w->db_idx[km->ns], &stalled);
      r = lookup_copy (view, w->ns_idx[km->ns], km->hash, km->key, km->key_len, &cp);
      if (r != CQC_LOOKUP_MISS && trust == TRUST_EXACT) {
         FUZZ_CHECK (km->valid, "key %u served after an invalidation or never admitted", k);
         FUZZ_CHECK ((r == CQC_LOOKUP_NOT_FOUND) == km->not_found,
                     "key %u: lookup %d, last admitted not_found=%d", k, (int) r,
                     (int) km->not_found);
         if (r == CQC_LOOKUP_HIT) {
            FUZZ_CHECK (cp.len == km->val_len && memcmp (cp.buf, km->val, cp.len) == 0,
                        "key %u: served %zu bytes that are not its last admission", k, cp.len);
         }
      } else if (r != CQC_LOOKUP_MISS && trust == TRUST_ADMITTED) {
         FUZZ_CHECK (was_admitted (w, k, &cp, r),
                     "key %u: served %s (%zu bytes) never admitted under it", k,
                     r == CQC_LOOKUP_HIT ? "a value" : "not found", cp.len);
      }
      free (cp.buf);
   }
}

static void
check_other_readers (const world_t *w, const cqc_arena_t *view, bool names_intact,
                     cursor_t *c)
{
   char name[CQC_NS_NAME_MAX + 8];
   uint32_t n, i, idx;
   bool stalled;

   for (n = 0; n < NS_N; n++) {
      int len = snprintf (name, sizeof name, "%s.%s", DB_OF[n], COLL_OF[n]);
      bool found = cqc_arena_r_ns_find (view, name, (size_t) len, &idx);
      if (found) {
         FUZZ_CHECK (idx < view->geo.ns_count, "ns_find returned index %u", idx);
      }
      if (names_intact) {
         FUZZ_CHECK (found && idx == w->ns_idx[n], "%s not found at its index", name);
      }
   }
   {
      uint32_t len = cur_u8 (c);
      cur_bytes (c, (uint8_t *) name, len);
      if (cqc_arena_r_ns_find (view, name, len, &idx)) {
         FUZZ_CHECK (idx < view->geo.ns_count, "ns_find returned index %u", idx);
      }
   }
   for (i = 0; i < view->geo.ns_count + 2; i++) {
      cqc_token_t tok;
      uint32_t cell = (i & 1) ? CQC_NO_CELL : i * 7u;
      cqc_arena_r_capture (view, i, cell, &tok);
      if (tok.healthy) {
         FUZZ_CHECK (tok.ns_idx < view->geo.ns_count && tok.db_idx < view->geo.db_count,
                     "healthy token with ns %u db %u", tok.ns_idx, tok.db_idx);
         FUZZ_CHECK (tok.id_cell == CQC_NO_CELL || tok.id_cell < view->geo.idgen_count,
                     "token with cell %u", tok.id_cell);
      }
   }
   for (i = 0; i < view->geo.db_count + 2; i++) {
      cqc_stream_state_t st = cqc_arena_r_db_state (view, i, &stalled);
      FUZZ_CHECK ((unsigned) st <= CQC_STREAM_STARTUP_FAILED, "state %d", (int) st);
   }
}

#define MAX_SLOTS 128u

/* The checksums of the blocks the live slots point to, in slot order (read
 * from the unpatched slots: the caller compares two calls). */
static uint32_t
live_block_sums (const cqc_arena_t *a, uint64_t *out)
{
   uint32_t i, n = 0;
   for (i = 0; i < a->geo.slot_count && i < MAX_SLOTS; i++) {
      const cqc_slot_t *s = &a->slots[i];
      if (s->state != 0 && (uint64_t) s->block_off + CQC_BLOCK_HEADER <= a->ring_bytes) {
         memcpy (&out[n++], a->ring + s->block_off + CQC_BLOCK_HEADER - 8u, 8);
      }
   }
   return n;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   cursor_t c = {data, size};
   world_t *w = malloc (sizeof *w);
   region_t regions[R_COUNT];
   uint32_t touched;
   cqc_arena_t attached;
   char err[256];
   bool ok;
   /* Patches whose effect on a hit the reader detects: generations and
    * health (validated), value bytes (checksummed). */
   const uint32_t validated = 1u << R_HEADER | 1u << R_DBS | 1u << R_NSS | 1u << R_IDGEN | 1u << R_RING;
   uint64_t sums[MAX_SLOTS], sums_after[MAX_SLOTS];
   uint32_t sums_before;

   FUZZ_CHECK (w, "out of memory");
   build_world (w, cur_u8 (&c));
   run_writer (w, &c);

   arena_regions (&w->a, regions);
   sums_before = live_block_sums (&w->a, sums);
   touched = apply_patches (&c, w->mem, w->size, regions, R_COUNT, cur_u8 (&c) % 9u);
   if (live_block_sums (&w->a, sums_after) != sums_before ||
       memcmp (sums, sums_after, sums_before * sizeof sums[0]) != 0) {
      touched |= 1u << R_SLOTS; /* a checksum changed: trust nothing */
   }

   /* Process-local mode: the writer's own view. Its geometry is private,
    * so a patched header moves nothing. */
   check_key_lookups (w, &w->a,
                      touched == 0                 ? TRUST_EXACT
                      : (touched & ~validated) == 0 ? TRUST_ADMITTED
                                                    : TRUST_NONE);
   probe_every_slot (&w->a);
   check_other_readers (w, &w->a, (touched & (1u << R_NSS | 1u << R_COUNT)) == 0, &c);

   /* A worker: attach to the same bytes, then read. */
   ok = cqc_arena_r_attach (&attached, w->mem, w->size, err, sizeof err);
   if (!(touched & (1u << R_HEADER | 1u << R_COUNT))) {
      FUZZ_CHECK (ok, "attach refused an arena whose header is intact: %s", err);
   }
   if (ok) {
      check_view_in_bounds (&attached, w->mem, w->size);
      check_key_lookups (w, &attached,
                         touched == 0 ? TRUST_EXACT
                         : (touched & ~validated) == 0 && !(touched & 1u << R_HEADER)
                            ? TRUST_ADMITTED
                            : TRUST_NONE);
      probe_every_slot (&attached);
      check_other_readers (w, &attached, (touched & (1u << R_HEADER | 1u << R_NSS |
                                                      1u << R_COUNT)) == 0, &c);
   }

   cqc_arena_w_policy_free (&w->a);
   free (w->a.access);
   free (w->mem);
   free (w);
   return 0;
}
