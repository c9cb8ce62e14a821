"""The change-stream followers over TLS, against a real TLS endpoint:
SecantusDB's own TLS (``--tls-cert-file``, ``--tls-key-file``,
``--tls-ca-file``, ``--tls-require-client-cert``) on 127.0.0.1, with a test
CA, server and client certificates made by the ``openssl`` command at test
time.

What is proved (docs/deployment.md#tls):

* the TLS options of the client reach the followers and mean what they mean
  in PyMongo: ``tlsCAFile``, ``tlsCertificateKeyFile`` and its password,
  ``tlsInsecure``, ``tlsAllowInvalidCertificates``,
  ``tlsAllowInvalidHostnames``;
* a follower that cannot verify the server (another CA, a name the
  certificate does not carry, an expired certificate, a server whose
  certificate changed under it) reports ``failed`` and never serves: reads
  go to MongoDB, counted as ``stream_unhealthy``;
* without ``tlsCAFile`` and without ``SSL_CERT_FILE``, the followers verify
  with the platform's trust store, on Debian's layout and on RHEL's: each is
  shown to the real product in a private mount namespace (root and
  ``unshare`` needed; skipped otherwise) where /etc holds only the test CA,
  at the one path that layout uses;
* ``SSL_CERT_FILE`` and ``SSL_CERT_DIR`` are honoured as OpenSSL honours them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlsplit

import pymongo
import pytest

from client_query_cache import CacheManager, SharedCacheConfig, StreamState
from client_query_cache._core.trust import platform_trust
from client_query_cache._core.uri import stream_uri_for
from client_query_cache.testing import DisposableServer, external_uri
from support import DEADLINE_S, TEST_MAX_AWAIT_MS, served, stream_of, wait_until

pytestmark = [
    pytest.mark.skipif(
        external_uri() is not None,
        reason="MONGODB_URI is set: these tests need TLS servers with a test CA of their own",
    ),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

#: The password of the client's encrypted private key; characters that a
#: connection string must escape.
KEY_PASSWORD = "p@ss w/rd:%"

CHILD = Path(__file__).with_name("tls_child.py")


# -- the test PKI ------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: Path  # the test CA's certificate
    other_ca: Path  # a CA that signed nothing the servers present
    both_cas: Path  # the two in one bundle
    server: tuple[Path, Path]  # certificate (IP:127.0.0.1) and key, by the test CA
    other_server: tuple[Path, Path]  # the same name, by the other CA
    expired_server: tuple[Path, Path]  # by the test CA, expired in 2020
    client: Path  # certificate and encrypted key (KEY_PASSWORD) in one file
    crl_empty: Path  # the test CA's revocation list, revoking nothing
    crl_revoked: Path  # the test CA's revocation list, revoking the server's certificate


def _openssl(cwd: Path, *args: str) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"openssl {' '.join(args)}: {done.stderr}"


def _make_ca(d: Path, name: str) -> None:
    _openssl(
        d, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=cqc test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip


def _make_leaf(d: Path, name: str, ca: str, san: str, usage: str) -> None:
    _openssl(
        d, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
    )  # fmt: skip
    (d / f"{name}.ext").write_text(
        f"subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"
    )
    _openssl(
        d, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
    )  # fmt: skip


def _make_expired(d: Path, name: str, ca: str) -> None:
    """A server certificate valid only on 2020-01-01 (``openssl ca`` is the
    command of OpenSSL 3.0 that takes both dates)."""
    _make_leaf(d, name, ca, "IP:127.0.0.1", "serverAuth")  # the CSR and extensions
    (d / "index.txt").write_text("")
    (d / "ca.cnf").write_text(
        "[ca]\ndefault_ca = test\n"
        "[test]\ndatabase = index.txt\nnew_certs_dir = .\nserial = ca.serial\n"
        "default_md = sha256\npolicy = any\nunique_subject = no\n"
        "[any]\ncommonName = supplied\n"
    )
    (d / "ca.serial").write_text("1000\n")
    _openssl(
        d, "ca", "-batch", "-config", "ca.cnf", "-cert", f"{ca}.pem", "-keyfile", f"{ca}.key",
        "-in", f"{name}.csr", "-out", f"{name}.pem", "-notext", "-extfile", f"{name}.ext",
        "-startdate", "20200101000000Z", "-enddate", "20200102000000Z",
    )  # fmt: skip


def _make_crls(d: Path, ca: str, revoked: str) -> None:
    """Two revocation lists of ``ca``: one revoking nothing, one revoking
    the certificate ``revoked``.pem (``openssl ca`` keeps its own list)."""
    (d / "crl-index.txt").write_text("")
    (d / "crl.cnf").write_text(
        "[ca]\ndefault_ca = test\n[test]\ndatabase = crl-index.txt\ndefault_md = sha256\ndefault_crl_days = 2\n"
    )
    keys = ("-config", "crl.cnf", "-cert", f"{ca}.pem", "-keyfile", f"{ca}.key")
    _openssl(d, "ca", "-batch", *keys, "-gencrl", "-out", "crl-empty.pem")
    _openssl(d, "ca", "-batch", *keys, "-revoke", f"{revoked}.pem")
    _openssl(d, "ca", "-batch", *keys, "-gencrl", "-out", "crl-revoked.pem")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    _make_ca(d, "ca")
    _make_ca(d, "other")
    _make_leaf(d, "server", "ca", "IP:127.0.0.1", "serverAuth")
    _make_leaf(d, "other-server", "other", "IP:127.0.0.1", "serverAuth")
    _make_expired(d, "expired-server", "ca")
    _make_leaf(d, "client", "ca", "DNS:cqc-client", "clientAuth")
    _openssl(d, "pkey", "-in", "client.key", "-aes256", "-passout", f"pass:{KEY_PASSWORD}", "-out", "client-enc.key")
    (d / "client-both.pem").write_text((d / "client.pem").read_text() + (d / "client-enc.key").read_text())
    (d / "both-cas.pem").write_text((d / "ca.pem").read_text() + (d / "other.pem").read_text())
    _make_crls(d, "ca", "server")
    return Pki(
        dir=d,
        ca=d / "ca.pem",
        other_ca=d / "other.pem",
        both_cas=d / "both-cas.pem",
        server=(d / "server.pem", d / "server.key"),
        other_server=(d / "other-server.pem", d / "other-server.key"),
        expired_server=(d / "expired-server.pem", d / "expired-server.key"),
        client=d / "client-both.pem",
        crl_empty=d / "crl-empty.pem",
        crl_revoked=d / "crl-revoked.pem",
    )


def _tls_args(cert: tuple[Path, Path], client_ca: Path | None = None) -> list[str]:
    args = ["--tls-cert-file", str(cert[0]), "--tls-key-file", str(cert[1])]
    if client_ca is not None:
        args += ["--tls-ca-file", str(client_ca), "--tls-require-client-cert"]
    return args


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[DisposableServer]:
    """Server TLS with the test CA's certificate for 127.0.0.1."""
    with DisposableServer(extra_args=_tls_args(pki.server)) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(pki: Pki) -> Iterator[DisposableServer]:
    """The same, and a client certificate by the test CA required."""
    with DisposableServer(extra_args=_tls_args(pki.server, client_ca=pki.ca)) as server:
        yield server


