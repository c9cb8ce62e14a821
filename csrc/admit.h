/*
 * admit.h - the single writer, and admission: the one way an entry gets into
 * the arena.
 *
 * A miss captures a token before its read (cqc_arena_r_capture), reads
 * MongoDB, and hands the result here with the token. In process-local mode
 * the reading process admits itself (module.c); in shared mode a worker
 * pushes the admission into its ring and the owner's drain admits it
 * (owner.c). Both call cqc_admit, so both check the same things in the same
 * order: the token's indexes are in range, its identity cell is the one the
 * filter maps to, the key is built from the admission's own bytes, and the
 * arena admits only if every generation the token captured is still current
 * (arena.h).
 */
#ifndef CQC_ADMIT_H
#define CQC_ADMIT_H

#include "arena.h"
#include "keys.h"

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

/* The arena and the lock of its single writer: every cqc_arena_w_* call is
 * made holding it (change-stream followers, admissions, registrations). */
typedef struct {
   cqc_arena_t *arena;
   pthread_mutex_t *lock;
} cqc_writer_t;

/* What a miss read, and under which token. A worker's ring carries these
 * fields as one record (ring.h). */
typedef struct {
   uint8_t kind;   /* the read's kind; may carry CQC_KIND_REBIND */
   bool not_found; /* the read found nothing: value is empty */
   cqc_token_t token;
   const uint8_t *filter;
   uint32_t flen;
   const uint8_t *rest;
   uint32_t rlen;
   const uint8_t *value;
   uint32_t vlen;
} cqc_admission_t;

/* Results beyond the arena's (cqc_admit_t): the admission itself does not
 * check, or its key could not be built. */
#define CQC_ADMIT_INVALID 6
#define CQC_ADMIT_NO_MEMORY 7

/* Whether the admission's token can belong to its filter in this arena: its
 * indexes are in range, its identity cell is the filter's, and a "not
 * found" carries no value. Reads only the process's own view of the
 * geometry. */
bool cqc_admission_valid (const cqc_arena_t *a, const cqc_admission_t *adm);

/* The admission's cache key (keys.h); free it with cqc_key_free. */
cqc_key_status_t cqc_admission_key (const cqc_admission_t *adm, cqc_key_t *key);

/* Admit under the writer lock: check (cqc_admission_valid), build the key,
 * rebind a find_one by a unique key to the identity of the document it
 * found (cqc_arena_w_rebind), and admit (cqc_arena_w_admit). Returns the
 * arena's verdict, CQC_ADMIT_INVALID or CQC_ADMIT_NO_MEMORY; *key_hash is
 * set to the key's hash when the key was built. Takes the lock itself. */
int cqc_admit (const cqc_writer_t *w, const cqc_admission_t *adm, uint64_t *key_hash);

#endif
