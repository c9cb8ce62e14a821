/*
 * stream.h - change-stream followers on libmongoc: one per database, each in
 * its own thread, keeping the arena coherent (DESIGN.md, coherence rules).
 *
 * A follower watches its database with a projection to what invalidation
 * needs (operationType, ns, documentKey, clusterTime, rename target), applies
 * every event to the arena under the writer lock, and publishes its health:
 *
 *   NOT_STARTED -> CONNECTING -> HEALTHY <-> RECONNECTING
 *                                   |            |
 *                                 CLOSED       FAILED (retried with backoff)
 *
 * HEALTHY is published only once the stream has caught up: an empty batch,
 * or an event at or after the cluster time read just before the stream was
 * opened. Every round trip refreshes the database's progress time; readers
 * treat progress older than the stall bound as unhealthy, so a hung socket
 * stops serving within the bound even before the driver notices.
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
 * Resume: the last resume token is kept across errors. A resume that fails
 * for any reason other than the network (history lost, token unknown) drops
 * every entry of the database (its incarnation is bumped) before the stream
 * starts afresh, so nothing cached before the gap can be served after it.
 */
#ifndef CQC_STREAM_H
#define CQC_STREAM_H

#include "admit.h"
#include "arena.h"

#include <pthread.h>
#include <stdint.h>

typedef struct cqc_stream cqc_stream_t;

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

/* Start following `db_name` (already registered at db_idx). `uri` is copied
 * and never logged; `trust`'s paths (may be NULL) are copied. */
cqc_stream_t *cqc_stream_start (cqc_writer_t *w, uint32_t db_idx, const char *db_name,
                                const char *uri, const cqc_trust_t *trust,
                                int64_t max_await_ms, char *err, size_t errlen);

/* Ask the follower to stop; returns at once. */
void cqc_stream_signal_stop (cqc_stream_t *s);

/* Stop (if not yet asked), join the thread and free everything. */
void cqc_stream_destroy (cqc_stream_t *s);

/* The same, first copying the follower's final info into *out. */
void cqc_stream_destroy_keep_info (cqc_stream_t *s, cqc_stream_info_t *out);

void cqc_stream_get_info (cqc_stream_t *s, cqc_stream_info_t *out);

#endif
