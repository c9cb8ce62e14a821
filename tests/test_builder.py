"""The document builder of hits (csrc/build.c) against PyMongo's decoder.

Under the default codec options a hit's objects are built in C instead of
by ``bson._bson_to_dict`` / ``bson._decode_all``. The promise: the same
objects as PyMongo's decoder (type, value and key order, recursively: see
bson_strict.py), and on bytes the builder does not take, PyMongo's own
result or error. Checked three ways:

* a differential property test over raw BSON generated element by element
  (every BSON type, nesting, DBRef-shaped documents, long and colliding
  field names), valid and damaged (truncated, bytes flipped, invalid UTF-8,
  datetimes out of range, bad Binary subtypes and booleans, unknown types,
  bad lengths), through the private ``_native._build`` (the builder alone)
  and ``_native._build_hit`` (a hit's steps: copy, build or decline, then
  PyMongo's decoder);
* targeted cases: the fast paths chosen at set-up, codec options that are
  not the defaults, nesting past the builder's depth, threads sharing the
  scratch buffer, the key cache's collisions and evictions;
* real hits from a server for both APIs (``d``): find_one, find, aggregate,
  count_documents and distinct of documents of every type, a view with other
  codec options, and a corrupt entry, which raises what PyMongo raises.
"""

from __future__ import annotations

import datetime
import inspect
import os
import pickle
import struct
import sys
import tempfile
import threading
import uuid
from typing import Any

import bson
import pytest
from bson import SON
from bson.binary import Binary, UuidRepresentation
from bson.code import Code
from bson.codec_options import DEFAULT_CODEC_OPTIONS, CodecOptions, DatetimeConversion, TypeDecoder, TypeRegistry
from bson.dbref import DBRef
from bson.decimal128 import Decimal128
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from bson.raw_bson import RawBSONDocument
from bson.regex import Regex
from bson.timestamp import Timestamp
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from client_query_cache import _native
from client_query_cache._core.engine import NO_STAMP, decode_bson, decode_document, decode_documents

# Hypothesis keeps files of its own even without an example database: in the
# temporary directory, not in the checkout.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "cqc-hypothesis"))

from bson_strict import as_batch_elements, assert_strict_equal, strict_difference  # noqa: E402

#: PyMongo's top-level decoder of documents laid end to end (the cache's
#: decode_documents decodes them as a cursor's batch elements).
decode_all_top = bson._decode_all

#: Examples per property (CQC_BUILDER_EXAMPLES to run more); the list
#: properties, whose examples are several documents each, run a third.
EXAMPLES = int(os.environ.get("CQC_BUILDER_EXAMPLES", "500"))


def _settings(examples: int) -> settings:
    return settings(
        max_examples=max(1, examples), deadline=None, database=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )  # fmt: skip


PROPERTY = _settings(EXAMPLES)
LIST_PROPERTY = _settings(EXAMPLES // 3)

#: The instants datetime.datetime can hold (years 1 to 9999), in BSON millis.
MILLIS_MIN = -62135596800000
MILLIS_MAX = 253402300799999


# -- raw BSON, element by element ---------------------------------------------------


def i32(n: int) -> bytes:
    return struct.pack("<i", n)


def i64(n: int) -> bytes:
    return struct.pack("<q", n)


def string(b: bytes) -> bytes:
    return i32(len(b) + 1) + b + b"\0"


Element = tuple[int, bytes, bytes]  # type byte, name (no NUL), value bytes


def document(elements: list[Element]) -> bytes:
    body = b"".join(bytes([t]) + name + b"\0" + value for t, name, value in elements)
    return i32(len(body) + 5) + body + b"\0"


def array(values: list[tuple[int, bytes]]) -> bytes:
    return document([(t, str(i).encode(), v) for i, (t, v) in enumerate(values)])


def code_w_scope(code: bytes, scope: bytes) -> bytes:
    body = string(code) + scope
    return i32(len(body) + 4) + body


texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
cstrings = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=10)
#: Field names: short, the DBRef ones, long (over 16 bytes, the key cache's
#: word compare; over 64, past the cache), and near-collisions (same first
#: and last 8 bytes).
names = st.one_of(
    cstrings,
    st.sampled_from(["_id", "a", "$ref", "$id", "$db", "$x", "é", "日本"]),
    st.sampled_from([f"abcdefgh{m}12345678" for m in ("x", "y", "xy", "é", "z" * 40)]),
    st.text(st.sampled_from("ab\u00e9"), min_size=17, max_size=80),
).map(lambda s: s.encode())

