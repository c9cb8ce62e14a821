"""The one oracle of the checked harnesses: what a read under writes may return.

Reference: docs/benchmarks.md, "Harness reference", `benchmarks._oracle`.
"""

from __future__ import annotations

import array
import bisect
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from pymongo import monitoring

from ._kit import MAX_EXAMPLES, Write, timestamp_int

EXACT, AT_LEAST, AT_MOST = 0, 1, 2


def applied_time(manager: Any, db: str) -> int:
    """The database's applied cluster time as one integer ((seconds << 32) |
    increment), read from the manager's current arena (a worker that
    re-attached reads its new owner's; holding an old native cache would
    also keep its arena and ring mapped)."""
    for s in manager._engine.native.streams():
        if s["database"] == db:
            t, i = s["applied_time"]
            return (t << 32) | i
    return 0


class WriteTimes(monitoring.CommandListener):
    """The ``operationTime`` of each acknowledged single-document update a
    client sends (``update`` commands whose first statement filters on
    ``_id`` and sets ``version``), by (document, version): the writes keep
    their ordinary form (no session argument) and still get their cluster
    time, also when several tasks write at once. ``take`` removes it."""

    def __init__(self) -> None:
        self._started: dict[tuple[str, int], tuple[int, int]] = {}
        self._times: dict[tuple[int, int], int] = {}

    @staticmethod
    def _statement(command: Any) -> tuple[int, int] | None:
        updates = command.get("updates") or ()
        if len(updates) != 1:
            return None
        doc = updates[0].get("q", {}).get("_id")
        version = (updates[0].get("u", {}).get("$set") or {}).get("version")
        return (doc, version) if type(doc) is int and type(version) is int else None

    def started(self, event: Any) -> None:
        if event.command_name == "update":
            statement = self._statement(event.command)
            if statement is not None:
                self._started[(event.connection_id, event.request_id)] = statement

    def succeeded(self, event: Any) -> None:
        statement = self._started.pop((event.connection_id, event.request_id), None)
        ot = event.reply.get("operationTime")
        if ot is None:
            return
        if statement is not None and event.reply.get("n", 0) == 1:
            self._times[statement] = timestamp_int(ot)

    def failed(self, event: Any) -> None:
        self._started.pop((event.connection_id, event.request_id), None)

    def take(self, doc: int, version: int) -> int:
        """The write's cluster time (KeyError: never acknowledged as one update)."""
        return self._times.pop((doc, version))


def initial_versions(documents: int, version: int = 1) -> list[Write]:
    """Every document's inserted ``version``, as a write at time 0."""
    return [Write(k, version) for k in range(documents)]


# -- Stale: the applied-time oracle ----------------------------------------------


class Oracle:
    """What each read must return, from the writes' operation times."""

    def __init__(self, writes: Iterable[Write]) -> None:
        self._times: dict[int, list[int]] = {}
        self._versions: dict[int, list[int]] = {}
        self._sent: dict[tuple[int, int], int] = {}
        for w in sorted(writes, key=lambda w: w.optime):
            self._times.setdefault(w.key, []).append(w.optime)
            self._versions.setdefault(w.key, []).append(w.version)
            self._sent[(w.key, w.version)] = w.sent_ns

    def required(self, doc: int, applied: int) -> int:
        """The newest version of ``doc`` written at or before ``applied``."""
        times = self._times.get(doc)
        if not times:
            return 0
        n = bisect.bisect_right(times, applied)
        return self._versions[doc][n - 1] if n else 0

    def impossible(self, doc: int, version: int, end_ns: int) -> str | None:
        """Why a version cannot have been read by a read ending at end_ns."""
        if version == 0:
            return None
        sent = self._sent.get((doc, version))
        if sent is None:
            return f"document {doc} at version {version} was never written"
        if sent > end_ns:
            return f"document {doc} at version {version} was read before its write was sent"
        return None


# -- One process's rows and their judgement --------------------------------------


