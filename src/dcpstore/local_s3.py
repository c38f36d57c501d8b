"""An embedded S3 server for demos, benchmarks and tests: moto on loopback.

Runs ``python -m moto.server`` (the ``moto[server]`` extra) as a child
process on a free port of 127.0.0.1, so clients exercise real HTTP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request

TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """``python -m moto.server`` as a subprocess on a free loopback port."""

    def __init__(self, env: dict[str, str] | None = None, startup_timeout: float = 30):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).read()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto server did not start (is the moto[server] extra installed?)")
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()

    def __enter__(self) -> "MotoServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
