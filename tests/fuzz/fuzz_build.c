/*
 * fuzz_build.c - the document builder of hits (build.c) against PyMongo's
 * decoder, on arbitrary bytes, in an embedded interpreter.
 *
 * Input: one byte of mode, then the entry's bytes.
 *   mode & 1   one document (as bson._bson_to_dict reads it), else a list
 *              of documents end to end (as bson._decode_all)
 *   mode & 2   as elements of a reply's batch, as PyMongo's cursors decode
 *              documents (the cache's decode_document and decode_documents,
 *              against tests/bson_strict.py's as_batch_elements)
 *
 * Per input, with the entry copied into a buffer of exactly its size (so
 * that ASan sees any read past it):
 *   - cqc_build either declines, or returns objects; then PyMongo's decoder
 *     must succeed on the same bytes and its objects be the same in type,
 *     value and key order, recursively (tests/bson_strict.py's
 *     strict_difference);
 *   - a hit's steps (cqc_hit_begin, cqc_hit_alloc, cqc_hit_finish) return
 *     what the decoder returns, or raise the same exception class with the
 *     same message;
 *   - when what the hit returned can be a template (template.h), a hit
 *     served from it returns the same objects again, sharing no container
 *     with the first;
 *   - nothing but an Exception is ever raised, and never by cqc_build.
 *
 * Set-up (once): PYTHONMALLOC=malloc (every object allocation goes through
 * ASan), the interpreter started, bson and bson_strict imported (.ci/fuzz
 * puts the environment's site-packages and tests/ on PYTHONPATH), the
 * builder's functions added to a module of their own, and the builder
 * checked to be ready with its fast paths on.
 */
