/*
 * ring.c - see ring.h.
 */
#include "ring.h"
#include "keys.h"

#include <stdlib.h>
#include <string.h>

#define LOAD(p) __atomic_load_n ((p), __ATOMIC_ACQUIRE)
#define LOAD_RELAXED(p) __atomic_load_n ((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n ((p), (v), __ATOMIC_RELEASE)
#define STORE_RELAXED(p, v) __atomic_store_n ((p), (v), __ATOMIC_RELAXED)

/* Fixed part of a record: len, kind_flags, sum, then (from TOKEN_OFF) the
 * token and flen, rlen, vlen. */
#define SUM_OFF 8u
#define TOKEN_OFF 16u
#define LENS_BYTES ((uint32_t) sizeof (cqc_token_t) + 12u)
#define REC_FIXED (TOKEN_OFF + LENS_BYTES)
#define FLAG_NOT_FOUND 0x100u

static uint64_t
align8 (uint64_t v)
{
   return (v + 7u) & ~(uint64_t) 7u;
}

/* The record's sum: a chain of hashes over its length and kind, the token
 * and lengths (`lens`, LENS_BYTES), then filter, rest and value. Computed by
 * the producer from its own arguments (never from the bytes it wrote into
 * the segment) and by the consumer from its private copy. */
static uint64_t
record_sum (uint32_t len, uint32_t kf, const uint8_t *lens, const uint8_t *filter, uint32_t flen,
            const uint8_t *rest, uint32_t rlen, const uint8_t *value, uint32_t vlen)
{
   uint64_t h = cqc_hash_bytes (lens, LENS_BYTES, ((uint64_t) len << 32 | kf) ^ 0x72696e67ull);
   /* An empty part is skipped (the producer may pass NULL for it); the
    * lengths are in `lens`, so both sides skip the same parts. */
   h = flen ? cqc_hash_bytes (filter, flen, h) : h;
   h = rlen ? cqc_hash_bytes (rest, rlen, h) : h;
   return vlen ? cqc_hash_bytes (value, vlen, h) : h;
}

/* ======================================================================== */
/* Producer                                                                 */
/* ======================================================================== */

/* Write the producer's line of the header from its private state. */
static void
publish_header (cqc_ring_producer_t *p)
{
   cqc_ring_header_t *h = (cqc_ring_header_t *) p->mem;
   STORE_RELAXED (&h->version, CQC_RING_VERSION);
   STORE_RELAXED (&h->pid, p->pid);
   STORE_RELAXED (&h->capacity, p->capacity);
   STORE (&h->head, p->head);
   STORE (&h->magic, CQC_RING_MAGIC);
}

static void
publish_counters (cqc_ring_producer_t *p)
{
   cqc_ring_header_t *h = (cqc_ring_header_t *) p->mem;
   STORE_RELAXED (&h->pushed, p->pushed);
   STORE_RELAXED (&h->dropped, p->dropped);
   STORE_RELAXED (&h->damaged, p->damaged);
}

bool
cqc_ring_format (cqc_ring_producer_t *p, void *mem, uint64_t size, uint32_t pid)
{
   memset (p, 0, sizeof *p);
   if (size < CQC_RING_DATA_OFF + 4096u) {
      return false;
   }
   memset (mem, 0, sizeof (cqc_ring_header_t));
   p->mem = mem;
   p->size = size;
   p->capacity = (size - CQC_RING_DATA_OFF) & ~(uint64_t) 7u;
   p->pid = pid;
   publish_header (p); /* the magic last */
   return true;
}

bool
cqc_ring_check (const void *mem, uint64_t size)
{
   const cqc_ring_header_t *h = mem;
   uint64_t cap;
   if (size < CQC_RING_DATA_OFF + 4096u || LOAD (&h->magic) != CQC_RING_MAGIC ||
       LOAD_RELAXED (&h->version) != CQC_RING_VERSION) {
      return false;
   }
   cap = LOAD_RELAXED (&h->capacity);
   return cap >= 4096u && cap % 8u == 0 && cap <= size - CQC_RING_DATA_OFF;
}

/* Whether the producer's line still holds what the producer wrote. */
static bool
header_is_mine (const cqc_ring_producer_t *p)
{
   const cqc_ring_header_t *h = (const cqc_ring_header_t *) p->mem;
   return LOAD_RELAXED (&h->magic) == CQC_RING_MAGIC &&
          LOAD_RELAXED (&h->version) == CQC_RING_VERSION &&
          LOAD_RELAXED (&h->pid) == p->pid && LOAD_RELAXED (&h->capacity) == p->capacity &&
          LOAD_RELAXED (&h->head) == p->head;
}

