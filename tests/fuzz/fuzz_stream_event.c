/*
 * fuzz_stream_event.c - stream.c's handling of one change event, without a
 * server: the input is the event's BSON, applied by apply_event (static in
 * stream.c, so this file includes stream.c) to a real arena.
 *
 * The stream carries database d alone (a database's own stream), or d and
 * o (the deployment-wide stream of a cache serving both): the input's
 * length decides, odd carrying both. Before the event the arena holds, in
 * each of the namespaces d.a, d.b and o.a, a query entry
 * (count_documents {x: 1}) and identity entries find_one {_id: v} for
 * v = 1, "a", the event's documentKey._id and, when that is a number, the
 * same number as int32, int64 and double. Every entry is admitted through a
 * captured token, as module.c does. After the event, what coherence rule 3
 * (DESIGN.md) and stream.c's event table say must be gone must miss:
 *
 *   insert, update, replace, delete of _id X in a registered namespace N:
 *       every query entry of N, and every identity entry of N whose _id
 *       equals X as MongoDB compares (numbers by value, across types);
 *       every entry of N when X is missing or a Decimal128;
 *   drop: every entry of N;   rename: N's and the target's, or the whole
 *       database when the target is not named;
 *   dropDatabase: every entry of the event's database;
 *   invalidate: every entry of every database the stream carries;
 *   any other type: every entry of N, or of the event's database when the
 *       event names no namespace.
 * The event's database is the carried one its ns.db names, else the one its
 * to.db names, else the stream's only one when it carries d alone (a
 * database's own stream), or names no database; else every carried
 * database when it names none, and when it names another database (a
 * rename between databases the stream does not carry, which the
 * deployment-wide $match lets through) it changes nothing, unless it is
 * an invalidate.
 * The operation type is compared as stream.c does (a C string). Also:
 * apply_event asks for a reopen exactly on "invalidate", marks the stream
 * caught up exactly when clusterTime is at or after the open time, and
 * counts the event for its database (for every carried one when it has
 * none, or is an invalidate). Over-invalidation is allowed (it is safe) and not
 * checked. Malformed BSON (bson_init_static accepts any length-prefixed
 * bytes) must not crash either.
 */
#include "../../csrc/stream.c"

#include "fuzz_common.h"

#include <math.h>

#define NS_N 3
#define ENT_MAX 8

static const char *const DB_OF[NS_N] = {"d", "d", "o"};
static const char *const COLL_OF[NS_N] = {"a", "b", "a"};

typedef struct {
   uint8_t key[128];
   uint32_t key_len;
   uint32_t ns; /* model namespace */
   bool identity;
   bool event_id; /* its _id equals the event's documentKey._id */
   bool admitted;
} entry_t;

typedef struct {
   cqc_arena_t a;
   uint8_t *mem;
   pthread_mutex_t lock;
   uint32_t ns_idx[NS_N];
   uint32_t db_idx[NS_N];
   entry_t e[NS_N * ENT_MAX];
   uint32_t n;
} world_t;

/* Admit find_one/count entry with this filter; records whether it took. */
static void
admit (world_t *w, uint32_t ns, const bson_t *filter, bool event_id)
{
   entry_t *e;
   uint64_t id_hash;
   uint32_t cell = CQC_NO_CELL;
   cqc_token_t tok;
   uint8_t val[16] = {16, 0, 0, 0, 0x10, 'v', 0, 1, 0, 0, 0, 0};

   if (w->n == NS_N * ENT_MAX || CQC_KEY_FIXED + filter->len > sizeof e->key) {
      return;
   }
   e = &w->e[w->n++];
   e->ns = ns;
   e->event_id = event_id;
   e->identity = cqc_filter_identity (bson_get_data (filter), filter->len, &id_hash);
   if (e->identity) {
      cell = cqc_id_cell (id_hash, w->ns_idx[ns], w->a.geo.idgen_count);
   }
   e->key_len = CQC_KEY_FIXED + filter->len;
   cqc_key_write (e->key, e->identity ? 1 : 2, w->ns_idx[ns], bson_get_data (filter),
                  filter->len, NULL, 0);
   cqc_arena_r_capture (&w->a, w->ns_idx[ns], cell, &tok);
   e->admitted = cqc_arena_w_admit (&w->a, &tok, cqc_hash_bytes (e->key, e->key_len, 0),
                                    e->key, e->key_len, val, sizeof val, 0) == CQC_ADMIT_OK;
}

