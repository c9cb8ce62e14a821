/*
 * build.c - a hit's Python objects, built straight from the cached BSON
 * (build.h states the contract: equal to PyMongo's decoder or declined).
 *
 * Sections: the state and its lazy set-up (PyMongo's classes, the two fast
 * constructors checked against PyMongo at set-up), codec verdicts, the key
 * cache, values, documents and arrays, the entry point, a lookup's copy, and
 * the private functions the tests call.
 *
 * Convention inside the builder: a function that makes an object returns a
 * new reference, or NULL. NULL without an exception means "declined" (the
 * bytes are not what this builder takes); NULL with an exception means a
 * call into Python failed. cqc_build sorts the two out at the top: an
 * Exception is cleared and counts as declined (PyMongo's decoder then says
 * what it thinks of the bytes), anything else (KeyboardInterrupt) is raised.
 */
#include "build.h"
#include "le.h"

#include <stdlib.h>
#include <string.h>

/* ======================================================================== */
/* State                                                                    */
/* ======================================================================== */

/* The prefix of CPython's PyDateTime_CAPI (Include/datetime.h), which the
 * limited API does not expose: six pointers, then the two constructors used
 * here. The prefix has been the same since 3.7 (later members are appended
 * after it); set_up_datetime checks it before the first call through it. */
typedef struct {
   PyTypeObject *DateType;
   PyTypeObject *DateTimeType;
   PyTypeObject *TimeType;
   PyTypeObject *DeltaType;
   PyTypeObject *TZInfoType;
   PyObject *TimeZone_UTC;
   PyObject *(*Date_FromDate) (int, int, int, PyTypeObject *);
   PyObject *(*DateTime_FromDateAndTime) (int, int, int, int, int, int, int, PyObject *,
                                          PyTypeObject *);
} dt_capi_t;

/* How datetimes are made, best first; the set-up picks the best one whose
 * objects equal PyMongo's for a set of sample instants. */
typedef enum {
   DT_DECLINE = 0, /* neither matched: a document with a datetime is declined */
   DT_CALL = 1,    /* datetime.datetime(y, m, d, H, M, S, us) through a call */
   DT_CAPI = 2,    /* the capsule's DateTime_FromDateAndTime */
} dt_mode_t;

enum { NOT_SET_UP = 0, READY = 1, SETTING_UP = 2, UNAVAILABLE = 3 };

static struct {
   int status;
   PyObject *decode_one;    /* bson._bson_to_dict */
   PyObject *decode_all;    /* bson._decode_all */
   PyObject *default_codec; /* bson.codec_options.DEFAULT_CODEC_OPTIONS */
   PyObject *objectid, *binary, *dbref, *code, *regex, *timestamp, *int64, *from_bid, *minkey,
      *maxkey, *datetime;
   PyObject *empty_tuple;
   PyObject *s_ref, *s_id, *s_db; /* "$ref", "$id", "$db" */
   /* ObjectId without its Python __init__: object.__new__, then its one
    * slot set through the slot's member descriptor (set_up_objectid). */
   bool oid_fast;
   newfunc oid_new;
   PyObject *oid_slot;
   descrsetfunc oid_set;
   descrgetfunc oid_get;
   dt_mode_t dt_mode;
   const dt_capi_t *dt_capi;
} g;

/* The bounds of datetime.datetime (years 1 to 9999) in BSON milliseconds:
 * PyMongo's decoder raises outside them, so the builder declines. */
#define MILLIS_MIN (-62135596800000LL)
#define MILLIS_MAX 253402300799999LL

/* Deepest nesting (in recursion levels, below) the builder follows before
 * it declines, whatever the interpreter's recursion limit: a bound on its
 * own C stack. */
#define MAX_LEVEL 200

static PyObject *
import_attr (const char *module, const char *name)
{
   PyObject *m = PyImport_ImportModule (module);
   PyObject *v = m ? PyObject_GetAttrString (m, name) : NULL;
   Py_XDECREF (m);
   return v;
}

/* ======================================================================== */
/* Datetimes                                                                */
/* ======================================================================== */

/* Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's
 * civil_from_days); z is within the bounds of MILLIS_MIN and MILLIS_MAX. */
static void
civil_from_days (int64_t z, int *year, int *month, int *day)
{
   int64_t era, y;
   uint32_t doe, yoe, doy, mp;

   z += 719468;
   era = (z >= 0 ? z : z - 146096) / 146097;
   doe = (uint32_t) (z - era * 146097);
   yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
   y = (int64_t) yoe + era * 400;
   doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
   mp = (5 * doy + 2) / 153;
   *day = (int) (doy - (153 * mp + 2) / 5 + 1);
   *month = (int) (mp < 10 ? mp + 3 : mp - 9);
   *year = (int) (y + (*month <= 2));
}

/* The naive datetime PyMongo's decoder makes of `millis` (UTC), by `mode`;
 * NULL without an exception outside years 1-9999 or when declining. */
static PyObject *
datetime_by (dt_mode_t mode, int64_t millis)
{
   int64_t ms, secs, days, rem;
   int y, mo, d;

   if (millis < MILLIS_MIN || millis > MILLIS_MAX || mode == DT_DECLINE) {
      return NULL;
   }
   /* Floor division, as PyMongo's datetime_from_millis does it. */
   ms = ((millis % 1000) + 1000) % 1000;
   secs = (millis - ms) / 1000;
   rem = ((secs % 86400) + 86400) % 86400;
   days = (secs - rem) / 86400;
   civil_from_days (days, &y, &mo, &d);
   if (mode == DT_CAPI) {
      return g.dt_capi->DateTime_FromDateAndTime (y, mo, d, (int) (rem / 3600),
                                                  (int) (rem / 60 % 60), (int) (rem % 60),
                                                  (int) ms * 1000, Py_None,
                                                  g.dt_capi->DateTimeType);
   }
   return PyObject_CallFunction (g.datetime, "iiiiiii", y, mo, d, (int) (rem / 3600),
                                 (int) (rem / 60 % 60), (int) (rem % 60), (int) ms * 1000);
}

/* Whether `mode` makes, for each sample instant, an object of the same
 * type, equal and with the same repr as PyMongo's decoder makes of
 * {"d": <UTC datetime millis>}. */
static bool __attribute__ ((cold))
datetime_mode_matches (dt_mode_t mode)
{
   static const int64_t samples[] = {
      0,          -1,          1,          MILLIS_MIN,   MILLIS_MAX,    951782400000LL,
      -2203891200001LL, 1767225600123LL, 4107542399999LL, -62135596799999LL, 86399999LL};
   uint8_t doc[16] = {16, 0, 0, 0, 9, 'd', 0};
   size_t i;
   bool ok = true;

   for (i = 0; ok && i < sizeof samples / sizeof samples[0]; i++) {
      uint64_t u = (uint64_t) samples[i];
      PyObject *bytes, *want = NULL, *got, *w = NULL, *rw = NULL, *rg = NULL;
      int k;

      for (k = 0; k < 8; k++) {
         doc[7 + k] = (uint8_t) (u >> (8 * k));
      }
      doc[15] = 0;
      bytes = PyBytes_FromStringAndSize ((const char *) doc, sizeof doc);
      if (bytes) {
         want = PyObject_CallFunctionObjArgs (g.decode_one, bytes, g.default_codec, NULL);
         Py_DECREF (bytes);
      }
      w = want && PyDict_Check (want) ? PyDict_GetItemString (want, "d") : NULL;
      got = datetime_by (mode, samples[i]);
      rw = w ? PyObject_Repr (w) : NULL;
      rg = got ? PyObject_Repr (got) : NULL;
      ok = w && got && rw && rg && Py_TYPE (w) == Py_TYPE (got) &&
           PyObject_RichCompareBool (w, got, Py_EQ) == 1 &&
           PyObject_RichCompareBool (rw, rg, Py_EQ) == 1;
      Py_XDECREF (want);
      Py_XDECREF (got);
      Py_XDECREF (rw);
      Py_XDECREF (rg);
   }
   PyErr_Clear ();
   return ok;
}

/* Pick the datetime mode. The capsule is used only when its six type and
 * singleton pointers are the datetime module's own objects (so the prefix
 * is laid out as dt_capi_t says) and its constructor's objects match
 * PyMongo's; otherwise datetimes are made by calling the class. */
