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

struct cqc_stream {
   cqc_writer_t w;
   uint32_t db_idx;
   char *db_name;
   char *uri;
   char *ca_file; /* cqc_trust_t, owned copies; NULL: none */
   char *ca_dir;
   char *crl_file;
   int64_t max_await_ms;

   pthread_t thread;
   bool thread_started;
   pthread_mutex_t mu; /* guards everything below */
   pthread_cond_t cv;
   bool stop;
   cqc_stream_state_t state;
   uint64_t events;
   uint64_t reconnects;
   uint64_t history_lost;
   uint64_t getmores;
   uint64_t event_bytes;
   uint64_t invalidations;
   uint32_t lag_us[CQC_LAG_WINDOW]; /* a ring of the latest lags */
   uint64_t lag_count;              /* every sample ever (the ring's head) */
   char last_error[256];
};

/* Per-connection state of the follower thread (not shared). */
typedef struct {
   bson_t *token;      /* last resume token, owned */
   bool start_after;   /* token came from an invalidate event */
   uint32_t open_t;    /* cluster time read before opening: seconds */
   uint32_t open_i;    /* and increment */
   bool have_open_time;
   bool caught_up;
   bool ever_healthy;  /* entries can exist only once HEALTHY was published */
   bool fresh;         /* opened without a resume token: nothing cached predates it */
   uint64_t freezes;   /* the arena's freeze count when open_t was read */
} follow_t;

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

/* Sleep up to ms, waking early when asked to stop. */
static void
sleep_unless_stopped (cqc_stream_t *s, int64_t ms)
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
   while (!s->stop) {
      if (pthread_cond_timedwait (&s->cv, &s->mu, &ts) == ETIMEDOUT) {
         break;
      }
   }
   pthread_mutex_unlock (&s->mu);
}

/* Publish a state to the arena (for readers) and to the info block. */
static void
set_state (cqc_stream_t *s, cqc_stream_state_t st)
{
   pthread_mutex_lock (s->w.lock);
   cqc_arena_w_set_health (s->w.arena, s->db_idx, st);
   pthread_mutex_unlock (s->w.lock);
   pthread_mutex_lock (&s->mu);
   s->state = st;
   pthread_mutex_unlock (&s->mu);
}

static void
set_error (cqc_stream_t *s, const bson_error_t *e)
{
   pthread_mutex_lock (&s->mu);
   int n = snprintf (s->last_error, sizeof s->last_error, "%u.%u: ", e->domain, e->code);
   if (n > 0 && (size_t) n < sizeof s->last_error) {
      bson_strncpy (s->last_error + n, e->message, sizeof s->last_error - (size_t) n);
   }
   pthread_mutex_unlock (&s->mu);
}

