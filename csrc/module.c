/*
 * module.c - the CPython module client_query_cache._native: the binding.
 *
 * Types and functions only: converting arguments and results, raising the
 * exceptions the core's errors call for (error.h), holding the GIL or
 * releasing it. A hit's objects are made by build.c (built from the entry
 * under the default codec options, else the caller's decoder). The logic is
 * the core's: a cache and its three modes (cache.c), the arena (arena.c),
 * keys and identity filters (keys.c), admission (admit.c), the causal floor
 * (floor.c), change-stream followers (stream.c), the owner's drain
 * (owner.c), workers' rings (ring.c) and the shared files (shm.c).
 *
 * Three types. Cache, made by one of three constructors: Cache.local,
 * Cache.owner and Cache.worker (cache.h says what each is); its lookups are
 * read.c's. CoreBase and ViewBase (read.c), the C bases of the facades'
 * CollectionCore and CollectionBase: the find_one fast path, which answers
 * a hit without running Python code. binding.h has what the two files
 * share.
 */
#include "binding.h"

#include <limits.h>
#include <pthread.h>
#include <string.h>
#include <sys/prctl.h>

/* Bumped in a child after fork(): a Cache from before refuses to work. */
volatile uint64_t cqc_fork_gen;

static void
on_fork_child (void)
{
   cqc_fork_gen++;
}

/* ======================================================================== */
/* Construction and lifetime                                                */
/* ======================================================================== */

static bool
entry_live (const void *arena, const cqc_entry_id_t *id)
{
   return cqc_arena_r_entry_live (arena, id);
}

/* Make a Cache of `mode`; decode and oid are NULL for an owner, which
 * keeps no templates (template_bytes 0: none). */
static PyObject *
cache_make (PyObject *cls, cqc_mode_t mode, const cqc_cache_config_t *cfg, PyObject *decode,
            PyObject *oid, PyObject *closed_error, PyObject *forked_error,
            unsigned long long template_bytes)
{
   allocfunc alloc = (allocfunc) PyType_GetSlot ((PyTypeObject *) cls, Py_tp_alloc);
   CacheObject *self;
   cqc_error_t err;
   bool ok;

   if (decode && !check_decode (decode)) {
      return NULL;
   }
   if (!(self = (CacheObject *) alloc ((PyTypeObject *) cls, 0))) {
      return NULL;
   }
   self->fork_gen = cqc_fork_gen;
   self->decode = Py_XNewRef (decode);
   self->objectid_type = Py_XNewRef (oid);
   self->closed_error = Py_NewRef (closed_error);
   self->forked_error = Py_NewRef (forked_error);
   Py_BEGIN_ALLOW_THREADS
   ok = cqc_cache_open (&self->c, mode, cfg, &err);
   Py_END_ALLOW_THREADS
   if (!ok) {
      set_error (&err);
      Py_DECREF (self); /* Cache_dealloc releases what was made */
      return NULL;
   }
   if (template_bytes && mode != CQC_MODE_OWNER &&
       !(self->templates = cqc_templates_new ((size_t) template_bytes, entry_live, &self->c.arena))) {
      Py_DECREF (self);
      return PyErr_NoMemory ();
   }
   return (PyObject *) self;
}

/* Cache.local(...): the arguments are kwlist's, as _native.pyi gives them. */
static PyObject *
Cache_local (PyObject *cls, PyObject *args, PyObject *kwds)
{
   static char *kwlist[] = {"budget_bytes", "slot_count",   "uri",          "max_await_time_ms",
                            "decode",       "objectid_type", "closed_error", "forked_error",
                            "tls_ca_file",  "tls_ca_dir",    "tls_crl_file", "stream_scope",
                            "template_bytes", NULL};
   cqc_cache_config_t cfg = {0};
   PyObject *decode, *oid, *closed_error, *forked_error;
   unsigned long long template_bytes = 0;

   if (!PyArg_ParseTupleAndKeywords (args, kwds, "KIzLOOOO|zzziK", kwlist, &cfg.budget_bytes,
                                     &cfg.slot_count, &cfg.uri, &cfg.max_await_ms, &decode, &oid,
                                     &closed_error, &forked_error, &cfg.tls_ca_file,
                                     &cfg.tls_ca_dir, &cfg.tls_crl_file, &cfg.stream_scope,
                                     &template_bytes)) {
      return NULL;
   }
   return cache_make (cls, CQC_MODE_LOCAL, &cfg, decode, oid, closed_error, forked_error,
                      template_bytes);
}

