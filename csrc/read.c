/*
 * read.c - the read side of the CPython binding: lookups (Cache.lookup,
 * Cache.peek) and the facades' find_one fast path (CoreBase, ViewBase),
 * which answers a hit of find_one({"_id": v}) without running Python code.
 * A hit's objects are made by build.c. binding.h has what this file shares
 * with module.c.
 */
#include "binding.h"

#include <stdlib.h>
#include <string.h>

#include <structmember.h>

#define FAST_STR_MAX 256

PyObject *cqc_miss;
PyObject *cqc_unhealthy;
PyObject *cqc_behind;
PyObject *cqc_after_var;

/* ======================================================================== */
/* Lookups                                                                  */
/* ======================================================================== */

/* A lookup's copy (first: build.c's callbacks take the context as a
 * cqc_hit_t) and the template that may stand in for it. */
typedef struct {
   cqc_hit_t hit;
   cqc_templates_t *templates; /* NULL: no template for this lookup */
   int kind;                   /* the hit's how and elements (template.h's kind) */
   PyObject *tpl;              /* held: a new reference to the entry's template */
   const cqc_program_t *program; /* tpl's */
} read_hit_t;

static bool
held_template (void *ctx, cqc_entry_id_t *id)
{
   read_hit_t *r = ctx;

   return cqc_templates_find (r->templates, id, r->kind, &r->tpl, &r->program);
}

/* Look the built key k (keys.h, its hash key_hash) up; returns a new
 * reference (the entry as decode(bytes, codec_options) makes it, built by
 * build.c or copied from its template (template.h) when it can be, None,
 * or a sentinel) or NULL with an exception. */
static PyObject *
lookup_built (CacheObject *self, uint32_t ns_idx, uint32_t db_idx, const cqc_key_t *k,
              uint64_t key_hash, PyObject *codec_options, PyObject *decode)
{
   cqc_served_t served;
   uint64_t block_off;
   cqc_entry_id_t id;
   read_hit_t r = {.templates = NULL, .tpl = NULL};
   const cqc_program_t *program = NULL;
   uint64_t value_hash = 0;
   PyObject *res;

   /* The lookup's first loads (the slot, the template's way, the block
    * the template was made of) depend on one another: asked for together
    * here, they overlap. The copy's first lines are then asked for too:
    * they arrive while the lookup validates the entry. The program is
    * read before cqc_hit_begin, which may run Python code (a codec's
    * judgement), after which the way may no longer hold it. */
   cqc_arena_r_prefetch (&self->c.arena, key_hash);
   if (self->templates &&
       (program = cqc_templates_prefetch (self->templates, key_hash, &block_off))) {
      cqc_arena_r_prefetch_block (&self->c.arena, block_off);
      cqc_template_prefetch (program);
   }
   cqc_hit_begin (&r.hit, decode, codec_options);
   if (self->templates && r.hit.how != CQC_HIT_DECODE) {
      r.templates = self->templates;
      r.kind = (int) r.hit.how | (r.hit.elements ? 4 : 0);
   }
   served = cqc_cache_lookup (&self->c, ns_idx, db_idx, k, key_hash, cqc_hit_alloc,
                              cqc_hit_discard, r.templates ? held_template : NULL, &r, &id);
   if (served != CQC_SERVE_HIT) {
      PyObject *answer[] = {[CQC_SERVE_NOT_FOUND] = Py_None, [CQC_SERVE_MISS] = cqc_miss,
                            [CQC_SERVE_UNHEALTHY] = cqc_unhealthy, [CQC_SERVE_BEHIND] = cqc_behind};
      Py_XDECREF (r.tpl); /* held, then refused by the causal floor */
      return Py_NewRef (answer[served]);
   }
   if (r.tpl) {
      cqc_templates_served (r.templates);
      res = cqc_template_run (r.program);
      Py_DECREF (r.tpl);
      return res;
   }
   if (r.templates && r.hit.buf) {
      value_hash = cqc_floor_result_hash (r.hit.buf, r.hit.len, false);
   }
   res = cqc_hit_finish (&r.hit);
   /* The first hit of the entry: its objects become its template. The
    * decoder may have run Python code: the store is read again (close()
    * frees it). */
   if (res && r.templates && self->templates) {
      cqc_templates_add (self->templates, &id, r.kind, res, value_hash);
   }
   return res;
}

