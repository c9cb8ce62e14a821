"""Proof that client_query_cache runs from an installed wheel that carries
libmongoc, libbson and OpenSSL inside its extension.

- ``python installed_wheel.py``: check once and print what was found.
- ``python -m pytest -p installed_wheel``: a pytest plugin that checks the
  process running the suite at its start and again at its end (after every
  test has loaded and used the extension), prints the findings under the
  summary, and fails the run if a check fails. Under pytest-xdist (``-n``)
  every worker process, which is where the tests run, is checked at its
  start and end too: each reports its findings to the controlling process,
  which prints them and fails the run if a worker's check failed or a
  worker reported none.

The checks: ``client_query_cache`` and its ``_native`` extension are imported
from this interpreter's site-packages (not from a source tree); ``ldd`` of the
extension resolves every library it needs, and each is one the manylinux
policy counts as part of the system (glibc's), so no mongo-c-driver or
OpenSSL library comes from anywhere; and /proc/self/maps shows no libmongoc,
libbson or libmongocrypt mapped from anywhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path

#: Libraries of mongo-c-driver, which must never be loaded: the wheel's
#: extension has them linked in.
DRIVER_LIBS = ("libmongoc", "libbson", "libmongocrypt")
#: What the extension may need from the system (glibc's libraries, and the
#: dynamic loader and vDSO of x86-64 and aarch64).
SYSTEM_LIBS = (
    "linux-vdso.so.1",
    "libc.so.6",
    "libm.so.6",
    "libpthread.so.0",
    "libdl.so.2",
    "libresolv.so.2",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
)

LDD_LINE = re.compile(r"^\s*(\S+)(?:\s+=>\s+(.+?))?(?:\s+\(0x[0-9a-f]+\))?$")


class NotFromWheel(Exception):
    pass


def _is_driver_lib(name: str) -> bool:
    return any(Path(name).name.startswith(lib) for lib in DRIVER_LIBS)


def check() -> list[str]:
    """Run the checks in this process; return the findings as lines, or raise
    NotFromWheel naming every problem."""
    import client_query_cache
    from client_query_cache import _native

    site = Path(sysconfig.get_paths()["platlib"]).resolve()
    package = Path(client_query_cache.__file__).resolve()
    native = Path(_native.__file__).resolve()
    problems = [f"{p} is not in {site}" for p in (package, native) if site not in p.parents]
    lines = [
        f"interpreter: {sys.executable}",
        f"client_query_cache: {package}",
        f"_native: {native}",
    ]

    ldd = subprocess.run(["ldd", str(native)], capture_output=True, text=True, check=True).stdout
    needed = []
    for line in ldd.splitlines():
        m = LDD_LINE.match(line)
        if not m:
            continue
        name, path = m.group(1), m.group(2)
        needed.append(Path(name).name)
        if path == "not found":
            problems.append(f"ldd: {name} not found")
        elif Path(name).name not in SYSTEM_LIBS:
            problems.append(f"ldd: the extension needs {name} ({path}), not a system library")
    lines.append(f"ldd: {', '.join(needed)}")
    if not needed:
        problems.append("ldd: no libraries listed (not a dynamically linked extension?)")

    mapped = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            mapped.add(fields[5])
    for path in sorted(p for p in mapped if _is_driver_lib(p)):
        problems.append(f"maps: {path} is mapped")
    lines.append("maps: no libmongoc, libbson or libmongocrypt mapped")
    if problems:
        raise NotFromWheel("; ".join(problems))
    return lines


# -- pytest plugin ---------------------------------------------------------------

_findings: dict[str, list[str]] = {}
#: Under pytest-xdist, in the controlling process: each worker's findings
#: (what it put in config.workeroutput), by worker id.
_worker_findings: dict[str, dict[str, object]] = {}
_workers_down: list[str] = []


def _is_xdist_worker(config) -> bool:  # type: ignore[no-untyped-def]
    return hasattr(config, "workerinput")


def pytest_sessionstart(session) -> None:  # type: ignore[no-untyped-def]
    import pytest

    try:
        _findings["start"] = check()
    except NotFromWheel as e:
        raise pytest.UsageError(f"not running from the installed wheel: {e}") from None


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    failed = False
    try:
        _findings["end"] = check()
    except NotFromWheel as e:
        _findings["end"] = [f"FAILED: {e}"]
        failed = True
    config = session.config
    if _is_xdist_worker(config):
        # Sent to the controlling process with the worker's last event
        # (xdist's own pytest_sessionfinish wraps this hook and sends after it).
        config.workeroutput["installed_wheel"] = {"findings": dict(_findings), "failed": failed}
    else:
        for worker in _workers_down:
            report = _worker_findings.get(worker)
            if report is None:
                _findings[f"end of worker {worker}"] = ["FAILED: the worker reported no findings"]
                failed = True
            elif report["failed"]:
                failed = True
    if failed:
        session.exitstatus = 1


try:
    from pytest import hookimpl as _hookimpl
except ImportError:  # run as a script where pytest is not installed

    def _hookimpl(**_options):  # type: ignore[no-untyped-def]
        return lambda function: function


# Known to pytest only when pytest-xdist is installed, hence optional.
@_hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # type: ignore[no-untyped-def]
    """pytest-xdist's hook, in the controlling process: a worker finished
    (or died: then ``error`` is set and it sent nothing)."""
    worker = node.gateway.id
    _workers_down.append(worker)
    report = getattr(node, "workeroutput", {}).get("installed_wheel")
    if report is not None:
        _worker_findings[worker] = report


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    for when, lines in _findings.items():
        terminalreporter.write_sep("-", f"installed wheel, checked at the session's {when}")
        for line in lines:
            terminalreporter.write_line(line)
    for worker, report in sorted(_worker_findings.items()):
        for when, lines in report["findings"].items():  # type: ignore[union-attr]
            terminalreporter.write_sep("-", f"installed wheel, checked at worker {worker}'s {when}")
            for line in lines:
                terminalreporter.write_line(line)


if __name__ == "__main__":
    try:
        for line in check():
            print(line)
    except NotFromWheel as e:
        sys.exit(f"not running from the installed wheel: {e}")
    print("ok: the installed wheel is used, with mongo-c-driver linked into its extension")
