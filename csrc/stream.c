/*
 * stream.c - see stream.h.
 */
#include "stream.h"
#include "keys.h"

#include <errno.h>
#include <mongoc/mongoc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The server refuses this side's rights (a deployment-wide stream, for a
 * user without the privilege on every database). */
#define ERR_UNAUTHORIZED 13
/* Server error codes that mean the stream's history is gone. */
#define ERR_CAPPED_POSITION_LOST 136
#define ERR_CHANGE_STREAM_FATAL 280
#define ERR_CHANGE_STREAM_HISTORY_LOST 286

#define BACKOFF_MIN_MS 50
#define BACKOFF_MAX_MS 2000
#define BACKOFF_FAILED_MS 10000
/* A stream the server refused to start: retried after 1 s, then twice as
 * long each time, up to BACKOFF_FAILED_MS. */
#define BACKOFF_STARTUP_MS 1000

/* Streams per database, polled in turn: the events one applies before the
 * next gets its turn, and the shortest await of their getMores (each
 * awaits max_await_ms shared among them, so a quiet round takes about
 * max_await_ms whatever their number). */
#define EVENTS_PER_TURN 256u
#define SHARE_MIN_MS 1
/* While events flow, how often the progress of every database a stream
 * carries is refreshed (readers allow 2 s more than twice the await). */
#define PROGRESS_ALL_NS 100000000ull

/* One followed database: its name and counters (guarded by the follower's
 * mu), and the follower thread's own view of it. */
typedef struct {
   uint32_t db_idx;
   uint32_t name_len;
   char name[CQC_DB_NAME_MAX];
   /* Guarded by mu. */
   cqc_stream_state_t state;
   uint64_t events;
   uint64_t reconnects;
   uint64_t history_lost;
   uint64_t event_bytes;
   uint64_t invalidations;
   uint32_t lag_us[CQC_LAG_WINDOW]; /* a ring of the latest lags */
   uint64_t lag_count;              /* every sample ever (the ring's head) */
   char last_error[256];
   /* The follower thread's own. */
   bool carried;      /* a stream has been opened carrying it */
   bool serving;      /* HEALTHY published, not taken back since */
   bool ever_healthy; /* entries can exist only once HEALTHY was published */
   bool fresh;        /* no entry of it predates its stream's coverage */
} fdb_t;

/* One change stream and the databases it carries, dbs[lo, hi): the one
 * deployment-wide stream (lo 0), or one database's (hi = lo + 1). The
 * follower thread's own. */
typedef struct {
   uint32_t lo, hi;
   uint32_t serving;            /* how many of them serve */
   mongoc_change_stream_t *cs;  /* NULL: not open */
   int64_t await_ms;            /* its getMores' maxAwaitTimeMS */
   bson_t *token;      /* last resume token, owned */
   bool start_after;   /* token came from an invalidate event */
   uint32_t open_t;    /* cluster time read before opening: seconds */
   uint32_t open_i;    /* and increment */
   bool have_open_time;
   bool caught_up;
   bool ever_opened;   /* it caught up once: a refusal is no longer a startup's */
   bool tried;         /* an open was attempted: later ones are reconnections */
   uint64_t freezes;   /* the arena's freeze count when open_t was read */
   int64_t backoff;
   uint64_t retry_ns;  /* CLOCK_MONOTONIC before which it is not opened */
   uint64_t all_progress_ns; /* when every database's progress was refreshed */
} follow_t;

struct cqc_stream {
   cqc_writer_t w;
   char *uri;
   char *ca_file; /* cqc_trust_t, owned copies; NULL: none */
   char *ca_dir;
   char *crl_file;
   int64_t max_await_ms;
   uint32_t cap; /* the arena's db_count */
   fdb_t *dbs;   /* [cap], in the order they were added */

   pthread_t thread;
   bool thread_started;
   pthread_mutex_t mu; /* guards what is marked so, and everything below */
   pthread_cond_t cv;
   bool stop;
   uint32_t n_dbs;   /* dbs[0, n_dbs) are followed; stored with release order */
   uint32_t *by_idx; /* [cap]: db_idx -> its place in dbs + 1 (0: not followed) */
   cqc_stream_scope_t scope; /* in use: changed by the thread only */
   char scope_reason[256];
   uint64_t getmores;

   /* The follower thread's own. */
   follow_t *chans; /* [cap]: the deployment's stream, or one per database */
   uint32_t n_chans;
   mongoc_client_t *client;
   mongoc_database_t **handles; /* [cap]: the database scope's, by dbs' place */
};

/* ======================================================================== */
/* Small helpers                                                            */
/* ======================================================================== */

static bool
should_stop (cqc_stream_t *s)
{
   bool v;
   pthread_mutex_lock (&s->mu);
   v = s->stop;
   pthread_mutex_unlock (&s->mu);
   return v;
}

/* Databases added beyond the first n (the thread's check between events). */
static bool
added_since (cqc_stream_t *s, uint32_t n)
{
   return __atomic_load_n (&s->n_dbs, __ATOMIC_ACQUIRE) > n;
}

/* Wait up to ms, waking early when asked to stop or given a database
 * beyond the first n. */
static void
wait_unless_stopped (cqc_stream_t *s, int64_t ms, uint32_t n)
{
   struct timespec ts;
   clock_gettime (CLOCK_REALTIME, &ts);
   ts.tv_sec += ms / 1000;
   ts.tv_nsec += (ms % 1000) * 1000000L;
   if (ts.tv_nsec >= 1000000000L) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000L;
   }
   pthread_mutex_lock (&s->mu);
   while (!s->stop && s->n_dbs == n) {
      if (pthread_cond_timedwait (&s->cv, &s->mu, &ts) == ETIMEDOUT) {
         break;
      }
   }
   pthread_mutex_unlock (&s->mu);
}

/* Publish a state to the arena (for readers) and to the info of dbs[lo,
 * hi), ch's. Only become_healthy publishes HEALTHY; any other state takes
 * serving back. A database whose start the server refused keeps saying so
 * while it is retried (keep_refused). */
static void
set_state (cqc_stream_t *s, follow_t *ch, uint32_t lo, uint32_t hi, cqc_stream_state_t st,
           bool keep_refused)
{
   uint32_t k;

   pthread_mutex_lock (&s->mu);
   for (k = lo; k < hi; k++) {
      if (!keep_refused || s->dbs[k].state != CQC_STREAM_STARTUP_FAILED) {
         s->dbs[k].state = st;
      }
   }
   pthread_mutex_unlock (&s->mu);
   pthread_mutex_lock (s->w.lock);
   for (k = lo; k < hi; k++) {
      /* The thread's own copy of the state: mu only orders it for readers. */
      cqc_arena_w_set_health (s->w.arena, s->dbs[k].db_idx, s->dbs[k].state);
   }
   pthread_mutex_unlock (s->w.lock);
   for (k = lo; k < hi; k++) {
      if (s->dbs[k].serving) {
         s->dbs[k].serving = false;
         ch->serving--;
      }
   }
}

static void
set_error (cqc_stream_t *s, const follow_t *ch, const bson_error_t *e)
{
   uint32_t k;
   char msg[256];
   int n = snprintf (msg, sizeof msg, "%u.%u: ", e->domain, e->code);

   if (n > 0 && (size_t) n < sizeof msg) {
      bson_strncpy (msg + n, e->message, sizeof msg - (size_t) n);
   }
   pthread_mutex_lock (&s->mu);
   for (k = ch->lo; k < ch->hi; k++) {
      memcpy (s->dbs[k].last_error, msg, sizeof msg);
   }
   pthread_mutex_unlock (&s->mu);
}