/* Build the key of (kind, ns_idx, filter, rest) and look it up
 * (lookup_built). */
static PyObject *
lookup_key (CacheObject *self, uint32_t ns_idx, uint32_t db_idx, uint8_t kind,
            const uint8_t *filter, uint32_t flen, const uint8_t *rest, uint32_t rlen,
            PyObject *codec_options, PyObject *decode)
{
   cqc_key_t k;
   PyObject *res;

   if (!set_key_error (cqc_key_build (&k, kind, ns_idx, filter, flen, rest, rlen))) {
      return NULL;
   }
   res = lookup_built (self, ns_idx, db_idx, &k, cqc_hash_bytes (k.buf, k.len, 0), codec_options,
                       decode);
   cqc_key_free (&k);
   return res;
}

/* Whether the after() token of the current context (cqc_after_var's value:
 * (cluster time, monotonic ns), or (0, 0) outside any block) is covered by
 * the database's stream: 1, 0, or -1 with an exception. */
static int
after_covers (CacheObject *cache, uint32_t db_idx)
{
   PyObject *tok = PyObject_CallMethod (cqc_after_var, "get", NULL);
   unsigned long long ts = 0, ns = 0;
   cqc_covered_t cov;
   int ok;

   if (!tok) {
      return -1;
   }
   ok = PyArg_ParseTuple (tok, "KK", &ts, &ns);
   Py_DECREF (tok);
   if (!ok) {
      return -1;
   }
   if (!ts) {
      return 1;
   }
   cqc_floor_covered (&cache->c.arena, db_idx, &cov);
   return cqc_floor_covers (&cache->c.floor, &cov, ts, ns) ? 1 : 0;
}

/* {"_id": v} for the values the fast path takes (keys.h): the BSON length,
 * 0 when it does not take v (no exception set), or -1 with an exception. */
static Py_ssize_t
id_filter (CacheObject *self, PyObject *v, uint8_t *out, size_t cap)
{
   if (PyLong_CheckExact (v)) {
      int overflow = 0;
      long long x = PyLong_AsLongLongAndOverflow (v, &overflow);
      if (overflow || (x == -1 && PyErr_Occurred ())) {
         PyErr_Clear ();
         return 0; /* let PyMongo say what it thinks of this number */
      }
      return cqc_id_filter_int (out, cap, x);
   }
   if (PyUnicode_CheckExact (v)) {
      Py_ssize_t n;
      const char *s = PyUnicode_AsUTF8AndSize (v, &n);
      if (!s) {
         PyErr_Clear ();
         return 0;
      }
      return cqc_id_filter_str (out, cap, s, (size_t) n);
   }
   if (Py_TYPE (v) == (PyTypeObject *) self->objectid_type) {
      PyObject *bin = cqc_build_objectid_bytes (v);
      Py_ssize_t n = 0;
      if (!bin && (PyErr_Occurred () || !(bin = PyObject_GetAttrString (v, "binary")))) {
         return -1;
      }
      if (PyBytes_Check (bin) && PyBytes_Size (bin) == 12) {
         n = cqc_id_filter_oid (out, cap, (const uint8_t *) PyBytes_AsString (bin));
      }
      Py_DECREF (bin);
      return n;
   }
   return 0;
}

/* The key of find_one({"_id": v}) built early, before the checks that
 * precede its lookup, and its first lines asked for (the slot, the access
 * cell, the template store's set), so that they arrive while the checks
 * run: true with *k built (its filter in `filter`) and *key_hash set. Only
 * for an int or a str v (encoding them runs no Python code and raises
 * nothing) and a cache the checks will let read; else false, and the
 * key is built after the checks. */