static void __attribute__ ((cold))
set_up_datetime (void)
{
   static const char *const names[] = {"date", "datetime", "time", "timedelta", "tzinfo"};
   const dt_capi_t *capi = PyCapsule_Import ("datetime.datetime_CAPI", 0);
   PyObject *mod = PyImport_ImportModule ("datetime");
   PyObject *utc = mod ? import_attr ("datetime", "timezone") : NULL;
   PyObject *utc_obj = utc ? PyObject_GetAttrString (utc, "utc") : NULL;
   bool layout = capi && mod && utc_obj && capi->TimeZone_UTC == utc_obj;
   size_t i;

   for (i = 0; layout && i < 5; i++) {
      PyObject *t = PyObject_GetAttrString (mod, names[i]);
      PyTypeObject *mine[] = {capi->DateType, capi->DateTimeType, capi->TimeType,
                              capi->DeltaType, capi->TZInfoType};
      layout = t && (PyTypeObject *) t == mine[i];
      Py_XDECREF (t);
   }
   Py_XDECREF (mod);
   Py_XDECREF (utc);
   Py_XDECREF (utc_obj);
   PyErr_Clear ();
   g.dt_capi = capi;
   g.dt_mode = DT_DECLINE;
   if (layout && capi->DateTime_FromDateAndTime && datetime_mode_matches (DT_CAPI)) {
      g.dt_mode = DT_CAPI;
   } else if (datetime_mode_matches (DT_CALL)) {
      g.dt_mode = DT_CALL;
   }
}

/* ======================================================================== */
/* ObjectId                                                                 */
/* ======================================================================== */

static PyObject *
objectid_by (bool fast, const uint8_t *p)
{
   PyObject *bytes = PyBytes_FromStringAndSize ((const char *) p, 12);
   PyObject *oid;

   if (!bytes) {
      return NULL;
   }
   if (!fast) {
      oid = PyObject_CallFunctionObjArgs (g.objectid, bytes, NULL);
   } else if ((oid = g.oid_new ((PyTypeObject *) g.objectid, g.empty_tuple, NULL)) &&
              g.oid_set (g.oid_slot, oid, bytes) < 0) {
      Py_CLEAR (oid);
   }
   Py_DECREF (bytes);
   return oid;
}

/* Whether two objects have the same type and are equal, with equal
 * results for each of the named methods or attributes (NULL-ended). */
static bool
same_by (PyObject *a, PyObject *b, const char *const *attrs)
{
   bool ok = a && b && Py_TYPE (a) == Py_TYPE (b) && PyObject_RichCompareBool (a, b, Py_EQ) == 1;

   for (; ok && *attrs; attrs++) {
      PyObject *x = PyObject_GetAttrString (a, *attrs);
      PyObject *y = x ? PyObject_GetAttrString (b, *attrs) : NULL;
      PyObject *cx = x && PyCallable_Check (x) ? PyObject_CallNoArgs (x) : Py_XNewRef (x);
      PyObject *cy = y && PyCallable_Check (y) ? PyObject_CallNoArgs (y) : Py_XNewRef (y);
      ok = cx && cy && PyObject_RichCompareBool (cx, cy, Py_EQ) == 1;
      Py_XDECREF (x);
      Py_XDECREF (y);
      Py_XDECREF (cx);
      Py_XDECREF (cy);
   }
   return ok;
}

/* Whether reading ObjectId `oid`'s slot gives what its `binary` gives
 * (cqc_build_objectid_bytes reads the slot). */
static bool __attribute__ ((cold))
slot_is_binary (PyObject *oid)
{
   PyObject *slot = oid ? g.oid_get (g.oid_slot, oid, g.objectid) : NULL;
   PyObject *binary = oid ? PyObject_GetAttrString (oid, "binary") : NULL;
   bool same = slot && binary && PyBytes_CheckExact (slot) && PyBytes_Size (slot) == 12 &&
               PyObject_RichCompareBool (slot, binary, Py_EQ) == 1;

   Py_XDECREF (slot);
   Py_XDECREF (binary);
   return same;
}

/* ObjectId(b) runs a Python __init__ that, for 12 bytes, only stores them
 * in the one slot the class declares (__slots__ = ("__id",)). The fast
 * path makes the object as object.__new__ does and stores the bytes
 * through that slot's descriptor. It is used only if the class still looks
 * like that (__new__ is object's, the slot is a member descriptor, no
 * instance __dict__) and an object made so is indistinguishable from
 * ObjectId(b): same type, equal, same binary, repr, hash and state. The
 * slot is then read in place of `binary` too (cqc_build_objectid_bytes). */
static void __attribute__ ((cold))
set_up_objectid (void)
{
   static const uint8_t sample[12] = {0x65, 0x01, 0x02, 0x03, 0x04, 0x05,
                                      0x06, 0x07, 0x08, 0x09, 0x0a, 0xfb};
   static const char *const attrs[] = {"binary", "__repr__", "__hash__", "__getstate__",
                                       "__str__", NULL};
   PyObject *new_of_oid = PyObject_GetAttrString (g.objectid, "__new__");
   PyObject *new_of_obj = PyObject_GetAttrString ((PyObject *) &PyBaseObject_Type, "__new__");
   PyObject *slots = PyObject_GetAttrString (g.objectid, "__slots__");
   PyObject *a = NULL, *b = NULL;

   g.oid_fast = false;
   g.oid_slot = PyObject_GetAttrString (g.objectid, "_ObjectId__id");
   g.oid_new = (newfunc) PyType_GetSlot ((PyTypeObject *) g.objectid, Py_tp_new);
   g.oid_set = g.oid_slot
                  ? (descrsetfunc) PyType_GetSlot (Py_TYPE (g.oid_slot), Py_tp_descr_set)
                  : NULL;
   g.oid_get = g.oid_slot
                  ? (descrgetfunc) PyType_GetSlot (Py_TYPE (g.oid_slot), Py_tp_descr_get)
                  : NULL;
   if (new_of_oid && new_of_oid == new_of_obj && slots && PyTuple_Check (slots) &&
       PyTuple_Size (slots) == 1 && g.oid_new && g.oid_set && g.oid_get) {
      a = objectid_by (true, sample);
      b = objectid_by (false, sample);
      g.oid_fast = same_by (a, b, attrs) && !PyObject_HasAttrString (a, "__dict__") &&
                   slot_is_binary (b);
   }
   Py_XDECREF (new_of_oid);
   Py_XDECREF (new_of_obj);
   Py_XDECREF (slots);
   Py_XDECREF (a);
   Py_XDECREF (b);
   PyErr_Clear ();
}

PyObject *
cqc_build_objectid_bytes (PyObject *oid)
{
   if (g.status != READY || !g.oid_fast || Py_TYPE (oid) != (PyTypeObject *) g.objectid) {
      return NULL;
   }
   return g.oid_get (g.oid_slot, oid, g.objectid);
}

/* ======================================================================== */
/* Set-up                                                                   */
/* ======================================================================== */

static PyObject *build_entry (const uint8_t *buf, size_t len, bool many, bool elements,
                              bool *declined);

/* A document of every type the builder makes (built by bson.encode, with
 * undefined, symbol, DBPointer and an old binary appended by hand):
 *   {f: -1.5, s: "hé", d: {a: 1, $ref: 2}, l: [true, null], b0: Binary
 *    subtype 0, b1: subtype 1, u: subtype 4 of 16 bytes, o: ObjectId,
 *    t: 1969-07-20T20:17:40.001, r: /^x/imsulx, c: Code, cs: Code with
 *    scope {v: Int64}, i: -2, ts: Timestamp(3, 4), l64: Int64, m:
 *    Decimal128, mn: MinKey, mx: MaxKey, ref: DBRef("c", 1, "db", x=1),
 *    un: undefined, sy: symbol, dp: DBPointer, ob: subtype 2} */