millis = st.one_of(
    st.integers(MILLIS_MIN, MILLIS_MAX),
    st.sampled_from([MILLIS_MIN, MILLIS_MAX, 0, -1, 1, 951782400000, -2203891200001, 86399999]),
)
binary_values = st.one_of(
    st.tuples(st.sampled_from([0, 1, 5, 6, 7, 8, 9, 0x80, 0xFF]), st.binary(max_size=20)),
    st.tuples(st.sampled_from([3, 4]), st.binary(min_size=16, max_size=16)),
).map(lambda sd: (5, i32(len(sd[1])) + bytes([sd[0]]) + sd[1]))
old_binary = st.binary(max_size=12).map(lambda b: (5, i32(len(b) + 4) + b"\x02" + i32(len(b)) + b))

scalars = st.one_of(
    st.floats().map(lambda f: (1, struct.pack("<d", f))),
    st.binary(min_size=8, max_size=8).map(lambda b: (1, b)),  # any NaN payload too
    texts.map(lambda s: (2, string(s.encode()))),
    binary_values,
    old_binary,
    st.sampled_from([(6, b""), (10, b""), (0x7F, b""), (0xFF, b""), (8, b"\0"), (8, b"\1")]),
    st.binary(min_size=12, max_size=12).map(lambda b: (7, b)),
    millis.map(lambda m: (9, i64(m))),
    st.tuples(cstrings, st.text("ilmsuxab", max_size=4)).map(
        lambda pf: (11, pf[0].encode() + b"\0" + pf[1].encode() + b"\0")
    ),
    st.tuples(texts, st.binary(min_size=12, max_size=12)).map(lambda cb: (12, string(cb[0].encode()) + cb[1])),
    texts.map(lambda s: (13, string(s.encode()))),
    texts.map(lambda s: (14, string(s.encode()))),
    st.integers(-(2**31), 2**31 - 1).map(lambda n: (16, i32(n))),
    st.binary(min_size=8, max_size=8).map(lambda b: (17, b)),
    st.integers(-(2**63), 2**63 - 1).map(lambda n: (18, i64(n))),
    st.binary(min_size=16, max_size=16).map(lambda b: (19, b)),
)


def containers(children: st.SearchStrategy[tuple[int, bytes]]) -> st.SearchStrategy[tuple[int, bytes]]:
    elements = st.lists(st.tuples(names, children), max_size=6).map(
        lambda els: [(t, n, v) for n, (t, v) in els]
    )
    dbref_like = st.tuples(
        st.one_of(texts.map(lambda s: (2, string(s.encode()))), children),  # $ref: a str, or not
        children,  # $id
        st.one_of(
            st.none(), st.just((10, b"")), texts.map(lambda s: (2, string(s.encode()))), children
        ),  # $db: absent, None, a str, anything
        elements,  # extra fields
        st.booleans(),  # extra fields first
    ).map(
        lambda r: document(
            (r[3] if r[4] else [])
            + [(r[0][0], b"$ref", r[0][1]), (r[1][0], b"$id", r[1][1])]
            + ([] if r[2] is None else [(r[2][0], b"$db", r[2][1])])
            + ([] if r[4] else r[3])
        )
    )
    return st.one_of(
        elements.map(lambda els: (3, document(els))),
        st.lists(children, max_size=6).map(lambda vs: (4, array(vs))),
        dbref_like.map(lambda doc: (3, doc)),
        st.tuples(texts, elements).map(lambda ce: (15, code_w_scope(ce[0].encode(), document(ce[1])))),
    )


values = st.recursive(scalars, containers, max_leaves=25)
documents = st.lists(st.tuples(names, values), max_size=10).map(
    lambda els: document([(t, n, v) for n, (t, v) in els])
)