@pytest.fixture(scope="module")
def expired_server(pki: Pki) -> Iterator[DisposableServer]:
    with DisposableServer(extra_args=_tls_args(pki.expired_server)) as server:
        yield server


def _uri(server: DisposableServer, host: str = "127.0.0.1", **options: Any) -> str:
    """A TLS connection string for ``server`` (options' values escaped)."""
    query = "tls=true&directConnection=true"
    for name, value in options.items():
        value = ("true" if value else "false") if isinstance(value, bool) else str(value)
        query += f"&{name}={quote(value, safe='')}"
    return f"mongodb://{host}:{server.port}/?{query}"


# -- helpers -------------------------------------------------------------------------


@pytest.fixture
def clients() -> Iterator[Callable[..., pymongo.MongoClient]]:
    made: list[pymongo.MongoClient] = []

    def make(uri: str, **options: Any) -> pymongo.MongoClient:
        options.setdefault("serverSelectionTimeoutMS", 10_000)
        client: pymongo.MongoClient = pymongo.MongoClient(uri, **options)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def db() -> str:
    return f"cqc_tls_{uuid.uuid4().hex[:12]}"


def _verified_hit_and_invalidation(manager: CacheManager, client: pymongo.MongoClient, db: str) -> None:
    """A document cached, changed through PyMongo, and the change seen in
    the cache through the follower (the new value served as a hit)."""
    client[db].items.insert_one({"_id": 1, "v": 1})
    coll = manager[db]["items"]
    assert manager.wait_ready(DEADLINE_S, database=db), f"the TLS follower did not serve: {manager.snapshot()!r}"
    assert served(manager, lambda: coll.find_one({"_id": 1})) == {"_id": 1, "v": 1}
    client[db].items.update_one({"_id": 1}, {"$set": {"v": 2}})
    wait_until(
        lambda: coll.find_one({"_id": 1}) == {"_id": 1, "v": 2},
        what="the update reached the cache through the TLS follower",
    )
    assert served(manager, lambda: coll.find_one({"_id": 1})) == {"_id": 1, "v": 2}
    assert stream_of(manager, db).events >= 1  # the update (the insert came before the stream)
    client.drop_database(db)


