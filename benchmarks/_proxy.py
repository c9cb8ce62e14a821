"""A TCP proxy with faults, for putting between a cache's change stream and
its server (``stream_uri=proxy.uri``): cut every connection, refuse new ones,
hold traffic (a stalled link: connections stay open, nothing moves) or delay
every chunk (a slow link). It runs an asyncio loop in a daemon thread; every
method may be called from any other thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

HOST = "127.0.0.1"
CHUNK = 65536


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = HOST) -> None:
        self._target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.port = 0
        #: New connections are closed at once while set.
        self.refusing = False
        #: Traffic waits (in both directions) while set.
        self.holding = False
        #: Seconds each chunk waits before it is forwarded.
        self.delay = 0.0
        #: Connections accepted, and cut by ``cut()``.
        self.accepted = 0
        self.cut_count = 0

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._cut()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def uri(self) -> str:
        return f"mongodb://{HOST}:{self.port}/?directConnection=true"

    # -- faults ----------------------------------------------------------------

    def cut(self) -> int:
        """Close every open connection now (both sides); returns how many."""
        return int(self._call(self._cut()))

    def heal(self) -> None:
        """Back to a plain proxy."""
        self.refusing = self.holding = False
        self.delay = 0.0

    async def _cut(self) -> int:
        conns = list(self._conns)
        for w in conns:
            with contextlib.suppress(Exception):
                w.transport.abort()
        self.cut_count += len(conns)
        return len(conns)

    # -- plumbing --------------------------------------------------------------

    def _call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        self._conns.update((writer, up_writer))
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._conns.discard(w)
                w.transport.abort()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(CHUNK):
                while self.holding:
                    await asyncio.sleep(0.005)
                if self.delay:
                    await asyncio.sleep(self.delay)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.transport.abort()
