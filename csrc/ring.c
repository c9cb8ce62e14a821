/*
 * ring.c - see ring.h.
 */
#include "ring.h"

#include <string.h>

#define LOAD(p) __atomic_load_n ((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n ((p), (v), __ATOMIC_RELEASE)

/* Fixed part of a record: len, kind_flags, token, flen, rlen, vlen. */
#define REC_FIXED (8u + (uint32_t) sizeof (cqc_token_t) + 12u)
#define FLAG_NOT_FOUND 0x100u

static uint64_t
align8 (uint64_t v)
{
   return (v + 7u) & ~(uint64_t) 7u;
}

bool
cqc_ring_format (void *mem, uint64_t size, uint32_t pid)
{
   cqc_ring_header_t *h = mem;
   if (size < CQC_RING_DATA_OFF + 4096u) {
      return false;
   }
   memset (h, 0, sizeof *h);
   h->version = CQC_RING_VERSION;
   h->pid = pid;
   h->capacity = (size - CQC_RING_DATA_OFF) & ~(uint64_t) 7u;
   STORE (&h->magic, CQC_RING_MAGIC);
   return true;
}

bool
cqc_ring_check (const void *mem, uint64_t size)
{
   const cqc_ring_header_t *h = mem;
   return size >= CQC_RING_DATA_OFF + 4096u && LOAD (&h->magic) == CQC_RING_MAGIC &&
          h->version == CQC_RING_VERSION && h->capacity % 8u == 0 &&
          h->capacity <= size - CQC_RING_DATA_OFF;
}

/* ======================================================================== */
/* Producer                                                                 */
/* ======================================================================== */

bool
cqc_ring_push (void *mem, uint8_t kind, bool not_found, const cqc_token_t *tok,
               const uint8_t *filter, uint32_t flen, const uint8_t *rest, uint32_t rlen,
               const uint8_t *value, uint32_t vlen)
{
   cqc_ring_header_t *h = mem;
   uint8_t *data = (uint8_t *) mem + CQC_RING_DATA_OFF;
   uint64_t cap = h->capacity;
   uint64_t need = align8 ((uint64_t) REC_FIXED + flen + rlen + vlen);
   uint64_t head = h->head; /* only this producer writes it */
   uint64_t tail = LOAD (&h->tail);
   uint64_t pos = head % cap;
   uint64_t pad = 0;
   uint32_t len32, kf;
   uint8_t *p;

   if (need > 0x7fffffffu || need > cap / 2) {
      h->dropped++;
      return false;
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
      h->dropped++;
      return false;
   }
   if (pad) {
      uint32_t padlen = (uint32_t) pad | CQC_RING_PAD;
      memcpy (data + pos, &padlen, 4); /* pad >= 8: records are aligned */
      head += pad;
      pos = 0;
   }
   p = data + pos;
   len32 = (uint32_t) need;
   kf = (uint32_t) kind | (not_found ? FLAG_NOT_FOUND : 0u);
   memcpy (p, &len32, 4);
   memcpy (p + 4, &kf, 4);
   memcpy (p + 8, tok, sizeof *tok);
   p += 8 + sizeof *tok;
   memcpy (p, &flen, 4);
   memcpy (p + 4, &rlen, 4);
   memcpy (p + 8, &vlen, 4);
   p += 12;
   memcpy (p, filter, flen);
   p += flen;
   if (rlen) {
      memcpy (p, rest, rlen);
      p += rlen;
   }
   if (vlen) {
      memcpy (p, value, vlen);
   }
   h->pushed++;
   STORE (&h->head, head + need); /* publishes the record */
   return true;
}

/* ======================================================================== */
/* Consumer                                                                 */
/* ======================================================================== */

uint64_t
cqc_ring_drain (void *mem, uint64_t size, cqc_ring_fn fn, void *ctx)
{
   cqc_ring_header_t *h = mem;
   const uint8_t *data = (const uint8_t *) mem + CQC_RING_DATA_OFF;
   /* The header lies in memory the producer controls: each field is read
    * once, and the values read are the ones checked and used (checking
    * h->capacity again would let a producer change it in between). */
   uint64_t cap = LOAD (&h->capacity);
   uint64_t head = LOAD (&h->head);
   uint64_t tail = LOAD (&h->tail); /* only the consumer should write it */
   uint64_t n = 0;

   if (!cqc_ring_check (mem, size) || cap % 8u != 0 || cap > size - CQC_RING_DATA_OFF ||
       head - tail > cap) {
      goto malformed;
   }
   while (tail != head) {
      uint64_t pos = tail % cap;
      uint64_t avail = head - tail;
      uint32_t len, kf;
      cqc_ring_record_t rec;
      const uint8_t *p;
      uint64_t body;

      if (avail < 8 || cap - pos < 8) {
         goto malformed;
      }
      memcpy (&len, data + pos, 4);
      if (len & CQC_RING_PAD) {
         uint64_t pad = len & ~CQC_RING_PAD;
         if (pad != cap - pos || pad > avail) {
            goto malformed;
         }
         tail += pad;
         continue;
      }
      if (len < REC_FIXED || len % 8u || len > avail || len > cap - pos) {
         goto malformed;
      }
      p = data + pos;
      memcpy (&kf, p + 4, 4);
      memcpy (&rec.token, p + 8, sizeof rec.token);
      p += 8 + sizeof rec.token;
      memcpy (&rec.flen, p, 4);
      memcpy (&rec.rlen, p + 4, 4);
      memcpy (&rec.vlen, p + 8, 4);
      p += 12;
      body = (uint64_t) rec.flen + rec.rlen + rec.vlen;
      if (body > (uint64_t) len - REC_FIXED) {
         goto malformed;
      }
      rec.kind = (uint8_t) (kf & 0xffu);
      rec.not_found = (kf & FLAG_NOT_FOUND) != 0;
      rec.filter = p;
      rec.rest = p + rec.flen;
      rec.value = p + rec.flen + rec.rlen;
      fn (ctx, &rec);
      n++;
      tail += len;
   }
   h->popped += n;
   STORE (&h->tail, tail);
   return n;

malformed:
   /* Drop everything published so far; the producer goes on from head. */
   h->malformed++;
   STORE (&h->tail, head);
   return n;
}
