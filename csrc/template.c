/*
 * template.c - templates of hit entries (template.h says what and why).
 *
 * A template is a tuple (tree, plan, lines). tree is the template's own
 * copy of the built object's containers, around the built object's values;
 * plan says where, in each container, the containers nested in it are:
 * None for a container holding none, else a tuple (key or index, plan,
 * ...). A copy of a container is one PyDict_Copy or list slice (which share
 * the values), then a copy of each nested container put in its place.
 * lines (bytes) holds the address of every object the copy reads or
 * changes the reference count of: the copy prefetches them all before it
 * starts, so that a template not in the CPU's caches costs about one
 * memory latency rather than one per object (its objects are scattered
 * over the heap, and a hit of an entry not hit recently finds none of them
 * cached).
 *
 * The store is a set-associative table (WAYS templates per set, by the
 * entry's key hash), under the GIL. Nothing it frees runs Python code: a
 * template holds only containers, str keys and the shareable values, none
 * of which has a finalizer.
 */
#include "template.h"

#include <stdlib.h>
#include <string.h>

#define WAYS 4
/* Deepest nesting a template follows: the builder's own bound (build.c's
 * MAX_LEVEL), below the C stack's. */
#define MAX_DEPTH 200
/* A template larger than this share of the budget is not kept. */
#define MAX_SHARE 8

/* The values a template shares between hits, set up once: exact types, of
 * objects no caller can change. */
enum { NOT_SET_UP = 0, READY = 1, UNAVAILABLE = 2 };

static struct {
   int status;
   PyObject *types[7]; /* ObjectId, Int64, Decimal128, Timestamp, MinKey, MaxKey, datetime */
   PyObject *s_sizeof;
} g;

/* Whether objects of type `tp` have no instance dict: nothing can be set
 * on them (a type with __slots__ only, or a builtin). */
static bool
no_instance_dict (PyObject *tp)
{
   PyObject *off = PyObject_GetAttrString (tp, "__dictoffset__");
   long v = off ? PyLong_AsLong (off) : -1;

   Py_XDECREF (off);
   PyErr_Clear ();
   return v == 0;
}

static bool
ready (void)
{
   static const char *const want[][2] = {
      {"bson.objectid", "ObjectId"},  {"bson.int64", "Int64"},     {"bson.decimal128", "Decimal128"},
      {"bson.timestamp", "Timestamp"}, {"bson.min_key", "MinKey"}, {"bson.max_key", "MaxKey"},
      {"datetime", "datetime"},
   };
   size_t i;

   if (g.status != NOT_SET_UP) {
      return g.status == READY;
   }
   g.status = UNAVAILABLE;
   for (i = 0; i < sizeof want / sizeof want[0]; i++) {
      PyObject *mod = PyImport_ImportModule (want[i][0]);
      g.types[i] = mod ? PyObject_GetAttrString (mod, want[i][1]) : NULL;
      Py_XDECREF (mod);
      /* A type whose objects take attributes is not shared: its values
       * make a document's hits built every time. */
      if (g.types[i] && (!PyType_Check (g.types[i]) || !no_instance_dict (g.types[i]))) {
         Py_CLEAR (g.types[i]);
      }
   }
   PyErr_Clear ();
   g.s_sizeof = PyUnicode_InternFromString ("__sizeof__");
   if (g.s_sizeof) {
      g.status = READY;
   }
   PyErr_Clear ();
   return g.status == READY;
}

static bool
shareable (PyObject *v)
{
   PyObject *tp = (PyObject *) Py_TYPE (v);
   size_t i;

   if (PyUnicode_CheckExact (v) || PyLong_CheckExact (v) || PyFloat_CheckExact (v) ||
       PyBool_Check (v) || v == Py_None || PyBytes_CheckExact (v)) {
      return true;
   }
   for (i = 0; i < sizeof g.types / sizeof g.types[0]; i++) {
      if (g.types[i] && tp == g.types[i]) {
         return true;
      }
   }
   return false;
}

/* __sizeof__ of o, added to *bytes; false (no exception) if it fails. */
static bool
add_size (PyObject *o, size_t *bytes)
{
   PyObject *n = PyObject_CallMethodObjArgs (o, g.s_sizeof, NULL);
   Py_ssize_t v = n ? PyLong_AsSsize_t (n) : -1;

   Py_XDECREF (n);
   if (v < 0) {
      PyErr_Clear ();
      return false;
   }
   *bytes += (size_t) v;
   return true;
}

