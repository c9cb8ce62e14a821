"""The connection string the C change-stream followers use.

The followers run on libmongoc, so they need a connection string for the same
deployment as the caller's PyMongo client. It is rebuilt from the client's
seeds and options; pass ``stream_uri=`` to the manager to give it explicitly
(for example for options this reconstruction does not carry). The string may
hold credentials: it is handed to C in memory and never logged or shown.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from .errors import CacheConfigurationError

__all__ = ["stream_uri_for"]

# URI options copied as they are, when the client has them.
_PASSTHROUGH = (
    "replicaSet",
    "authSource",
    "authMechanism",
    "tls",
    "ssl",
    "tlsCAFile",
    "tlsCertificateKeyFile",
    "tlsAllowInvalidCertificates",
    "tlsAllowInvalidHostnames",
    "tlsInsecure",
    "directConnection",
)


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


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
    if options.pool_options._ssl_context is not None and "tls" not in query and "ssl" not in query:
        query["tls"] = "true"

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
        uri += "?" + urlencode(query)
    return uri
