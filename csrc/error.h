/*
 * error.h - what the core says when something fails: a kind the binding
 * turns into the matching Python exception, and a message.
 */
#ifndef CQC_ERROR_H
#define CQC_ERROR_H

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef enum {
   CQC_ERR_NONE = 0,
   CQC_ERR_VALUE = 1,      /* bad argument or input (ValueError) */
   CQC_ERR_PERMISSION = 2, /* another user's, or others can access it (PermissionError) */
   CQC_ERR_OS = 3,         /* a system call failed with errnum, on path (OSError) */
   CQC_ERR_RUNTIME = 4,    /* a thread could not start, a mode cannot do it (RuntimeError) */
   CQC_ERR_MEMORY = 5,     /* (MemoryError) */
} cqc_error_kind_t;

typedef struct {
   cqc_error_kind_t kind;
   int errnum;     /* CQC_ERR_OS */
   char path[256]; /* CQC_ERR_OS: the file, if any */
   char msg[320];
} cqc_error_t;

static inline void __attribute__ ((format (printf, 3, 4)))
cqc_error_set (cqc_error_t *e, cqc_error_kind_t kind, const char *fmt, ...)
{
   va_list ap;
   e->kind = kind;
   e->errnum = 0;
   e->path[0] = '\0';
   va_start (ap, fmt);
   vsnprintf (e->msg, sizeof e->msg, fmt, ap);
   va_end (ap);
}

/* errno, as the failed call on `path` left it. */
static inline void
cqc_error_errno (cqc_error_t *e, const char *what, const char *path)
{
   int errnum = errno;
   cqc_error_set (e, CQC_ERR_OS, "cannot %s %s: %s", what, path, strerror (errnum));
   e->errnum = errnum;
   snprintf (e->path, sizeof e->path, "%s", path);
}

#endif