/* ======================================================================== */
/* Making and copying a template                                            */
/* ======================================================================== */

/* The addresses a copy of the template prefetches. */
typedef struct {
   const void **at;
   size_t n, cap;
   bool failed;
} lines_t;

static void
lines_add (lines_t *l, const void *p)
{
   if (l->n == l->cap) {
      size_t cap = l->cap ? 2 * l->cap : 64;
      const void **at = l->failed ? NULL : realloc (l->at, cap * sizeof *at);
      if (!at) {
         l->failed = true;
         return;
      }
      l->at = at;
      l->cap = cap;
   }
   l->at[l->n++] = p;
}

/* How many lines lines_add_range adds for `size` bytes. */
static size_t
range_lines (size_t size)
{
   return (size + 63) / 64;
}

static void
lines_add_range (lines_t *l, const void *p, size_t size)
{
   size_t off;

   for (off = 0; off < size; off += 64) {
      lines_add (l, (const char *) p + off);
   }
}

/* The bytes of a plan tuple (its items are inline in the object, in every
 * CPython). */
static size_t
plan_size (PyObject *plan)
{
   return plan == Py_None ? 0
                          : sizeof (PyObject) + sizeof (Py_ssize_t) +
                               (size_t) PyTuple_Size (plan) * sizeof (PyObject *);
}

/* A container's own storage, which a copy reads: a dict's keys table
 * (PyDict_Copy copies it whole), a list's array of items. Their addresses
 * are in the objects' structs, which the limited API does not describe:
 * read from where CPython 3.11 to 3.14 keep them (PyDictObject's ma_keys,
 * PyListObject's ob_item: the fifth and fourth words of the object). A
 * hint only: a prefetch of any address is harmless, so on a CPython laid
 * out otherwise a copy is as correct, only slower. The words read are
 * inside the objects (a dict or a list is larger). */
static const void *
storage_of (PyObject *node, size_t *size)
{
   if (PyDict_CheckExact (node)) {
      /* header, indices, entries: a bound */
      *size = 48 + 3 * (size_t) PyDict_Size (node) * sizeof (void *);
      return ((const void *const *) node)[4];
   }
   *size = (size_t) PyList_Size (node) * sizeof (void *);
   return ((const void *const *) node)[3];
}

/* How many lines collect_lines adds for the container itself (not its
 * nested containers): the same count at the copy, which follows it. */
static size_t
node_lines (PyObject *node, PyObject *plan)
{
   size_t storage;
   Py_ssize_t n = PyDict_CheckExact (node) ? PyDict_Size (node) : PyList_Size (node);

   storage_of (node, &storage);
   return 1 + range_lines (storage) + (size_t) n + range_lines (plan_size (plan));
}

/* The lines a copy of `node` touches, in the order it touches them: the
 * container, its storage, its values, its plan, then each nested
 * container's the same way, in the plan's order. */
static void
collect_lines (PyObject *node, PyObject *plan, lines_t *l)
{
   bool dict = PyDict_CheckExact (node);
   Py_ssize_t pos = 0, i, n;
   PyObject *k, *v;
   size_t storage;
   const void *p = storage_of (node, &storage);

   lines_add (l, node);
   lines_add_range (l, p, storage);
   if (dict) {
      while (PyDict_Next (node, &pos, &k, &v)) {
         lines_add (l, v);
      }
   } else {
      for (i = 0, n = PyList_Size (node); i < n; i++) {
         lines_add (l, PyList_GetItem (node, i));
      }
   }
   if (plan == Py_None) {
      return;
   }
   lines_add_range (l, plan, plan_size (plan));
   for (i = 0, n = PyTuple_Size (plan); i + 1 < n; i += 2) {
      PyObject *at = PyTuple_GetItem (plan, i);
      PyObject *child = dict ? PyDict_GetItem (node, at) : PyList_GetItem (node, PyLong_AsSsize_t (at));
      if (child) {
         collect_lines (child, PyTuple_GetItem (plan, i + 1), l);
      }
   }
}

static PyObject *make_node (PyObject *o, int depth, size_t *bytes, PyObject **plan);

/* The template's version of the value v at `at` (a key or an index) of a
 * container: v itself when it is shared (nothing added to the plan), a
 * template of it when it is a container (its plan appended to `plan`, a
 * list of key, plan, ...), NULL when it is neither. A new reference. */