/* Cache.owner(...): the arguments are kwlist's, as _native.pyi gives them. */
static PyObject *
Cache_owner (PyObject *cls, PyObject *args, PyObject *kwds)
{
   static char *kwlist[] = {"budget_bytes", "slot_count",   "uri",
                            "max_await_time_ms",    "arena_path",   "closed_error",
                            "forked_error", "heartbeat_timeout_ms", "arena_bytes",
                            "tls_ca_file",  "tls_ca_dir",   "tls_crl_file", "stream_scope",
                            "arena_fd",     NULL};
   cqc_cache_config_t cfg = {.heartbeat_timeout_ms = 1000, .arena_fd = -1, .segment_fd = -1};
   PyObject *closed_error, *forked_error;

   if (!PyArg_ParseTupleAndKeywords (args, kwds, "KIzLzOO|KKzzzii", kwlist, &cfg.budget_bytes,
                                     &cfg.slot_count, &cfg.uri, &cfg.max_await_ms,
                                     &cfg.arena_path, &closed_error, &forked_error,
                                     &cfg.heartbeat_timeout_ms, &cfg.arena_bytes,
                                     &cfg.tls_ca_file, &cfg.tls_ca_dir, &cfg.tls_crl_file,
                                     &cfg.stream_scope, &cfg.arena_fd)) {
      return NULL;
   }
   return cache_make (cls, CQC_MODE_OWNER, &cfg, NULL, NULL, closed_error, forked_error, 0);
}

/* Cache.worker(...): the arguments are kwlist's, as _native.pyi gives them. */
static PyObject *
Cache_worker (PyObject *cls, PyObject *args, PyObject *kwds)
{
   static char *kwlist[] = {"arena_path",    "segment_path", "ring_bytes",   "decode",
                            "objectid_type", "closed_error", "forked_error", "arena_fd",
                            "segment_fd",    "template_bytes", NULL};
   cqc_cache_config_t cfg = {.arena_fd = -1, .segment_fd = -1};
   PyObject *decode, *oid, *closed_error, *forked_error;
   unsigned long long template_bytes = 0;

   if (!PyArg_ParseTupleAndKeywords (args, kwds, "zzKOOOO|iiK", kwlist, &cfg.arena_path,
                                     &cfg.segment_path, &cfg.ring_bytes, &decode, &oid,
                                     &closed_error, &forked_error, &cfg.arena_fd,
                                     &cfg.segment_fd, &template_bytes)) {
      return NULL;
   }
   return cache_make (cls, CQC_MODE_WORKER, &cfg, decode, oid, closed_error, forked_error,
                      template_bytes);
}

/* Cache is a heap type (the limited API has no static types): each instance
 * holds a reference to its type, released once the memory is freed. */
static void
Cache_dealloc (CacheObject *self)
{
   PyTypeObject *tp = Py_TYPE ((PyObject *) self);
   freefunc tp_free = (freefunc) PyType_GetSlot (tp, Py_tp_free);
   /* In a forked child the threads do not exist and the locks may be held
    * by one of them in the parent's image: leave them alone. */
   bool threads = self->fork_gen == cqc_fork_gen;

   cqc_templates_close (self->templates);
   Py_BEGIN_ALLOW_THREADS
   cqc_cache_release (&self->c, threads);
   Py_END_ALLOW_THREADS
   Py_XDECREF (self->decode);
   Py_XDECREF (self->objectid_type);
   Py_XDECREF (self->closed_error);
   Py_XDECREF (self->forked_error);
   tp_free (self);
   Py_DECREF (tp);
}

/* check(): raise if this cache may not be used (closed, or forked). */
static PyObject *
Cache_check (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   return check_usable (self, USE) ? Py_NewRef (Py_None) : NULL;
}

static PyObject *
Cache_close (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   /* After fork(), nothing of the parent's threads exists here. */
   bool stop = !self->closed && self->fork_gen == cqc_fork_gen;

   self->closed = true;
   /* Reads raise from now on: the templates are of no more use. */
   cqc_templates_close (self->templates);
   self->templates = NULL;
   if (stop) {
      Py_BEGIN_ALLOW_THREADS
      cqc_cache_stop (&self->c);
      Py_END_ALLOW_THREADS
   }
   Py_RETURN_NONE;
}