#: Elements PyMongo refuses, placed anywhere in a document.
bad_scalars = st.one_of(
    st.one_of(st.integers(max_value=MILLIS_MIN - 1), st.integers(min_value=MILLIS_MAX + 1)).filter(
        lambda n: -(2**63) <= n < 2**63
    ).map(lambda m: (9, i64(m))),
    st.tuples(st.sampled_from([3, 4]), st.binary(max_size=20).filter(lambda b: len(b) != 16)).map(
        lambda sd: (5, i32(len(sd[1])) + bytes([sd[0]]) + sd[1])
    ),
    st.binary(max_size=8).map(lambda b: (5, i32(len(b) + 4) + b"\x02" + i32(len(b) + 1) + b)),
    st.integers(2, 255).map(lambda v: (8, bytes([v]))),
    st.sampled_from([b"\xff", b"a\xc3", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80"]).map(
        lambda b: (2, string(b))
    ),
    st.sampled_from([0x00, 0x14, 0x20, 0x7E, 0x80, 0xFE]).map(lambda t: (t, b"\1\0\0\0")),
    st.sampled_from([b"\xff", b"i\xc3", b"\xed\xa0\x80"]).map(lambda f: (11, b"^a\0" + f + b"\0")),
    st.just((2, i32(0) + b"\0")),
    st.just((2, i32(5) + b"ab\0")),
    st.just((8, b"")),
)
bad_names = st.sampled_from([b"\xff", b"a\xc3", b"\xed\xa0\x80"])
bad_values = st.recursive(st.one_of(scalars, bad_scalars), containers, max_leaves=12)
bad_documents = st.lists(
    st.tuples(st.one_of(names, bad_names), bad_values), min_size=1, max_size=6
).map(lambda els: document([(t, n, v) for n, (t, v) in els]))


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """A valid document with bytes damaged: cut short, changed, or its
    length made to disagree with its bytes."""
    data = bytearray(draw(documents))
    how = draw(st.sampled_from(["truncate", "flip", "length", "extend"]))
    if how == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 3))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
        return bytes(data)
    if how == "length":
        data[:4] = i32(draw(st.integers(-10, len(data) + 10)))
        return bytes(data)
    return bytes(data) + draw(st.binary(min_size=1, max_size=6))


any_bytes = st.one_of(documents, bad_documents, damaged(), st.binary(max_size=40))


# -- what a hit returns ---------------------------------------------------------


def outcome(call: Any) -> tuple[Any, ...]:
    """A call's result, or the class and message of what it raised."""
    try:
        return ("returned", call())
    except Exception as exc:  # noqa: BLE001 - comparing behaviours
        return ("raised", type(exc), str(exc))


def assert_same_outcome(got: tuple[Any, ...], want: tuple[Any, ...]) -> None:
    if want[0] == "returned" and got[0] == "returned":
        assert_strict_equal(got[1], want[1])
    else:
        assert got == want


def check_bytes(data: bytes) -> None:
    """One document's bytes: the builder either builds PyMongo's objects or
    declines; a hit of them returns or raises what PyMongo does."""
    want = outcome(lambda: decode_bson(data, DEFAULT_CODEC_OPTIONS))
    built = _native._build(data)
    if built is not NotImplemented:
        assert want[0] == "returned", f"built what PyMongo refuses: {want}"
        assert_strict_equal(built, want[1])
    assert_same_outcome(outcome(lambda: _native._build_hit(data, decode_bson, DEFAULT_CODEC_OPTIONS)), want)
    check_decoded(data, decode_bson)
    check_elements(data, False)


def check_template(built: Any, want: Any) -> None:
    """When what a hit built can be a template (csrc/template.h), a hit
    served from that template returns PyMongo's objects again, in new
    containers."""
    tpl = _native._template(built)
    if tpl is not None:
        for _ in range(2):
            copy = _native._template_copy(tpl)
            assert copy is not built and copy is not tpl[0]
            assert_strict_equal(copy, want)


def check_elements(data: bytes, many: bool) -> None:
    """The same bytes as a find_one's document (``many`` false) or a find's
    documents, which the cache decodes as PyMongo's cursor does, as elements
    of a reply's batch (bson_strict.as_batch_elements): decode_document(s),
    the builder with elements set, a hit and a miss's copy all return or
    raise what the cursor would."""
    decode = decode_documents if many else decode_document
    want = outcome(lambda: as_batch_elements(data, DEFAULT_CODEC_OPTIONS, many))
    assert_same_outcome(outcome(lambda: decode(data, DEFAULT_CODEC_OPTIONS)), want)
    built = _native._build(data, many, True)
    if built is not NotImplemented:
        assert want[0] == "returned", f"built what PyMongo's cursor refuses: {want}"
        assert_strict_equal(built, want[1])
        check_template(built, want[1])
    assert_same_outcome(outcome(lambda: _native._build_hit(data, decode, DEFAULT_CODEC_OPTIONS)), want)
    check_decoded(data, decode)


def check_decoded(data: bytes, decode: Any) -> None:
    """A miss's copy (``_native.decoded``) of the same bytes returns or
    raises what ``decode`` does with them: as bytes, as the read-only
    memoryview PyMongo 4.18+ gives for large raw documents, and as a
    bytearray (mutable: always left to the decoder)."""
    for given in (data, memoryview(data), bytearray(data)):
        want = outcome(lambda given=given: decode(given, DEFAULT_CODEC_OPTIONS))
        assert_same_outcome(outcome(lambda given=given: _native.decoded(given, decode, DEFAULT_CODEC_OPTIONS)), want)


