"""A `Service` on its own event-loop thread, as `kvmiss serve` runs it: for tests that drive a
whole service in-process (start, send, scrape, stop)."""

from __future__ import annotations

import asyncio
import threading

from kvmiss.enricher.service.serve import Service


class RunningService:
    """A Service on its own event loop thread, as `kvmiss serve` runs it."""

    def __init__(self, config):
        self.config = config
        self.service: Service | None = None
        self.started = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        assert self.started.wait(15), "service did not start"
        if self.error:
            raise self.error

    async def _main(self):
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            self.service = Service(self.config)
            await self.service.start()
        except BaseException as exc:  # surfaced in the test thread
            self.error = exc
            self.started.set()
            return
        self.started.set()
        await self._stop.wait()
        await self.service.shutdown()

    def stop(self):
        if self._loop and self._stop:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)