static const uint8_t canary[] = {
   0x5c, 0x01, 0x00, 0x00, 0x01, 0x66, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xf8, 0xbf,
   0x02, 0x73, 0x00, 0x04, 0x00, 0x00, 0x00, 0x68, 0xc3, 0xa9, 0x00, 0x03, 0x64, 0x00, 0x16,
   0x00, 0x00, 0x00, 0x10, 0x61, 0x00, 0x01, 0x00, 0x00, 0x00, 0x10, 0x24, 0x72, 0x65, 0x66,
   0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x04, 0x6c, 0x00, 0x0c, 0x00, 0x00, 0x00, 0x08, 0x30,
   0x00, 0x01, 0x0a, 0x31, 0x00, 0x00, 0x05, 0x62, 0x30, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00,
   0x01, 0x05, 0x62, 0x31, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x02, 0x05, 0x75, 0x00, 0x10,
   0x00, 0x00, 0x00, 0x04, 0x03, 0x03, 0x03, 0x03, 0x03, 0x03, 0x03, 0x03, 0x03, 0x03, 0x03,
   0x03, 0x03, 0x03, 0x03, 0x03, 0x07, 0x6f, 0x00, 0x30, 0x31, 0x32, 0x33, 0x34, 0x35, 0x36,
   0x37, 0x38, 0x39, 0x61, 0x62, 0x09, 0x74, 0x00, 0xa1, 0x82, 0xa1, 0xb2, 0xfc, 0xff, 0xff,
   0xff, 0x0b, 0x72, 0x00, 0x5e, 0x78, 0x00, 0x69, 0x6c, 0x6d, 0x73, 0x75, 0x78, 0x00, 0x0d,
   0x63, 0x00, 0x02, 0x00, 0x00, 0x00, 0x66, 0x00, 0x0f, 0x63, 0x73, 0x00, 0x1a, 0x00, 0x00,
   0x00, 0x02, 0x00, 0x00, 0x00, 0x67, 0x00, 0x10, 0x00, 0x00, 0x00, 0x12, 0x76, 0x00, 0x01,
   0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x69, 0x00, 0xfe, 0xff, 0xff, 0xff,
   0x11, 0x74, 0x73, 0x00, 0x04, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x12, 0x6c, 0x36,
   0x34, 0x00, 0x05, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x13, 0x6d, 0x00, 0x01, 0x00,
   0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x3e, 0x30, 0xff,
   0x6d, 0x6e, 0x00, 0x7f, 0x6d, 0x78, 0x00, 0x03, 0x72, 0x65, 0x66, 0x00, 0x2d, 0x00, 0x00,
   0x00, 0x02, 0x24, 0x72, 0x65, 0x66, 0x00, 0x02, 0x00, 0x00, 0x00, 0x63, 0x00, 0x10, 0x24,
   0x69, 0x64, 0x00, 0x01, 0x00, 0x00, 0x00, 0x02, 0x24, 0x64, 0x62, 0x00, 0x03, 0x00, 0x00,
   0x00, 0x64, 0x62, 0x00, 0x10, 0x78, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x06, 0x75, 0x6e,
   0x00, 0x0e, 0x73, 0x79, 0x00, 0x02, 0x00, 0x00, 0x00, 0x79, 0x00, 0x0c, 0x64, 0x70, 0x00,
   0x02, 0x00, 0x00, 0x00, 0x63, 0x00, 0x30, 0x31, 0x32, 0x33, 0x34, 0x35, 0x36, 0x37, 0x38,
   0x39, 0x61, 0x62, 0x05, 0x6f, 0x62, 0x00, 0x05, 0x00, 0x00, 0x00, 0x02, 0x01, 0x00, 0x00,
   0x00, 0x7a, 0x00
};

/* Whether two decoded trees are the same: types at every level, dict keys
 * in the same order, floats bit for bit, other values equal with equal
 * reprs, and the documents inside Code (scope) and DBRef (id, extra
 * fields) compared the same way. */
static bool __attribute__ ((cold))
same_tree (PyObject *a, PyObject *b, int depth)
{
   static const char *const inner[] = {"scope", "id", "collection", "database",
                                       "_DBRef__kwargs", NULL};
   Py_ssize_t i = 0, j = 0;
   PyObject *ka, *va, *kb, *vb, *ra = NULL, *rb = NULL;
   bool ok;
   size_t k;

   if (!a || !b || Py_TYPE (a) != Py_TYPE (b) || depth > 16) {
      return false;
   }
   if (PyDict_CheckExact (a)) {
      if (PyDict_Size (a) != PyDict_Size (b)) {
         return false;
      }
      while (PyDict_Next (a, &i, &ka, &va) && PyDict_Next (b, &j, &kb, &vb)) {
         if (!same_tree (ka, kb, depth + 1) || !same_tree (va, vb, depth + 1)) {
            return false;
         }
      }
      return true;
   }
   if (PyList_CheckExact (a)) {
      if (PyList_Size (a) != PyList_Size (b)) {
         return false;
      }
      for (i = 0; i < PyList_Size (a); i++) {
         if (!same_tree (PyList_GetItem (a, i), PyList_GetItem (b, i), depth + 1)) {
            return false;
         }
      }
      return true;
   }
   if (PyFloat_CheckExact (a)) {
      double x = PyFloat_AsDouble (a), y = PyFloat_AsDouble (b);
      return memcmp (&x, &y, sizeof x) == 0;
   }
   ra = PyObject_Repr (a);
   rb = ra ? PyObject_Repr (b) : NULL;
   ok = rb && PyObject_RichCompareBool (a, b, Py_EQ) == 1 &&
        PyObject_RichCompareBool (ra, rb, Py_EQ) == 1;
   Py_XDECREF (ra);
   Py_XDECREF (rb);
   for (k = 0; ok && inner[k] && (Py_TYPE (a) == (PyTypeObject *) g.code ||
                                  Py_TYPE (a) == (PyTypeObject *) g.dbref);
        k++) {
      PyObject *x = PyObject_GetAttrString (a, inner[k]);
      PyObject *y = x ? PyObject_GetAttrString (b, inner[k]) : NULL;
      if (x || y) {
         ok = same_tree (x, y, depth + 1);
      }
      Py_XDECREF (x);
      Py_XDECREF (y);
      PyErr_Clear ();
   }
   return ok;
}

/* The last line of set-up: the canary built here is the same as PyMongo's
 * decoder makes it, and as one list entry too. A PyMongo release that
 * converted some type otherwise would fail this, and leave every hit to
 * its decoder. */
static bool __attribute__ ((cold))
canary_matches (void)
{
   PyObject *bytes = PyBytes_FromStringAndSize ((const char *) canary, sizeof canary);
   PyObject *want = bytes ? PyObject_CallFunctionObjArgs (g.decode_one, bytes, g.default_codec, NULL)
                          : NULL;
   PyObject *want_all = want ? PyObject_CallFunctionObjArgs (g.decode_all, bytes,
                                                            g.default_codec, NULL)
                             : NULL;
   bool declined;
   PyObject *got = want_all ? build_entry (canary, sizeof canary, false, false, &declined) : NULL;
   PyObject *got_all = got ? build_entry (canary, sizeof canary, true, false, &declined) : NULL;
   bool ok = same_tree (got, want, 0) && same_tree (got_all, want_all, 0);

   Py_XDECREF (bytes);
   Py_XDECREF (want);
   Py_XDECREF (want_all);
   Py_XDECREF (got);
   Py_XDECREF (got_all);
   PyErr_Clear ();
   return ok;
}

static bool __attribute__ ((cold))
set_up (void)
{
   struct {
      PyObject **out;
      const char *module, *name;
   } want[] = {
      {&g.decode_one, "bson", "_bson_to_dict"},
      {&g.decode_all, "bson", "_decode_all"},
      {&g.default_codec, "bson.codec_options", "DEFAULT_CODEC_OPTIONS"},
      {&g.objectid, "bson.objectid", "ObjectId"},
      {&g.binary, "bson.binary", "Binary"},
      {&g.dbref, "bson.dbref", "DBRef"},
      {&g.code, "bson.code", "Code"},
      {&g.regex, "bson.regex", "Regex"},
      {&g.timestamp, "bson.timestamp", "Timestamp"},
      {&g.int64, "bson.int64", "Int64"},
      {&g.from_bid, "bson.decimal128", "Decimal128"},
      {&g.minkey, "bson.min_key", "MinKey"},
      {&g.maxkey, "bson.max_key", "MaxKey"},
      {&g.datetime, "datetime", "datetime"},
   };
   size_t i;
   PyObject *dec;

   for (i = 0; i < sizeof want / sizeof want[0]; i++) {
      if (!(*want[i].out = import_attr (want[i].module, want[i].name))) {
         return false;
      }
   }
   dec = g.from_bid;
   g.from_bid = PyObject_GetAttrString (dec, "from_bid");
   Py_DECREF (dec);
   g.empty_tuple = PyTuple_New (0);
   g.s_ref = PyUnicode_InternFromString ("$ref");
   g.s_id = PyUnicode_InternFromString ("$id");
   g.s_db = PyUnicode_InternFromString ("$db");
   if (!g.from_bid || !g.empty_tuple || !g.s_ref || !g.s_id || !g.s_db ||
       !PyType_Check (g.objectid) || !PyTuple_Check (g.default_codec)) {
      return false;
   }
   set_up_objectid ();
   set_up_datetime ();
   return canary_matches ();
}

