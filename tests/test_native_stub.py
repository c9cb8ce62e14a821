"""The type stub ``_native.pyi`` describes the built extension: the same public
names at module level and on ``Cache``, constants of the declared types, and
``Cache``'s keywords accepted by the C keyword list. The stub is read from
beside the imported extension, so this checks whatever is installed (the
source tree, or a wheel)."""

from __future__ import annotations

import ast
import fcntl
import os
from pathlib import Path

import bson
import pytest

from client_query_cache import _native

STUB = Path(_native.__file__).with_name("_native.pyi")


def _public(names: object) -> set[str]:
    return {n for n in names if not n.startswith("_")}  # type: ignore[attr-defined]


def _stub_tree() -> ast.Module:
    assert STUB.is_file(), f"no stub beside {_native.__file__}"
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _declared(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a stub body declares, mapped to their declaration."""
    out: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
    return out


def _cache_class() -> ast.ClassDef:
    node = _declared(_stub_tree().body)["Cache"]
    assert isinstance(node, ast.ClassDef)
    return node


def test_the_stub_declares_exactly_the_public_names_of_the_module() -> None:
    assert _public(_declared(_stub_tree().body)) == _public(vars(_native))


def test_the_stub_declares_exactly_the_public_attributes_of_cache() -> None:
    assert _public(_declared(_cache_class().body)) == _public(dir(_native.Cache))


def test_the_stub_constants_have_the_declared_types() -> None:
    for name, node in _declared(_stub_tree().body).items():
        if not isinstance(node, ast.AnnAssign) or name.startswith("_"):
            continue
        annotation = ast.unparse(node.annotation)
        expected = {"Final[int]": int, "Final[str]": str}[annotation]
        assert type(getattr(_native, name)) is expected, name


def _constructor(name: str) -> ast.FunctionDef:
    node = _declared(_cache_class().body)[name]
    assert isinstance(node, ast.FunctionDef)
    assert [ast.unparse(d) for d in node.decorator_list] == ["classmethod"], name
    return node


def _values(tmp_path: Path) -> dict[str, object]:
    """Valid arguments for every constructor keyword; the optional ones at
    what the C code takes as its defaults."""
    return {
        "budget_bytes": 1 << 20,
        "slot_count": 1024,
        "uri": None,
        "max_await_time_ms": 100,
        "decode": bson.decode,
        "objectid_type": bson.ObjectId,
        "closed_error": RuntimeError,
        "forked_error": RuntimeError,
        "arena_path": str(tmp_path / "t.arena"),
        "segment_path": str(tmp_path / "w.ring"),
        "ring_bytes": 1 << 20,
        "heartbeat_timeout_ms": 1000,
        "arena_bytes": 0,
        "tls_ca_file": None,
        "tls_ca_dir": None,
        "tls_crl_file": None,
        "stream_scope": 0,
        "arena_fd": -1,
        "segment_fd": -1,
        "template_bytes": 0,
    }


@pytest.mark.parametrize("mode", ["local", "owner", "worker"])
def test_each_constructor_accepts_exactly_the_keywords_the_stub_declares(mode: str, tmp_path: Path) -> None:
    init = _constructor(mode)
    names = [a.arg for a in init.args.args[1:]]
    required = names[: len(names) - len(init.args.defaults)]
    values = _values(tmp_path)
    assert set(names) <= set(values), "update this test's values with the stub"
    owner = None
    if mode == "worker":
        # A worker attaches to a running owner's arena.
        owner = _native.Cache.owner(**{n: values[n] for n in _required("owner")})
    try:
        cache = getattr(_native.Cache, mode)(**{n: values[n] for n in names})
        try:
            assert cache.closed is False
            assert cache.geometry()["mode"] == getattr(_native, f"MODE_{mode.upper()}")
        finally:
            cache.close()
        with pytest.raises(TypeError):
            getattr(_native.Cache, mode)(**{n: values[n] for n in required}, not_a_keyword=1)
        with pytest.raises(TypeError):
            getattr(_native.Cache, mode)(**{n: values[n] for n in required[:-1]})
    finally:
        if owner is not None:
            owner.close()


def _required(mode: str) -> list[str]:
    init = _constructor(mode)
    names = [a.arg for a in init.args.args[1:]]
    return names[: len(names) - len(init.args.defaults)]


def test_cache_has_no_other_constructor() -> None:
    with pytest.raises(TypeError):
        _native.Cache()


def test_an_owner_serves_no_reads(tmp_path: Path) -> None:
    values = _values(tmp_path)
    owner = _native.Cache.owner(**{n: values[n] for n in _required("owner")})
    # The identity fast path reads through the same cache, from CoreBase and
    # from ViewBase's find_one.
    core = _native.CoreBase()
    core.native, core.codec, core.bound_session, core.fast = owner, bson.DEFAULT_CODEC_OPTIONS, lambda: None, True
    view = _native.ViewBase()
    view._core = core
    try:
        for call in (
            lambda: owner.lookup(0, 0, 1, b"", b"", None),
            lambda: owner.peek(0, 1, b"", b""),
            lambda: owner.capture(0, b""),
            lambda: owner.admit(b"", 1, b"", b"", None, 0, 0, 0, 0, False),
            lambda: core.fast_find_one({"_id": 1}),
            lambda: view.find_one({"_id": 1}),
        ):
            with pytest.raises(RuntimeError, match="owner serves no reads"):
                call()
    finally:
        owner.close()


def test_an_owner_and_a_worker_share_an_arena_through_memfds_and_refuse_unsealed_ones() -> None:

    values = _values(Path("/nonexistent"))
    arena = os.memfd_create("t.arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    ring = os.memfd_create("w.ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    owner = worker = None
    try:
        owner = _native.Cache.owner(**{n: values[n] for n in _required("owner") if n != "arena_path"},
                                    arena_path=None, arena_fd=arena)  # fmt: skip
        worker_args = {n: values[n] for n in _required("worker") if n not in ("arena_path", "segment_path")}
        # Not sealed yet: a descriptor handed over must be sealed against
        # shrinking, or its holder could kill the mapper with SIGBUS.
        with pytest.raises(PermissionError, match="sealed"):
            _native.Cache.worker(**worker_args, arena_path=None, segment_path=None, arena_fd=arena, segment_fd=ring)
        fcntl.fcntl(arena, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        worker = _native.Cache.worker(**worker_args, arena_path=None, segment_path=None, arena_fd=arena, segment_fd=ring)
        assert worker.geometry()["arena_bytes"] == owner.geometry()["arena_bytes"]
        with pytest.raises(ValueError, match="sealed"):
            owner.attach_ring(ring)
        fcntl.fcntl(ring, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        ring_id = owner.attach_ring(ring)
        assert ring_id > 0
        owner.detach_ring(ring_id)
        for bad in (-1, 1 << 40):
            with pytest.raises((ValueError, OverflowError)):
                owner.attach_ring(bad)
        with pytest.raises(ValueError, match="arena_path or arena_fd"):
            _native.Cache.owner(**{n: values[n] for n in _required("owner") if n != "arena_path"}, arena_path=None)
    finally:
        for cache in (worker, owner):
            if cache is not None:
                cache.close()
        os.close(arena)
        os.close(ring)