def _fails_and_bypasses(manager: CacheManager, client: pymongo.MongoClient, db: str, why: str) -> None:
    """The follower reports ``failed`` with ``why``; reads go to MongoDB
    (counted) and see every write; nothing is cached."""
    items = client[db].items
    items.insert_one({"_id": 1, "v": 1})
    coll = manager[db]["items"]
    stream = wait_until(
        lambda: (s := stream_of(manager, db)).state is StreamState.FAILED and s,
        what="the follower reports that it cannot verify the server",
    )
    assert why in stream.last_error, stream
    assert stream.reconnects >= 1
    before = manager.snapshot()
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
    items.update_one({"_id": 1}, {"$set": {"v": 2}})
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
    assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
    after = manager.snapshot()
    assert after.hits == before.hits == 0
    assert after.admissions == 0
    assert after.bypasses.get("stream_unhealthy", 0) - before.bypasses.get("stream_unhealthy", 0) == 3
    client.drop_database(db)


# -- the client's options reach the followers ----------------------------------------


def _query(uri: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(uri).query))


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"tls": True}, {"tls": "true"}),
        ({"tls": False}, {}),
        ({"tlsCAFile": "CA"}, {"tls": "true", "tlsCAFile": "CA"}),
        (
            {"tls": True, "tlsCertificateKeyFile": "CLIENT", "tlsCertificateKeyFilePassword": KEY_PASSWORD},
            {"tls": "true", "tlsCertificateKeyFile": "CLIENT", "tlsCertificateKeyFilePassword": KEY_PASSWORD},
        ),
        # PyMongo expands tlsInsecure into tlsAllowInvalidCertificates,
        # tlsAllowInvalidHostnames and tlsDisableOCSPEndpointCheck, which
        # libmongoc refuses to see beside it.
        ({"tls": True, "tlsInsecure": True}, {"tls": "true", "tlsInsecure": "true"}),
        # Verifying no certificate verifies nothing, in either driver.
        ({"tls": True, "tlsAllowInvalidCertificates": True}, {"tls": "true", "tlsInsecure": "true"}),
        ({"tls": True, "tlsAllowInvalidHostnames": True}, {"tls": "true", "tlsAllowInvalidHostnames": "true"}),
        ({"tls": True, "tlsAllowInvalidCertificates": False}, {"tls": "true"}),
        ({"tls": True, "tlsInsecure": False}, {"tls": "true"}),
        ({"tls": True, "tlsDisableOCSPEndpointCheck": True}, {"tls": "true", "tlsDisableOCSPEndpointCheck": "true"}),
        # libmongoc takes no such option: the package reads it back out and
        # gives it to the followers apart (crl_file_in).
        ({"tlsCAFile": "CA", "tlsCRLFile": "CRL"}, {"tls": "true", "tlsCAFile": "CA", "tlsCRLFile": "CRL"}),
    ],
)
def test_the_derived_stream_uri_carries_the_clients_tls_options_in_libmongocs_terms(
    pki: Pki, options: dict[str, Any], expected: dict[str, str]
) -> None:
    files = {"CA": str(pki.ca), "CLIENT": str(pki.client), "CRL": str(pki.crl_empty)}  # the table's placeholders
    options = {k: files.get(v, v) if isinstance(v, str) else v for k, v in options.items()}
    expected = {k: files.get(v, v) for k, v in expected.items()}
    client: pymongo.MongoClient = pymongo.MongoClient("mongodb://127.0.0.1:1/", connect=False, **options)
    try:
        query = _query(stream_uri_for(client))
    finally:
        client.close()
    query.pop("directConnection", None)
    assert query == expected