static bool
early_key (CacheObject *cache, uint64_t ns_idx, PyObject *v, uint8_t *filter, size_t cap,
           cqc_key_t *k, uint64_t *key_hash)
{
   Py_ssize_t flen;

   if (cache->fork_gen != cqc_fork_gen || cache->closed || cache->c.mode == CQC_MODE_OWNER ||
       ns_idx >= cache->c.arena.geo.ns_count || (!PyLong_CheckExact (v) && !PyUnicode_CheckExact (v))) {
      return false;
   }
   flen = id_filter (cache, v, filter, cap);
   if (flen <= 0 ||
       cqc_key_build (k, 1, (uint32_t) ns_idx, filter, (uint32_t) flen, NULL, 0) != CQC_KEY_OK) {
      return false;
   }
   *key_hash = cqc_hash_bytes (k->buf, k->len, 0);
   cqc_arena_r_prefetch (&cache->c.arena, *key_hash);
   if (cache->templates) {
      cqc_templates_prefetch_set (cache->templates, *key_hash);
   }
   return true;
}

/* lookup(ns_idx, db_idx, kind, filter_bson, rest, codec_options[, decode]):
 * decode(bytes, codec_options) builds the result of a hit; the cache's
 * decode (one document) when omitted. */
PyObject *
Cache_lookup (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t ns_idx, db_idx, kind;
   Py_buffer b[2] = {{0}}; /* filter, rest */
   PyObject *res = NULL;

   if (!check_args (nargs, 6, 7, "lookup") || (nargs == 7 && !check_decode (args[6])) ||
       !check_usable (self, USE_READS) || !PARSE_NS (args[0], &ns_idx) ||
       !PARSE_DB (args[1], &db_idx) || !parse_idx (args[2], &kind, 256, "kind")) {
      return NULL;
   }
   if (get_buffer (args[3], &b[0], "filter") && get_buffer (args[4], &b[1], "rest")) {
      res = lookup_key (self, ns_idx, db_idx, (uint8_t) kind, b[0].buf, (uint32_t) b[0].len,
                        b[1].buf, (uint32_t) b[1].len, args[5],
                        nargs == 7 ? args[6] : self->decode);
   }
   release_buffers (b, 2);
   return res;
}

/* A private copy for peek: malloc'd, freed by the caller. */
typedef struct {
   uint8_t *buf;
   size_t len;
} peek_copy_t;

static void *
peek_alloc (void *ctx, size_t len)
{
   peek_copy_t *p = ctx;

   p->len = len;
   return p->buf = malloc (len ? len : 1);
}

static void
peek_discard (void *ctx)
{
   peek_copy_t *p = ctx;

   free (p->buf);
   p->buf = NULL;
}

/* peek(ns_idx, kind, filter_bson, rest) -> (value, end_ns, end_ts, read_id)
 * of the valid entry under the key whatever the causal floor says (value:
 * its bytes, None for a cached "not found"), or None: what a read the floor
 * refused would have been served (floor.h; its miss compares its result
 * with it). Counts nothing. */
PyObject *
Cache_peek (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t ns_idx, kind, cell;
   Py_buffer b[2] = {{0}}; /* filter, rest */
   PyObject *res = NULL;
   cqc_key_t k;
   cqc_stamp_t stamp;
   peek_copy_t copy = {NULL, 0};
   cqc_lookup_t r;

   if (!check_args (nargs, 4, 4, "peek") || !check_usable (self, USE_READS) ||
       !PARSE_NS (args[0], &ns_idx) || !parse_idx (args[1], &kind, 256, "kind")) {
      return NULL;
   }
   if (!get_buffer (args[2], &b[0], "filter") || !get_buffer (args[3], &b[1], "rest") ||
       !set_key_error (cqc_key_build (&k, (uint8_t) kind, ns_idx, b[0].buf, (uint32_t) b[0].len,
                                      b[1].buf, (uint32_t) b[1].len))) {
      goto cleanup;
   }
   r = cqc_arena_r_lookup_stamped (&self->c.arena, ns_idx, cqc_hash_bytes (k.buf, k.len, 0), k.buf,
                                   k.len, peek_alloc, peek_discard, &copy, &stamp, &cell);
   cqc_key_free (&k);
   if (r == CQC_LOOKUP_MISS || (r == CQC_LOOKUP_HIT && !copy.buf)) {
      res = Py_NewRef (Py_None);
   } else {
      PyObject *value = r == CQC_LOOKUP_HIT
                           ? PyBytes_FromStringAndSize ((const char *) copy.buf, (Py_ssize_t) copy.len)
                           : Py_NewRef (Py_None);
      if (value) {
         res = Py_BuildValue ("(NKKK)", value, (unsigned long long) stamp.end_ns,
                              (unsigned long long) stamp.end_ts, (unsigned long long) stamp.read_id);
      }
   }
   free (copy.buf);
cleanup:
   release_buffers (b, 2);
   return res;
}