static PyObject *
make_value (PyObject *v, PyObject *at, int depth, size_t *bytes, PyObject *plan)
{
   PyObject *sub = NULL, *node;

   if (PyDict_CheckExact (v) || PyList_CheckExact (v)) {
      if (!(node = make_node (v, depth + 1, bytes, &sub))) {
         return NULL;
      }
      if (PyList_Append (plan, at) < 0 || PyList_Append (plan, sub) < 0) {
         Py_DECREF (node);
         node = NULL;
      }
      Py_DECREF (sub);
      return node;
   }
   if (!shareable (v) || !add_size (v, bytes)) {
      return NULL;
   }
   return Py_NewRef (v);
}

/* A container's template: a new container of the same type, its values
 * made by make_value; *plan None or the tuple of its nested containers. */
static PyObject *
make_node (PyObject *o, int depth, size_t *bytes, PyObject **plan)
{
   PyObject *node = NULL, *nested = NULL, *k, *v;
   Py_ssize_t pos = 0, i, n;

   if (depth > MAX_DEPTH || !add_size (o, bytes) || !(nested = PyList_New (0))) {
      return NULL;
   }
   if (PyDict_CheckExact (o)) {
      if (!(node = PyDict_New ())) {
         goto fail;
      }
      while (PyDict_Next (o, &pos, &k, &v)) {
         PyObject *t;
         int r;
         if (!PyUnicode_CheckExact (k) || !(t = make_value (v, k, depth, bytes, nested))) {
            goto fail;
         }
         r = PyDict_SetItem (node, k, t);
         Py_DECREF (t);
         if (r < 0) {
            goto fail;
         }
      }
   } else {
      n = PyList_Size (o);
      if (n < 0 || !(node = PyList_New (n))) {
         goto fail;
      }
      for (i = 0; i < n; i++) {
         PyObject *at = PyLong_FromSsize_t (i), *t;
         t = at ? make_value (PyList_GetItem (o, i), at, depth, bytes, nested) : NULL;
         Py_XDECREF (at);
         if (!t || PyList_SetItem (node, i, t) < 0) {
            goto fail;
         }
      }
   }
   *plan = PyList_Size (nested) ? PyList_AsTuple (nested) : Py_NewRef (Py_None);
   Py_DECREF (nested);
   if (!*plan) {
      Py_DECREF (node);
      return NULL;
   }
   return node;
fail:
   Py_XDECREF (node);
   Py_XDECREF (nested);
   return NULL;
}

PyObject *
cqc_template_of (PyObject *built, size_t *bytes)
{
   PyObject *tree, *plan = NULL, *at = NULL, *tpl = NULL;
   lines_t lines = {NULL, 0, 0, false};

   *bytes = 0;
   if (!ready () || (!PyDict_CheckExact (built) && !PyList_CheckExact (built))) {
      return NULL;
   }
   tree = make_node (built, 0, bytes, &plan);
   if (tree) {
      collect_lines (tree, plan, &lines);
   }
   if (tree && !lines.failed) {
      at = PyBytes_FromStringAndSize ((const char *) lines.at, (Py_ssize_t) (lines.n * sizeof *lines.at));
   }
   if (at && add_size (at, bytes)) {
      tpl = PyTuple_Pack (3, tree, plan, at);
   }
   free (lines.at);
   Py_XDECREF (tree);
   Py_XDECREF (plan);
   Py_XDECREF (at);
   PyErr_Clear ();
   return tpl;
}

/* The prefetches of a copy: the template's lines (collect_lines' order),
 * how many the containers copied so far account for, how many asked for. */
typedef struct {
   const void *const *at;
   size_t n, used, asked;
} ahead_t;

/* Lines asked for beyond those of the container being copied: enough to
 * keep the CPU's outstanding misses busy while it copies. */
#define LEAD 32

/* A copy of the container o: a new one sharing o's values, with a copy of
 * each nested container (plan) in its place. Asks first for its own lines
 * and LEAD more, so that the loads of what comes next overlap this copy. */
