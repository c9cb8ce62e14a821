/*
 * le.h - BSON's little-endian integers read from bytes in place, whatever
 * the bytes' alignment and the host's byte order.
 */
#ifndef CQC_LE_H
#define CQC_LE_H

#include <stdint.h>

static inline uint32_t
cqc_le32 (const uint8_t *p)
{
   return (uint32_t) p[0] | (uint32_t) p[1] << 8 | (uint32_t) p[2] << 16 | (uint32_t) p[3] << 24;
}

static inline uint64_t
cqc_le64 (const uint8_t *p)
{
   return (uint64_t) cqc_le32 (p) | (uint64_t) cqc_le32 (p + 4) << 32;
}

#endif