/* Set up once, on the first hit that could be built (an owner never gets
 * here, so it never imports bson). A failure leaves the builder unavailable
 * for the life of the process: every hit is then decoded as before. */
static bool
ready (void)
{
   if (g.status == NOT_SET_UP) {
      g.status = SETTING_UP; /* a thread switch during set-up sees "not ready" */
      g.status = set_up () ? READY : UNAVAILABLE;
      PyErr_Clear ();
   }
   return g.status == READY;
}

/* ======================================================================== */
/* Codec verdicts                                                           */
/* ======================================================================== */

/* Verdicts by codec options object, holding a reference to each so that an
 * address is never reused for another object while it is remembered. */
#define CODEC_MEMO 8

static struct {
   PyObject *codec;
   bool ok;
} g_codecs[CODEC_MEMO];
static unsigned g_codec_next;

/* Whether `codec` decodes as DEFAULT_CODEC_OPTIONS does: PyMongo's decoder
 * reads the codec options as a tuple of seven items, so each item must have
 * the default's exact type and be equal to it. */
static bool __attribute__ ((cold))
codec_judge (PyObject *codec)
{
   Py_ssize_t i, n = PyTuple_Size (g.default_codec);

   if (!PyTuple_Check (codec) || PyTuple_Size (codec) != n) {
      return false;
   }
   for (i = 0; i < n; i++) {
      PyObject *a = PyTuple_GetItem (codec, i), *d = PyTuple_GetItem (g.default_codec, i);
      if (!a || !d || Py_TYPE (a) != Py_TYPE (d) || PyObject_RichCompareBool (a, d, Py_EQ) != 1) {
         PyErr_Clear ();
         return false;
      }
   }
   return true;
}

static bool
codec_ok (PyObject *codec)
{
   PyObject *old;
   unsigned i;
   bool ok;

   for (i = 0; i < CODEC_MEMO; i++) {
      if (g_codecs[i].codec == codec) {
         return g_codecs[i].ok;
      }
   }
   ok = codec_judge (codec);
   /* The slot is taken only after the judgement (which may run Python and
    * let another thread in), and the evicted reference dropped last. */
   i = g_codec_next++ % CODEC_MEMO;
   old = g_codecs[i].codec;
   g_codecs[i].codec = Py_NewRef (codec);
   g_codecs[i].ok = ok;
   Py_XDECREF (old);
   return ok;
}

/* ======================================================================== */
/* Keys                                                                     */
/* ======================================================================== */

/* A bounded cache of the str objects of field names, direct-mapped by a
 * hash of the name's bytes: a name seen before costs a compare and a
 * reference, and its str already carries its hash, so PyDict_SetItem does
 * not compute it again. A str is immutable: sharing one between documents
 * is unobservable except by identity, as CPython's own interning is. Only
 * names that decoded as strict UTF-8 get in, so a hit is always a name
 * PyMongo's decoder would accept.
 *
 * A name is read as two 64-bit words that together cover all of its bytes
 * (overlapping loads for 8 to 16 bytes, two 32-bit loads for 4 to 7, three
 * bytes for 1 to 3), so a name of up to 16 bytes is compared as its length
 * and two words; a longer one (up to KEY_MAX bytes) is then compared with
 * the UTF-8 of its str. Fixed-size loads, never byte copies into a word: a
 * word assembled from byte stores stalls the load that reads it back. An
 * entry is 32 bytes, so the table (16 KiB) stays small next to L1. */
#define KEY_SLOTS 512u
#define KEY_MAX 64u

static struct {
   PyObject *str;
   uint64_t w0, w1;
   uint64_t len;
} g_keys[KEY_SLOTS];

static inline uint64_t
load64 (const uint8_t *p)
{
   uint64_t v;
   memcpy (&v, p, 8);
   return v;
}

static inline uint32_t
load32 (const uint8_t *p)
{
   uint32_t v;
   memcpy (&v, p, 4);
   return v;
}

static inline void
key_words (const uint8_t *p, size_t len, uint64_t *w0, uint64_t *w1)
{
   if (len >= 8) {
      *w0 = load64 (p);
      *w1 = load64 (p + len - 8);
   } else if (len >= 4) {
      *w0 = load32 (p);
      *w1 = load32 (p + len - 4);
   } else {
      *w0 = (uint64_t) p[0] | (uint64_t) p[len / 2] << 8 | (uint64_t) p[len - 1] << 16;
      *w1 = 0;
   }
}

/* Whether a cached str longer than 16 bytes spells these bytes. */
static bool
key_long_equal (PyObject *s, const uint8_t *p, size_t len)
{
   Py_ssize_t n;
   const char *u = PyUnicode_AsUTF8AndSize (s, &n);

   if (!u) {
      PyErr_Clear ();
      return false;
   }
   return (size_t) n == len && memcmp (u, p, len) == 0;
}

/* The str of a field name of len bytes (no NUL among them). */
static PyObject *
key_str (const uint8_t *p, size_t len)
{
   uint64_t w0, w1, h;
   uint32_t i;
   PyObject *s, *old;

   if (len == 0 || len > KEY_MAX) {
      return PyUnicode_DecodeUTF8 ((const char *) p, (Py_ssize_t) len, NULL);
   }
   key_words (p, len, &w0, &w1);
   h = (w0 ^ (uint64_t) len) * 0x9e3779b97f4a7c15ull;
   h ^= (w1 + 0x632be59bd9b4e019ull) * 0xc2b2ae3d27d4eb4full;
   i = (uint32_t) (h >> 40) & (KEY_SLOTS - 1u);
   if (g_keys[i].len == len && g_keys[i].w0 == w0 && g_keys[i].w1 == w1 && g_keys[i].str &&
       (len <= 16 || key_long_equal (g_keys[i].str, p, len))) {
      return Py_NewRef (g_keys[i].str);
   }
   if (!(s = PyUnicode_DecodeUTF8 ((const char *) p, (Py_ssize_t) len, NULL))) {
      return NULL;
   }
   if (PyObject_Hash (s) == -1) {
      Py_DECREF (s);
      return NULL;
   }
   old = g_keys[i].str;
   g_keys[i].str = Py_NewRef (s);
   g_keys[i].len = len;
   g_keys[i].w0 = w0;
   g_keys[i].w1 = w1;
   Py_XDECREF (old); /* a str: freeing it runs no Python code */
   return s;
}

/* The offset of the first NUL in p[0, n), or n if there is none. Names are
 * short: a word at a time while 8 bytes remain (no loop to mispredict for
 * a name under 8 bytes), then byte by byte. */
static inline size_t
nul_at (const uint8_t *p, size_t n)
{
   size_t i = 0;

   for (; i + 8 <= n; i += 8) {
      uint64_t w = load64 (p + i);
      uint64_t z = (w - 0x0101010101010101ull) & ~w & 0x8080808080808080ull;
      if (z) {
         return i + ((size_t) __builtin_ctzll (z) >> 3);
      }
   }
   while (i < n && p[i]) {
      i++;
   }
   return i;
}

/* ======================================================================== */
/* Values                                                                   */
/* ======================================================================== */

/* Recursion levels. PyMongo's decoder enters one (Py_EnterRecursiveCall)
 * for each document and around each array element, and fails with the
 * interpreter's RecursionError where the levels it holds reach the limit.
 * The builder counts the same levels but holds only as many as the deepest
 * level reached so far, entering one more when it goes deeper: the check
 * runs at each new depth, so it fails at the same depth as PyMongo's (at
 * one more level, for the call PyMongo's decoder would be), and costs a
 * call into the interpreter only per new depth instead of per element.
 * build_entry leaves them all at the end. */
typedef struct {
   int level;   /* the levels PyMongo's decoder would hold here */
   int entered; /* Py_EnterRecursiveCall calls held: the deepest level so far */
} builder_t;

