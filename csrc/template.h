/*
 * template.h - a process's templates of the entries it hits: the objects a
 * hit built, kept so that later hits of the same entry make only fresh
 * containers around the same immutable values.
 *
 * A hit under the default codec options builds a document (build.h) of
 * mostly immutable values: str, int, float, bool, None, bytes, datetime,
 * ObjectId, Int64, Decimal128, Timestamp, MinKey, MaxKey. The fourth hit
 * of an entry in the process keeps a template of what it built: a copy of its containers
 * (dicts and lists) around the same values. A later hit of the same entry
 * (the arena's entry id: the same block, generation, size and sum, checked
 * by the lookup exactly as a copy is: arena.h, cqc_arena_r_lookup_entry)
 * takes no copy of the bytes and builds nothing: it copies the template's
 * containers, sharing the values, as copy.deepcopy does. What a caller can
 * change (a dict, a list) is never shared; what is shared no caller can
 * change: a document holding any other value (a Regex, a DBRef, a Code, a
 * Binary, an object of a type with an instance dict) gets no template and
 * is built every time.
 *
 * Per Cache object (a local cache or a worker; an owner serves no reads),
 * under the GIL. Bounded: its own byte budget (an estimate of the
 * templates' objects, from their __sizeof__), its own eviction (CLOCK), and
 * templates of entries since invalidated, replaced or evicted are released
 * as they are found: by a lookup of the same key, and by a sweep that
 * checks a few templates against the arena on every template added and
 * every 256 template hits.
 */
#ifndef CQC_TEMPLATE_H
#define CQC_TEMPLATE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "arena.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct cqc_templates cqc_templates_t;

/* Whether an entry is still live (cqc_arena_r_entry_live on `arena`). */
typedef bool (*cqc_live_fn) (const void *arena, const cqc_entry_id_t *id);

/* A store of at most limit_bytes of templates, checking liveness with
 * live(arena, id); NULL (no exception) without memory. */
cqc_templates_t *cqc_templates_new (size_t limit_bytes, cqc_live_fn live, const void *arena);

/* Release every template and the store (NULL: nothing), at once, or when
 * an add under way (which ran Python code that closed it) ends. */
void cqc_templates_close (cqc_templates_t *t);

/* A template's program: what cqc_template_run follows. Valid while the
 * template (the tuple that holds it) is. */
typedef struct cqc_program cqc_program_t;

/* The template kept for id's key and `kind` (how it was built: the
 * caller's code for its decoder), if it was made of an entry with this very
 * id: a new reference in *tpl, its program in *program, id->value_hash
 * set, and true. Runs inside the arena's lookup: no Python code, nothing
 * freed. */
bool cqc_templates_find (cqc_templates_t *t, cqc_entry_id_t *id, int kind, PyObject **tpl,
                         const cqc_program_t **program);

/* A hint before a lookup of the key hashed key_hash: when a way of its
 * set holds a template of that key, asks for the first lines of its
 * program and returns the program, with *block_off the arena block it was
 * made of (for cqc_arena_r_prefetch_block); else NULL. The program is
 * only for cqc_template_prefetch, called before any Python code can run
 * (which may release the template): nothing holds it. */
const cqc_program_t *cqc_templates_prefetch (cqc_templates_t *t, uint64_t key_hash,
                                             uint64_t *block_off);

/* A hint: asks for the lines of the set where a template of the key
 * hashed key_hash would be (cqc_templates_prefetch then finds them). */
void cqc_templates_prefetch_set (const cqc_templates_t *t, uint64_t key_hash);

/* A hint: asks for the first lines a copy from `program` reads, so that
 * they arrive while the lookup validates the entry. */
void cqc_template_prefetch (const cqc_program_t *program);

/* A template hit was served (counted; every 256th runs the sweep). */
void cqc_templates_served (cqc_templates_t *t);

/* Keep a template of `built`, what a hit of the entry `id` with `kind`
 * returned, when it is made of containers and shareable values only;
 * value_hash is the floor's hash of the entry's value (never 0). Replaces
 * the key's older template, and evicts to stay within the budget. Never
 * fails (no template, no exception); may run Python code (__sizeof__), and
 * t may be closed when it returns. An entry gets its template on the
 * process's fourth hit of it (template.c, g_hits_before_template). */
void cqc_templates_add (cqc_templates_t *t, const cqc_entry_id_t *id, int kind, PyObject *built,
                        uint64_t value_hash);

/* A template of `built` without a store: a new reference, or NULL (no
 * exception) when `built` holds anything but containers and shareable
 * values; *bytes is its estimated size. For the tests and the fuzz target. */
PyObject *cqc_template_of (PyObject *built, size_t *bytes);

/* A fresh object from template `tpl`: new containers, the same values. A
 * new reference, or NULL with an exception (memory). */
PyObject *cqc_template_copy (PyObject *tpl);

/* The same from a template's program (cqc_templates_find's). */
PyObject *cqc_template_run (const cqc_program_t *program);

/* The module's private functions for the tests: _native._template,
 * _native._template_copy and _native._template_hits (PyModule_AddFunctions
 * takes them). */
extern PyMethodDef cqc_template_methods[];

typedef struct {
   uint64_t hits;      /* hits served from a template */
   uint64_t count;     /* templates kept */
   uint64_t bytes;     /* their estimated size */
   uint64_t limit;     /* the budget */
   uint64_t evicted;   /* dropped for room */
   uint64_t released;  /* dropped: their entry is gone or changed */
   uint64_t declined;  /* hits whose objects could not be a template */
} cqc_templates_stats_t;

void cqc_templates_stats (const cqc_templates_t *t, cqc_templates_stats_t *out);

#endif