#include "build.h"
#include "template.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_CHECK(cond, ...)                                                 \
   do {                                                                       \
      if (!(cond)) {                                                          \
         fprintf (stderr, "fuzz check failed at %s:%d: %s: ", __FILE__,       \
                  __LINE__, #cond);                                           \
         fprintf (stderr, __VA_ARGS__);                                       \
         fputc ('\n', stderr);                                                \
         if (PyErr_Occurred ()) {                                             \
            PyErr_Print ();                                                   \
         }                                                                    \
         abort ();                                                            \
      }                                                                       \
   } while (0)

static PyObject *g_decode_one, *g_decode_all, *g_codec, *g_difference, *g_batch;
static PyObject *g_doc_one, *g_doc_all; /* the module's decode_document(s) */

static PyObject *
attr_of (const char *module, const char *name)
{
   PyObject *m = PyImport_ImportModule (module);
   PyObject *v = m ? PyObject_GetAttrString (m, name) : NULL;
   Py_XDECREF (m);
   FUZZ_CHECK (v, "cannot import %s.%s (is PYTHONPATH set as .ci/fuzz sets it?)", module, name);
   return v;
}

int
LLVMFuzzerInitialize (int *argc, char ***argv)
{
   PyObject *info, *v, *mod;
   (void) argc;
   (void) argv;

   setenv ("PYTHONMALLOC", "malloc", 1);
   setenv ("PYTHONDONTWRITEBYTECODE", "1", 1);
   Py_Initialize ();
   g_decode_one = attr_of ("bson", "_bson_to_dict");
   g_decode_all = attr_of ("bson", "_decode_all");
   g_codec = attr_of ("bson.codec_options", "DEFAULT_CODEC_OPTIONS");
   g_difference = attr_of ("bson_strict", "strict_difference");
   g_batch = attr_of ("bson_strict", "as_batch_elements");
   mod = PyModule_New ("fuzz_native");
   FUZZ_CHECK (mod && cqc_build_add_functions (mod) == 0, "cannot add the builder's functions");
   g_doc_one = PyObject_GetAttrString (mod, "decode_document");
   g_doc_all = PyObject_GetAttrString (mod, "decode_documents");
   FUZZ_CHECK (g_doc_one && g_doc_all, "no decode_document(s)");
   info = PyObject_CallMethod (mod, "_build_info", NULL);
   FUZZ_CHECK (info, "_build_info failed");
   v = PyDict_GetItemString (info, "ready");
   FUZZ_CHECK (v == Py_True, "the builder is not ready");
   v = PyDict_GetItemString (info, "objectid_fast");
   FUZZ_CHECK (v == Py_True, "the ObjectId fast path is off");
   v = PyDict_GetItemString (info, "datetime");
   FUZZ_CHECK (v && PyUnicode_CompareWithASCIIString (v, "capi") == 0, "datetimes are not made through the capsule");
   Py_DECREF (info);
   return 0;
}

/* The outcome of a call: its result, or NULL with *exc the exception
 * (normalized), taken out of the error indicator. */
static PyObject *
taken (PyObject *res, PyObject **exc)
{
   *exc = NULL;
   if (!res) {
      PyObject *type, *value, *tb;
      PyErr_Fetch (&type, &value, &tb);
      PyErr_NormalizeException (&type, &value, &tb);
      FUZZ_CHECK (value, "a call failed without an exception");
      FUZZ_CHECK (PyErr_GivenExceptionMatches (type, PyExc_Exception),
                  "something other than an Exception was raised");
      *exc = value;
      Py_XDECREF (type);
      Py_XDECREF (tb);
   }
   return res;
}

/* Whether a and b are the same in type, value and key order. */
static void
check_same (PyObject *a, PyObject *b, const char *what)
{
   PyObject *d = PyObject_CallFunctionObjArgs (g_difference, a, b, NULL);
   FUZZ_CHECK (d, "strict_difference failed (%s)", what);
   if (d != Py_None) {
      const char *s = PyUnicode_AsUTF8 (d);
      FUZZ_CHECK (0, "%s differ from PyMongo's: %s", what, s ? s : "?");
   }
   Py_DECREF (d);
}

/* Same class and same message. */
static void
check_same_error (PyObject *a, PyObject *b)
{
   PyObject *sa = PyObject_Str (a), *sb = PyObject_Str (b);
   FUZZ_CHECK (Py_TYPE (a) == Py_TYPE (b), "a hit raised another class than PyMongo");
   FUZZ_CHECK (sa && sb && PyObject_RichCompareBool (sa, sb, Py_EQ) == 1,
               "a hit raised another message than PyMongo: %s / %s",
               sa ? PyUnicode_AsUTF8 (sa) : "?", sb ? PyUnicode_AsUTF8 (sb) : "?");
   Py_XDECREF (sa);
   Py_XDECREF (sb);
}

int
LLVMFuzzerTestOneInput (const uint8_t *data, size_t size)
{
   bool one, elements, declined;
   uint8_t *buf;
   size_t n;
   PyObject *decode, *bytes, *want, *want_exc, *built, *hit, *hit_exc;
   cqc_hit_t h;
   void *dst;

   if (size < 1 || size > 65536) {
      return 0;
   }
   one = data[0] & 1;
   elements = (data[0] & 2) != 0;
   n = size - 1;
   buf = malloc (n ? n : 1);
   FUZZ_CHECK (buf, "out of memory");
   memcpy (buf, data + 1, n);
   decode = elements ? (one ? g_doc_one : g_doc_all) : one ? g_decode_one : g_decode_all;

   bytes = PyBytes_FromStringAndSize ((const char *) buf, (Py_ssize_t) n);
   FUZZ_CHECK (bytes, "bytes");
   want = elements ? PyObject_CallFunctionObjArgs (g_batch, bytes, g_codec, one ? Py_False : Py_True, NULL)
                   : PyObject_CallFunctionObjArgs (decode, bytes, g_codec, NULL);
   want = taken (want, &want_exc);

   built = cqc_build (buf, n, !one, elements, &declined);
   FUZZ_CHECK (built || declined, "cqc_build raised instead of declining");
   FUZZ_CHECK (!PyErr_Occurred (), "cqc_build left an exception set");
   if (built) {
      FUZZ_CHECK (want, "the builder built what PyMongo refuses");
      check_same (built, want, "built objects");
   }

   cqc_hit_begin (&h, decode, g_codec);
   FUZZ_CHECK (h.how == (one ? CQC_HIT_ONE : CQC_HIT_ALL), "the builder does not take this hit");
   dst = cqc_hit_alloc (&h, n);
   FUZZ_CHECK (dst, "no buffer for the copy");
   memcpy (dst, buf, n);
   hit = taken (cqc_hit_finish (&h), &hit_exc);
   if (want) {
      size_t tbytes;
      PyObject *tpl, *copy;
      FUZZ_CHECK (hit, "a hit raised where PyMongo returns");
      check_same (hit, want, "a hit's objects");
      if ((tpl = cqc_template_of (hit, &tbytes))) {
         copy = cqc_template_copy (tpl);
         FUZZ_CHECK (copy, "a template's copy failed");
         FUZZ_CHECK (copy != hit && copy != PyTuple_GetItem (tpl, 0), "a template hit shares its container");
         check_same (copy, want, "a template hit's objects");
         Py_DECREF (copy);
         Py_DECREF (tpl);
      }
      FUZZ_CHECK (!PyErr_Occurred (), "a template left an exception set");
   } else {
      FUZZ_CHECK (!hit, "a hit returned where PyMongo raises");
      check_same_error (hit_exc, want_exc);
   }

   Py_XDECREF (hit);
   Py_XDECREF (hit_exc);
   Py_XDECREF (built);
   Py_XDECREF (want);
   Py_XDECREF (want_exc);
   Py_DECREF (bytes);
   free (buf);
   return 0;
}