static inline bool
level_in (builder_t *b)
{
   if (b->level >= b->entered) {
      if (b->level >= MAX_LEVEL || Py_EnterRecursiveCall (" while decoding a BSON document")) {
         return false;
      }
      b->entered++;
   }
   b->level++;
   return true;
}

static inline void
level_out (builder_t *b)
{
   b->level--;
}

static PyObject *build_doc (builder_t *b, const uint8_t *p, size_t avail, bool dbref);
static PyObject *build_array (builder_t *b, const uint8_t *p, size_t avail);

/* A BSON string at p (int32 length, bytes, NUL) within `avail` bytes; *used
 * is set to its size. */
static PyObject *
string_at (const uint8_t *p, size_t avail, size_t *used)
{
   uint32_t n;

   if (avail < 4) {
      return NULL;
   }
   n = cqc_le32 (p);
   if (n == 0 || (uint64_t) n + 4 > avail || p[4 + n - 1] != 0) {
      return NULL;
   }
   *used = 4 + (size_t) n;
   return PyUnicode_DecodeUTF8 ((const char *) p + 4, (Py_ssize_t) n - 1, NULL);
}

/* Binary (type 5): subtype 0 is bytes; 3 and 4 (UUIDs, kept as Binary
 * under uuid_representation UNSPECIFIED) are declined unless 16 bytes long
 * (PyMongo before 4.20 refuses other lengths, 4.20 takes them); subtype 2
 * (the old binary) carries its own length, which must agree. */
static PyObject *__attribute__ ((cold))
binary_at (const uint8_t *p, size_t avail, size_t *used)
{
   uint32_t n;
   uint8_t st;
   const uint8_t *data;
   PyObject *bytes, *sub, *v = NULL;

   if (avail < 5) {
      return NULL;
   }
   n = cqc_le32 (p);
   st = p[4];
   data = p + 5;
   if ((uint64_t) n > avail - 5) {
      return NULL;
   }
   *used = 5 + (size_t) n;
   if (st == 0) {
      return PyBytes_FromStringAndSize ((const char *) data, n);
   }
   if ((st == 3 || st == 4) && n != 16) {
      return NULL;
   }
   if (st == 2) {
      if (n < 4 || cqc_le32 (data) != n - 4) {
         return NULL;
      }
      data += 4;
      n -= 4;
   }
   bytes = PyBytes_FromStringAndSize ((const char *) data, n);
   sub = bytes ? PyLong_FromLong (st) : NULL;
   if (sub) {
      v = PyObject_CallFunctionObjArgs (g.binary, bytes, sub, NULL);
   }
   Py_XDECREF (bytes);
   Py_XDECREF (sub);
   return v;
}

/* Whether n bytes are strict UTF-8 (an exception is cleared). */
static bool
utf8_ok (const uint8_t *p, size_t n)
{
   size_t i;
   PyObject *s;

   for (i = 0; i < n && p[i] < 0x80; i++) {
   }
   if (i == n) {
      return true;
   }
   if (!(s = PyUnicode_DecodeUTF8 ((const char *) p, (Py_ssize_t) n, NULL))) {
      PyErr_Clear ();
      return false;
   }
   Py_DECREF (s);
   return true;
}

/* Regex (type 11): two C strings, the pattern (strict UTF-8) and the flags
 * (read as PyMongo reads them: known letters set bits, others are
 * ignored). Flags that are not UTF-8 are declined: PyMongo 4.20 refuses
 * them, earlier releases ignore them. */
static PyObject *__attribute__ ((cold))
regex_at (const uint8_t *p, size_t avail, size_t *used)
{
   const uint8_t *pe = memchr (p, 0, avail), *f, *fe;
   PyObject *pattern, *flags, *v = NULL;
   long bits = 0;

   if (!pe) {
      return NULL;
   }
   f = pe + 1;
   if (!(fe = memchr (f, 0, avail - (size_t) (f - p)))) {
      return NULL;
   }
   *used = (size_t) (fe - p) + 1;
   if (!utf8_ok (f, (size_t) (fe - f))) {
      return NULL;
   }
   for (; f < fe; f++) {
      switch (*f) {
      case 'i': bits |= 2; break;
      case 'l': bits |= 4; break;
      case 'm': bits |= 8; break;
      case 's': bits |= 16; break;
      case 'u': bits |= 32; break;
      case 'x': bits |= 64; break;
      default: break;
      }
   }
   pattern = PyUnicode_DecodeUTF8 ((const char *) p, pe - p, NULL);
   flags = pattern ? PyLong_FromLong (bits) : NULL;
   if (flags) {
      v = PyObject_CallFunctionObjArgs (g.regex, pattern, flags, NULL);
   }
   Py_XDECREF (pattern);
   Py_XDECREF (flags);
   return v;
}

/* Code with scope (type 15): int32 total, string, document; the total
 * must be exactly the sum of its parts. The scope is a plain document (no
 * DBRef conversion of the scope itself, as in PyMongo). */
static PyObject *__attribute__ ((cold))
code_w_scope_at (builder_t *b, const uint8_t *p, size_t avail, size_t *used)
{
   uint32_t total;
   size_t slen = 0;
   PyObject *code, *scope = NULL, *v = NULL;

   if (avail < 14) {
      return NULL;
   }
   total = cqc_le32 (p);
   if (total < 14 || total > avail) {
      return NULL;
   }
   if (!(code = string_at (p + 4, total - 4, &slen))) {
      return NULL;
   }
   if (total - 4 - slen >= 5 && cqc_le32 (p + 4 + slen) == total - 4 - slen) {
      scope = build_doc (b, p + 4 + slen, total - 4 - slen, false);
   }
   if (scope) {
      v = PyObject_CallFunctionObjArgs (g.code, code, scope, NULL);
   }
   *used = total;
   Py_DECREF (code);
   Py_XDECREF (scope);
   return v;
}

/* The rare types: made by PyMongo's classes, kept out of the hot code
 * (cold: placed apart, so the common path stays within fewer cache
 * lines). Same contract as value_at. */
static PyObject *__attribute__ ((noinline, cold))
rare_value_at (builder_t *b, uint8_t type, const uint8_t *p, size_t avail, size_t *used)
{
   PyObject *x, *y, *v;
   size_t n;

   switch (type) {
   case 0x05:
      return binary_at (p, avail, used);
   case 0x06: /* undefined */
      *used = 0;
      return Py_NewRef (Py_None);
   case 0x0B:
      return regex_at (p, avail, used);
   case 0x0C: /* DBPointer: DBRef(collection, ObjectId) */
      if (!(x = string_at (p, avail, &n)) || avail - n < 12 ||
          !(y = objectid_by (g.oid_fast, p + n))) {
         Py_XDECREF (x);
         return NULL;
      }
      *used = n + 12;
      v = PyObject_CallFunctionObjArgs (g.dbref, x, y, NULL);
      Py_DECREF (x);
      Py_DECREF (y);
      return v;
   case 0x0D: /* JavaScript code */
      if (!(x = string_at (p, avail, used))) {
         return NULL;
      }
      v = PyObject_CallFunctionObjArgs (g.code, x, NULL);
      Py_DECREF (x);
      return v;
   case 0x0E: /* symbol: a str */
      return string_at (p, avail, used);
   case 0x0F:
      return code_w_scope_at (b, p, avail, used);
   case 0x11: /* Timestamp(time, inc): the increment comes first */
      if (avail < 8) {
         return NULL;
      }
      *used = 8;
      x = PyLong_FromUnsignedLong (cqc_le32 (p + 4));
      y = x ? PyLong_FromUnsignedLong (cqc_le32 (p)) : NULL;
      v = y ? PyObject_CallFunctionObjArgs (g.timestamp, x, y, NULL) : NULL;
      Py_XDECREF (x);
      Py_XDECREF (y);
      return v;
   case 0x12: /* int64: Int64 */
      if (avail < 8) {
         return NULL;
      }
      *used = 8;
      x = PyLong_FromLongLong ((long long) (int64_t) cqc_le64 (p));
      v = x ? PyObject_CallFunctionObjArgs (g.int64, x, NULL) : NULL;
      Py_XDECREF (x);
      return v;
   case 0x13: /* Decimal128.from_bid(16 bytes) */
      if (avail < 16) {
         return NULL;
      }
      *used = 16;
      x = PyBytes_FromStringAndSize ((const char *) p, 16);
      v = x ? PyObject_CallFunctionObjArgs (g.from_bid, x, NULL) : NULL;
      Py_XDECREF (x);
      return v;
   case 0x7F:
      *used = 0;
      return PyObject_CallNoArgs (g.maxkey);
   case 0xFF:
      *used = 0;
      return PyObject_CallNoArgs (g.minkey);
   default: /* 0x00 and unknown types: PyMongo raises */
      return NULL;
   }
}

