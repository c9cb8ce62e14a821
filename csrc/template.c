/*
 * template.c - templates of hit entries (template.h says what and why).
 *
 * A template is a tuple (tree, program). tree is the template's own copy
 * of the built object's containers, around the built object's values; the
 * program (a capsule, which holds the tree too) lists its containers in
 * the order a copy makes them, each with where it goes in its parent, and
 * the address of every line the copy reads or changes the reference count
 * of, in that order (but for the values every copy touches anyway). A
 * copy makes each container with one PyDict_Copy or list slice (which
 * share the values) and puts it in its parent's copy, asking for the
 * lines of the next containers as it goes: a template not
 * in the CPU's caches (its objects are scattered over the heap, and a hit
 * of an entry not hit recently finds none of them cached) then costs a few
 * memory latencies, not one per object.
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

/* A template's program: its containers in the order a copy makes them
 * (depth first, each before those nested in it), where each goes in the
 * copy of its parent, and the address of every line the copy touches, in
 * the order it touches them. A copy is then a loop over the steps: no
 * Python object is read to find its way. The nodes and keys are borrowed
 * from the tree, which the program holds. */
typedef struct {
   PyObject *node; /* the template's container (a dict or a list) */
   union {
      PyObject *key;    /* its key in its parent dict (keyed) */
      Py_ssize_t index; /* its index in its parent list */
   } at;
   uint32_t lines; /* how many of the program's lines its copy touches */
   uint32_t slot;  /* keyed: its value's offset in its parent's keys table
                    * (value_offset), 0 when the copy uses PyDict_SetItem */
   uint16_t depth; /* 0 for the tree itself, then its parent's + 1 */
   uint8_t dict;   /* a dict, else a list */
   uint8_t keyed;  /* its parent is a dict */
} step_t;

typedef struct cqc_program {
   PyObject *tree; /* held */
   size_t nsteps, nlines;
   step_t *steps;
   const void **lines;
} program_t;

#define PROGRAM_CAPSULE "client_query_cache._native.template"

/* Whether this is a CPython whose dicts and lists are laid out as described
 * here and at storage_of: 3.11 to 3.14. Any other reads none of their
 * fields. */
static bool
layout_known (void)
{
   return Py_Version >= 0x030B0000 && Py_Version < 0x030F0000;
}

/* Where a copy puts a nested container in the copy of its parent dict.
 * That copy is PyDict_Copy's: a clone of the template's keys table, which
 * holds the template's nested container where the copy's must go. The
 * copy replaces it there instead of looking the key up again with
 * PyDict_SetItem (whose lookup and insert code, cold after other work,
 * cost more than the rest of a nested container's copy). The value's
 * offset is read from where CPython 3.11 to 3.14 keep it: a dict's keys
 * table is the fifth word of the object, and a table of str keys is a
 * 32-byte header whose ninth and tenth bytes are the log2 of its slots
 * and of its index bytes, the index, then 16-byte entries (key, value),
 * PyDict_Next's position minus one being an entry's index. Unlike the
 * prefetch hints (storage_of), this writes, so it is done only where
 *  - this interpreter's dicts were found laid out so (layout_holds, once);
 *  - the template's own table has its nested container at that offset
 *    (compile);
 *  - the copy's table has the template's sizes and still holds the
 *    template's nested container there (template_run).
 * Anywhere else the copy uses PyDict_SetItem. A copy is a new dict no other
 * code has seen: no watcher or cached version can miss the write. */
static const uint8_t *
dict_table (PyObject *dict)
{
   return ((const void *const *) dict)[4];
}

/* The offset of entry ix's value in dict's keys table, 0 if the table's
 * header does not describe such an entry. */
