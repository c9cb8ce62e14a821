/*
 * keys.c - see keys.h.
 */
#include "keys.h"
#include "le.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ======================================================================== */
/* Byte hashing                                                             */
/* ======================================================================== */

static inline uint64_t
fmix64 (uint64_t k)
{
   k ^= k >> 33;
   k *= 0xff51afd7ed558ccdull;
   k ^= k >> 33;
   k *= 0xc4ceb9fe1a85ec53ull;
   k ^= k >> 33;
   return k;
}

uint64_t
cqc_hash_bytes (const void *p, size_t len, uint64_t seed)
{
   const uint8_t *b = p;
   uint64_t h = seed ^ ((uint64_t) len * 0x9e3779b97f4a7c15ull);
   uint64_t w;

   while (len >= 8) {
      memcpy (&w, b, 8);
      h = (h ^ fmix64 (w)) * 0x9e3779b97f4a7c15ull;
      h ^= h >> 29;
      b += 8;
      len -= 8;
   }
   w = 0;
   memcpy (&w, b, len);
   h = (h ^ fmix64 (w ^ ((uint64_t) len << 56))) * 0x9e3779b97f4a7c15ull;
   return fmix64 (h);
}

/* ======================================================================== */
/* Canonical _id hashing                                                    */
/* ======================================================================== */

/* Canonical type tags: one per BSON comparison class that matters here. */
enum { TAG_INT = 1, TAG_DOUBLE = 2, TAG_STRING = 3, TAG_OTHER = 4 };

static uint64_t
hash_tagged (uint32_t tag, const void *p, size_t len)
{
   return cqc_hash_bytes (p, len, 0x1d000000ull + tag);
}

static uint64_t
hash_int (int64_t v)
{
   return hash_tagged (TAG_INT, &v, sizeof v);
}

/* An _id of any other type: its type byte and its value's raw bytes. */
static uint64_t
hash_value_bytes (uint8_t type, const uint8_t *raw, size_t len)
{
   uint64_t h = hash_tagged (TAG_OTHER, &type, 1);

   return h ^ cqc_hash_bytes (raw, len, h);
}