/* The value of `type` at p, within avail bytes (up to its container's
 * terminating NUL); *used is set to its size. The types of most documents
 * here, the rest in rare_value_at. */
static PyObject *
value_at (builder_t *b, uint8_t type, const uint8_t *p, size_t avail, size_t *used)
{
   double dbl;
   uint64_t u;

   switch (type) {
   case 0x01: /* double */
      if (avail < 8) {
         return NULL;
      }
      u = cqc_le64 (p);
      memcpy (&dbl, &u, 8);
      *used = 8;
      return PyFloat_FromDouble (dbl);
   case 0x02: /* string */
      return string_at (p, avail, used);
   case 0x03: /* document */
      if (avail < 4) {
         return NULL;
      }
      *used = cqc_le32 (p);
      return build_doc (b, p, avail, true);
   case 0x04: /* array */
      if (avail < 4) {
         return NULL;
      }
      *used = cqc_le32 (p);
      return build_array (b, p, avail);
   case 0x07:
      if (avail < 12) {
         return NULL;
      }
      *used = 12;
      return objectid_by (g.oid_fast, p);
   case 0x08: /* boolean: 0 or 1, anything else is declined */
      if (avail < 1 || p[0] > 1) {
         return NULL;
      }
      *used = 1;
      return Py_NewRef (p[0] ? Py_True : Py_False);
   case 0x09:
      if (avail < 8) {
         return NULL;
      }
      *used = 8;
      return datetime_by (g.dt_mode, (int64_t) cqc_le64 (p));
   case 0x0A: /* null */
      *used = 0;
      return Py_NewRef (Py_None);
   case 0x10: /* int32 */
      if (avail < 4) {
         return NULL;
      }
      *used = 4;
      return PyLong_FromLong ((long) (int32_t) cqc_le32 (p));
   default:
      return rare_value_at (b, type, p, avail, used);
   }
}

/* ======================================================================== */
/* Documents and arrays                                                     */
/* ======================================================================== */

/* A document built with dbref set (an embedded document, as PyMongo's
 * _dbref_hook sees it) that has "$ref" and "$id": a DBRef when "$ref" is a
 * str and "$db" is absent, None or a str, made the way PyMongo makes it
 * (the three keys taken out, the rest passed as its extra fields).
 * Consumes d. */
static PyObject *__attribute__ ((cold))
dbref_of (PyObject *d)
{
   PyObject *ref = PyDict_GetItemWithError (d, g.s_ref);
   PyObject *id = ref ? PyDict_GetItemWithError (d, g.s_id) : NULL;
   PyObject *db = id ? PyDict_GetItemWithError (d, g.s_db) : NULL;
   PyObject *v = NULL;
   bool has_db = db != NULL;

   if (!ref || !id || PyErr_Occurred ()) {
      Py_DECREF (d);
      return NULL;
   }
   if (!PyUnicode_Check (ref) || (db && db != Py_None && !PyUnicode_Check (db))) {
      return d;
   }
   Py_INCREF (ref);
   Py_INCREF (id);
   db = has_db ? Py_NewRef (db) : Py_NewRef (Py_None);
   if (PyDict_DelItem (d, g.s_ref) == 0 && PyDict_DelItem (d, g.s_id) == 0 &&
       (!has_db || PyDict_DelItem (d, g.s_db) == 0)) {
      v = PyObject_CallFunctionObjArgs (g.dbref, ref, id, db, d, NULL);
   }
   Py_DECREF (ref);
   Py_DECREF (id);
   Py_DECREF (db);
   Py_DECREF (d);
   return v;
}

/* The bounds every container shares: an int32 size of at least 5 that
 * fits in avail, and a terminating NUL. */
static bool
container_ok (const uint8_t *p, size_t avail)
{
   uint32_t size;

   if (avail < 5) {
      return false;
   }
   size = cqc_le32 (p);
   return size >= 5 && size <= avail && p[size - 1] == 0;
}

/* A document at p within avail bytes, as a dict; dbref: an embedded
 * document, which becomes a DBRef when it is one. One recursion level, as
 * PyMongo's elements_to_dict counts it. */
static PyObject *
build_doc (builder_t *b, const uint8_t *p, size_t avail, bool dbref)
{
   size_t pos = 4, end, used;
   PyObject *d = NULL;
   bool has_ref = false, has_id = false;

   if (!container_ok (p, avail) || !level_in (b)) {
      return NULL;
   }
   end = cqc_le32 (p) - 1;
   if (!(d = PyDict_New ())) {
      goto cleanup;
   }
   while (pos < end) {
      uint8_t type = p[pos++];
      const uint8_t *name = p + pos;
      size_t nlen = nul_at (name, end - pos);
      PyObject *k, *v;
      int r;

      if (nlen == end - pos) {
         Py_CLEAR (d);
         goto cleanup;
      }
      if (dbref && name[0] == '$') {
         has_ref |= nlen == 4 && memcmp (name, "$ref", 4) == 0;
         has_id |= nlen == 3 && memcmp (name, "$id", 3) == 0;
      }
      pos += nlen + 1;
      used = 0;
      if (!(k = key_str (name, nlen)) || !(v = value_at (b, type, p + pos, end - pos, &used))) {
         Py_XDECREF (k);
         Py_CLEAR (d);
         goto cleanup;
      }
      r = PyDict_SetItem (d, k, v);
      Py_DECREF (k);
      Py_DECREF (v);
      if (r < 0 || used > end - pos) {
         Py_CLEAR (d);
         goto cleanup;
      }
      pos += used;
   }
   if (has_ref && has_id) {
      d = dbref_of (d);
   }
cleanup:
   level_out (b);
   return d;
}

/* An array at p within avail bytes, as a list; its keys are skipped
 * unread, as PyMongo skips them. One recursion level per element, as
 * PyMongo counts them. */
static PyObject *
build_array (builder_t *b, const uint8_t *p, size_t avail)
{
   size_t pos = 4, end, used;
   PyObject *list;

   if (!container_ok (p, avail) || !(list = PyList_New (0))) {
      return NULL;
   }
   end = cqc_le32 (p) - 1;
   while (pos < end) {
      uint8_t type = p[pos++];
      size_t nlen = nul_at (p + pos, end - pos);
      PyObject *v = NULL;
      int r;

      if (nlen == end - pos) {
         Py_CLEAR (list);
         break;
      }
      pos += nlen + 1;
      used = 0;
      if (level_in (b)) {
         v = value_at (b, type, p + pos, end - pos, &used);
         level_out (b);
      }
      r = v ? PyList_Append (list, v) : -1;
      Py_XDECREF (v);
      if (r < 0 || used > end - pos) {
         Py_CLEAR (list);
         break;
      }
      pos += used;
   }
   return list;
}

/* ======================================================================== */
/* Entry point                                                              */
/* ======================================================================== */

/* A top-level document: exactly `len` bytes (one document, as
 * _bson_to_dict wants it) or a prefix of them (the next one of a list, as
 * _decode_all reads them); *size is set to its size. elements: built as an
 * element of a reply's batch, where a DBRef document becomes a DBRef. */
static PyObject *
top_doc (builder_t *b, const uint8_t *p, size_t len, bool exact, bool elements, size_t *size)
{
   if (len < 5 || (exact && cqc_le32 (p) != len)) {
      return NULL;
   }
   *size = cqc_le32 (p);
   return build_doc (b, p, len, elements);
}