def check_list(data: bytes) -> None:
    """The same for the entry of a find or aggregate: documents end to end."""
    want = outcome(lambda: decode_all_top(data, DEFAULT_CODEC_OPTIONS))
    built = _native._build(data, True)
    if built is not NotImplemented:
        assert want[0] == "returned", f"built what PyMongo refuses: {want}"
        assert_strict_equal(built, want[1])
    got = outcome(lambda: _native._build_hit(data, decode_all_top, DEFAULT_CODEC_OPTIONS))
    assert_same_outcome(got, want)
    check_decoded(data, decode_all_top)
    check_elements(data, True)


# -- the property tests ------------------------------------------------------------


@PROPERTY
@given(data=documents)
@example(data=document([]))
@example(data=document([(9, b"lo", i64(MILLIS_MIN)), (9, b"hi", i64(MILLIS_MAX)), (9, b"z", i64(-1))]))
@example(data=document([(1, b"n", b"\x01\x00\x00\x00\x00\x00\xf8\x7f"), (1, b"z", struct.pack("<d", -0.0))]))
@example(data=document([(3, b"r", document([(2, b"$ref", string(b"c")), (16, b"$id", i32(1)), (10, b"$db", b"")]))]))
@example(data=document([(16, b"_id", i32(1)), (2, b"$ref", string(b"c")), (16, b"$id", i32(1))]))
@example(data=document([(2, b"$ref", string(b"c")), (16, b"$id", i32(1)), (16, b"$db", i32(2))]))
@example(data=document([(16, b"$ref", i32(1)), (16, b"$id", i32(1))]))
def test_valid_documents_are_built_as_pymongo_decodes_them(data: bytes) -> None:
    want = bson.decode(data)
    built = _native._build(data)
    assert built is not NotImplemented, "the builder declined a document PyMongo decodes"
    assert_strict_equal(built, want)
    # A hit: once with the key cache as it is, once more with it warm.
    for _ in range(2):
        assert_strict_equal(_native._build_hit(data, decode_bson, DEFAULT_CODEC_OPTIONS), want)
    before = _native._build_info()
    assert_strict_equal(_native.decoded(memoryview(data), decode_bson, DEFAULT_CODEC_OPTIONS), want)
    assert _native._build_info()["built"] == before["built"] + 1, "a miss's copy was not built"
    # As a find_one's document: built too, as PyMongo's cursor decodes it.
    want = as_batch_elements(data, DEFAULT_CODEC_OPTIONS, False)
    built = _native._build(data, False, True)
    assert built is not NotImplemented, "the builder declined a batch element PyMongo decodes"
    assert_strict_equal(built, want)
    check_template(built, want)
    assert_strict_equal(_native._build_hit(data, decode_document, DEFAULT_CODEC_OPTIONS), want)
    assert_strict_equal(_native.decoded(data, decode_document, DEFAULT_CODEC_OPTIONS), want)


@LIST_PROPERTY
@given(docs=st.lists(documents, max_size=4))
def test_valid_lists_are_built_as_pymongo_decodes_them(docs: list[bytes]) -> None:
    data = b"".join(docs)
    want = bson.decode_all(data)
    built = _native._build(data, True)
    assert built is not NotImplemented
    assert_strict_equal(built, want)
    assert_strict_equal(_native._build_hit(data, decode_all_top, DEFAULT_CODEC_OPTIONS), want)
    assert_strict_equal(_native.decoded(data, decode_all_top, DEFAULT_CODEC_OPTIONS), want)
    want = as_batch_elements(data, DEFAULT_CODEC_OPTIONS, True)
    assert_strict_equal(_native._build(data, True, True), want)
    check_template(_native._build(data, True, True), want)
    assert_strict_equal(_native._build_hit(data, decode_documents, DEFAULT_CODEC_OPTIONS), want)
    assert_strict_equal(_native.decoded(data, decode_documents, DEFAULT_CODEC_OPTIONS), want)


@PROPERTY
@given(data=any_bytes)
@example(data=b"")
@example(data=document([(9, b"d", i64(MILLIS_MAX + 1))]))
@example(data=document([(9, b"d", i64(MILLIS_MIN - 1))]))
@example(data=document([(9, b"d", i64(-(2**63)))]))
@example(data=document([(2, b"\xff", string(b"x"))]))
@example(data=document([(5, b"u", i32(15) + b"\x04" + bytes(15))]))
@example(data=document([(8, b"b", b"\x02")]))
@example(data=document([(0x14, b"t", b"")]))
def test_any_bytes_give_what_pymongo_gives(data: bytes) -> None:
    check_bytes(data)


@LIST_PROPERTY
@given(parts=st.lists(any_bytes, min_size=1, max_size=3))
def test_any_list_bytes_give_what_pymongo_gives(parts: list[bytes]) -> None:
    check_list(b"".join(parts))