/* Drop every entry of the database: its history has a gap. */
static void
drop_database_entries (cqc_stream_t *s, bool history_lost)
{
   pthread_mutex_lock (s->w.lock);
   cqc_arena_w_invalidate_db (s->w.arena, s->db_idx);
   if (history_lost) {
      s->w.arena->dbs[s->db_idx].history_lost++;
   }
   pthread_mutex_unlock (s->w.lock);
   if (history_lost) {
      pthread_mutex_lock (&s->mu);
      s->history_lost++;
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
publish_applied_w (cqc_stream_t *s, uint32_t t, uint32_t i)
{
   cqc_db_t *db = &s->w.arena->dbs[s->db_idx];
   uint64_t ts = ((uint64_t) t << 32) | i;
   if (ts > db->applied_ts) {
      __atomic_store_n (&db->applied_ts, ts, __ATOMIC_RELEASE);
   }
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

/* Apply one change event. Returns true if the stream was invalidated and
 * must be reopened. Called without the writer lock. */
static bool
apply_event (cqc_stream_t *s, follow_t *f, const bson_t *doc)
{
   cqc_arena_t *a = s->w.arena;
   bson_iter_t it, child;
   const char *op = "";
   const char *db, *coll, *to_db, *to_coll;
   uint32_t db_len, coll_len, to_db_len, to_coll_len, ns_idx;
   bool invalidated = false;
   bool have_time = false;
   bool untouched = false;
   uint32_t ev_t = 0, ev_i = 0;
   int64_t wall_ms = 0;

   if (bson_iter_init_find (&it, doc, "operationType") && BSON_ITER_HOLDS_UTF8 (&it)) {
      op = bson_iter_utf8 (&it, NULL);
   }
   get_ns (doc, "ns", &db, &db_len, &coll, &coll_len);
   if (bson_iter_init_find (&it, doc, "clusterTime") && BSON_ITER_HOLDS_TIMESTAMP (&it)) {
      bson_iter_timestamp (&it, &ev_t, &ev_i);
      have_time = true;
      if (f->have_open_time && ts_at_or_after (ev_t, ev_i, f->open_t, f->open_i)) {
         f->caught_up = true;
      }
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
      get_ns (doc, "to", &to_db, &to_db_len, &to_coll, &to_coll_len);
      if (to_db && to_coll) {
         invalidate_ns_named_w (a, to_db, to_db_len, to_coll, to_coll_len);
      } else {
         cqc_arena_w_invalidate_db (a, s->db_idx);
      }
   } else if (!strcmp (op, "dropDatabase")) {
      cqc_arena_w_invalidate_db (a, s->db_idx);
   } else if (!strcmp (op, "invalidate")) {
      cqc_arena_w_invalidate_db (a, s->db_idx);
      invalidated = true;
   } else if (db && coll) {
      /* create, modify, createIndexes, dropIndexes, shardCollection and any
       * event type this version does not know: drop the namespace. */
      invalidate_ns_named_w (a, db, db_len, coll, coll_len);
   } else {
      cqc_arena_w_invalidate_db (a, s->db_idx);
   }
   /* Published with release order after the invalidation above: a reader
    * that sees the new count also sees the invalidation (the coherence
    * checker relies on it). */
   __atomic_store_n (&a->dbs[s->db_idx].events, a->dbs[s->db_idx].events + 1, __ATOMIC_RELEASE);
   if (have_time) {
      publish_applied_w (s, ev_t, ev_i);
   }
   cqc_arena_w_progress (a, s->db_idx);
   pthread_mutex_unlock (s->w.lock);

   if (bson_iter_init_find (&it, doc, "wallTime") && BSON_ITER_HOLDS_DATE_TIME (&it)) {
      wall_ms = bson_iter_date_time (&it);
   }
   pthread_mutex_lock (&s->mu);
   s->events++;
   s->event_bytes += doc->len;
   s->invalidations += untouched ? 0 : 1;
   if (wall_ms > 0) {
      struct timespec now;
      int64_t lag_us;

      clock_gettime (CLOCK_REALTIME, &now);
      lag_us = ((int64_t) now.tv_sec * 1000 + now.tv_nsec / 1000000 - wall_ms) * 1000 +
               (now.tv_nsec / 1000) % 1000;
      lag_us = lag_us < 0 ? 0 : lag_us > (int64_t) UINT32_MAX ? (int64_t) UINT32_MAX : lag_us;
      s->lag_us[s->lag_count++ % CQC_LAG_WINDOW] = (uint32_t) lag_us;
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

/* Decide what an error means. Returns the backoff in ms before retrying. */
static int64_t
handle_error (cqc_stream_t *s, follow_t *f, const bson_error_t *e, int64_t *backoff)
{
   set_error (s, e);
   pthread_mutex_lock (&s->mu);
   s->reconnects++;
   pthread_mutex_unlock (&s->mu);
   pthread_mutex_lock (s->w.lock);
   s->w.arena->dbs[s->db_idx].reconnects++;
   pthread_mutex_unlock (s->w.lock);

   if (!f->ever_healthy && (is_auth_refusal (e) || (!is_network_error (e) && !is_history_lost (e)))) {
      /* The stream never opened, and the server refused it (the
       * credentials, the rights, a deployment without change streams):
       * nothing to resume, and a quick retry would be refused again. */
      set_state (s, CQC_STREAM_STARTUP_FAILED);
      *backoff = *backoff >= BACKOFF_STARTUP_MS
                    ? (*backoff * 2 > BACKOFF_FAILED_MS ? BACKOFF_FAILED_MS : *backoff * 2)
                    : BACKOFF_STARTUP_MS;
      return *backoff;
   }
   if (is_tls_refusal (e)) {
      /* This side refused the server's certificate: a matter of
       * configuration (the authorities, the name) or of the server's
       * certificate, which a quick retry will not mend. The resume token is
       * kept: a server it can verify again resumes where this one left. */
      set_state (s, CQC_STREAM_FAILED);
      *backoff = BACKOFF_FAILED_MS;
      return *backoff;
   }
   if (is_network_error (e) && !is_history_lost (e)) {
      set_state (s, CQC_STREAM_RECONNECTING);
      *backoff = *backoff ? (*backoff * 2 > BACKOFF_MAX_MS ? BACKOFF_MAX_MS : *backoff * 2)
                          : BACKOFF_MIN_MS;
      return *backoff;
   }
   if (f->token || is_history_lost (e)) {
      /* A resume the server refused: whatever happened in the gap is
       * unknown. Drop the database's entries and start afresh. */
      drop_database_entries (s, true);
      bson_destroy (f->token);
      f->token = NULL;
      f->start_after = false;
      set_state (s, CQC_STREAM_RECONNECTING);
      *backoff = BACKOFF_MIN_MS;
      return *backoff;
   }
   /* The server refuses the stream itself (no change streams, no rights). */
   set_state (s, CQC_STREAM_FAILED);
   *backoff = BACKOFF_FAILED_MS;
   return *backoff;
}

static void
save_token (follow_t *f, const bson_t *token, bool start_after)
{
   if (!token) {
      return;
   }
   bson_destroy (f->token);
   f->token = bson_copy (token);
   f->start_after = start_after;
}

/* Start a catch-up: note the owner's freeze count, then read the
 * deployment's time (in that order: a freeze noted after the time was read
 * would let a time from before it pass). */
static bool
read_open_time_noting_freezes (cqc_stream_t *s, mongoc_client_t *client, follow_t *f,
                               bson_error_t *error)
{
   f->freezes = __atomic_load_n (&s->w.arena->hdr->freezes, __ATOMIC_ACQUIRE);
   return read_open_time (client, f, error);
}

static void catch_up_first (cqc_stream_t *s, follow_t *f, mongoc_client_t *client);

/* The stream has caught up: serve again. A stream opened without a resume
 * token starts with no entry older than it (they were dropped, or there were
 * none), so every write up to the time read before opening is reflected.
 *
 * Unless the owner was frozen since the catch-up began: its demotion
 * (owner.c) may have landed just before this promotion, and what looked
 * caught up is then a batch from before the freeze, with the freeze's
 * writes still queued behind it. The freeze count is compared and HEALTHY
 * published in one hold of the writer lock, the lock the demotion holds
 * while it bumps the count: either the demotion comes after and demotes
 * this HEALTHY, or the comparison sees it and the catch-up starts over.
 * Returns whether the database serves. */
static bool
become_healthy (cqc_stream_t *s, follow_t *f, mongoc_client_t *client, int64_t *backoff)
{
   bool frozen;

   pthread_mutex_lock (s->w.lock);
   frozen = s->w.arena->hdr->freezes != f->freezes;
   if (!frozen) {
      if (f->fresh && f->have_open_time) {
         publish_applied_w (s, f->open_t, f->open_i);
      }
      cqc_arena_w_set_health (s->w.arena, s->db_idx, CQC_STREAM_HEALTHY);
   }
   pthread_mutex_unlock (s->w.lock);
   if (frozen) {
      catch_up_first (s, f, client);
      return false;
   }
   pthread_mutex_lock (&s->mu);
   s->state = CQC_STREAM_HEALTHY;
   pthread_mutex_unlock (&s->mu);
   f->ever_healthy = true;
   *backoff = 0;
   return true;
}

/* Whether readers stopped trusting this stream while it believed itself
 * healthy: it was silent for longer than the stall bound, or the owner
 * demoted it after being frozen past its heartbeat timeout (owner.c). What
 * it delivers next is a backlog. */
static bool
distrusted (cqc_stream_t *s)
{
   const cqc_db_t *d = &s->w.arena->dbs[s->db_idx];
   uint64_t now = cqc_now_ns ();
   bool silent, demoted;
   pthread_mutex_lock (s->w.lock);
   silent = now > d->progress_ns + d->stall_ns;
   demoted = d->health != CQC_STREAM_HEALTHY;
   pthread_mutex_unlock (s->w.lock);
   return silent || demoted;
}

/* Applying the first event of a backlog would make readers serve entries
 * whose invalidations are still queued behind it: stop serving, read the
 * deployment's time as of now, and serve again once caught up with it (an
 * event at or after it, or an empty batch from a later getMore). */
static void
catch_up_first (cqc_stream_t *s, follow_t *f, mongoc_client_t *client)
{
   bson_error_t ignored; /* the stream's next batch tells whether it still works */

   set_state (s, CQC_STREAM_RECONNECTING);
   read_open_time_noting_freezes (s, client, f, &ignored);
   f->caught_up = false;
}

/* Follow one opened stream until it errors, is invalidated or we stop.
 * Returns false with *error set on error. */
static bool
follow (cqc_stream_t *s, follow_t *f, mongoc_client_t *client, mongoc_change_stream_t *cs,
        bson_error_t *error, int64_t *backoff)
{
   const bson_t *doc;
   const bson_t *reply = NULL;
   bool healthy = false;
   uint32_t pbrt_t, pbrt_i;
   bool high_water;

   while (!should_stop (s)) {
      /* When this round began: if it comes back empty, every event the
       * server could show before then has been applied (quiet_ns). */
      uint64_t round_ns = cqc_now_ns ();
      for (;; round_ns = cqc_now_ns ()) {
         bson_iter_t it;
         bool invalidated;
         if (!mongoc_change_stream_next (cs, &doc)) {
            break;
         }
         if (healthy && distrusted (s)) {
            catch_up_first (s, f, client);
            healthy = false;
         }
         invalidated = apply_event (s, f, doc);
         if (invalidated) {
            if (bson_iter_init_find (&it, doc, "_id") && BSON_ITER_HOLDS_DOCUMENT (&it)) {
               bson_t id;
               uint32_t len;
               const uint8_t *data;
               bson_iter_document (&it, &len, &data);
               if (bson_init_static (&id, data, len)) {
                  save_token (f, &id, true);
               }
            }
            return true;
         }
         save_token (f, mongoc_change_stream_get_resume_token (cs), false);
         if (!healthy && f->caught_up) {
            healthy = become_healthy (s, f, client, backoff);
         }
         if (should_stop (s)) {
            return true;
         }
      }
      if (mongoc_change_stream_error_document (cs, error, &reply)) {
         return false;
      }
      /* An empty batch: caught up with the server. Every event up to its
       * postBatchResumeToken has been applied above, where that token is a
       * high-water mark (resume_token_time). */
      save_token (f, mongoc_change_stream_get_resume_token (cs), false);
      pthread_mutex_lock (s->w.lock);
      if (resume_token_time (f->token, &pbrt_t, &pbrt_i, &high_water) && high_water) {
         publish_applied_w (s, pbrt_t, pbrt_i);
      }
      __atomic_store_n (&s->w.arena->dbs[s->db_idx].quiet_ns, round_ns, __ATOMIC_RELEASE);
      pthread_mutex_unlock (s->w.lock);
      if (healthy && distrusted (s)) {
         /* This batch may predate the pause: the next one tells. */
         catch_up_first (s, f, client);
         healthy = false;
         continue;
      }
      f->caught_up = true;
      if (!healthy) {
         healthy = become_healthy (s, f, client, backoff);
      } else {
         pthread_mutex_lock (s->w.lock);
         cqc_arena_w_progress (s->w.arena, s->db_idx);
         pthread_mutex_unlock (s->w.lock);
      }
   }
   return true;
}

static void *
stream_main (void *arg)
{
   cqc_stream_t *s = arg;
   follow_t f = {0};
   mongoc_client_t *client = NULL;
   mongoc_database_t *db = NULL;
   bson_t *pipeline = NULL;
   bson_error_t error;
   int64_t backoff = 0;
   bool started = false;

   pipeline = BCON_NEW ("pipeline", "[", "{", "$project", "{", "operationType", BCON_INT32 (1),
                        "ns", BCON_INT32 (1), "documentKey", BCON_INT32 (1), "clusterTime",
                        BCON_INT32 (1), "wallTime", BCON_INT32 (1), "to", BCON_INT32 (1), "}",
                        "}", "]");

   while (!should_stop (s)) {
      mongoc_change_stream_t *cs = NULL;
      const bson_t *reply = NULL;
      bson_t opts = BSON_INITIALIZER;
      bool ok, reached, refused;

      pthread_mutex_lock (&s->mu);
      refused = s->state == CQC_STREAM_STARTUP_FAILED;
      pthread_mutex_unlock (&s->mu);
      if (!refused) {
         /* A refused start stays reported as such while it is retried. */
         set_state (s, started ? CQC_STREAM_RECONNECTING : CQC_STREAM_CONNECTING);
      }
      started = true;
      if (!client) {
         client = make_client (s, &error);
         if (!client) {
            set_error (s, &error);
            set_state (s, CQC_STREAM_FAILED);
            bson_destroy (&opts);
            sleep_unless_stopped (s, BACKOFF_FAILED_MS);
            continue;
         }
         db = mongoc_client_get_database (client, s->db_name);
      }
      if (!f.token && f.ever_healthy) {
         /* Starting again without a token: what was cached is unverifiable. */
         drop_database_entries (s, false);
      }
      reached = read_open_time_noting_freezes (s, client, &f, &error);
      f.caught_up = false;
      f.fresh = f.token == NULL;
      if (!reached) {
         ok = false; /* error says why */
      } else {
         BSON_APPEND_INT64 (&opts, "maxAwaitTimeMS", s->max_await_ms);
         if (f.token) {
            BSON_APPEND_DOCUMENT (&opts, f.start_after ? "startAfter" : "resumeAfter", f.token);
         }
         cs = mongoc_database_watch (db, pipeline, &opts);
         if (mongoc_change_stream_error_document (cs, &error, &reply)) {
            ok = false;
         } else {
            ok = follow (s, &f, client, cs, &error, &backoff);
         }
         mongoc_change_stream_destroy (cs);
      }
      bson_destroy (&opts);
      if (!ok && !should_stop (s)) {
         if (is_network_error (&error)) {
            /* A single-threaded client keeps a server it failed to reach
             * in a 5 s cooldown; a new client tries again after the
             * backoff alone. */
            mongoc_database_destroy (db);
            mongoc_client_destroy (client);
            db = NULL;
            client = NULL;
         }
         sleep_unless_stopped (s, handle_error (s, &f, &error, &backoff));
      }
   }

   set_state (s, CQC_STREAM_CLOSED);
   bson_destroy (f.token);
   bson_destroy (pipeline);
   mongoc_database_destroy (db);
   mongoc_client_destroy (client);
   return NULL;
}

/* ======================================================================== */
/* Public API                                                               */
/* ======================================================================== */

cqc_stream_t *
cqc_stream_start (cqc_writer_t *w, uint32_t db_idx, const char *db_name, const char *uri,
                  const cqc_trust_t *trust, int64_t max_await_ms, char *err, size_t errlen)
{
   cqc_stream_t *s = calloc (1, sizeof *s);
   bool ok = false;

   if (!s) {
      snprintf (err, errlen, "out of memory");
      return NULL;
   }
   s->w = *w;
   s->db_idx = db_idx;
   s->max_await_ms = max_await_ms;
   s->db_name = strdup (db_name);
   s->uri = strdup (uri);
   s->ca_file = trust && trust->ca_file ? strdup (trust->ca_file) : NULL;
   s->ca_dir = trust && trust->ca_dir ? strdup (trust->ca_dir) : NULL;
   s->crl_file = trust && trust->crl_file ? strdup (trust->crl_file) : NULL;
   pthread_mutex_init (&s->mu, NULL);
   pthread_cond_init (&s->cv, NULL);
   if (!s->db_name || !s->uri || (trust && trust->ca_file && !s->ca_file) ||
       (trust && trust->ca_dir && !s->ca_dir) || (trust && trust->crl_file && !s->crl_file)) {
      snprintf (err, errlen, "out of memory");
      goto cleanup;
   }
   pthread_mutex_lock (w->lock);
   /* Readers consider progress older than this stalled. */
   __atomic_store_n (&w->arena->dbs[db_idx].stall_ns,
                     (uint64_t) (2 * max_await_ms + 2000) * 1000000ull, __ATOMIC_RELAXED);
   pthread_mutex_unlock (w->lock);
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
   free (s->db_name);
   free (s);
}

void
cqc_stream_destroy_keep_info (cqc_stream_t *s, cqc_stream_info_t *out)
{
   cqc_stream_signal_stop (s);
   if (s->thread_started) {
      pthread_join (s->thread, NULL);
      s->thread_started = false;
   }
   cqc_stream_get_info (s, out);
   cqc_stream_destroy (s);
}

static int
cmp_u32 (const void *x, const void *y)
{
   uint32_t a = *(const uint32_t *) x, b = *(const uint32_t *) y;
   return a < b ? -1 : a > b;
}

void
cqc_stream_get_info (cqc_stream_t *s, cqc_stream_info_t *out)
{
   uint32_t lags[CQC_LAG_WINDOW], n;

   pthread_mutex_lock (&s->mu);
   out->state = s->state;
   out->events = s->events;
   out->reconnects = s->reconnects;
   out->history_lost = s->history_lost;
   out->getmores = s->getmores;
   out->event_bytes = s->event_bytes;
   out->invalidations = s->invalidations;
   n = s->lag_count < CQC_LAG_WINDOW ? (uint32_t) s->lag_count : CQC_LAG_WINDOW;
   memcpy (lags, s->lag_us, n * sizeof lags[0]);
   memcpy (out->last_error, s->last_error, sizeof out->last_error);
   pthread_mutex_unlock (&s->mu);
   out->lag_samples = n;
   out->lag_p50_ms = out->lag_p95_ms = out->lag_max_ms = 0.0;
   if (n) {
      qsort (lags, n, sizeof lags[0], cmp_u32);
      out->lag_p50_ms = lags[(n - 1) / 2] / 1000.0;
      out->lag_p95_ms = lags[(uint32_t) ((n - 1) * 95ull / 100)] / 1000.0;
      out->lag_max_ms = lags[n - 1] / 1000.0;
   }
}