/* ======================================================================== */
/* The facades' find_one fast path                                          */
/* ======================================================================== */

/* CoreBase is the C part of read.py's CollectionCore: what its fast path
 * reads, set by CollectionCore (its _bind) as plain attributes: the cache
 * (`native`), the collection's codec options, the bound-session getter,
 * the namespace's indexes and whether the collection can be served at all
 * (`fast`). ViewBase is the C part of the facades' collections, holding
 * their CollectionCore as `_core`. A hit of find_one({"_id": v}) then runs
 * no Python frame: the interpreter's frames and their objects, cold after
 * other work, cost about as much as the lookup itself. */
typedef struct {
   PyObject_HEAD
   PyObject *native;
   PyObject *codec;
   PyObject *bound_session;
   /* 64 bits, so that a value past 32 bits is refused by the lookup's
    * range check instead of truncated to another namespace's index. */
   unsigned long long ns_idx;
   unsigned long long db_idx;
   char fast;
} CoreObject;

typedef struct {
   PyObject_HEAD
   PyObject *core;
} ViewObject;

static PyTypeObject *g_cache_type; /* Cache */
static PyTypeObject *g_core_type;  /* CoreBase */
static PyObject *g_s_id;           /* "_id" */
static PyObject *g_s_start_id;     /* "_start_id" */
static PyObject *g_s_start_find_one;
static PyObject *g_s_find_one_rest;
static PyObject *g_empty_tuple;

/* find_one(filter)'s fast path: 1 with *out the hit (a new reference: a
 * document, or None for a cached "not found"); 0 when it does not answer,
 * with *out a lookup's sentinel and *id its _id (new references) when the
 * lookup ran, both NULL when the fast path does not take this read; -1
 * with an exception. The same checks, in the same order, as the Python
 * this replaced: the collection can be served, the filter is exactly
 * {"_id": int|str|ObjectId}, no session is bound; then the lookup raises
 * what lookup raises (closed, forked, an index out of range). */
