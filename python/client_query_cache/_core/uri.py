"""The connection string the C change-stream followers use.

The followers run on libmongoc, so they need a connection string for the same
deployment as the caller's PyMongo client. It is rebuilt from the client's
seeds and options; pass ``stream_uri=`` to the manager to give it explicitly
(for example for options this reconstruction does not carry). The string may
hold credentials (a password, a key file's password): it is handed to C in
memory and never logged or shown.

TLS is rebuilt from what PyMongo made of its options, in libmongoc's terms
(docs/deployment.md#tls): TLS on whenever the client has an SSL context;
``tlsCAFile``, ``tlsCertificateKeyFile`` and its password as given; and the
checks the client skips. PyMongo expands ``tlsInsecure`` into the options it
stands for, which libmongoc refuses to see beside it, and a client that
verifies no certificate checks no host name and no OCSP status either (in
both drivers); so a client that allows invalid certificates gives
``tlsInsecure=true``, and one that only allows invalid host names gives
``tlsAllowInvalidHostnames=true``. Without ``tlsCAFile`` the followers
verify with the platform's trust store (trust.py), as PyMongo does.

``tlsCRLFile`` is carried too, though libmongoc takes no such URI option (it
ignores it, and its log is silenced): the package reads it back out of the
connection string, derived or given (``crl_file_in``), and hands it to the
followers beside the trust store, which set libmongoc's ``crl_file`` with it
(stream.c), so they check the server's certificate against the same
revocation list as PyMongo.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from .errors import CacheConfigurationError

__all__ = ["stream_uri_for", "crl_file_in"]

# URI options copied as they are, when the client has them.
_PASSTHROUGH = (
    "replicaSet",
    "authSource",
    "authMechanism",
    "directConnection",
)

# TLS files copied as they are when TLS is on (PyMongo has checked that the
# files are readable).
_TLS_FILES = (
    "tlsCAFile",
    "tlsCertificateKeyFile",
    "tlsCertificateKeyFilePassword",
    "tlsCRLFile",
)


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _tls_options(lowered: dict[str, Any]) -> dict[str, str]:
    """The TLS options of a client with TLS on, in libmongoc's terms
    (``lowered``: the client's options by lower-case name, as PyMongo
    validated and expanded them)."""
    query = {"tls": "true"}
    for name in _TLS_FILES:
        value = lowered.get(name.lower())
        if value is not None:
            query[name] = str(value)
    if lowered.get("tlsallowinvalidcertificates") is True:
        # Nothing is verified then, the name and OCSP included: one option
        # says so to libmongoc without clashing with the others.
        query["tlsInsecure"] = "true"
    else:
        if lowered.get("tlsallowinvalidhostnames") is True:
            query["tlsAllowInvalidHostnames"] = "true"
        if lowered.get("tlsdisableocspendpointcheck") is True:
            query["tlsDisableOCSPEndpointCheck"] = "true"
    return query


def stream_uri_for(client: Any) -> str:
    """Build a libmongoc connection string for ``client``'s deployment."""
    try:
        settings = client._topology_settings
        seeds = sorted(settings.seeds)
        options = client.options
        given = dict(options._options)
        creds = options.pool_options._credentials
        direct = options.direct_connection
    except AttributeError as exc:  # a PyMongo whose internals moved
        raise CacheConfigurationError(
            "cannot derive the change-stream connection string from this client; "
            "pass stream_uri="
        ) from exc
    if not seeds:
        raise CacheConfigurationError("the client has no seed hosts; pass stream_uri=")

    lowered = {k.lower(): v for k, v in given.items()}
    query: dict[str, str] = {}
    for name in _PASSTHROUGH:
        if name.lower() in lowered:
            query[name] = _format(lowered[name.lower()])
    if direct is not None:
        query["directConnection"] = _format(bool(direct))
    if options.pool_options._ssl_context is not None:
        query.update(_tls_options(lowered))

    userinfo = ""
    if creds is not None and creds.username:
        userinfo = quote(creds.username, safe="")
        if creds.password is not None:
            userinfo += ":" + quote(creds.password, safe="")
        userinfo += "@"
        query.setdefault("authSource", creds.source)
        if creds.mechanism and creds.mechanism != "DEFAULT":
            query.setdefault("authMechanism", creds.mechanism)

    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in seeds)
    uri = f"mongodb://{userinfo}{hosts}/"
    if query:
        # %20 for a space, not "+": libmongoc unescapes only %XX sequences
        # (a key file's password or a path with a space would change).
        uri += "?" + urlencode(query, quote_via=quote, safe="")
    return uri


def crl_file_in(uri: str) -> str | None:
    """The ``tlsCRLFile`` a connection string names (the last one given,
    its name in any case, as PyMongo reads options), or None."""
    found = None
    for name, value in parse_qsl(urlsplit(uri).query, keep_blank_values=True):
        if name.lower() == "tlscrlfile":
            found = value
    return found or None
