/*
 * module.c - the CPython module client_query_cache._native.
 *
 * Types and functions only: the arena (arena.c), keys (keys.c) and stream
 * followers (stream.c) hold the logic. One type, Cache, owns an arena in
 * process-private memory, the writer lock, and one follower per database.
 *
 * Cache keys are built here, identically on the fast path (lookup_id, which
 * encodes {"_id": v} itself for int, str and ObjectId) and the general path
 * (lookup, which takes the filter as BSON bytes encoded by PyMongo):
 *
 *   kind (1 byte) | ns_idx (4) | filter length (4) | filter BSON | rest
 *
 * where `rest` is the remainder of the read's shape (projection, options),
 * already canonical and encoded by the caller.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "arena.h"
#include "keys.h"
#include "owner.h"
#include "ring.h"
#include "stream.h"

#include <errno.h>
#include <fcntl.h>
#include <mongoc/mongoc.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define KEY_STACK 512
#define FAST_STR_MAX 256

/* Sentinels returned by lookups, compared by identity in Python. */
static PyObject *g_miss;      /* no valid entry: read MongoDB and admit */
static PyObject *g_unhealthy; /* the database's stream does not serve */
static PyObject *g_fallback;  /* the fast path cannot encode this _id */
static PyObject *g_behind;    /* the applied time is behind the causal floor */

/* Bumped in a child after fork(): a Cache from before refuses to work. */
static volatile uint64_t g_fork_gen;

static void
on_fork_child (void)
{
   g_fork_gen++;
}

/* ======================================================================== */
/* The Cache type                                                           */
/* ======================================================================== */

/* Where the arena lives and who writes it. */
enum {
   MODE_LOCAL = 0,  /* private memory; this process writes */
   MODE_OWNER = 1,  /* a shared file this process created; it writes */
   MODE_WORKER = 2, /* an owner's file mapped read-only; admissions go to a ring */
};

#define ADMIT_QUEUED 16
#define ADMIT_DROPPED 17

/* Keys admitted by this process's own misses, each with the causal floor
 * its database had when the miss was the last thing the process observed
 * there (see lookup_key): MEMO_WAYS entries per bucket, found by key hash.
 * An entry whose floor is no longer its database's is free. */
#define MEMO_BUCKETS 1024
#define MEMO_WAYS 8

/* Writes this process made to one document ({"_id": v}) through a view,
 * not yet applied by the stream (see pending_blocks). */
#define PENDING_MAX 64

typedef struct {
   uint64_t ts;      /* the write's cluster time (the client's, after it) */
   uint64_t quiet;   /* CLOCK_MONOTONIC after it, one-member proof (0: none) */
   uint32_t db_idx;
   uint32_t ns_idx;
   uint32_t cell;    /* the document's identity cell */
   uint32_t used;
} pending_t;

typedef struct {
   uint64_t hash;
   uint64_t floor_ts;
   uint32_t db_idx;
   uint32_t used;
} memo_t;

typedef struct {
   PyObject_HEAD
   int mode;
   cqc_owner_t *owner; /* MODE_OWNER: the drain thread */
   void *seg;          /* MODE_WORKER: this worker's ring segment */
   size_t seg_len;
   cqc_ring_producer_t ring; /* MODE_WORKER: the producer's private state of seg */
   cqc_arena_t arena;
   void *mem;
   size_t mem_len;
   pthread_mutex_t lock; /* the single writer's lock */
   cqc_writer_t writer;
   cqc_stream_t **streams; /* indexed by db_idx */
   cqc_stream_info_t *final_info; /* a stopped follower's last info, by db_idx */
   char *uri;              /* NULL: no followers (arena-only use) */
   int64_t max_await_ms;
   PyObject *decode;        /* decode(bytes, codec_options) */
   PyObject *objectid_type; /* bson.objectid.ObjectId */
   PyObject *forked_error;  /* raised when used after fork() */
   PyObject *closed_error;  /* raised when used after close() */
   uint64_t fork_gen;
   bool closed;
   /* Process-local counters, changed with the GIL held. */
   uint64_t hits;
   uint64_t not_found_hits;
   uint64_t misses;
   uint64_t unhealthy;
   uint64_t behind; /* lookups refused by the causal floor */
   uint32_t pending_used; /* used entries of pending[] (read by every lookup) */
   /* The causal floor, by db_idx, in two parts (observe()): the highest
    * cluster time this process has observed from the database, and, on a
    * deployment of one member, the CLOCK_MONOTONIC time it observed it at
    * (0 elsewhere). A hit is served only once the database's applied time
    * has reached the first, or a stream round that began after the second
    * came back empty (cqc_db_t.quiet_ns), so a process never reads a version
    * older than one it has already been given. Raised with the GIL held and
    * read by lookups with it; never lowered. */
   uint64_t *floor_ts;
   uint64_t *floor_ns;
   /* On a deployment of one member, a miss whose own read is the newest
    * thing the process observed from its database reflects everything the
    * process has seen there: its entry may be served while the floor it
    * raised is unchanged, before the stream catches up (admit()'s
    * memo_floor). Process-local; matched by the key's 64-bit hash. */
   memo_t *memo; /* MEMO_BUCKETS * MEMO_WAYS */
   uint32_t memo_next; /* the way replaced when a bucket has none free */
   /* A write through a view to one document tells the process nothing about
    * other documents: instead of the database's floor it holds back only the
    * entries that may depend on that document (its identity cell's, and
    * every entry of its namespace that is not an identity entry) until the
    * stream has applied it (observe_id()). */
   pending_t pending[PENDING_MAX];
} CacheObject;

typedef struct {
   PyObject *bytes;
} alloc_ctx_t;

static void *
alloc_bytes (void *vctx, size_t len)
{
   alloc_ctx_t *ctx = vctx;
   ctx->bytes = PyBytes_FromStringAndSize (NULL, (Py_ssize_t) len);
   if (!ctx->bytes) {
      PyErr_Clear ();
      return NULL;
   }
   return PyBytes_AsString (ctx->bytes);
}

static void
discard_bytes (void *vctx)
{
   alloc_ctx_t *ctx = vctx;
   Py_CLEAR (ctx->bytes);
}

static bool
check_usable (CacheObject *self)
{
   if (self->fork_gen != g_fork_gen) {
      PyErr_SetString (self->forked_error,
                       "this cache was created before fork(); create a new CacheManager in "
                       "the child process");
      return false;
   }
   if (self->closed) {
      PyErr_SetString (self->closed_error, "the cache manager is closed");
      return false;
   }
   return true;
}

/* Give a new shared file its full size, with every block reserved now: on a
 * tmpfs (/dev/shm) a sparse file whose pages cannot be allocated later kills
 * the process that first writes them with SIGBUS. Falls back to a sparse
 * file where the filesystem cannot reserve. Returns 0 or an errno value. */
static int
size_shared_file (int fd, uint64_t size)
{
   int rc = posix_fallocate (fd, 0, (off_t) size);
   if (rc == EOPNOTSUPP || rc == EINVAL) {
      rc = ftruncate (fd, (off_t) size) == 0 ? 0 : errno;
   }
   return rc;
}

/* MODE_OWNER: create the arena file (owner-only) and map it shared. */
static void *
create_shared (const char *path, uint64_t size)
{
   void *mem;
   int fd = open (path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
   if (fd < 0) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, path);
      return MAP_FAILED;
   }
   if ((errno = size_shared_file (fd, size)) != 0) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, path);
      close (fd);
      unlink (path);
      return MAP_FAILED;
   }
   mem = mmap (NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
   if (mem == MAP_FAILED) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, path);
      unlink (path);
   }
   close (fd);
   return mem;
}

