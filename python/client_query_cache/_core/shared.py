"""Shared cache plumbing: names, the per-user runtime directory, the control
protocol between workers and the owner, and a worker's link to its owner.

Files of a shared cache ``NAME`` live in one directory per user, created
owner-only (0700) and checked on every use (owned by this uid, no access for
others): ``$CQC_RUNTIME_DIR`` if set, else ``/dev/shm/client-query-cache-UID``.

    NAME.arena            the arena, created by the owner (0600), mapped
                          read-only by workers
    NAME.sock             the owner's control socket (peer uid checked)
    NAME.lock             held (flock) by the running owner
    NAME.starting         held (flock) by a worker starting the owner
    NAME.w<pid>-<hex>.ring  one worker's admission ring (0600), created by the
                          worker, mapped by the owner, removed on detach

An owner that requires a capability (``SharedCache.start(require_capability=
True)``) keeps neither an arena nor rings there: its arena is a memfd that it
hands, read-only, to each worker that presents the capability, over the
control socket (SCM_RIGHTS), and each worker hands its ring's memfd back the
same way; both are sealed against shrinking and growing.

No suffix above ends another, so no name's files can be another name's:
NAME + s1 == OTHER + s2 only when NAME == OTHER. A name starts with a letter or a digit, so none is a hidden
file or reads as an option.

Control protocol: one JSON object per line each way (at most 1 MiB). Requests: ``info``
(the ring size, the identity salt, whether a capability is required),
``hello`` (check the deployment, the identity and the capability; attach a
ring, or with a capability required answer with the arena's descriptor),
``ring`` (with a capability required: attach the ring whose descriptor comes
with it), ``register`` (a namespace: the owner starts the database's
stream), ``snapshot`` (group statistics), ``stop``. Credentials never cross
it: the owner gets its connection string and capability on stdin.
"""

from __future__ import annotations

# The owner imports this module: only C modules here, not json, re, socket or
# threading, whose Python layers (and the enum module they share) would add
# about 2 MiB to the owner's private memory (owner.py).
import _operator
import _socket
import _thread
import os
import stat
import struct
from _json import encode_basestring_ascii, make_scanner

from .. import TYPE_CHECKING
from .errors import CacheConfigurationError, CacheError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

__all__ = [
    "SharedCacheError",
    "ring_bytes_for",
    "validate_name",
    "runtime_dir",
    "paths_for",
    "deployment_of_client",
    "deployment_of_uri",
    "same_deployment",
    "identity_of_client",
    "identity_of_uri",
    "identity_proof",
    "identity_mismatch",
    "encode_message",
    "decode_message",
    "send_message",
    "recv_message",
    "LineReader",
    "OwnerLink",
    "SharedCacheConnection",
    "new_capability",
    "capability_matches",
]

_NAME_FIRST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_NAME_REST = _NAME_FIRST | frozenset("_.-")
_NAME_MAX = 64
#: Bytes of a worker's admission ring. A record takes at most half a ring (so
#: that one always fits once the ring drains, wherever its head is), so a ring
#: has room for two records of the largest admissible entry and its key. The
#: owner drains every ring at least once a millisecond, so a ring rarely holds
#: more than a few records, but every byte a worker ever wrote into it stays
#: resident (shared memory): rings are kept no larger than that.
MIN_RING_BYTES = 1024 * 1024
RECORD_HEADROOM_BYTES = 64 * 1024
#: Seconds a worker waits for its owner's answer to one request.
REQUEST_TIMEOUT_S = 5.0


def ring_bytes_for(max_entry_bytes: int) -> int:
    """The ring size for entries of up to ``max_entry_bytes`` (whole pages)."""
    size = max(MIN_RING_BYTES, 2 * (int(max_entry_bytes) + RECORD_HEADROOM_BYTES))
    return (size + 4095) // 4096 * 4096


class SharedCacheError(CacheError, RuntimeError):
    """The shared cache's owner cannot be reached, started or trusted."""


def validate_name(name: object) -> str:
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= _NAME_MAX
        or name[0] not in _NAME_FIRST
        or not _NAME_REST.issuperset(name)
    ):
        raise CacheConfigurationError(
            "shared cache name must match [A-Za-z0-9][A-Za-z0-9_.-]{0,63}, got " + repr(name)
        )
    return name


def runtime_dir(create: bool) -> str:
    """The per-user directory of shared caches, checked for ownership."""
    path = os.environ.get("CQC_RUNTIME_DIR") or f"/dev/shm/client-query-cache-{os.getuid()}"
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            os.makedirs(path, 0o700, exist_ok=True)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SharedCacheError(f"no shared cache runs for this user ({path} does not exist)") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise SharedCacheError(
            f"{path} must be a directory owned by uid {os.getuid()} with mode 0700; refusing to use it"
        )
    return path