/* Drop every entry of dbs[lo, hi): their history has a gap. */
static void
drop_entries (cqc_stream_t *s, uint32_t lo, uint32_t hi, bool history_lost)
{
   uint32_t k;

   pthread_mutex_lock (s->w.lock);
   for (k = lo; k < hi; k++) {
      cqc_arena_w_invalidate_db (s->w.arena, s->dbs[k].db_idx);
      if (history_lost) {
         s->w.arena->dbs[s->dbs[k].db_idx].history_lost++;
      }
   }
   pthread_mutex_unlock (s->w.lock);
   if (history_lost) {
      pthread_mutex_lock (&s->mu);
      for (k = lo; k < hi; k++) {
         s->dbs[k].history_lost++;
      }
      pthread_mutex_unlock (&s->mu);
   }
}

static bool
ts_at_or_after (uint32_t t, uint32_t i, uint32_t ref_t, uint32_t ref_i)
{
   return t > ref_t || (t == ref_t && i >= ref_i);
}

/* Publish the cluster time up to which the database's writes are reflected
 * (cqc_db_t.applied_ts). Caller holds the writer lock; never moves back. */
static void
publish_applied_w (cqc_stream_t *s, uint32_t db_idx, uint32_t t, uint32_t i)
{
   cqc_db_t *db = &s->w.arena->dbs[db_idx];
   uint64_t ts = ((uint64_t) t << 32) | i;
   if (ts > db->applied_ts) {
      __atomic_store_n (&db->applied_ts, ts, __ATOMIC_RELEASE);
   }
}

/* Refresh the progress of every database ch carries. Caller holds the
 * writer lock. */
static void
progress_all_w (cqc_stream_t *s, follow_t *ch)
{
   uint32_t k;

   for (k = ch->lo; k < ch->hi; k++) {
      cqc_arena_w_progress (s->w.arena, s->dbs[k].db_idx);
   }
   ch->all_progress_ns = cqc_now_ns ();
}

/* Longest "_data" of the BSON layout decoded, in bytes (MongoDB's tokens
 * need only their first 9). */
#define TOKEN_DECODE_MAX 512

static int
hex_value (char c)
{
   if (c >= '0' && c <= '9') {
      return c - '0';
   }
   if (c >= 'a' && c <= 'f') {
      return c - 'a' + 10;
   }
   if (c >= 'A' && c <= 'F') {
      return c - 'A' + 10;
   }
   return -1;
}

/* Decode n bytes of hex text into out; false on a character that is not hex. */
static bool
hex_decode (const char *hex, uint8_t *out, size_t n)
{
   size_t k;
   for (k = 0; k < n; k++) {
      int hi = hex_value (hex[2 * k]), lo = hex_value (hex[2 * k + 1]);
      if (hi < 0 || lo < 0) {
         return false;
      }
      out[k] = (uint8_t) (hi << 4 | lo);
   }
   return true;
}

static uint32_t
be32 (const uint8_t *p)
{
   return (uint32_t) p[0] << 24 | (uint32_t) p[1] << 16 | (uint32_t) p[2] << 8 | p[3];
}

/* The cluster time a resume token stands for, for the layouts known here.
 * Its "_data" string is hex text of either
 *   - MongoDB's KeyString, whose first value is the event's (or, for a
 *     postBatchResumeToken, the scanned) cluster time: type byte 0x82, then
 *     seconds and increment big-endian; or
 *   - a BSON document whose field "t" is a Timestamp (SecantusDB's layout).
 * Any other token gives false: the applied time then moves with events only,
 * which is safe (the causal floor is reached later, never early).
 * *high_water says whether the layout is MongoDB's: only its empty batch's
 * token is a high-water mark that no write still committing can precede.
 * SecantusDB mints an empty batch's token after a scan that may have missed
 * a write to the watched database still committing (when it saw only other
 * databases' entries), so its time is not taken as applied (docs/
 * consistency.md). */
static bool
resume_token_time (const bson_t *token, uint32_t *t, uint32_t *i, bool *high_water)
{
   bson_iter_t it;
   const char *hex;
   uint32_t len;
   uint8_t buf[TOKEN_DECODE_MAX];
   bson_t doc;

   if (!token || !bson_iter_init_find (&it, token, "_data") || !BSON_ITER_HOLDS_UTF8 (&it)) {
      return false;
   }
   hex = bson_iter_utf8 (&it, &len);
   *high_water = false;
   if (len >= 18 && hex[0] == '8' && hex[1] == '2') {
      if (!hex_decode (hex, buf, 9)) {
         return false;
      }
      *high_water = true;
      *t = be32 (buf + 1);
      *i = be32 (buf + 5);
      return true;
   }
   if (len % 2 || len / 2 > sizeof buf || !hex_decode (hex, buf, len / 2) ||
       !bson_init_static (&doc, buf, len / 2) || !bson_iter_init_find (&it, &doc, "t") ||
       !BSON_ITER_HOLDS_TIMESTAMP (&it)) {
      return false;
   }
   bson_iter_timestamp (&it, t, i);
   return true;
}

/* ======================================================================== */
/* Applying events                                                          */
/* ======================================================================== */

static bool
get_ns (const bson_t *doc, const char *field, const char **db, uint32_t *db_len,
        const char **coll, uint32_t *coll_len)
{
   bson_iter_t it, child;
   char path[32];

   *db = *coll = NULL;
   *db_len = *coll_len = 0;
   snprintf (path, sizeof path, "%s.db", field);
   if (bson_iter_init (&it, doc) && bson_iter_find_descendant (&it, path, &child) &&
       BSON_ITER_HOLDS_UTF8 (&child)) {
      *db = bson_iter_utf8 (&child, db_len);
   }
   snprintf (path, sizeof path, "%s.coll", field);
   if (bson_iter_init (&it, doc) && bson_iter_find_descendant (&it, path, &child) &&
       BSON_ITER_HOLDS_UTF8 (&child)) {
      *coll = bson_iter_utf8 (&child, coll_len);
   }
   return *db != NULL;
}

/* Invalidate a namespace if it is registered (an unregistered one holds no
 * entries: registration precedes every capture). */
static void
invalidate_ns_named_w (cqc_arena_t *a, const char *db, uint32_t db_len, const char *coll,
                       uint32_t coll_len)
{
   uint32_t ns_idx;
   if (db && coll && cqc_arena_w_ns_lookup (a, db, db_len, coll, coll_len, &ns_idx)) {
      cqc_arena_w_invalidate_ns (a, ns_idx);
   }
}

/* The database of ch named db (NULL: none). */
static fdb_t *
chan_db (cqc_stream_t *s, const follow_t *ch, const char *db, uint32_t len)
{
   uint32_t k;

   for (k = ch->lo; db && k < ch->hi; k++) {
      if (s->dbs[k].name_len == len && !memcmp (s->dbs[k].name, db, len)) {
         return &s->dbs[k];
      }
   }
   return NULL;
}

/* Drop the entries of d, or of every database ch carries (d NULL: an event
 * that names none of them). Caller holds the writer lock. */
static void
invalidate_db_w (cqc_stream_t *s, const follow_t *ch, const fdb_t *d)
{
   uint32_t k;

   if (d) {
      cqc_arena_w_invalidate_db (s->w.arena, d->db_idx);
      return;
   }
   for (k = ch->lo; k < ch->hi; k++) {
      cqc_arena_w_invalidate_db (s->w.arena, s->dbs[k].db_idx);
   }
}