cqc_ring_push_t
cqc_ring_push (cqc_ring_producer_t *p, uint8_t kind, bool not_found, const cqc_token_t *tok,
               const uint8_t *filter, uint32_t flen, const uint8_t *rest, uint32_t rlen,
               const uint8_t *value, uint32_t vlen)
{
   cqc_ring_header_t *h = (cqc_ring_header_t *) p->mem;
   uint8_t *data = p->mem + CQC_RING_DATA_OFF;
   uint64_t cap = p->capacity; /* private: a changed header cannot move a bound */
   uint64_t need = align8 ((uint64_t) REC_FIXED + flen + rlen + vlen);
   uint64_t head = p->head;
   uint64_t pos = head % cap;
   uint64_t tail, pad = 0, sum;
   uint8_t lens[LENS_BYTES];
   uint32_t len32, kf;
   uint8_t *rec;
   cqc_ring_push_t res = CQC_RING_FULL;

   if (need > 0x7fffffffu || need > cap / 2) {
      res = CQC_RING_TOO_LARGE; /* however empty the ring, it would not fit */
      goto cleanup;
   }
   /* The one shared value the producer uses is the consumer's tail. The
    * consumer only ever stores a head it read, so a tail more than `cap`
    * behind head, or ahead of it (the subtraction wraps), was written by
    * someone else; so was any header field that is not the producer's. */
   tail = LOAD (&h->tail);
   if (!header_is_mine (p) || head - tail > cap) {
      /* Drop the record and write the header again: the consumer resets a
       * ring whose tail or records make no sense to the head it reads (the
       * producer's again from now on), and the ring works again. */
      publish_header (p);
      res = CQC_RING_DAMAGED;
      goto cleanup;
   }
   if (cap - pos < need) {
      pad = cap - pos; /* the record goes to the start of the data area */
   } else if (pos >= CQC_RING_SOFT_WRAP && head + (cap - pos) + need - tail <= cap) {
      /* Far into the ring and the start is free: go back to it. Every page
       * of a ring a worker ever wrote stays resident, so a ring the owner
       * keeps drained touches only its first CQC_RING_SOFT_WRAP bytes plus
       * one record; the rest is room for bursts and the largest entries. */
      pad = cap - pos;
   }
   if (head + pad + need - tail > cap) {
      goto cleanup;
   }
   if (pad) {
      uint32_t padlen = (uint32_t) pad | CQC_RING_PAD;
      memcpy (data + pos, &padlen, 4); /* pad >= 8: records are aligned */
      head += pad;
      pos = 0;
   }
   /* pos + need <= cap: the record lies in the producer's own mapping,
    * whatever the header says. */
   rec = data + pos;
   len32 = (uint32_t) need;
   kf = (uint32_t) kind | (not_found ? FLAG_NOT_FOUND : 0u);
   memcpy (lens, tok, sizeof *tok);
   memcpy (lens + sizeof *tok, &flen, 4);
   memcpy (lens + sizeof *tok + 4, &rlen, 4);
   memcpy (lens + sizeof *tok + 8, &vlen, 4);
   sum = record_sum (len32, kf, lens, filter, flen, rest, rlen, value, vlen);
   memcpy (rec, &len32, 4);
   memcpy (rec + 4, &kf, 4);
   memcpy (rec + SUM_OFF, &sum, 8);
   memcpy (rec + TOKEN_OFF, lens, LENS_BYTES);
   rec += REC_FIXED;
   memcpy (rec, filter, flen);
   rec += flen;
   if (rlen) {
      memcpy (rec, rest, rlen);
      rec += rlen;
   }
   if (vlen) {
      memcpy (rec, value, vlen);
   }
   p->head = head + need;
   STORE (&h->head, p->head); /* publishes the record */
   res = CQC_RING_PUSHED;

cleanup:
   if (res == CQC_RING_PUSHED) {
      p->pushed++;
   } else if (res == CQC_RING_DAMAGED) {
      p->damaged++;
   } else if (res == CQC_RING_TOO_LARGE) {
      p->oversize++;
   } else {
      p->dropped++;
   }
   publish_counters (p);
   return res;
}

/* ======================================================================== */
/* Consumer                                                                 */
/* ======================================================================== */

