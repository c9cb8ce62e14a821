/*
 * shm.h - the files a shared cache lives in: the owner's arena and each
 * worker's admission ring.
 *
 * Both are regular files in the runtime directory (on a tmpfs, normally
 * /dev/shm), or memfds passed over the owner's control socket when the
 * cache requires a capability (docs/deployment.md), created by the process
 * that writes them, private to its user
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

/* The same for a file already open as fd (a memfd a process created, or
 * was handed over a unix socket), which stays open; `what` names it in
 * errors. cqc_shm_create_fd reserves `size` bytes of the empty file and
 * maps it read-write. cqc_shm_map_fd maps it whole if it is a regular file
 * sealed against shrinking (F_SEAL_SHRINK) whose size is within bounds: its
 * owner and mode are not checked, as whoever handed the descriptor over
 * chose to share it. */
void *cqc_shm_create_fd (int fd, const char *what, uint64_t size, cqc_error_t *err);
void *cqc_shm_map_fd (int fd, const char *what, bool writable, uint64_t min_size,
                      uint64_t max_size, uint64_t *size, cqc_error_t *err);

#endif