/* Count an applied event in the arena (release order after the
 * invalidation it made: a reader that sees the new count also sees the
 * invalidation, which the coherence checker relies on), and move the
 * database's applied time and progress. Caller holds the writer lock. */
static void
count_event_w (cqc_stream_t *s, const fdb_t *d, bool have_time, uint32_t t, uint32_t i)
{
   cqc_db_t *db = &s->w.arena->dbs[d->db_idx];

   __atomic_store_n (&db->events, db->events + 1, __ATOMIC_RELEASE);
   if (have_time) {
      publish_applied_w (s, d->db_idx, t, i);
   }
   cqc_arena_w_progress (s->w.arena, d->db_idx);
}

/* Apply one change event of ch's stream. Returns true if the stream was
 * invalidated and must be reopened. Called without the writer lock. */
static bool
apply_event (cqc_stream_t *s, follow_t *ch, const bson_t *doc)
{
   cqc_arena_t *a = s->w.arena;
   bson_iter_t it, child;
   const char *op = "";
   const char *db, *coll, *to_db, *to_coll;
   uint32_t db_len, coll_len, to_db_len, to_coll_len, ns_idx, k;
   bool invalidated = false;
   bool have_time = false;
   bool untouched = false;
   bool all;
   uint32_t ev_t = 0, ev_i = 0;
   int64_t wall_ms = 0;
   fdb_t *d;

   if (bson_iter_init_find (&it, doc, "operationType") && BSON_ITER_HOLDS_UTF8 (&it)) {
      op = bson_iter_utf8 (&it, NULL);
   }
   get_ns (doc, "ns", &db, &db_len, &coll, &coll_len);
   get_ns (doc, "to", &to_db, &to_db_len, &to_coll, &to_coll_len);
   /* The database the event is about: its namespace's, else a rename's
    * target's, else a database's own stream's, or the deployment-wide
    * stream's only one for an event that names no database. */
   d = chan_db (s, ch, db, db_len);
   d = d ? d : chan_db (s, ch, to_db, to_db_len);
   if (!d && ch->hi - ch->lo == 1 && (!db || s->scope == CQC_STREAM_SCOPE_DATABASE)) {
      d = &s->dbs[ch->lo];
   }
   if (bson_iter_init_find (&it, doc, "clusterTime") && BSON_ITER_HOLDS_TIMESTAMP (&it)) {
      bson_iter_timestamp (&it, &ev_t, &ev_i);
      have_time = true;
      if (ch->have_open_time && ts_at_or_after (ev_t, ev_i, ch->open_t, ch->open_i)) {
         ch->caught_up = true;
      }
   }
   if (!d && db && strcmp (op, "invalidate")) {
      /* The deployment-wide stream's $match lets every rename through: one
       * between databases it does not carry changes nothing here. */
      return false;
   }

   pthread_mutex_lock (s->w.lock);
   if (!strcmp (op, "insert") || !strcmp (op, "update") || !strcmp (op, "replace") ||
       !strcmp (op, "delete")) {
      untouched = true; /* unless the namespace is cached here */
      if (db && coll && cqc_arena_w_ns_lookup (a, db, db_len, coll, coll_len, &ns_idx)) {
         untouched = false;
         uint64_t h;
         bool ok;
         if (bson_iter_init (&it, doc) &&
             bson_iter_find_descendant (&it, "documentKey._id", &child) &&
             cqc_id_hash (&child, &h, &ok) == CQC_ID_CELL) {
            cqc_arena_w_invalidate_id (a, ns_idx, cqc_id_cell (h, ns_idx, a->geo.idgen_count));
         } else {
            cqc_arena_w_invalidate_ns (a, ns_idx);
         }
      }
   } else if (!strcmp (op, "drop")) {
      invalidate_ns_named_w (a, db, db_len, coll, coll_len);
   } else if (!strcmp (op, "rename")) {
      invalidate_ns_named_w (a, db, db_len, coll, coll_len);
      if (to_db && to_coll) {
         invalidate_ns_named_w (a, to_db, to_db_len, to_coll, to_coll_len);
      } else {
         invalidate_db_w (s, ch, d);
      }
   } else if (!strcmp (op, "dropDatabase")) {
      invalidate_db_w (s, ch, d);
   } else if (!strcmp (op, "invalidate")) {
      invalidate_db_w (s, ch, NULL);
      invalidated = true;
   } else if (db && coll) {
      /* create, modify, createIndexes, dropIndexes, shardCollection and any
       * event type this version does not know: drop the namespace. */
      invalidate_ns_named_w (a, db, db_len, coll, coll_len);
   } else {
      invalidate_db_w (s, ch, d);
   }
   /* An invalidate, or an event naming none of ch's databases, is about
    * every one of them. */
   all = !d || invalidated;
   for (k = ch->lo; k < ch->hi; k++) {
      if (all || &s->dbs[k] == d) {
         count_event_w (s, &s->dbs[k], have_time, ev_t, ev_i);
      }
   }
   pthread_mutex_unlock (s->w.lock);

   if (bson_iter_init_find (&it, doc, "wallTime") && BSON_ITER_HOLDS_DATE_TIME (&it)) {
      wall_ms = bson_iter_date_time (&it);
   }
   pthread_mutex_lock (&s->mu);
   for (k = ch->lo; k < ch->hi; k++) {
      fdb_t *e = &s->dbs[k];
      if (!all && e != d) {
         continue;
      }
      e->events++;
      e->event_bytes += doc->len;
      e->invalidations += untouched ? 0 : 1;
      if (wall_ms > 0) {
         struct timespec now;
         int64_t lag_us;

         clock_gettime (CLOCK_REALTIME, &now);
         lag_us = ((int64_t) now.tv_sec * 1000 + now.tv_nsec / 1000000 - wall_ms) * 1000 +
                  (now.tv_nsec / 1000) % 1000;
         lag_us = lag_us < 0 ? 0 : lag_us > (int64_t) UINT32_MAX ? (int64_t) UINT32_MAX : lag_us;
         e->lag_us[e->lag_count++ % CQC_LAG_WINDOW] = (uint32_t) lag_us;
      }
   }
   pthread_mutex_unlock (&s->mu);
   return invalidated;
}

/* ======================================================================== */
/* The follower thread                                                      */
/* ======================================================================== */

#ifdef MONGOC_ENABLE_SSL
/* A URI that turns TLS on and checks certificates without naming the
 * authorities (tlsCAFile) gets the platform's trust store, s->ca_file and
 * s->ca_dir, instead of the one compiled into libmongoc's OpenSSL (which in
 * the wheel is built for Debian's /etc/ssl); and a follower given the
 * application's revocation list (s->crl_file, its tlsCRLFile, which no URI
 * option carries to libmongoc) checks the server's certificate against it,
 * with whichever authorities verify. The other fields are read from the
 * URI exactly as libmongoc reads them itself (_mongoc_ssl_opts_from_uri,
 * the same from 1.23 to 2.x), and mongoc_client_set_ssl_opts keeps the
 * OCSP options the client parsed from it: what is verified stays what the
 * URI says; only where the authorities come from, and the revocation list,
 * change. Nothing is allocated: libmongoc copies the strings. */
