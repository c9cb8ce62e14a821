/*
 * ring.h - single-producer, single-consumer rings from a worker process to
 * the owner, in a shared segment the worker creates (mode 0600).
 *
 * A worker that misses reads MongoDB itself and pushes an admission record
 * (its token, the key parts, the raw value) into its ring without blocking:
 * a full ring drops the record and counts it. The owner's drain thread pops
 * records and admits them under the writer lock, checking the token then.
 *
 * Segment layout:
 *
 *   +------------------------+ 0
 *   | cqc_ring_header_t      | line 0: the producer's (magic, version, pid,
 *   |                        |   capacity, head, its counters); line 1: the
 *   |                        |   consumer's (tail, its counters)
 *   +------------------------+ CQC_RING_DATA_OFF
 *   | data[capacity]         | records, each 8-byte aligned:
 *   |                        |   u32 len (whole record) | u32 kind_flags |
 *   |                        |   u64 sum | token | u32 flen | u32 rlen |
 *   |                        |   u32 vlen | filter | rest | value
 *   +------------------------+ align64(ring bytes)
 *   | u32 access[cells]      | the worker's access map: its hits mark it,
 *   |                        |   the owner reads it when it evicts (arena.c)
 *   +------------------------+ segment end
 *
 * The owner finds the map at the end of the segment, from the size it
 * mapped and the cell count of its own arena's geometry
 * (cqc_access_cells), never from anything the segment says. A worker
 * that writes anything there can change which entries are evicted and
 * nothing else (arena.c).
 *
 * `head` and `tail` are byte counters that only grow (mod 2^64); a record
 * never wraps: when it does not fit before the end of the data area the
 * producer writes a pad record (len with the PAD bit) and starts at 0. It
 * does the same past CQC_RING_SOFT_WRAP whenever the start of the ring is
 * free, so a drained ring keeps its resident pages few. `sum` is a hash of
 * the rest of the record (cqc_ring_record_sum): it catches bytes changed by
 * anything but the producer, not a forger who computes it too.
 *
 * Trust. The segment is a file any process of the user can write, so
 * neither side trusts what the other side's fields, or the records, hold:
 *  - The consumer reads each header field once, checks it, and uses only
 *    the value it checked. It reads a record's length once, checks it
 *    against the capacity and the bytes between tail and head, then copies
 *    the whole record into private memory and parses, checks (lengths, sum)
 *    and hands on only that copy: nothing it checked can change under it.
 *    A malformed ring is reset (tail := the head it read; its records
 *    dropped, counted), never followed out of bounds.
 *  - The producer keeps its own capacity and head in private memory
 *    (cqc_ring_producer_t) and never reads them back. The one shared value
 *    it reads, the consumer's tail, is bounds-checked before use. When its
 *    header is not what it wrote (magic, version, pid, capacity, head) or
 *    the tail is impossible, it drops the admission, counts it and writes its
 *    header again, so the consumer's next drain finds the ring malformed (or
 *    not), resets its tail to the producer's head and the ring works again.
 */
#ifndef CQC_RING_H
#define CQC_RING_H

#include "admit.h"
#include "arena.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CQC_RING_MAGIC 0x474e495243514343ULL /* "CCQCRING" */
#define CQC_RING_VERSION 4u
#define CQC_RING_DATA_OFF 128u
#define CQC_RING_PAD 0x80000000u
/* A producer past this offset wraps early when the ring's start is free.
 * The pad that wrap writes counts as used until the consumer passes it, so
 * until the next drain the ring has room only for this many bytes of new
 * records: 62 of 4 KiB, a burst a worker's threads or tasks can make within
 * the drain thread's 10 ms after a quiet spell. (64 KiB, tried, kept 190 KiB
 * less resident per ring but kept only the first 16 records of such a burst:
 * of 50 sent, 34 were dropped.) */
#define CQC_RING_SOFT_WRAP (256u * 1024u)

/* The producer's fields and the consumer's lie on separate cache lines: each
 * side writes only its own line on every record. */
