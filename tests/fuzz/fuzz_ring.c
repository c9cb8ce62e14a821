/*
 * fuzz_ring.c - the owner's side of a worker's admission ring (the
 * consumer, cqc_ring_drain) against ring bytes the worker controls.
 *
 * Input: u8 size | ops... | 0xff | u8 patch count | patches...
 *   push   u8 kind, u8 not_found, 40 token bytes, u8 flen, u8 rlen,
 *          u16 vlen (mod 2048), then the filter, rest and value bytes
 *   drain
 * Patches go into the header (magic, capacity, head, tail, counters) or the
 * data area, or anywhere in the segment.
 *
 * The segment is a buffer of exactly its size (ASan sees any read or write
 * past it), formatted with cqc_ring_format and filled by the real producer,
 * cqc_ring_push; drains between pushes make records wrap and pad. Checks:
 *
 *   always:     every record handed to the callback is the consumer's
 *               private copy, outside the segment (ring.h: nothing checked
 *               can change under the consumer), its parts contiguous;
 *   unpatched:  every drain yields exactly the records pushed and not
 *               dropped, in order, byte for byte (kind, not_found, token,
 *               filter, rest, value);
 *   patched:    the drain returns and leaves tail == head (a malformed ring
 *               is reset, not followed); the producer, whose header may now
 *               say anything (capacity, head, tail...), writes only inside
 *               the segment and drops at most the next record;
 *   afterwards: whatever the patches did, the ring recovers: after one
 *               drain, one push (perhaps dropped as damaged) and another
 *               drain, a record pushed is drained intact.
 */
#include "fuzz_common.h"
#include "ring.h"

#define QUEUE_MAX 256

typedef struct {
   uint8_t kind;
   bool not_found;
   cqc_token_t tok;
   uint8_t *bytes; /* filter | rest | value */
   uint32_t flen, rlen, vlen;
} rec_t;

typedef struct {
   const uint8_t *seg; /* the whole segment */
   uint64_t seg_size;
   cqc_ring_producer_t prod;
   cqc_ring_push_t last; /* what the last push_one returned */
   bool exact; /* compare with the queue */
   rec_t q[QUEUE_MAX];
   uint32_t head, tail; /* queue indexes (pushed, drained) */
   uint64_t seen;
} state_t;

static void
on_record (void *ctx, const cqc_ring_record_t *r)
{
   state_t *st = ctx;
   const uint8_t *end = st->seg + st->seg_size;

   st->seen++;
   FUZZ_CHECK (r->filter + r->flen + r->rlen + r->vlen <= st->seg || r->filter >= end,
               "the record handed on points into the shared segment");
   FUZZ_CHECK (r->rest == r->filter + r->flen && r->value == r->rest + r->rlen,
               "record parts not contiguous");
   if (st->exact) {
      rec_t *e;
      FUZZ_CHECK (st->tail != st->head, "a record that was never pushed");
      e = &st->q[st->tail++ % QUEUE_MAX];
      FUZZ_CHECK (r->kind == e->kind && r->not_found == e->not_found &&
                     memcmp (&r->token, &e->tok, sizeof e->tok) == 0 && r->flen == e->flen &&
                     r->rlen == e->rlen && r->vlen == e->vlen &&
                     memcmp (r->filter, e->bytes, e->flen) == 0 &&
                     memcmp (r->rest, e->bytes + e->flen, e->rlen) == 0 &&
                     memcmp (r->value, e->bytes + e->flen + e->rlen, e->vlen) == 0,
                  "record %u drained differs from the one pushed", st->tail - 1);
      free (e->bytes);
      e->bytes = NULL;
   }
}

