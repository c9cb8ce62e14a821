"""Write the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/.

    python3 tests/fuzz/make_corpus.py

Pure Python (no dependencies), deterministic: running it again rewrites the
same files. Each seed is a small, meaningful input in its target's format
(the comment at the top of each harness describes it); the fuzzer mutates
from there. Regression seeds (inputs that once found a bug) are committed
under the same directories with a `regress-` prefix and are not written by
this script.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"

# Layout facts the seeds depend on (arena.h, ring.h); fuzz_arena_image
# rejects nothing for being off, but a seed that matches gets further.
ARENA_MAGIC = 0x414E455241435143
LAYOUT_VERSION = 5
HEADER_BYTES = 248
TOKEN_BYTES = 40
RING_MAGIC = 0x474E495243514343


def write(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


# ---------------------------------------------------------------- BSON ---


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


def doc(*elements: bytes) -> bytes:
    body = b"".join(elements)
    return struct.pack("<i", len(body) + 5) + body + b"\0"


def el(t: int, key: str, value: bytes) -> bytes:
    return bytes([t]) + cstr(key) + value


def string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<i", len(b) + 1) + b + b"\0"


def i32(k: str, v: int) -> bytes:
    return el(0x10, k, struct.pack("<i", v))


def i64(k: str, v: int) -> bytes:
    return el(0x12, k, struct.pack("<q", v))


def dbl(k: str, v: float) -> bytes:
    return el(0x01, k, struct.pack("<d", v))


def utf8(k: str, v: str) -> bytes:
    return el(0x02, k, string(v))


def subdoc(k: str, d: bytes) -> bytes:
    return el(0x03, k, d)


def array(k: str, *vals: bytes) -> bytes:
    return el(0x04, k, doc(*vals))


ID_VALUES = {
    "int32": i32("_id", 7),
    "int64": i64("_id", 7),
    "int64_big": i64("_id", 2**53 + 1),
    "double_integral": dbl("_id", 7.0),
    "double_fraction": dbl("_id", 7.5),
    "double_neg_zero": dbl("_id", -0.0),
    "double_nan": dbl("_id", math.nan),
    "double_2p63": dbl("_id", 2.0**63),
    "string": utf8("_id", "abc"),
    "symbol": el(0x0E, "_id", string("abc")),
    "oid": el(0x07, "_id", bytes(range(12))),
    "decimal128": el(0x13, "_id", struct.pack("<QQ", 7, 0x3040000000000000)),
    "bool": el(0x08, "_id", b"\x01"),
    "date": el(0x09, "_id", struct.pack("<q", 1_700_000_000_000)),
    "binary": el(0x05, "_id", struct.pack("<i", 3) + b"\x00abc"),
    "null": el(0x0A, "_id", b""),
    "regex": el(0x0B, "_id", cstr("a.*") + cstr("i")),
    "document": subdoc("_id", doc(i32("a", 1))),
    "minkey": el(0xFF, "_id", b""),
}


def keys_seeds() -> None:
    for name, element in ID_VALUES.items():
        write("keys", f"id_{name}", doc(element))
    write("keys", "id_and_field", doc(i32("_id", 1), i32("x", 2)))
    write("keys", "field_then_id", doc(i32("x", 2), i32("_id", 1)))
    write(
        "keys",
        "nested_everything",
        doc(subdoc("a", doc(*ID_VALUES.values())), array("b", i32("0", 1), dbl("1", 1.0))),
    )
    write("keys", "not_bson", b"\x05\x00\x00\x00\x01")


# ------------------------------------------------------- stream events ---


def event(op: str | None, ns: tuple[str, str | None] | None, *extra: bytes) -> bytes:
    parts = []
    if op is not None:
        parts.append(utf8("operationType", op))
    if ns is not None:
        db, coll = ns
        parts.append(subdoc("ns", doc(utf8("db", db), *([utf8("coll", coll)] if coll else []))))
    parts.extend(extra)
    return doc(*parts)


def cluster_time(t: int, i: int) -> bytes:
    return el(0x11, "clusterTime", struct.pack("<II", i, t))


def stream_seeds() -> None:
    for op in ("insert", "update", "replace", "delete"):
        for name in ("int32", "double_integral", "string", "decimal128", "oid"):
            write(
                "stream_event",
                f"{op}_{name}",
                event(op, ("d", "a"), subdoc("documentKey", doc(ID_VALUES[name])),
                      cluster_time(100, 5)),
            )
    write("stream_event", "update_no_document_key", event("update", ("d", "a")))
    write("stream_event", "update_other_db", event(
        "update", ("o", "a"), subdoc("documentKey", doc(i32("_id", 1)))))
    write("stream_event", "drop", event("drop", ("d", "b"), cluster_time(99, 1)))
    write("stream_event", "rename", event(
        "rename", ("d", "a"), subdoc("to", doc(utf8("db", "d"), utf8("coll", "b")))))
    write("stream_event", "rename_no_target", event("rename", ("d", "a")))
    write("stream_event", "drop_database", event("dropDatabase", ("d", None)))
    write("stream_event", "invalidate", event("invalidate", None))
    write("stream_event", "create_indexes", event("createIndexes", ("d", "a")))
    write("stream_event", "unknown_without_ns", event("somethingNew", None))
    write("stream_event", "no_operation_type", event(None, ("d", "a")))
    # Resume tokens (the event's _id): MongoDB's KeyString layout and a
    # hex-encoded BSON document with a Timestamp "t".
    keystring = "82" + struct.pack(">II", 100, 7).hex() + "2b022c0100296e5a1004"
    write("stream_event", "token_keystring", event(
        "insert", ("d", "a"), subdoc("_id", doc(utf8("_data", keystring))), cluster_time(100, 7)))
    bson_token = doc(i32("s", 4), el(0x11, "t", struct.pack("<II", 7, 100))).hex()
    write("stream_event", "token_bson", event(
        "insert", ("d", "a"), subdoc("_id", doc(utf8("_data", bson_token))), cluster_time(100, 7)))


# ------------------------------------------------------------- arena ---

# fuzz_arena_patch opcodes (op % 9) and patch regions.
ADMIT, INVAL_ID, INVAL_NS, INVAL_DB, HEALTH, CLEAR, LOOKUP, SCRIBBLE = 0, 2, 3, 4, 5, 6, 7, 8
R_HEADER, R_DBS, R_NSS, R_IDGEN, R_SLOTS, R_RING, R_ANY = range(7)


def admit(key: int, value: bytes, flags: int = 0) -> bytes:
    return bytes([ADMIT, key, flags, len(value)]) + value


def patch(region: int, offset: int, data: bytes) -> bytes:
    return bytes([region]) + struct.pack("<I", offset) + bytes([len(data)]) + data


def patch_program(geo: int, ops: list[bytes], patches: list[bytes], name: bytes = b"") -> bytes:
    return (bytes([geo]) + b"".join(ops) + b"\xff" + bytes([len(patches)]) + b"".join(patches)
            + bytes([len(name)]) + name)


def value(tag: int, n: int = 24) -> bytes:
    return doc(i32("_id", tag), el(0x05, "v", struct.pack("<i", n) + b"\0" + bytes([tag]) * n))


def arena_patch_seeds() -> None:
    every = [admit(k, value(k)) for k in range(0, 24, 3)] + [admit(1, b"", flags=1)]
    write("arena_patch", "admit_and_read", patch_program(0, every, []))
    write("arena_patch", "invalidate_each_way", patch_program(1, every + [
        bytes([INVAL_ID, 0]), bytes([INVAL_ID, 4, 9]), bytes([INVAL_NS, 8]),
        bytes([INVAL_DB, 16]), bytes([HEALTH, 20, 3]), admit(0, value(100)),
        bytes([HEALTH, 20, 2]),
    ], []))
    write("arena_patch", "stale_admission", patch_program(0, [admit(2, value(2), flags=2)], []))
    write("arena_patch", "conflict", patch_program(0, [admit(5, value(5)), admit(5, value(6)),
                                                       admit(5, value(7))], []))
    write("arena_patch", "clear_then_admit", patch_program(2, every + [bytes([CLEAR])]
                                                           + every[:3], []))
    big = [admit(k % 24, value(k, 200)) for k in range(40)]
    write("arena_patch", "ring_wraps_and_evicts", patch_program(0, big, []))
    write("arena_patch", "patch_slots", patch_program(0, every, [
        patch(R_SLOTS, 16 + 64 * k, struct.pack("<I", 8 * k + 3)) for k in range(4)
    ] + [patch(R_SLOTS, 28 + 64 * 5, b"\xff\xff\x00\x00")]))
    write("arena_patch", "patch_ring", patch_program(0, every, [
        patch(R_RING, 0, b"\x00" * 16), patch(R_RING, 40, b"\xee" * 8)]))
    write("arena_patch", "rollback_generations", patch_program(0, every + [
        bytes([INVAL_NS, 0]), bytes([INVAL_DB, 16])
    ], [patch(R_NSS, 16, b"\x00" * 16), patch(R_DBS, 8, b"\x00" * 4),
        patch(R_IDGEN, 0, b"\x00" * 16)]))
    write("arena_patch", "patch_header", patch_program(0, every, [
        patch(R_HEADER, 56, struct.pack("<Q", 64)), patch(R_HEADER, 8, b"\x03")]))
    write("arena_patch", "odd_seqlock", patch_program(0, every, [
        patch(R_SLOTS, 64 * k, b"\x01") for k in range(8)]))
    write("arena_patch", "name_lookup", patch_program(0, every, [], b"d0.a"))
    # Two rings (geometry 4: 16 KiB): fill the main ring, hit a few of its
    # entries, replace others (dead blocks) until new entries go to the
    # small ring, hit some there, and go on until both tails judge them:
    # promotions, reinsertions, dead entries reclaimed, with a scribbled
    # access cell beside.
    ids = [k for k in range(24) if k % 8 < 4]  # the identity keys
    others = [k for k in range(24) if k % 8 >= 4]
    churn = [admit(k, value(k, 230)) for k in ids[:6]]
    churn += [bytes([LOOKUP, 0]), bytes([LOOKUP, 1]), bytes([LOOKUP, 0])]
    for r in range(36):  # replaced entries keep the main ring's place
        k = ids[2 + r % 4]
        churn += [bytes([INVAL_ID, k]), admit(k, value(k + 50 + r, 230))]
    for k in ids[6:9]:  # the main ring is full: these start in the small ring
        churn += [admit(k, value(k, 230)), bytes([LOOKUP, k]), bytes([LOOKUP, k])]
    churn += [bytes([SCRIBBLE, 7]) + struct.pack("<I", 0xffffffff)]
    churn += [admit(k, value(k + 100, 230)) for k in ids[9:] + others]
    write("arena_patch", "evict_hot_and_dead", patch_program(4, churn, []))


def arena_header(geo_slots: int = 64, budget: int = 4096) -> bytes:
    """The header fuzz_arena_image's raw mode needs for the smallest
    geometry (4 databases, 16 namespaces, 64 identity cells): offsets as
    cqc_arena_format lays them out."""
    db_off = 256
    ns_off = db_off + 4 * 144  # 4 cqc_db_t of 144 bytes (a multiple of 64 as a whole)
    idgen_off = ns_off + 16 * 296
    slots_off = idgen_off + 64 * 8
    ring_off = slots_off + geo_slots * 64
    size = ring_off + budget
    h = struct.pack("<QIIQ", ARENA_MAGIC, LAYOUT_VERSION, HEADER_BYTES, size)
    h += struct.pack("<QIIII", budget, geo_slots, 16, 4, 64)
    h += struct.pack("<6Q", db_off, ns_off, idgen_off, slots_off, ring_off, budget)
    h += b"\0" * (HEADER_BYTES - len(h))
    return h


def image_populate(entries: list[tuple[bytes, bytes]]) -> bytes:
    out = bytes([len(entries)])
    for key, val in entries:
        out += bytes([len(key) - 1, len(val)]) + key + val
    return out


def lookups(*keys: bytes) -> bytes:
    return b"".join(bytes([len(k)]) + struct.pack("<I", 0) + k for k in keys) + b"\0"


def arena_image_seeds() -> None:
    entries = [(b"key-%d" % k, value(k, 8 * k)) for k in range(6)]
    blank = b"\0" * HEADER_BYTES
    # Formatted, populated, no patch: every read path on a real arena.
    write("arena_image", "populated", bytes([0x21]) + blank + image_populate(entries)
          + b"\0" + b"\0" * 5 + lookups(b"key-1", b"key-9"))
    write("arena_image", "populated_patched", bytes([0x25]) + blank + image_populate(entries)
          + bytes([3]) + patch(0, 6016 + 16, b"\x08\x00\x00\x00")
          + patch(0, 6016 + 64 + 28, b"\xff\xff\xff\x7f") + patch(0, 10112 + 4, b"\x01"))
    write("arena_image", "formatted_empty", bytes([0x01]) + blank + b"\0")
    # Raw header, consistent with its size: attach accepts it.
    write("arena_image", "raw_valid_header",
          bytes([0x00]) + arena_header() + struct.pack("<I", 0) + b"\0")
    bad = bytearray(arena_header())
    struct.pack_into("<Q", bad, 72, 1 << 40)  # ring_off far past the image
    write("arena_image", "raw_bad_offsets", bytes([0x00]) + bad + struct.pack("<I", 0) + b"\0")
    write("arena_image", "header_over_formatted", bytes([0x03]) + arena_header(128) + b"\0")


# -------------------------------------------------------------- ring ---


def push(kind: int, filt: bytes, rest: bytes, val: bytes, not_found: bool = False) -> bytes:
    tok = struct.pack("<IIIIQQII", 3, 1, 0xFFFFFFFF, 0, 1, 2, 1, 0)
    assert len(tok) == TOKEN_BYTES
    return (bytes([0, kind, int(not_found)]) + tok + bytes([len(filt), len(rest)])
            + struct.pack("<H", len(val)) + filt + rest + val)


DRAIN = b"\x03"


def ring_program(size: int, ops: list[bytes], patches: list[bytes]) -> bytes:
    return bytes([size]) + b"".join(ops) + b"\xff" + bytes([len(patches)]) + b"".join(patches)


def ring_seeds() -> None:
    f = doc(i32("_id", 1))
    three = [push(1, f, b"", value(1)), push(2, doc(i32("x", 2)), b"K" + b"\0" * 8, value(2)),
             push(1, f, b"", b"", not_found=True)]
    write("ring", "push_drain", ring_program(0, three + [DRAIN], []))
    wrap = [push(5, f, b"", value(k, 1400)) for k in range(5)]
    write("ring", "wrap_with_pads", ring_program(7, [wrap[0], wrap[1], DRAIN, wrap[2], DRAIN,
                                                     wrap[3], wrap[4], DRAIN], []))
    write("ring", "full_ring_drops", ring_program(0, wrap, []))
    # Patches: region 0 is the header, 1 the data area.
    write("ring", "head_past_capacity", ring_program(0, three, [patch(0, 24, struct.pack("<Q", 1 << 20))]))
    write("ring", "tail_ahead_of_head", ring_program(0, three, [patch(0, 64, struct.pack("<Q", 1 << 40))]))
    write("ring", "capacity_zero", ring_program(0, three, [patch(0, 16, b"\0" * 8)]))
    write("ring", "record_length_huge", ring_program(0, three, [patch(1, 0, b"\xf8\xff\xff\x7f")]))
    # A record: len, kind_flags, sum (8), token (40), flen, rlen, vlen.
    write("ring", "record_body_lengths", ring_program(0, three, [patch(1, 56, b"\xff" * 12)]))
    write("ring", "record_sum", ring_program(0, three, [patch(1, 8, b"\x01")]))
    write("ring", "pad_record_wrong", ring_program(0, three, [patch(1, 0, struct.pack("<I", 0x80000010))]))
    write("ring", "bad_magic", ring_program(0, three, [patch(0, 0, b"XXXX")]))


# fuzz_ring_admit opcodes (op % 4) and push flags.
PUSH, WRITE, DRAIN_ADMIT, CHECK = 0, 1, 2, 3
IDENTITY, REBIND, NOT_FOUND, RAW_TOKEN, RAW_VALUE = 1, 2, 4, 8, 16


def admit_push(ns: int, flags: int, id_: int, val: bytes, token: bytes = b"") -> bytes:
    return bytes([PUSH, ns, flags, id_, len(val)]) + val + token


def ring_admit_seeds() -> None:
    base = [admit_push(0, IDENTITY, 7, b"hello"), admit_push(0, 0, 1, b"query"),
            admit_push(0, REBIND, 2, b"\x09ab"), admit_push(1, NOT_FOUND, 3, b""),
            admit_push(2, IDENTITY | NOT_FOUND, 4, b"")]
    write("ring_admit", "admit_then_writes", b"".join(base) + bytes([DRAIN_ADMIT, CHECK])
          + bytes([WRITE, 0, 9, CHECK, WRITE, 0, 7, CHECK, WRITE, 1, 200, CHECK]) + b"\xff\0")
    write("ring_admit", "write_before_drain", b"".join(base) + bytes([WRITE, 0, 1, DRAIN_ADMIT,
                                                                      CHECK]) + b"\xff\0")
    write("ring_admit", "same_key_twice", b"".join([
        admit_push(0, IDENTITY, 5, b"one"), admit_push(0, IDENTITY, 5, b"two"),
        bytes([DRAIN_ADMIT, CHECK, WRITE, 0, 5]), admit_push(0, IDENTITY, 5, b"three"),
        bytes([DRAIN_ADMIT, CHECK])]) + b"\xff\0")
    raw_tok = struct.pack("<IIIIQQII", 0, 0, 0xFFFFFFFF, 0, 0, 0, 1, 0)
    write("ring_admit", "raw_tokens_and_values", b"".join([
        admit_push(0, RAW_TOKEN, 1, b"x", raw_tok), admit_push(1, REBIND | RAW_VALUE, 2,
                                                              doc(i32("_id", 3))),
        bytes([DRAIN_ADMIT, CHECK])]) + b"\xff\0")
    write("ring_admit", "patched_ring", b"".join(base) + b"\xff" + bytes([2])
          + patch(1, 8, b"\xff\xff\xff\xff") + patch(0, 24, struct.pack("<Q", 4096)))


def recheck_record(ns: int, flags: int, id_: int, val: bytes) -> bytes:
    return bytes([ns, flags, id_, len(val)]) + val


def ring_recheck_seeds() -> None:
    """fuzz_ring_recheck: records, then the patches made while each one is
    handed on (regions: 0 header, 1 data area, 2 first 512 bytes of data)."""
    recs = [recheck_record(0, 1, 7, b"hello"), recheck_record(1, 0, 1, b"query"),
            recheck_record(0, 3, 4, b"")]
    head = bytes([len(recs) - 1]) + b"".join(recs)
    write("ring_recheck", "nothing_changes", head + b"\0\0\0")
    # While the first record is handed on: its value bytes (after the 68-byte
    # fixed part and the filter), its lengths, and the header's head.
    write("ring_recheck", "value_rewritten", head + bytes([1]) + patch(2, 68 + 14 + 20, b"\xee" * 8)
          + b"\0\0")
    write("ring_recheck", "lengths_rewritten", head + bytes([1]) + patch(2, 56, b"\xff" * 12) + b"\0\0")
    write("ring_recheck", "next_record_rewritten", head + bytes([2]) + patch(2, 120, b"\x00" * 16)
          + patch(0, 24, struct.pack("<Q", 1 << 20)) + b"\0\0")


# ------------------------------------------------------- the builder ---


def build_seeds() -> None:
    """fuzz_build: a mode byte (1: one document, 0: documents end to end),
    then the entry: every type the builder makes, nesting, DBRef-shaped
    documents, and what PyMongo refuses."""
    oid = bytes(range(12))
    scalars = doc(
        dbl("f", -1.5), utf8("s", "h\u00e9"), el(0x08, "t", b"\x01"), el(0x0A, "n", b""),
        el(0x07, "o", oid), el(0x09, "d", struct.pack("<q", -1)), i32("i", -2), i64("l", 2**40),
        el(0x13, "m", struct.pack("<QQ", 7, 0x3040000000000000)), el(0x11, "ts", struct.pack("<II", 4, 3)),
        el(0xFF, "mn", b""), el(0x7F, "mx", b""), el(0x06, "un", b""), el(0x0E, "sy", string("y")),
    )  # fmt: skip
    binaries = doc(
        el(0x05, "b0", struct.pack("<i", 2) + b"\x00ab"), el(0x05, "b1", struct.pack("<i", 1) + b"\x01z"),
        el(0x05, "u4", struct.pack("<i", 16) + b"\x04" + bytes(16)),
        el(0x05, "old", struct.pack("<i", 5) + b"\x02" + struct.pack("<i", 1) + b"z"),
        el(0x05, "user", struct.pack("<i", 1) + b"\x80q"),
    )  # fmt: skip
    code = doc(
        el(0x0B, "r", cstr("^a.*") + cstr("imsulx")), el(0x0D, "c", string("f()")),
        el(0x0F, "cs", struct.pack("<i", 4 + len(string("g")) + len(doc(i32("v", 1)))) + string("g")
           + doc(i32("v", 1))),
        el(0x0C, "dp", string("coll") + oid),
    )  # fmt: skip
    dbref = doc(
        subdoc("r", doc(utf8("$ref", "c"), el(0x07, "$id", oid), utf8("$db", "d"), i32("x", 1))),
        subdoc("no_db", doc(i32("x", 1), utf8("$ref", "c"), i32("$id", 2))),
        subdoc("db_null", doc(utf8("$ref", "c"), i32("$id", 2), el(0x0A, "$db", b""))),
        subdoc("not_ref", doc(i32("$ref", 1), i32("$id", 2))),
    )  # fmt: skip
    nested = doc(array("a", subdoc("0", doc(array("b", array("0", dbl("0", 1.0)), subdoc("1", doc())))),
                       i32("1", 5)))
    keys = doc(*(i32(name, i) for i, name in enumerate(
        ["a", "abcdefgh", "abcdefghX12345678", "abcdefghY12345678", "\u65e5\u672c", "k" * 70])))
    for name, d in [("scalars", scalars), ("binaries", binaries), ("code", code), ("dbref", dbref),
                    ("nested", nested), ("keys", keys), ("empty", doc())]:
        write("build", name, b"\x01" + d)
    write("build", "list", b"\x00" + scalars + nested + doc())
    write("build", "list_empty", b"\x00")
    refused = {
        "date_after_9999": doc(el(0x09, "d", struct.pack("<q", 253402300800000))),
        "bad_utf8_key": doc(b"\x10\xff\x00" + b"\0\0\0\0"),
        "bad_utf8_value": doc(el(0x02, "s", struct.pack("<i", 2) + b"\xff\0")),
        "uuid_short": doc(el(0x05, "u", struct.pack("<i", 2) + b"\x03ab")),
        "bool_2": doc(el(0x08, "t", b"\x02")),
        "unknown_type": doc(el(0x20, "x", b"")),
        "truncated": scalars[:-7],
    }
    for name, d in refused.items():
        write("build", name, b"\x01" + d)


def main() -> None:
    build_seeds()
    keys_seeds()
    stream_seeds()
    arena_patch_seeds()
    arena_image_seeds()
    ring_seeds()
    ring_admit_seeds()
    ring_recheck_seeds()
    for d in sorted(CORPUS.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds")


if __name__ == "__main__":
    main()
