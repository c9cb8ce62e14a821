/*
 * shm.h - the files a shared cache lives in: the owner's arena and each
 * worker's admission ring.
 *
 * Both are regular files in the runtime directory (on a tmpfs, normally
 * /dev/shm), created by the process that writes them, private to its user
 * (mode 0600, opened with O_NOFOLLOW), and mapped whole. A file is created
 * with every block reserved: on a tmpfs, a sparse file whose pages cannot be
 * allocated later kills the process that first writes them with SIGBUS. A
 * process attaching to another's file (a worker to the arena, the owner to a
 * ring) maps it only after checking that it is a regular file of its own uid
 * that no other user can access.
 */
#ifndef CQC_SHM_H
#define CQC_SHM_H

#include "error.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Errors: CQC_ERR_OS for a failed call, CQC_ERR_PERMISSION for a file that
 * is not private, CQC_ERR_VALUE for a size out of range. */

/* Create `path` (it must not exist) with `size` bytes reserved and map it
 * read-write, shared. Returns the mapping, or NULL with err set and no file
 * left behind. */
void *cqc_shm_create (const char *path, uint64_t size, cqc_error_t *err);

/* Map the private file `path` whole, read-write if `writable`, read-only
 * otherwise, if its size is within [min_size, max_size]. Returns the mapping
 * and sets *size, or NULL with err set. */
void *cqc_shm_map_private (const char *path, bool writable, uint64_t min_size,
                           uint64_t max_size, uint64_t *size, cqc_error_t *err);

#endif
