/*
 * fuzz_keys.c - keys.c against arbitrary bytes and arbitrary BSON.
 *
 * Input: the bytes are used three ways.
 *   1. cqc_filter_identity on the whole input, as bytes (any length, any
 *      content: it must refuse what is not a BSON document), against
 *      libbson's iterator reading the same bytes: the same answer and
 *      hash (keys.c reads the fast path's shapes without it).
 *   2. If the input is a valid BSON document, every element at every depth
 *      (up to 8 levels) goes through cqc_id_hash, and the canonical-hash
 *      rules of keys.h are checked against libbson-built equivalents:
 *        - an int32, an int64 and a double of the same value hash alike
 *          (every double that is integral and in int64 range, -0.0 too);
 *        - every NaN hashes alike;
 *        - a string and a symbol with the same bytes hash alike;
 *        - Decimal128 is namespace-wide, everything else has a cell;
 *        - {_id: v} is an identity filter exactly when cqc_id_hash says v
 *          is identity-cacheable, with the same hash; {_id: v, x: 1} and
 *          {x: 1, _id: v} never are;
 *        - cqc_id_cell stays below the table size.
 *   3. cqc_key_write with the first bytes as kind and namespace and the
 *      rest split into filter and rest: the key reads back field by field,
 *      cqc_hash_bytes is a function of the bytes only, and cqc_key_build
 *      makes the same bytes (on the stack or on the heap).
 *   4. The fast path's {"_id": v} encoders (cqc_id_filter_*) with the first
 *      8 bytes as an integer, the first 12 as an ObjectId and the rest as a
 *      string, each against libbson's encoding of the same document (an
 *      int32 when the integer fits, as PyMongo writes it), and always an
 *      identity filter; a string holding NUL or too long for the buffer is
 *      refused.
 */
#include "fuzz_common.h"

#include <math.h>

static uint64_t
hash_of_value (const bson_value_t *v, bool *ok, cqc_id_kind_t *kind)
{
   bson_t doc = BSON_INITIALIZER;
   bson_iter_t it;
   uint64_t h = 0;

   FUZZ_CHECK (bson_append_value (&doc, "_id", 3, v), "cannot build {_id: v}");
   FUZZ_CHECK (bson_iter_init_find (&it, &doc, "_id"), "no _id in {_id: v}");
   *kind = cqc_id_hash (&it, &h, ok);
   bson_destroy (&doc);
   return h;
}

static void
expect_same_hash (uint64_t h, const bson_value_t *other, const char *what)
{
   bool ok;
   cqc_id_kind_t kind;
   uint64_t h2 = hash_of_value (other, &ok, &kind);
   FUZZ_CHECK (kind == CQC_ID_CELL && h2 == h, "%s hashes differently", what);
}