static void
set_trust (const cqc_stream_t *s, const mongoc_uri_t *uri, mongoc_client_t *client)
{
   mongoc_ssl_opt_t opt = {0};
   const char *uri_ca = mongoc_uri_get_option_as_utf8 (uri, MONGOC_URI_TLSCAFILE, NULL);
   bool insecure;

   if (!mongoc_uri_get_tls (uri) || (!s->crl_file && (uri_ca || (!s->ca_file && !s->ca_dir)))) {
      return;
   }
   insecure = mongoc_uri_get_option_as_bool (uri, MONGOC_URI_TLSINSECURE, false);
   opt.weak_cert_validation =
      mongoc_uri_get_option_as_bool (uri, MONGOC_URI_TLSALLOWINVALIDCERTIFICATES, insecure);
   if (opt.weak_cert_validation) {
      return; /* no chain is verified: no authorities to find, no list to check */
   }
   opt.allow_invalid_hostname =
      mongoc_uri_get_option_as_bool (uri, MONGOC_URI_TLSALLOWINVALIDHOSTNAMES, insecure);
   opt.pem_file = mongoc_uri_get_option_as_utf8 (uri, MONGOC_URI_TLSCERTIFICATEKEYFILE, NULL);
   opt.pem_pwd =
      mongoc_uri_get_option_as_utf8 (uri, MONGOC_URI_TLSCERTIFICATEKEYFILEPASSWORD, NULL);
   opt.ca_file = uri_ca ? uri_ca : s->ca_file;
   opt.ca_dir = uri_ca ? NULL : s->ca_dir;
   opt.crl_file = s->crl_file;
   mongoc_client_set_ssl_opts (client, &opt);
}
#endif

/* Counts the getMores the follower's client sends (libmongoc's APM). */
static void
command_started (const mongoc_apm_command_started_t *event)
{
   cqc_stream_t *s = mongoc_apm_command_started_get_context (event);

   if (!strcmp (mongoc_apm_command_started_get_command_name (event), "getMore")) {
      pthread_mutex_lock (&s->mu);
      s->getmores++;
      pthread_mutex_unlock (&s->mu);
   }
}

static mongoc_client_t *
make_client (cqc_stream_t *s, bson_error_t *error)
{
   mongoc_uri_t *uri = mongoc_uri_new_with_error (s->uri, error);
   mongoc_client_t *client = NULL;
   int32_t socket_ms = (int32_t) (s->max_await_ms + 10000);

   if (!uri) {
      goto cleanup;
   }
   mongoc_uri_set_option_as_int32 (uri, MONGOC_URI_SERVERSELECTIONTIMEOUTMS, 5000);
   mongoc_uri_set_option_as_int32 (uri, MONGOC_URI_CONNECTTIMEOUTMS, 5000);
   mongoc_uri_set_option_as_int32 (uri, MONGOC_URI_SOCKETTIMEOUTMS, socket_ms);
   if (!mongoc_uri_get_option_as_utf8 (uri, MONGOC_URI_APPNAME, NULL)) {
      mongoc_uri_set_appname (uri, "client-query-cache-stream");
   }
   client = mongoc_client_new_from_uri_with_error (uri, error);
   if (client) {
      mongoc_apm_callbacks_t *apm = mongoc_apm_callbacks_new ();

      mongoc_apm_set_command_started_cb (apm, command_started);
      mongoc_client_set_apm_callbacks (client, apm, s); /* copies them */
      mongoc_apm_callbacks_destroy (apm);
      mongoc_client_set_error_api (client, MONGOC_ERROR_API_VERSION_2);
#ifdef MONGOC_ENABLE_SSL
      set_trust (s, uri, client);
#endif
   }
cleanup:
   mongoc_uri_destroy (uri);
   return client;
}

static bool
is_network_error (const bson_error_t *e)
{
   return e->domain == MONGOC_ERROR_STREAM || e->domain == MONGOC_ERROR_SERVER_SELECTION ||
          e->domain == MONGOC_ERROR_CLIENT || e->domain == MONGOC_ERROR_PROTOCOL;
}

/* Whether the TLS handshake failed because this side refused the server:
 * its certificate chain (unknown authority, expired, ...), its name, or its
 * OCSP status. libmongoc has no error code of its own for these, only the
 * messages of its OpenSSL stream (mongoc-stream-tls-openssl.c, the same
 * from 1.23 to 2.x), which server selection quotes in its own. */
static bool
is_tls_refusal (const bson_error_t *e)
{
   return (e->domain == MONGOC_ERROR_STREAM || e->domain == MONGOC_ERROR_SERVER_SELECTION) &&
          (strstr (e->message, "TLS handshake failed: certificate verify failed") ||
           strstr (e->message, "TLS handshake failed: Failed certificate verification") ||
           strstr (e->message, "TLS handshake failed: Failed OCSP verification"));
}

/* Read the deployment's cluster time, so the stream knows when it has caught
 * up with everything that happened before it was opened. Returns false,
 * with *error set, when the server could not be reached (selection, the
 * network, TLS, authentication): opening the stream cannot work either, and
 * this error says why, where a second attempt inside libmongoc's 5 s
 * cooldown would only say "No servers yet eligible for rescan". Any other
 * failure only leaves the open time unknown. */
static bool
read_open_time (mongoc_client_t *client, follow_t *f, bson_error_t *error)
{
   bson_t cmd = BSON_INITIALIZER;
   bson_t reply;
   bson_iter_t it;
   bool reached = true;

   f->have_open_time = false;
   BSON_APPEND_INT32 (&cmd, "ping", 1);
   if (mongoc_client_command_simple (client, "admin", &cmd, NULL, &reply, error)) {
      if (bson_iter_init_find (&it, &reply, "operationTime") && BSON_ITER_HOLDS_TIMESTAMP (&it)) {
         bson_iter_timestamp (&it, &f->open_t, &f->open_i);
         f->have_open_time = true;
      }
   } else {
      reached = !is_network_error (error);
   }
   bson_destroy (&reply);
   bson_destroy (&cmd);
   return reached;
}

static bool
is_history_lost (const bson_error_t *e)
{
   return e->code == ERR_CHANGE_STREAM_HISTORY_LOST || e->code == ERR_CHANGE_STREAM_FATAL ||
          e->code == ERR_CAPPED_POSITION_LOST;
}

/* Whether the server refused this side's credentials or rights: libmongoc's
 * authentication failure (its handshake's, which server selection reports),
 * or the server's AuthenticationFailed (18) or Unauthorized (13). */
static bool
is_auth_refusal (const bson_error_t *e)
{
   return (e->domain == MONGOC_ERROR_CLIENT && e->code == MONGOC_ERROR_CLIENT_AUTHENTICATE) ||
          (!is_network_error (e) && (e->code == 18 || e->code == 13)) ||
          (e->domain == MONGOC_ERROR_SERVER_SELECTION && strstr (e->message, "uthentication failed"));
}

/* Whether the server refused this side's rights (not its credentials). */
static bool
is_unauthorized (const bson_error_t *e)
{
   return !is_network_error (e) && e->code == ERR_UNAUTHORIZED;
}

/* Decide what ch's error means for its databases. Returns the backoff in ms
 * before its stream is opened again. */
