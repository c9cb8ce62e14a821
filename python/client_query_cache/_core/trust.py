"""Where the change-stream followers find the certificate authorities.

A connection string that turns TLS on without ``tlsCAFile`` asks the driver
to verify the server against the platform's trust store. PyMongo does that
with Python's ``ssl`` module (``SSLContext.load_default_certs()``): the
``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` environment variables when set, else
the file and directory compiled into the OpenSSL that Python links. The
followers run on libmongoc, whose OpenSSL has its own compiled-in directory,
and in the wheel that OpenSSL is linked into the extension, built for
Debian's layout (``/etc/ssl``, that is ``/etc/ssl/certs``): left alone, it
finds nothing on RHEL and its relatives (``/etc/pki``). So the followers are handed the trust store that
PyMongo uses, resolved here in Python:

1. the file and directory Python's OpenSSL verifies with
   (``ssl.get_default_verify_paths()``: the environment variables when set,
   else its compiled-in ones), those of them that exist;
2. when neither variable is set and that gives no file (or no directory),
   the first existing of the bundles (and directories) the common Linux
   families keep (:data:`BUNDLE_LOCATIONS`): pyOpenSSL falls back to the
   same list for the same reason, an OpenSSL built for another layout.

The C side applies the result only where it means what the URI says
(``stream.c``, ``use_platform_trust``): TLS on, no ``tlsCAFile``, and
certificates checked. A ``tlsCAFile`` of the user's is never replaced, and
verification is never turned off. docs/deployment.md#tls records the
decision.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

try:
    import ssl
except ImportError:  # a Python built without it, where PyMongo has no TLS either
    ssl = None  # type: ignore[assignment]

__all__ = ["BUNDLE_LOCATIONS", "DIRECTORY_LOCATIONS", "Trust", "platform_trust"]

#: CA bundles (PEM, one file) where the common Linux families keep them;
#: the first that exists is used when Python's OpenSSL names none.
BUNDLE_LOCATIONS = (
    # Debian, Ubuntu (update-ca-certificates); also Arch, Gentoo.
    "/etc/ssl/certs/ca-certificates.crt",
    # RHEL, Fedora, CentOS, Rocky, Alma, Amazon Linux (update-ca-trust):
    # a link to the next one.
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    # openSUSE, SLES.
    "/etc/ssl/ca-bundle.pem",
    # Alpine.
    "/etc/ssl/cert.pem",
)

#: Hashed certificate directories (c_rehash), likewise.
DIRECTORY_LOCATIONS = ("/etc/ssl/certs",)

_ENV_VARS = ("SSL_CERT_FILE", "SSL_CERT_DIR")


@dataclasses.dataclass(frozen=True, slots=True)
class Trust:
    """The authorities the followers verify with when the URI names none.
    Either may be ``None``; both ``None`` leaves libmongoc's own default."""

    #: A PEM bundle of CA certificates.
    ca_file: str | None
    #: A directory of CA certificates named by their hash.
    ca_dir: str | None


def _first(paths: tuple[str, ...], exists: Callable[[str], bool]) -> str | None:
    return next((path for path in paths if exists(path)), None)


def platform_trust() -> Trust:
    """The trust store PyMongo verifies with in this process (see the
    module's docstring). Reads the environment and the file system anew on
    each call."""
    ca_file: str | None = None
    ca_dir: str | None = None
    if ssl is not None:
        paths = ssl.get_default_verify_paths()  # None for what does not exist
        ca_file, ca_dir = paths.cafile, paths.capath
    if not any(os.environ.get(name) for name in _ENV_VARS):
        if ca_file is None:
            ca_file = _first(BUNDLE_LOCATIONS, os.path.isfile)
        if ca_dir is None:
            ca_dir = _first(DIRECTORY_LOCATIONS, os.path.isdir)
    return Trust(ca_file, ca_dir)