static void
push_one (state_t *st, cursor_t *c)
{
   rec_t r;
   bool ok;

   r.kind = cur_u8 (c);
   r.not_found = cur_u8 (c) & 1;
   cur_bytes (c, (uint8_t *) &r.tok, sizeof r.tok);
   r.flen = cur_u8 (c);
   r.rlen = cur_u8 (c);
   r.vlen = cur_u16 (c) % 2048u;
   r.bytes = malloc (r.flen + r.rlen + r.vlen + 1u);
   FUZZ_CHECK (r.bytes, "out of memory");
   cur_bytes (c, r.bytes, r.flen + r.rlen + r.vlen);
   st->last = cqc_ring_push (&st->prod, r.kind, r.not_found, &r.tok, r.bytes, r.flen,
                             r.bytes + r.flen, r.rlen, r.bytes + r.flen + r.rlen, r.vlen);
   ok = st->last == CQC_RING_PUSHED;
   if (!ok || st->head - st->tail == QUEUE_MAX) {
      /* Dropped (ring full), or more than the queue remembers: then stop
       * comparing rather than remember less. */
      if (ok) {
         st->exact = false;
      }
      free (r.bytes);
      return;
   }
   st->q[st->head++ % QUEUE_MAX] = r;
}

static void
drain (state_t *st, void *mem, uint64_t size)
{
   const cqc_ring_header_t *h = mem;
   uint32_t before = st->head - st->tail;
   uint64_t n = cqc_ring_drain (mem, size, on_record, st);

   FUZZ_CHECK (h->tail == h->head, "drain left tail %llu, head %llu",
               (unsigned long long) h->tail, (unsigned long long) h->head);
   if (st->exact) {
      FUZZ_CHECK (n == before && st->tail == st->head, "drained %llu of %u records",
                  (unsigned long long) n, before);
   }
   while (st->tail != st->head) {
      free (st->q[st->tail++ % QUEUE_MAX].bytes);
   }
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   cursor_t c = {data, size};
   uint64_t seg = CQC_RING_DATA_OFF + 4096u + (uint64_t) cur_u8 (&c) * 40u;
   uint8_t *mem = calloc (1, seg);
   state_t *st = calloc (1, sizeof *st);
   region_t regions[2] = {{0, CQC_RING_DATA_OFF}, {CQC_RING_DATA_OFF, 0}};
   uint32_t touched, steps;
   const cqc_ring_header_t *h = (const cqc_ring_header_t *) mem;

   FUZZ_CHECK (mem && st, "out of memory");
   FUZZ_CHECK (cqc_ring_format (&st->prod, mem, seg, 4242), "format refused %llu bytes",
               (unsigned long long) seg);
   FUZZ_CHECK (cqc_ring_check (mem, seg), "a formatted ring fails its check");
   st->seg = mem;
   st->seg_size = seg;
   st->exact = true;
   regions[1].len = h->capacity;

   for (steps = 0; steps < 128 && c.n; steps++) {
      uint8_t op = cur_u8 (&c);
      if (op == 0xff) {
         break;
      }
      if (op % 4 == 3) {
         drain (st, mem, seg);
      } else {
         push_one (st, &c);
      }
   }

   touched = apply_patches (&c, mem, seg, regions, 2, cur_u8 (&c) % 9u);
   if (touched) {
      st->exact = false;
   }
   drain (st, mem, seg);

   /* Recovery, whatever the patches did: the producer keeps its capacity
    * and head privately and writes its header again when it finds it
    * changed; the consumer resets a ring that makes no sense. */
   {
      uint8_t rec[64];
      cursor_t rc = {rec, sizeof rec};
      memset (rec, 0x5a, sizeof rec);
      st->exact = false;
      push_one (st, &rc); /* may be dropped: the header was not the producer's */
      drain (st, mem, seg);
      st->exact = true;
      st->seen = 0;
      rc = (cursor_t){rec, sizeof rec};
      push_one (st, &rc);
      FUZZ_CHECK (st->last == CQC_RING_PUSHED, "the ring did not recover: push returned %d",
                  (int) st->last);
      drain (st, mem, seg);
      FUZZ_CHECK (st->seen == 1, "the ring did not recover: %llu records",
                  (unsigned long long) st->seen);
   }
   free (st);
   free (mem);
   return 0;
}