static int64_t
handle_error (cqc_stream_t *s, follow_t *ch, const bson_error_t *e)
{
   uint32_t k;

   set_error (s, ch, e);
   pthread_mutex_lock (&s->mu);
   for (k = ch->lo; k < ch->hi; k++) {
      s->dbs[k].reconnects++;
   }
   pthread_mutex_unlock (&s->mu);
   pthread_mutex_lock (s->w.lock);
   for (k = ch->lo; k < ch->hi; k++) {
      s->w.arena->dbs[s->dbs[k].db_idx].reconnects++;
   }
   pthread_mutex_unlock (s->w.lock);

   if (!ch->ever_opened &&
       (is_auth_refusal (e) || (!is_network_error (e) && !is_history_lost (e)))) {
      /* The stream never opened, and the server refused it (the
       * credentials, the rights, a deployment without change streams):
       * nothing to resume, and a quick retry would be refused again. */
      set_state (s, ch, ch->lo, ch->hi, CQC_STREAM_STARTUP_FAILED, false);
      ch->backoff = ch->backoff >= BACKOFF_STARTUP_MS
                       ? (ch->backoff * 2 > BACKOFF_FAILED_MS ? BACKOFF_FAILED_MS : ch->backoff * 2)
                       : BACKOFF_STARTUP_MS;
      return ch->backoff;
   }
   if (is_tls_refusal (e)) {
      /* This side refused the server's certificate: a matter of
       * configuration (the authorities, the name) or of the server's
       * certificate, which a quick retry will not mend. The resume token is
       * kept: a server it can verify again resumes where this one left. */
      set_state (s, ch, ch->lo, ch->hi, CQC_STREAM_FAILED, false);
      ch->backoff = BACKOFF_FAILED_MS;
      return ch->backoff;
   }
   if (is_network_error (e) && !is_history_lost (e)) {
      set_state (s, ch, ch->lo, ch->hi, CQC_STREAM_RECONNECTING, false);
      ch->backoff = ch->backoff ? (ch->backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : ch->backoff * 2)
                                : BACKOFF_MIN_MS;
      return ch->backoff;
   }
   if (ch->token || is_history_lost (e)) {
      /* A resume the server refused: whatever happened in the gap is
       * unknown. Drop the databases' entries and start afresh. */
      set_state (s, ch, ch->lo, ch->hi, CQC_STREAM_RECONNECTING, false);
      drop_entries (s, ch->lo, ch->hi, true);
      bson_destroy (ch->token);
      ch->token = NULL;
      ch->start_after = false;
      ch->backoff = BACKOFF_MIN_MS;
      return ch->backoff;
   }
   /* The server refuses the stream itself (no change streams, no rights). */
   set_state (s, ch, ch->lo, ch->hi, CQC_STREAM_FAILED, false);
   ch->backoff = BACKOFF_FAILED_MS;
   return ch->backoff;
}

static void
save_token (follow_t *ch, const bson_t *token, bool start_after)
{
   if (!token) {
      return;
   }
   bson_destroy (ch->token);
   ch->token = bson_copy (token);
   ch->start_after = start_after;
}

/* Start a catch-up: note the owner's freeze count, then read the
 * deployment's time (in that order: a freeze noted after the time was read
 * would let a time from before it pass). */
static bool
read_open_time_noting_freezes (cqc_stream_t *s, follow_t *ch, bson_error_t *error)
{
   ch->freezes = __atomic_load_n (&s->w.arena->hdr->freezes, __ATOMIC_ACQUIRE);
   return read_open_time (s->client, ch, error);
}

/* Applying the first event of a backlog would make readers serve entries
 * whose invalidations are still queued behind it: stop serving, read the
 * deployment's time as of now, and serve again once caught up with it (an
 * event at or after it, or an empty batch from a later getMore). */
static void
catch_up_first (cqc_stream_t *s, follow_t *ch)
{
   bson_error_t ignored; /* the stream's next batch tells whether it still works */
   uint32_t k;

   for (k = ch->lo; k < ch->hi; k++) {
      if (s->dbs[k].serving) {
         set_state (s, ch, k, k + 1, CQC_STREAM_RECONNECTING, false);
      }
   }
   read_open_time_noting_freezes (s, ch, &ignored);
   ch->caught_up = false;
}

/* ch's stream has caught up: its databases that do not serve yet serve. A
 * database with no entry older than the stream (fresh: opened without a
 * resume token, or carried for the first time) has every write up to the
 * time read before opening reflected.
 *
 * Unless the owner was frozen since the catch-up began: its demotion
 * (owner.c) may have landed just before this promotion, and what looked
 * caught up is then a batch from before the freeze, with the freeze's
 * writes still queued behind it. The freeze count is compared and HEALTHY
 * published in one hold of the writer lock, the lock the demotion holds
 * while it bumps the count: either the demotion comes after and demotes
 * this HEALTHY, or the comparison sees it and the catch-up starts over. */
static void
become_healthy (cqc_stream_t *s, follow_t *ch)
{
   bool frozen;
   uint32_t k;

   pthread_mutex_lock (s->w.lock);
   frozen = s->w.arena->hdr->freezes != ch->freezes;
   for (k = ch->lo; k < ch->hi && !frozen; k++) {
      fdb_t *d = &s->dbs[k];
      if (!d->serving) {
         if (d->fresh && ch->have_open_time) {
            publish_applied_w (s, d->db_idx, ch->open_t, ch->open_i);
         }
         cqc_arena_w_set_health (s->w.arena, d->db_idx, CQC_STREAM_HEALTHY);
      }
   }
   pthread_mutex_unlock (s->w.lock);
   if (frozen) {
      catch_up_first (s, ch);
      return;
   }
   pthread_mutex_lock (&s->mu);
   for (k = ch->lo; k < ch->hi; k++) {
      s->dbs[k].state = CQC_STREAM_HEALTHY;
   }
   pthread_mutex_unlock (&s->mu);
   for (k = ch->lo; k < ch->hi; k++) {
      s->dbs[k].serving = s->dbs[k].ever_healthy = true;
   }
   ch->serving = ch->hi - ch->lo;
   ch->ever_opened = true;
   ch->backoff = 0;
}

/* Whether readers stopped trusting ch's stream while it believed its
 * databases served: it was silent for longer than the stall bound, or the
 * owner demoted them after being frozen past its heartbeat timeout
 * (owner.c). What it delivers next is a backlog. The databases it carries
 * progress together and a demotion takes every one, so the first that
 * serves tells. */
static bool
distrusted (cqc_stream_t *s, const follow_t *ch)
{
   const cqc_db_t *d = NULL;
   uint64_t now = cqc_now_ns ();
   bool silent, demoted;
   uint32_t k;

   for (k = ch->lo; k < ch->hi && !d; k++) {
      d = s->dbs[k].serving ? &s->w.arena->dbs[s->dbs[k].db_idx] : NULL;
   }
   if (!d) {
      return false;
   }
   pthread_mutex_lock (s->w.lock);
   silent = now > d->progress_ns + d->stall_ns;
   demoted = d->health != CQC_STREAM_HEALTHY;
   pthread_mutex_unlock (s->w.lock);
   return silent || demoted;
}

/* The await of one getMore of a database's stream, when n are polled in
 * turn. */
static int64_t
share_ms (const cqc_stream_t *s, uint32_t n)
{
   int64_t ms = s->max_await_ms / (n ? n : 1);
   return ms < SHARE_MIN_MS ? SHARE_MIN_MS : ms;
}

/* The pipeline of ch's stream: in the deployment scope a $match keeping
 * the events of its databases, every rename (a rename into one of them
 * names its source's database; renames are rare, and apply_event ignores
 * those between other databases) and any event without a namespace; then
 * the fields invalidation needs. The database names appear once: a server
 * that evaluates the pipeline per batch (the test server) pays for its
 * size on every event. */