static PyObject *
copy_node (PyObject *o, PyObject *plan, ahead_t *a)
{
   bool dict = PyDict_CheckExact (o);
   PyObject *n;
   Py_ssize_t i, np;
   size_t upto;

   if ((!dict && !PyList_CheckExact (o)) || (plan != Py_None && !PyTuple_CheckExact (plan))) {
      PyErr_SetString (PyExc_TypeError, "not a template");
      return NULL;
   }
   a->used += node_lines (o, plan);
   for (upto = a->used + LEAD < a->n ? a->used + LEAD : a->n; a->asked < upto; a->asked++) {
      __builtin_prefetch (a->at[a->asked], 1, 3);
   }
   n = dict ? PyDict_Copy (o) : PyList_GetSlice (o, 0, PY_SSIZE_T_MAX);
   if (!n || plan == Py_None) {
      return n;
   }
   np = PyTuple_Size (plan);
   for (i = 0; i + 1 < np; i += 2) {
      PyObject *at = PyTuple_GetItem (plan, i), *child, *c;
      int r;

      if (dict) {
         child = PyDict_GetItemWithError (o, at);
      } else {
         child = PyList_GetItem (o, PyLong_AsSsize_t (at));
      }
      if (!child || !(c = copy_node (child, PyTuple_GetItem (plan, i + 1), a))) {
         if (!PyErr_Occurred ()) {
            PyErr_SetString (PyExc_RuntimeError, "a template lost a container");
         }
         Py_DECREF (n);
         return NULL;
      }
      if (dict) {
         r = PyDict_SetItem (n, at, c);
         Py_DECREF (c);
      } else {
         r = PyList_SetItem (n, PyLong_AsSsize_t (at), c); /* steals c */
      }
      if (r < 0) {
         Py_DECREF (n);
         return NULL;
      }
   }
   return n;
}

PyObject *
cqc_template_copy (PyObject *tpl)
{
   PyObject *lines = PyTuple_GetItem (tpl, 2);
   ahead_t a = {(const void *const *) PyBytes_AsString (lines), 0, 0, 0};

   a.n = (size_t) PyBytes_Size (lines) / sizeof *a.at;
   return copy_node (PyTuple_GetItem (tpl, 0), PyTuple_GetItem (tpl, 1), &a);
}

/* ======================================================================== */
/* The store                                                                */
/* ======================================================================== */

/* A way holds a template (a tuple), or stands for an entry of the key that
 * has none: NO_TEMPLATE (its objects cannot be one) or CANDIDATE (hit fewer
 * than HITS_BEFORE_TEMPLATE times so far). */
#define NO_TEMPLATE Py_None
#define CANDIDATE Py_Ellipsis
/* An entry gets its template on this process's g_hits_before_template-th
 * hit of it (each built until then; 4, or what _native._template_hits set
 * for the tests): a template costs this process several times the entry's
 * bytes, which pays when the entry is hit again and again (docs/benchmarks.md
 * measured what a lower count costs a group of workers reading a hot set
 * larger than their budgets). */
static uint32_t g_hits_before_template = 4;

typedef struct {
   cqc_entry_id_t id;
   uint64_t value_hash;
   PyObject *tpl; /* NULL: an empty way; else a template, NO_TEMPLATE or CANDIDATE */
   size_t bytes;
   int kind;
   uint32_t hits; /* a CANDIDATE's hits so far */
   bool ref;      /* hit since the clock hand last passed */
} way_t;

struct cqc_templates {
   way_t *ways;
   uint32_t mask; /* sets - 1 */
   uint32_t hand; /* the clock hand, over every way */
   uint32_t tick;
   size_t bytes, limit;
   cqc_live_fn live;
   const void *arena;
   uint64_t count, hits, evicted, released, declined;
   int busy;    /* adds under way: they may run Python code */
   bool closed; /* cqc_templates_close during an add: freed when it ends */
};

static bool
is_template (const way_t *w)
{
   return w->tpl && w->tpl != NO_TEMPLATE && w->tpl != CANDIDATE;
}

cqc_templates_t *
cqc_templates_new (size_t limit_bytes, cqc_live_fn live, const void *arena)
{
   cqc_templates_t *t = calloc (1, sizeof *t);
   uint32_t sets = 16;

   /* About one way per 4 KiB of budget. */
   while (sets < 65536 && (size_t) sets * WAYS * 4096 < limit_bytes) {
      sets <<= 1;
   }
   if (!t || !(t->ways = calloc ((size_t) sets * WAYS, sizeof (way_t)))) {
      free (t);
      return NULL;
   }
   t->mask = sets - 1;
   t->limit = limit_bytes;
   t->live = live;
   t->arena = arena;
   return t;
}

/* Empty the way; true if it held a template. */
static bool
release (cqc_templates_t *t, way_t *w)
{
   bool was = is_template (w);

   if (was) {
      t->count--;
   }
   t->bytes -= w->bytes;
   Py_CLEAR (w->tpl);
   w->bytes = 0;
   w->hits = 0;
   return was;
}

