import os
import pickle
import time
import uuid

import boto3
import pytest

from rgw import RgwUnavailable, rgw_server
from s3server import FaultProxy, MotoServer

AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto server for the session; its endpoint reaches dcpstore through AWS_ENDPOINT_URL."""
    for k, v in AWS_ENV.items():
        os.environ[k] = v
    os.environ.pop("AWS_PROFILE", None)
    server = MotoServer()
    os.environ["AWS_ENDPOINT_URL"] = server.endpoint
    yield server.endpoint
    server.stop()


# -- which S3 server a test talks to ------------------------------------------------------
#
# Tests reach the server through the ``endpoint`` fixture (``s3``, ``bucket``
# and ``proxy`` build on it).  By default that is the session's moto server.
# A test marked ``@pytest.mark.also_rgw`` runs twice, as ``test[moto]`` and as
# ``test[rgw]`` against a Ceph RADOS Gateway (scripts/ceph_rgw.sh); the rgw
# variant carries the ``rgw`` marker, which the default run deselects
# (pyproject: ``-m 'not rgw'``) and ``pytest -m rgw`` selects.
# ``also_rgw(world_size=2)`` limits the rgw variants to those parameters.
# Both markers are registered in pyproject.toml.


def pytest_generate_tests(metafunc):
    if "s3_server" in metafunc.fixturenames and metafunc.definition.get_closest_marker("also_rgw"):
        metafunc.parametrize(
            "s3_server", ["moto", pytest.param("rgw", marks=pytest.mark.rgw)], indirect=True, scope="function"
        )


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("also_rgw")
        params = getattr(getattr(item, "callspec", None), "params", {})
        if not marker or params.get("s3_server") != "rgw":
            keep.append(item)
            continue
        if any(params.get(k) != v for k, v in marker.kwargs.items()):
            drop.append(item)
            continue
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def s3_server(request) -> str:
    """"moto" or "rgw": the server this test runs against."""
    return getattr(request, "param", "moto")


@pytest.fixture(scope="session")
def rgw_gateway():
    """The Ceph RGW tier's server: a running one, or one started for the session.

    Skips the rgw tests with the reason when there is neither, or fails them
    when ``DCPSTORE_RGW_REQUIRED=1`` (CI, where a skipped tier must not pass).
    """
    try:
        server = rgw_server()
    except RgwUnavailable as e:
        if os.environ.get("DCPSTORE_RGW_REQUIRED") == "1":
            pytest.fail(f"rgw tier: no Ceph RADOS Gateway (DCPSTORE_RGW_REQUIRED=1): {e}")
        pytest.skip(f"rgw tier: no Ceph RADOS Gateway: {e}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def rgw_fault_proxy(rgw_gateway):
    proxy = FaultProxy(rgw_gateway.endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def endpoint(s3_server, request, monkeypatch):
    """This test's S3 endpoint; the AWS environment (what dcpstore and workers see) points at it."""
    if s3_server == "moto":
        return request.getfixturevalue("moto_endpoint")
    server = request.getfixturevalue("rgw_gateway")
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    _forget_cached_s3_clients()  # fsspec's cached S3FileSystem would still talk to moto
    request.addfinalizer(_forget_cached_s3_clients)
    return server.endpoint


def _forget_cached_s3_clients():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(endpoint):
    return boto3.client("s3", endpoint_url=endpoint)


# S3's documented write rate for one prefix: where a job that was told it starts (see throttle).
S3_PREFIX_WRITE_RATE = 3500.0


# client_environment() -> server_of({}) under it (see bucket).
_ENVIRONMENT_SERVERS: dict[str, str] = {}


@pytest.fixture
def bucket(s3, endpoint, request):
    """A fresh bucket for the test.

    The writes of this process start at S3's rate for it, as a job's do
    (``TransferConfig.prefix_write_rate``, ``RateBook.share``), not in the
    slow start of a writer that was told nothing: the test servers have no
    request-rate limit, and that ramp, paid afresh in every test's new
    bucket, was most of the time of the single-process tests.  A test of
    pacing itself (``@pytest.mark.slow_start``, and every test with its own
    ``ThrottleModel`` in ``test_throttling.py``) keeps the slow start.  Ranks
    in processes of their own start as they would anyway.
    """
    from dcpstore.storage.s3_requests import client_environment, server_of
    from dcpstore.storage.throttle import RATES

    name = f"test-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    if request.node.get_closest_marker("slow_start") is None:
        # The AWS environment's endpoint, which the endpoint fixture set.  server_of
        # makes a botocore session (0.3 s of service-model parsing), once per environment here.
        environment = client_environment()
        if environment not in _ENVIRONMENT_SERVERS:
            _ENVIRONMENT_SERVERS[environment] = server_of({})
        servers = [_ENVIRONMENT_SERVERS[environment]]
        if "proxy" in request.fixturenames:
            servers.append(server_of({"endpoint_url": request.getfixturevalue("proxy").endpoint}))
        for server in servers:
            RATES.share((server, name), "write", S3_PREFIX_WRITE_RATE)
    return name


@pytest.fixture(scope="session")
def fault_proxy(moto_endpoint):
    proxy = FaultProxy(moto_endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def proxy(s3_server, endpoint, request):
    """A FaultProxy in front of this test's server, cleared before and after the test."""
    fault_proxy = request.getfixturevalue("fault_proxy" if s3_server == "moto" else "rgw_fault_proxy")
    fault_proxy.clear()
    yield fault_proxy
    fault_proxy.clear()


def read_metadata_raw(s3, bucket: str, prefix: str):
    """The checkpoint's Metadata, read with plain boto3 + pickle (no dcpstore)."""
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/.metadata")["Body"].read()
    return pickle.loads(body)


def object_exists(s3, bucket: str, key: str) -> bool:
    resp = s3.list_objects_v2(Bucket=bucket, Prefix=key)
    return any(o["Key"] == key for o in resp.get("Contents", []))


def wait_until_older_than(store, seconds: float) -> None:
    """Wait until everything under ``store``, objects and open uploads, is older than ``seconds`` on its server's clock.

    For tests of what a grace period lets go: objects cannot be backdated,
    so the test waits for them to age (polling the server's clock).
    """
    times = [o.last_modified for o in store.list()]
    times += [store.upload_last_active(u) for u in store.list_multipart_uploads()]
    newest = max((t for t in times if t is not None), default=0.0)
    while store.server_time() - newest <= seconds:
        time.sleep(0.2)
