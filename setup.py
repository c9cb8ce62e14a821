"""Builds the C extension ``client_query_cache._native``.

Project metadata lives in pyproject.toml; this file only describes the
extension. Compiler and linker flags for libmongoc and libbson come from
pkg-config: mongo-c-driver 2.x installs them as ``mongoc2`` and ``bson2``,
1.x as ``libmongoc-1.0`` and ``libbson-1.0``; the first pair pkg-config knows
is used (docs/packaging.md). ``CQC_SANITIZE=1`` in the environment builds with AddressSanitizer
and UndefinedBehaviorSanitizer (see .ci/sanitize for how to run it), at -O1,
or at the level ``CQC_SANITIZE_OPT`` names (0, 1, 2 or g): CI runs the suite
once more at -O0, where the compiler writes every byte a struct copy names
and keeps every load the source makes.

The extension is built against CPython's stable ABI (the limited API of 3.11),
so one wheel, tagged cp311-abi3, serves 3.11 and every later CPython; the
measurement behind that choice is in docs/packaging.md.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from glob import glob

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

# pkg-config's names for mongo-c-driver, newest major version first: 2.0
# renamed libmongoc-1.0 and libbson-1.0 to mongoc2 and bson2.
PKG_CONFIG_CANDIDATES = (("mongoc2", "bson2"), ("libmongoc-1.0", "libbson-1.0"))
# The static libraries .ci/build-vendored installs for the release wheel.
STATIC_PKG_CONFIG = ("libmongoc-static-1.0", "libbson-static-1.0")
INSTALL_HINT = (
    "Install mongo-c-driver's development files, 1.x or 2.x, and pkg-config "
    "(Debian and Ubuntu: apt-get install libmongoc-dev libbson-dev pkg-config); "
    "in a source checkout, `bash .ci/setup` installs them. Or install a binary "
    "wheel, which needs none of them."
)

COMPILE_ARGS = ["-Wall", "-Wextra", "-Werror", "-std=gnu11", "-O2", "-pthread", "-fvisibility=hidden"]
LINK_ARGS = ["-pthread"]
# A release or development build (not a sanitized one) is optimized across
# its files at link time, and calls into libpython and the libraries load
# their addresses from the GOT rather than going through PLT stubs: the hit
# path is many small functions in several files and CPython calls, and a
# hit after other code has run pays for every code line it touches
# (docs/benchmarks.md has the side-by-side runs). Plain -flto: zig cc,
# which builds the wheels, takes no -flto=auto.
OPTIMIZE_ARGS = ["-flto", "-fno-plt"]
# The oldest CPython whose limited API the extension is written to (3.11:
# Py_buffer and PyObject_GetBuffer joined the limited API there).
LIMITED_API_HEX = "0x030B0000"
LIMITED_API_TAG = "cp311"

# Later flags win, so the -O level here overrides the -O2 above.
SANITIZE_ARGS = [
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-fno-sanitize-recover=undefined",
    "-g",
]
SANITIZE_OPT_LEVELS = ("0", "1", "2", "g")


def sanitize_requested() -> bool:
    return os.environ.get("CQC_SANITIZE", "").strip().lower() in {"1", "true", "yes", "on"}


def sanitize_args() -> list[str]:
    """SANITIZE_ARGS and the optimization level of a sanitized build."""
    level = os.environ.get("CQC_SANITIZE_OPT", "").strip() or "1"
    if level not in SANITIZE_OPT_LEVELS:
        raise SystemExit(
            f"error: CQC_SANITIZE_OPT must be one of {', '.join(SANITIZE_OPT_LEVELS)}, not {level!r}"
        )
    return SANITIZE_ARGS + [f"-O{level}"]


def static_prefix_requested() -> str:
    """The prefix ``CQC_STATIC_PREFIX`` names, or "" for a build against
    the system's mongo-c-driver."""
    return os.environ.get("CQC_STATIC_PREFIX", "").strip()