static PyObject *
Cache_closed (CacheObject *self, void *Py_UNUSED (closure))
{
   return PyBool_FromLong (self->closed);
}

/* ======================================================================== */
/* Capture and admission (lookups: read.c)                                  */
/* ======================================================================== */

/* capture(ns_idx, filter_bson) -> token bytes, or None if the stream does
 * not serve (the caller then bypasses). */
static PyObject *
Cache_capture (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t ns_idx;
   Py_buffer fb = {0};
   cqc_token_t tok;
   bool healthy;

   if (!check_args (nargs, 2, 2, "capture") || !check_usable (self, USE_READS) ||
       !PARSE_NS (args[0], &ns_idx) || !get_buffer (args[1], &fb, "filter")) {
      return NULL;
   }
   healthy = cqc_cache_capture (&self->c, ns_idx, fb.buf, (uint32_t) fb.len, &tok);
   PyBuffer_Release (&fb);
   return healthy ? PyBytes_FromStringAndSize ((const char *) &tok, sizeof tok)
                  : Py_NewRef (Py_None);
}

/* admit(token, kind, filter_bson, rest, value_or_None, start_ns, end_ns,
 * end_ts, read_id, ordered) -> result code; kind may carry CQC_KIND_REBIND
 * (the constant KIND_REBIND). The rest is the read's stamp (arena.h). */
static PyObject *
Cache_admit (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   cqc_stamp_t stamp = {0};
   int ordered;
   uint32_t kind;
   Py_buffer b[4] = {{0}}; /* token, filter, rest, value */
   cqc_admission_t adm;
   PyObject *res = NULL;
   int r;

   if (!check_args (nargs, 10, 10, "admit") || !check_usable (self, USE_READS) ||
       !parse_idx (args[1], &kind, 256, "kind") || !parse_u64 (args[5], &stamp.start_ns) ||
       !parse_u64 (args[6], &stamp.end_ns) || !parse_u64 (args[7], &stamp.end_ts) ||
       !parse_u64 (args[8], &stamp.read_id) || (ordered = PyObject_IsTrue (args[9])) < 0) {
      return NULL;
   }
   stamp.flags = ordered ? CQC_STAMP_ORDERED : 0;
   if (!get_buffer (args[0], &b[0], "token") || !get_buffer (args[2], &b[1], "filter") ||
       !get_buffer (args[3], &b[2], "rest") ||
       (args[4] != Py_None && !get_buffer (args[4], &b[3], "value"))) {
      goto cleanup;
   }
   if (b[0].len != (Py_ssize_t) sizeof adm.token) {
      PyErr_SetString (PyExc_ValueError, "invalid token");
      goto cleanup;
   }
   adm = (cqc_admission_t){(uint8_t) kind,      b[3].obj == NULL,   {0},
                           b[1].buf,            (uint32_t) b[1].len, b[2].buf,
                           (uint32_t) b[2].len, b[3].buf,            (uint32_t) b[3].len};
   memcpy (&adm.token, b[0].buf, sizeof adm.token);
   adm.token.stamp = stamp;
   r = cqc_cache_admit (&self->c, &adm);
   if (r == CQC_ADMIT_INVALID) {
      PyErr_SetString (PyExc_ValueError, "invalid token: not one of this arena for this filter");
   } else if (r == CQC_ADMIT_NO_MEMORY) {
      PyErr_NoMemory ();
   } else {
      res = PyLong_FromLong (r);
   }
cleanup:
   release_buffers (b, 4);
   return res;
}

/* ======================================================================== */
/* Registration, the causal floor, state                                    */
/* ======================================================================== */

/* register(db, coll) -> (ns_idx, db_idx); starts the db's follower. */
static PyObject *
Cache_register (CacheObject *self, PyObject *args)
{
   const char *db, *coll;
   Py_ssize_t db_len, coll_len;
   uint32_t ns_idx, db_idx;
   cqc_error_t err;

   if (!PyArg_ParseTuple (args, "s#s#", &db, &db_len, &coll, &coll_len) ||
       !check_usable (self, USE)) {
      return NULL;
   }
   if (!cqc_cache_register (&self->c, db, (size_t) db_len, coll, (size_t) coll_len, &ns_idx,
                            &db_idx, &err)) {
      set_error (&err);
      return NULL;
   }
   return Py_BuildValue ("(II)", ns_idx, db_idx);
}