def paths_for(name: str, create: bool = False) -> dict[str, str]:
    d = runtime_dir(create)
    return {
        "dir": d,
        "arena": os.path.join(d, f"{name}.arena"),
        "sock": os.path.join(d, f"{name}.sock"),
        "lock": os.path.join(d, f"{name}.lock"),
        "starting": os.path.join(d, f"{name}.starting"),
    }


def ring_path(name: str) -> str:
    return os.path.join(runtime_dir(False), f"{name}.w{os.getpid()}-{os.urandom(4).hex()}.ring")


# -- deployment identity ----------------------------------------------------


def _normalize(hosts: Iterable[tuple[str, int]]) -> list[str]:
    return sorted(f"{h.lower()}:{int(p)}" for h, p in hosts)


def deployment_of_client(client: Any) -> dict[str, Any]:
    """Seeds and replica set name of a (sync or async) PyMongo client."""
    settings = client._topology_settings
    return {"hosts": _normalize(settings.seeds), "replica_set": settings.replica_set_name}


def deployment_of_uri(uri: str) -> dict[str, Any]:
    from pymongo.uri_parser import parse_uri

    parsed = parse_uri(uri)
    options = parsed.get("options") or {}
    replica_set = next((v for k, v in options.items() if k.lower() == "replicaset"), None)
    return {"hosts": _normalize(parsed["nodelist"]), "replica_set": replica_set}