static bson_t *
make_pipeline (const cqc_stream_t *s, const follow_t *ch, bool deployment)
{
   /* Arrays are made as documents keyed "0", "1", ... and appended whole
    * (bson_append_array): libbson 2.x deprecates bson_append_array_begin. */
   bson_t *p = bson_new ();
   bson_t stages = BSON_INITIALIZER, alts = BSON_INITIALIZER, names = BSON_INITIALIZER;
   bson_t stage, body, alt, cond;
   char key[16];
   const char *kp;
   uint32_t k, n = 0;

   if (deployment) {
      for (k = ch->lo; k < ch->hi; k++) {
         bson_uint32_to_string (k - ch->lo, &kp, key, sizeof key);
         bson_append_utf8 (&names, kp, -1, s->dbs[k].name, (int) s->dbs[k].name_len);
      }
      bson_append_document_begin (&alts, "0", 1, &alt);
      bson_append_document_begin (&alt, "ns.db", -1, &cond);
      bson_append_array (&cond, "$in", -1, &names);
      bson_append_document_end (&alt, &cond);
      bson_append_document_end (&alts, &alt);
      bson_append_document_begin (&alts, "1", 1, &alt);
      BSON_APPEND_UTF8 (&alt, "operationType", "rename");
      bson_append_document_end (&alts, &alt);
      bson_append_document_begin (&alts, "2", 1, &alt);
      bson_append_document_begin (&alt, "ns", 2, &cond);
      BSON_APPEND_BOOL (&cond, "$exists", false);
      bson_append_document_end (&alt, &cond);
      bson_append_document_end (&alts, &alt);
      bson_uint32_to_string (n++, &kp, key, sizeof key);
      bson_append_document_begin (&stages, kp, -1, &stage);
      bson_append_document_begin (&stage, "$match", -1, &body);
      bson_append_array (&body, "$or", -1, &alts);
      bson_append_document_end (&stage, &body);
      bson_append_document_end (&stages, &stage);
   }
   bson_uint32_to_string (n, &kp, key, sizeof key);
   bson_append_document_begin (&stages, kp, -1, &stage);
   bson_append_document_begin (&stage, "$project", -1, &body);
   BSON_APPEND_INT32 (&body, "operationType", 1);
   BSON_APPEND_INT32 (&body, "ns", 1);
   BSON_APPEND_INT32 (&body, "documentKey", 1);
   BSON_APPEND_INT32 (&body, "clusterTime", 1);
   BSON_APPEND_INT32 (&body, "wallTime", 1);
   BSON_APPEND_INT32 (&body, "to", 1);
   bson_append_document_end (&stage, &body);
   bson_append_document_end (&stages, &stage);
   bson_append_array (p, "pipeline", -1, &stages);
   bson_destroy (&names);
   bson_destroy (&alts);
   bson_destroy (&stages);
   return p;
}

/* Open ch's stream, carrying every database it is to carry. A database
 * carried for the first time is fresh; one carried before keeps serving
 * when the stream resumes from its token, and otherwise (no token: what
 * was cached is unverifiable) loses its entries and serves again once
 * caught up. Returns false with *error set. */
static bool
open_chan (cqc_stream_t *s, follow_t *ch, bson_error_t *error)
{
   bool deployment = s->scope == CQC_STREAM_SCOPE_DEPLOYMENT;
   bson_t opts = BSON_INITIALIZER;
   bson_t *pipeline;
   const bson_t *reply = NULL;
   uint32_t k;
   bool ok;

   if (deployment) {
      ch->hi = __atomic_load_n (&s->n_dbs, __ATOMIC_ACQUIRE);
   }
   for (k = ch->lo; k < ch->hi; k++) {
      fdb_t *d = &s->dbs[k];
      if (!d->carried) {
         d->carried = d->fresh = true;
         set_state (s, ch, k, k + 1, CQC_STREAM_CONNECTING, true);
         continue;
      }
      if (!ch->token) {
         if (d->serving) {
            set_state (s, ch, k, k + 1, CQC_STREAM_RECONNECTING, false);
         }
         if (d->ever_healthy) {
            drop_entries (s, k, k + 1, false);
         }
      } else if (!d->serving) {
         set_state (s, ch, k, k + 1, CQC_STREAM_RECONNECTING, true);
      }
      d->fresh = !ch->token || !d->ever_healthy;
   }
   ch->tried = true;
   ch->caught_up = false;
   if (!read_open_time_noting_freezes (s, ch, error)) {
      bson_destroy (&opts);
      return false; /* error says why */
   }
   ch->await_ms = deployment ? s->max_await_ms : share_ms (s, s->n_chans);
   BSON_APPEND_INT64 (&opts, "maxAwaitTimeMS", ch->await_ms);
   if (ch->token) {
      BSON_APPEND_DOCUMENT (&opts, ch->start_after ? "startAfter" : "resumeAfter", ch->token);
   }
   pipeline = make_pipeline (s, ch, deployment);
   if (deployment) {
      ch->cs = mongoc_client_watch (s->client, pipeline, &opts);
   } else {
      if (!s->handles[ch->lo]) {
         s->handles[ch->lo] = mongoc_client_get_database (s->client, s->dbs[ch->lo].name);
      }
      ch->cs = mongoc_database_watch (s->handles[ch->lo], pipeline, &opts);
   }
   ok = !mongoc_change_stream_error_document (ch->cs, error, &reply);
   if (!ok) {
      mongoc_change_stream_destroy (ch->cs);
      ch->cs = NULL;
   }
   bson_destroy (pipeline);
   bson_destroy (&opts);
   return ok;
}

static void
close_chan (follow_t *ch)
{
   mongoc_change_stream_destroy (ch->cs);
   ch->cs = NULL;
}

/* Close every stream and the client (libmongoc keeps a server a
 * single-threaded client failed to reach in a 5 s cooldown; a new client
 * tries again after the backoff alone). The streams keep their tokens and
 * resume where they were. */
static void
drop_client (cqc_stream_t *s)
{
   uint32_t k;

   for (k = 0; k < s->n_chans; k++) {
      close_chan (&s->chans[k]);
   }
   for (k = 0; k < s->cap; k++) {
      mongoc_database_destroy (s->handles[k]);
      s->handles[k] = NULL;
   }
   mongoc_client_destroy (s->client);
   s->client = NULL;
}

/* The deployment refused a deployment-wide stream: follow each database on
 * a stream of its own from now on. They start without a token (a
 * deployment-wide one means nothing to them), so what was cached goes. */
static void
fall_back (cqc_stream_t *s, const bson_error_t *e)
{
   follow_t *ch = &s->chans[0];
   uint32_t k;
   char why[sizeof s->scope_reason];
   int n = snprintf (why, sizeof why,
                     "the deployment refused a deployment-wide change stream: %u.%u: ", e->domain,
                     e->code);

   if (n > 0 && (size_t) n < sizeof why) {
      bson_strncpy (why + n, e->message, sizeof why - (size_t) n);
   }
   pthread_mutex_lock (&s->mu);
   s->scope = CQC_STREAM_SCOPE_DATABASE;
   memcpy (s->scope_reason, why, sizeof why);
   pthread_mutex_unlock (&s->mu);
   set_state (s, ch, ch->lo, ch->hi, CQC_STREAM_CONNECTING, true);
   for (k = ch->lo; k < ch->hi; k++) {
      if (s->dbs[k].ever_healthy) {
         drop_entries (s, k, k + 1, false);
      }
      s->dbs[k].carried = false;
   }
   close_chan (ch);
   bson_destroy (ch->token);
   memset (ch, 0, sizeof *ch);
   s->n_chans = 0;
}

/* Take the databases added since: in the deployment scope, re-open the
 * stream (from its token) with the wider $match; in the database scope,
 * give each a stream of its own. */
