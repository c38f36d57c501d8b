"""The rgw test tier's server: a Ceph RADOS Gateway from scripts/ceph_rgw.sh.

``rgw_server()`` uses, in this order: the server named by
``DCPSTORE_RGW_ENDPOINT`` (keys from ``DCPSTORE_RGW_ACCESS_KEY`` /
``DCPSTORE_RGW_SECRET_KEY``, default the script's), the one the script
reports as running (``ceph_rgw.sh env``), or one it starts now
(``ceph_rgw.sh start``, which installs the Debian packages when missing and
needs root or sudo for that); a server started here is stopped by ``stop()``.
Anything that goes wrong raises ``RgwUnavailable`` with the reason, which the
session fixture turns into a skip.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import subprocess
import time

import boto3
from botocore.config import Config

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "ceph_rgw.sh"
# The script's defaults (DCPSTORE_RGW_ACCESS_KEY / DCPSTORE_RGW_SECRET_KEY override both).
DEFAULT_ACCESS_KEY = "dcpstoreaccesskey"
DEFAULT_SECRET_KEY = "dcpstoresecretkey0123456789"
START_TIMEOUT = float(os.environ.get("DCPSTORE_RGW_START_TIMEOUT", 1200))  # apt install included


class RgwUnavailable(RuntimeError):
    pass


class RgwServer:
    def __init__(self, env: dict[str, str], started: bool):
        self.env = env
        self.endpoint = env["AWS_ENDPOINT_URL"]
        self.access_key = env["AWS_ACCESS_KEY_ID"]
        self.secret_key = env["AWS_SECRET_ACCESS_KEY"]
        self.started = started

    def stop(self) -> None:
        if self.started:
            subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, timeout=120)


def _parse_exports(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            k, v = words[1].split("=", 1)
            env[k] = v
    return env


def _script(command: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["bash", str(SCRIPT), command], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RgwUnavailable(f"`ceph_rgw.sh {command}` did not finish in {timeout:.0f}s") from e


def _wait_until_it_answers(server: RgwServer, timeout: float = 60) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.env["AWS_DEFAULT_REGION"],
        config=Config(connect_timeout=2, read_timeout=10, retries={"total_max_attempts": 1}),
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.list_buckets()
            return
        except Exception as e:  # noqa: BLE001 - reported if it persists
            if time.monotonic() > deadline:
                raise RgwUnavailable(f"{server.endpoint} does not answer ListBuckets: {e}") from e
            time.sleep(0.5)


def rgw_server() -> RgwServer:
    endpoint = os.environ.get("DCPSTORE_RGW_ENDPOINT")
    if endpoint:
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": os.environ.get("DCPSTORE_RGW_ACCESS_KEY", DEFAULT_ACCESS_KEY),
            "AWS_SECRET_ACCESS_KEY": os.environ.get("DCPSTORE_RGW_SECRET_KEY", DEFAULT_SECRET_KEY),
            "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
        }
        server = RgwServer(env, started=False)
    else:
        out = _script("env", 30)
        started = out.returncode != 0
        if started:
            out = _script("start", START_TIMEOUT)
            if out.returncode != 0:
                tail = " | ".join(out.stderr.strip().splitlines()[-5:])
                raise RgwUnavailable(f"`bash scripts/ceph_rgw.sh start` failed (exit {out.returncode}): {tail}")
        env = _parse_exports(out.stdout)
        if "AWS_ENDPOINT_URL" not in env:
            raise RgwUnavailable(f"`ceph_rgw.sh` printed no environment: {out.stdout!r}")
        server = RgwServer(env, started=started)
    try:
        _wait_until_it_answers(server)
    except RgwUnavailable:
        server.stop()
        raise
    return server