/* Open a file this user owns and nobody else can access. */
static int
open_private (const char *path, int flags, struct stat *st)
{
   int fd = open (path, flags | O_CLOEXEC | O_NOFOLLOW);
   if (fd < 0) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, path);
      return -1;
   }
   if (fstat (fd, st) != 0 || !S_ISREG (st->st_mode) || st->st_uid != getuid () ||
       (st->st_mode & 077) != 0) {
      PyErr_Format (PyExc_PermissionError,
                    "%s is not a private file of this user (uid %u): refusing to attach", path,
                    (unsigned) getuid ());
      close (fd);
      return -1;
   }
   return fd;
}

/* MODE_WORKER: map the owner's arena read-only, validate it, and create this
 * worker's ring segment. Sets self->mem, mem_len, seg, seg_len. */
static bool
attach_worker (CacheObject *self, const char *arena_path, const char *segment_path,
               unsigned long long ring_bytes)
{
   struct stat st;
   char err[256];
   void *mem = MAP_FAILED, *seg = MAP_FAILED;
   int fd = open_private (arena_path, O_RDONLY, &st);

   if (fd < 0) {
      return false;
   }
   if (st.st_size < (off_t) sizeof (cqc_arena_header_t)) {
      PyErr_Format (PyExc_ValueError, "%s is too small to be an arena", arena_path);
      goto fail;
   }
   mem = mmap (NULL, (size_t) st.st_size, PROT_READ, MAP_SHARED, fd, 0);
   close (fd);
   fd = -1;
   if (mem == MAP_FAILED) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, arena_path);
      goto fail;
   }
   if (!cqc_arena_r_attach (&self->arena, mem, (uint64_t) st.st_size, err, sizeof err)) {
      PyErr_Format (PyExc_ValueError, "cannot attach to %s: %s", arena_path, err);
      goto fail;
   }
   if (self->arena.hdr->heartbeat_timeout_ns == 0) {
      /* Every owner sets one before publishing the arena (arena.h). */
      PyErr_Format (PyExc_ValueError, "cannot attach to %s: it has no heartbeat timeout",
                    arena_path);
      goto fail;
   }
   if (self->arena.hdr->owner_uid != (uint32_t) getuid ()) {
      PyErr_Format (PyExc_PermissionError, "the arena's owner runs as uid %u, not %u",
                    self->arena.hdr->owner_uid, (unsigned) getuid ());
      goto fail;
   }
   if (ring_bytes < CQC_RING_DATA_OFF + 4096u || ring_bytes > (1u << 30)) {
      PyErr_SetString (PyExc_ValueError, "ring_bytes out of range");
      goto fail;
   }
   fd = open (segment_path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
   if (fd < 0) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, segment_path);
      goto fail;
   }
   if ((errno = size_shared_file (fd, ring_bytes)) != 0) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, segment_path);
      unlink (segment_path);
      goto fail;
   }
   seg = mmap (NULL, ring_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
   if (seg == MAP_FAILED || !cqc_ring_format (&self->ring, seg, ring_bytes, (uint32_t) getpid ())) {
      PyErr_SetFromErrnoWithFilename (PyExc_OSError, segment_path);
      unlink (segment_path);
      goto fail;
   }
   close (fd);
   self->mem = mem;
   self->mem_len = (size_t) st.st_size;
   self->seg = seg;
   self->seg_len = ring_bytes;
   return true;

fail:
   if (fd >= 0) {
      close (fd);
   }
   if (seg != MAP_FAILED) {
      munmap (seg, ring_bytes);
   }
   if (mem != MAP_FAILED) {
      munmap (mem, (size_t) st.st_size);
   }
   memset (&self->arena, 0, sizeof self->arena);
   return false;
}