/* Parse the private copy of one record (len bytes, len >= REC_FIXED, len
 * read from the segment once and checked by the caller). Every length is
 * checked against len and the sum against the bytes; rec points into copy. */
static bool
parse_record (const uint8_t *copy, uint32_t len, cqc_ring_record_t *rec)
{
   const uint8_t *lens = copy + TOKEN_OFF;
   uint32_t kf;
   uint64_t sum, body;

   memcpy (&kf, copy + 4, 4);
   memcpy (&sum, copy + SUM_OFF, 8);
   memcpy (&rec->token, lens, sizeof rec->token);
   memcpy (&rec->flen, lens + sizeof rec->token, 4);
   memcpy (&rec->rlen, lens + sizeof rec->token + 4, 4);
   memcpy (&rec->vlen, lens + sizeof rec->token + 8, 4);
   body = (uint64_t) rec->flen + rec->rlen + rec->vlen;
   if (body > (uint64_t) len - REC_FIXED) {
      return false;
   }
   rec->kind = (uint8_t) (kf & 0xffu);
   rec->not_found = (kf & FLAG_NOT_FOUND) != 0;
   rec->filter = copy + REC_FIXED;
   rec->rest = rec->filter + rec->flen;
   rec->value = rec->rest + rec->rlen;
   return record_sum (len, kf, lens, rec->filter, rec->flen, rec->rest, rec->rlen, rec->value,
                      rec->vlen) == sum;
}

uint64_t
cqc_ring_drain (void *mem, uint64_t size, cqc_ring_fn fn, void *ctx)
{
   cqc_ring_header_t *h = mem;
   const uint8_t *data = (const uint8_t *) mem + CQC_RING_DATA_OFF;
   /* The header lies in memory the producer (and any process of the user)
    * controls: each field is read once, and the values read are the ones
    * checked and used (checking h->capacity again would let a producer
    * change it in between). */
   uint64_t magic = LOAD (&h->magic);
   uint32_t version = LOAD_RELAXED (&h->version);
   uint64_t cap = LOAD_RELAXED (&h->capacity);
   uint64_t head = LOAD (&h->head);
   uint64_t tail = LOAD_RELAXED (&h->tail); /* only the consumer should write it */
   uint8_t *copy = NULL;                    /* the record being handled, private */
   uint32_t copy_cap = 0;
   uint64_t n = 0;
   bool malformed = false;

   if (size < CQC_RING_DATA_OFF + 4096u || magic != CQC_RING_MAGIC ||
       version != CQC_RING_VERSION || cap < 4096u || cap % 8u != 0 ||
       cap > size - CQC_RING_DATA_OFF || head - tail > cap) {
      malformed = true;
      goto cleanup;
   }
   while (tail != head) {
      uint64_t pos = tail % cap;
      uint64_t avail = head - tail;
      uint32_t len;
      cqc_ring_record_t rec;

      if (avail < 8 || cap - pos < 8) {
         malformed = true;
         goto cleanup;
      }
      /* The record's length is read once, and everything after comes from
       * the copy: a producer that rewrites a record after this point
       * changes nothing the consumer checked or uses. */
      memcpy (&len, data + pos, 4);
      if (len & CQC_RING_PAD) {
         uint64_t pad = len & ~CQC_RING_PAD;
         if (pad != cap - pos || pad > avail) {
            malformed = true;
            goto cleanup;
         }
         tail += pad;
         continue;
      }
      if (len < REC_FIXED || len % 8u || len > avail || len > cap - pos) {
         malformed = true;
         goto cleanup;
      }
      if (len > copy_cap) {
         uint8_t *bigger = realloc (copy, len);
         if (!bigger) {
            break; /* out of memory: the record waits for the next drain */
         }
         copy = bigger;
         copy_cap = len;
      }
      memcpy (copy, data + pos, len);
      if (!parse_record (copy, len, &rec)) {
         malformed = true;
         goto cleanup;
      }
      fn (ctx, &rec);
      n++;
      tail += len;
   }

cleanup:
   if (malformed) {
      /* Drop everything published so far; the producer goes on from head. */
      STORE_RELAXED (&h->malformed, LOAD_RELAXED (&h->malformed) + 1u);
      tail = head;
   }
   STORE_RELAXED (&h->popped, LOAD_RELAXED (&h->popped) + n);
   STORE (&h->tail, tail);
   free (copy);
   return n;
}