static void
templates_free (cqc_templates_t *t)
{
   uint32_t i;

   for (i = 0; i < (t->mask + 1) * WAYS; i++) {
      Py_XDECREF (t->ways[i].tpl);
   }
   free (t->ways);
   free (t);
}

void
cqc_templates_close (cqc_templates_t *t)
{
   if (t && t->busy) {
      t->closed = true;
   } else if (t) {
      templates_free (t);
   }
}

static way_t *
set_of (cqc_templates_t *t, uint64_t key_hash)
{
   return &t->ways[(size_t) ((key_hash >> 17) & t->mask) * WAYS];
}

static bool
same_entry (const cqc_entry_id_t *a, const cqc_entry_id_t *b)
{
   return a->block_off == b->block_off && a->block_gen == b->block_gen &&
          a->val_len == b->val_len && a->sum == b->sum;
}

bool
cqc_templates_find (cqc_templates_t *t, cqc_entry_id_t *id, int kind, PyObject **tpl)
{
   way_t *w = set_of (t, id->key_hash);
   int i;

   for (i = 0; i < WAYS; i++, w++) {
      if (is_template (w) && w->kind == kind && w->id.key_hash == id->key_hash &&
          same_entry (&w->id, id)) {
         w->ref = true;
         w->id.slot = id->slot; /* where the sweep finds it now */
         id->value_hash = w->value_hash;
         *tpl = Py_NewRef (w->tpl);
         return true;
      }
   }
   return false;
}

bool
cqc_templates_prefetch (cqc_templates_t *t, uint64_t key_hash, uint64_t *block_off)
{
   way_t *w = set_of (t, key_hash);
   int i;

   for (i = 0; i < WAYS; i++, w++) {
      if (is_template (w) && w->id.key_hash == key_hash) {
         __builtin_prefetch (w->tpl, 1, 3);
         *block_off = w->id.block_off;
         return true;
      }
   }
   return false;
}

/* Check n ways from the hand on, and release those whose entries are gone
 * or changed. */
static void
sweep (cqc_templates_t *t, int n)
{
   uint32_t total = (t->mask + 1) * WAYS;

   while (n-- > 0) {
      way_t *w = &t->ways[t->hand];
      t->hand = (t->hand + 1) % total;
      if (w->tpl && !t->live (t->arena, &w->id) && release (t, w)) {
         t->released++;
      }
   }
}

void
cqc_templates_served (cqc_templates_t *t)
{
   t->hits++;
   if ((++t->tick & 255u) == 0) {
      sweep (t, 4);
   }
}

/* Free room until the store is within its budget: the clock hand passes
 * templates hit since its last pass (clearing the mark), drops the others. */
static void
make_room (cqc_templates_t *t, const way_t *keep)
{
   uint32_t total = (t->mask + 1) * WAYS, steps = 2 * total;

   while (t->bytes > t->limit && steps-- > 0) {
      way_t *w = &t->ways[t->hand];
      t->hand = (t->hand + 1) % total;
      if (!is_template (w) || w == keep) {
         continue;
      }
      if (w->ref) {
         w->ref = false;
         continue;
      }
      release (t, w);
      t->evicted++;
   }
}

/* A way of the set for a new entry: an empty one, else one not hit since
 * the hand passed (a candidate first), else the first. */
static way_t *
way_for (cqc_templates_t *t, way_t *set)
{
   way_t *w = NULL;
   int i;

   for (i = 0; i < WAYS && !w; i++) {
      w = set[i].tpl ? NULL : &set[i];
   }
   for (i = 0; i < WAYS && !w; i++) {
      w = set[i].tpl == CANDIDATE && !set[i].ref ? &set[i] : NULL;
   }
   for (i = 0; i < WAYS && !w; i++) {
      w = set[i].ref ? NULL : &set[i];
   }
   if (!w) {
      w = &set[0];
   }
   if (w->tpl && release (t, w)) {
      t->evicted++;
   }
   return w;
}