static uint32_t
value_offset (PyObject *dict, Py_ssize_t ix)
{
   const uint8_t *keys = dict_table (dict);
   unsigned log2_size = keys[8], log2_index = keys[9];

   if (log2_size < 3 || log2_size > 16 || log2_index < log2_size || log2_index > log2_size + 2 ||
       ix < 0 || ix >= ((Py_ssize_t) 1 << log2_size) * 2 / 3) {
      return 0;
   }
   return (uint32_t) (32 + ((size_t) 1 << log2_index) + (size_t) ix * 16 + 8);
}

static PyObject **
value_at (PyObject *dict, uint32_t offset)
{
   return (PyObject **) (dict_table (dict) + offset);
}

/* Whether this interpreter lays dicts out as value_offset reads them: in a
 * dict of 12 str keys (a table of 32 slots), its first 4 values where
 * value_offset says (offsets under 200 bytes: inside the table however it
 * is laid out). Tested once. */
static bool
layout_holds (void)
{
   static int holds = -1;
   PyObject *d = NULL, *k, *v;
   Py_ssize_t pos = 0;
   int i, found = 0;
   bool ok;

   if (holds >= 0) {
      return holds;
   }
   holds = 0;
   ok = layout_known () && (d = PyDict_New ()) != NULL;
   for (i = 0; ok && i < 12; i++) {
      k = PyUnicode_FromFormat ("k%d", i);
      v = k ? PyLong_FromLong (1000 + i) : NULL;
      ok = v && PyDict_SetItem (d, k, v) == 0;
      Py_XDECREF (k);
      Py_XDECREF (v);
   }
   while (ok && found < 4 && PyDict_Next (d, &pos, &k, &v)) {
      uint32_t off = value_offset (d, pos - 1);
      ok = off && off < 200 && *value_at (d, off) == v;
      found++;
   }
   Py_XDECREF (d);
   PyErr_Clear ();
   holds = ok && found == 4;
   return holds;
}

/* The offset of child's value in the template dict node, where child is
 * at key: 0 when the copy is to use PyDict_SetItem. *pos is PyDict_Next's
 * position, kept between the calls for one node: its nested containers
 * are asked for in the node's order (make_node's plan), so the node's
 * entries are read once in all. */
static uint32_t
child_offset (PyObject *node, PyObject *key, PyObject *child, Py_ssize_t *pos)
{
   PyObject *k, *v;
   uint32_t off;

   if (!layout_holds ()) {
      return 0;
   }
   while (PyDict_Next (node, pos, &k, &v)) {
      if (k == key) {
         off = value_offset (node, *pos - 1);
         return off && *value_at (node, off) == child ? off : 0;
      }
   }
   return 0;
}

/* Where the copy of dict template tmpl holds s's template container, or
 * NULL when the copy is to use PyDict_SetItem. */
static inline PyObject **
child_in_copy (PyObject *copy, PyObject *tmpl, const step_t *s)
{
   const uint8_t *ct, *tt;
   PyObject **at;

   if (!s->slot) {
      return NULL;
   }
   ct = dict_table (copy);
   tt = dict_table (tmpl);
   if (ct[8] != tt[8] || ct[9] != tt[9]) {
      return NULL;
   }
   at = value_at (copy, s->slot);
   return *at == s->node ? at : NULL;
}

/* A growing array (steps or lines) while a program is made. */
typedef struct {
   void *at;
   size_t n, cap, size;
   bool failed;
} grow_t;

static void *
grow (grow_t *g)
{
   if (g->failed) {
      return NULL;
   }
   if (g->n == g->cap) {
      size_t cap = g->cap ? 2 * g->cap : 32;
      void *at = realloc (g->at, cap * g->size);
      if (!at) {
         g->failed = true;
         return NULL;
      }
      g->at = at;
      g->cap = cap;
   }
   return (char *) g->at + g->size * g->n++;
}

static void
line_add (grow_t *lines, const void *p)
{
   const void **at = grow (lines);

   if (at) {
      *at = p;
   }
}

/* A value's line, unless it is one every copy touches anyway (None, the
 * bools, CPython's cached small ints): those stay in the CPU's caches,
 * and asking for them would only delay the next lines. */
