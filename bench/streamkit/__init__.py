"""Instruments for a prepared dataset in a bucket, shared by ``bench/streaming.py`` (the 1 GiB vs 50 MiB
memory and start-up figures) and ``tests/test_data_streaming.py`` (what is fetched, and how often):

- :class:`CountingProxy`: an HTTP proxy on 127.0.0.1, in a process of its own, in front of an S3-compatible
  server; it records every request's method, key and response bytes, so what really went over the wire is counted;
- :func:`write_dataset`: a prepared folder of random tokens written with the real shard writer (no tokenising);
- :func:`rss_anon_mb` and :class:`WorkerRss`: a process's anonymous resident memory, and a poller of every Ray
  Train worker's (its peak, and its value at the run's first step);
- :func:`start_moto`: an S3-compatible server (moto) on loopback, for the benchmark run without a bucket of its own
  (the tests have conftest's ``s3_server``).

A package (not a ``bench/*.py`` script): the test imports it with ``bench/`` on ``sys.path``. Importing it loads
the standard library only; :func:`write_dataset` imports numpy and attnlab when called.
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float, failure: str) -> None:
    """Return once something listens on 127.0.0.1:``port``; RuntimeError(``failure``) if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.time() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(failure) from None
            time.sleep(0.1)


def start_moto(log_path: str) -> tuple[subprocess.Popen, str]:
    """A moto S3 server on 127.0.0.1 (a free port), its output in ``log_path``; returns (process, endpoint URL)."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    log.close()  # the child has its own copy
    wait_for_port(port, proc, 60, f"moto server did not start (see {log_path})")
    return proc, f"http://127.0.0.1:{port}"


# ---------------------------------------------------------------------------------------------- counting proxy
class _Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]
    log: object  # a text file, one line per request
    lock: threading.Lock

    def log_message(self, *args):  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self):
        body = self._body()
        conn = getattr(self.server.local, "conn", None)
        if conn is None:
            conn = self.server.local.conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "content-length")}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
        except (http.client.HTTPException, OSError):
            conn.close()
            conn = self.server.local.conn = http.client.HTTPConnection(*self.upstream, timeout=120)
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
        data = resp.read()
        with self.lock:
            path = unquote(urlsplit(self.path).path).lstrip("/").replace(" ", "%20")
            self.log.write(f"{self.command} {path or '/'} {resp.status} {len(data)}\n")
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)) if self.command != "HEAD" else
                         resp.getheader("Content-Length", "0"))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


def serve(upstream: str, port: int, log_path: str) -> None:
    """Run the proxy (in a process of its own, so its buffers never count in the caller's memory)."""
    up = urlsplit(upstream)

    class Handler(_Proxy):
        pass

    Handler.upstream, Handler.log, Handler.lock = (up.hostname, up.port), open(log_path, "a", buffering=1), \
        threading.Lock()
    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that exited mid-transfer is no error
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    server.local = threading.local()
    server.serve_forever()


class CountingProxy:
    """The proxy process in front of the plain-HTTP S3 endpoint ``endpoint``, and its request log (``METHOD path
    status bytes`` per line). Point ``AWS_ENDPOINT_URL`` at :attr:`url` to go through it."""

    def __init__(self, endpoint: str, log_path: str):
        if urlsplit(endpoint).scheme != "http":
            raise ValueError(f"the counting proxy fronts a plain-HTTP endpoint, not {endpoint!r}")
        self.log_path = log_path
        open(log_path, "w").close()
        port = free_port()
        code = (f"import sys; sys.path.insert(0, {BENCH_DIR!r}); "
                f"from streamkit import serve; serve({endpoint!r}, {port}, {log_path!r})")
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        self.url = f"http://127.0.0.1:{port}"
        wait_for_port(port, self.proc, 30, "the counting proxy did not start")

    def _lines(self) -> list[list[str]]:
        with open(self.log_path) as f:
            return [line.split(" ") for line in f.read().splitlines()]

    def mark(self) -> int:
        return len(self._lines())

    def get_bytes(self, since: int = 0, suffix: str = "") -> dict[str, int]:
        """Response bytes of GET requests per object path (``bucket/key``) since ``mark``."""
        out: dict[str, int] = {}
        for method, path, _status, size in self._lines()[since:]:
            if method == "GET" and path.endswith(suffix):
                out[path] = out.get(path, 0) + int(size)
        return out

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------- datasets
def write_dataset(uri: str, train_tokens: int, *, shard_tokens: int, val_tokens: int, seed: int = 0) -> dict:
    """A prepared folder of random uint16 tokens (a document every ~1000 tokens) at ``uri``, written with the real
    shard writer: ``train_tokens`` in shards of ``shard_tokens``, and a val split of ``val_tokens``. Returns the
    manifest."""
    import numpy as np

    from attnlab.data.pipeline.prepare import _entry
    from attnlab.data.shards import FORMAT, FORMAT_VERSION, MANIFEST, encode_shard, manifest_bytes, sha256_hex, \
        shard_name
    from attnlab.data.tokenizer import EOT_ID, GPT2_VOCAB, TOKENIZER_NAME
    from attnlab.location import Location

    loc = Location.parse(uri)
    rng = np.random.default_rng(seed)
    entries = []
    for split, total in (("train", train_tokens), ("val", val_tokens)):
        for k, lo in enumerate(range(0, total, shard_tokens)):
            n = min(shard_tokens, total - lo)
            tokens = rng.integers(0, EOT_ID, n, dtype=np.uint16)
            starts = np.cumsum(rng.integers(1, 2000, n // 1000 + 1))
            starts = starts[starts < n]
            continues = k > 0 and (len(starts) == 0 or starts[0] != 0)
            if not continues:
                starts = np.union1d([0], starts)
            tokens[starts] = EOT_ID
            data = encode_shard(tokens, starts, continues)
            del tokens
            name = shard_name(split, k)
            loc.write_bytes(name, data)
            entries.append(_entry(name, sha256_hex(data), n, len(starts), continues))
            del data
    splits = {s: {"num_tokens": sum(e["num_tokens"] for e in entries if e["split"] == s),
                  "num_docs": sum(e["num_docs"] for e in entries if e["split"] == s),
                  "num_shards": sum(1 for e in entries if e["split"] == s)} for s in ("train", "val")}
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": TOKENIZER_NAME, "vocab_size": GPT2_VOCAB,
                "eot_id": EOT_ID, "source": f"random tokens, seed {seed}", "seed": seed, "shard_tokens": shard_tokens,
                "val_tokens_requested": val_tokens, "dtype": "uint16", "splits": splits, "shards": entries}
    loc.write_bytes(MANIFEST, manifest_bytes(manifest))
    return manifest


def shard_sizes(uri: str, manifest: dict) -> dict[str, int]:
    """Each shard's size in bytes, keyed as the proxy logs it (``bucket/prefix/name``)."""
    from attnlab.location import Location

    loc = Location.parse(uri)
    prefix = uri.split("://", 1)[1].rstrip("/")
    return {f"{prefix}/{e['name']}": loc.fs.get_file_info(f"{prefix}/{e['name']}").size for e in manifest["shards"]}


# ---------------------------------------------------------------------------------------------- memory
def rss_anon_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


class WorkerRss:
    """Polls /proc for Ray Train worker processes and keeps each one's peak RssAnon (MB), and its RssAnon when the
    run's ``metrics.jsonl`` first holds a step (``at_first_step``); and the time (from start) of that first step.
    ``environ_has``: only workers whose environment holds this ``NAME=value`` (e.g. the run's own cache folder, which
    ``run_training`` forwards to its workers), so that another Ray on the machine is not measured."""

    def __init__(self, metrics_file: str, environ_has: str | None = None):
        self.metrics_file = metrics_file
        self.environ_has = None if environ_has is None else b"\0" + environ_has.encode() + b"\0"
        self._skipped: set[int] = set()
        self.t0 = time.perf_counter()
        self.first_step: float | None = None
        self.peak: dict[int, float] = {}
        self.at_first_step: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self.first_step is None and os.path.exists(self.metrics_file) and os.path.getsize(self.metrics_file):
                self.first_step = time.perf_counter() - self.t0
            for pid in os.listdir("/proc"):
                if not pid.isdigit() or int(pid) in self._skipped:
                    continue
                try:
                    if not self._is_worker(pid):
                        continue
                    if int(pid) not in self.peak and self._is_worker(self._parent(pid)):
                        # a worker's fork between fork and exec (a subprocess it runs) carries its name and its
                        # (shared) pages: not a worker of its own
                        self._skipped.add(int(pid))
                        continue
                    if self.environ_has is not None and int(pid) not in self.peak:
                        with open(f"/proc/{pid}/environ", "rb") as f:
                            if self.environ_has not in b"\0" + f.read() + b"\0":
                                self._skipped.add(int(pid))
                                continue
                    mb = rss_anon_mb(pid)
                except OSError:
                    continue
                self.peak[int(pid)] = max(self.peak.get(int(pid), 0.0), mb)
                if self.first_step is not None:
                    self.at_first_step.setdefault(int(pid), mb)
            self._stop.wait(0.05)

    @staticmethod
    def _is_worker(pid: str) -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"TrainWorker" in f.read()

    @staticmethod
    def _parent(pid: str) -> str:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[1].decode()  # the field after the state

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        return self.peak

    def growth_after_first_step(self) -> dict[int, float]:
        """Each worker's peak RssAnon minus its RssAnon at the run's first step (MB): what the training steps,
        the data they read and the shards fetched meanwhile added."""
        return {pid: self.peak[pid] - base for pid, base in self.at_first_step.items()}
