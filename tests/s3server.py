"""Fault injection for tests: a proxy in front of the moto server.

Every test talks HTTP to a real moto server process (``dcpstore.local_s3``);
nothing of dcpstore is mocked.  ``FaultProxy`` sits between a client and moto when a test needs the
network to misbehave: it answers chosen requests with S3 errors (503
SlowDown, 500, 403), delays them, cuts the connection before or after the
server acted on them (a lost response), cuts a response body short, or
damages a request body on its way in (and checks it against its
``x-amz-checksum-crc32`` as AWS does: ``check_crc32``).
``ThrottleModel`` makes it answer like S3 under load: a request rate per
partition of the key space, with 503 SlowDown for the excess.

It also reports times as AWS does, where moto does not (``aws_times``): an
open upload's ``Initiated`` is when it began (moto: always 2010), and a
multipart object's LastModified is when its upload began (moto: when it
completed), in listings and in HEAD and GET answers.
"""

from __future__ import annotations

import base64
import bisect
import collections
import dataclasses
import email.utils
import hashlib
import html
import http.client
import http.server
import re
import socket
import threading
import time
import urllib.parse
import zlib

from dcpstore.local_s3 import MotoServer, free_port  # noqa: F401 - re-exported for tests


def flip_middle_byte(data: bytes) -> bytes:
    """``data`` with every bit of its middle byte flipped: damage on the wire that keeps the length."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1 :]


@dataclasses.dataclass
class Rule:
    method: str
    pattern: re.Pattern
    status: int | None = None  # answer with this S3 error status
    code: str = "SlowDown"
    delay: float = 0.0  # seconds before acting (forwarding, or any fault below)
    reset: bool = False  # close the connection without answering
    drop_response: bool = False  # forward to the server, then close without answering
    truncate: bool = False  # forward, then send only half the response body
    short: bool = False  # forward, then answer with half the body under a Content-Length that says so
    corrupt: bool = False  # forward, then flip every bit of the body's middle byte (damage in transit)
    corrupt_request: bool = False  # flip every bit of the request body's middle byte, then forward (damage on the way in)
    lands_after: float | None = None  # with status: answer at once, and forward the request this many seconds later
    hold: threading.Event | None = None  # wait for this event before acting (after any delay)
    header: str | None = None  # only requests that carry this header (x-amz-copy-source: a server-side copy)
    after: int = 0  # let this many matching requests through first (fail the Nth attempt)
    times: int | None = None  # apply this many times, then stop (None: always)
    seen: int = 0  # matching requests so far
    hits: int = 0  # requests the fault was applied to
    arrived: threading.Event = dataclasses.field(default_factory=threading.Event)  # a request the fault applies to came
    answered: threading.Event = dataclasses.field(default_factory=threading.Event)  # a faulted request's handler is done
    answered_at: float | None = None  # time.time() when it was (comparable across the test's processes)
    landed: threading.Event = dataclasses.field(default_factory=threading.Event)  # lands_after: the late request reached the server

    def matches(self, method: str, path: str, headers=None) -> bool:
        return (
            (self.times is None or self.hits < self.times)
            and self.method in (method, "*")
            and self.pattern.search(path) is not None
            and (self.header is None or (headers is not None and self.header in headers))
        )


@dataclasses.dataclass
class _Partition:
    low: str  # the first key of its range
    tokens: float
    refilled: float
    born: float = 0.0  # when it came to be (its share of the modelled capacity starts then)
    hot_since: float | None = None  # when its current run of load near its rate began
    recent: collections.deque = dataclasses.field(default_factory=collections.deque)  # request times, last HOT_WINDOW s
    keys: list = dataclasses.field(default_factory=list)  # keys asked for while hot (split point)


class ThrottleModel:
    """S3's request-rate limit for tests: a token bucket of ``rate`` per second and ``burst`` per partition.

    Partitions are ranges of ``bucket/key`` strings, as S3's are, not
    '/'-prefixes: keys under different folders share one partition until
    it splits.  With ``split_after``, a partition asked for at least
    ``HOT_LOAD`` of its rate (over ``HOT_WINDOW`` seconds, throttled or not)
    for that many seconds splits at the median key asked for meanwhile, and
    each half gets the full rate: S3 splits a partition after sustained
    load, whether or not a client has pushed it into throttling.  Requests whose method is not in ``methods``
    pass unlimited.  ``sent``, ``admitted`` and ``throttled`` count the rest.
    """

    def __init__(self, rate: float, burst: float, methods=("PUT", "POST", "DELETE"), split_after: float | None = None):
        self.rate, self.burst, self.methods, self.split_after = rate, burst, frozenset(methods), split_after
        now = time.monotonic()
        self.partitions = [_Partition("", burst, now, born=now)]
        self.sent = self.admitted = self.throttled = 0
        self.started = None  # time of the first request it saw
        self.first = self.last = None  # times of the first and last admitted request

    HOT_WINDOW = 2.0
    HOT_LOAD = 0.8

    def admit(self, method: str, path: str) -> bool:
        """Whether a request is admitted now (called under the proxy's lock)."""
        if method not in self.methods:
            return True
        key = urllib.parse.urlsplit(path).path.lstrip("/")
        now = time.monotonic()
        self.sent += 1
        self.started = self.started or now
        self._track_load(self._index(key), key, now)
        part = self.partitions[self._index(key)]  # after a split, the half that holds the key
        part.tokens = min(self.burst, part.tokens + (now - part.refilled) * self.rate)
        part.refilled = now
        if part.tokens >= 1:
            part.tokens -= 1
            self.admitted += 1
            self.first = self.first or now
            self.last = now
            return True
        self.throttled += 1
        return False

    def _index(self, key: str) -> int:
        return bisect.bisect_right([p.low for p in self.partitions], key) - 1

    def _track_load(self, i: int, key: str, now: float) -> None:
        """Count a request against partition ``i``'s load; split it once that load has lasted ``split_after``."""
        part = self.partitions[i]
        part.recent.append(now)
        while part.recent[0] < now - self.HOT_WINDOW:
            part.recent.popleft()
        if len(part.recent) < self.HOT_LOAD * self.rate * self.HOT_WINDOW:
            part.hot_since, part.keys = None, []
            return
        if part.hot_since is None:
            part.hot_since = now
        part.keys.append(key)
        if self.split_after is not None and now - part.hot_since >= self.split_after:
            self._split(i, now)

    def _split(self, i: int, now: float) -> None:
        part = self.partitions[i]
        keys = sorted(set(part.keys))
        middle = keys[len(keys) // 2] if keys else ""
        if middle <= part.low:
            return  # one key alone: nothing to split
        part.hot_since, part.keys = None, []
        part.recent.clear()
        self.partitions.insert(i + 1, _Partition(middle, self.burst, now, born=now))

    def allowed(self, start: float, end: float) -> float:
        """Requests the model admits in ``[start, end]``: every partition's rate while it existed, plus one burst."""
        return self.burst + sum(self.rate * max(0.0, end - max(start, p.born)) for p in self.partitions)

    @property
    def amplification(self) -> float:
        """Requests sent per request admitted (1.0: not one throttled)."""
        return self.sent / max(1, self.admitted)


class FaultProxy:
    """An HTTP proxy to an S3 endpoint that injects faults by rule."""

    def __init__(self, upstream: str):
        self.upstream = upstream.split("://", 1)[1]
        self.rules: list[Rule] = []
        self.requests: list[tuple[str, str]] = []
        self.headers: list[tuple[str, str, dict[str, str]]] = []  # (method, path, request headers)
        self.landed: list[tuple[str, str, int]] = []  # (method, path, status) of each request the server answered
        self.throttle: ThrottleModel | None = None  # S3's rate limit, applied to requests no rule faults
        # Enforce If-Match on CompleteMultipartUpload as AWS does (moto 5.2 ignores it there).
        self.if_match_on_completion = False
        # Refuse a body that fails its x-amz-checksum-crc32 (400 BadDigest), and a completion that does not list
        # each such part's checksum (400 InvalidPart), as AWS does (moto 5.2 checks neither).
        self.check_crc32 = False
        self._part_crc32s: dict[tuple[str, str], str] = {}  # (upload id, part number) -> the checksum its part came with
        self.aws_times = True  # report upload and multipart object times as AWS does (see the module docstring)
        # Hold each object of a DeleteObjects to its ETag element, as AWS does (moto 5.2 deletes it anyway).
        self.etags_on_batch_deletes = True
        self._initiated: dict[str, float] = {}  # upload id -> when CreateMultipartUpload was answered
        self._began: dict[str, float] = {}  # "/bucket/key" -> when the upload that wrote the object began
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self):
                self.rule = None
                try:
                    self._serve()
                finally:
                    if self.rule is not None:
                        self.rule.answered_at = time.time()
                        self.rule.answered.set()

            def _serve(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.headers.append((self.command, self.path, {k.lower(): v for k, v in self.headers.items()}))
                rule = self.rule = proxy._match(self.command, self.path, self.headers)
                if rule is not None and rule.corrupt_request and body:
                    body = flip_middle_byte(body)
                if rule is None and not proxy._admit(self.command, self.path):
                    rule = Rule(self.command, re.compile(""), status=503, code="SlowDown")
                if rule is None and proxy.if_match_on_completion and not proxy._completion_matches(self):
                    rule = Rule(self.command, re.compile(""), status=412, code="PreconditionFailed")
                if (rule is None or rule.corrupt_request) and proxy.check_crc32 and not proxy._crc32_matches(self, body):
                    rule = Rule(self.command, re.compile(""), status=400, code="BadDigest")
                if rule is None and proxy.check_crc32 and not proxy._completion_lists_crc32s(self, body):
                    rule = Rule(self.command, re.compile(""), status=400, code="InvalidPart")
                if rule is not None and rule.delay:
                    time.sleep(rule.delay)
                if rule is not None and rule.hold is not None:
                    rule.hold.wait()
                if rule is not None and rule.reset:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if rule is not None and rule.status and rule.lands_after is not None:
                    # A gateway's error answer to a request the store behind it completes later.
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                    later = threading.Timer(rule.lands_after, proxy._forward_and_track, (self.command, self.path, body, headers, rule))
                    later.daemon = True
                    later.start()
                if rule is not None and rule.status:
                    payload = (
                        f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{rule.code}</Code>"
                        f"<Message>injected by FaultProxy</Message></Error>"
                    ).encode()
                    self.send_response(rule.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD answer has no body
                        self.wfile.write(payload)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                changed: list[str] = []
                if proxy.etags_on_batch_deletes and self.command == "POST" and b"<ETag>" in body and "?delete" in self.path:
                    body, changed = proxy._without_changed_objects(self.path, body, headers)
                    if b"<Object>" not in body:  # nothing left to delete: S3's answer, without the server
                        self.send_response(200)
                        payload = proxy._with_precondition_errors(b"<DeleteResult></DeleteResult>", changed)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                resp, data = proxy._forward(self.command, self.path, body, headers)
                if changed:
                    data = proxy._with_precondition_errors(data, changed)
                data, last_modified = proxy._as_aws_reports(self.command, self.path, body, resp.status, data)
                if self.command == "PUT" and resp.status == 200 and self.headers.get("x-amz-checksum-crc32"):
                    query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                    if "uploadId" in query:
                        with proxy._lock:
                            proxy._part_crc32s[(query["uploadId"][0], query["partNumber"][0])] = self.headers["x-amz-checksum-crc32"]
                if rule is not None and rule.drop_response:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() == "last-modified" and last_modified is not None:
                        v = last_modified
                    if k.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(k, v)
                if rule is not None and rule.short:
                    data = data[: len(data) // 2]
                if rule is not None and rule.corrupt and data:
                    data = flip_middle_byte(data)
                # A HEAD answer has no body but keeps the object's length.
                length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if rule is not None and rule.truncate:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                elif self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _forward(self, method: str, path: str, body: bytes, headers: dict[str, str]):
        """Send a request on to the server: its response and body."""
        conn = http.client.HTTPConnection(self.upstream, timeout=60)
        conn.request(method, path, body=body, headers={**headers, "Content-Length": str(len(body))})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        self.landed.append((method, path, resp.status))
        return resp, data

    def _forward_and_track(self, method: str, path: str, body: bytes, headers: dict[str, str], rule: Rule) -> None:
        """A request forwarded late (``lands_after``): the times it sets are tracked as any other's; ``rule.landed`` once it did."""
        try:
            resp, data = self._forward(method, path, body, headers)
            self._as_aws_reports(method, path, body, resp.status, data)
        finally:
            rule.landed.set()

    def _as_aws_reports(self, method: str, path: str, body: bytes, status: int, data: bytes) -> tuple[bytes, str | None]:
        """Track when uploads began, and rewrite the times moto reports to AWS's: the body, and a Last-Modified header or ``None``."""
        if not self.aws_times or status >= 300:
            return data, None
        url = urllib.parse.urlsplit(path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        obj = urllib.parse.unquote(url.path)
        with self._lock:
            if method == "POST" and "uploads" in query:
                upload_id = re.search(rb"<UploadId>([^<]+)</UploadId>", data)
                if upload_id:
                    self._initiated[upload_id.group(1).decode()] = time.time()
            elif method == "POST" and "uploadId" in query:
                began = self._initiated.pop(query["uploadId"][0], None)
                if began is not None:
                    self._began[obj] = began
            elif method == "DELETE" and "uploadId" in query:
                self._initiated.pop(query["uploadId"][0], None)
            elif method in ("PUT", "DELETE") and "uploadId" not in query:
                self._began.pop(obj, None)  # replaced by a single PUT, or deleted
            elif method == "POST" and "delete" in query:
                bucket = obj.rstrip("/")
                for key in re.findall(rb"<Key>([^<]+)</Key>", body):
                    self._began.pop(f"{bucket}/{html.unescape(key.decode())}", None)
            elif method in ("GET", "HEAD") and obj in self._began:
                return data, email.utils.formatdate(self._began[obj], usegmt=True)
            elif method == "GET" and "uploads" in query:
                return self._rewrite(data, rb"<Upload>.*?</Upload>", rb"<UploadId>([^<]+)</UploadId>", rb"Initiated",
                                     lambda upload_id: self._initiated.get(upload_id)), None
            elif method == "GET" and "list-type" in query:
                bucket = obj.rstrip("/")
                return self._rewrite(data, rb"<Contents>.*?</Contents>", rb"<Key>([^<]+)</Key>", rb"LastModified",
                                     lambda key: self._began.get(f"{bucket}/{urllib.parse.unquote(html.unescape(key))}")), None
        return data, None

    @staticmethod
    def _rewrite(data: bytes, entry: bytes, name: bytes, field: bytes, time_of) -> bytes:
        """``data`` with the ``field`` of each XML ``entry`` set to ``time_of(its name)``, where that is not ``None``."""

        def one(match: re.Match) -> bytes:
            found = re.search(name, match.group(0))
            when = time_of(found.group(1).decode()) if found else None
            if when is None:
                return match.group(0)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(when)) + f".{int(when % 1 * 1000):03d}Z"
            return re.sub(rb"<%s>[^<]*</%s>" % (field, field), b"<%s>%s</%s>" % (field, stamp.encode(), field), match.group(0))

        return re.sub(entry, one, data, flags=re.S)

    def add(self, method: str, pattern: str, **kwargs) -> Rule:
        rule = Rule(method=method, pattern=re.compile(pattern), **kwargs)
        with self._lock:
            self.rules.append(rule)
        return rule

    def _admit(self, method: str, path: str) -> bool:
        with self._lock:
            return self.throttle is None or self.throttle.admit(method, path)

    def _completion_matches(self, handler) -> bool:
        """False for a CompleteMultipartUpload whose ``If-Match`` names another ETag than the object's (one HEAD upstream)."""
        wanted = handler.headers.get("If-Match")
        if handler.command != "POST" or "uploadId=" not in handler.path or not wanted:
            return True
        import boto3
        import botocore.exceptions

        bucket, _, key = urllib.parse.unquote(handler.path.split("?", 1)[0]).lstrip("/").partition("/")
        try:
            etag = boto3.client("s3", endpoint_url=f"http://{self.upstream}").head_object(Bucket=bucket, Key=key)["ETag"]
        except botocore.exceptions.ClientError:
            return False
        return etag.strip('"') == wanted.strip('"')

    def _without_changed_objects(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[bytes, list[str]]:
        """A DeleteObjects body without the objects whose ``ETag`` element no longer matches (one HEAD upstream each), and their keys.

        The body's checksum headers are made to match what is left.
        """
        import boto3
        import botocore.exceptions

        client = boto3.client("s3", endpoint_url=f"http://{self.upstream}")
        bucket = urllib.parse.unquote(urllib.parse.urlsplit(path).path).strip("/")
        changed = []

        def one(match: re.Match) -> bytes:
            key = html.unescape(re.search(rb"<Key>([^<]*)</Key>", match.group(0)).group(1).decode())
            wanted = re.search(rb"<ETag>([^<]*)</ETag>", match.group(0))
            if wanted is None:
                return match.group(0)
            try:
                etag = client.head_object(Bucket=bucket, Key=key)["ETag"]
            except botocore.exceptions.ClientError:
                return match.group(0)  # gone: deleting it again is a success
            if etag.strip('"') == html.unescape(wanted.group(1).decode()).strip('"'):
                return match.group(0)
            changed.append(key)
            return b""

        body = re.sub(rb"<Object>.*?</Object>", one, body, flags=re.S)
        for name in list(headers):
            if name.lower() == "x-amz-checksum-crc32":
                headers[name] = base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()
            elif name.lower() == "content-md5":
                headers[name] = base64.b64encode(hashlib.md5(body).digest()).decode()
        return body, changed

    @staticmethod
    def _with_precondition_errors(data: bytes, keys: list[str]) -> bytes:
        """A DeleteResult with S3's ``PreconditionFailed`` error for each of ``keys`` added."""
        errors = b"".join(
            b"<Error><Key>%s</Key><Code>PreconditionFailed</Code><Message>At least one of the pre-conditions you "
            b"specified did not hold</Message></Error>" % html.escape(key).encode()
            for key in keys
        )
        return data.replace(b"</DeleteResult>", errors + b"</DeleteResult>")

    @staticmethod
    def _crc32_matches(handler, body: bytes) -> bool:
        """False for a request whose ``x-amz-checksum-crc32`` is not the CRC32 of the body that arrived."""
        wanted = handler.headers.get("x-amz-checksum-crc32")
        return wanted is None or base64.b64decode(wanted) == zlib.crc32(body).to_bytes(4, "big")

    def _completion_lists_crc32s(self, handler, body: bytes) -> bool:
        """False for a CompleteMultipartUpload that leaves out, or misstates, the checksum a part came with."""
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(handler.path).query)
        if handler.command != "POST" or "uploadId" not in query:
            return True
        upload = query["uploadId"][0]
        for part in re.findall(rb"<Part>(.*?)</Part>", body, re.DOTALL):
            number = re.search(rb"<PartNumber>(\d+)</PartNumber>", part).group(1).decode()
            listed = re.search(rb"<ChecksumCRC32>([^<]*)</ChecksumCRC32>", part)
            with self._lock:
                sent = self._part_crc32s.get((upload, number))
            if sent is not None and (listed is None or listed.group(1).decode() != sent):
                return False
        return True

    def clear(self) -> None:
        with self._lock:
            self.throttle = None
            self.if_match_on_completion = False
            self.check_crc32 = False
            self._part_crc32s.clear()
            self.aws_times = True
            self.etags_on_batch_deletes = True
            self.rules.clear()
            self.requests.clear()
            self.headers.clear()
            self.landed.clear()

    def _match(self, method: str, path: str, headers=None) -> Rule | None:
        with self._lock:
            self.requests.append((method, path))
            for rule in self.rules:
                if rule.matches(method, path, headers):
                    rule.seen += 1
                    if rule.seen <= rule.after:
                        continue
                    rule.hits += 1
                    rule.arrived.set()
                    return rule
        return None

    def stop(self) -> None:
        self._server.shutdown()