static void
value_add (grow_t *lines, PyObject *v)
{
   if (v == Py_None || PyBool_Check (v)) {
      return;
   }
   if (PyLong_CheckExact (v)) {
      int overflow;
      long x = PyLong_AsLongAndOverflow (v, &overflow);
      if (!overflow && x >= -5 && x <= 256) {
         return;
      }
      PyErr_Clear ();
   }
   line_add (lines, v);
}

/* A container's own storage, which a copy reads: a dict's keys table
 * (PyDict_Copy copies it whole), a list's array of items. Their addresses
 * are in the objects' structs, which the limited API does not describe:
 * read from where CPython 3.11 to 3.14 keep them (PyDictObject's ma_keys,
 * PyListObject's ob_item: the fifth and fourth words of the object), as is
 * the size of a keys table (a 32-byte header whose ninth and tenth bytes
 * are the log2 of its slots and of its index bytes, the index, then 2/3 of
 * the slots as entries of a str key and a value: a template's keys are
 * str). A hint only: a prefetch of any address is harmless, so on a
 * CPython laid out otherwise a copy is as correct, only slower. The words
 * read are inside the objects (a dict or a list is larger, a keys table
 * at least its header); on a CPython after 3.14 none is read. */
static const void *
storage_of (PyObject *node, size_t *size)
{
   if (!layout_known ()) {
      *size = 0;
      return node;
   }
   if (PyDict_CheckExact (node)) {
      const uint8_t *keys = dict_table (node);
      size_t slots = (size_t) 1 << (keys[8] & 31), index = (size_t) 1 << (keys[9] & 31);
      size_t bound = 48 + 3 * (size_t) PyDict_Size (node) * sizeof (void *);

      *size = 32 + index + slots * 2 / 3 * 2 * sizeof (void *);
      if (*size > 4 * bound) {
         *size = bound; /* not the layout described above */
      }
      return keys;
   }
   *size = (size_t) PyList_Size (node) * sizeof (void *);
   return ((const void *const *) node)[3];
}

/* The steps and lines of `node` (at `key` or `index` of its parent) and of
 * the containers nested in it, which `plan` (make_node's) names. */
static void
compile (PyObject *node, PyObject *plan, PyObject *key, Py_ssize_t index, uint32_t depth,
         grow_t *steps, grow_t *lines)
{
   bool dict = PyDict_CheckExact (node);
   Py_ssize_t pos = 0, scan = 0, i, n;
   PyObject *k, *v;
   size_t storage, before = lines->n, at = steps->n, off;
   const char *p = storage_of (node, &storage);
   step_t *s = grow (steps);

   if (!s) {
      return;
   }
   *s = (step_t){.node = node, .slot = 0, .depth = (uint16_t) depth, .dict = dict, .keyed = key != NULL};
   if (key) {
      s->at.key = key;
   } else {
      s->at.index = index;
   }
   if (depth == 0) {
      line_add (lines, node); /* a nested one is its parent's value */
   }
   for (off = 0; off < (uintptr_t) p % 64 + storage; off += 64) {
      line_add (lines, p - (uintptr_t) p % 64 + off);
   }
   if (dict) {
      while (PyDict_Next (node, &pos, &k, &v)) {
         value_add (lines, v);
      }
   } else {
      for (i = 0, n = PyList_Size (node); i < n; i++) {
         value_add (lines, PyList_GetItem (node, i));
      }
   }
   if (steps->failed || lines->failed) {
      return;
   }
   ((step_t *) steps->at)[at].lines = (uint32_t) (lines->n - before);
   for (i = 0, n = plan == Py_None ? 0 : PyTuple_Size (plan); i + 1 < n; i += 2) {
      PyObject *where = PyTuple_GetItem (plan, i);
      PyObject *child = dict ? PyDict_GetItem (node, where)
                             : PyList_GetItem (node, PyLong_AsSsize_t (where));
      size_t here = steps->n;
      if (!child) {
         steps->failed = true;
         return;
      }
      compile (child, PyTuple_GetItem (plan, i + 1), dict ? where : NULL,
               dict ? 0 : PyLong_AsSsize_t (where), depth + 1, steps, lines);
      if (dict && !steps->failed && here < steps->n) {
         ((step_t *) steps->at)[here].slot = child_offset (node, where, child, &scan);
      }
   }
}