static int
Cache_init (CacheObject *self, PyObject *args, PyObject *kwds)
{
   static char *kwlist[] = {"budget_bytes", "slot_count",    "uri",          "max_await_time_ms",
                            "decode",       "objectid_type", "closed_error", "forked_error",
                            "mode",         "arena_path",    "segment_path", "ring_bytes",
                            "heartbeat_timeout_ms", "arena_bytes", NULL};
   int mode = MODE_LOCAL;
   const char *arena_path = NULL, *segment_path = NULL;
   unsigned long long ring_bytes = 0, beat_ms = 1000, arena_bytes = 0;
   unsigned long long budget;
   unsigned int slots;
   const char *uri = NULL;
   long long await_ms;
   PyObject *decode, *oid, *closed_error, *forked_error;
   cqc_geometry_t geo = {0};
   cqc_arena_owner_t who = {0};
   char err[256];
   uint64_t need;
   void *mem;

   if (self->mem) {
      PyErr_SetString (PyExc_RuntimeError, "Cache is already initialized");
      return -1;
   }
   self->fork_gen = g_fork_gen;
   if (!PyArg_ParseTupleAndKeywords (args, kwds, "KIzLOOOO|izzKKK", kwlist, &budget, &slots,
                                     &uri, &await_ms, &decode, &oid, &closed_error, &forked_error,
                                     &mode, &arena_path, &segment_path, &ring_bytes, &beat_ms,
                                     &arena_bytes)) {
      return -1;
   }
   if (mode != MODE_LOCAL && mode != MODE_OWNER && mode != MODE_WORKER) {
      PyErr_SetString (PyExc_ValueError, "invalid mode");
      return -1;
   }
   if (mode != MODE_LOCAL && !arena_path) {
      PyErr_SetString (PyExc_ValueError, "a shared arena needs arena_path");
      return -1;
   }
   geo.budget_bytes = budget;
   geo.slot_count = slots;
   if (mode == MODE_WORKER) {
      if (!segment_path || !attach_worker (self, arena_path, segment_path, ring_bytes)) {
         if (!PyErr_Occurred ()) {
            PyErr_SetString (PyExc_ValueError, "a worker needs segment_path");
         }
         return -1;
      }
      mem = self->mem;
      need = self->mem_len;
      uri = NULL; /* the owner follows the streams */
   } else {
      need = cqc_arena_required_bytes (&geo);
      if (arena_bytes) {
         if (arena_bytes < need) {
            PyErr_Format (PyExc_ValueError,
                          "arena_bytes (%llu) is smaller than the %llu bytes this budget and "
                          "slot count need",
                          arena_bytes, (unsigned long long) need);
            return -1;
         }
         need = arena_bytes;
      }
      mem = mode == MODE_OWNER ? create_shared (arena_path, need)
                               /* private: pages are committed only when touched */
                               : mmap (NULL, need, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (mem == MAP_FAILED) {
         if (!PyErr_Occurred ()) {
            PyErr_SetFromErrno (PyExc_OSError);
         }
         return -1;
      }
      /* Written by the format, before the magic: a worker attaching at once
       * sees them (arena.h). */
      who.uid = (uint32_t) getuid ();
      who.pid = (uint32_t) getpid ();
      who.heartbeat_timeout_ns = mode == MODE_OWNER ? beat_ms * 1000000ull : 0;
      if (!cqc_arena_format (&self->arena, mem, need, &geo, &who, err, sizeof err)) {
         munmap (mem, need);
         PyErr_SetString (PyExc_ValueError, err);
         return -1;
      }
   }
   self->mode = mode;
   /* From here on, Cache_dealloc releases whatever init leaves behind. */
   self->mem = mem;
   self->mem_len = need;
   self->streams = PyMem_Calloc (self->arena.geo.db_count, sizeof (cqc_stream_t *));
   self->final_info = PyMem_Calloc (self->arena.geo.db_count, sizeof (cqc_stream_info_t));
   self->floor_ts = PyMem_Calloc (self->arena.geo.db_count, sizeof (uint64_t));
   self->floor_ns = PyMem_Calloc (self->arena.geo.db_count, sizeof (uint64_t));
   self->memo = PyMem_Calloc (MEMO_BUCKETS * MEMO_WAYS, sizeof (memo_t));
   if (!self->streams || !self->final_info || !self->floor_ts || !self->floor_ns || !self->memo) {
      PyErr_NoMemory ();
      return -1;
   }
   if (uri) {
      self->uri = strdup (uri);
      if (!self->uri) {
         PyErr_NoMemory ();
         return -1;
      }
   }
   pthread_mutex_init (&self->lock, NULL);
   self->writer.arena = &self->arena;
   self->writer.lock = &self->lock;
   if (mode == MODE_OWNER) {
      self->owner = cqc_owner_start (&self->writer, err, sizeof err);
      if (!self->owner) {
         PyErr_SetString (PyExc_RuntimeError, err);
         return -1;
      }
   }
   self->max_await_ms = await_ms;
   self->fork_gen = g_fork_gen;
   Py_INCREF (decode);
   self->decode = decode;
   Py_INCREF (oid);
   self->objectid_type = oid;
   Py_INCREF (closed_error);
   self->closed_error = closed_error;
   Py_INCREF (forked_error);
   self->forked_error = forked_error;
   return 0;
}

/* Stop every follower; the GIL is released while threads finish. The
 * pointers are cleared first (with the GIL), so a concurrent streams() never
 * sees a follower being freed; their final info is published afterwards. */
static void
stop_streams (CacheObject *self)
{
   uint32_t i, n = self->arena.hdr ? self->arena.geo.db_count : 0;
   cqc_stream_t **stopping;
   cqc_stream_info_t *info;

   if (!self->streams || !self->final_info) {
      return;
   }
   stopping = PyMem_Calloc (n ? n : 1, sizeof *stopping);
   info = PyMem_Calloc (n ? n : 1, sizeof *info);
   if (!stopping || !info) {
      /* Without memory for the copies, stop the followers in place. */
      PyMem_Free (stopping);
      PyMem_Free (info);
      for (i = 0; i < n; i++) {
         cqc_stream_t *st = self->streams[i];
         self->streams[i] = NULL;
         cqc_stream_destroy (st);
      }
      return;
   }
   for (i = 0; i < n; i++) {
      stopping[i] = self->streams[i];
      self->streams[i] = NULL;
      if (stopping[i]) {
         cqc_stream_signal_stop (stopping[i]);
      }
   }
   Py_BEGIN_ALLOW_THREADS
   for (i = 0; i < n; i++) {
      if (stopping[i]) {
         cqc_stream_destroy_keep_info (stopping[i], &info[i]);
         info[i].state = CQC_STREAM_CLOSED;
      }
   }
   Py_END_ALLOW_THREADS
   for (i = 0; i < n; i++) {
      if (stopping[i]) {
         self->final_info[i] = info[i];
      }
   }
   PyMem_Free (stopping);
   PyMem_Free (info);
}

/* Cache is a heap type (the limited API has no static types): each instance
 * holds a reference to its type, released once the memory is freed. */
static void
free_instance (PyObject *obj)
{
   PyTypeObject *tp = Py_TYPE (obj);
   freefunc tp_free = (freefunc) PyType_GetSlot (tp, Py_tp_free);
   tp_free (obj);
   Py_DECREF (tp);
}

static void
Cache_dealloc (CacheObject *self)
{
   bool same_process = self->fork_gen == g_fork_gen;
   if (self->mem && same_process) {
      stop_streams (self);
      if (self->owner) {
         Py_BEGIN_ALLOW_THREADS
         cqc_owner_destroy (self->owner);
         Py_END_ALLOW_THREADS
         self->owner = NULL;
      }
      pthread_mutex_destroy (&self->lock);
   }
   if (self->seg) {
      munmap (self->seg, self->seg_len);
   }
   /* In a forked child the threads do not exist and the lock may be held by
    * one of them in the parent's image: leave both alone. */
   if (self->mem) {
      munmap (self->mem, self->mem_len);
   }
   PyMem_Free (self->streams);
   PyMem_Free (self->final_info);
   PyMem_Free (self->floor_ts);
   PyMem_Free (self->floor_ns);
   PyMem_Free (self->memo);
   if (self->uri) {
      memset (self->uri, 0, strlen (self->uri));
      free (self->uri);
   }
   Py_XDECREF (self->decode);
   Py_XDECREF (self->objectid_type);
   Py_XDECREF (self->closed_error);
   Py_XDECREF (self->forked_error);
   free_instance ((PyObject *) self);
}

/* ------------------------------------------------------------------------ */
/* Keys                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct {
   uint8_t stack[KEY_STACK];
   uint8_t *buf;
   uint32_t len;
} key_t_;

static bool
key_build (key_t_ *k, uint8_t kind, uint32_t ns_idx, const uint8_t *filter, uint32_t flen,
           const uint8_t *rest, uint32_t rlen)
{
   uint64_t total = 9ull + flen + rlen;
   if (total > 0x7fffffffull) {
      PyErr_SetString (PyExc_ValueError, "cache key too large");
      return false;
   }
   k->buf = total <= KEY_STACK ? k->stack : PyMem_Malloc (total);
   if (!k->buf) {
      PyErr_NoMemory ();
      return false;
   }
   cqc_key_write (k->buf, kind, ns_idx, filter, flen, rest, rlen);
   k->len = (uint32_t) total;
   return true;
}

static void
key_free (key_t_ *k)
{
   if (k->buf && k->buf != k->stack) {
      PyMem_Free (k->buf);
   }
   k->buf = NULL;
}

/* Encode {"_id": v} as PyMongo does for int, str and ObjectId. Returns the
 * BSON length, 0 when this fast path does not apply (no exception set), or
 * -1 with an exception set. */
static Py_ssize_t
encode_id_filter (CacheObject *self, PyObject *v, uint8_t *out, size_t cap)
{
   uint8_t *p = out + 4;
   int32_t total;

   if (PyLong_CheckExact (v)) {
      int overflow = 0;
      long long x = PyLong_AsLongLongAndOverflow (v, &overflow);
      if (overflow || (x == -1 && PyErr_Occurred ())) {
         PyErr_Clear ();
         return 0; /* let PyMongo say what it thinks of this number */
      }
      if (x >= INT32_MIN && x <= INT32_MAX) {
         int32_t x32 = (int32_t) x;
         *p++ = 0x10;
         memcpy (p, "_id", 4);
         p += 4;
         memcpy (p, &x32, 4);
         p += 4;
      } else {
         int64_t x64 = (int64_t) x;
         *p++ = 0x12;
         memcpy (p, "_id", 4);
         p += 4;
         memcpy (p, &x64, 8);
         p += 8;
      }
   } else if (PyUnicode_CheckExact (v)) {
      Py_ssize_t n;
      const char *s = PyUnicode_AsUTF8AndSize (v, &n);
      int32_t slen;
      if (!s) {
         PyErr_Clear ();
         return 0;
      }
      if ((size_t) n + 32 > cap || memchr (s, '\0', (size_t) n)) {
         return 0;
      }
      slen = (int32_t) n + 1;
      *p++ = 0x02;
      memcpy (p, "_id", 4);
      p += 4;
      memcpy (p, &slen, 4);
      p += 4;
      memcpy (p, s, (size_t) n + 1);
      p += n + 1;
   } else if (Py_TYPE (v) == (PyTypeObject *) self->objectid_type) {
      PyObject *bin = PyObject_GetAttrString (v, "binary");
      if (!bin) {
         return -1;
      }
      if (!PyBytes_Check (bin) || PyBytes_Size (bin) != 12) {
         Py_DECREF (bin);
         return 0;
      }
      *p++ = 0x07;
      memcpy (p, "_id", 4);
      p += 4;
      memcpy (p, PyBytes_AsString (bin), 12);
      p += 12;
      Py_DECREF (bin);
   } else {
      return 0;
   }
   *p++ = 0;
   total = (int32_t) (p - out);
   memcpy (out, &total, 4);
   return total;
}

/* ------------------------------------------------------------------------ */
/* Lookups                                                                  */
/* ------------------------------------------------------------------------ */

static bool
memo_current (const CacheObject *self, const memo_t *m)
{
   return m->used && m->floor_ts == self->floor_ts[m->db_idx];
}

static bool
memo_allows (const CacheObject *self, uint32_t db_idx, uint64_t hash)
{
   const memo_t *bucket = &self->memo[(hash % MEMO_BUCKETS) * MEMO_WAYS];
   uint32_t w;
   for (w = 0; w < MEMO_WAYS; w++) {
      if (bucket[w].hash == hash && bucket[w].db_idx == db_idx && memo_current (self, &bucket[w])) {
         return true;
      }
   }
   return false;
}

/* Whether a pending write of this process (CacheObject.pending) may make
 * the entry of this lookup (namespace, filter) older than what the process
 * wrote. Frees the pending writes of the database the stream has applied. */
static bool
pending_blocks (CacheObject *self, uint32_t ns_idx, uint32_t db_idx, const uint8_t *filter,
                uint32_t flen)
{
   uint64_t applied = 0, quiet = 0, id_hash;
   bool loaded = false, classified = false, identity = false;
   uint32_t cell = CQC_NO_CELL, i;

   for (i = 0; i < PENDING_MAX && self->pending_used; i++) {
      pending_t *p = &self->pending[i];
      if (!p->used || p->db_idx != db_idx) {
         continue;
      }
      if (!loaded) {
         applied = cqc_arena_r_applied (&self->arena, db_idx);
         quiet = cqc_arena_r_quiet (&self->arena, db_idx);
         loaded = true;
      }
      if (applied >= p->ts || (p->quiet && quiet >= p->quiet)) {
         p->used = 0; /* applied: the entries reflect it */
         self->pending_used--;
         continue;
      }
      if (p->ns_idx != ns_idx) {
         continue;
      }
      if (!classified) {
         identity = cqc_filter_identity (filter, flen, &id_hash);
         if (identity) {
            cell = cqc_id_cell (id_hash, ns_idx, self->arena.geo.idgen_count);
         }
         classified = true;
      }
      if (!identity || cell == p->cell) {
         return true;
      }
   }
   return false;
}

/* Look up a built key; returns a new reference (the entry decoded with
 * decode(bytes, codec_options), None, or a sentinel) or NULL with an
 * exception. */
static PyObject *
lookup_key (CacheObject *self, uint32_t ns_idx, uint32_t db_idx, const key_t_ *k,
            const uint8_t *filter, uint32_t flen, PyObject *codec_options, PyObject *decode)
{
   alloc_ctx_t ctx = {NULL};
   bool stalled;
   cqc_lookup_t r;
   uint64_t hash;
   bool behind;
   PyObject *doc;

   if (cqc_arena_r_db_state (&self->arena, db_idx, &stalled) != CQC_STREAM_HEALTHY) {
      self->unhealthy++;
      Py_INCREF (g_unhealthy);
      return g_unhealthy;
   }
   /* The causal floor. Acquire: the lookup below sees every invalidation
    * the applied (or quiet) time covers, so an entry it finds is at least
    * as new as the floor. Behind it, an entry found may be older than what
    * the process has seen and is not served; a miss still is one (its read
    * goes to MongoDB and is admitted). */
   hash = cqc_hash_bytes (k->buf, k->len, 0);
   behind = (cqc_arena_r_applied (&self->arena, db_idx) < self->floor_ts[db_idx] &&
             (!self->floor_ns[db_idx] ||
              cqc_arena_r_quiet (&self->arena, db_idx) < self->floor_ns[db_idx]) &&
             !memo_allows (self, db_idx, hash)) ||
            (self->pending_used && pending_blocks (self, ns_idx, db_idx, filter, flen));
   r = cqc_arena_r_lookup (&self->arena, ns_idx, hash, k->buf, k->len, alloc_bytes, discard_bytes,
                           &ctx);
   if (r == CQC_LOOKUP_MISS) {
      self->misses++;
      Py_INCREF (g_miss);
      return g_miss;
   }
   if (behind) {
      Py_XDECREF (ctx.bytes);
      self->behind++;
      Py_INCREF (g_behind);
      return g_behind;
   }
   self->hits++;
   if (r == CQC_LOOKUP_NOT_FOUND) {
      self->not_found_hits++;
      Py_RETURN_NONE;
   }
   /* PyObject_Vectorcall is not in the 3.11 limited API; this call builds
    * no tuple either (CPython passes the arguments on the C stack). */
   doc = PyObject_CallFunctionObjArgs (decode, ctx.bytes, codec_options, NULL);
   Py_DECREF (ctx.bytes);
   return doc;
}

static bool
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

/* How many after() blocks are open in this process (causal.py): while any
 * is, the fast path answers FALLBACK, so the read takes the path that
 * checks the block's token. Changed and read with the GIL held. */
static long g_after_blocks;

static PyObject *
mod_after_blocks (PyObject *Py_UNUSED (m), PyObject *arg)
{
   long n = PyLong_AsLong (arg);
   if (n == -1 && PyErr_Occurred ()) {
      return NULL;
   }
   g_after_blocks = n;
   Py_RETURN_NONE;
}

/* lookup_id(ns_idx, db_idx, id_value, codec_options) */
static PyObject *
Cache_lookup_id (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint8_t filter[FAST_STR_MAX + 32];
   uint32_t ns_idx, db_idx;
   Py_ssize_t flen;
   key_t_ k;
   PyObject *res;

   if (nargs != 4) {
      PyErr_SetString (PyExc_TypeError, "lookup_id takes 4 arguments");
      return NULL;
   }
   if (!check_usable (self) ||
       !parse_idx (args[0], &ns_idx, self->arena.geo.ns_count, "ns_idx") ||
       !parse_idx (args[1], &db_idx, self->arena.geo.db_count, "db_idx")) {
      return NULL;
   }
   flen = encode_id_filter (self, args[2], filter, sizeof filter);
   if (flen < 0) {
      return NULL;
   }
   if (flen == 0 || g_after_blocks) {
      Py_INCREF (g_fallback);
      return g_fallback;
   }
   if (!key_build (&k, 1, ns_idx, filter, (uint32_t) flen, NULL, 0)) {
      return NULL;
   }
   res = lookup_key (self, ns_idx, db_idx, &k, filter, (uint32_t) flen, args[3], self->decode);
   key_free (&k);
   return res;
}

static bool
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

/* lookup(ns_idx, db_idx, kind, filter_bson, rest, codec_options[, decode]):
 * decode(bytes, codec_options) builds the result of a hit; the cache's
 * decode (one document) when omitted. */
static PyObject *
Cache_lookup (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t ns_idx, db_idx, kind;
   Py_buffer fb = {0}, rb = {0};
   key_t_ k = {.buf = NULL};
   PyObject *res = NULL;

   if (nargs != 6 && nargs != 7) {
      PyErr_SetString (PyExc_TypeError, "lookup takes 6 or 7 arguments");
      return NULL;
   }
   if (nargs == 7 && !PyCallable_Check (args[6])) {
      PyErr_SetString (PyExc_TypeError, "decode must be callable");
      return NULL;
   }
   if (!check_usable (self) ||
       !parse_idx (args[0], &ns_idx, self->arena.geo.ns_count, "ns_idx") ||
       !parse_idx (args[1], &db_idx, self->arena.geo.db_count, "db_idx") ||
       !parse_idx (args[2], &kind, 256, "kind")) {
      return NULL;
   }
   if (!get_buffer (args[3], &fb, "filter")) {
      goto cleanup;
   }
   if (!get_buffer (args[4], &rb, "rest")) {
      goto cleanup;
   }
   if (!key_build (&k, (uint8_t) kind, ns_idx, fb.buf, (uint32_t) fb.len, rb.buf,
                   (uint32_t) rb.len)) {
      goto cleanup;
   }
   res = lookup_key (self, ns_idx, db_idx, &k, fb.buf, (uint32_t) fb.len, args[5],
                     nargs == 7 ? args[6] : self->decode);
cleanup:
   key_free (&k);
   if (fb.obj) {
      PyBuffer_Release (&fb);
   }
   if (rb.obj) {
      PyBuffer_Release (&rb);
   }
   return res;
}

/* ------------------------------------------------------------------------ */
/* Capture and admission                                                    */
/* ------------------------------------------------------------------------ */

/* capture(ns_idx, filter_bson) -> token bytes, or None if the stream does
 * not serve (the caller then bypasses). */
static PyObject *
Cache_capture (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t ns_idx, cell = CQC_NO_CELL;
   Py_buffer fb = {0};
   uint64_t id_hash;
   cqc_token_t tok;

   if (nargs != 2) {
      PyErr_SetString (PyExc_TypeError, "capture takes 2 arguments");
      return NULL;
   }
   if (!check_usable (self) ||
       !parse_idx (args[0], &ns_idx, self->arena.geo.ns_count, "ns_idx") ||
       !get_buffer (args[1], &fb, "filter")) {
      return NULL;
   }
   if (cqc_filter_identity (fb.buf, (size_t) fb.len, &id_hash)) {
      cell = cqc_id_cell (id_hash, ns_idx, self->arena.geo.idgen_count);
   }
   PyBuffer_Release (&fb);
   cqc_arena_r_capture (&self->arena, ns_idx, cell, &tok);
   if (!tok.healthy) {
      Py_RETURN_NONE;
   }
   return PyBytes_FromStringAndSize ((const char *) &tok, sizeof tok);
}

/* Remember a key this process's own miss admitted (see CacheObject.memo). */
static void
memo_record (CacheObject *self, const cqc_token_t *tok, const key_t_ *k, uint64_t floor_ts)
{
   uint64_t hash;
   memo_t *bucket, *slot = NULL;
   uint32_t w;

   if (!floor_ts || tok->db_idx >= self->arena.geo.db_count) {
      return;
   }
   hash = cqc_hash_bytes (k->buf, k->len, 0);
   bucket = &self->memo[(hash % MEMO_BUCKETS) * MEMO_WAYS];
   for (w = 0; w < MEMO_WAYS && !slot; w++) {
      if (bucket[w].hash == hash && bucket[w].db_idx == tok->db_idx) {
         slot = &bucket[w]; /* the same key again */
      }
   }
   for (w = 0; w < MEMO_WAYS && !slot; w++) {
      if (!memo_current (self, &bucket[w])) {
         slot = &bucket[w];
      }
   }
   if (!slot) {
      slot = &bucket[self->memo_next++ % MEMO_WAYS];
   }
   *slot = (memo_t){hash, floor_ts, tok->db_idx, 1};
}

/* admit(token, kind, filter_bson, rest, value_or_None[, memo_floor]) ->
 * result code; kind may carry CQC_KIND_REBIND (the constant KIND_REBIND).
 * memo_floor (0: none): the database's causal floor this miss's read stands
 * for, when nothing else was observed there since its token was taken. */
static PyObject *
Cache_admit (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   unsigned long long memo_floor = 0;
   uint32_t kind;
   Py_buffer tb = {0}, fb = {0}, rb = {0}, vb = {0};
   key_t_ k = {.buf = NULL};
   cqc_token_t tok;
   cqc_admit_t r;
   uint64_t id_hash;
   bool identity, rebind;
   PyObject *res = NULL;

   if (nargs != 5 && nargs != 6) {
      PyErr_SetString (PyExc_TypeError, "admit takes 5 or 6 arguments");
      return NULL;
   }
   if (!check_usable (self) || !parse_idx (args[1], &kind, 256, "kind")) {
      return NULL;
   }
   if (nargs == 6) {
      memo_floor = PyLong_AsUnsignedLongLong (args[5]);
      if (memo_floor == (unsigned long long) -1 && PyErr_Occurred ()) {
         return NULL;
      }
   }
   /* kind | CQC_KIND_REBIND: a find_one by a unique key, to be validated by
    * the identity of the document it found (cqc_arena_w_rebind). */
   rebind = (kind & CQC_KIND_REBIND) != 0;
   kind &= ~CQC_KIND_REBIND;
   if (!get_buffer (args[0], &tb, "token") || !get_buffer (args[2], &fb, "filter") ||
       !get_buffer (args[3], &rb, "rest")) {
      goto cleanup;
   }
   if (args[4] != Py_None && !get_buffer (args[4], &vb, "value")) {
      goto cleanup;
   }
   if (tb.len != (Py_ssize_t) sizeof tok) {
      PyErr_SetString (PyExc_ValueError, "invalid token");
      goto cleanup;
   }
   memcpy (&tok, tb.buf, sizeof tok);
   if (tok.ns_idx >= self->arena.geo.ns_count) {
      PyErr_SetString (PyExc_ValueError, "invalid token");
      goto cleanup;
   }
   /* The token's identity cell must be the one this filter maps to. */
   identity = cqc_filter_identity (fb.buf, (size_t) fb.len, &id_hash);
   if ((identity ? cqc_id_cell (id_hash, tok.ns_idx, self->arena.geo.idgen_count)
                 : CQC_NO_CELL) != tok.id_cell) {
      PyErr_SetString (PyExc_ValueError, "token does not match the filter");
      goto cleanup;
   }
   if ((self->mode != MODE_WORKER || memo_floor) &&
       !key_build (&k, (uint8_t) kind, tok.ns_idx, fb.buf, (uint32_t) fb.len, rb.buf,
                   (uint32_t) rb.len)) {
      goto cleanup;
   }
   if (self->mode == MODE_WORKER) {
      cqc_ring_push_t pushed = cqc_ring_push (
         &self->ring, (uint8_t) (kind | (rebind ? CQC_KIND_REBIND : 0u)), vb.obj == NULL, &tok,
         fb.buf, (uint32_t) fb.len, rb.buf, (uint32_t) rb.len, vb.obj ? vb.buf : NULL,
         vb.obj ? (uint32_t) vb.len : 0);
      if (pushed == CQC_RING_PUSHED) {
         memo_record (self, &tok, &k, memo_floor);
      }
      res = PyLong_FromLong (pushed == CQC_RING_PUSHED ? ADMIT_QUEUED : ADMIT_DROPPED);
      goto cleanup;
   }
   pthread_mutex_lock (&self->lock);
   if (rebind && vb.obj) {
      cqc_arena_w_rebind (&self->arena, &tok, vb.buf, (uint32_t) vb.len);
   }
   r = cqc_arena_w_admit (&self->arena, &tok, cqc_hash_bytes (k.buf, k.len, 0), k.buf, k.len,
                          vb.obj ? vb.buf : NULL, vb.obj ? (uint32_t) vb.len : 0,
                          vb.obj ? 0 : CQC_ENTRY_NOT_FOUND);
   pthread_mutex_unlock (&self->lock);
   if (r == CQC_ADMIT_OK) {
      memo_record (self, &tok, &k, memo_floor);
   }
   res = PyLong_FromLong ((long) r);
cleanup:
   key_free (&k);
   if (tb.obj) {
      PyBuffer_Release (&tb);
   }
   if (fb.obj) {
      PyBuffer_Release (&fb);
   }
   if (rb.obj) {
      PyBuffer_Release (&rb);
   }
   if (vb.obj) {
      PyBuffer_Release (&vb);
   }
   return res;
}

/* ------------------------------------------------------------------------ */
/* Registration, state, statistics                                          */
/* ------------------------------------------------------------------------ */

/* register(db, coll) -> (ns_idx, db_idx); starts the db's follower. */
static PyObject *
Cache_register (CacheObject *self, PyObject *args)
{
   const char *db, *coll;
   Py_ssize_t db_len, coll_len;
   uint32_t ns_idx, db_idx;
   char err[256];
   bool ok;

   if (!PyArg_ParseTuple (args, "s#s#", &db, &db_len, &coll, &coll_len)) {
      return NULL;
   }
   if (!check_usable (self)) {
      return NULL;
   }
   if (self->mode == MODE_WORKER) {
      PyErr_SetString (PyExc_RuntimeError, "a worker registers namespaces through its owner");
      return NULL;
   }
   pthread_mutex_lock (&self->lock);
   ok = cqc_arena_w_ns_register (&self->arena, db, (size_t) db_len, coll, (size_t) coll_len,
                                 &ns_idx, err, sizeof err);
   if (ok) {
      db_idx = self->arena.nss[ns_idx].db_idx;
   }
   pthread_mutex_unlock (&self->lock);
   if (!ok) {
      PyErr_SetString (PyExc_ValueError, err);
      return NULL;
   }
   if (self->uri && !self->streams[db_idx]) {
      self->streams[db_idx] =
         cqc_stream_start (&self->writer, db_idx, self->arena.dbs[db_idx].name, self->uri,
                           self->max_await_ms, err, sizeof err);
      if (!self->streams[db_idx]) {
         PyErr_SetString (PyExc_RuntimeError, err);
         return NULL;
      }
   }
   return Py_BuildValue ("(II)", ns_idx, db_idx);
}

/* observe(db_idx, cluster_time, monotonic_ns): raise the database's causal
 * floor to the cluster time ((seconds << 32) | increment) of something this
 * process read or wrote and, on a deployment of one member, the time it did
 * (0: no such proof); lower values leave the floor as it is. */
static PyObject *
Cache_observe (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t db_idx;
   unsigned long long ts, ns;

   if (nargs != 3) {
      PyErr_SetString (PyExc_TypeError, "observe takes 3 arguments");
      return NULL;
   }
   if (!check_usable (self) || !parse_idx (args[0], &db_idx, self->arena.geo.db_count, "db_idx")) {
      return NULL;
   }
   ts = PyLong_AsUnsignedLongLong (args[1]);
   if (ts == (unsigned long long) -1 && PyErr_Occurred ()) {
      return NULL;
   }
   ns = PyLong_AsUnsignedLongLong (args[2]);
   if (ns == (unsigned long long) -1 && PyErr_Occurred ()) {
      return NULL;
   }
   if (ts > self->floor_ts[db_idx]) {
      self->floor_ts[db_idx] = ts;
   }
   if (ns > self->floor_ns[db_idx]) {
      self->floor_ns[db_idx] = ns;
   }
   Py_RETURN_NONE;
}

/* observe_id(db_idx, ns_idx, filter_bson, cluster_time, monotonic_ns) ->
 * bool: this process wrote the one document {"_id": v} of the namespace at
 * that cluster time (observed at monotonic_ns on a one-member deployment, 0
 * otherwise). False when the filter is not an identity filter or no slot is
 * free: the caller then raises the database's floor instead. */
static PyObject *
Cache_observe_id (CacheObject *self, PyObject *const *args, Py_ssize_t nargs)
{
   uint32_t db_idx, ns_idx, i;
   unsigned long long ts, ns;
   Py_buffer fb = {0};
   uint64_t id_hash;
   bool identity;

   if (nargs != 5) {
      PyErr_SetString (PyExc_TypeError, "observe_id takes 5 arguments");
      return NULL;
   }
   if (!check_usable (self) || !parse_idx (args[0], &db_idx, self->arena.geo.db_count, "db_idx") ||
       !parse_idx (args[1], &ns_idx, self->arena.geo.ns_count, "ns_idx")) {
      return NULL;
   }
   ts = PyLong_AsUnsignedLongLong (args[3]);
   if (ts == (unsigned long long) -1 && PyErr_Occurred ()) {
      return NULL;
   }
   ns = PyLong_AsUnsignedLongLong (args[4]);
   if (ns == (unsigned long long) -1 && PyErr_Occurred ()) {
      return NULL;
   }
   if (!get_buffer (args[2], &fb, "filter")) {
      return NULL;
   }
   identity = cqc_filter_identity (fb.buf, (size_t) fb.len, &id_hash);
   PyBuffer_Release (&fb);
   if (!identity) {
      Py_RETURN_FALSE;
   }
   for (i = 0; i < PENDING_MAX; i++) {
      pending_t *p = &self->pending[i];
      if (p->used && (cqc_arena_r_applied (&self->arena, p->db_idx) >= p->ts ||
                      (p->quiet && cqc_arena_r_quiet (&self->arena, p->db_idx) >= p->quiet))) {
         p->used = 0; /* applied */
         self->pending_used--;
      }
      if (!p->used) {
         *p = (pending_t){ts, ns, db_idx, ns_idx,
                          cqc_id_cell (id_hash, ns_idx, self->arena.geo.idgen_count), 1};
         self->pending_used++;
         Py_RETURN_TRUE;
      }
   }
   Py_RETURN_FALSE;
}

/* applied(db_idx) -> the database's applied time as readers see it. */
static PyObject *
Cache_applied (CacheObject *self, PyObject *arg)
{
   uint32_t db_idx;
   if (!check_usable (self) || !parse_idx (arg, &db_idx, self->arena.geo.db_count, "db_idx")) {
      return NULL;
   }
   return PyLong_FromUnsignedLongLong (cqc_arena_r_applied (&self->arena, db_idx));
}

/* db_state(db_idx) -> (state, stalled) as readers see it. */
static PyObject *
Cache_db_state (CacheObject *self, PyObject *arg)
{
   uint32_t db_idx;
   bool stalled;
   cqc_stream_state_t st;
   if (!check_usable (self) || !parse_idx (arg, &db_idx, self->arena.geo.db_count, "db_idx")) {
      return NULL;
   }
   st = cqc_arena_r_db_state (&self->arena, db_idx, &stalled);
   return Py_BuildValue ("(iO)", (int) st, stalled ? Py_True : Py_False);
}

/* ns_epoch(ns_idx) -> (epoch, db incarnation): what a collection probe's
 * verdict is valid for. */
static PyObject *
Cache_ns_epoch (CacheObject *self, PyObject *arg)
{
   uint32_t ns_idx, db_idx;
   unsigned long long epoch;
   unsigned int inc = 0;
   if (!check_usable (self) || !parse_idx (arg, &ns_idx, self->arena.geo.ns_count, "ns_idx")) {
      return NULL;
   }
   epoch = __atomic_load_n (&self->arena.nss[ns_idx].epoch, __ATOMIC_ACQUIRE);
   db_idx = self->arena.nss[ns_idx].db_idx;
   if (db_idx < self->arena.geo.db_count) {
      inc = __atomic_load_n (&self->arena.dbs[db_idx].incarnation, __ATOMIC_ACQUIRE);
   }
   return Py_BuildValue ("(KI)", epoch, inc);
}

#define SET_U64(d, name, v)                                     \
   do {                                                         \
      PyObject *o_ = PyLong_FromUnsignedLongLong (v);           \
      if (!o_ || PyDict_SetItemString (d, name, o_) < 0) {      \
         Py_XDECREF (o_);                                       \
         Py_DECREF (d);                                         \
         return NULL;                                           \
      }                                                         \
      Py_DECREF (o_);                                           \
   } while (0)

static PyObject *
Cache_stats (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   cqc_arena_header_t h;
   PyObject *d;

   if (self->fork_gen != g_fork_gen) {
      (void) check_usable (self);
      return NULL;
   }
   if (self->mode == MODE_WORKER) {
      memcpy (&h, self->arena.hdr, sizeof h); /* the owner's counters, racy */
   } else {
      pthread_mutex_lock (&self->lock);
      memcpy (&h, self->arena.hdr, sizeof h);
      pthread_mutex_unlock (&self->lock);
   }
   d = PyDict_New ();
   if (!d) {
      return NULL;
   }
   if (self->mode == MODE_WORKER) {
      /* The producer's own counts, not the segment's copy of them. */
      SET_U64 (d, "ring_pushed", self->ring.pushed);
      SET_U64 (d, "ring_dropped", self->ring.dropped);
      SET_U64 (d, "ring_damaged", self->ring.damaged);
   }
   if (self->owner) {
      cqc_owner_stats_t os;
      cqc_owner_get_stats (self->owner, &os);
      SET_U64 (d, "attached_rings", os.rings);
      SET_U64 (d, "ring_records", os.records);
      SET_U64 (d, "ring_dropped", os.dropped);
      SET_U64 (d, "ring_malformed", os.malformed);
      SET_U64 (d, "ring_damaged", os.damaged);
   }
   SET_U64 (d, "owner_pid", h.owner_pid);
   SET_U64 (d, "created_ns", h.created_ns);
   SET_U64 (d, "heartbeat_ns", h.heartbeat_ns);
   SET_U64 (d, "hits", self->hits);
   SET_U64 (d, "not_found_hits", self->not_found_hits);
   SET_U64 (d, "misses", self->misses);
   SET_U64 (d, "unhealthy_lookups", self->unhealthy);
   SET_U64 (d, "behind_lookups", self->behind);
   SET_U64 (d, "admissions", h.admissions);
   SET_U64 (d, "rejected_stale", h.rejected_stale);
   SET_U64 (d, "rejected_unhealthy", h.rejected_health);
   SET_U64 (d, "rejected_too_large", h.rejected_size);
   SET_U64 (d, "rejected_no_slot", h.rejected_probe);
   SET_U64 (d, "rejected_conflict", h.rejected_conflict);
   SET_U64 (d, "evictions", h.evictions);
   SET_U64 (d, "invalidations", h.invalidations);
   SET_U64 (d, "used_bytes", h.used_bytes);
   SET_U64 (d, "budget_bytes", h.geo.budget_bytes);
   SET_U64 (d, "entries", h.entries);
   SET_U64 (d, "slot_count", h.geo.slot_count);
   SET_U64 (d, "arena_bytes", h.arena_bytes);
   return d;
}

static const char *
state_name (cqc_stream_state_t st)
{
   switch (st) {
   case CQC_STREAM_NOT_STARTED:
      return "not_started";
   case CQC_STREAM_CONNECTING:
      return "connecting";
   case CQC_STREAM_HEALTHY:
      return "healthy";
   case CQC_STREAM_RECONNECTING:
      return "reconnecting";
   case CQC_STREAM_FAILED:
      return "failed";
   case CQC_STREAM_CLOSED:
   default:
      return "closed";
   }
}

/* streams() -> list of dicts, one per registered database. */
static PyObject *
Cache_streams (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   PyObject *list;
   uint32_t i;

   if (self->fork_gen != g_fork_gen) {
      (void) check_usable (self);
      return NULL;
   }
   list = PyList_New (0);
   if (!list) {
      return NULL;
   }
   for (i = 0; i < self->arena.geo.db_count && self->arena.dbs[i].used; i++) {
      cqc_stream_info_t info = {.state = CQC_STREAM_NOT_STARTED};
      bool stalled = false;
      uint32_t name_len;
      uint64_t applied;
      cqc_stream_state_t seen = cqc_arena_r_db_state (&self->arena, i, &stalled);
      PyObject *d;
      if (self->streams && self->streams[i]) {
         cqc_stream_get_info (self->streams[i], &info);
      } else if (self->closed && self->final_info && self->mode != MODE_WORKER) {
         info = self->final_info[i];
         info.state = CQC_STREAM_CLOSED;
      } else if (self->mode == MODE_WORKER) {
         /* The owner's followers, as published in the arena. */
         const cqc_db_t *db = &self->arena.dbs[i];
         info.state = (cqc_stream_state_t) __atomic_load_n (&db->health, __ATOMIC_ACQUIRE);
         if (info.state > CQC_STREAM_CLOSED) {
            info.state = CQC_STREAM_FAILED;
         }
         info.events = __atomic_load_n (&db->events, __ATOMIC_ACQUIRE);
         info.reconnects = db->reconnects;
         info.history_lost = db->history_lost;
      }
      /* The name is read from the arena: bounded, never trusted to end. */
      name_len = self->arena.dbs[i].name_len;
      if (name_len >= CQC_DB_NAME_MAX) {
         name_len = 0;
      }
      applied = __atomic_load_n (&self->arena.dbs[i].applied_ts, __ATOMIC_ACQUIRE);
      d = Py_BuildValue ("{s:s#,s:I,s:s,s:O,s:K,s:K,s:K,s:I,s:s,s:(II)}", "database",
                         self->arena.dbs[i].name, (Py_ssize_t) name_len, "db_idx", i, "state", state_name (info.state),
                         "stalled", (stalled && seen != CQC_STREAM_HEALTHY) ? Py_True : Py_False,
                         "events", (unsigned long long) info.events, "reconnects",
                         (unsigned long long) info.reconnects, "history_lost",
                         (unsigned long long) info.history_lost, "incarnation",
                         self->arena.dbs[i].incarnation, "last_error", info.last_error,
                         "applied_time", (unsigned int) (applied >> 32),
                         (unsigned int) (applied & 0xffffffffu));
      if (!d || PyList_Append (list, d) < 0) {
         Py_XDECREF (d);
         Py_DECREF (list);
         return NULL;
      }
      Py_DECREF (d);
   }
   return list;
}

/* attach_ring(path) -> id (MODE_OWNER): start draining a worker's ring. */
static PyObject *
Cache_attach_ring (CacheObject *self, PyObject *arg)
{
   const char *path = PyUnicode_AsUTF8AndSize (arg, NULL);
   char err[256];
   uint32_t id;
   if (!path || !check_usable (self)) {
      return NULL;
   }
   if (!self->owner) {
      PyErr_SetString (PyExc_RuntimeError, "only an owner drains rings");
      return NULL;
   }
   id = cqc_owner_attach (self->owner, path, err, sizeof err);
   if (!id) {
      PyErr_SetString (PyExc_ValueError, err);
      return NULL;
   }
   return PyLong_FromUnsignedLong (id);
}

/* detach_ring(id) (MODE_OWNER): drain what is left, unmap and unlink. */
static PyObject *
Cache_detach_ring (CacheObject *self, PyObject *arg)
{
   unsigned long id = PyLong_AsUnsignedLong (arg);
   if (PyErr_Occurred ()) {
      return NULL;
   }
   if (self->owner && self->fork_gen == g_fork_gen) {
      Py_BEGIN_ALLOW_THREADS
      cqc_owner_detach (self->owner, (uint32_t) id);
      Py_END_ALLOW_THREADS
   }
   Py_RETURN_NONE;
}

/* geometry() -> dict: what an attacher compares with what it expects. */
static PyObject *
Cache_geometry (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   const cqc_arena_header_t *h = self->arena.hdr;
   if (!h) {
      PyErr_SetString (PyExc_RuntimeError, "no arena");
      return NULL;
   }
   return Py_BuildValue ("{s:I,s:K,s:K,s:I,s:I,s:I,s:I,s:K}", "layout_version",
                         h->layout_version, "arena_bytes", (unsigned long long) h->arena_bytes,
                         "budget_bytes", (unsigned long long) h->geo.budget_bytes, "slot_count",
                         h->geo.slot_count, "owner_uid", h->owner_uid, "owner_pid",
                         h->owner_pid, "mode", (unsigned) self->mode, "heartbeat_timeout_ns",
                         (unsigned long long) h->heartbeat_timeout_ns);
}

/* check(): raise if this cache may not be used (closed, or forked). */
static PyObject *
Cache_check (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   if (!check_usable (self)) {
      return NULL;
   }
   Py_RETURN_NONE;
}

static PyObject *
Cache_close (CacheObject *self, PyObject *Py_UNUSED (ignored))
{
   if (self->fork_gen != g_fork_gen) {
      self->closed = true; /* nothing of the parent's threads exists here */
      Py_RETURN_NONE;
   }
   if (!self->closed) {
      self->closed = true;
      stop_streams (self);
      if (self->owner) {
         Py_BEGIN_ALLOW_THREADS
         cqc_owner_destroy (self->owner);
         Py_END_ALLOW_THREADS
         self->owner = NULL;
      }
   }
   Py_RETURN_NONE;
}

static PyObject *
Cache_closed (CacheObject *self, void *Py_UNUSED (closure))
{
   return PyBool_FromLong (self->closed);
}

static PyMethodDef Cache_methods[] = {
   {"lookup_id", (PyCFunction) (void (*) (void)) Cache_lookup_id, METH_FASTCALL,
    "lookup_id(ns_idx, db_idx, id, codec_options): fast identity lookup."},
   {"lookup", (PyCFunction) (void (*) (void)) Cache_lookup, METH_FASTCALL,
    "lookup(ns_idx, db_idx, kind, filter, rest, codec_options)."},
   {"capture", (PyCFunction) (void (*) (void)) Cache_capture, METH_FASTCALL,
    "capture(ns_idx, filter) -> token bytes or None if the stream does not serve."},
   {"admit", (PyCFunction) (void (*) (void)) Cache_admit, METH_FASTCALL,
    "admit(token, kind, filter, rest, value_or_None) -> result code."},
   {"register", (PyCFunction) Cache_register, METH_VARARGS,
    "register(db, coll) -> (ns_idx, db_idx)."},
   {"db_state", (PyCFunction) Cache_db_state, METH_O, "db_state(db_idx) -> (state, stalled)."},
   {"observe", (PyCFunction) (void (*) (void)) Cache_observe, METH_FASTCALL,
    "observe(db_idx, cluster_time, monotonic_ns): raise the database's causal floor."},
   {"applied", (PyCFunction) Cache_applied, METH_O, "applied(db_idx) -> applied cluster time."},
   {"observe_id", (PyCFunction) (void (*) (void)) Cache_observe_id, METH_FASTCALL,
    "observe_id(db_idx, ns_idx, filter, cluster_time, monotonic_ns) -> bool: a write to one document."},
   {"ns_epoch", (PyCFunction) Cache_ns_epoch, METH_O, "ns_epoch(ns_idx) -> (epoch, incarnation)."},
   {"stats", (PyCFunction) Cache_stats, METH_NOARGS, "Arena and lookup counters."},
   {"streams", (PyCFunction) Cache_streams, METH_NOARGS, "Change-stream followers."},
   {"close", (PyCFunction) Cache_close, METH_NOARGS, "Stop the followers."},
   {"check", (PyCFunction) Cache_check, METH_NOARGS, "Raise if closed or used after fork."},
   {"attach_ring", (PyCFunction) Cache_attach_ring, METH_O, "Owner: drain a worker's ring."},
   {"detach_ring", (PyCFunction) Cache_detach_ring, METH_O, "Owner: release a worker's ring."},
   {"geometry", (PyCFunction) Cache_geometry, METH_NOARGS, "Arena geometry and owner."},
   {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cache_getset[] = {
   {"closed", (getter) Cache_closed, NULL, "Whether close() was called.", NULL},
   {NULL, NULL, NULL, NULL, NULL},
};

/* A spec rather than a static PyTypeObject: the stable ABI (abi3) hides the
 * type object's layout, so the type is created from slots at import.
 * IMMUTABLETYPE keeps its attributes read-only, as a static type's are. */
static PyType_Slot Cache_slots[] = {
   {Py_tp_doc, (void *) "A cache arena with its writer and change-stream followers."},
   {Py_tp_new, (void *) PyType_GenericNew},
   {Py_tp_init, (void *) Cache_init},
   {Py_tp_dealloc, (void *) Cache_dealloc},
   {Py_tp_methods, Cache_methods},
   {Py_tp_getset, Cache_getset},
   {0, NULL},
};

static PyType_Spec Cache_spec = {
   .name = "client_query_cache._native.Cache",
   .basicsize = sizeof (CacheObject),
   .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
   .slots = Cache_slots,
};

/* ======================================================================== */
/* Module                                                                   */
/* ======================================================================== */

/* id_cell_of(filter_bson, ns_idx, count) -> cell or None: exposes the
 * canonical identity hashing for tests. */
static PyObject *
mod_identity_hash (PyObject *Py_UNUSED (m), PyObject *arg)
{
   Py_buffer b;
   uint64_t h;
   bool ok;
   if (PyObject_GetBuffer (arg, &b, PyBUF_SIMPLE) != 0) {
      return NULL;
   }
   ok = cqc_filter_identity (b.buf, (size_t) b.len, &h);
   PyBuffer_Release (&b);
   if (!ok) {
      Py_RETURN_NONE;
   }
   return PyLong_FromUnsignedLongLong (h);
}

static PyMethodDef module_methods[] = {
   {"after_blocks", mod_after_blocks, METH_O,
    "after_blocks(n): how many after() blocks are open (the fast path defers to them)."},
   {"identity_hash", mod_identity_hash, METH_O,
    "identity_hash(filter_bson) -> canonical _id hash, or None if not an identity filter."},
   {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
   PyModuleDef_HEAD_INIT, "client_query_cache._native",
   "C core of client-query-cache: arena, keys and change-stream followers.", -1,
   module_methods, NULL, NULL, NULL, NULL,
};

static void
quiet_log (mongoc_log_level_t level, const char *domain, const char *message, void *data)
{
   (void) level;
   (void) domain;
   (void) message;
   (void) data;
}

static PyObject *
make_sentinel (const char *name)
{
   return PyUnicode_FromFormat ("<cache %s>", name);
}

PyMODINIT_FUNC
PyInit__native (void)
{
   PyObject *m, *cache_type;
   static bool initialized;

   m = PyModule_Create (&moduledef);
   if (!m) {
      return NULL;
   }
   cache_type = PyType_FromSpec (&Cache_spec);
   if (!cache_type) {
      Py_DECREF (m);
      return NULL;
   }
   if (!initialized) {
      mongoc_init ();
      mongoc_log_set_handler (quiet_log, NULL);
      pthread_atfork (NULL, NULL, on_fork_child);
      initialized = true;
   }
   g_miss = make_sentinel ("miss");
   g_unhealthy = make_sentinel ("unhealthy");
   g_fallback = make_sentinel ("fallback");
   g_behind = make_sentinel ("behind");
   if (!g_miss || !g_unhealthy || !g_fallback || !g_behind) {
      Py_DECREF (cache_type);
      Py_DECREF (m);
      return NULL;
   }
   if (PyModule_AddObject (m, "Cache", cache_type) < 0) {
      Py_DECREF (cache_type);
      Py_DECREF (m);
      return NULL;
   }
   if (PyModule_AddObjectRef (m, "MISS", g_miss) < 0 ||
       PyModule_AddObjectRef (m, "UNHEALTHY", g_unhealthy) < 0 ||
       PyModule_AddObjectRef (m, "FALLBACK", g_fallback) < 0 ||
       PyModule_AddObjectRef (m, "BEHIND", g_behind) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_OK", CQC_ADMIT_OK) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_STALE", CQC_ADMIT_STALE) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_UNHEALTHY", CQC_ADMIT_UNHEALTHY) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_TOO_LARGE", CQC_ADMIT_TOO_LARGE) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_NO_SLOT", CQC_ADMIT_NO_SLOT) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_CONFLICT", CQC_ADMIT_CONFLICT) < 0 ||
       PyModule_AddIntConstant (m, "KIND_REBIND", CQC_KIND_REBIND) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_QUEUED", ADMIT_QUEUED) < 0 ||
       PyModule_AddIntConstant (m, "ADMIT_DROPPED", ADMIT_DROPPED) < 0 ||
       PyModule_AddIntConstant (m, "MODE_LOCAL", MODE_LOCAL) < 0 ||
       PyModule_AddIntConstant (m, "MODE_OWNER", MODE_OWNER) < 0 ||
       PyModule_AddIntConstant (m, "MODE_WORKER", MODE_WORKER) < 0 ||
       PyModule_AddIntConstant (m, "LAYOUT_VERSION", CQC_LAYOUT_VERSION) < 0 ||
       PyModule_AddIntConstant (m, "STATE_HEALTHY", CQC_STREAM_HEALTHY) < 0) {
      Py_DECREF (m);
      return NULL;
   }
   return m;
}