class Rows:
    """A process's reads, one row per returned document: parallel arrays
    that pickle compactly (a spawned worker sends them to its parent)."""

    __slots__ = ("docs", "versions", "applied", "starts", "ends", "kinds", "bounds")

    def __init__(self) -> None:
        self.docs, self.versions = array.array("q"), array.array("q")
        self.applied, self.starts, self.ends = array.array("q"), array.array("q"), array.array("q")
        self.kinds, self.bounds = array.array("b"), array.array("b")

    def add(self, doc: int, version: int, applied: int, start: int, end: int, kind: int, bound: int = EXACT) -> None:
        self.docs.append(doc)
        self.versions.append(version)
        self.applied.append(applied)
        self.starts.append(start)
        self.ends.append(end)
        self.kinds.append(kind)
        self.bounds.append(bound)

    def __len__(self) -> int:
        return len(self.docs)

    def as_dict(self) -> dict[str, array.array[int]]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    stale: int = 0
    impossible: int = 0
    monotonic: int = 0
    read_your_writes: int = 0
    examples: tuple[str, ...] = ()

    def __add__(self, other: Verdict) -> Verdict:
        return Verdict(
            self.stale + other.stale,
            self.impossible + other.impossible,
            self.monotonic + other.monotonic,
            self.read_your_writes + other.read_your_writes,
            (self.examples + other.examples)[:MAX_EXAMPLES],
        )

    def counts(self) -> dict[str, int]:
        return {
            "stale_reads": self.stale,
            "impossible_reads": self.impossible,
            "monotonic_violations": self.monotonic,
            "read_your_writes_violations": self.read_your_writes,
        }


class _Floors:
    """Per document: the highest version known at each time, from events
    (time, version), looked up for the events strictly before a time."""

    def __init__(self, events: Iterable[tuple[int, int, int]]) -> None:
        per_doc: dict[int, list[tuple[int, int]]] = {}
        for doc, at, version in events:
            per_doc.setdefault(doc, []).append((at, version))
        self._at: dict[int, list[int]] = {}
        self._top: dict[int, list[int]] = {}
        for doc, evs in per_doc.items():
            evs.sort()
            self._at[doc] = [at for at, _ in evs]
            top, tops = -1, []
            for _, version in evs:
                top = max(top, version)
                tops.append(top)
            self._top[doc] = tops

    def before(self, doc: int, t: int) -> int:
        """The highest version of ``doc`` among events before ``t`` (-1: none)."""
        at = self._at.get(doc)
        if not at:
            return -1
        n = bisect.bisect_left(at, t)
        return self._top[doc][n - 1] if n else -1


def judge(
    rows: Any,
    *,
    oracle: Oracle | None = None,
    own_writes: Sequence[Write] = (),
    label: str = "",
    kind_names: Sequence[str] = (),
) -> Verdict:
    """Judge one process's rows (a ``Rows`` or a dict of its arrays; without
    ``bounds`` every row is exact): stale and impossible against ``oracle``
    (skipped without one), monotonic against the process's own earlier
    completed reads, read-your-writes against ``own_writes`` (acknowledged
    before the read started)."""
    get = rows.get if isinstance(rows, dict) else lambda name, default=None: getattr(rows, name, default)
    docs, versions, starts, ends = get("docs"), get("versions"), get("starts"), get("ends")
    applied, kinds = get("applied"), get("kinds")
    bounds = get("bounds") or array.array("b", bytes(len(docs)))
    seen = _Floors((docs[n], ends[n], versions[n]) for n in range(len(docs)) if bounds[n] != AT_MOST)
    mine = _Floors((w.key, w.ack_ns, w.version) for w in own_writes)
    counts = [0, 0, 0, 0]
    examples: list[str] = []

    def bad(which: int, text: str) -> None:
        counts[which] += 1
        if len(examples) < MAX_EXAMPLES:
            kind = kind_names[kinds[n]] if kinds is not None and kind_names else "a"
            examples.append(f"{label}{kind} read returned document {docs[n]} at version {versions[n]}, {text}")

    for n in range(len(docs)):
        if bounds[n] == AT_LEAST:
            continue
        k, v = docs[n], versions[n]
        if oracle is not None:
            need = oracle.required(k, applied[n])
            if v < need:
                bad(0, f"but version {need} had been applied before it started")
            why = oracle.impossible(k, v, ends[n]) if bounds[n] == EXACT else None
            if why:
                bad(1, why)
        if starts is None:  # rows without start times: no order to judge
            continue
        earlier = seen.before(k, starts[n])
        if v < earlier:
            bad(2, f"but this process had already read version {earlier}")
        written = mine.before(k, starts[n])
        if v < written:
            bad(3, f"but this process had written version {written} before it started")
    return Verdict(*counts, tuple(examples))


def judge_all(results: Iterable[dict[str, Any]], oracle: Oracle, kind_names: Sequence[str] = ()) -> Verdict:
    """Every worker's rows (``results``, each with its ``index``) judged by
    ``judge``, read-your-writes against the worker's own ``writes``; summed."""
    verdict = Verdict()
    for r in results:
        label, own = f"worker {r['index']}: ", r.get("writes", ())
        verdict += judge(r, oracle=oracle, own_writes=own, label=label, kind_names=kind_names)
    return verdict


def hit_fraction(hits: int, reads: int) -> float:
    return hits / reads if reads else 0.0