/* observe(scope, db_idx, ns_idx, filter_or_None, cluster_time, monotonic_ns,
 * read_id): an observation (floor.h) of a database (SCOPE_DB), a namespace
 * (SCOPE_NS), or the identity cell of the filter {"_id": v} (SCOPE_CELL;
 * the namespace for any other filter), bounded by the client's cluster time
 * and CLOCK_MONOTONIC after its reply. */
static PyObject *
Cache_observe (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t scope, db_idx, ns_idx;
   uint64_t ts, ns, read_id, id_hash = 0;
   Py_buffer fb = {0};

   if (!check_args (nargs, 7, 7, "observe") || !check_usable (self, USE) ||
       !parse_idx (args[0], &scope, 3, "scope") || !PARSE_DB (args[1], &db_idx) ||
       !PARSE_NS (args[2], &ns_idx) || !parse_u64 (args[4], &ts) || !parse_u64 (args[5], &ns) ||
       !parse_u64 (args[6], &read_id)) {
      return NULL;
   }
   if (scope == CQC_SCOPE_CELL) {
      if (args[3] == Py_None || !get_buffer (args[3], &fb, "filter")) {
         if (args[3] != Py_None) {
            return NULL;
         }
         scope = CQC_SCOPE_NS;
      } else {
         if (!cqc_filter_identity (fb.buf, (uint32_t) fb.len, &id_hash)) {
            scope = CQC_SCOPE_NS;
         }
         PyBuffer_Release (&fb);
      }
   }
   cqc_floor_observe (&self->c.floor, &self->c.arena, (int) scope, db_idx, ns_idx, id_hash,
                      ts ? ts : 1, ns, read_id);
   Py_RETURN_NONE;
}

/* observe_result(db_idx, ns_idx, kind, filter_bson, rest, value_or_None,
 * cluster_time, monotonic_ns, read_id): observe (SCOPE_CELL) a read that
 * returned one whole result of the key (kind, filter, rest): floor.h's (d)
 * then also serves another read's entry of that key holding those bytes. */
static PyObject *
Cache_observe_result (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t db_idx, ns_idx, kind;
   uint64_t ts, ns, read_id, id_hash = 0, key_hash = 0, value_hash;
   bool identity;
   Py_buffer b[3] = {{0}}; /* filter, rest, value */
   PyObject *res = NULL;
   cqc_key_t k;

   if (!check_args (nargs, 9, 9, "observe_result") || !check_usable (self, USE) ||
       !PARSE_DB (args[0], &db_idx) || !PARSE_NS (args[1], &ns_idx) ||
       !parse_idx (args[2], &kind, 256, "kind") || !parse_u64 (args[6], &ts) ||
       !parse_u64 (args[7], &ns) || !parse_u64 (args[8], &read_id)) {
      return NULL;
   }
   if (!get_buffer (args[3], &b[0], "filter") || !get_buffer (args[4], &b[1], "rest") ||
       (args[5] != Py_None && !get_buffer (args[5], &b[2], "value")) ||
       !set_key_error (cqc_key_build (&k, (uint8_t) kind, ns_idx, b[0].buf, (uint32_t) b[0].len,
                                      b[1].buf, (uint32_t) b[1].len))) {
      goto cleanup;
   }
   key_hash = cqc_hash_bytes (k.buf, k.len, 0);
   cqc_key_free (&k);
   value_hash = cqc_floor_result_hash (b[2].buf, (size_t) b[2].len, b[2].obj == NULL);
   identity = cqc_filter_identity (b[0].buf, (uint32_t) b[0].len, &id_hash);
   cqc_floor_observe_result (&self->c.floor, &self->c.arena,
                             identity ? CQC_SCOPE_CELL : CQC_SCOPE_NS, db_idx, ns_idx, id_hash,
                             ts ? ts : 1, ns, read_id, key_hash, value_hash);
   res = Py_NewRef (Py_None);
cleanup:
   release_buffers (b, 3);
   return res;
}

/* set_ordered(ordered): the deployment is known to have one member, where
 * a read that began after another ended read at least what it read
 * (floor.h (b) and (c)). */
static PyObject *
Cache_set_ordered (CacheObject *self, PyObject *arg)
{
   int ordered = PyObject_IsTrue (arg);

   if (ordered < 0 || !check_usable (self, USE)) {
      return NULL;
   }
   self->c.floor.ordered = ordered != 0;
   Py_RETURN_NONE;
}