# -- targeted cases -----------------------------------------------------------------


def test_the_fast_paths_were_checked_and_taken() -> None:
    # Set-up compares each fast constructor with PyMongo's own objects and
    # takes it only if they match: on the CPython versions this package
    # supports, both do (a failure here means one fell back, slower).
    info = _native._build_info()
    assert info["ready"] is True
    assert info["objectid_fast"] is True
    assert info["datetime"] == "capi"


def test_built_objectids_behave_as_pymongo_s() -> None:
    oid = ObjectId()
    built = _native._build(bson.encode({"o": oid}))["o"]
    want = bson.decode(bson.encode({"o": oid}))["o"]
    assert type(built) is ObjectId
    assert built == want and hash(built) == hash(want) and str(built) == str(want)
    assert built.binary == oid.binary and built.generation_time == oid.generation_time
    assert pickle.loads(pickle.dumps(built)) == oid
    assert not hasattr(built, "__dict__")
    assert built != ObjectId() and {built: 1}[oid] == 1


@pytest.mark.parametrize(
    "instant",
    [
        datetime.datetime(1, 1, 1),
        datetime.datetime(9999, 12, 31, 23, 59, 59, 999000),
        datetime.datetime(1969, 12, 31, 23, 59, 59, 999000),
        datetime.datetime(1970, 1, 1),
        datetime.datetime(2000, 2, 29, 12, 30, 1, 1000),
        datetime.datetime(1900, 3, 1),
        datetime.datetime(2100, 2, 28, 23, 59, 59),
    ],
    ids=str,
)
def test_datetimes_at_the_edges_of_the_calendar(instant: datetime.datetime) -> None:
    data = bson.encode({"d": instant, "a": [instant]})
    assert_strict_equal(_native._build(data), bson.decode(data))


@pytest.mark.parametrize("millis", [MILLIS_MAX + 1, MILLIS_MIN - 1, 2**63 - 1, -(2**63)])
def test_a_datetime_out_of_range_raises_what_pymongo_raises(millis: int) -> None:
    data = document([(9, b"d", i64(millis))])
    assert _native._build(data) is NotImplemented
    with pytest.raises(Exception) as ours:
        _native._build_hit(data, decode_bson, DEFAULT_CODEC_OPTIONS)
    with pytest.raises(Exception) as theirs:
        bson.decode(data)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)
    # PyMongo's message quotes CPython's, whose words change between versions.
    assert isinstance(ours.value, bson.errors.InvalidBSON)


def test_what_some_pymongo_releases_refuse_is_left_to_the_installed_one() -> None:
    # A UUID subtype that is not 16 bytes (refused by PyMongo 4.17, taken by
    # 4.20) and regex flags that are not UTF-8 (ignored by 4.17, refused by
    # 4.20): the builder declines both, so the installed release decides.
    for data in (
        document([(5, b"u", i32(5) + b"\x03" + b"abcde")]),
        document([(5, b"u", i32(17) + b"\x04" + bytes(17))]),
        document([(11, b"r", b"^a\0i\xff\0")]),
    ):
        assert _native._build(data) is NotImplemented
        assert_same_outcome(
            outcome(lambda: _native._build_hit(data, decode_bson, DEFAULT_CODEC_OPTIONS)), outcome(lambda: bson.decode(data))
        )


def test_invalid_utf8_raises_what_pymongo_raises() -> None:
    for data in (document([(2, b"s", string(b"\xed\xa0\x80"))]), document([(16, b"\xc3(", i32(1))])):
        assert _native._build(data) is NotImplemented
        assert outcome(lambda: _native._build_hit(data, decode_bson, DEFAULT_CODEC_OPTIONS)) == outcome(
            lambda: bson.decode(data)
        )
        assert outcome(lambda: bson.decode(data))[1] is bson.errors.InvalidBSON


def test_every_listed_conversion() -> None:
    # The conversions PyMongo makes, each built (not declined), in one document.
    uid = uuid.UUID("12345678-1234-5678-1234-567812345678")
    doc = SON(
        [
            ("ref", DBRef("coll", ObjectId(), "db", extra=1)),
            ("ref_nodb", DBRef("coll", 5)),
            ("bytes", Binary(b"raw", 0)),
            ("uuid3", Binary(uid.bytes, 3)),
            ("uuid4", Binary.from_uuid(uid)),
            ("user", Binary(b"u", 0x80)),
            ("i64", Int64(2**40)),
            ("dec", Decimal128("1.5E-7")),
            ("re", Regex("^a.*", "imxslu")),
            ("code", Code("f()")),
            ("scope", Code("g()", {"x": 1, "d": {"$ref": "c", "$id": 1}})),
            ("ts", Timestamp(4000000000, 7)),
            ("min", MinKey()),
            ("max", MaxKey()),
            ("dt", datetime.datetime(2026, 1, 2, 3, 4, 5, 6000)),
            ("nested", [[{"a": [1.5, None, True]}]]),
        ]
    )
    data = bson.encode(doc)
    built = _native._build(data)
    assert built is not NotImplemented
    assert_strict_equal(built, bson.decode(data))
    assert type(built["ref"]) is DBRef and type(built["bytes"]) is bytes and type(built["uuid4"]) is Binary