static int
core_try_hit (CoreObject *core, PyObject *filter, PyObject **id, PyObject **out)
{
   uint8_t key[FAST_STR_MAX + CQC_ID_FILTER_FIXED];
   CacheObject *cache = (CacheObject *) core->native;
   PyObject *v, *session, *codec, *r;
   Py_ssize_t flen = 0;
   cqc_key_t k;
   uint64_t key_hash = 0, early_ns;
   bool early;
   int rc = -1;

   *id = *out = NULL;
   if (!core->fast || !cache || Py_TYPE (core->native) != g_cache_type || !core->codec ||
       !core->bound_session || !PyDict_CheckExact (filter) || PyDict_Size (filter) != 1) {
      return 0;
   }
   if (!(v = PyDict_GetItemWithError (filter, g_s_id))) {
      return PyErr_Occurred () ? -1 : 0;
   }
   if (!PyLong_CheckExact (v) && !PyUnicode_CheckExact (v) &&
       (!cache->objectid_type || Py_TYPE (v) != (PyTypeObject *) cache->objectid_type)) {
      return 0;
   }
   Py_INCREF (v); /* the getter below may let another thread change filter */
   Py_INCREF ((PyObject *) cache);
   early_ns = core->ns_idx;
   early = early_key (cache, early_ns, v, key, sizeof key, &k, &key_hash);
   if (!(session = PyObject_CallNoArgs (core->bound_session))) {
      goto done;
   }
   Py_DECREF (session);
   if (session != Py_None) {
      goto not_taken;
   }
   if (!check_usable (cache, USE_READS)) {
      goto done;
   }
   if (core->ns_idx >= cache->c.arena.geo.ns_count || core->db_idx >= cache->c.arena.geo.db_count) {
      PyErr_SetString (PyExc_ValueError, "ns_idx or db_idx out of range");
      goto done;
   }
   if (early && core->ns_idx != early_ns) {
      cqc_key_free (&k); /* rebound while the getter ran */
      early = false;
   }
   if (!early) {
      if ((flen = id_filter (cache, v, key, sizeof key)) < 0) {
         goto done;
      }
      if (flen == 0) {
         goto not_taken; /* an _id it cannot encode */
      }
   }
   if (cqc_after_var) {
      int covered = after_covers (cache, (uint32_t) core->db_idx);
      if (covered < 0) {
         goto done;
      }
      if (!covered) {
         goto not_taken; /* held to a token the stream has not reached */
      }
   }
   if (!core->codec) {
      goto not_taken; /* deleted while the getter ran */
   }
   codec = Py_NewRef (core->codec); /* a decoder in Python may let other code run */
   r = early ? lookup_built (cache, (uint32_t) core->ns_idx, (uint32_t) core->db_idx, &k, key_hash,
                             codec, cache->decode)
             : lookup_key (cache, (uint32_t) core->ns_idx, (uint32_t) core->db_idx, 1, key,
                           (uint32_t) flen, NULL, 0, codec, cache->decode);
   Py_DECREF (codec);
   if (!r) {
      goto done;
   }
   *out = r;
   if (r == cqc_miss || r == cqc_unhealthy || r == cqc_behind) {
      *id = Py_NewRef (v);
      rc = 0;
   } else {
      rc = 1;
   }
   goto done;
not_taken:
   rc = 0;
done:
   if (early) {
      cqc_key_free (&k);
   }
   Py_DECREF (v);
   Py_DECREF ((PyObject *) cache);
   return rc;
}

/* The first Step of a find_one(filter) the fast path did not answer:
 * core._start_id(id, looked_up) after its lookup, else
 * core.start_find_one(filter, (), {}). Steals id and looked_up. */
static PyObject *
core_first_step (PyObject *core, PyObject *filter, PyObject *id, PyObject *looked_up)
{
   PyObject *step, *kwargs;

   if (looked_up) {
      step = PyObject_CallMethodObjArgs (core, g_s_start_id, id, looked_up, NULL);
      Py_DECREF (id);
      Py_DECREF (looked_up);
      return step;
   }
   if (!(kwargs = PyDict_New ())) {
      return NULL;
   }
   step = PyObject_CallMethodObjArgs (core, g_s_start_find_one, filter, g_empty_tuple, kwargs,
                                      NULL);
   Py_DECREF (kwargs);
   return step;
}

/* CoreBase.fast_find_one(filter): the hit itself when the fast path
 * answers, else the read's first Step. */
static PyObject *
Core_fast_find_one (CoreObject *self, PyObject *filter)
{
   PyObject *id, *r;
   int rc = core_try_hit (self, filter, &id, &r);

   if (rc != 0) {
      return rc > 0 ? r : NULL;
   }
   return core_first_step ((PyObject *) self, filter, id, r);
}

/* ViewBase.find_one(filter=None, *args, **kwargs): a fast-path hit, else
 * self._find_one_rest(step, filter, *args, **kwargs), where step is the
 * first Step the fast path took, or None when it did not apply. A
 * vectorcall method: a hit makes no argument tuple. */
