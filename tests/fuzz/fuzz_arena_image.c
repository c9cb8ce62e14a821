/*
 * fuzz_arena_image.c - a worker attaching to an arena image that comes
 * whole from the fuzzer, header included, then reading it.
 *
 * Input: u8 mode | header bytes (sizeof (cqc_arena_header_t)) | [body] |
 * u8 patch count | patches (fuzz_common.h) | lookup keys...
 *
 *   mode bit 0 clear: the image is the header bytes as given, followed by
 *     u32 n and n body bytes, then zeros up to the header's arena_bytes
 *     (when that lies between the header's size and 256 KiB; the header and
 *     body otherwise). Seeds are images of real arenas (make_seeds.c).
 *   mode bit 0 set: the image is a freshly formatted small arena (geometry
 *     from mode bits 2-4), with entries admitted by the writer when bit 5
 *     is set (u8 count, then per entry u8 key length, u8 value length and
 *     the bytes), and the given header bytes laid over its header when bit
 *     1 is set. This gets past attach's checks often enough to fuzz the
 *     reads behind them.
 * Either way the patches then go anywhere.
 *
 * The image is copied into a buffer of exactly its size, so ASan reports
 * any read past it. Then cqc_arena_r_attach either refuses it or returns a
 * view whose every region lies inside the image (checked here, not only by
 * ASan), with power-of-two tables. With a view, the harness runs every
 * worker-side read: the state of every database, namespace lookups by name,
 * token captures, lookups of keys taken from the input, and a lookup aimed
 * at each live slot (its hash, namespace and the key bytes its block holds),
 * so the probe, bounds and copy paths see arbitrary slots. A copy is never
 * longer than the ring.
 */
#include "fuzz_common.h"

#define IMAGE_MAX (256u * 1024u)

static void
read_everything (const cqc_arena_t *a, cursor_t *c)
{
   uint32_t i, idx;
   bool stalled;
   uint8_t key[300];

   for (i = 0; i < a->geo.db_count && i < 300; i++) {
      (void) cqc_arena_r_db_state (a, i, &stalled);
   }
   (void) cqc_arena_r_db_state (a, cur_u32 (c), &stalled);
   for (i = 0; i < a->geo.ns_count && i < 64; i++) {
      cqc_token_t tok;
      cqc_arena_r_capture (a, i, (i & 1) ? CQC_NO_CELL : i * 0x9e3779b9u, &tok);
      if (tok.healthy) {
         FUZZ_CHECK (tok.db_idx < a->geo.db_count, "healthy token with db %u", tok.db_idx);
         FUZZ_CHECK (tok.id_cell == CQC_NO_CELL || tok.id_cell < a->geo.idgen_count,
                     "token with cell %u", tok.id_cell);
      }
   }
   /* Names: the ones a slot of the namespace table claims, and one from
    * the input. */
   for (i = 0; i < a->geo.ns_count && i < 64; i++) {
      cqc_ns_t ns;
      memcpy (&ns, &a->nss[i], sizeof ns);
      if (ns.name_len < CQC_NS_NAME_MAX &&
          cqc_arena_r_ns_find (a, ns.name, ns.name_len, &idx)) {
         FUZZ_CHECK (idx < a->geo.ns_count, "ns_find returned %u", idx);
      }
   }
   {
      uint32_t len = cur_u8 (c);
      cur_bytes (c, key, len);
      if (cqc_arena_r_ns_find (a, (const char *) key, len, &idx)) {
         FUZZ_CHECK (idx < a->geo.ns_count, "ns_find returned %u", idx);
      }
   }
   /* Keys from the input: u8 length (0 ends), u32 namespace, bytes. */
   while (c->n) {
      uint32_t len = cur_u8 (c), ns_idx;
      copy_t cp;
      if (!len) {
         break;
      }
      ns_idx = cur_u32 (c);
      cur_bytes (c, key, len);
      (void) lookup_copy (a, ns_idx, cqc_hash_bytes (key, len, 0), key, len, &cp);
      free (cp.buf);
   }
   probe_every_slot (a);
}

/* Admit entries through the writer, so the image has live slots and
 * blocks to corrupt. */
static void
populate (cqc_arena_t *w, cursor_t *c)
{
   uint32_t ns_idx, n, count = cur_u8 (c) % 9u;
   char err[256];

   FUZZ_CHECK (cqc_arena_w_ns_register (w, "d", 1, "a", 1, &ns_idx, err, sizeof err), "%s",
               err);
   cqc_arena_w_set_health (w, w->nss[ns_idx].db_idx, CQC_STREAM_HEALTHY);
   for (n = 0; n < count; n++) {
      uint8_t key[64], val[255];
      uint32_t klen = cur_u8 (c) % 64u + 1u, vlen = cur_u8 (c);
      cqc_token_t tok;
      cur_bytes (c, key, klen);
      cur_bytes (c, val, vlen);
      cqc_arena_r_capture (w, ns_idx, CQC_NO_CELL, &tok);
      (void) cqc_arena_w_admit (w, &tok, cqc_hash_bytes (key, klen, 0), key, klen, val, vlen, 0);
   }
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   cursor_t c = {data, size};
   uint8_t mode = cur_u8 (&c);
   cqc_arena_header_t h;
   uint8_t *img = NULL;
   uint64_t img_size;
   cqc_arena_t a;
   char err[256];

   cur_bytes (&c, (uint8_t *) &h, sizeof h);
   if (mode & 1) {
      cqc_geometry_t geo = small_geometry ((uint8_t) ((mode >> 2) & 7u));
      cqc_arena_t w;
      img_size = cqc_arena_required_bytes (&geo);
      img = calloc (1, img_size);
      FUZZ_CHECK (img, "out of memory");
      FUZZ_CHECK (cqc_arena_format (&w, img, img_size, &geo, NULL, err, sizeof err), "%s", err);
      if (mode & 0x20) {
         populate (&w, &c);
      }
      if (mode & 2) {
         memcpy (img, &h, sizeof h);
      }
   } else {
      uint32_t body = cur_u32 (&c) % IMAGE_MAX;
      img_size = h.arena_bytes >= sizeof h && h.arena_bytes <= IMAGE_MAX
                    ? h.arena_bytes
                    : sizeof h + body;
      img = calloc (1, img_size);
      FUZZ_CHECK (img, "out of memory");
      memcpy (img, &h, sizeof h);
      if (body > img_size - sizeof h) {
         body = (uint32_t) (img_size - sizeof h);
      }
      cur_bytes (&c, img + sizeof h, body);
   }
   (void) apply_patches (&c, img, img_size, NULL, 0, cur_u8 (&c) % 17u);

   if (cqc_arena_r_attach (&a, img, img_size, err, sizeof err)) {
      check_view_in_bounds (&a, img, img_size);
      read_everything (&a, &c);
   } else {
      FUZZ_CHECK (err[0] != '\0', "attach failed without a reason");
   }
   free (img);
   return 0;
}