/* covers(db_idx, cluster_time, monotonic_ns) -> bool: whether the
 * database's stream has applied everything an observation so bounded (an
 * after() token entered at monotonic_ns) could have seen. */
static PyObject *
Cache_covers (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t db_idx;
   uint64_t ts, ns;
   cqc_covered_t cov;

   if (!check_args (nargs, 3, 3, "covers") || !check_usable (self, USE) ||
       !PARSE_DB (args[0], &db_idx) || !parse_u64 (args[1], &ts) || !parse_u64 (args[2], &ns)) {
      return NULL;
   }
   cqc_floor_covered (&self->c.arena, db_idx, &cov);
   return PyBool_FromLong (cqc_floor_covers (&self->c.floor, &cov, ts, ns));
}

/* hold(db_idx, held): refuse every entry of the database while a
 * transaction of this process that wrote there is open (cqc_floor_hold). */
static PyObject *
Cache_hold (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t db_idx;
   int held;

   if (!check_args (nargs, 2, 2, "hold") || !check_usable (self, USE) ||
       !PARSE_DB (args[0], &db_idx) || (held = PyObject_IsTrue (args[1])) < 0) {
      return NULL;
   }
   cqc_floor_hold (&self->c.floor, db_idx, held);
   Py_RETURN_NONE;
}

/* invalidate_written(db_idx, ns_idx, filter_or_None, cluster_time,
 * monotonic_ns): this process wrote the document {"_id": v} (or, for any
 * other filter or None, somewhere in the namespace), observed with those
 * bounds: its entries are invalid until the stream applies the write
 * (cqc_cache_invalidate_written). */
static PyObject *
Cache_invalidate_written (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t db_idx, ns_idx;
   uint64_t ts, ns;
   Py_buffer fb = {0};

   if (!check_args (nargs, 5, 5, "invalidate_written") || !check_usable (self, USE) ||
       !PARSE_DB (args[0], &db_idx) || !PARSE_NS (args[1], &ns_idx) ||
       !parse_u64 (args[3], &ts) || !parse_u64 (args[4], &ns) ||
       (args[2] != Py_None && !get_buffer (args[2], &fb, "filter"))) {
      return NULL;
   }
   cqc_cache_invalidate_written (&self->c, db_idx, ns_idx, fb.obj ? fb.buf : NULL,
                                 (uint32_t) fb.len, ts ? ts : 1, ns);
   if (fb.obj) {
      PyBuffer_Release (&fb);
   }
   Py_RETURN_NONE;
}

/* db_state(db_idx) -> (state, stalled, applied time) as readers see it. */
static PyObject *
Cache_db_state (CacheObject *self, PyObject *arg)
{
   uint32_t db_idx;
   bool stalled;
   cqc_stream_state_t st;
   if (!check_usable (self, USE) || !PARSE_DB (arg, &db_idx)) {
      return NULL;
   }
   st = cqc_arena_r_db_state (&self->c.arena, db_idx, &stalled);
   return Py_BuildValue ("(iOK)", (int) st, stalled ? Py_True : Py_False,
                         (unsigned long long) cqc_arena_r_applied (&self->c.arena, db_idx));
}

/* ns_epoch(ns_idx) -> (epoch, db incarnation): what a collection probe's
 * verdict is valid for. */
static PyObject *
Cache_ns_epoch (CacheObject *self, PyObject *arg)
{
   uint32_t ns_idx, inc;
   uint64_t epoch;
   if (!check_usable (self, USE) || !PARSE_NS (arg, &ns_idx)) {
      return NULL;
   }
   cqc_cache_ns_epoch (&self->c, ns_idx, &epoch, &inc);
   return Py_BuildValue ("(KI)", (unsigned long long) epoch, inc);
}

/* ======================================================================== */
/* Statistics, followers, rings                                             */
/* ======================================================================== */

