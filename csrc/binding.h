/*
 * binding.h - what the two files of the CPython binding share: module.c
 * (the Cache type: construction, admission, the causal floor, reports; and
 * the module) and read.c (lookups, and the facades' find_one fast path:
 * CoreBase and ViewBase). Argument checks and error conversion are here, as
 * static inline functions. Everything here runs with the GIL held.
 */
#ifndef CQC_BINDING_H
#define CQC_BINDING_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "build.h"
#include "cache.h"
#include "template.h"

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>

/* A Cache: the core's cache (cache.h) and what the binding adds. */
typedef struct {
   PyObject_HEAD
   cqc_cache_t c;
   PyObject *decode;        /* decode(bytes, codec_options) (build.h); NULL for an owner */
   PyObject *objectid_type; /* bson.objectid.ObjectId; NULL for an owner */
   PyObject *forked_error;  /* raised when used after fork() */
   PyObject *closed_error;  /* raised when used after close() */
   cqc_templates_t *templates; /* hits' templates (template.h); NULL: none */
   uint64_t fork_gen;
   bool closed;
} CacheObject;

/* Bumped in a child after fork() (module.c): a Cache from before refuses
 * to work. */
extern volatile uint64_t cqc_fork_gen;

/* Sentinels returned by lookups, compared by identity in Python (read.c). */
extern PyObject *cqc_miss;      /* no valid entry: read MongoDB and admit */
extern PyObject *cqc_unhealthy; /* the database's stream does not serve */
extern PyObject *cqc_behind;    /* the applied time is behind the causal floor */

/* The context variable of after() tokens (causal.py), once a block was
 * entered in this process (NULL before; module.c's after_blocks sets it):
 * from then on the fast path reads it on every read, as a task created
 * inside a block carries the token after the block has closed, and leaves
 * a read whose token the stream does not cover to the path that bypasses. */
extern PyObject *cqc_after_var;

/* ======================================================================== */
/* Arguments and errors                                                     */
/* ======================================================================== */

/* What a call needs of its cache, besides coming from the process that made
 * it: to read (a local cache or a worker, not an owner), or to tolerate
 * close() (reports). */
enum { USE = 0, USE_READS = 1, USE_CLOSED = 2 };

static inline bool
check_usable (CacheObject *self, int use)
{
   if (self->fork_gen != cqc_fork_gen) {
      PyErr_SetString (self->forked_error,
                       "this cache was created before fork(); create a new CacheManager in "
                       "the child process");
   } else if (self->closed && !(use & USE_CLOSED)) {
      PyErr_SetString (self->closed_error, "the cache manager is closed");
   } else if ((use & USE_READS) && self->c.mode == CQC_MODE_OWNER) {
      PyErr_SetString (PyExc_RuntimeError, "an owner serves no reads");
   } else {
      return true;
   }
   return false;
}

static inline bool
parse_idx (PyObject *o, uint32_t *out, uint32_t limit, const char *what)
{
   unsigned long v = PyLong_AsUnsignedLong (o);
   if (v == (unsigned long) -1 && PyErr_Occurred ()) {
      return false;
   }
   if (v >= limit) {
      PyErr_Format (PyExc_ValueError, "%s out of range", what);
      return false;
   }
   *out = (uint32_t) v;
   return true;
}

#define PARSE_NS(o, out) parse_idx ((o), (out), self->c.arena.geo.ns_count, "ns_idx")
#define PARSE_DB(o, out) parse_idx ((o), (out), self->c.arena.geo.db_count, "db_idx")

static inline bool
parse_u64 (PyObject *o, uint64_t *out)
{
   unsigned long long v = PyLong_AsUnsignedLongLong (o);
   if (v == (unsigned long long) -1 && PyErr_Occurred ()) {
      return false;
   }
   *out = (uint64_t) v;
   return true;
}

static inline bool
get_buffer (PyObject *o, Py_buffer *view, const char *what)
{
   if (PyObject_GetBuffer (o, view, PyBUF_SIMPLE) != 0) {
      return false;
   }
   if (view->len > 0x7fffffff) {
      PyBuffer_Release (view);
      PyErr_Format (PyExc_ValueError, "%s too large", what);
      return false;
   }
   return true;
}

static inline void
release_buffers (Py_buffer *views, size_t n)
{
   size_t i;
   for (i = 0; i < n; i++) {
      if (views[i].obj) {
         PyBuffer_Release (&views[i]);
      }
   }
}

static inline bool
check_args (Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi, const char *name)
{
   if (nargs < lo || nargs > hi) {
      PyErr_Format (PyExc_TypeError, "%s takes %zd to %zd arguments", name, lo, hi);
      return false;
   }
   return true;
}

static inline void
set_error (const cqc_error_t *e)
{
   PyObject *type[] = {PyExc_ValueError,   PyExc_ValueError,   PyExc_PermissionError,
                       PyExc_OSError,      PyExc_RuntimeError, PyExc_MemoryError};
   if (e->kind == CQC_ERR_OS) {
      errno = e->errnum;
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, e->path);
   } else {
      PyErr_SetString (type[(unsigned) e->kind < 6 ? e->kind : 0], e->msg);
   }
}

static inline bool
check_decode (PyObject *decode)
{
   if (!PyCallable_Check (decode)) {
      PyErr_SetString (PyExc_TypeError, "decode must be callable");
      return false;
   }
   return true;
}

static inline bool
set_key_error (cqc_key_status_t st)
{
   if (st == CQC_KEY_TOO_LARGE) {
      PyErr_SetString (PyExc_ValueError, "cache key too large");
   } else if (st == CQC_KEY_NO_MEMORY) {
      PyErr_NoMemory ();
   }
   return st == CQC_KEY_OK;
}

/* ======================================================================== */
/* read.c                                                                   */
/* ======================================================================== */

/* Cache.lookup and Cache.peek (module.c's method table lists them). */
PyObject *Cache_lookup (CacheObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Cache_peek (CacheObject *self, PyObject *const *args, Py_ssize_t nargs);

/* Make the sentinels and the CoreBase and ViewBase types, and add them to
 * the module m (MISS, UNHEALTHY, BEHIND, CoreBase, ViewBase); cache_type
 * is Cache, which the fast path checks its cache against. 0, or -1 with an
 * exception. */
int cqc_read_add_to_module (PyObject *m, PyTypeObject *cache_type);

#endif