static PyObject *
View_find_one (ViewObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
   PyObject *step = NULL, *rest_args, *kwargs = NULL, *method, *res = NULL;
   Py_ssize_t i, nkw = kwnames ? PyTuple_Size (kwnames) : 0;

   if (nargs == 1 && nkw == 0 && self->core && PyObject_TypeCheck (self->core, g_core_type)) {
      PyObject *core = Py_NewRef (self->core), *id, *r;
      int rc = core_try_hit ((CoreObject *) core, args[0], &id, &r);

      step = rc == 0 ? core_first_step (core, args[0], id, r) : NULL;
      Py_DECREF (core);
      if (rc != 0) {
         return rc > 0 ? r : NULL;
      }
      if (!step) {
         return NULL;
      }
   }
   if (!(rest_args = PyTuple_New (nargs + 1)) || (nkw && !(kwargs = PyDict_New ()))) {
      Py_XDECREF (rest_args);
      Py_XDECREF (step);
      return NULL;
   }
   PyTuple_SetItem (rest_args, 0, step ? step : Py_NewRef (Py_None));
   for (i = 0; i < nargs; i++) {
      PyTuple_SetItem (rest_args, i + 1, Py_NewRef (args[i]));
   }
   for (i = 0; i < nkw; i++) {
      if (PyDict_SetItem (kwargs, PyTuple_GetItem (kwnames, i), args[nargs + i]) < 0) {
         goto done;
      }
   }
   if ((method = PyObject_GetAttr ((PyObject *) self, g_s_find_one_rest))) {
      res = PyObject_Call (method, rest_args, kwargs);
      Py_DECREF (method);
   }
done:
   Py_DECREF (rest_args);
   Py_XDECREF (kwargs);
   return res;
}

static int
Core_traverse (CoreObject *self, visitproc visit, void *arg)
{
   Py_VISIT (Py_TYPE ((PyObject *) self));
   Py_VISIT (self->native);
   Py_VISIT (self->codec);
   Py_VISIT (self->bound_session);
   return 0;
}

static int
Core_clear (CoreObject *self)
{
   Py_CLEAR (self->native);
   Py_CLEAR (self->codec);
   Py_CLEAR (self->bound_session);
   return 0;
}

static void
Core_dealloc (CoreObject *self)
{
   PyTypeObject *tp = Py_TYPE ((PyObject *) self);
   freefunc tp_free = (freefunc) PyType_GetSlot (tp, Py_tp_free);

   PyObject_GC_UnTrack (self);
   Core_clear (self);
   tp_free (self);
   Py_DECREF (tp);
}

static int
View_traverse (ViewObject *self, visitproc visit, void *arg)
{
   Py_VISIT (Py_TYPE ((PyObject *) self));
   Py_VISIT (self->core);
   return 0;
}

static int
View_clear (ViewObject *self)
{
   Py_CLEAR (self->core);
   return 0;
}

static void
View_dealloc (ViewObject *self)
{
   PyTypeObject *tp = Py_TYPE ((PyObject *) self);
   freefunc tp_free = (freefunc) PyType_GetSlot (tp, Py_tp_free);

   PyObject_GC_UnTrack (self);
   View_clear (self);
   tp_free (self);
   Py_DECREF (tp);
}

static PyMemberDef Core_members[] = {
   {"native", T_OBJECT_EX, offsetof (CoreObject, native), 0, "The cache (_native.Cache)."},
   {"codec", T_OBJECT_EX, offsetof (CoreObject, codec), 0, "The collection's codec options."},
   {"bound_session", T_OBJECT_EX, offsetof (CoreObject, bound_session), 0,
    "The bound-session getter: the session PyMongo's bind() made current, or None."},
   {"ns_idx", T_ULONGLONG, offsetof (CoreObject, ns_idx), 0, "The namespace's index."},
   {"db_idx", T_ULONGLONG, offsetof (CoreObject, db_idx), 0, "The database's index."},
   {"fast", T_BOOL, offsetof (CoreObject, fast), 0, "Whether the fast path may serve."},
   {NULL, 0, 0, 0, NULL},
};