static void
take_added (cqc_stream_t *s, uint32_t n)
{
   uint32_t k;

   if (s->scope == CQC_STREAM_SCOPE_DEPLOYMENT) {
      s->n_chans = 1;
      if (s->chans[0].cs && s->chans[0].hi < n) {
         close_chan (&s->chans[0]);
         s->chans[0].retry_ns = 0;
      }
      return;
   }
   for (k = s->n_chans; k < n; k++) {
      memset (&s->chans[k], 0, sizeof s->chans[k]);
      s->chans[k].lo = k;
      s->chans[k].hi = k + 1;
   }
   s->n_chans = n;
}

typedef enum {
   ROUND_OK = 0,     /* its turn is over: open, and nothing is wrong */
   ROUND_ERROR = 1,  /* *error set */
   ROUND_REOPEN = 2, /* invalidated: open again from its token */
} round_t;

/* One turn of ch's open stream: apply its events until a batch comes back
 * empty (an awaited getMore), the database scope's turn is over, a
 * database was added or the follower is asked to stop. */
static round_t
run_round (cqc_stream_t *s, follow_t *ch, bson_error_t *error)
{
   const bson_t *doc;
   const bson_t *reply = NULL;
   uint32_t pbrt_t, pbrt_i, k;
   bool high_water, have_pbrt;
   uint32_t budget = s->scope == CQC_STREAM_SCOPE_DATABASE && s->n_chans > 1 ? EVENTS_PER_TURN
                                                                            : UINT32_MAX;
   /* When this round began: if it comes back empty, every event the server
    * could show before then has been applied (quiet_ns). */
   uint64_t round_ns = cqc_now_ns ();

   for (;; round_ns = cqc_now_ns ()) {
      bson_iter_t it;
      if (!mongoc_change_stream_next (ch->cs, &doc)) {
         break;
      }
      if (ch->serving && distrusted (s, ch)) {
         catch_up_first (s, ch);
      }
      if (apply_event (s, ch, doc)) {
         if (bson_iter_init_find (&it, doc, "_id") && BSON_ITER_HOLDS_DOCUMENT (&it)) {
            bson_t id;
            uint32_t len;
            const uint8_t *data;
            bson_iter_document (&it, &len, &data);
            if (bson_init_static (&id, data, len)) {
               save_token (ch, &id, true);
            }
         }
         return ROUND_REOPEN;
      }
      save_token (ch, mongoc_change_stream_get_resume_token (ch->cs), false);
      if (ch->caught_up && ch->serving < ch->hi - ch->lo) {
         become_healthy (s, ch);
      }
      if (cqc_now_ns () - ch->all_progress_ns > PROGRESS_ALL_NS) {
         pthread_mutex_lock (s->w.lock);
         progress_all_w (s, ch);
         pthread_mutex_unlock (s->w.lock);
      }
      if (--budget == 0 || should_stop (s) ||
          (s->scope == CQC_STREAM_SCOPE_DEPLOYMENT && added_since (s, ch->hi))) {
         return ROUND_OK;
      }
   }
   if (mongoc_change_stream_error_document (ch->cs, error, &reply)) {
      return ROUND_ERROR;
   }
   /* An empty batch: caught up with the server. Every event up to its
    * postBatchResumeToken has been applied above, where that token is a
    * high-water mark (resume_token_time). */
   save_token (ch, mongoc_change_stream_get_resume_token (ch->cs), false);
   have_pbrt = resume_token_time (ch->token, &pbrt_t, &pbrt_i, &high_water) && high_water;
   pthread_mutex_lock (s->w.lock);
   for (k = ch->lo; k < ch->hi; k++) {
      if (have_pbrt) {
         publish_applied_w (s, s->dbs[k].db_idx, pbrt_t, pbrt_i);
      }
      __atomic_store_n (&s->w.arena->dbs[s->dbs[k].db_idx].quiet_ns, round_ns, __ATOMIC_RELEASE);
   }
   pthread_mutex_unlock (s->w.lock);
   if (ch->serving && distrusted (s, ch)) {
      /* This batch may predate the pause: the next one tells. */
      catch_up_first (s, ch);
      return ROUND_OK;
   }
   ch->caught_up = true;
   if (ch->serving < ch->hi - ch->lo) {
      become_healthy (s, ch);
   }
   pthread_mutex_lock (s->w.lock);
   progress_all_w (s, ch);
   pthread_mutex_unlock (s->w.lock);
   return ROUND_OK;
}

/* ch failed with *e: decide when to open it again, or, for a refused
 * deployment-wide stream, change the scope. */
static void
chan_failed (cqc_stream_t *s, follow_t *ch, const bson_error_t *e)
{
   close_chan (ch);
   if (s->scope == CQC_STREAM_SCOPE_DEPLOYMENT && is_unauthorized (e)) {
      fall_back (s, e);
      return;
   }
   if (is_network_error (e)) {
      drop_client (s);
   }
   ch->retry_ns = cqc_now_ns () + (uint64_t) handle_error (s, ch, e) * 1000000ull;
}

static void *
stream_main (void *arg)
{
   cqc_stream_t *s = arg;
   bson_error_t error;
   uint32_t n, k;

   for (;;) {
      uint64_t now, wake = UINT64_MAX;
      bool ran = false;

      pthread_mutex_lock (&s->mu);
      n = s->n_dbs;
      pthread_mutex_unlock (&s->mu);
      if (should_stop (s)) {
         break;
      }
      if (n == 0) {
         wait_unless_stopped (s, 60000, 0);
         continue;
      }
      take_added (s, n);
      if (!s->client && !(s->client = make_client (s, &error))) {
         for (k = 0; k < s->n_chans; k++) {
            set_error (s, &s->chans[k], &error);
            set_state (s, &s->chans[k], s->chans[k].lo, s->chans[k].hi, CQC_STREAM_FAILED, false);
         }
         wait_unless_stopped (s, BACKOFF_FAILED_MS, n);
         continue;
      }
      for (k = 0; k < s->n_chans && s->client && !should_stop (s); k++) {
         follow_t *ch = &s->chans[k];
         round_t r;

         now = cqc_now_ns ();
         if (!ch->cs && now < ch->retry_ns) {
            wake = ch->retry_ns < wake ? ch->retry_ns : wake;
            continue;
         }
         if (!ch->cs && !open_chan (s, ch, &error)) {
            chan_failed (s, ch, &error);
            wake = ch->retry_ns < wake ? ch->retry_ns : wake;
            continue;
         }
         ran = true;
         r = run_round (s, ch, &error);
         if (r == ROUND_ERROR) {
            chan_failed (s, ch, &error);
         } else if (r == ROUND_REOPEN) {
            close_chan (ch);
            ch->retry_ns = 0;
         } else if (s->scope == CQC_STREAM_SCOPE_DATABASE && ch->token &&
                    ch->await_ms > 2 * share_ms (s, s->n_chans)) {
            /* More streams share the await than when it opened. */
            close_chan (ch);
            ch->retry_ns = 0;
         }
      }
      if (!ran && wake != UINT64_MAX) {
         now = cqc_now_ns ();
         if (wake > now) {
            wait_unless_stopped (s, (int64_t) ((wake - now) / 1000000ull) + 1, n);
         }
      }
   }

   for (k = 0; k < s->n_chans; k++) {
      close_chan (&s->chans[k]);
      bson_destroy (s->chans[k].token);
      s->chans[k].token = NULL;
   }
   if (s->client) {
      drop_client (s);
   }
   {
      /* Every database followed, carried by a stream or not yet. */
      follow_t every = {.lo = 0, .hi = __atomic_load_n (&s->n_dbs, __ATOMIC_ACQUIRE)};
      for (k = every.lo; k < every.hi; k++) {
         s->dbs[k].serving = false;
      }
      set_state (s, &every, every.lo, every.hi, CQC_STREAM_CLOSED, false);
   }
   return NULL;
}

