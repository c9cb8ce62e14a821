/*
 * owner.h - the shared-cache owner's writer loop: draining the workers'
 * admission rings into the arena, and publishing a heartbeat.
 *
 * One drain thread per owner. It polls every attached ring (1 ms after a
 * pass that found records, then twice as long after each pass that found
 * none, up to 10 ms), admits each
 * record through cqc_admit (admit.h), the path a process-local admission
 * takes, and stores CLOCK_MONOTONIC into the arena header's heartbeat every
 * 100 ms. Workers
 * stop serving from an arena whose heartbeat is older than its
 * heartbeat_timeout_ns (set at creation), so an owner that dies, hangs or is
 * stopped stops serving within that bound, whatever its streams' state says.
 *
 * Rings are worker-created segments; the owner maps them read-write only
 * after checking that the file belongs to its own uid and is not accessible
 * to others (shm.h), and unlinks them when the worker detaches or dies. Any
 * process of that uid can still write them: the drain hands admit_record a
 * private copy of each record, checked (ring.h), and cqc_admit checks the
 * token against the arena as for any admission. The counters read from a ring's
 * header are the worker's word, used for statistics only.
 */
#ifndef CQC_OWNER_H
#define CQC_OWNER_H

#include "stream.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CQC_HEARTBEAT_PERIOD_NS 100000000ull /* 100 ms */

typedef struct cqc_owner cqc_owner_t;

typedef struct {
   uint32_t rings;
   uint64_t records;   /* admission records drained */
   uint64_t dropped;   /* records workers dropped because their ring was full */
   uint64_t damaged;   /* records workers dropped because another process had
                        * changed their ring's header (as the workers report) */
   uint64_t malformed; /* rings reset because they held malformed records */
} cqc_owner_stats_t;

cqc_owner_t *cqc_owner_start (cqc_writer_t *w, char *err, size_t errlen);

/* Map a worker's ring segment, its file at path or (path NULL) the memfd
 * fd, which stays open (shm.h); returns its id (> 0) or 0 with err set. */
uint32_t cqc_owner_attach (cqc_owner_t *o, const char *path, int fd, char *err, size_t errlen);

/* Drain what is left, unmap and unlink the ring. */
void cqc_owner_detach (cqc_owner_t *o, uint32_t id);

void cqc_owner_get_stats (cqc_owner_t *o, cqc_owner_stats_t *out);

/* Stop the thread, detach every ring, free. */
void cqc_owner_destroy (cqc_owner_t *o);

#endif