def same_deployment(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same replica set name (or neither has one) and at least one seed in common."""
    return a.get("replica_set") == b.get("replica_set") and bool(set(a["hosts"]) & set(b["hosts"]))


# -- MongoDB identity ---------------------------------------------------------
#
# A hit never reaches MongoDB, so MongoDB's access control never sees it: a
# worker may read a shared cache only if its client authenticates as the
# owner's connection string does (docs/deployment.md, "Who may attach").
# An identity is the credential PyMongo builds from a client's options or
# from a connection string (mechanism, source, user, password); what crosses
# the control socket and what the owner keeps is the mechanism, source and
# user, and for the password a PBKDF2 proof under a salt the owner drew at
# its start, never the password. The owner does not import PyMongo or
# hashlib: the process that starts it computes its proof.

#: PBKDF2-HMAC-SHA256 rounds of a password's proof: an owner's memory or a
#: control message read by a process of the same user does not give the
#: password back for the price of one hash.
PROOF_ROUNDS = 100_000


def _identity_of_credentials(creds: Any) -> dict[str, Any] | None:
    if creds is None:
        return None
    return {
        "mechanism": str(creds.mechanism or "DEFAULT"),
        "source": None if creds.source is None else str(creds.source),
        "user": None if creds.username is None else str(creds.username),
        "secret": None if creds.password is None else str(creds.password),
    }


def identity_of_client(client: Any) -> dict[str, Any] | None:
    """The identity a (sync or async) PyMongo client authenticates as (None:
    it has no credentials). Holds the password: never sent or shown."""
    try:
        creds = client.options.pool_options._credentials
    except AttributeError as exc:  # a PyMongo whose internals moved
        raise CacheConfigurationError(
            "cannot read the MongoDB identity of this client for the shared cache"
        ) from exc
    return _identity_of_credentials(creds)


def identity_of_uri(uri: str) -> dict[str, Any] | None:
    """The identity a connection string authenticates as, as PyMongo builds
    it for a client of that string."""
    from pymongo.client_options import _parse_credentials
    from pymongo.uri_parser import parse_uri

    parsed = parse_uri(uri)
    return _identity_of_credentials(
        _parse_credentials(parsed["username"], parsed["password"], parsed["database"], parsed["options"])
    )


def identity_proof(identity: dict[str, Any] | None, salt: str) -> dict[str, Any] | None:
    """What is sent and kept of an identity: its password replaced by its
    proof under ``salt`` (hex)."""
    if identity is None:
        return None
    import hashlib

    secret = identity.get("secret")
    proof = None
    if secret is not None:
        proof = hashlib.pbkdf2_hmac("sha256", secret.encode(), bytes.fromhex(salt), PROOF_ROUNDS).hex()
    return {"mechanism": identity["mechanism"], "source": identity["source"], "user": identity["user"], "proof": proof}


def _same(a: object, b: object) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return _operator._compare_digest(a.encode(), b.encode())
    return a is None and b is None


def identity_mismatch(worker: object, owner: dict[str, Any] | None) -> str | None:
    """Why a worker whose client authenticates as ``worker`` (its
    identity_proof under the owner's salt) may not read an owner's arena
    whose connection string authenticates as ``owner``; None when it may.
    Names the worker's user, never the owner's, and no secret."""
    if worker is not None and not isinstance(worker, dict):
        return "the worker sent no valid identity"
    if owner is None:
        if worker is None:
            return None
        return "the worker's client authenticates to MongoDB and the owner's connection string does not"
    if worker is None:
        return "the worker's client has no MongoDB credentials and the owner's connection string has some"
    user = worker.get("user")
    mine = f"the worker's is {user!r} of {worker.get('source')!r}" if isinstance(user, str) else "the worker's names none"
    if not _same(worker.get("user"), owner["user"]) or not _same(worker.get("source"), owner["source"]):
        return f"the worker's client authenticates to MongoDB as another user than the owner's ({mine})"
    if not _same(worker.get("mechanism"), owner["mechanism"]):
        return "the worker's client authenticates to MongoDB with another mechanism than the owner's"
    if not _same(worker.get("proof"), owner["proof"]):
        return "the worker's client authenticates to MongoDB with another password than the owner's"
    return None


# -- messages ---------------------------------------------------------------
#
# JSON through the C halves of the json module: its scanner, and its string
# escaper under a small encoder for the types messages hold.

#: Bytes of the longest control message.
MAX_MESSAGE_BYTES = 1 << 20


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


class _Strict:
    """The json module's decoder settings, for its C scanner."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_no_constant)


_scan = make_scanner(_Strict())


def _encode(value: Any, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(encode_basestring_ascii(value))
    elif value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        out.append(int.__repr__(value))
    elif isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{value!r} is not JSON")
        out.append(float.__repr__(value))
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                raise TypeError(f"a message's keys are str, not {type(key).__name__}")
            out.append(", " if i else "")
            out.append(encode_basestring_ascii(key))
            out.append(": ")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            out.append(", " if i else "")
            _encode(item, out)
        out.append("]")
    else:
        raise TypeError(f"a message cannot hold {type(value).__name__}")


def encode_message(message: dict[str, Any]) -> bytes:
    """``message`` as one line of JSON, newline included."""
    out: list[str] = []
    _encode(message, out)
    out.append("\n")
    return "".join(out).encode("ascii")


def decode_message(line: bytes | str) -> dict[str, Any]:
    """The JSON object on ``line``; ValueError if it is not one."""
    text = (line.decode("utf-8") if isinstance(line, bytes) else line).strip(" \t\r\n")
    try:
        message, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("a control message must be JSON") from None
    except SystemError:
        # CPython 3.11's scanner raises json.decoder.JSONDecodeError only if
        # json.decoder is imported already; otherwise (in the owner, which
        # does not import json) a truncated string or object makes it return
        # NULL with no exception set, which the interpreter reports as this.
        raise ValueError("a control message must be JSON") from None
    if end != len(text):
        raise ValueError("a control message must be one JSON value")
    if not isinstance(message, dict):
        raise ValueError("a control message must be a JSON object")
    return message


def send_message(sock: Any, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send ``message``; with ``fds``, those descriptors go with its first
    byte (SCM_RIGHTS), and the receiver's LineReader collects them."""
    data = encode_message(message)
    if fds:
        sent = sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class _suppress_os_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        return kind is not None and issubclass(kind, OSError)


#: The most file descriptors one message may carry (SCM_RIGHTS).
MAX_FDS = 1


class LineReader:
    """The lines a socket receives, read in chunks, and the file
    descriptors that came with them (``fds``, oldest first: whoever takes
    one closes it; ``close_fds`` closes those nobody took)."""

    __slots__ = ("_sock", "_buf", "fds")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._buf = bytearray()
        self.fds: list[int] = []

    def _recv(self) -> bytes:
        chunk, ancillary, _flags, _addr = self._sock.recvmsg(65536, _socket.CMSG_SPACE(4 * MAX_FDS))
        for level, kind, data in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                n = len(data) // 4
                self.fds.extend(struct.unpack(f"{n}i", data[: 4 * n]))
        return chunk

    def take_fd(self) -> int | None:
        """The oldest descriptor received and not taken, or None."""
        return self.fds.pop(0) if self.fds else None

    def close_fds(self) -> None:
        while self.fds:
            with _suppress_os_error():
                os.close(self.fds.pop())

    def readline(self, limit: int) -> bytes:
        """The next line, newline included, or at most ``limit`` bytes of
        it; what is left at end of stream (b"" once nothing is)."""
        buf = self._buf
        while True:
            end = buf.find(b"\n", 0, limit)
            if end >= 0 or len(buf) >= limit:
                end = end + 1 if end >= 0 else limit
                line = bytes(buf[:end])
                del buf[:end]
                return line
            chunk = self._recv()
            if not chunk:
                line = bytes(buf)
                buf.clear()
                return line
            buf += chunk


def recv_message(reader: Any) -> dict[str, Any] | None:
    """One message from a ``LineReader`` (or ``sock.makefile("rb")``); None
    at end of stream."""
    line = reader.readline(MAX_MESSAGE_BYTES)
    if not line:
        return None
    return decode_message(line)


def peer_uid(sock: Any) -> int:
    creds = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


# -- capabilities -------------------------------------------------------------

#: The string form of a SharedCacheConnection: ``cqc1:NAME:CAPABILITY``.
CONNECTION_PREFIX = "cqc1:"
_HEX = frozenset("0123456789abcdef")


def new_capability() -> str:
    """32 random bytes, as 64 lowercase hex digits."""
    return os.urandom(32).hex()


def _check_capability(value: object) -> str:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise CacheConfigurationError("a shared cache's capability is 64 lowercase hex digits")
    return value


def capability_matches(given: object, expected: str) -> bool:
    """Whether ``given`` is the capability ``expected`` (in constant time)."""
    return isinstance(given, str) and _operator._compare_digest(given.encode(), expected.encode())


class SharedCacheConnection:
    """What a worker needs to attach to a shared cache: its name and the
    capability its owner was started with (``SharedCache.connection``).
    Pass it as ``CacheManager(client, shared=connection)``, pickled to a
    worker process, or as its string form ``str(connection)``
    (``cqc1:NAME:CAPABILITY``, for an environment variable), which
    ``CacheManager(shared=...)`` and ``SharedCacheConnection.parse`` take.
    The capability is a secret: ``repr()`` leaves it out."""

    __slots__ = ("name", "capability")

    def __init__(self, name: str, capability: str) -> None:
        object.__setattr__(self, "name", validate_name(name))
        object.__setattr__(self, "capability", _check_capability(capability))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("SharedCacheConnection is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (SharedCacheConnection, (self.name, self.capability))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SharedCacheConnection)
            and other.name == self.name
            and capability_matches(other.capability, self.capability)
        )

    def __hash__(self) -> int:
        return hash((self.name, self.capability))

    def __repr__(self) -> str:
        return f"SharedCacheConnection(name={self.name!r}, capability=<hidden>)"

    def __str__(self) -> str:
        return f"{CONNECTION_PREFIX}{self.name}:{self.capability}"

    @classmethod
    def parse(cls, text: object) -> SharedCacheConnection:
        """The connection whose string form is ``text``;
        CacheConfigurationError for anything else (the message never
        quotes it)."""
        if not isinstance(text, str) or not text.startswith(CONNECTION_PREFIX):
            raise CacheConfigurationError(f"a shared cache connection string starts with {CONNECTION_PREFIX!r}")
        name, sep, capability = text[len(CONNECTION_PREFIX) :].rpartition(":")
        if not sep:
            raise CacheConfigurationError("a shared cache connection string is 'cqc1:NAME:CAPABILITY'")
        return cls(name, capability)


class OwnerLink:
    """A worker's connection to its owner: the control socket (kept open for
    the worker's life; the owner detaches the worker when it closes) and the
    request/response exchange over it."""

    def __init__(self, name: str, capability: str | None = None) -> None:
        self.name = validate_name(name)
        #: The capability this worker presents (None: it attaches by name).
        self.capability = capability
        self.paths = paths_for(name)
        self._lock = _thread.allocate_lock()
        self._sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            # The owner answers at once; a longer wait means it hangs, and
            # a request may hold a read (registering a collection) that long.
            self._sock.settimeout(REQUEST_TIMEOUT_S)
            self._sock.connect(self.paths["sock"])
            if peer_uid(self._sock) != os.getuid():
                raise SharedCacheError(f"the owner of {name!r} runs as another user; refusing to attach")
        except OSError as exc:
            self._sock.close()
            raise SharedCacheError(f"no owner of shared cache {name!r} answers: {exc}") from None
        except BaseException:
            self._sock.close()
            raise
        self._reader = LineReader(self._sock)

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        reply, fds = self.request_fds(op, None, **fields)
        for fd in fds:  # none was asked for
            with _suppress_os_error():
                os.close(fd)
        return reply

    def request_fds(self, op: str, fds: list[int] | None, **fields: Any) -> tuple[dict[str, Any], list[int]]:
        """``request`` sending ``fds`` with the request; also the
        descriptors that came with the reply (the caller closes them)."""
        with self._lock:
            try:
                send_message(self._sock, {"op": op, **fields}, fds)
                reply = recv_message(self._reader)
            except (OSError, ValueError) as exc:
                self._reader.close_fds()
                raise SharedCacheError(f"the owner of {self.name!r} did not answer: {exc}") from None
            received, self._reader.fds = self._reader.fds, []
        if reply is None or not reply.get("ok"):
            for fd in received:
                with _suppress_os_error():
                    os.close(fd)
        if reply is None:
            raise SharedCacheError(f"the owner of {self.name!r} closed the connection")
        if not reply.get("ok"):
            raise SharedCacheError(str(reply.get("error", "the owner refused the request")))
        return reply, received

    def close(self) -> None:
        self._sock.close()