@pytest.mark.parametrize(
    "codec",
    [
        CodecOptions(tz_aware=True),
        CodecOptions(tz_aware=True, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
        CodecOptions(uuid_representation=UuidRepresentation.STANDARD),
        CodecOptions(document_class=SON),
        CodecOptions(unicode_decode_error_handler="replace"),
        CodecOptions(datetime_conversion=DatetimeConversion.DATETIME_AUTO),
        CodecOptions(datetime_conversion=DatetimeConversion.DATETIME_MS),
        CodecOptions(
            type_registry=TypeRegistry([type("I64", (TypeDecoder,), {"bson_type": Int64, "transform_bson": int})()])
        ),
    ],
    ids=["tz_aware", "tzinfo", "uuid_standard", "son", "replace", "dt_auto", "dt_ms", "registry"],
)
def test_other_codec_options_are_decoded_by_pymongo(codec: CodecOptions) -> None:
    valid = bson.encode({"d": datetime.datetime(2026, 5, 1), "u": Binary.from_uuid(uuid.uuid4()), "n": Int64(3)})
    far = document([(9, b"far", i64(MILLIS_MAX + 5))])
    bad_utf8 = document([(2, b"bad", string(b"a\xffb"))])
    assert _native._build_codec_ok(codec) is False
    for data in (valid, far, bad_utf8):
        before = _native._build_info()
        got = outcome(lambda: _native._build_hit(data, decode_bson, codec))
        want = outcome(lambda: decode_bson(data, codec))
        assert type(got[1]) is type(want[1]) and repr(got) == repr(want)
        missed = outcome(lambda: _native.decoded(data, decode_bson, codec))
        assert type(missed[1]) is type(want[1]) and repr(missed) == repr(want)
        after = _native._build_info()
        assert (after["decoded"], after["built"]) == (before["decoded"] + 2, before["built"])


def test_default_codec_options_are_recognised_by_value() -> None:
    import pymongo

    assert _native._build_codec_ok(DEFAULT_CODEC_OPTIONS) is True
    assert _native._build_codec_ok(CodecOptions()) is True
    assert _native._build_codec_ok(pymongo.MongoClient(connect=False).codec_options) is True
    # A decoder other than PyMongo's two is always called, never bypassed.
    calls = []
    assert _native._build_hit(bson.encode({"a": 1}), lambda b, c: calls.append(c) or "mine", DEFAULT_CODEC_OPTIONS) == "mine"
    assert calls == [DEFAULT_CODEC_OPTIONS]
    # Many codec objects in turn (more than the verdicts remembered).
    for _ in range(3):
        for codec in [CodecOptions(), CodecOptions(tz_aware=True)] * 6:
            assert _native._build_codec_ok(codec) is (codec.tz_aware is False)


def test_nesting_past_the_builder_s_depth_gives_what_pymongo_gives() -> None:
    for depth in (1, 50, 199, 200, 201, 400):
        data = document([(16, b"leaf", i32(depth))])
        for i in range(depth):
            data = document([(3 if i % 2 else 4, b"0", data)])
        check_bytes(data)


@pytest.mark.skipif(
    sys.version_info >= (3, 12), reason="from 3.12 the C recursion limit is not sys.setrecursionlimit's"
)
def test_near_the_recursion_limit_the_builder_never_builds_what_pymongo_refuses() -> None:
    # PyMongo's decoder fails with the interpreter's RecursionError (as
    # InvalidBSON) where its recursion levels reach the limit; the builder
    # counts the same levels and must decline at that depth or before.
    def attempt(call: Any) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - comparing behaviours
            return exc

    documents_ = []
    for depth in range(1, 90):
        data = document([(16, b"leaf", i32(depth))])
        for i in range(depth):
            data = document([(3 if i % 2 else 4, b"0", data)])
        documents_.append(data)
    results = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + 60)
    try:
        for data in documents_:
            theirs = attempt(lambda: decode_bson(data, DEFAULT_CODEC_OPTIONS))
            ours = attempt(lambda: _native._build(data))
            results.append((theirs, ours))
    finally:
        sys.setrecursionlimit(limit)
    refused = 0
    for depth, (theirs, ours) in enumerate(results, 1):
        if isinstance(theirs, Exception):
            refused += 1
            assert ours is NotImplemented, f"depth {depth}: built what PyMongo refuses ({theirs!r})"
        elif ours is not NotImplemented:
            assert_strict_equal(ours, theirs)
    assert refused > 0, "the limit was never reached: the test proves nothing"


