"""docs/api.md documents every public name, so the reference cannot drift.

Public: everything in ``client_query_cache.__all__`` and in the ``__all__``
of its public submodules; for every public class, its public methods,
properties and fields (those defined in the package, not inherited from
``object``, ``Exception``, ``str`` or ``Enum``), the protocol methods that
make it usable (``__getitem__``, ``__enter__``, ``__aiter__``, ...), and the
members of public enumerations, by name and by value.

Each class has a section in docs/api.md whose heading is its name in
backticks (``### `CacheManager` ``); a member is documented when that
section holds a code span that names it: `` `snapshot()` ``,
`` `manager.snapshot()` ``, `` `await manager.close()` ``, `` `__getitem__` ``.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import re
from pathlib import Path

import pytest

import client_query_cache

API_MD = Path(__file__).resolve().parent.parent / "docs" / "api.md"

#: Submodules an application imports by name.
PUBLIC_SUBMODULES = (
    "client_query_cache.synchronous",
    "client_query_cache.asynchronous",
    "client_query_cache.owner",
    "client_query_cache.testing",
    "client_query_cache.otel",
)

#: Protocol methods that are part of a class's interface when the package
#: defines them (``with``, ``async with``, ``manager[name]``, iteration,
#: attribute pass-through to PyMongo).
PROTOCOL = frozenset(
    {
        "__getitem__", "__getattr__", "__enter__", "__exit__", "__aenter__", "__aexit__",
        "__iter__", "__next__", "__aiter__", "__anext__",
    }
)  # fmt: skip


def public_modules() -> list[tuple[str, object]]:
    return [("client_query_cache", client_query_cache)] + [
        (name, importlib.import_module(name)) for name in PUBLIC_SUBMODULES
    ]


def public_names() -> list[tuple[str, str, object]]:
    """(module, name, object) for every name in a public ``__all__``."""
    out = []
    for module_name, module in public_modules():
        for name in module.__all__:  # type: ignore[attr-defined]
            out.append((module_name, name, getattr(module, name)))
    return out


def public_classes() -> dict[str, type]:
    return {name: obj for _, name, obj in public_names() if inspect.isclass(obj)}


def members(cls: type) -> set[str]:
    """Public members the package defines on ``cls`` or its package bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("client_query_cache"):
            continue
        for name in vars(klass):
            if (not name.startswith("_") or name in PROTOCOL) and not (
                isinstance(cls, enum.EnumMeta) and name in cls.__members__
            ):
                names.add(name)
        init = vars(klass).get("__init__")
        if init is not None and not dataclasses.is_dataclass(klass):
            # Instance attributes of plain classes: ``self.name = ...``.
            names.update(re.findall(r"^\s+self\.([a-z]\w*)\s*(?::[^=]*)?=", inspect.getsource(init), re.M))
    if isinstance(cls, enum.EnumMeta):
        for name, member in cls.__members__.items():
            names.add(name)
            names.add(member.value)
    return names


def sections(text: str) -> dict[str, str]:
    """Section text by the name in backticks of its heading (any level)."""
    out: dict[str, str] = {}
    heads = list(re.finditer(r"^(#{2,4}) `([\w.]+)`.*$", text, re.M))
    for i, head in enumerate(heads):
        end = len(text)
        for later in heads[i + 1 :]:
            if len(later.group(1)) <= len(head.group(1)):
                end = later.start()
                break
        out[head.group(2).rsplit(".", 1)[-1]] = text[head.end() : end]
    return out


def names_member(section: str, name: str) -> bool:
    """Whether a code span in ``section`` names ``name``: `name`, `name(...)`,
    `obj.name`, `await obj.name(...)`, `"value"`."""
    pattern = r"`(?:await |async |with |for )?(?:[\w\[\]\"']+\.)*" + re.escape(name) + r"(?![\w])"
    quoted = r"`\"" + re.escape(name) + r"\"`"
    return re.search(pattern, section) is not None or re.search(quoted, section) is not None


def missing(text: str) -> list[str]:
    """Every public name and member that docs/api.md does not document."""
    found = sections(text)
    gaps = []
    for module_name, name, _ in public_names():
        if name not in found and not re.search(r"`(?:[\w.]+\.)?" + re.escape(name) + r"(?![\w])", text):
            gaps.append(f"{module_name}.{name}")
    for name, cls in public_classes().items():
        section = found.get(name)
        if section is None:
            gaps.append(f"{name}: no section headed `{name}`")
            continue
        for member in sorted(members(cls)):
            if not names_member(section, member):
                gaps.append(f"{name}.{member}")
    return gaps


def test_every_public_name_is_in_the_api_reference() -> None:
    gaps = missing(API_MD.read_text(encoding="utf-8"))
    assert not gaps, "docs/api.md does not document: " + ", ".join(gaps)


def test_the_enumeration_finds_what_the_reference_must_hold() -> None:
    # The enumeration itself: names the reference must cover are found.
    classes = public_classes()
    assert {"CacheManager", "AsyncCachedCursor", "SharedCache", "DisposableServer", "CacheMetrics"} <= set(classes)
    assert {"snapshot", "get_database", "wait_ready", "close", "__getitem__", "__enter__"} <= members(
        classes["CacheManager"]
    )
    assert {"raw", "with_options", "find_one", "find", "__getattr__"} <= members(classes["CachedCollection"])
    assert {"STREAM_UNHEALTHY", "stream_unhealthy"} <= members(classes["BypassReason"])
    assert {"hits", "bypasses", "bypass_total", "streams"} <= members(classes["CacheSnapshot"])
    names = {name for _, name, _ in public_names()}
    assert {"disposable_uri", "main", "instrument", "__version__"} <= names


def without(text: str, heading: str, member: str) -> str:
    """``text`` without the lines of ``heading``'s section that name ``member``."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    level = heading.split(" ", 1)[0]
    out = lines[: start + 1]
    for j in range(start + 1, len(lines)):
        line = lines[j]
        if re.match(r"#{2,%d} " % len(level), line):
            return "".join(out + lines[j:])
        if not names_member(line, member):
            out.append(line)
    return "".join(out)


@pytest.mark.parametrize(
    ("heading", "member", "reported"),
    [
        ("### `CacheManager`", "snapshot", "CacheManager.snapshot"),
        ("### `BypassReason`", "owner_unavailable", "BypassReason.owner_unavailable"),
        ("### `AsyncCachedCursor`", "__aiter__", "AsyncCachedCursor.__aiter__"),
        ("### `SharedCache`", "pid", "SharedCache.pid"),
        ("### `CacheSnapshot`", "bypass_total", "CacheSnapshot.bypass_total"),
    ],
)
def test_a_member_removed_from_the_reference_is_reported(heading: str, member: str, reported: str) -> None:
    text = API_MD.read_text(encoding="utf-8")
    assert not missing(text)
    assert reported in missing(without(text, heading, member))


def test_a_class_without_its_section_is_reported() -> None:
    text = API_MD.read_text(encoding="utf-8").replace("### `StreamSnapshot`", "### Stream snapshots")
    assert "StreamSnapshot: no section headed `StreamSnapshot`" in missing(text)