void
cqc_templates_add (cqc_templates_t *t, const cqc_entry_id_t *id, int kind, PyObject *built,
                   uint64_t value_hash)
{
   way_t *set = set_of (t, id->key_hash), *w = NULL;
   PyObject *tpl;
   size_t bytes = 0;
   int i;

   if (value_hash == 0) {
      return;
   }
   for (i = 0; i < WAYS; i++) {
      way_t *x = &set[i];
      if (!x->tpl || x->kind != kind || x->id.key_hash != id->key_hash) {
         continue;
      }
      if (!same_entry (&x->id, id)) {
         if (release (t, x)) { /* the key's older entry */
            t->released++;
         }
         continue;
      }
      if (x->tpl != CANDIDATE) {
         return; /* no template, or one another thread made meanwhile */
      }
      x->ref = true;
      x->id.slot = id->slot;
      if (++x->hits < g_hits_before_template) {
         return;
      }
      w = x;
   }
   if (!w) {
      w = way_for (t, set);
      *w = (way_t){*id, value_hash, Py_NewRef (CANDIDATE), 0, kind, 1, false};
      w->id.held = false;
      if (g_hits_before_template > 1) {
         return;
      }
   }
   /* The entry's g_hits_before_template-th hit: its objects become its
    * template, or it is remembered as having none. Making it may run
    * Python code (__sizeof__, the garbage collector), which may hit this
    * store or close it: the candidate is looked for again afterwards. */
   t->busy++;
   tpl = cqc_template_of (built, &bytes);
   t->busy--;
   if (t->closed) {
      Py_XDECREF (tpl);
      if (!t->busy) {
         templates_free (t);
      }
      return;
   }
   for (i = 0, w = NULL; i < WAYS && !w; i++) {
      way_t *x = &set[i];
      w = x->tpl == CANDIDATE && x->kind == kind && x->id.key_hash == id->key_hash &&
                same_entry (&x->id, id)
             ? x
             : NULL;
   }
   if (!w) {
      Py_XDECREF (tpl);
      return;
   }
   if (!tpl || bytes > t->limit / MAX_SHARE) {
      Py_XDECREF (tpl);
      tpl = Py_NewRef (NO_TEMPLATE);
      bytes = 0;
      t->declined++;
   }
   Py_DECREF (w->tpl);
   w->tpl = tpl;
   w->bytes = bytes;
   w->value_hash = value_hash;
   t->bytes += bytes;
   if (tpl != NO_TEMPLATE) {
      t->count++;
   }
   sweep (t, 8);
   make_room (t, w);
}

void
cqc_templates_stats (const cqc_templates_t *t, cqc_templates_stats_t *out)
{
   memset (out, 0, sizeof *out);
   if (t) {
      out->hits = t->hits;
      out->count = t->count;
      out->bytes = t->bytes;
      out->limit = t->limit;
      out->evicted = t->evicted;
      out->released = t->released;
      out->declined = t->declined;
   }
}

/* ======================================================================== */
/* Private functions for the tests                                          */
/* ======================================================================== */

/* _template(obj) -> the template of obj (a tuple), or None when obj is not
 * one (holds anything but containers and shareable values). */
static PyObject *
mod_template (PyObject *Py_UNUSED (m), PyObject *obj)
{
   size_t bytes;
   PyObject *tpl = cqc_template_of (obj, &bytes);

   return tpl ? tpl : Py_NewRef (Py_None);
}

/* _template_copy(template) -> what a template hit returns. */
static PyObject *
mod_template_copy (PyObject *Py_UNUSED (m), PyObject *tpl)
{
   if (!PyTuple_Check (tpl) || PyTuple_Size (tpl) != 3 || !PyBytes_Check (PyTuple_GetItem (tpl, 2))) {
      PyErr_SetString (PyExc_TypeError, "not a template");
      return NULL;
   }
   return cqc_template_copy (tpl);
}

/* _template_hits(n) -> the previous count: from now on an entry gets its
 * template on this process's n-th hit of it (1 to 1000). */
static PyObject *
mod_template_hits (PyObject *Py_UNUSED (m), PyObject *arg)
{
   long n = PyLong_AsLong (arg);
   uint32_t old = g_hits_before_template;

   if (n == -1 && PyErr_Occurred ()) {
      return NULL;
   }
   if (n < 1 || n > 1000) {
      PyErr_SetString (PyExc_ValueError, "the count is 1 to 1000");
      return NULL;
   }
   g_hits_before_template = (uint32_t) n;
   return PyLong_FromUnsignedLong (old);
}

PyMethodDef cqc_template_methods[] = {
   {"_template_hits", mod_template_hits, METH_O,
    "_template_hits(n): templates from the n-th hit of an entry on; the previous n."},
   {"_template", mod_template, METH_O, "_template(obj): obj's template, or None."},
   {"_template_copy", mod_template_copy, METH_O, "_template_copy(template): a template hit."},
   {NULL, NULL, 0, NULL},
};