/* cqc_build without the set-up check (set_up's canary runs it). */
static PyObject *
build_entry (const uint8_t *buf, size_t len, bool many, bool elements, bool *declined)
{
   builder_t b = {0};
   PyObject *res = NULL, *doc;
   size_t pos = 0, size = 0;

   *declined = false;
   /* One level for the call itself: PyMongo's decoder, called through
    * tp_call, starts one level deeper than this function does; as batch
    * elements, two more: the document and the array that hold them
    * (decode_document's wrapper). */
   if (!level_in (&b) || (elements && (!level_in (&b) || !level_in (&b)))) {
      goto cleanup;
   }
   if (!many) {
      res = top_doc (&b, buf, len, true, elements, &size);
   } else if ((res = PyList_New (0))) {
      while (pos < len) {
         if (!(doc = top_doc (&b, buf + pos, len - pos, false, elements, &size)) ||
             PyList_Append (res, doc) < 0) {
            Py_XDECREF (doc);
            Py_CLEAR (res);
            break;
         }
         Py_DECREF (doc);
         pos += size;
      }
   }
cleanup:
   while (b.entered-- > 0) {
      Py_LeaveRecursiveCall ();
   }
   if (!res) {
      /* Declined, or an Exception from a call (PyMongo's decoder will meet
       * the same bytes and raise its own); a BaseException is the caller's. */
      if (!PyErr_Occurred () || PyErr_ExceptionMatches (PyExc_Exception)) {
         PyErr_Clear ();
         *declined = true;
      }
   }
   return res;
}

PyObject *
cqc_build (const uint8_t *buf, size_t len, bool many, bool elements, bool *declined)
{
   if (!ready ()) {
      *declined = false;
      PyErr_SetString (PyExc_RuntimeError, "the document builder is not available");
      return NULL;
   }
   return build_entry (buf, len, many, elements, declined);
}

/* ======================================================================== */
/* Documents of a batch                                                     */
/* ======================================================================== */

/* PyMongo's cursors decode each document of a reply as an element of its
 * batch array, not as a top-level document: a DBRef document ("$ref" and
 * "$id") becomes a DBRef, and an exception from a TypeRegistry decoder
 * becomes InvalidBSON with its message, as for any nested field. The
 * cache's results must not depend on whether it served the read, so its
 * documents are decoded the same way: decode_document and
 * decode_documents (the module functions below, kept in g_elements to be
 * recognized by cqc_hit_begin) wrap them in {"": [d0, d1, ...]} and hand
 * that to bson._bson_to_dict with the caller's codec options; the builder,
 * with elements set, makes the same objects without the wrapper. */
static struct {
   PyObject *one;       /* _native.decode_document */
   PyObject *all;       /* _native.decode_documents */
   PyObject *to_dict;   /* bson._bson_to_dict */
   PyObject *decode_all; /* bson._decode_all */
   PyObject *key;       /* "" */
} g_elements;

/* {"": [the documents of p]}: one document of exactly len bytes (many
 * false), or documents laid end to end; NULL without an exception when p
 * does not hold that, or is too large for one BSON document. */
static inline void
put_le32 (uint8_t *p, uint32_t v)
{
   p[0] = (uint8_t) v;
   p[1] = (uint8_t) (v >> 8);
   p[2] = (uint8_t) (v >> 16);
   p[3] = (uint8_t) (v >> 24);
}

static PyObject *
batch_of (const uint8_t *p, size_t len, bool many)
{
   size_t n = 0, pos = 0, total, at;
   uint8_t *out;
   PyObject *bytes;

   while (pos < len) {
      size_t size;
      if (len - pos < 5 || (size = cqc_le32 (p + pos)) < 5 || size > len - pos) {
         return NULL;
      }
      pos += size;
      n++;
   }
   if ((!many && n != 1) || len > INT32_MAX) {
      return NULL;
   }
   /* document: size, 0x04 "" NUL, array: size, n x (0x03 "0" NUL doc), NUL; NUL */
   total = 4 + 2 + 4 + 3 * n + len + 1 + 1;
   if (total > INT32_MAX || !(bytes = PyBytes_FromStringAndSize (NULL, (Py_ssize_t) total))) {
      PyErr_Clear ();
      return NULL;
   }
   out = (uint8_t *) PyBytes_AsString (bytes);
   put_le32 (out, (uint32_t) total);
   out[4] = 0x04;
   out[5] = 0;
   put_le32 (out + 6, (uint32_t) (total - 7));
   at = 10;
   for (pos = 0; pos < len;) {
      size_t size = cqc_le32 (p + pos);
      out[at] = 0x03;
      out[at + 1] = '0';
      out[at + 2] = 0;
      memcpy (out + at + 3, p + pos, size);
      at += 3 + size;
      pos += size;
   }
   out[at] = 0;
   out[at + 1] = 0;
   return bytes;
}

/* decode_document(data, codec_options) / decode_documents(...): the
 * document, or the list of documents laid end to end, of data, as PyMongo's
 * cursor decodes a reply's batch. Bytes that are not documents laid end to
 * end go to PyMongo's own top-level decoder, which raises its error. */
static PyObject *
decode_batch (PyObject *const *args, Py_ssize_t nargs, bool many)
{
   Py_buffer view;
   PyObject *wrapped, *outer, *list, *res = NULL;

   if (nargs != 2) {
      PyErr_Format (PyExc_TypeError, "%s(data, codec_options) takes 2 arguments",
                    many ? "decode_documents" : "decode_document");
      return NULL;
   }
   if (!g_elements.to_dict && (!(g_elements.to_dict = import_attr ("bson", "_bson_to_dict")) ||
                               !(g_elements.decode_all = import_attr ("bson", "_decode_all")))) {
      Py_CLEAR (g_elements.to_dict);
      return NULL;
   }
   if (PyObject_GetBuffer (args[0], &view, PyBUF_SIMPLE) < 0) {
      return NULL;
   }
   wrapped = batch_of (view.buf, (size_t) view.len, many);
   PyBuffer_Release (&view);
   if (!wrapped) {
      return PyObject_CallFunctionObjArgs (many ? g_elements.decode_all : g_elements.to_dict,
                                           args[0], args[1], NULL);
   }
   outer = PyObject_CallFunctionObjArgs (g_elements.to_dict, wrapped, args[1], NULL);
   Py_DECREF (wrapped);
   list = outer ? PyObject_GetItem (outer, g_elements.key) : NULL;
   Py_XDECREF (outer);
   if (list) {
      res = !many ? PySequence_GetItem (list, 0)
                  : PyList_CheckExact (list) ? Py_NewRef (list) : PySequence_List (list);
      Py_DECREF (list);
   }
   return res;
}

static PyObject *
mod_decode_document (PyObject *Py_UNUSED (m), PyObject *const *args, Py_ssize_t nargs)
{
   return decode_batch (args, nargs, false);
}

static PyObject *
mod_decode_documents (PyObject *Py_UNUSED (m), PyObject *const *args, Py_ssize_t nargs)
{
   return decode_batch (args, nargs, true);
}

/* ======================================================================== */
/* A lookup's copy                                                          */
/* ======================================================================== */

/* One scratch buffer per process for the copies of built hits: no
 * allocation per hit. A build may run Python code (a class it calls, the
 * garbage collector) and so let another thread look up meanwhile: while
 * the scratch is busy, a copy gets a buffer of its own. Copies larger than
 * SCRATCH_KEEP get one too, so the scratch never holds more than that. (A
 * child forked while another thread's build had let go of the GIL keeps
 * the scratch marked busy: its copies are then malloc'd, never shared.) */
#define SCRATCH_KEEP (256u * 1024u)

static struct {
   uint8_t *buf;
   size_t cap;
   bool busy;
} g_scratch;

/* How this process's hits were made (_build_info reports them). */
static uint64_t g_built, g_declined, g_decoded;

void
cqc_hit_begin (cqc_hit_t *h, PyObject *decode, PyObject *codec)
{
   bool one, all;

   memset (h, 0, sizeof *h);
   h->decode = decode;
   h->codec = codec;
   h->how = CQC_HIT_DECODE;
   h->elements = decode == g_elements.one || decode == g_elements.all;
   if (!ready ()) {
      return;
   }
   one = decode == g_elements.one || decode == g.decode_one;
   all = decode == g_elements.all || decode == g.decode_all;
   if ((one || all) && codec_ok (codec)) {
      h->how = one ? CQC_HIT_ONE : CQC_HIT_ALL;
   }
}