def test_field_names_that_share_their_ends_are_told_apart() -> None:
    # The same first and last 8 bytes: the key cache compares all of them.
    names_ = [f"abcdefgh{m}12345678" for m in ("a", "b", "ab", "ba", "c" * 30, "d" * 30, "e" * 60)]
    for order in (names_, names_[::-1]):
        data = bson.encode({n: i for i, n in enumerate(order)})
        assert list(_native._build(data)) == order
        assert_strict_equal(_native._build(data), bson.decode(data))


def test_more_field_names_than_the_key_cache_holds() -> None:
    doc = {f"k{i}": i for i in range(3000)}
    data = bson.encode(doc)
    for _ in range(2):
        assert_strict_equal(_native._build(data), bson.decode(data))


def test_threads_building_at_once_share_the_scratch_buffer_safely() -> None:
    # Regex, Code, DBRef and Binary are made by Python classes: a build can
    # let another thread in, which then builds in a buffer of its own.
    docs = [
        bson.encode({"i": i, "re": Regex(f"^{i}", "i"), "c": Code(f"f{i}", {"k": i}),
                     "r": DBRef("c", i), "b": Binary(bytes([i % 256]) * i, 0x80), "pad": "x" * (i * 37)})
        for i in range(64)
    ]  # fmt: skip
    expected = [bson.decode(d) for d in docs]
    errors: list[str] = []

    def work(seed: int) -> None:
        for n in range(300):
            k = (seed * 7 + n) % len(docs)
            found = strict_difference(_native._build_hit(docs[k], decode_bson, DEFAULT_CODEC_OPTIONS), expected[k])
            if found:
                errors.append(found)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []


# -- real hits ---------------------------------------------------------------------


def every_type_documents() -> list[bytes]:
    """Documents of every BSON type, as raw bytes (so that the types PyMongo
    cannot encode, undefined, symbol and DBPointer, are stored too)."""
    uid = uuid.UUID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
    first = bson.encode(
        SON(
            [
                ("_id", 1),
                ("s", "héllo"), ("f", -0.0), ("nan", float("nan")), ("i", -7), ("i64", Int64(-(2**62))),
                ("t", True), ("none", None), ("oid", ObjectId("0123456789abcdef01234567")),
                ("dt", datetime.datetime(1999, 12, 31, 23, 59, 59, 999000)), ("b", b"\x00\x01"),
                ("u3", Binary(uid.bytes, 3)), ("u4", Binary(uid.bytes, 4)), ("bu", Binary(b"z", 0x80)),
                ("dec", Decimal128("-0.0001")), ("re", Regex("a|b", "im")), ("code", Code("x")),
                ("cws", Code("y", {"z": [1, {"$ref": "r", "$id": 2}]})), ("ts", Timestamp(1, 2)),
                ("min", MinKey()), ("max", MaxKey()), ("ref", DBRef("other", 9, "db2", note="n")),
                ("nested", {"a": [{"b": [[], {}]}, [1, [2, [3.5]]]], "$ref": 3}),
                ("long_key_name_over_sixteen_bytes", 1),
            ]
        )
    )  # fmt: skip
    rare = document(
        [(16, b"_id", i32(2)), (6, b"undef", b""), (14, b"sym", string(b"symbol")),
         (12, b"ptr", string(b"coll") + bytes(range(12))), (5, b"old", i32(7) + b"\x02" + i32(3) + b"abc")]
    )  # fmt: skip
    return [first, rare]