cqc_id_kind_t
cqc_id_hash (const bson_iter_t *iter, uint64_t *hash, bool *identity_ok)
{
   bson_type_t t = bson_iter_type (iter);
   *identity_ok = false;

   switch (t) {
   case BSON_TYPE_INT32:
      *identity_ok = true;
      *hash = hash_int (bson_iter_int32 (iter));
      return CQC_ID_CELL;
   case BSON_TYPE_INT64:
      *identity_ok = true;
      *hash = hash_int (bson_iter_int64 (iter));
      return CQC_ID_CELL;
   case BSON_TYPE_DOUBLE: {
      double d = bson_iter_double (iter);
      *identity_ok = true;
      if (isnan (d)) {
         *hash = hash_tagged (TAG_DOUBLE, "nan", 3);
      } else if (d == floor (d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
         *hash = hash_int ((int64_t) d); /* also folds -0.0 into 0 */
      } else {
         *hash = hash_tagged (TAG_DOUBLE, &d, sizeof d);
      }
      return CQC_ID_CELL;
   }
   case BSON_TYPE_UTF8:
   case BSON_TYPE_SYMBOL: {
      uint32_t len = 0;
      const char *s = t == BSON_TYPE_UTF8 ? bson_iter_utf8 (iter, &len)
                                          : bson_iter_symbol (iter, &len);
      *identity_ok = t == BSON_TYPE_UTF8;
      *hash = hash_tagged (TAG_STRING, s, len);
      return CQC_ID_CELL;
   }
   case BSON_TYPE_DECIMAL128:
      *hash = 0;
      return CQC_ID_NS_WIDE;
   case BSON_TYPE_OID:
   case BSON_TYPE_BOOL:
   case BSON_TYPE_DATE_TIME:
   case BSON_TYPE_BINARY:
      *identity_ok = true;
      __attribute__ ((fallthrough)); /* hashed by type and value bytes */
   default: {
      /* Hash the type byte and the raw value bytes (libbson's iterator
       * exposes the value's offset, d1, and the next element's, next_off). */
      size_t vlen = iter->next_off > iter->d1 ? iter->next_off - iter->d1 : 0;
      *hash = hash_value_bytes ((uint8_t) t, iter->raw + iter->d1, vlen);
      return CQC_ID_CELL;
   }
   }
}

uint32_t
cqc_id_cell (uint64_t id_hash, uint32_t ns_idx, uint32_t count)
{
   return (uint32_t) fmix64 (id_hash ^ ((uint64_t) ns_idx * 0x9e3779b97f4a7c15ull)) &
          (count - 1);
}

/* The filters the fast path writes (cqc_id_filter_*): {"_id": v} with an
 * int32, int64, string or ObjectId v, read in place with cqc_id_hash's
 * hashes. A read's check against the causal floor runs this when the
 * process observed a read the stream has not covered yet: libbson's
 * iterator, which nothing else on a hit runs, would be cold code there.
 * false for any other bytes, which the iterator then reads. */
static bool
simple_identity (const uint8_t *f, size_t len, uint64_t *id_hash)
{
   const uint8_t *v = f + 9; /* after the length, the type and "_id" */
   size_t vlen = len - 10;   /* up to the document's last byte */
   uint8_t type;
   int64_t x;

   if (len < 14 || cqc_le32 (f) != len || f[len - 1] != 0 || memcmp (f + 5, "_id", 4) != 0) {
      return false;
   }
   switch ((type = f[4])) {
   case 0x10: /* int32 */
      if (vlen != 4) {
         return false;
      }
      x = (int32_t) cqc_le32 (v);
      *id_hash = hash_int (x);
      return true;
   case 0x12: /* int64 */
      if (vlen != 8) {
         return false;
      }
      x = (int64_t) cqc_le64 (v);
      *id_hash = hash_int (x);
      return true;
   case 0x02: /* string: its length counts its NUL */
      if (vlen < 5 || cqc_le32 (v) != vlen - 4 || v[vlen - 1] != 0) {
         return false;
      }
      *id_hash = hash_tagged (TAG_STRING, v + 4, vlen - 5);
      return true;
   case 0x07: /* ObjectId */
      if (vlen != 12) {
         return false;
      }
      *id_hash = hash_value_bytes (type, v, 12);
      return true;
   default:
      return false;
   }
}

bool
cqc_filter_identity (const uint8_t *filter, size_t len, uint64_t *id_hash)
{
   bson_iter_t it;
   bool ok = false;

   if (simple_identity (filter, len, id_hash)) {
      return true;
   }
   if (!bson_iter_init_from_data (&it, filter, len) || !bson_iter_next (&it)) {
      return false;
   }
   if (strcmp (bson_iter_key (&it), "_id") != 0) {
      return false;
   }
   if (cqc_id_hash (&it, id_hash, &ok) != CQC_ID_CELL || !ok) {
      return false;
   }
   return !bson_iter_next (&it);
}

void
cqc_key_write (uint8_t *out, uint8_t kind, uint32_t ns_idx, const uint8_t *filter, uint32_t flen,
               const uint8_t *rest, uint32_t rlen)
{
   out[0] = kind;
   memcpy (out + 1, &ns_idx, 4);
   memcpy (out + 5, &flen, 4);
   memcpy (out + CQC_KEY_FIXED, filter, flen);
   if (rlen) {
      memcpy (out + CQC_KEY_FIXED + flen, rest, rlen);
   }
}

cqc_key_status_t
cqc_key_build (cqc_key_t *k, uint8_t kind, uint32_t ns_idx, const uint8_t *filter, uint32_t flen,
               const uint8_t *rest, uint32_t rlen)
{
   uint64_t total = (uint64_t) CQC_KEY_FIXED + flen + rlen;

   k->buf = NULL;
   k->len = 0;
   if (total > CQC_KEY_MAX) {
      return CQC_KEY_TOO_LARGE;
   }
   k->buf = total <= CQC_KEY_STACK ? k->stack : malloc (total);
   if (!k->buf) {
      return CQC_KEY_NO_MEMORY;
   }
   cqc_key_write (k->buf, kind, ns_idx, filter, flen, rest, rlen);
   k->len = (uint32_t) total;
   return CQC_KEY_OK;
}

void
cqc_key_free (cqc_key_t *k)
{
   if (k->buf && k->buf != k->stack) {
      free (k->buf);
   }
   k->buf = NULL;
   k->len = 0;
}

/* ======================================================================== */
/* Identity filters                                                         */
/* ======================================================================== */

/* Frame {"_id": <a value of `type`, n bytes>} in `out` (`cap` bytes): sets
 * *total and returns where the value goes, or NULL when it does not fit. */
static uint8_t *
id_frame (uint8_t *out, size_t cap, uint8_t type, size_t n, uint32_t *total)
{
   int32_t len;

   if (n > cap || 10 + n > cap) {
      return NULL;
   }
   *total = (uint32_t) (10 + n);
   len = (int32_t) *total;
   memcpy (out, &len, 4);
   out[4] = type;
   memcpy (out + 5, "_id", 4);
   out[*total - 1] = 0;
   return out + 9;
}

uint32_t
cqc_id_filter_int (uint8_t *out, size_t cap, int64_t v)
{
   uint32_t total = 0;
   uint8_t *p;

   if (v >= INT32_MIN && v <= INT32_MAX) {
      int32_t v32 = (int32_t) v;
      if ((p = id_frame (out, cap, 0x10, 4, &total))) {
         memcpy (p, &v32, 4);
      }
   } else if ((p = id_frame (out, cap, 0x12, 8, &total))) {
      memcpy (p, &v, 8);
   }
   return p ? total : 0;
}

uint32_t
cqc_id_filter_str (uint8_t *out, size_t cap, const char *s, size_t n)
{
   uint32_t total = 0;
   int32_t slen = (int32_t) n + 1;
   uint8_t *p;

   if (n + CQC_ID_FILTER_FIXED > cap || memchr (s, '\0', n)) {
      return 0;
   }
   if (!(p = id_frame (out, cap, 0x02, n + 5, &total))) {
      return 0;
   }
   memcpy (p, &slen, 4);
   memcpy (p + 4, s, n);
   p[4 + n] = 0;
   return total;
}

uint32_t
cqc_id_filter_oid (uint8_t *out, size_t cap, const uint8_t oid[12])
{
   uint32_t total = 0;
   uint8_t *p = id_frame (out, cap, 0x07, 12, &total);

   if (p) {
      memcpy (p, oid, 12);
   }
   return p ? total : 0;
}
