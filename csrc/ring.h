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
 *   | cqc_ring_header_t      | magic, version, capacity, head, tail, counters
 *   +------------------------+ CQC_RING_DATA_OFF
 *   | data[capacity]         | records, each 8-byte aligned:
 *   |                        |   u32 len (whole record) | u32 kind_flags |
 *   |                        |   token | u32 flen | u32 rlen | u32 vlen |
 *   |                        |   filter | rest | value
 *   +------------------------+
 *
 * `head` and `tail` are byte counters that only grow (mod 2^64); a record
 * never wraps: when it does not fit before the end of the data area the
 * producer writes a pad record (len with the PAD bit) and starts at 0. It
 * does the same past CQC_RING_SOFT_WRAP whenever the start of the ring is
 * free, so a drained ring keeps its resident pages few.
 *
 * Trust: the consumer treats the segment as arbitrary bytes. Every length is
 * checked against the capacity and the bytes between tail and head before it
 * is used; a malformed ring is reset (its records dropped, counted), never
 * followed out of bounds. The producer only trusts its own head.
 */
#ifndef CQC_RING_H
#define CQC_RING_H

#include "arena.h"

#include <stdbool.h>
#include <stdint.h>

#define CQC_RING_MAGIC 0x474e495243514343ULL /* "CCQCRING" */
#define CQC_RING_VERSION 1u
#define CQC_RING_DATA_OFF 128u
#define CQC_RING_PAD 0x80000000u
/* A producer past this offset wraps early when the ring's start is free. */
#define CQC_RING_SOFT_WRAP (256u * 1024u)

typedef struct {
   uint64_t magic;
   uint32_t version;
   uint32_t pid;       /* the producer */
   uint64_t capacity;  /* bytes of the data area, multiple of 8 */
   uint64_t head;      /* producer: bytes written (release) */
   uint8_t pad0_[32];  /* head and tail on separate cache lines */
   uint64_t tail;      /* consumer: bytes consumed (release) */
   uint64_t pushed;    /* producer: records pushed */
   uint64_t dropped;   /* producer: records dropped because the ring was full */
   uint64_t popped;    /* consumer: records admitted or refused */
   uint64_t malformed; /* consumer: times a malformed ring was reset */
   uint8_t pad1_[24];
} cqc_ring_header_t;

/* One admission record, as the consumer sees it (pointers into the ring). */
typedef struct {
   uint8_t kind;
   bool not_found;
   cqc_token_t token;
   const uint8_t *filter;
   uint32_t flen;
   const uint8_t *rest;
   uint32_t rlen;
   const uint8_t *value;
   uint32_t vlen;
} cqc_ring_record_t;

/* Format a zeroed segment of `size` bytes as an empty ring. */
bool cqc_ring_format (void *mem, uint64_t size, uint32_t pid);

/* Validate a segment mapped by the consumer. */
bool cqc_ring_check (const void *mem, uint64_t size);

/* Producer: push one record; false if it does not fit (counted as dropped). */
bool cqc_ring_push (void *mem, uint8_t kind, bool not_found, const cqc_token_t *tok,
                    const uint8_t *filter, uint32_t flen, const uint8_t *rest, uint32_t rlen,
                    const uint8_t *value, uint32_t vlen);

/* Consumer: pop every complete record, calling fn for each; returns how
 * many. Records are only valid during the callback. */
typedef void (*cqc_ring_fn) (void *ctx, const cqc_ring_record_t *rec);
uint64_t cqc_ring_drain (void *mem, uint64_t size, cqc_ring_fn fn, void *ctx);

#endif
