"""Running the app under uvicorn, and its shutdown.

On SIGTERM (or Ctrl-C) uvicorn stops its main loop and waits for every open connection to close before the app's
lifespan ends, however long a request still has to run: a non-streamed request of a few hundred tokens held a
server for 90 s. Here the shutdown drains instead (`Server.drain`): the listening sockets close at once, new
requests on open connections get 503, running requests have `shutdown_timeout` seconds to finish (vLLM's
--shutdown-timeout; 0, the default, aborts them at once), then they are aborted (each response ends with
finish_reason "abort"), uvicorn closes the connections and the engine stops.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

# After the drain, how long uvicorn waits for the connections left before it cancels their tasks.
CONNECTION_CLOSE_SECONDS = 5.0
# While draining, how often to look for a second Ctrl-C.
FORCE_EXIT_POLL_SECONDS = 0.1


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app_server, shutdown_timeout: float):
        super().__init__(config)
        self.app_server, self.shutdown_timeout = app_server, shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None):
        for server in self.servers:   # no new connections while the running requests drain
            server.close()
        drain = asyncio.ensure_future(self.app_server.drain(self.shutdown_timeout))
        while not drain.done() and not self.force_exit:   # a second Ctrl-C quits at once, as in uvicorn
            await asyncio.sleep(FORCE_EXIT_POLL_SECONDS)
        if not drain.done():
            drain.cancel()
        elif drain.exception() is not None:   # the shutdown goes on: uvicorn still closes what is left
            logging.getLogger("uvicorn.error").error("draining the requests failed", exc_info=drain.exception())
        await super().shutdown(sockets)


def run(app, *, host: str, port: int, log_level: str, shutdown_timeout: float = 0.0,
        sockets: list[socket.socket] | None = None):
    """Serves `app` (build_app's) until SIGTERM/SIGINT, then shuts down as the module says. `sockets`: already
    bound listening sockets to serve on (host and port then only name them)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=CONNECTION_CLOSE_SECONDS)
    DrainingServer(config, app.state.server, shutdown_timeout).run(sockets=sockets)
