"""A real server on a free port of 127.0.0.1, in a background thread of this process (for tests and
notebooks): ``with serving(engine, max_batch_seqs=...) as (url, server): ...``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from engine.serve.app import Server, bind_socket, lower_this_thread, make_server, uvicorn_server
from engine.serve.config import ServeConfig


@contextmanager
def serving(engine, model_name: str = "test-model", api_key: str | None = None, **settings) -> Iterator[tuple[str, Server]]:
    """Serve ``engine`` (an ``engine.runtime.Engine``) until the block ends; yields (API base URL, server)."""
    cfg = replace(ServeConfig(), host="127.0.0.1", port=0, log_level="warning", **settings)
    server = make_server(engine, cfg, model_name, api_key)
    sock = bind_socket(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    uv = uvicorn_server(server.app(), cfg)
    server.loop.start()
    def run() -> None:
        lower_this_thread(cfg.http_thread_nice)  # as `engine serve` does
        uv.run(sockets=[sock])

    thread = threading.Thread(target=run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1", server
    finally:
        uv.should_exit = True
        thread.join(15)
        server.loop.close()
        sock.close()
