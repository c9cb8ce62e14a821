/*
 * shm.c - see shm.h.
 */
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
cqc_shm_create (const char *path, uint64_t size, cqc_error_t *err)
{
   void *mem = NULL;
   int fd = open (path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);

   if (fd < 0) {
      cqc_error_errno (err, "create", path);
      goto cleanup;
   }
   if ((errno = reserve (fd, size)) != 0) {
      cqc_error_errno (err, "reserve the blocks of", path);
      goto cleanup;
   }
   mem = mmap (NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
   if (mem == MAP_FAILED) {
      cqc_error_errno (err, "map", path);
      mem = NULL;
   }
cleanup:
   if (fd >= 0) {
      close (fd);
      if (!mem) {
         unlink (path);
      }
   }
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
   if ((uint64_t) st.st_size < min_size || (uint64_t) st.st_size > max_size) {
      cqc_error_set (err, CQC_ERR_VALUE, "%s has an invalid size (%llu bytes)", path,
                     (unsigned long long) st.st_size);
      goto cleanup;
   }
   mem = mmap (NULL, (size_t) st.st_size, writable ? PROT_READ | PROT_WRITE : PROT_READ,
               MAP_SHARED, fd, 0);
   if (mem == MAP_FAILED) {
      cqc_error_errno (err, "map", path);
      mem = NULL;
      goto cleanup;
   }
   *size = (uint64_t) st.st_size;
cleanup:
   if (fd >= 0) {
      close (fd);
   }
   return mem;
}