/* The numeric and string equivalences of keys.h. */
static void
check_equivalents (const bson_iter_t *it, uint64_t h)
{
   bson_value_t v;
   switch (bson_iter_type (it)) {
   case BSON_TYPE_INT32: {
      int32_t x = bson_iter_int32 (it);
      v.value_type = BSON_TYPE_INT64;
      v.value.v_int64 = x;
      expect_same_hash (h, &v, "int32 and int64 of one value");
      v.value_type = BSON_TYPE_DOUBLE;
      v.value.v_double = (double) x;
      expect_same_hash (h, &v, "int32 and double of one value");
      break;
   }
   case BSON_TYPE_INT64: {
      int64_t x = bson_iter_int64 (it);
      if (x >= INT32_MIN && x <= INT32_MAX) {
         v.value_type = BSON_TYPE_INT32;
         v.value.v_int32 = (int32_t) x;
         expect_same_hash (h, &v, "int64 and int32 of one value");
      }
      /* A double equal to x, if there is one. */
      if ((double) x < 9223372036854775808.0 && (int64_t) (double) x == x) {
         v.value_type = BSON_TYPE_DOUBLE;
         v.value.v_double = (double) x;
         expect_same_hash (h, &v, "int64 and double of one value");
      }
      break;
   }
   case BSON_TYPE_DOUBLE: {
      double d = bson_iter_double (it);
      if (isnan (d)) {
         v.value_type = BSON_TYPE_DOUBLE;
         v.value.v_double = NAN;
         expect_same_hash (h, &v, "two NaNs");
      } else if (d == floor (d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
         v.value_type = BSON_TYPE_INT64;
         v.value.v_int64 = (int64_t) d;
         expect_same_hash (h, &v, "double and int64 of one value");
      } else if (d == 0.0) {
         v.value_type = BSON_TYPE_DOUBLE;
         v.value.v_double = -d;
         expect_same_hash (h, &v, "0.0 and -0.0");
      }
      break;
   }
   case BSON_TYPE_UTF8:
   case BSON_TYPE_SYMBOL: {
      uint32_t len;
      const char *s = bson_iter_type (it) == BSON_TYPE_UTF8 ? bson_iter_utf8 (it, &len)
                                                            : bson_iter_symbol (it, &len);
      v.value_type = bson_iter_type (it) == BSON_TYPE_UTF8 ? BSON_TYPE_SYMBOL : BSON_TYPE_UTF8;
      if (v.value_type == BSON_TYPE_UTF8) {
         v.value.v_utf8.str = (char *) s;
         v.value.v_utf8.len = len;
      } else {
         v.value.v_symbol.symbol = (char *) s;
         v.value.v_symbol.len = len;
      }
      expect_same_hash (h, &v, "a string and a symbol of the same bytes");
      break;
   }
   default:
      break;
   }
}

/* {_id: v} is an identity filter exactly when v is identity-cacheable;
 * a second field, before or after, makes it a query. */
static void
check_filters (const bson_iter_t *it, uint64_t h, bool ok, cqc_id_kind_t kind)
{
   bson_t f = BSON_INITIALIZER;
   uint64_t fh = 0;
   bool is_id;

   if (!bson_append_iter (&f, "_id", 3, it)) {
      /* libbson refuses to copy a malformed value (the input is only
       * checked element by element); cqc_id_hash has seen it already. */
      bson_destroy (&f);
      return;
   }
   is_id = cqc_filter_identity (bson_get_data (&f), f.len, &fh);
   FUZZ_CHECK (is_id == (kind == CQC_ID_CELL && ok), "{_id: v} identity %d, id_hash %d/%d",
               (int) is_id, (int) kind, (int) ok);
   if (is_id) {
      FUZZ_CHECK (fh == h, "{_id: v} hashes apart from v");
   }
   BSON_APPEND_INT32 (&f, "x", 1);
   FUZZ_CHECK (!cqc_filter_identity (bson_get_data (&f), f.len, &fh),
               "{_id: v, x: 1} taken for an identity filter");
   bson_reinit (&f);
   BSON_APPEND_INT32 (&f, "x", 1);
   FUZZ_CHECK (bson_append_iter (&f, "_id", 3, it), "cannot build {x: 1, _id: v}");
   FUZZ_CHECK (!cqc_filter_identity (bson_get_data (&f), f.len, &fh),
               "{x: 1, _id: v} taken for an identity filter");
   bson_destroy (&f);
}

static void
walk (bson_iter_t *it, int depth)
{
   while (bson_iter_next (it)) {
      uint64_t h = 0;
      bool ok = false;
      cqc_id_kind_t kind = cqc_id_hash (it, &h, &ok);
      uint32_t count;

      FUZZ_CHECK ((kind == CQC_ID_NS_WIDE) == (bson_iter_type (it) == BSON_TYPE_DECIMAL128),
                  "type 0x%x gives kind %d", (unsigned) bson_iter_type (it), (int) kind);
      for (count = 1; count <= (1u << 20); count <<= 5) {
         uint32_t cell = cqc_id_cell (h, depth, count);
         FUZZ_CHECK (cell < count, "cell %u of %u", cell, count);
      }
      if (kind == CQC_ID_CELL) {
         check_equivalents (it, h);
      }
      check_filters (it, h, ok, kind);
      if (depth < 8 && (BSON_ITER_HOLDS_DOCUMENT (it) || BSON_ITER_HOLDS_ARRAY (it))) {
         bson_iter_t child;
         if (bson_iter_recurse (it, &child)) {
            walk (&child, depth + 1);
         }
      }
   }
}

static void
check_key_write (const uint8_t *data, size_t size)
{
   cursor_t c = {data, size};
   uint8_t kind = cur_u8 (&c);
   uint32_t ns_idx = cur_u32 (&c);
   uint32_t flen = c.n ? cur_u8 (&c) % (uint32_t) (c.n + 1) : 0;
   const uint8_t *filter = c.p;
   const uint8_t *rest;
   uint32_t rlen, f2, n2;
   uint8_t *key;

   if (flen > c.n) {
      flen = (uint32_t) c.n;
   }
   rest = filter + flen;
   rlen = (uint32_t) (c.n - flen);
   key = malloc (CQC_KEY_FIXED + flen + rlen);
   FUZZ_CHECK (key, "out of memory");
   cqc_key_write (key, kind, ns_idx, filter, flen, rest, rlen);
   memcpy (&n2, key + 1, 4);
   memcpy (&f2, key + 5, 4);
   FUZZ_CHECK (key[0] == kind && n2 == ns_idx && f2 == flen &&
                  memcmp (key + CQC_KEY_FIXED, filter, flen) == 0 &&
                  memcmp (key + CQC_KEY_FIXED + flen, rest, rlen) == 0,
               "key does not read back");
   {
      /* The hash depends on the bytes only, not on where they are. */
      uint8_t *copy = malloc (CQC_KEY_FIXED + flen + rlen + 1);
      FUZZ_CHECK (copy, "out of memory");
      memcpy (copy + 1, key, CQC_KEY_FIXED + flen + rlen);
      FUZZ_CHECK (cqc_hash_bytes (copy + 1, CQC_KEY_FIXED + flen + rlen, 0) ==
                     cqc_hash_bytes (key, CQC_KEY_FIXED + flen + rlen, 0),
                  "hash depends on alignment");
      free (copy);
   }
   {
      cqc_key_t built;
      FUZZ_CHECK (cqc_key_build (&built, kind, ns_idx, filter, flen, rest, rlen) == CQC_KEY_OK,
                  "cqc_key_build refused a key of %u bytes", CQC_KEY_FIXED + flen + rlen);
      FUZZ_CHECK (built.len == CQC_KEY_FIXED + flen + rlen &&
                     memcmp (built.buf, key, built.len) == 0 &&
                     (built.buf == built.stack) == (built.len <= CQC_KEY_STACK),
                  "cqc_key_build differs from cqc_key_write");
      cqc_key_free (&built);
   }
   free (key);
}

/* One encoder's output against libbson's {"_id": v}. */
static void
same_filter (const uint8_t *out, uint32_t len, const bson_t *want, const char *what,
             bool identity)
{
   uint64_t h;
   FUZZ_CHECK (len == want->len && memcmp (out, bson_get_data (want), len) == 0,
               "%s: %u bytes, libbson %u", what, len, want->len);
   FUZZ_CHECK (!identity || cqc_filter_identity (out, len, &h), "%s is no identity filter",
               what);
}

static void
check_id_filters (const uint8_t *data, size_t size)
{
   uint8_t out[256 + CQC_ID_FILTER_FIXED];
   int64_t v = 0;
   bson_oid_t oid;
   bson_t want;
   uint32_t len;

   memcpy (&v, data, size < 8 ? size : 8);
   bson_init (&want);
   if (v >= INT32_MIN && v <= INT32_MAX) {
      BSON_APPEND_INT32 (&want, "_id", (int32_t) v);
   } else {
      BSON_APPEND_INT64 (&want, "_id", v);
   }
   same_filter (out, cqc_id_filter_int (out, sizeof out, v), &want, "int", true);
   bson_destroy (&want);

   memset (&oid, 0, sizeof oid);
   memcpy (oid.bytes, data, size < 12 ? size : 12);
   bson_init (&want);
   BSON_APPEND_OID (&want, "_id", &oid);
   same_filter (out, cqc_id_filter_oid (out, sizeof out, oid.bytes), &want, "oid", true);
   bson_destroy (&want);

   len = cqc_id_filter_str (out, sizeof out, (const char *) data, size);
   if (memchr (data, 0, size) || size + CQC_ID_FILTER_FIXED > sizeof out) {
      FUZZ_CHECK (len == 0, "a string of %zu bytes with NUL or too long was encoded", size);
      return;
   }
   bson_init (&want);
   FUZZ_CHECK (bson_append_utf8 (&want, "_id", 3, (const char *) data, (int) size),
               "libbson refused a string of %zu bytes", size);
   /* Python hands the encoder valid UTF-8 only; other bytes must still
    * encode as libbson does. */
   same_filter (out, len, &want, "str", bson_utf8_validate ((const char *) data, size, false));
   bson_destroy (&want);
}

/* cqc_filter_identity on any bytes agrees with libbson's reading of them
 * (its fast path for the shapes the fast path writes must take exactly
 * the documents the iterator takes, with the same hash). */
static void
check_identity_bytes (const uint8_t *data, size_t size)
{
   bson_iter_t it;
   bool ok = false, want;
   uint64_t h = 0, want_h = 0;
   bool got = cqc_filter_identity (data, size, &h);

   want = bson_iter_init_from_data (&it, data, size) && bson_iter_next (&it) &&
          strcmp (bson_iter_key (&it), "_id") == 0 &&
          cqc_id_hash (&it, &want_h, &ok) == CQC_ID_CELL && ok && !bson_iter_next (&it);
   FUZZ_CHECK (got == want, "identity of the bytes %d, libbson's %d", (int) got, (int) want);
   if (got) {
      FUZZ_CHECK (h == want_h, "identity hash apart from libbson's reading");
   }
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   bson_iter_t it;

   check_identity_bytes (data, size);
   if (bson_iter_init_from_data (&it, data, size)) {
      walk (&it, 0);
   }
   check_key_write (data, size);
   check_id_filters (data, size);
   return 0;
}
