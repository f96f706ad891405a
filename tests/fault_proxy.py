"""An HTTP proxy on 127.0.0.1 that injects object-store faults in front of the GCS emulator.

Forwards every request to the emulator (tests/gcs_emulator.py) unless a rule
matches it (method and a substring of the request target, e.g. ".npz"):

- "stall": reads the request and answers nothing until the proxy stops (at
  most STALL_SECONDS), as a hung connection does;
- "status": answers with an HTTP error status and a GCS-style JSON body;
- "reset": closes the connection without an answer;
- "truncate": forwards, then sends half of the answer's body and closes;
- "flip": forwards, with one bit of the answer's body flipped (a corruption
  in transit the HTTP layer does not see: the length is right).

A rule may also ask for a substring of the request body (`body`: a simple
upload names its object only there). A rule applies `times` times (None:
always). Every wait is bounded, and `stop()` (or `release()`) releases
stalled handlers, so no test can hang on the proxy.

`delay_seconds` adds a fixed latency to every request (a bucket's round
trip, for benchmarks/bucket.py); `count` is the number of requests served,
`served_bytes` the bytes of the responses it forwarded.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import socket
import struct
import threading
import time
import urllib.parse

STALL_SECONDS = 120
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te"}


@dataclasses.dataclass
class Rule:
  action: str  # "stall", "status", "reset", "truncate" or "flip"
  contains: str
  method: str | None = None
  status: int = 503
  times: int | None = None
  body: bytes | None = None


class FaultProxy:
  """`FaultProxy(upstream_url).start()`; `add(...)` rules; `stop()`."""

  def __init__(self, upstream: str, *, delay_seconds: float = 0.0):
    parsed = urllib.parse.urlsplit(upstream)
    self.delay_seconds = delay_seconds
    self.count = 0
    self.served_bytes = 0  # response bodies forwarded (what the clients downloaded through it)
    self._upstream = (parsed.hostname, parsed.port)
    self._rules: list[Rule] = []
    self._lock = threading.Lock()
    self._released = threading.Event()
    self.hits: list[tuple[str, str, str]] = []  # (action, method, target) of each injected fault
    proxy = self

    class Handler(http.server.BaseHTTPRequestHandler):
      protocol_version = "HTTP/1.1"

      def log_message(self, *args):  # quiet
        del args

      def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        with proxy._lock:  # pylint: disable=protected-access
          proxy.count += 1
        if proxy.delay_seconds:
          time.sleep(proxy.delay_seconds)
        rule = proxy._match(self.command, self.path, body)  # pylint: disable=protected-access
        if rule is None:
          return self._forward(body)
        proxy.hits.append((rule.action, self.command, self.path))
        if rule.action == "stall":
          proxy._released.wait(STALL_SECONDS)  # pylint: disable=protected-access
          self.close_connection = True
          return None
        if rule.action == "reset":
          # SO_LINGER 0: the close sends a TCP reset.
          self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
          self.close_connection = True
          return None
        if rule.action == "status":
          data = json.dumps({"error": {"code": rule.status, "message": "injected by the test proxy"}}).encode()
          self.send_response(rule.status)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(data)))
          self.send_header("Connection", "close")
          self.end_headers()
          self.wfile.write(data)
          self.close_connection = True
          return None
        return self._forward(body, truncate=rule.action == "truncate", flip=rule.action == "flip")

      def _forward(self, body: bytes, truncate: bool = False, flip: bool = False):
        upstream = http.client.HTTPConnection(*proxy._upstream, timeout=60)  # pylint: disable=protected-access
        try:
          headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
          upstream.request(self.command, self.path, body=body, headers=headers)
          response = upstream.getresponse()
          data = response.read()
          if flip and data:
            middle = len(data) // 2
            data = data[:middle] + bytes([data[middle] ^ 0x04]) + data[middle + 1:]
          self.send_response(response.status)
          for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP | {"content-length"}:
              self.send_header(key, value)
          self.send_header("Content-Length", str(len(data)))
          self.send_header("Connection", "close")
          self.end_headers()
          if self.command != "HEAD":
            self.wfile.write(data[: len(data) // 2] if truncate else data)
            with proxy._lock:  # pylint: disable=protected-access
              proxy.served_bytes += len(data)
          self.close_connection = True
        finally:
          upstream.close()

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

    self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self._server.daemon_threads = True
    self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
    self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

  def start(self) -> "FaultProxy":
    self._thread.start()
    return self

  def add(self, action: str, contains: str, *, method: str | None = None, status: int = 503,
          times: int | None = None, body: bytes | None = None) -> None:
    with self._lock:
      self._rules.append(Rule(action, contains, method, status, times, body))

  def clear(self) -> None:
    with self._lock:
      self._rules.clear()

  def release(self) -> None:
    """Ends every stall now (each closes its connection unanswered); later stalls do not wait."""
    self._released.set()

  def _match(self, method: str, target: str, body: bytes = b"") -> Rule | None:
    with self._lock:
      for rule in self._rules:
        if (rule.contains in target and rule.method in (None, method)
            and (rule.body is None or rule.body in body)):
          if rule.times is not None:
            if rule.times <= 0:
              continue
            rule.times -= 1
          return rule
    return None

  def stop(self) -> None:
    self._released.set()
    self._server.shutdown()
    self._server.server_close()
