/*
 * build.h - a hit's Python objects, built straight from the cached BSON.
 *
 * A hit used to be copied into a new bytes object and handed to PyMongo's
 * decoder. Under the default codec options (dict documents, tz_aware False,
 * uuid_representation UNSPECIFIED, 'strict' Unicode errors, no tzinfo, an
 * empty type registry, DatetimeConversion.DATETIME) this builder makes the
 * objects itself, from a scratch copy of the entry:
 *
 *   - Equal to PyMongo's in type, value and key order, recursively: the same
 *     conversions (_cbsonmodule.c's get_value), including DBRef documents
 *     ($ref and $id with a str $ref and an absent or str $db), Binary
 *     subtype 0 as bytes, Int64, Decimal128, Regex, Code (with scope),
 *     Timestamp, MinKey and MaxKey. The rare types are made by calling
 *     PyMongo's own classes; the common ones (documents, arrays, strings,
 *     keys, numbers, booleans, ObjectId, datetimes) are made in C.
 *   - It never raises PyMongo's errors itself. Anything it does not take
 *     (a bad length, invalid UTF-8, a datetime outside years 1-9999, an
 *     unknown type, a Binary subtype 3 or 4 that is not 16 bytes, nesting
 *     deeper than PyMongo would go, any exception from a class it calls)
 *     makes it decline, and the same bytes then go to the caller's decoder,
 *     which returns its result or raises its own error. Declining is always
 *     correct; building is only allowed where PyMongo's decoder would
 *     succeed with the same objects. It is stricter than PyMongo (every
 *     element must lie inside its container), never looser.
 *   - Safe on any bytes: every length and offset is checked against the end
 *     of its container before it is used, and nothing is read past the
 *     buffer it was given.
 *
 * Which hits are built: the caller's decoder must be decode_document (a
 * find_one's document) or decode_documents (a find or aggregate entry: a
 * list of documents), which decode them as PyMongo's cursors do, as
 * elements of a reply's batch, or bson._bson_to_dict (the entries of counts
 * and distinct) or bson._decode_all, and its codec options equal to
 * DEFAULT_CODEC_OPTIONS item by
 * item, with the same item types. That verdict is remembered per codec
 * options object (a collection keeps one for its lifetime), so it is taken
 * once per view. Any other decoder or codec options: the entry is copied
 * into a new bytes object and decoded as before.
 *
 * Everything here runs with the GIL held. The state it keeps (PyMongo's
 * classes, the key cache, the scratch buffer, the codec verdicts) is
 * per process and used only under the GIL; a build that calls back into
 * Python (a rare type's class, the garbage collector) may let another
 * thread run a build meanwhile, so nothing here holds a borrowed pointer
 * into that state across such a call (build.c says how, where it matters).
 * docs/architecture.md, "Building a hit", says why each fast path is safe.
 */
#ifndef CQC_BUILD_H
#define CQC_BUILD_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* How a hit becomes the caller's object. */
typedef enum {
   CQC_HIT_DECODE = 0, /* a new bytes object, then decode(bytes, codec) */
   CQC_HIT_ONE = 1,    /* built: one document (as bson._bson_to_dict) */
   CQC_HIT_ALL = 2,    /* built: a list of documents (as bson._decode_all) */
} cqc_hit_how_t;

/* One lookup's copy of its entry, on the caller's stack. */
typedef struct {
   PyObject *decode; /* borrowed: the caller's decoder */
   PyObject *codec;  /* borrowed: the caller's codec options */
   cqc_hit_how_t how;
   bool elements; /* decode is decode_document(s): documents of a batch */
   PyObject *bytes; /* CQC_HIT_DECODE: the copy */
   uint8_t *buf;    /* CQC_HIT_ONE, CQC_HIT_ALL: the copy */
   size_t len;
   bool scratch; /* buf is the process's scratch buffer (else malloc'd) */
} cqc_hit_t;

/* Decide how this lookup's hit is made (the decoder and codec options must
 * outlive the lookup). Never fails: anything unusual means DECODE. */
void cqc_hit_begin (cqc_hit_t *h, PyObject *decode, PyObject *codec);

/* The arena's callbacks (cqc_alloc_fn, cqc_discard_fn): a buffer of len
 * bytes for the copy, NULL (no exception set) if there is no memory; and
 * dropping it. ctx is the cqc_hit_t. */
void *cqc_hit_alloc (void *ctx, size_t len);
void cqc_hit_discard (void *ctx);

/* The caller's object from the copy (a new reference, or NULL with an
 * exception: the decoder's, or a BaseException that is not an Exception
 * raised while building, such as KeyboardInterrupt). Frees the copy. */
PyObject *cqc_hit_finish (cqc_hit_t *h);

/* Build the objects of `len` bytes of BSON: one document (many false) or a
 * list of the documents laid end to end (many true), each as a top-level
 * document (elements false, as bson._bson_to_dict and _decode_all decode
 * them) or as an element of a reply's batch (elements true, as PyMongo's
 * cursors decode them: a DBRef document becomes a DBRef). Returns a new
 * reference; NULL with *declined true and no exception set when the builder
 * does not take these bytes (the caller decodes them with PyMongo); NULL
 * with *declined false and an exception set when the builder is not
 * available or a BaseException that is not an Exception was raised. */
PyObject *cqc_build (const uint8_t *buf, size_t len, bool many, bool elements, bool *declined);

/* The 12 bytes of `oid`, an ObjectId, read from its slot as its `binary`
 * property returns them, without calling the property: a new reference;
 * NULL without an exception when the builder has not verified that the
 * two agree (the caller then reads `binary`), NULL with one when the slot
 * is unset. Does not set the builder up. */
PyObject *cqc_build_objectid_bytes (PyObject *oid);

/* Add the module's functions to m: _native.decoded (a miss's copy for its
 * caller, built as a hit's would be), _native.decode_document and
 * decode_documents (documents decoded as PyMongo's cursors decode a batch's;
 * hits and misses of find_one, find and aggregate use them) and the private
 * ones for tests (_native._build, _build_hit, _build_info, _build_codec_ok).
 * 0, or -1 with an exception. */
int cqc_build_add_functions (PyObject *m);

#endif