def test_a_verified_follower_serves_hits_and_sees_writes(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str
) -> None:
    # tlsCAFile given to PyMongo reaches the follower (the stream URI is
    # derived from the client); SSL_CERT_FILE of the environment, if any,
    # does not hold the test CA.
    client = clients(_uri(tls_server, tlsCAFile=pki.ca))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)


def test_a_revocation_list_that_revokes_nothing_still_lets_the_follower_serve(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str
) -> None:
    # The client's tlsCRLFile reaches the follower through the derived URI;
    # the certificate is not on the list, so both drivers verify it.
    client = clients(_uri(tls_server, tlsCAFile=pki.ca, tlsCRLFile=pki.crl_empty))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)


def test_a_client_certificate_and_its_password_reach_the_follower(
    mtls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str
) -> None:
    client = clients(
        _uri(mtls_server, tlsCAFile=pki.ca),
        tlsCertificateKeyFile=str(pki.client),
        tlsCertificateKeyFilePassword=KEY_PASSWORD,
    )
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)
        snapshot = repr(manager.snapshot())
    assert KEY_PASSWORD not in snapshot and quote(KEY_PASSWORD, safe="") not in snapshot


def test_a_follower_without_the_required_client_certificate_never_serves(
    mtls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str
) -> None:
    # The server refuses the follower (libmongoc sees the connection end, a
    # network error): it keeps trying, and reads bypass meanwhile.
    client = clients(_uri(mtls_server, tlsCAFile=pki.ca), tlsCertificateKeyFile=str(pki.client),
                     tlsCertificateKeyFilePassword=KEY_PASSWORD)  # fmt: skip
    stream_uri = _uri(mtls_server, tlsCAFile=pki.ca)
    with CacheManager(client, stream_uri=stream_uri, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        client[db].items.insert_one({"_id": 1, "v": 1})
        coll = manager[db]["items"]
        wait_until(lambda: stream_of(manager, db).reconnects >= 2, what="the follower was refused twice")
        assert not manager.wait_ready(0.5, database=db)
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
        assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 1}
        snapshot = manager.snapshot()
        assert snapshot.hits == 0 and snapshot.admissions == 0
        assert snapshot.bypasses.get("stream_unhealthy", 0) == 2
    client.drop_database(db)


@pytest.mark.parametrize("option", ["tlsInsecure", "tlsAllowInvalidCertificates"])
def test_a_client_that_does_not_verify_has_followers_that_do_not_either(
    tls_server: DisposableServer, clients: Callable[..., pymongo.MongoClient], db: str, option: str
) -> None:
    # By name, where the certificate only carries the address: PyMongo checks
    # neither the chain nor the name, and nor may the follower.
    client = clients(_uri(tls_server, host="localhost", **{option: True}))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)