void *
cqc_hit_alloc (void *ctx, size_t len)
{
   cqc_hit_t *h = ctx;
   size_t need = len ? len : 1;

   if (h->how == CQC_HIT_DECODE) {
      if (!(h->bytes = PyBytes_FromStringAndSize (NULL, (Py_ssize_t) len))) {
         PyErr_Clear ();
         return NULL;
      }
      return PyBytes_AsString (h->bytes);
   }
   h->len = len;
   if (!g_scratch.busy && need <= SCRATCH_KEEP) {
      if (g_scratch.cap < need) {
         size_t cap = need < 8192 ? 8192 : need;
         uint8_t *p = realloc (g_scratch.buf, cap);
         if (!p) {
            return NULL;
         }
         g_scratch.buf = p;
         g_scratch.cap = cap;
      }
      g_scratch.busy = true;
      h->scratch = true;
      return h->buf = g_scratch.buf;
   }
   h->scratch = false;
   return h->buf = malloc (need);
}

void
cqc_hit_discard (void *ctx)
{
   cqc_hit_t *h = ctx;

   Py_CLEAR (h->bytes);
   if (h->scratch) {
      g_scratch.busy = false;
   } else {
      free (h->buf);
   }
   h->buf = NULL;
   h->scratch = false;
}

/* cqc_build, counted: built (its result or the decoder's error) or declined. */
static PyObject *
build_counted (const uint8_t *buf, size_t len, bool many, bool elements, bool *declined)
{
   PyObject *res = cqc_build (buf, len, many, elements, declined);

   g_built += res != NULL;
   g_declined += *declined;
   return res;
}

PyObject *
cqc_hit_finish (cqc_hit_t *h)
{
   PyObject *res = NULL, *bytes = h->bytes;
   bool declined = true;

   if (h->how != CQC_HIT_DECODE && h->buf) {
      res = build_counted (h->buf, h->len, h->how == CQC_HIT_ALL, h->elements, &declined);
      bytes = declined ? PyBytes_FromStringAndSize ((const char *) h->buf, (Py_ssize_t) h->len)
                       : NULL;
   } else {
      Py_XINCREF (bytes);
      g_decoded++;
   }
   if (declined && bytes) {
      res = PyObject_CallFunctionObjArgs (h->decode, bytes, h->codec, NULL);
   } else if (declined && !PyErr_Occurred ()) {
      PyErr_SetString (PyExc_RuntimeError, "a hit without its copy");
   }
   Py_XDECREF (bytes);
   cqc_hit_discard (h);
   return res;
}

/* decoded(data, decode, codec_options) -> decode(data, codec_options)'s
 * result, built straight from `data` where a hit with this decoder and these
 * codec options would be built: a miss's copy for its caller, the same
 * objects as a hit of its entry, in less time than PyMongo's decoder. Built
 * in place only from a read-only buffer (bytes, or PyMongo's read-only
 * memoryview of a reply), which nothing can change while the builder calls
 * back into Python; any other object, and declined bytes, go to `decode`,
 * which returns its result or raises its own error. */
static PyObject *
mod_decoded (PyObject *Py_UNUSED (m), PyObject *const *args, Py_ssize_t nargs)
{
   cqc_hit_t hit;
   Py_buffer view;
   PyObject *res;
   bool tried = false, declined = true;

   if (nargs != 3) {
      PyErr_SetString (PyExc_TypeError, "decoded(data, decode, codec_options) takes 3 arguments");
      return NULL;
   }
   cqc_hit_begin (&hit, args[1], args[2]);
   if (hit.how != CQC_HIT_DECODE && PyObject_CheckBuffer (args[0])) {
      if (PyObject_GetBuffer (args[0], &view, PyBUF_SIMPLE) < 0) {
         PyErr_Clear (); /* the decoder says what is wrong with it */
      } else if (!view.readonly) {
         PyBuffer_Release (&view);
      } else {
         res = build_counted (view.buf, (size_t) view.len, hit.how == CQC_HIT_ALL, hit.elements,
                              &declined);
         PyBuffer_Release (&view);
         if (!declined) {
            return res;
         }
         tried = true; /* counted as declined */
      }
   }
   g_decoded += !tried;
   return PyObject_CallFunctionObjArgs (args[1], args[0], args[2], NULL);
}

/* ======================================================================== */
/* Private functions for the tests                                          */
/* ======================================================================== */

/* _build(data, many=False, elements=False) -> the built object, or
 * NotImplemented when the builder declines these bytes. */
static PyObject *
mod_build (PyObject *Py_UNUSED (m), PyObject *args)
{
   Py_buffer view;
   int many = 0, elements = 0;
   bool declined;
   PyObject *res;

   if (!PyArg_ParseTuple (args, "y*|pp", &view, &many, &elements)) {
      return NULL;
   }
   res = cqc_build (view.buf, (size_t) view.len, many != 0, elements != 0, &declined);
   PyBuffer_Release (&view);
   return declined ? Py_NewRef (Py_NotImplemented) : res;
}

/* _build_hit(data, decode, codec_options) -> what a hit whose entry is
 * `data` returns: the same steps as a lookup's (cqc_hit_begin, a copy made
 * by cqc_hit_alloc, cqc_hit_finish), without an arena. */
static PyObject *
mod_build_hit (PyObject *Py_UNUSED (m), PyObject *args)
{
   Py_buffer view;
   PyObject *decode, *codec;
   cqc_hit_t hit;
   void *dst;

   if (!PyArg_ParseTuple (args, "y*OO", &view, &decode, &codec)) {
      return NULL;
   }
   cqc_hit_begin (&hit, decode, codec);
   if ((dst = cqc_hit_alloc (&hit, (size_t) view.len))) {
      memcpy (dst, view.buf, (size_t) view.len);
   }
   PyBuffer_Release (&view);
   return dst ? cqc_hit_finish (&hit) : PyErr_NoMemory ();
}

/* _build_info() -> dict: whether the builder is set up, which fast paths
 * its checks at set-up allowed, and how this process's hits were made
 * (built, declined and decoded by the caller's decoder instead, decoded
 * because the decoder or codec options are not the builder's). */
static PyObject *
mod_build_info (PyObject *Py_UNUSED (m), PyObject *Py_UNUSED (ignored))
{
   static const char *const modes[] = {"decline", "call", "capi"};
   bool ok = ready ();
   return Py_BuildValue ("{s:O,s:O,s:s,s:K,s:K,s:K}", "ready", ok ? Py_True : Py_False,
                         "objectid_fast", ok && g.oid_fast ? Py_True : Py_False, "datetime",
                         ok ? modes[g.dt_mode] : "decline", "built",
                         (unsigned long long) g_built, "declined",
                         (unsigned long long) g_declined, "decoded",
                         (unsigned long long) g_decoded);
}

/* _build_codec_ok(codec_options) -> whether hits under them are built. */
static PyObject *
mod_build_codec_ok (PyObject *Py_UNUSED (m), PyObject *codec)
{
   return PyBool_FromLong (ready () && codec_ok (codec));
}

static PyMethodDef build_methods[] = {
   {"decoded", (PyCFunction) (void (*) (void)) mod_decoded, METH_FASTCALL,
    "decoded(data, decode, codec_options): a miss's copy, built as a hit's would be."},
   {"decode_document", (PyCFunction) (void (*) (void)) mod_decode_document, METH_FASTCALL,
    "decode_document(data, codec_options): one document, as a cursor's batch holds it."},
   {"decode_documents", (PyCFunction) (void (*) (void)) mod_decode_documents, METH_FASTCALL,
    "decode_documents(data, codec_options): documents laid end to end, as a batch's."},
   {"_build", mod_build, METH_VARARGS,
    "_build(data, many=False, elements=False): the builder's objects."},
   {"_build_hit", mod_build_hit, METH_VARARGS, "_build_hit(data, decode, codec): a hit's object."},
   {"_build_info", mod_build_info, METH_NOARGS, "_build_info(): the builder's fast paths."},
   {"_build_codec_ok", mod_build_codec_ok, METH_O, "_build_codec_ok(codec_options)."},
   {NULL, NULL, 0, NULL},
};

int
cqc_build_add_functions (PyObject *m)
{
   if (PyModule_AddFunctions (m, build_methods) < 0) {
      return -1;
   }
   /* Kept as long as the process: hits compare their decoder with them. */
   if (!g_elements.one) {
      g_elements.one = PyObject_GetAttrString (m, "decode_document");
      g_elements.all = PyObject_GetAttrString (m, "decode_documents");
   }
   if (!g_elements.key) {
      g_elements.key = PyUnicode_InternFromString ("");
   }
   return g_elements.one && g_elements.all && g_elements.key ? 0 : -1;
}