static void
program_free (PyObject *capsule)
{
   program_t *p = PyCapsule_GetPointer (capsule, PROGRAM_CAPSULE);

   if (p) {
      Py_XDECREF (p->tree);
      free (p);
   }
}

/* The program of `tree` (make_node's, with its plan): a capsule, or NULL
 * (no exception). One block holds it all; *bytes grows by its size. */
static PyObject *
program_of (PyObject *tree, PyObject *plan, size_t *bytes)
{
   grow_t steps = {NULL, 0, 0, sizeof (step_t), false};
   grow_t lines = {NULL, 0, 0, sizeof (const void *), false};
   program_t *p = NULL;
   PyObject *capsule = NULL;
   size_t size;

   compile (tree, plan, NULL, 0, 0, &steps, &lines);
   if (!steps.failed && !lines.failed) {
      size = sizeof *p + steps.n * sizeof (step_t) + lines.n * sizeof (const void *);
      p = malloc (size);
   }
   if (p) {
      p->tree = Py_NewRef (tree);
      p->nsteps = steps.n;
      p->nlines = lines.n;
      /* The header, then the lines (the first a copy asks for are in
       * the header's line and those after it), then the steps. */
      p->lines = (const void **) (p + 1);
      p->steps = (step_t *) (p->lines + lines.n);
      memcpy (p->steps, steps.at, steps.n * sizeof (step_t));
      memcpy (p->lines, lines.at, lines.n * sizeof (const void *));
      if (!(capsule = PyCapsule_New (p, PROGRAM_CAPSULE, program_free))) {
         Py_DECREF (tree);
         free (p);
      } else if (!add_size (capsule, bytes)) {
         Py_CLEAR (capsule);
      } else {
         *bytes += size;
      }
   }
   free (steps.at);
   free (lines.at);
   return capsule;
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
   PyObject *tree, *plan = NULL, *program = NULL, *tpl = NULL;

   *bytes = 0;
   if (!ready () || (!PyDict_CheckExact (built) && !PyList_CheckExact (built))) {
      return NULL;
   }
   tree = make_node (built, 0, bytes, &plan);
   if (tree) {
      program = program_of (tree, plan, bytes);
   }
   if (program) {
      tpl = PyTuple_Pack (2, tree, program);
   }
   Py_XDECREF (tree);
   Py_XDECREF (plan);
   Py_XDECREF (program);
   PyErr_Clear ();
   return tpl;
}

/* Lines asked for beyond those of the container being copied: enough to
 * keep the CPU's outstanding misses busy while it copies. */
#define LEAD 32

/* The program's first lines: its header and first lines to ask for. */
#define HEAD_LINES 4

void
cqc_template_prefetch (const program_t *p)
{
   size_t i, n = p->nlines < LEAD ? p->nlines : LEAD;

   __builtin_prefetch (p->steps, 0, 3);
   for (i = 0; i < n; i++) {
      __builtin_prefetch (p->lines[i], 1, 3);
   }
}

PyObject *
cqc_template_copy (PyObject *tpl)
{
   return cqc_template_run (PyCapsule_GetPointer (PyTuple_GetItem (tpl, 1), PROGRAM_CAPSULE));
}