def test_tls_allow_invalid_hostnames_still_verifies_the_chain(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str
) -> None:
    client = clients(_uri(tls_server, host="localhost", tlsCAFile=pki.ca, tlsAllowInvalidHostnames=True))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)
    # The name is not checked, the authority is.
    stream_uri = _uri(tls_server, host="localhost", tlsCAFile=pki.other_ca, tlsAllowInvalidHostnames=True)
    with CacheManager(client, stream_uri=stream_uri, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _fails_and_bypasses(manager, client, db, "certificate verify failed")


# -- a follower that cannot verify the server ------------------------------------------


@pytest.mark.parametrize(
    "case", ["another CA", "a name the certificate lacks", "an expired certificate", "a revoked certificate"]
)
def test_a_follower_that_cannot_verify_the_server_fails_and_reads_bypass(
    request: pytest.FixtureRequest, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str, case: str
) -> None:
    if case == "an expired certificate":
        server = request.getfixturevalue("expired_server")
        client = clients(_uri(server, tlsInsecure=True))  # PyMongo reads regardless
        stream_uri = _uri(server, tlsCAFile=pki.ca)
        why = "certificate has expired"
    else:
        server = request.getfixturevalue("tls_server")
        client = clients(_uri(server, tlsCAFile=pki.ca))
        if case == "another CA":
            stream_uri, why = _uri(server, tlsCAFile=pki.other_ca), "certificate verify failed"
        elif case == "a revoked certificate":
            # tlsCRLFile is no libmongoc URI option: it reaches the followers apart.
            stream_uri, why = _uri(server, tlsCAFile=pki.ca, tlsCRLFile=pki.crl_revoked), "certificate revoked"
        else:
            stream_uri, why = _uri(server, host="localhost", tlsCAFile=pki.ca), "hostname mismatch"
    with CacheManager(client, stream_uri=stream_uri, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _fails_and_bypasses(manager, client, db, why)


def test_an_owner_given_a_revocation_list_refuses_a_revoked_server(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient], db: str, runtime_dir: Path
) -> None:
    # The owner's connection string carries tlsCRLFile (SharedCache.start's
    # uri): its followers check the list; the workers' reads bypass.
    client = clients(_uri(tls_server, tlsCAFile=pki.ca))
    owner_uri = _uri(tls_server, tlsCAFile=pki.ca, tlsCRLFile=pki.crl_revoked)
    config = SharedCacheConfig(
        name=f"crl-{uuid.uuid4().hex[:8]}", start_owner=True, uri=owner_uri,
        max_await_time_ms=TEST_MAX_AWAIT_MS, grace_seconds=0,
    )  # fmt: skip
    with CacheManager(client, shared=config) as manager:
        # A worker sees the owner's follower's state, not its message.
        _fails_and_bypasses(manager, client, db, "")


def test_a_server_the_follower_can_no_longer_verify_stops_the_cache(pki: Pki, tmp_path: Path) -> None:
    # The server comes back on the same port and storage with a certificate
    # of another CA: the follower, which trusts only the test CA, must not
    # resume, and nothing cached before is served after.
    storage = tmp_path / "data"
    first = DisposableServer(storage_path=storage, extra_args=_tls_args(pki.server))
    second = DisposableServer(storage_path=storage, port=first.port, extra_args=_tls_args(pki.other_server))
    client: pymongo.MongoClient = pymongo.MongoClient(
        _uri(first, tlsCAFile=pki.both_cas), serverSelectionTimeoutMS=20_000
    )
    try:
        first.start()
        stream_uri = _uri(first, tlsCAFile=pki.ca)
        with CacheManager(client, stream_uri=stream_uri, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
            items = client.rotate.items
            items.insert_one({"_id": 1, "v": 1})
            coll = manager["rotate"]["items"]
            assert manager.wait_ready(DEADLINE_S, database="rotate"), manager.snapshot()
            assert served(manager, lambda: coll.find_one({"_id": 1})) == {"_id": 1, "v": 1}

            first.stop()
            second.start()
            items.update_one({"_id": 1}, {"$set": {"v": 2}})
            wait_until(
                lambda: stream_of(manager, "rotate").state is StreamState.FAILED,
                what="the follower refuses the server's new certificate",
            )
            hits = manager.snapshot().hits
            assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
            assert coll.find_one({"_id": 1}) == {"_id": 1, "v": 2}
            assert manager.snapshot().hits == hits
            assert "certificate verify failed" in stream_of(manager, "rotate").last_error
    finally:
        client.close()  # while a server still answers its endSessions
        first.close()
        second.close()


# -- the platform's trust store, without tlsCAFile ---------------------------------------


def _env_without_ca_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR")}


def test_ssl_cert_file_is_honoured(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient],
    db: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    assert platform_trust().ca_file == str(pki.ca)
    client = clients(_uri(tls_server))  # PyMongo verifies with it too
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)


def test_ssl_cert_dir_is_honoured(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient],
    db: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:  # fmt: skip
    hashed = tmp_path / "certs"
    hashed.mkdir()
    shutil.copy(pki.ca, hashed / "cqc-test-ca.pem")
    _openssl(tmp_path, "rehash", str(hashed))
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.setenv("SSL_CERT_DIR", str(hashed))
    assert platform_trust().ca_dir == str(hashed)
    client = clients(_uri(tls_server))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)


