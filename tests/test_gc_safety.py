"""gc deletes only what is dead: a step where nothing changed within the grace, on the server's clock.

Times go through the fault proxy, which reports them as AWS does (an open
upload's ``Initiated`` and a multipart object's LastModified are when the
upload began); moto alone reports neither that way.
"""

import time

import boto3
import pytest

from conftest import wait_until_older_than
from dcpstore.cli import main
from dcpstore.steps import plan_gc
from dcpstore.storage import open_store

GRACE = 2.0
PART = 5 << 20


@pytest.fixture
def store(bucket, proxy):
    store = open_store(f"s3://{bucket}/run", storage_options={"endpoint_url": proxy.endpoint})
    yield store
    store.close()


@pytest.fixture
def client(proxy):
    return boto3.client("s3", endpoint_url=proxy.endpoint)


def test_gc_leaves_every_upload_and_object_of_a_live_step_alone(bucket, store, client, proxy):
    """An upload that began long ago but sent a part just now is live; so is an old upload beside a shard that just landed."""
    slow = client.create_multipart_upload(Bucket=bucket, Key="run/step_00000002/__0_a_0.distcp")
    client.upload_part(Bucket=bucket, Key="run/step_00000002/__0_a_0.distcp", UploadId=slow["UploadId"], PartNumber=1, Body=b"x" * PART)
    stalled = client.create_multipart_upload(Bucket=bucket, Key="run/step_00000003/__0_b_0.distcp")
    client.upload_part(Bucket=bucket, Key="run/step_00000003/__0_b_0.distcp", UploadId=stalled["UploadId"], PartNumber=1, Body=b"x" * PART)
    wait_until_older_than(store, GRACE)
    client.upload_part(Bucket=bucket, Key="run/step_00000002/__0_a_0.distcp", UploadId=slow["UploadId"], PartNumber=2, Body=b"x")
    client.put_object(Bucket=bucket, Key="run/step_00000003/__1_b_0.distcp", Body=b"another shard of step 3, just landed")

    list_parts = lambda: sum(1 for method, path in proxy.requests if method == "GET" and "uploadId=" in path)  # noqa: E731
    asked = list_parts()
    plan = plan_gc(store, None, grace=GRACE)
    assert plan.uploads == [] and plan.incomplete == []  # both steps are live: nothing is aborted or deleted
    assert list_parts() - asked == 1  # ListParts only for the old upload of a step not known live

    wait_until_older_than(store, GRACE)  # now nothing under either step changed within the grace
    plan = plan_gc(store, None, grace=GRACE)
    assert sorted(u.upload_id for u in plan.uploads) == sorted([slow["UploadId"], stalled["UploadId"]])
    assert [s.step for s in plan.incomplete] == [3]
    plan.run(store)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


def test_a_gc_host_whose_clock_runs_ahead_still_sees_a_running_save_as_live(bucket, store, client, monkeypatch):
    """Ages are measured on the server's clock (the Date of its answers), not on the host's."""
    client.put_object(Bucket=bucket, Key="run/step_00000002/__0_0.distcp", Body=b"a shard of a save running now")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)  # this host's clock runs two hours ahead
    plan = plan_gc(store, None, grace=3600)
    assert plan.incomplete == []


def test_a_grace_must_be_positive(root_on_memory="memory://gc-grace"):
    import dcpstore

    for bad in ("0", "-5", "nan"):
        with pytest.raises(SystemExit):
            main(["gc", root_on_memory, "--grace", bad])
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="grace period must be positive"):
            dcpstore.AsyncCheckpointer(root_on_memory, gc_grace=bad)
        with pytest.raises(ValueError, match="grace period must be positive"):
            plan_gc(open_store(root_on_memory), None, grace=bad)