/* ======================================================================== */
/* Public API                                                               */
/* ======================================================================== */

cqc_stream_t *
cqc_stream_start (cqc_writer_t *w, cqc_stream_scope_t scope, const char *uri,
                  const cqc_trust_t *trust, int64_t max_await_ms, char *err, size_t errlen)
{
   cqc_stream_t *s = calloc (1, sizeof *s);
   uint32_t cap = w->arena->geo.db_count;
   bool ok = false;

   if (!s) {
      snprintf (err, errlen, "out of memory");
      return NULL;
   }
   s->w = *w;
   s->cap = cap;
   s->scope = scope;
   if (scope == CQC_STREAM_SCOPE_DATABASE) {
      snprintf (s->scope_reason, sizeof s->scope_reason, "asked for: a stream per database");
   }
   s->max_await_ms = max_await_ms;
   s->uri = strdup (uri);
   s->ca_file = trust && trust->ca_file ? strdup (trust->ca_file) : NULL;
   s->ca_dir = trust && trust->ca_dir ? strdup (trust->ca_dir) : NULL;
   s->crl_file = trust && trust->crl_file ? strdup (trust->crl_file) : NULL;
   s->dbs = calloc (cap ? cap : 1, sizeof *s->dbs);
   s->by_idx = calloc (cap ? cap : 1, sizeof *s->by_idx);
   s->chans = calloc (cap ? cap : 1, sizeof *s->chans);
   s->handles = calloc (cap ? cap : 1, sizeof *s->handles);
   pthread_mutex_init (&s->mu, NULL);
   pthread_cond_init (&s->cv, NULL);
   if (!s->uri || !s->dbs || !s->by_idx || !s->chans || !s->handles ||
       (trust && trust->ca_file && !s->ca_file) || (trust && trust->ca_dir && !s->ca_dir) ||
       (trust && trust->crl_file && !s->crl_file)) {
      snprintf (err, errlen, "out of memory");
      goto cleanup;
   }
   if (pthread_create (&s->thread, NULL, stream_main, s) != 0) {
      snprintf (err, errlen, "could not start the change-stream thread");
      goto cleanup;
   }
   s->thread_started = true;
   ok = true;

cleanup:
   if (!ok) {
      cqc_stream_destroy (s);
      s = NULL;
   }
   return s;
}

bool
cqc_stream_add (cqc_stream_t *s, uint32_t db_idx, const char *db_name, char *err, size_t errlen)
{
   size_t len = strlen (db_name);
   fdb_t *d;

   if (db_idx >= s->cap || len >= CQC_DB_NAME_MAX) {
      snprintf (err, errlen, "database %u is out of the follower's range", db_idx);
      return false;
   }
   pthread_mutex_lock (s->w.lock);
   /* Readers consider progress older than this stalled. */
   __atomic_store_n (&s->w.arena->dbs[db_idx].stall_ns,
                     (uint64_t) (2 * s->max_await_ms + 2000) * 1000000ull, __ATOMIC_RELAXED);
   pthread_mutex_unlock (s->w.lock);
   pthread_mutex_lock (&s->mu);
   if (!s->by_idx[db_idx] && s->n_dbs < s->cap) {
      d = &s->dbs[s->n_dbs];
      d->db_idx = db_idx;
      d->name_len = (uint32_t) len;
      memcpy (d->name, db_name, len + 1);
      d->state = CQC_STREAM_NOT_STARTED;
      s->by_idx[db_idx] = s->n_dbs + 1;
      __atomic_store_n (&s->n_dbs, s->n_dbs + 1, __ATOMIC_RELEASE);
      pthread_cond_broadcast (&s->cv);
   }
   pthread_mutex_unlock (&s->mu);
   return true;
}

void
cqc_stream_signal_stop (cqc_stream_t *s)
{
   pthread_mutex_lock (&s->mu);
   s->stop = true;
   pthread_cond_broadcast (&s->cv);
   pthread_mutex_unlock (&s->mu);
}

void
cqc_stream_destroy (cqc_stream_t *s)
{
   if (!s) {
      return;
   }
   cqc_stream_signal_stop (s);
   if (s->thread_started) {
      pthread_join (s->thread, NULL);
   }
   pthread_mutex_destroy (&s->mu);
   pthread_cond_destroy (&s->cv);
   if (s->uri) {
      /* The URI may carry credentials: do not leave them in freed memory. */
      memset (s->uri, 0, strlen (s->uri));
   }
   free (s->uri);
   free (s->ca_file);
   free (s->ca_dir);
   free (s->crl_file);
   free (s->dbs);
   free (s->by_idx);
   free (s->chans);
   free (s->handles);
   free (s);
}

void
cqc_stream_destroy_keep_info (cqc_stream_t *s, cqc_stream_info_t *out)
{
   uint32_t k;

   cqc_stream_signal_stop (s);
   if (s->thread_started) {
      pthread_join (s->thread, NULL);
      s->thread_started = false;
   }
   for (k = 0; k < s->n_dbs; k++) {
      cqc_stream_get_info (s, s->dbs[k].db_idx, &out[s->dbs[k].db_idx]);
   }
   cqc_stream_destroy (s);
}

static int
cmp_u32 (const void *x, const void *y)
{
   uint32_t a = *(const uint32_t *) x, b = *(const uint32_t *) y;
   return a < b ? -1 : a > b;
}

bool
cqc_stream_get_info (cqc_stream_t *s, uint32_t db_idx, cqc_stream_info_t *out)
{
   uint32_t lags[CQC_LAG_WINDOW], n;
   const fdb_t *d;

   pthread_mutex_lock (&s->mu);
   if (db_idx >= s->cap || !s->by_idx[db_idx]) {
      pthread_mutex_unlock (&s->mu);
      return false;
   }
   d = &s->dbs[s->by_idx[db_idx] - 1];
   out->state = d->state;
   out->events = d->events;
   out->reconnects = d->reconnects;
   out->history_lost = d->history_lost;
   /* The getMores of the stream carrying the database: in the deployment
    * scope, shared by every database it carries. */
   out->getmores = s->getmores;
   out->event_bytes = d->event_bytes;
   out->invalidations = d->invalidations;
   n = d->lag_count < CQC_LAG_WINDOW ? (uint32_t) d->lag_count : CQC_LAG_WINDOW;
   memcpy (lags, d->lag_us, n * sizeof lags[0]);
   memcpy (out->last_error, d->last_error, sizeof out->last_error);
   out->scope = s->scope;
   memcpy (out->scope_reason, s->scope_reason, sizeof out->scope_reason);
   pthread_mutex_unlock (&s->mu);
   out->lag_samples = n;
   out->lag_p50_ms = out->lag_p95_ms = out->lag_max_ms = 0.0;
   if (n) {
      qsort (lags, n, sizeof lags[0], cmp_u32);
      out->lag_p50_ms = lags[(n - 1) / 2] / 1000.0;
      out->lag_p95_ms = lags[(uint32_t) ((n - 1) * 95ull / 100)] / 1000.0;
      out->lag_max_ms = lags[n - 1] / 1000.0;
   }
   return true;
}