PyObject *
cqc_template_run (const program_t *p)
{
   /* The copy of each depth's container on the way to the current one
    * (borrowed: each is held by the one above it, the first by root). */
   PyObject *path[MAX_DEPTH + 2], *root = NULL;
   /* The template's container at each depth of that way. */
   PyObject *tpath[MAX_DEPTH + 2];
   size_t k, used = 0, asked = 0, upto;

   for (k = 0; p && k < p->nsteps; k++) {
      const step_t *s = &p->steps[k];
      PyObject *c;
      int r = 0;

      /* This container's lines and LEAD more: the loads of what comes next
       * overlap the copy of what is here. */
      used += s->lines;
      for (upto = used + LEAD < p->nlines ? used + LEAD : p->nlines; asked < upto; asked++) {
         __builtin_prefetch (p->lines[asked], 1, 3);
      }
      c = s->dict ? PyDict_Copy (s->node) : PyList_GetSlice (s->node, 0, PY_SSIZE_T_MAX);
      if (!c) {
         break;
      }
      if (k == 0) {
         root = c;
      } else if (s->keyed) {
         PyObject **at = child_in_copy (path[s->depth - 1], tpath[s->depth - 1], s);
         if (at) {
            *at = c; /* the reference the clone took to s->node goes */
            Py_DECREF (s->node);
         } else {
            r = PyDict_SetItem (path[s->depth - 1], s->at.key, c);
            Py_DECREF (c);
         }
      } else {
         r = PyList_SetItem (path[s->depth - 1], s->at.index, c); /* steals c */
      }
      if (r < 0) {
         break;
      }
      path[s->depth] = c;
      tpath[s->depth] = s->node;
   }
   if (!p || k < p->nsteps) {
      Py_XDECREF (root);
      return NULL;
   }
   return root;
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
   uint32_t hits;          /* a CANDIDATE's hits so far */
   bool ref;               /* hit since the clock hand last passed */
   const program_t *prog;  /* a template's program (in tpl) */
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
   w->prog = NULL;
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
cqc_templates_find (cqc_templates_t *t, cqc_entry_id_t *id, int kind, PyObject **tpl,
                    const program_t **program)
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
         *program = w->prog;
         return true;
      }
   }
   return false;
}

void
cqc_templates_prefetch_set (const cqc_templates_t *t, uint64_t key_hash)
{
   const char *set = (const char *) &t->ways[(size_t) ((key_hash >> 17) & t->mask) * WAYS];
   size_t off;

   for (off = 0; off < WAYS * sizeof (way_t); off += 64) {
      __builtin_prefetch (set + off, 0, 3);
   }
}

const program_t *
cqc_templates_prefetch (cqc_templates_t *t, uint64_t key_hash, uint64_t *block_off)
{
   way_t *w = set_of (t, key_hash);
   int i, l;

   for (i = 0; i < WAYS; i++, w++) {
      if (is_template (w) && w->id.key_hash == key_hash) {
         __builtin_prefetch (w->tpl, 1, 3);
         for (l = 0; l < HEAD_LINES; l++) {
            __builtin_prefetch ((const char *) w->prog + 64 * l, 0, 3);
         }
         *block_off = w->id.block_off;
         return w->prog;
      }
   }
   return NULL;
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
      *w = (way_t){*id, value_hash, Py_NewRef (CANDIDATE), 0, kind, 1, false, NULL};
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
   w->prog = tpl != NO_TEMPLATE
                ? PyCapsule_GetPointer (PyTuple_GetItem (tpl, 1), PROGRAM_CAPSULE)
                : NULL;
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

/* _template_copy(template) -> what a template hit returns. Only a tuple
 * whose program is a template's (its capsule, which no Python code makes)
 * is taken: the program's addresses are those of its own tree. */
static PyObject *
mod_template_copy (PyObject *Py_UNUSED (m), PyObject *tpl)
{
   if (!PyTuple_CheckExact (tpl) || PyTuple_Size (tpl) != 2 ||
       !PyCapsule_IsValid (PyTuple_GetItem (tpl, 1), PROGRAM_CAPSULE)) {
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