typedef struct {
   /* Line 0: written by the producer only. */
   uint64_t magic;
   uint32_t version;
   uint32_t pid;       /* the producer */
   uint64_t capacity;  /* bytes of the data area, multiple of 8 */
   uint64_t head;      /* bytes written (release: publishes the records) */
   uint64_t pushed;    /* records pushed (relaxed, informational) */
   uint64_t dropped;   /* records dropped because the ring was full */
   uint64_t damaged;   /* records dropped because the header was not the producer's */
   uint64_t pad0_;
   /* Line 1: written by the consumer only. */
   uint64_t tail;      /* bytes consumed (release) */
   uint64_t popped;    /* records admitted or refused (relaxed) */
   uint64_t malformed; /* times a malformed ring was reset (relaxed) */
   uint8_t pad1_[40];
} cqc_ring_header_t;

_Static_assert (offsetof (cqc_ring_header_t, magic) == 0 &&
                   offsetof (cqc_ring_header_t, version) == 8 &&
                   offsetof (cqc_ring_header_t, pid) == 12 &&
                   offsetof (cqc_ring_header_t, capacity) == 16 &&
                   offsetof (cqc_ring_header_t, head) == 24 &&
                   offsetof (cqc_ring_header_t, pushed) == 32 &&
                   offsetof (cqc_ring_header_t, dropped) == 40 &&
                   offsetof (cqc_ring_header_t, damaged) == 48 &&
                   offsetof (cqc_ring_header_t, tail) == 64 &&
                   offsetof (cqc_ring_header_t, popped) == 72 &&
                   offsetof (cqc_ring_header_t, malformed) == 80 &&
                   sizeof (cqc_ring_header_t) == CQC_RING_DATA_OFF,
                "cqc_ring_header_t layout: producer line, consumer line, then data");

/* One admission record, as the consumer hands it on (admit.h): pointers
 * into the consumer's private copy of the record, valid during the callback
 * only. */
typedef cqc_admission_t cqc_ring_record_t;

/* The producer's private state: what it formatted and wrote, never read
 * back from the segment. */
typedef struct {
   uint8_t *mem;
   uint64_t size;
   uint64_t capacity;
   uint64_t head;
   uint32_t pid;
   uint64_t pushed;
   uint64_t dropped;  /* the ring was full */
   uint64_t damaged;  /* the header was not the producer's: dropped, header rewritten */
   uint64_t oversize; /* the record is larger than half the ring: never fits */
} cqc_ring_producer_t;

typedef enum {
   CQC_RING_PUSHED = 0,
   CQC_RING_FULL = 1,    /* dropped: no room (the owner lags) */
   CQC_RING_DAMAGED = 2, /* dropped: the header was changed by someone else */
   CQC_RING_TOO_LARGE = 3, /* dropped: the record is larger than half the ring */
} cqc_ring_push_t;

/* Bytes of a worker's segment: a ring of ring_bytes and an access map of
 * `cells` cells after it. */
static inline uint64_t
cqc_ring_segment_bytes (uint64_t ring_bytes, uint32_t cells)
{
   return ((ring_bytes + 63u) & ~(uint64_t) 63u) + (uint64_t) cells * sizeof (uint32_t);
}

/* Format a zeroed segment of `size` bytes as an empty ring and make `p` its
 * producer. */
bool cqc_ring_format (cqc_ring_producer_t *p, void *mem, uint64_t size, uint32_t pid);

/* Validate a segment mapped by the consumer. */
bool cqc_ring_check (const void *mem, uint64_t size);

/* Producer: push one record without blocking. */
cqc_ring_push_t cqc_ring_push (cqc_ring_producer_t *p, uint8_t kind, bool not_found,
                               const cqc_token_t *tok, const uint8_t *filter, uint32_t flen,
                               const uint8_t *rest, uint32_t rlen, const uint8_t *value,
                               uint32_t vlen);

/* Consumer: pop every complete record, calling fn for each with a private
 * copy; returns how many. */
typedef void (*cqc_ring_fn) (void *ctx, const cqc_ring_record_t *rec);
uint64_t cqc_ring_drain (void *mem, uint64_t size, cqc_ring_fn fn, void *ctx);

#endif
