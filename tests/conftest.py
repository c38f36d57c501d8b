import os
import pickle
import uuid

import boto3
import pytest

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


@pytest.fixture
def s3(moto_endpoint):
    return boto3.client("s3", endpoint_url=moto_endpoint)


@pytest.fixture
def bucket(s3):
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def fault_proxy(moto_endpoint):
    proxy = FaultProxy(moto_endpoint)
    yield proxy
    proxy.stop()


@pytest.fixture
def proxy(fault_proxy):
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
