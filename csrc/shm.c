/*
 * shm.c - see shm.h.
 */
#define _GNU_SOURCE /* F_GET_SEALS */
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Reserve every block of a new file; falls back to a sparse file where the
 * filesystem cannot reserve. Returns 0 or an errno value. */
static int
reserve (int fd, uint64_t size)
{
   int rc = posix_fallocate (fd, 0, (off_t) size);
   if (rc == EOPNOTSUPP || rc == EINVAL) {
      rc = ftruncate (fd, (off_t) size) == 0 ? 0 : errno;
   }
   return rc;
}

void *
cqc_shm_create_fd (int fd, const char *what, uint64_t size, cqc_error_t *err)
{
   void *mem;

   if ((errno = reserve (fd, size)) != 0) {
      cqc_error_errno (err, "reserve the blocks of", what);
      return NULL;
   }
   mem = mmap (NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
   if (mem == MAP_FAILED) {
      cqc_error_errno (err, "map", what);
      return NULL;
   }
   return mem;
}

void *
cqc_shm_create (const char *path, uint64_t size, cqc_error_t *err)
{
   void *mem;
   int fd = open (path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);

   if (fd < 0) {
      cqc_error_errno (err, "create", path);
      return NULL;
   }
   mem = cqc_shm_create_fd (fd, path, size, err);
   close (fd);
   if (!mem) {
      unlink (path);
   }
   return mem;
}

/* Map the regular file open as fd whole if its size is within bounds. */
static void *
map_whole (int fd, const char *what, const struct stat *st, bool writable, uint64_t min_size,
           uint64_t max_size, uint64_t *size, cqc_error_t *err)
{
   void *mem;

   if ((uint64_t) st->st_size < min_size || (uint64_t) st->st_size > max_size) {
      cqc_error_set (err, CQC_ERR_VALUE, "%s has an invalid size (%llu bytes)", what,
                     (unsigned long long) st->st_size);
      return NULL;
   }
   mem = mmap (NULL, (size_t) st->st_size, writable ? PROT_READ | PROT_WRITE : PROT_READ,
               MAP_SHARED, fd, 0);
   if (mem == MAP_FAILED) {
      cqc_error_errno (err, "map", what);
      return NULL;
   }
   *size = (uint64_t) st->st_size;
   return mem;
}

void *
cqc_shm_map_private (const char *path, bool writable, uint64_t min_size, uint64_t max_size,
                     uint64_t *size, cqc_error_t *err)
{
   struct stat st;
   void *mem = NULL;
   int fd = open (path, (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW);

   if (fd < 0) {
      cqc_error_errno (err, "open", path);
      goto cleanup;
   }
   if (fstat (fd, &st) != 0 || !S_ISREG (st.st_mode) || st.st_uid != getuid () ||
       (st.st_mode & 077) != 0) {
      cqc_error_set (err, CQC_ERR_PERMISSION,
                     "%s is not a private file of this user (uid %u): refusing to attach", path,
                     (unsigned) getuid ());
      goto cleanup;
   }
   mem = map_whole (fd, path, &st, writable, min_size, max_size, size, err);
cleanup:
   if (fd >= 0) {
      close (fd);
   }
   return mem;
}

void *
cqc_shm_map_fd (int fd, const char *what, bool writable, uint64_t min_size, uint64_t max_size,
                uint64_t *size, cqc_error_t *err)
{
   struct stat st;
   int seals;

   if (fstat (fd, &st) != 0 || !S_ISREG (st.st_mode)) {
      cqc_error_set (err, CQC_ERR_PERMISSION, "%s is not a regular file: refusing to map it", what);
      return NULL;
   }
   /* Shrunk under a mapping, a file kills whoever reads the lost pages
    * with SIGBUS: one handed over must be sealed so that nobody can. */
   seals = fcntl (fd, F_GET_SEALS);
   if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
      cqc_error_set (err, CQC_ERR_PERMISSION,
                     "%s is not sealed against shrinking (F_SEAL_SHRINK): refusing to map it",
                     what);
      return NULL;
   }
   return map_whole (fd, what, &st, writable, min_size, max_size, size, err);
}