static void
admit_id (world_t *w, uint32_t ns, const bson_value_t *v, bool event_id)
{
   bson_t f = BSON_INITIALIZER;
   uint64_t h;
   if (bson_append_value (&f, "_id", 3, v) &&
       cqc_filter_identity (bson_get_data (&f), f.len, &h)) {
      admit (w, ns, &f, event_id);
   }
   bson_destroy (&f);
}

/* The event's documentKey._id, and its numeric equivalents. */
static void
admit_event_ids (world_t *w, uint32_t ns, const bson_t *doc)
{
   bson_iter_t it, id;
   bson_value_t v;

   if (!bson_iter_init (&it, doc) || !bson_iter_find_descendant (&it, "documentKey._id", &id)) {
      return;
   }
   {
      bson_t f = BSON_INITIALIZER;
      uint64_t h;
      if (bson_append_iter (&f, "_id", 3, &id) &&
          cqc_filter_identity (bson_get_data (&f), f.len, &h)) {
         admit (w, ns, &f, true);
      }
      bson_destroy (&f);
   }
   switch (bson_iter_type (&id)) {
   case BSON_TYPE_INT32:
   case BSON_TYPE_INT64: {
      int64_t x = bson_iter_as_int64 (&id);
      if (x >= INT32_MIN && x <= INT32_MAX) {
         v.value_type = BSON_TYPE_INT32;
         v.value.v_int32 = (int32_t) x;
         admit_id (w, ns, &v, true);
      }
      v.value_type = BSON_TYPE_INT64;
      v.value.v_int64 = x;
      admit_id (w, ns, &v, true);
      if ((double) x < 9223372036854775808.0 && (int64_t) (double) x == x) {
         v.value_type = BSON_TYPE_DOUBLE;
         v.value.v_double = (double) x;
         admit_id (w, ns, &v, true);
      }
      break;
   }
   case BSON_TYPE_DOUBLE: {
      double d = bson_iter_double (&id);
      if (d == floor (d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
         v.value_type = BSON_TYPE_INT64;
         v.value.v_int64 = (int64_t) d;
         admit_id (w, ns, &v, true);
         if (d >= INT32_MIN && d <= INT32_MAX) {
            v.value_type = BSON_TYPE_INT32;
            v.value.v_int32 = (int32_t) d;
            admit_id (w, ns, &v, true);
         }
      }
      break;
   }
   default:
      break;
   }
}

static void
build_world (world_t *w, const bson_t *doc)
{
   uint64_t size;
   uint32_t n;

   memset (w, 0, sizeof *w);
   w->mem = new_arena (&w->a, small_geometry (1), &size, DB_OF, COLL_OF, NS_N, w->ns_idx,
                       w->db_idx);
   pthread_mutex_init (&w->lock, NULL);
   for (n = 0; n < NS_N; n++) {
      bson_t f = BSON_INITIALIZER;
      bson_value_t v;
      BSON_APPEND_INT32 (&f, "x", 1);
      admit (w, n, &f, false);
      bson_destroy (&f);
      v.value_type = BSON_TYPE_INT32;
      v.value.v_int32 = 1;
      admit_id (w, n, &v, false);
      v.value_type = BSON_TYPE_UTF8;
      v.value.v_utf8.str = (char *) "a";
      v.value.v_utf8.len = 1;
      admit_id (w, n, &v, false);
      admit_event_ids (w, n, doc);
   }
}

/* The model database (0: d, 1: o) of database name db, or -1. */
static int
model_db (const char *db, uint32_t len)
{
   return !db ? -1 : len == 1 && db[0] == 'd' ? 0 : len == 1 && db[0] == 'o' ? 1 : -1;
}

#define EVENT_ALL -1    /* about every database the stream carries */
#define EVENT_OTHER -2  /* about databases it does not carry: ignored */

/* The model database an event is about when the stream carries d alone
 * (its own stream) or d and o (both: the deployment-wide one), as
 * stream.c decides. */
static int
event_db (const bson_t *doc, bool both, bool invalidate)
{
   const char *db, *coll, *ns_db;
   uint32_t db_len, coll_len;
   const char *const fields[] = {"ns", "to"};
   size_t k;

   get_ns (doc, "ns", &ns_db, &db_len, &coll, &coll_len);
   for (k = 0; k < 2; k++) {
      int m;
      get_ns (doc, fields[k], &db, &db_len, &coll, &coll_len);
      m = model_db (db, db_len);
      if (m == 0 || (m == 1 && both)) {
         return m;
      }
   }
   if (!both) {
      return 0;
   }
   return ns_db && !invalidate ? EVENT_OTHER : EVENT_ALL;
}

/* The model namespace named by field.db / field.coll, or -1. */
static int
named_ns (const bson_t *doc, const char *field, bool *has_db, bool *has_coll)
{
   const char *db, *coll;
   uint32_t db_len, coll_len, n;

   *has_db = get_ns (doc, field, &db, &db_len, &coll, &coll_len);
   *has_coll = coll != NULL;
   if (!db || !coll) {
      return -1;
   }
   for (n = 0; n < NS_N; n++) {
      if (db_len == strlen (DB_OF[n]) && coll_len == strlen (COLL_OF[n]) &&
          !memcmp (db, DB_OF[n], db_len) && !memcmp (coll, COLL_OF[n], coll_len)) {
         return (int) n;
      }
   }
   return -1;
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   bson_t doc;
   world_t *w;
   cqc_stream_t s;
   follow_t f;
   bson_iter_t it, id;
   const char *op = "";
   bool must_go[NS_N * ENT_MAX] = {false};
   bool has_db, has_coll, crud, id_hashable = false, reopen, want_caught_up = false, all;
   bool both = size % 2 == 1;
   int ns, to, ed;
   uint32_t i, t = 0, inc = 0;
   uint64_t events_before[2];

   if (!bson_init_static (&doc, data, size)) {
      return 0;
   }
   w = malloc (sizeof *w);
   FUZZ_CHECK (w, "out of memory");
   build_world (w, &doc);

   memset (&s, 0, sizeof s);
   s.w.arena = &w->a;
   s.w.lock = &w->lock;
   s.cap = 2;
   s.dbs = calloc (2, sizeof *s.dbs);
   FUZZ_CHECK (s.dbs, "out of memory");
   s.dbs[0].db_idx = w->db_idx[0];
   s.dbs[1].db_idx = w->db_idx[2];
   s.dbs[0].name_len = s.dbs[1].name_len = 1;
   memcpy (s.dbs[0].name, "d", 2);
   memcpy (s.dbs[1].name, "o", 2);
   s.n_dbs = both ? 2 : 1;
   s.scope = both ? CQC_STREAM_SCOPE_DEPLOYMENT : CQC_STREAM_SCOPE_DATABASE;
   pthread_mutex_init (&s.mu, NULL);
   memset (&f, 0, sizeof f);
   f.lo = 0;
   f.hi = s.n_dbs;
   f.have_open_time = true;
   f.open_t = 100;
   f.open_i = 5;

   /* Its resume token (the event's _id) is decoded within its string, and
    * MongoDB's layout gives the time its first nine bytes hold. */
   if (bson_iter_init_find (&it, &doc, "_id") && BSON_ITER_HOLDS_DOCUMENT (&it)) {
      bson_t token;
      const uint8_t *tdata;
      uint32_t tlen, tt, ti;
      bool high_water;
      bson_iter_document (&it, &tlen, &tdata);
      if (bson_init_static (&token, tdata, tlen) &&
          resume_token_time (&token, &tt, &ti, &high_water) &&
          bson_iter_init_find (&id, &token, "_data") && BSON_ITER_HOLDS_UTF8 (&id)) {
         const char *hex = bson_iter_utf8 (&id, NULL);
         /* Only MongoDB's layout is a high-water mark. */
         FUZZ_CHECK (high_water == (hex[0] == '8' && hex[1] == '2'), "token layout");
         if (hex[0] == '8' && hex[1] == '2') {
            char part[9] = {0};
            memcpy (part, hex + 2, 8);
            FUZZ_CHECK (strtoul (part, NULL, 16) == tt, "token seconds");
            memcpy (part, hex + 10, 8);
            FUZZ_CHECK (strtoul (part, NULL, 16) == ti, "token increment");
         }
      }
   }

   /* What the event names, read as stream.c reads it. */
   if (bson_iter_init_find (&it, &doc, "operationType") && BSON_ITER_HOLDS_UTF8 (&it)) {
      op = bson_iter_utf8 (&it, NULL);
   }
   if (bson_iter_init_find (&it, &doc, "clusterTime") && BSON_ITER_HOLDS_TIMESTAMP (&it)) {
      bson_iter_timestamp (&it, &t, &inc);
      want_caught_up = t > 100 || (t == 100 && inc >= 5);
   }
   ns = named_ns (&doc, "ns", &has_db, &has_coll);
   if (bson_iter_init (&it, &doc) && bson_iter_find_descendant (&it, "documentKey._id", &id)) {
      uint64_t h;
      bool ok;
      id_hashable = cqc_id_hash (&id, &h, &ok) == CQC_ID_CELL;
   }
   crud = !strcmp (op, "insert") || !strcmp (op, "update") || !strcmp (op, "replace") ||
          !strcmp (op, "delete");
   ed = event_db (&doc, both, !strcmp (op, "invalidate"));
   all = ed == EVENT_ALL || !strcmp (op, "invalidate");
   for (i = 0; i < w->n; i++) {
      const entry_t *e = &w->e[i];
      bool in_n = ns >= 0 && e->ns == (uint32_t) ns;
      int edb = DB_OF[e->ns][0] == 'd' ? 0 : 1;
      bool carried = edb == 0 || both;
      bool in_db = ed >= 0 ? edb == ed : carried;
      if (ed == EVENT_OTHER) {
         continue; /* nothing must go */
      }
      if (crud) {
         must_go[i] = in_n && (!e->identity || e->event_id || !id_hashable);
      } else if (!strcmp (op, "drop")) {
         must_go[i] = in_n;
      } else if (!strcmp (op, "rename")) {
         bool to_db, to_coll;
         to = named_ns (&doc, "to", &to_db, &to_coll);
         must_go[i] = in_n || (to_db && to_coll ? to >= 0 && e->ns == (uint32_t) to : in_db);
      } else if (!strcmp (op, "dropDatabase")) {
         must_go[i] = in_db;
      } else if (!strcmp (op, "invalidate")) {
         must_go[i] = carried;
      } else if (has_db && has_coll) {
         must_go[i] = in_n;
      } else {
         must_go[i] = in_db;
      }
   }

   for (i = 0; i < 2; i++) {
      events_before[i] = w->a.dbs[s.dbs[i].db_idx].events;
   }
   reopen = apply_event (&s, &f, &doc);
   FUZZ_CHECK (reopen == (!strcmp (op, "invalidate") && ed != EVENT_OTHER),
               "apply_event returned %d for \"%s\"", (int) reopen, op);
   FUZZ_CHECK (f.caught_up == want_caught_up, "caught_up %d for clusterTime %u.%u",
               (int) f.caught_up, t, inc);
   for (i = 0; i < 2; i++) {
      bool counted = i < s.n_dbs && (all || ed == (int) i);
      FUZZ_CHECK (w->a.dbs[s.dbs[i].db_idx].events == events_before[i] + (counted ? 1 : 0) &&
                     s.dbs[i].events == (counted ? 1u : 0u),
                  "event counted wrong for database %u (\"%s\", carried %u)", i, op, s.n_dbs);
   }

   for (i = 0; i < w->n; i++) {
      const entry_t *e = &w->e[i];
      copy_t cp;
      cqc_lookup_t r;
      if (!e->admitted) {
         continue;
      }
      r = lookup_copy (&w->a, w->ns_idx[e->ns], cqc_hash_bytes (e->key, e->key_len, 0), e->key,
                       e->key_len, &cp);
      free (cp.buf);
      FUZZ_CHECK (!(must_go[i] && r != CQC_LOOKUP_MISS),
                  "\"%s\" left entry %u (ns %u, %s%s) in place", op, i, e->ns,
                  e->identity ? "identity" : "query", e->event_id ? ", the event's _id" : "");
   }

   pthread_mutex_destroy (&s.mu);
   free (s.dbs);
   pthread_mutex_destroy (&w->lock);
   free (w->mem);
   free (w);
   return 0;
}
