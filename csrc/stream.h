/*
 * stream.h - the change-stream follower on libmongoc: one per cache, in a
 * thread of its own with one connection, keeping the arena coherent
 * (DESIGN.md, coherence rules) for every database the cache serves.
 *
 * Scope. By default the follower opens one deployment-wide stream
 * (mongoc_client_watch) with a $match on the databases registered so far
 * (an event's ns.db among them; renames, whose target database a $match
 * on ns.db would miss, all pass, and those between other databases are
 * ignored). A database
 * registered later is carried once the stream is re-opened with the wider
 * $match from the last resume token, so no event of the databases already
 * carried is lost; until then the new database does not serve. Where the
 * deployment refuses a deployment-wide stream (Unauthorized, code 13: a
 * user without the privilege on every database), or the cache asks for it
 * (CQC_STREAM_SCOPE_DATABASE), the follower opens one stream per database
 * instead and polls them in turn on the same thread and connection, each
 * getMore awaiting its share of max_await_ms. The scope in use, and why,
 * are in every database's info.
 *
 * Every database publishes its own health, applied time and counters:
 *
 *   NOT_STARTED -> CONNECTING -> HEALTHY <-> RECONNECTING
 *                                   |            |
 *                                 CLOSED       FAILED (retried with backoff)
 *
 * HEALTHY is published only once the stream carrying the database has
 * caught up: an empty batch, or an event at or after the cluster time read
 * just before the stream was opened. Every round trip refreshes the
 * progress time of every database the stream carries (an event of one
 * database refreshes the others too); readers treat progress older than the
 * stall bound as unhealthy, so a hung socket stops serving within the bound
 * even before the driver notices.
 *
 * FAILED is for what retrying soon will not mend: the server refuses the
 * stream, libmongoc refuses the URI, or the TLS handshake fails to verify
 * the server (its certificate chain, its name, its OCSP status). Network
 * errors are RECONNECTING.
 *
 * TLS: a URI that turns TLS on and verifies certificates without naming
 * the authorities (no tlsCAFile) verifies against the trust store given to
 * cqc_stream_start (the platform's, resolved by the package), not the one
 * compiled into libmongoc's OpenSSL, so a wheel built on Debian verifies on
 * RHEL too. A revocation list given with the trust (the application's
 * tlsCRLFile) is checked too, whatever authorities verify. Everything else
 * about TLS is the URI's, as libmongoc reads it.
 *
 * Resume: each stream's last resume token is kept across errors. A resume
 * that fails for any reason other than the network (history lost, token
 * unknown) drops every entry of every database the stream carries (their
 * incarnations are bumped) before the stream starts afresh, so nothing
 * cached before the gap can be served after it. Streams opened per
 * database after a refused deployment-wide one start without a token (the
 * deployment-wide token means nothing to them): what was cached is dropped.
 */
#ifndef CQC_STREAM_H
#define CQC_STREAM_H

#include "admit.h"
#include "arena.h"

#include <pthread.h>
#include <stdint.h>

typedef struct cqc_stream cqc_stream_t;

typedef enum {
   CQC_STREAM_SCOPE_DEPLOYMENT = 0, /* one stream for every database */
   CQC_STREAM_SCOPE_DATABASE = 1,   /* one stream per database */
} cqc_stream_scope_t;

/* Invalidation lag samples kept per follower (the latest ones). */
#define CQC_LAG_WINDOW 256u

typedef struct {
   cqc_stream_state_t state;
   uint64_t events;
   uint64_t reconnects;
   uint64_t history_lost;
   uint64_t getmores;      /* getMore commands sent */
   uint64_t event_bytes;   /* bytes of the change events received */
   uint64_t invalidations; /* events that invalidated entries of the arena */
   /* From an event's wallTime to its application in the arena, over the
    * latest lag_samples events (at most CQC_LAG_WINDOW), in ms. */
   uint32_t lag_samples;
   double lag_p50_ms;
   double lag_p95_ms;
   double lag_max_ms;
   char last_error[256];
   /* The scope in use, and why ("" while it is the one asked for). */
   cqc_stream_scope_t scope;
   char scope_reason[256];
} cqc_stream_info_t;

/* The certificate authorities a follower verifies the server with when its
 * URI turns TLS on without tlsCAFile: a PEM bundle, a hashed directory
 * (c_rehash), or both. Both NULL: libmongoc's default (its OpenSSL's
 * SSL_CERT_FILE / SSL_CERT_DIR, else its compiled-in OPENSSLDIR). crl_file:
 * the application's tlsCRLFile (a PEM revocation list, which libmongoc takes
 * only as mongoc_ssl_opt_t.crl_file, not from a URI), or NULL. */
typedef struct {
   const char *ca_file;
   const char *ca_dir;
   const char *crl_file;
} cqc_trust_t;

/* Start the follower of the arena w writes: its thread waits for the first
 * database. `uri` is copied and never logged; `trust`'s paths (may be NULL)
 * are copied. */
cqc_stream_t *cqc_stream_start (cqc_writer_t *w, cqc_stream_scope_t scope, const char *uri,
                                const cqc_trust_t *trust, int64_t max_await_ms, char *err,
                                size_t errlen);

/* Follow `db_name`, already registered at db_idx, too (nothing if it is
 * followed already). Returns at once; the follower publishes the
 * database's health when its stream carries it. */
bool cqc_stream_add (cqc_stream_t *s, uint32_t db_idx, const char *db_name, char *err,
                     size_t errlen);

/* Ask the follower to stop; returns at once. */
void cqc_stream_signal_stop (cqc_stream_t *s);

/* Stop (if not yet asked), join the thread and free everything. */
void cqc_stream_destroy (cqc_stream_t *s);

/* The same, first copying each followed database's final info into
 * out[db_idx] (out has the arena's db_count elements; others untouched). */
void cqc_stream_destroy_keep_info (cqc_stream_t *s, cqc_stream_info_t *out);

/* The info of the database at db_idx; false if it is not followed. */
bool cqc_stream_get_info (cqc_stream_t *s, uint32_t db_idx, cqc_stream_info_t *out);

#endif