def test_a_client_certificate_reaches_a_follower_that_verifies_with_the_platform_trust_store(
    mtls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient],
    db: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Without tlsCAFile the follower's TLS settings are made anew with the
    # platform's authorities: the URI's key file and password must stay.
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    client = clients(_uri(mtls_server, tlsCertificateKeyFile=pki.client, tlsCertificateKeyFilePassword=KEY_PASSWORD))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)


def test_host_names_are_checked_with_the_platform_trust_store_unless_allowed(
    tls_server: DisposableServer, pki: Pki, clients: Callable[..., pymongo.MongoClient],
    db: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca))
    client = clients(_uri(tls_server, host="localhost", tlsAllowInvalidHostnames=True))
    with CacheManager(client, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _verified_hit_and_invalidation(manager, client, db)
    stream_uri = _uri(tls_server, host="localhost")
    with CacheManager(client, stream_uri=stream_uri, max_await_time_ms=TEST_MAX_AWAIT_MS) as manager:
        _fails_and_bypasses(manager, client, db, "hostname mismatch")


# Shell run as root in a private mount namespace (util-linux unshare):
# /etc becomes an overlay whose changes land in a tmpfs of the namespace
# (the machine's /etc is never written), its certificate stores are emptied
# and the test CA put where the layout keeps its bundle, and the child runs.
_LAYOUT_SCRIPT = r"""
set -eu
layout=$1 ca=$2 scratch=$3
shift 3
mount -t tmpfs cqc-etc "$scratch"
mkdir "$scratch/upper" "$scratch/work"
mount -t overlay cqc-etc -o "lowerdir=/etc,upperdir=$scratch/upper,workdir=$scratch/work" /etc
rm -rf /etc/ssl/certs /etc/pki
case $layout in
debian)
    mkdir -p /etc/ssl/certs
    cp "$ca" /etc/ssl/certs/ca-certificates.crt
    ;;
rhel)
    # As RHEL 9 lays it out: update-ca-trust's bundle, links to it, and
    # /etc/ssl/certs a link into /etc/pki.
    mkdir -p /etc/pki/tls/certs /etc/pki/ca-trust/extracted/pem
    cp "$ca" /etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem
    ln -s /etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem /etc/pki/tls/certs/ca-bundle.crt
    ln -s /etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem /etc/pki/tls/cert.pem
    ln -s ../pki/tls/certs /etc/ssl/certs
    ;;
esac
exec "$@"
"""


def _run_in_layout(layout: str, pki: Pki, scratch: Path, spec: dict[str, Any]) -> dict[str, Any]:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and util-linux's unshare for a private mount namespace")
    scratch.mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--",
         "sh", "-c", _LAYOUT_SCRIPT, "layout", layout, str(pki.ca), str(scratch),
         sys.executable, str(CHILD), json.dumps(spec)],
        capture_output=True, text=True, env=_env_without_ca_variables(), timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"the child failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shared", [False, True], ids=["process-local", "shared"])
@pytest.mark.parametrize("layout", ["debian", "rhel"])
def test_the_platform_trust_store_verifies_the_server_without_tlscafile(
    tls_server: DisposableServer, pki: Pki, tmp_path: Path, runtime_dir: Path, layout: str, shared: bool
) -> None:
    db = f"cqc_tls_{layout}_{uuid.uuid4().hex[:8]}"
    if layout == "debian":
        # Python's own OpenSSL (Debian's here) finds the CA too: PyMongo
        # verifies with no tlsCAFile, and the followers' URI is derived.
        spec = {"client_ca": None, "stream_uri": None}
    else:
        # This Python's OpenSSL was built for Debian's layout and finds
        # nothing on RHEL's, so PyMongo is given the CA (from a path of the
        # test's) and the followers a URI without one.
        spec = {"client_ca": str(pki.ca), "stream_uri": _uri(tls_server)}
    spec.update(port=tls_server.port, db=db, shared=shared)
    report = _run_in_layout(layout, pki, tmp_path / "scratch", spec)
    # The file found is the layout's bundle (through Python's compiled-in
    # name, a link, on Debian's; through the list of known bundles on RHEL's).
    assert report["trust_file_target"] == {
        "debian": "/etc/ssl/certs/ca-certificates.crt",
        "rhel": "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
    }[layout], report
    assert report["ready"], report
    assert report["state"] == "healthy", report
    assert report["hit_before"] and report["hit_after"], report