static PyObject *
Cache_stats (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   cqc_stat_t s[CQC_STATS_MAX + 7];
   cqc_templates_stats_t ts;
   size_t i, n;
   PyObject *d;

   if (!check_usable (self, USE_CLOSED)) {
      return NULL;
   }
   n = cqc_cache_stats (&self->c, s);
   cqc_templates_stats (self->templates, &ts);
   s[n++] = (cqc_stat_t){"template_hits", ts.hits};
   s[n++] = (cqc_stat_t){"templates", ts.count};
   s[n++] = (cqc_stat_t){"template_bytes", ts.bytes};
   s[n++] = (cqc_stat_t){"template_budget", ts.limit};
   s[n++] = (cqc_stat_t){"template_evictions", ts.evicted};
   s[n++] = (cqc_stat_t){"template_released", ts.released};
   s[n++] = (cqc_stat_t){"template_declined", ts.declined};
   if (!(d = PyDict_New ())) {
      return NULL;
   }
   for (i = 0; i < n; i++) {
      PyObject *v = PyLong_FromUnsignedLongLong (s[i].value);
      if (!v || PyDict_SetItemString (d, s[i].name, v) < 0) {
         Py_XDECREF (v);
         Py_DECREF (d);
         return NULL;
      }
      Py_DECREF (v);
   }
   return d;
}

/* streams() -> list of dicts, one per registered database. */
static PyObject *
Cache_streams (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   cqc_db_report_t r;
   PyObject *list, *d;
   uint32_t i;

   if (!check_usable (self, USE_CLOSED)) {
      return NULL;
   }
   if (!(list = PyList_New (0))) {
      return NULL;
   }
   for (i = 0; cqc_cache_db_report (&self->c, i, &r); i++) {
      d = Py_BuildValue (
         "{s:s#,s:I,s:s,s:O,s:K,s:K,s:K,s:I,s:s,s:(II),s:K,s:K,s:K,s:(Iddd)}", "database", r.name,
         (Py_ssize_t) r.name_len, "db_idx", i, "state", cqc_cache_state_name (r.info.state),
         "stalled", r.stalled ? Py_True : Py_False, "events", (unsigned long long) r.info.events,
         "reconnects", (unsigned long long) r.info.reconnects, "history_lost",
         (unsigned long long) r.info.history_lost, "incarnation", r.incarnation, "last_error",
         r.info.last_error, "applied_time", (unsigned int) (r.applied >> 32),
         (unsigned int) (r.applied & 0xffffffffu), "getmores", (unsigned long long) r.info.getmores,
         "event_bytes", (unsigned long long) r.info.event_bytes, "invalidations",
         (unsigned long long) r.info.invalidations, "lag", r.info.lag_samples, r.info.lag_p50_ms,
         r.info.lag_p95_ms, r.info.lag_max_ms);
      if (d && r.followed) {
         PyObject *scope = Py_BuildValue (
            "(ss)", r.info.scope == CQC_STREAM_SCOPE_DATABASE ? "database" : "deployment",
            r.info.scope_reason);
         if (!scope || PyDict_SetItemString (d, "scope", scope) < 0) {
            Py_CLEAR (d);
         }
         Py_XDECREF (scope);
      }
      if (!d || PyList_Append (list, d) < 0) {
         Py_XDECREF (d);
         Py_DECREF (list);
         return NULL;
      }
      Py_DECREF (d);
   }
   return list;
}

/* attach_ring(path or fd) -> id (owner): start draining a worker's ring,
 * its file or the memfd it handed over (which stays open). */
static PyObject *
Cache_attach_ring (CacheObject *self, PyObject *arg)
{
   const char *path = NULL;
   int fd = -1;
   cqc_error_t err;
   uint32_t id = 0;

   if (PyLong_Check (arg)) {
      long v = PyLong_AsLong (arg);
      if (v == -1 && PyErr_Occurred ()) {
         return NULL;
      }
      if (v < 0 || v > INT_MAX) {
         PyErr_SetString (PyExc_ValueError, "attach_ring: not a file descriptor");
         return NULL;
      }
      fd = (int) v;
   } else if (!(path = PyUnicode_AsUTF8AndSize (arg, NULL))) {
      return NULL;
   }
   if (check_usable (self, USE) && !(id = cqc_cache_attach_ring (&self->c, path, fd, &err))) {
      set_error (&err);
   }
   return id ? PyLong_FromUnsignedLong (id) : NULL;
}

/* detach_ring(id) (owner): drain what is left, unmap and unlink. */
static PyObject *
Cache_detach_ring (CacheObject *self, PyObject *arg)
{
   unsigned long id = PyLong_AsUnsignedLong (arg);
   if (id == (unsigned long) -1 && PyErr_Occurred ()) {
      return NULL;
   }
   if (self->fork_gen == cqc_fork_gen) {
      Py_BEGIN_ALLOW_THREADS
      cqc_cache_detach_ring (&self->c, (uint32_t) id);
      Py_END_ALLOW_THREADS
   }
   Py_RETURN_NONE;
}

