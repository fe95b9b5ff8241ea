"""The console's I/O shell: the observer thread and the aiohttp web server.

:class:`Console` starts two threads: the observer (a
:class:`dafka.cli.status.StatusProbe`, the observer of ``dafka status
--watch``, run in slices of ``interval`` seconds; each snapshot goes into the
:class:`~dafka.console.model.ConsoleModel`) and the web server (aiohttp on its
own event loop).  Pages are static shells; their script reads the JSON API
and a server-sent event stream (``/events``: the landing data once per
``interval``), and renders every name and content with ``textContent``, never
as markup.  Record contents are read only when the browser asks for them
(``/api/records``): over the mesh, FETCHed from the stores as a consumer reads
(:class:`~dafka.console.probe.ConsoleProbe`, bounded by
:class:`~dafka.console.model.PageFetch`), or from the local store of ``--db``.

Read-only: every route is a GET.  Pages carry a Content-Security-Policy that
allows only the console's own scripts.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import threading
import time
from importlib import resources
from pathlib import Path
from typing import Any

from aiohttp import web

from dafka.config import NodeConfig
from dafka.console.model import (
    FETCH_TIMEOUT,
    FORMATS,
    HOLES_READ,
    MAX_PAGE,
    PAGE_BYTES,
    ConsoleModel,
    PageFetch,
    offset_at_time,
    show_record,
)
from dafka.console.probe import ConsoleProbe
from dafka.store.db import RecordDB

log = logging.getLogger("dafka.console")

MAX_STREAMS = 64  # event streams open at once (pages beyond get 503)
MAX_PAGE_BYTES = PAGE_BYTES  # record contents read for one page of the record browser, at most
READ_AT_ONCE = 8  # records per read of the record browser
MAX_REFUSED_SHOWN = 20  # endpoints that refused our handshake, newest, in the alerts
STATIC = Path(str(resources.files("dafka.console") / "static"))
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def page(title: str, kind: str, name: str = "") -> str:
    """A page shell: the script fills it in (``name`` only ever as escaped text)."""
    e = html.escape
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{e(title)} - dafka console</title>
<link rel="stylesheet" href="/static/uPlot.min.css">
<link rel="stylesheet" href="/static/console.css">
</head>
<body data-page="{e(kind)}" data-name="{e(name)}">
<header><a href="/">dafka console</a> <span id="live" class="off">connecting</span></header>
<main><h1 id="title">{e(title)}</h1><div id="content"></div></main>
<script src="/static/uPlot.iife.min.js"></script>
<script src="/static/console.js"></script>
</body></html>
"""