async def test_real_hits_of_every_type_are_pymongo_s_objects(d, client, db_name) -> None:
    raw_docs = every_type_documents()
    client[db_name].items.insert_many([RawBSONDocument(r) for r in raw_docs])
    stored = list(client[db_name].items.find({}, sort=[("_id", 1)]))
    # Every hit built by the builder: no templates (test_templates.py).
    cache = d.manager(template_bytes=0)
    coll = await d.ready(cache, db_name)
    plain = d.client()[db_name].items
    reads = [
        ("find_one by _id", lambda c, i: c.find_one({"_id": i}), False),
        ("find_one by filter", lambda c, i: c.find_one({"_id": {"$in": [i]}}), False),
        ("find", lambda c, i: c.find({"_id": {"$gte": i}}, sort=[("_id", 1)]), True),
        ("aggregate", lambda c, i: c.aggregate([{"$match": {"_id": i}}]), True),
        ("count_documents", lambda c, i: c.count_documents({"_id": {"$gte": i}}), False),
        ("distinct", lambda c, i: c.distinct("nested.a", {"_id": i}), False),
    ]
    for what, read, cursor in reads:
        for doc in stored:
            i = doc["_id"]

            async def once(view: Any, read: Any = read, cursor: bool = cursor, i: int = i) -> Any:
                return await d.docs(read(view, i)) if cursor else await d.r(read(view, i))

            await d.served(cache, lambda: once(coll), what=f"{what} of {i} is served")
            before = _native._build_info()
            hits = cache.snapshot().hits
            got = await once(coll)
            assert cache.snapshot().hits == hits + 1, what
            after = _native._build_info()
            assert (after["built"], after["declined"]) == (before["built"] + 1, before["declined"]), what
            found = strict_difference(got, await once(plain))
            assert found is None, f"{what} of {i}: {found}"


async def test_real_misses_return_pymongo_s_objects_built_by_the_builder(d, client, db_name) -> None:
    """A miss's copy for its caller goes through the builder too
    (``_native.decoded``): a find_one and a find of every type, each a miss."""
    raw_docs = every_type_documents()
    client[db_name].items.insert_many([RawBSONDocument(r) for r in raw_docs])
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    plain = d.client()[db_name].items
    for doc in client[db_name].items.find({}, sort=[("_id", 1)]):
        i = doc["_id"]
        for what, read, cursor in (
            ("find_one", lambda c: c.find_one({"_id": i}), False),
            ("find", lambda c: c.find({"_id": {"$gte": i}}, sort=[("_id", 1)]), True),
        ):
            before, misses = _native._build_info(), cache.snapshot().misses
            got = await d.docs(read(coll)) if cursor else await d.r(read(coll))
            assert cache.snapshot().misses == misses + 1, f"{what} of {i} was not a miss"
            assert _native._build_info()["built"] > before["built"], f"{what} of {i}: the builder did not build"
            want = await d.docs(read(plain)) if cursor else await d.r(read(plain))
            found = strict_difference(got, want)
            assert found is None, f"{what} of {i}: {found}"


async def test_real_hits_under_other_codec_options_are_decoded_by_pymongo(d, client, db_name) -> None:
    client[db_name].items.insert_one({"_id": 1, "at": datetime.datetime(2026, 1, 1, 12)})
    codec = CodecOptions(tz_aware=True, tzinfo=datetime.timezone(datetime.timedelta(hours=-3)))
    cache = d.manager()
    await d.ready(cache, db_name)
    coll = cache[db_name].get_collection("items", codec_options=codec)
    await d.served(cache, lambda: coll.find_one({"_id": 1}))
    before = _native._build_info()
    got = await d.r(coll.find_one({"_id": 1}))
    after = _native._build_info()
    assert (after["decoded"], after["built"]) == (before["decoded"] + 1, before["built"])
    want = await d.r(d.client()[db_name].get_collection("items", codec_options=codec).find_one({"_id": 1}))
    assert got == want and repr(got) == repr(want) and got["at"].utcoffset() == datetime.timedelta(hours=-3)


async def test_a_corrupt_entry_raises_what_pymongo_raises(d, client, db_name) -> None:
    # An entry's bytes that PyMongo refuses (a datetime past year 9999),
    # admitted under a real miss's token: its hit raises PyMongo's error.
    client[db_name].items.insert_one({"_id": 1, "v": 1})
    cache = d.manager()
    coll = await d.ready(cache, db_name)
    engine = cache._engine
    held: list[Any] = []
    real_admit = engine.admit

    def hold(plan: Any, token: bytes, value: Any, rebind: bool = False, stamp: Any = NO_STAMP) -> None:
        held.append((plan, token, stamp))
        engine.admit = real_admit

    engine.admit = hold
    assert await d.r(coll.find_one({"_id": 1})) == {"_id": 1, "v": 1}
    ((plan, token, stamp),) = held
    corrupt = document([(16, b"_id", i32(1)), (9, b"v", i64(MILLIS_MAX + 1))])
    engine.admit(plan, token, corrupt, stamp=stamp)
    hits = cache.snapshot().hits
    with pytest.raises(bson.errors.InvalidBSON) as ours:
        await d.r(coll.find_one({"_id": 1}))
    assert cache.snapshot().hits == hits + 1
    with pytest.raises(bson.errors.InvalidBSON) as theirs:
        bson.decode(corrupt)
    assert str(ours.value) == str(theirs.value)