/* geometry() -> dict: what an attacher compares with what it expects. */
static PyObject *
Cache_geometry (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   const cqc_arena_header_t *h = self->c.arena.hdr;
   return Py_BuildValue ("{s:I,s:K,s:K,s:I,s:I,s:I,s:I,s:K}", "layout_version",
                         h->layout_version, "arena_bytes", (unsigned long long) h->arena_bytes,
                         "budget_bytes", (unsigned long long) h->geo.budget_bytes, "slot_count",
                         h->geo.slot_count, "owner_uid", h->owner_uid, "owner_pid",
                         h->owner_pid, "mode", (unsigned) self->c.mode, "heartbeat_timeout_ns",
                         (unsigned long long) h->heartbeat_timeout_ns);
}

#define FASTCALL(name, doc)                                                                  \
   {#name, (PyCFunction) (void (*) (void)) Cache_##name, METH_FASTCALL, doc}
#define CTOR(name, doc)                                                                      \
   {#name, (PyCFunction) (void (*) (void)) Cache_##name,                                     \
    METH_CLASS | METH_VARARGS | METH_KEYWORDS, doc}
#define METHOD(name, flags, doc) {#name, (PyCFunction) Cache_##name, flags, doc}

static PyMethodDef Cache_methods[] = {
   CTOR (local, "A process-local cache: it admits and follows the streams itself."),
   CTOR (owner, "A shared cache's owner: creates the arena file, follows, drains rings."),
   CTOR (worker, "A shared cache's worker: the owner's arena read-only, admits via a ring."),
   FASTCALL (lookup, "lookup(ns_idx, db_idx, kind, filter, rest, codec_options[, decode])."),
   FASTCALL (capture, "capture(ns_idx, filter) -> token, or None: the stream does not serve."),
   FASTCALL (admit, "admit(token, kind, filter, rest, value_or_None, start_ns, end_ns, end_ts, "
                    "read_id, ordered)."),
   FASTCALL (observe, "observe(scope, db_idx, ns_idx, filter_or_None, cluster_time, monotonic_ns, "
                      "read_id): the floor."),
   FASTCALL (covers, "covers(db_idx, cluster_time, monotonic_ns) -> bool."),
   FASTCALL (observe_result, "observe_result(db_idx, ns_idx, kind, filter, rest, value_or_None, "
                             "cluster_time, monotonic_ns, read_id)."),
   FASTCALL (peek, "peek(ns_idx, kind, filter, rest) -> (value, end_ns, end_ts, read_id) or None."),
   METHOD (set_ordered, METH_O, "set_ordered(ordered): the deployment has one member."),
   FASTCALL (hold, "hold(db_idx, held): refuse the database's entries (a transaction)."),
   FASTCALL (invalidate_written, "invalidate_written(db_idx, ns_idx, filter_or_None, "
                                 "cluster_time, monotonic_ns): this process wrote there."),
   METHOD (register, METH_VARARGS, "register(db, coll) -> (ns_idx, db_idx)."),
   METHOD (db_state, METH_O, "db_state(db_idx) -> (state, stalled, applied time)."),
   METHOD (ns_epoch, METH_O, "ns_epoch(ns_idx) -> (epoch, incarnation)."),
   METHOD (stats, METH_NOARGS, "Arena and lookup counters."),
   METHOD (streams, METH_NOARGS, "Change-stream followers."),
   METHOD (close, METH_NOARGS, "Stop the followers (and an owner's drain)."),
   METHOD (check, METH_NOARGS, "Raise if closed or used after fork."),
   METHOD (attach_ring, METH_O, "Owner: drain a worker's ring."),
   METHOD (detach_ring, METH_O, "Owner: release a worker's ring."),
   METHOD (geometry, METH_NOARGS, "Arena geometry and owner."),
   {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cache_getset[] = {
   {"closed", (getter) Cache_closed, NULL, "Whether close() was called.", NULL},
   {NULL, NULL, NULL, NULL, NULL},
};

/* A spec rather than a static PyTypeObject: the stable ABI (abi3) hides the
 * type object's layout, so the type is created from slots at import.
 * IMMUTABLETYPE keeps its attributes read-only, as a static type's are;
 * DISALLOW_INSTANTIATION leaves the three constructors as the only way to
 * make one. */
static PyType_Slot Cache_slots[] = {
   {Py_tp_doc, (void *) "A cache arena with its writer and change-stream followers."},
   {Py_tp_dealloc, (void *) Cache_dealloc},
   {Py_tp_methods, Cache_methods},
   {Py_tp_getset, Cache_getset},
   {0, NULL},
};

static PyType_Spec Cache_spec = {
   .name = "client_query_cache._native.Cache",
   .basicsize = sizeof (CacheObject),
   .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
   .slots = Cache_slots,
};

/* ======================================================================== */
/* Module                                                                   */
/* ======================================================================== */

static PyObject *
mod_after_blocks (PyObject *Py_UNUSED (m), PyObject *arg)
{
   PyObject *old = cqc_after_var;

   cqc_after_var = arg == Py_None ? NULL : Py_NewRef (arg);
   Py_XDECREF (old);
   Py_RETURN_NONE;
}

/* undumpable(): this process's /proc/<pid>/fd, /proc/<pid>/mem and maps
 * become root's, and processes of the same user can no longer ptrace it
 * (prctl PR_SET_DUMPABLE 0; no core dump either). The owner of a cache that
 * requires a capability calls it: its arena's memfd is then open to none of
 * them. */
static PyObject *
mod_undumpable (PyObject *Py_UNUSED (m), PyObject *Py_UNUSED (ignored))
{
   if (prctl (PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
      return PyErr_SetFromErrno (PyExc_OSError);
   }
   Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
   {"after_blocks", mod_after_blocks, METH_O,
    "after_blocks(var): the context variable of after() tokens, once a block was entered."},
   {"undumpable", mod_undumpable, METH_NOARGS,
    "undumpable(): make this process undumpable (prctl PR_SET_DUMPABLE 0)."},
   {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
   PyModuleDef_HEAD_INIT, "client_query_cache._native",
   "C core of client-query-cache: the cache, its arena and change-stream followers.", -1,
   module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__native (void)
{
   static bool initialized;
   PyObject *m = PyModule_Create (&moduledef);
   PyObject *cache_type = m ? PyType_FromSpec (&Cache_spec) : NULL;

   if (!initialized) {
      cqc_cache_init_library ();
      pthread_atfork (NULL, NULL, on_fork_child);
      initialized = true;
   }
   if (!cache_type || PyModule_AddObjectRef (m, "Cache", cache_type) < 0 ||
       cqc_read_add_to_module (m, (PyTypeObject *) cache_type) < 0 ||
       cqc_build_add_functions (m) < 0 || PyModule_AddFunctions (m, cqc_template_methods) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_OK", CQC_ADMIT_OK) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_STALE", CQC_ADMIT_STALE) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_UNHEALTHY", CQC_ADMIT_UNHEALTHY) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_TOO_LARGE", CQC_ADMIT_TOO_LARGE) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_NO_SLOT", CQC_ADMIT_NO_SLOT) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_CONFLICT", CQC_ADMIT_CONFLICT) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_QUEUED", CQC_ADMIT_QUEUED) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_DROPPED", CQC_ADMIT_DROPPED) < 0 ||
       PyModule_AddIntConstant (m, "KIND_REBIND", CQC_KIND_REBIND) < 0 ||
       PyModule_AddIntConstant (m, "SCOPE_DB", CQC_SCOPE_DB) < 0 ||
       PyModule_AddIntConstant (m, "SCOPE_NS", CQC_SCOPE_NS) < 0 ||
       PyModule_AddIntConstant (m, "SCOPE_CELL", CQC_SCOPE_CELL) < 0 ||
       PyModule_AddIntConstant (m, "MODE_LOCAL", CQC_MODE_LOCAL) < 0 ||
       PyModule_AddIntConstant (m, "MODE_OWNER", CQC_MODE_OWNER) < 0 ||
       PyModule_AddIntConstant (m, "MODE_WORKER", CQC_MODE_WORKER) < 0 ||
       PyModule_AddIntConstant (m, "LAYOUT_VERSION", CQC_LAYOUT_VERSION) < 0 ||
       PyModule_AddIntConstant (m, "STATE_HEALTHY", CQC_STREAM_HEALTHY) < 0) {
      Py_CLEAR (m);
   }
   Py_XDECREF (cache_type);
   return m;
}
