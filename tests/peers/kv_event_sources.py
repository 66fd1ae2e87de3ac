"""An engine as [fleet.engines] sees it: a real HTTP server answering ``GET /kv_event_sources``
in vLLM 0.32's shape, in front of real ZeroMQ publishers (kvmiss's demo publisher, byte for byte
vLLM's wire) bound on ports the OS picks, one per data-parallel rank.

`restart()` is an engine process that came back on new ports; `stop_answering()` closes the
HTTP listener (connections refused) while the publishers run on; `answer_with(body)` makes it
answer anything (bad answers).
"""

from __future__ import annotations

import http.server
import json
import threading
import time

import zmq

from kvmiss.enricher.demo.publisher import BlockStored, EventBatch, Publisher


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        engine: EngineHttp = self.server.engine  # type: ignore[attr-defined]
        engine.asked += 1
        if engine.delay_s:
            time.sleep(engine.delay_s)
        status, body = engine.reply(self.path)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class EngineHttp:
    """``/kv_event_sources`` on ``host``:``port`` (0: a free one), answering ``sources()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host, self.port = host, port
        self.body: bytes | None = None  # None: the publishers' sources
        self.status = 200
        self.delay_s = 0.0
        self.asked = 0
        self.sources: dict[int, dict] = {}
        self._server: http.server.ThreadingHTTPServer | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def reply(self, path: str) -> tuple[int, bytes]:
        if path != "/kv_event_sources":
            return 404, b'{"detail":"Not Found"}'
        if self.body is not None:
            return self.status, self.body
        return self.status, json.dumps({str(rank): s for rank, s in self.sources.items()}).encode()

    def start(self) -> None:
        server = http.server.ThreadingHTTPServer((self.host, self.port), _Handler)
        server.daemon_threads = True
        server.engine = self  # type: ignore[attr-defined]  (the handler reads it from its server)
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop_answering(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def answer_with(self, body: bytes | None, status: int = 200) -> None:
        self.body, self.status = body, status


def vllm_source(pub: Publisher, topic: str = "kv-events", *, wildcard: bool = False) -> dict:
    """vLLM 0.32's `KVEventsConfig` of one rank, as /kv_event_sources answers it."""
    endpoint, replay = pub.pub_endpoint, pub.replay_endpoint
    if wildcard:  # a fixed port bound on every interface is answered as configured
        endpoint, replay = (e.replace("127.0.0.1", "*") for e in (endpoint, replay))
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
            "replay_endpoint": replay, "buffer_steps": pub.buffer_steps, "hwm": 100000,
            "max_queue_size": 100000, "topic": topic}


class DpEngine:
    """An engine with ``ranks`` data-parallel ranks: one publisher each, one HTTP server."""

    def __init__(self, ranks: int = 2, *, host: str = "127.0.0.1", port: int = 0, wildcard: bool = False):
        self.ctx = zmq.Context.instance()
        self.ranks, self.wildcard = ranks, wildcard
        self.pubs: list[Publisher] = []
        self.http = EngineHttp(host, port)
        self.seq = 0
        self.restart()

    @property
    def url(self) -> str:
        return self.http.url

    def restart(self) -> None:
        """A new engine process: new publishers on new ports, seq from 0, a new answer."""
        for pub in self.pubs:
            pub.shutdown(crash=True)
        self.pubs = [Publisher(self.ctx, topic="kv-events") for _ in range(self.ranks)]
        for pub in self.pubs:
            pub.start()
        self.http.sources = {rank: vllm_source(pub, wildcard=self.wildcard) for rank, pub in enumerate(self.pubs)}

    def publish(self) -> None:
        """One step on every rank: a block stored with a fresh hash."""
        self.seq += 1
        for rank, pub in enumerate(self.pubs):
            block = self.seq * 100 + rank
            pub.publish(EventBatch(ts=time.time(), data_parallel_rank=rank, events=[BlockStored(
                block_hashes=[block], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                lora_id=None, medium="GPU", lora_name=None)]))

    def close(self) -> None:
        self.http.stop_answering()
        for pub in self.pubs:
            pub.shutdown(crash=True)
