"""Developer sessions: `nox -s tests`, `nox -s tests_sanitized`, `nox -s bench_quick`.

CI does not need nox: .ci/run does the same through .ci/setup and .ci/sanitize.
"""

from __future__ import annotations

import glob
import os
import subprocess

import nox

nox.options.sessions = ["tests"]
PYTHON = "3.11"


def _gcc_runtime(session: nox.Session, name: str) -> str:
    """Absolute path of a sanitizer runtime shipped with gcc."""
    path = subprocess.run(
        ["gcc", f"-print-file-name={name}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        session.error(f"gcc has no {name}; install gcc (Debian: apt-get install gcc)")
    return path


def _require_asan_build(session: nox.Session) -> None:
    """Refuse to test an extension that is not instrumented."""
    pattern = os.path.join(
        session.virtualenv.location,
        "lib/python3*/site-packages/client_query_cache/_native*.so",
    )
    found = glob.glob(pattern)
    ldd = subprocess.run(["ldd", *found[:1]], capture_output=True, text=True).stdout
    if not found or "libasan" not in ldd:
        session.error("the installed _native extension is not built with ASan")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The test suite against the normal build."""
    session.install(".[test]")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def tests_sanitized(session: nox.Session) -> None:
    """The test suite against an ASan/UBSan build of the extension.

    pip runs the build backend in a child process that inherits this
    environment, so CQC_SANITIZE reaches setup.py even with build isolation;
    setup.py always recompiles, so no object of a plain build is reused.
    """
    session.install(".[test]", env={"CQC_SANITIZE": "1"})
    _require_asan_build(session)
    preload = " ".join(
        _gcc_runtime(session, lib) for lib in ("libasan.so", "libubsan.so")
    )
    session.run(
        "pytest",
        *session.posargs,
        env={
            # The interpreter is not instrumented, so the ASan runtime must be
            # loaded before anything else.
            "LD_PRELOAD": preload,
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
            "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
        },
    )


@nox.session(python=PYTHON)
def bench_quick(session: nox.Session) -> None:
    """The shared-cache benchmark, short run, against a disposable server."""
    session.install(".[bench]")
    session.run("python", "-m", "benchmarks.public_shared_cache", "--quick", *session.posargs)


@nox.session(python=False)
def fuzz(session: nox.Session) -> None:
    """Fuzz the C core under ASan/UBSan with libFuzzer (.ci/fuzz).

    `nox -s fuzz` runs every target for about a minute in total;
    `nox -s fuzz -- SECONDS [TARGET...]` sets the total time and the targets
    (docs/fuzzing.md). No virtualenv: the targets are plain C programs.
    """
    session.run("bash", ".ci/fuzz", *session.posargs, external=True)