def pkg_config_flags() -> tuple[list[str], list[str]]:
    """Return (cflags, libs) for libmongoc and libbson, or stop the build
    with a message that names the packages to install.

    ``CQC_STATIC_PREFIX`` names a prefix where .ci/build-vendored installed
    static libmongoc, libbson and OpenSSL (the release wheel's build): they
    are linked into the extension (see BuildExt.static_link_args)."""
    exe = shutil.which("pkg-config")
    if exe is None:
        raise SystemExit(f"error: pkg-config was not found. {INSTALL_HINT}")
    static_prefix = static_prefix_requested()
    env = dict(os.environ)
    if static_prefix:
        env["PKG_CONFIG_LIBDIR"] = os.path.join(static_prefix, "lib", "pkgconfig")
        candidates: tuple[tuple[str, ...], ...] = (STATIC_PKG_CONFIG,)
    else:
        candidates = PKG_CONFIG_CANDIDATES
    modules = next(
        (pair for pair in candidates if subprocess.run([exe, "--exists", *pair], env=env).returncode == 0),
        None,
    )
    if modules is None:
        names = " or ".join(" and ".join(pair) for pair in candidates)
        where = f" under {static_prefix}" if static_prefix else ""
        raise SystemExit(f"error: pkg-config cannot find {names}{where}. {INSTALL_HINT}")

    def query(*options: str) -> list[str]:
        out = subprocess.run(
            [exe, *options, *modules], check=True, capture_output=True, text=True, env=env
        ).stdout
        return shlex.split(out)

    if static_prefix:
        return query("--cflags"), query("--static", "--libs")
    return query("--cflags"), query("--libs")


class BuildExt(build_ext):
    """Adds the pkg-config and sanitizer flags when a build actually runs
    (so metadata and sdists work without libmongoc), and always recompiles:
    the flags depend on the environment, and a timestamp check would let a
    sanitized build reuse objects from a plain one or the other way round."""

    def run(self) -> None:
        cflags, libs = pkg_config_flags()
        if sanitize_requested():
            compile_extra = link_extra = sanitize_args()
        else:  # link-time optimization compiles again at link: at -O2 too
            compile_extra, link_extra = OPTIMIZE_ARGS, OPTIMIZE_ARGS + ["-O2"]
        if static_prefix_requested():
            libs += self.static_link_args()
        for ext in self.extensions:
            ext.extra_compile_args = cflags + COMPILE_ARGS + compile_extra
            ext.extra_link_args = libs + LINK_ARGS + link_extra
        self.force = True
        super().run()
        if self.inplace:
            self._remove_stale_inplace_builds()

    def static_link_args(self) -> list[str]:
        """With the libraries linked in, the extension exports its init
        function only: every other symbol, OpenSSL's above all, stays local,
        so it never binds to (or stands in for) the OpenSSL that Python's
        ``ssl`` loads into the same process. Symbols and debug information
        are stripped: the release wheel's size."""
        os.makedirs(self.build_temp, exist_ok=True)
        exports = os.path.join(self.build_temp, "exports.map")
        with open(exports, "w", encoding="ascii") as fh:
            fh.write("{\n  global: PyInit__native;\n  local: *;\n};\n")
        return [f"-Wl,--version-script={exports}", "-s"]

    def _remove_stale_inplace_builds(self) -> None:
        """An in-place (editable) build leaves the file it just wrote; a copy
        of the same extension under another ABI suffix (a build from before
        the switch to abi3, say) would shadow it at import, so it goes."""
        for ext in self.extensions:
            built = os.path.abspath(self.get_ext_fullpath(ext.name))
            stem = os.path.join(os.path.dirname(built), ext.name.rsplit(".", 1)[-1])
            for other in glob(stem + ".*.so"):
                if os.path.abspath(other) != built:
                    os.remove(other)


native = Extension(
    "client_query_cache._native",
    sources=sorted(glob("csrc/*.c")),
    depends=sorted(glob("csrc/*.h")),
    include_dirs=["csrc"],
    define_macros=[("Py_LIMITED_API", LIMITED_API_HEX)],
    py_limited_api=True,
)

setup(
    package_dir={"": "python"},
    packages=find_packages(where="python"),
    # py.typed and the stubs (_native.pyi) ship in every package that has them.
    package_data={"": ["py.typed", "*.pyi"]},
    ext_modules=[native],
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": LIMITED_API_TAG}},
)
