"""A local HTTP endpoint for the calling rewards' tests (remote reward server, OpenAI-style
judge): bound to 127.0.0.1 only, on a free port, in a daemon thread; `answer(path, body)`
returns (status, JSON-able answer) and may sleep. Records every request body and the most
requests in flight at once."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[str, dict[str, Any]], tuple[int, Any]]


class Stub:
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.bodies: list[dict[str, Any]] = []
        self.live = self.most = 0
        self.lock = threading.Lock()
        self.url = ""


@contextmanager
def serve(answer: Answer) -> Iterator[Stub]:
    stub = Stub(answer)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with stub.lock:
                stub.bodies.append(body)
                stub.live += 1
                stub.most = max(stub.most, stub.live)
            try:
                status, out = stub.answer(self.path, body)
            finally:
                with stub.lock:
                    stub.live -= 1
            data = (out if isinstance(out, str) else json.dumps(out)).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    stub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield stub
    finally:
        server.shutdown()
        server.server_close()