static PyMethodDef Core_methods[] = {
   {"fast_find_one", (PyCFunction) Core_fast_find_one, METH_O,
    "fast_find_one(filter): the hit when the fast path answers, else the first Step."},
   {NULL, NULL, 0, NULL},
};

static PyType_Slot Core_slots[] = {
   {Py_tp_doc, (void *) "The C part of a collection's read logic (read.CollectionCore)."},
   {Py_tp_dealloc, (void *) Core_dealloc},
   {Py_tp_traverse, (void *) Core_traverse},
   {Py_tp_clear, (void *) Core_clear},
   {Py_tp_members, Core_members},
   {Py_tp_methods, Core_methods},
   {0, NULL},
};

static PyType_Spec Core_spec = {
   .name = "client_query_cache._native.CoreBase",
   .basicsize = sizeof (CoreObject),
   .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
   .slots = Core_slots,
};

static PyMemberDef View_members[] = {
   {"_core", T_OBJECT_EX, offsetof (ViewObject, core), 0, "The collection's CollectionCore."},
   {NULL, 0, 0, 0, NULL},
};

static PyMethodDef View_methods[] = {
   {"find_one", (PyCFunction) (void (*) (void)) View_find_one, METH_FASTCALL | METH_KEYWORDS,
    "find_one($self, filter=None, *args, **kwargs)\n--\n\n"
    "PyMongo's ``find_one``, served from the cache when safe."},
   {NULL, NULL, 0, NULL},
};

static PyType_Slot View_slots[] = {
   {Py_tp_doc, (void *) "The C part of a cached collection (facade.CollectionBase)."},
   {Py_tp_dealloc, (void *) View_dealloc},
   {Py_tp_traverse, (void *) View_traverse},
   {Py_tp_clear, (void *) View_clear},
   {Py_tp_members, View_members},
   {Py_tp_methods, View_methods},
   {0, NULL},
};

static PyType_Spec View_spec = {
   .name = "client_query_cache._native.ViewBase",
   .basicsize = sizeof (ViewObject),
   .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
   .slots = View_slots,
};

int
cqc_read_add_to_module (PyObject *m, PyTypeObject *cache_type)
{
   PyObject *core_type = PyType_FromSpec (&Core_spec);
   PyObject *view_type = PyType_FromSpec (&View_spec);
   int rc = -1;

   cqc_miss = PyUnicode_FromString ("<cache miss>");
   cqc_unhealthy = PyUnicode_FromString ("<cache unhealthy>");
   cqc_behind = PyUnicode_FromString ("<cache behind>");
   g_s_id = PyUnicode_InternFromString ("_id");
   g_s_start_id = PyUnicode_InternFromString ("_start_id");
   g_s_start_find_one = PyUnicode_InternFromString ("start_find_one");
   g_s_find_one_rest = PyUnicode_InternFromString ("_find_one_rest");
   g_empty_tuple = PyTuple_New (0);
   /* The types live as long as the process: the fast path compares with
    * them after the module object is gone. */
   g_cache_type = (PyTypeObject *) Py_NewRef ((PyObject *) cache_type);
   g_core_type = (PyTypeObject *) Py_XNewRef (core_type);
   if (core_type && view_type && cqc_miss && cqc_unhealthy && cqc_behind && g_s_id &&
       g_s_start_id && g_s_start_find_one && g_s_find_one_rest && g_empty_tuple &&
       PyModule_AddObjectRef (m, "CoreBase", core_type) == 0 &&
       PyModule_AddObjectRef (m, "ViewBase", view_type) == 0 &&
       PyModule_AddObjectRef (m, "MISS", cqc_miss) == 0 &&
       PyModule_AddObjectRef (m, "UNHEALTHY", cqc_unhealthy) == 0 &&
       PyModule_AddObjectRef (m, "BEHIND", cqc_behind) == 0) {
      rc = 0;
   }
   Py_XDECREF (core_type);
   Py_XDECREF (view_type);
   return rc;
}
