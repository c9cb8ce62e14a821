"""The example application: a small item store whose reads go through the
shared cache.

Run it with ``python -m examples.webapp`` (which also starts a database and
gunicorn), or under gunicorn directly::

    MONGODB_URI=mongodb://... gunicorn -c examples/webapp/gunicorn.conf.py \\
        --workers 2 examples.webapp.app:app

Each gunicorn worker imports this module after the fork (``preload_app`` is
off, gunicorn's default), so each builds its own ``MongoClient`` and
``CacheManager``; the manager attaches to the owner that ``gunicorn.conf.py``
started in the master.

Endpoints (JSON):

``GET /items/<id>``
    ``{"item": {...} | null, "pid": ..., "cached": bool, "outcome": ...}``:
    the document, the worker that answered and whether the read was served
    from the shared cache (``outcome`` is ``hit``, ``miss`` or
    ``bypass:<reason>``).
``GET /items``
    every item, sorted by ``_id`` (a query, also cached), with the same fields.
``PUT /items/<id>``
    body ``{"field": value, ...}``: sets the fields and increments
    ``version``; answers the document as written (404 if there is none).
``GET /stats``
    this worker's cache counters (hits, misses, bypasses by reason), the
    arena's entries and invalidations, and the change streams' states.
``GET /health``
    ``{"pid": ..., "ready": bool}``: whether the change stream of the app's
    database serves, so reads can be hits.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from flask import Flask, abort, jsonify, request
from pymongo import MongoClient, ReturnDocument

from client_query_cache import CacheManager, CacheSnapshot

MONGODB_URI = os.environ["MONGODB_URI"]
#: The database and shared-cache name; gunicorn.conf.py reads the same variables.
DATABASE = os.environ.get("EXAMPLE_DB", "cqc_example")
CACHE_NAME = os.environ.get("EXAMPLE_CACHE", "webapp-example")

# Created at import, in the worker (after gunicorn's fork): a manager created
# before the fork would refuse to work in the worker (CacheForkedError).
cache = CacheManager(MongoClient(MONGODB_URI), shared=CACHE_NAME)
items = cache[DATABASE]["items"]
# The first wrap of a database asks the owner to follow its change stream;
# until that stream serves, reads go to MongoDB (counted as bypasses). Wait a
# little so the first requests can already be hits, but boot either way.
cache.wait_ready(10.0, database=DATABASE)

app = Flask(__name__)


def _counters(snap: CacheSnapshot) -> tuple[int, int, dict[str, int]]:
    return snap.hits, snap.misses, dict(snap.bypasses)


def _outcome(before: tuple[int, int, dict[str, int]], after: tuple[int, int, dict[str, int]]) -> str:
    """What the read between two snapshots of this worker's counters did.
    Exact because a gunicorn sync worker handles one request at a time."""
    if after[0] > before[0]:
        return "hit"
    if after[1] > before[1]:
        return "miss"
    for reason, count in after[2].items():
        if count > before[2].get(reason, 0):
            return f"bypass:{reason}"
    return "unknown"


def _read(read: Any) -> dict[str, Any]:
    before = _counters(cache.snapshot())
    result = read()
    outcome = _outcome(before, _counters(cache.snapshot()))
    return {"pid": os.getpid(), "cached": outcome == "hit", "outcome": outcome, "result": result}


@app.get("/items/<int:item_id>")
def get_item(item_id: int) -> Any:
    answer = _read(lambda: items.find_one({"_id": item_id}))
    answer["item"] = answer.pop("result")
    return jsonify(answer), 200 if answer["item"] is not None else 404


@app.get("/items")
def list_items() -> Any:
    answer = _read(lambda: list(items.find({}, sort=[("_id", 1)])))
    answer["items"] = answer.pop("result")
    return jsonify(answer)


@app.put("/items/<int:item_id>")
def update_item(item_id: int) -> Any:
    fields = request.get_json(silent=True)
    if not isinstance(fields, dict) or not fields or "_id" in fields or "version" in fields:
        abort(400, "send a JSON object of the fields to set (not _id or version)")
    # Writes go to PyMongo unchanged; the owner's change stream invalidates
    # the cached reads of this document and of the collection's queries.
    doc = items.raw.find_one_and_update(
        {"_id": item_id},
        {"$set": fields, "$inc": {"version": 1}},
        return_document=ReturnDocument.AFTER,
    )
    if doc is None:
        abort(404)
    return jsonify({"pid": os.getpid(), "item": doc})


@app.get("/stats")
def stats() -> Any:
    snap = cache.snapshot()
    data = dataclasses.asdict(snap)
    data["bypasses"] = dict(snap.bypasses)
    data["rejected_admissions"] = dict(snap.rejected_admissions)
    data["streams"] = [
        {"database": s.database, "state": s.state.value, "events": s.events, "reconnects": s.reconnects}
        for s in snap.streams
    ]
    return jsonify({"pid": os.getpid(), "cache_name": CACHE_NAME, **data})


@app.get("/health")
def health() -> Any:
    return jsonify({"pid": os.getpid(), "ready": cache.wait_ready(0, database=DATABASE)})