class Console:
    """The observer and the web server (``with Console(...) as c: c.url``)."""

    def __init__(
        self,
        config: NodeConfig,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        db: str | None = None,
        interval: float = 1.0,
    ) -> None:
        self.config = config
        self.host = host
        self.port = port
        self.db_path = db
        self.interval = interval
        self.model = ConsoleModel()
        self.lock = threading.Lock()  # the model, between the observer and the server
        self.db_lock = threading.Lock()
        self._db: RecordDB | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._streams = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._probe: ConsoleProbe | None = None  # set once the observer is up
        self._observer = threading.Thread(target=self._observe, name="console-observer", daemon=True)
        self._server = threading.Thread(target=self._serve, name="console-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Console:
        self._server.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error
        self._observer.start()
        return self

    def close(self) -> None:
        self._stop.set()
        loop = self._loop
        if loop is not None and self._server.is_alive():
            loop.call_soon_threadsafe(lambda: None)  # wake it to see the stop
        self._server.join(10)
        self._observer.join(10)
        with self.db_lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> Console:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ observer

    def _observe(self) -> None:
        try:
            probe = ConsoleProbe(self.config)
        except Exception:
            log.exception("console: the observer could not start")
            return
        self._probe = probe
        try:
            while not self._stop.is_set():
                snap = probe.run(self.interval)
                snap["refused"] = probe.refused[-MAX_REFUSED_SHOWN:]  # secure: handshakes refused us
                parts, error, holes = self._db_partitions()
                with self.lock:
                    self.model.update(snap, time.monotonic(), parts, error, holes)
        except Exception:
            log.exception("console: the observer stopped")
        finally:
            self._probe = None
            probe.close()

    def _open_db(self) -> RecordDB | None:
        """The local store (read-only), opened when its database exists."""
        if self.db_path is None:
            return None
        if self._db is None:
            self._db = RecordDB(self.db_path, readonly=True)
        return self._db

    def _db_partitions(self) -> tuple[list[Any] | None, str | None, list[Any]]:
        """The local store's partitions, an error, and its first HOLES_READ recorded holes."""
        if self.db_path is None:
            return None, None, []
        with self.db_lock:
            try:
                db = self._open_db()
                assert db is not None
                return db.partitions(), None, [tuple(h) for h in db.holes(HOLES_READ)]
            except Exception as exc:  # noqa: BLE001 (shown as an alert; tried again next time)
                return [], f"{self.db_path}: {exc}", []

    # ------------------------------------------------------------ server

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._run_app())
        except BaseException as exc:  # noqa: BLE001 (handed to start())
            self._error = exc
            self._started.set()
        finally:
            loop.close()

    async def _run_app(self) -> None:
        app = web.Application(middlewares=[_headers])
        app.router.add_get("/", self._landing)
        app.router.add_get("/topics/{name:.+}", self._topic_page)
        app.router.add_get("/groups/{name:.+}", self._group_page)
        app.router.add_get("/api/state", self._api_state)
        app.router.add_get("/api/topic", self._api_topic)
        app.router.add_get("/api/group", self._api_group)
        app.router.add_get("/api/records", self._api_records)
        app.router.add_get("/events", self._events)
        app.router.add_static("/static/", STATIC, follow_symlinks=False)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self.host, self.port)
        try:
            await site.start()
            if self.port == 0:
                self.port = int(runner.addresses[0][1])  # the free port the system chose
            self._started.set()
            while not self._stop.is_set():
                await asyncio.sleep(0.1)
        finally:
            await runner.cleanup()

    async def _landing(self, request: web.Request) -> web.Response:
        return web.Response(text=page("Mesh", "landing"), content_type="text/html")

    async def _topic_page(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.Response(text=page(f"Topic {name}", "topic", name), content_type="text/html")

    async def _group_page(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        return web.Response(text=page(f"Group {name}", "group", name), content_type="text/html")

    def _landing_data(self) -> dict[str, Any]:
        with self.lock:
            return self.model.landing()

    async def _api_state(self, request: web.Request) -> web.Response:
        return web.json_response(self._landing_data())

    async def _api_topic(self, request: web.Request) -> web.Response:
        try:
            first = int(request.query.get("from", "0"))
        except ValueError:
            return web.json_response({"error": "from: a number"}, status=400)
        with self.lock:
            data = self.model.topic(request.query.get("name", ""), first)
        if data is None:
            return web.json_response({"error": "no such topic (yet)"}, status=404)
        return web.json_response(data)

    async def _api_group(self, request: web.Request) -> web.Response:
        try:
            first = int(request.query.get("from", "0"))
        except ValueError:
            return web.json_response({"error": "from: a number"}, status=400)
        with self.lock:
            data = self.model.group(request.query.get("name", ""), first=first)
        if data is None:
            return web.json_response({"error": "no such group (yet)"}, status=404)
        return web.json_response(data)

    async def _api_records(self, request: web.Request) -> web.Response:
        """A page of records: ``topic``, ``partition``, ``offset`` or ``time`` (ms since
        the epoch; default: the latest ``limit``), ``limit`` (at most MAX_PAGE), ``format``
        (auto, text, json, msgpack, hex)."""
        q = request.query
        topic, partition = q.get("topic", ""), q.get("partition", "")
        fmt = q.get("format", "auto")
        if fmt not in FORMATS:
            return web.json_response({"error": f"format: one of {', '.join(FORMATS)}"}, status=400)
        try:
            limit = min(MAX_PAGE, max(1, int(q.get("limit", "20"))))
            offset = int(q["offset"]) if q.get("offset", "") != "" else None
            at = int(q["time"]) if q.get("time", "") != "" else None  # ms since the epoch
        except ValueError:
            return web.json_response({"error": "offset, time (ms) and limit are numbers"}, status=400)
        if self.db_path is None:
            return await self._mesh_records(topic, partition, offset, limit, fmt, at)
        loop = asyncio.get_running_loop()
        try:
            data = await loop.run_in_executor(None, self._read_records, topic, partition, offset, limit, fmt, at)
        except Exception as exc:  # noqa: BLE001 (a bad name, an unreadable store: said, not fatal)
            return web.json_response({"error": str(exc)}, status=400)
        if data is None:
            return web.json_response({"error": "no such partition in the local store"}, status=404)
        return web.json_response(data)

    async def _mesh_records(
        self, topic: str, partition: str, offset: int | None, limit: int, fmt: str, at: int | None
    ) -> web.Response:
        """A page of records FETCHed over the mesh (no ``--db``): from ``offset``, or
        the latest ``limit`` below the partition's head as the mesh tells it."""
        if at is not None:
            return web.json_response(
                {"error": "records carry no timestamp over the mesh: from a time needs --db DIR"}, status=400
            )
        with self.lock:
            known, head = self.model.partition_head(topic, partition)
        if not known:
            return web.json_response({"error": "no such partition (yet)"}, status=404)
        probe = self._probe
        if probe is None:
            return web.json_response({"error": "the console's observer is not running"}, status=503)
        if head is None or (offset is not None and offset > head):
            start = head + 1 if head is not None else 0
            page = PageFetch(topic, partition, start if offset is None else offset, limit, fmt, 0.0)
            return web.json_response(page.result(None, head))  # nothing there yet
        start = max(0, head - limit + 1) if offset is None else max(0, offset)
        page = PageFetch(
            topic,
            partition,
            start,
            min(limit, head - start + 1),
            fmt,
            time.monotonic(),
            max_bytes=MAX_PAGE_BYTES,
            timeout=FETCH_TIMEOUT,
        )
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()

        def settle(result: dict[str, Any]) -> None:
            if not done.done():  # the request may have been given up meanwhile
                done.set_result(result)

        def finished(result: dict[str, Any]) -> None:  # on the observer's thread
            try:
                loop.call_soon_threadsafe(settle, result)
            except RuntimeError:  # the server stopped meanwhile
                pass

        probe.submit(page, None, head, finished)
        try:
            result = await asyncio.wait_for(done, FETCH_TIMEOUT + 5)
        except TimeoutError:
            return web.json_response({"error": "the console's observer did not answer"}, status=504)
        status = int(result.pop("status", 200))
        return web.json_response(result, status=status)

    def _read_records(
        self, topic: str, partition: str, offset: int | None, limit: int, fmt: str, at: int | None = None
    ) -> dict[str, Any] | None:
        with self.db_lock:
            db = self._open_db()
            assert db is not None
            info = db.info(topic, partition)
            if info is None:
                return None
            if at is not None:  # from a time: the first record stamped then or later

                def read_one(o: int) -> tuple[int, int] | None:
                    got = next(iter(db.read(topic, partition, o, 1)), None)
                    return None if got is None else (got.offset, got.ts_ms)

                offset = offset_at_time(read_one, info.first, info.last, at)
            start = max(info.first, info.last - limit + 1) if offset is None else max(0, offset)
            # A few records a read, up to MAX_PAGE_BYTES of contents: a page of huge
            # records does not hold them all in memory at once.
            records: list[dict[str, Any]] = []
            nxt, read_bytes, cut = start, 0, False
            while len(records) < limit:
                chunk = list(db.read(topic, partition, nxt, min(READ_AT_ONCE, limit - len(records))))
                if not chunk:
                    break
                for r in chunk:
                    records.append(show_record(r.offset, r.ts_ms, r.key, r.content, fmt))
                    read_bytes += len(r.content)
                    nxt = r.offset + 1
                if read_bytes >= MAX_PAGE_BYTES:
                    cut = len(records) < limit
                    break
        return {
            "topic": topic,
            "partition": partition,
            "first": info.first,
            "last": info.last,
            "offset": start,
            "next": nxt,  # where the next page starts
            "limit": limit,
            "cut": cut,  # fewer than limit: MAX_PAGE_BYTES of contents were read
            "source": "db",
            "records": records,
        }

    async def _events(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: the landing data once per interval (nothing is queued:
        a slow page gets the newest state when it reads again)."""
        if self._streams >= MAX_STREAMS:
            return web.Response(status=503, text="too many event streams open")
        self._streams += 1
        try:
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            while not self._stop.is_set():
                body = json.dumps(self._landing_data())
                await resp.write(f"data: {body}\n\n".encode())
                await asyncio.sleep(self.interval)
            return resp
        except ConnectionResetError:  # the page went away
            return resp
        finally:
            self._streams -= 1


@web.middleware
async def _headers(request: web.Request, handler: Any) -> web.StreamResponse:
    resp: web.StreamResponse = await handler(request)
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    return resp
