"""Incremental saves: what did not change since the last commit is copied by the bucket, not sent again (issue 44).

Bytes sent are counted at an HTTP proxy in front of the server (the bodies
of PUTs: single objects and parts); the bucket's copies (``UploadPartCopy``,
a PUT with ``x-amz-copy-source`` and no body) are counted apart.  Every step
is loaded back with torch's own ``FsspecReader``: each one is whole.
"""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

import dcpstore
from conftest import read_metadata_raw
from dcpstore.cli import main
from dcpstore.storage import TransferConfig
from dcpstore.storage.config import MiB
from dist_utils import run_ranks
from workers import (
    checkpointer_incremental_killed,
    checkpointer_incremental_resume,
    checkpointer_incremental_saves,
    dcp_save_incremental,
)

TENSORS, TENSOR_MIB = 16, 2  # 32 MiB: 16 tensors, 4 to a shard object
TRANSFER = TransferConfig(part_size=5 * MiB)  # S3's smallest part, so these small objects go up in parts


def state(step: int, changed: int) -> dict:
    """``TENSORS`` tensors; the first ``changed`` of them are trained (their values depend on ``step``), the rest frozen."""
    out = {}
    for i in range(TENSORS):
        g = torch.Generator().manual_seed(i + 1000 * step * (i < changed))
        out[f"layer{i:02d}.weight"] = torch.randn(TENSOR_MIB * MiB // 4, generator=g)
    out["step"] = step
    return out


def sent_and_copied(proxy) -> tuple[int, int]:
    """Bytes of PUT bodies that went through ``proxy``, and the copy requests it saw."""
    sent = copies = 0
    for method, _path, headers in proxy.headers:
        if method == "PUT" and "x-amz-copy-source" in headers:
            copies += 1
        elif method == "PUT":
            sent += int(headers.get("content-length", 0))
    return sent, copies


def load_with_torch(url: str, like: dict, reader=FsspecReader) -> dict:
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()}
    dcp.load(out, storage_reader=reader(url), no_dist=True)
    return out


def load_with_dcpstore(url: str, like: dict) -> dict:
    return load_with_torch(url, like, reader=dcpstore.ObjectStoreReader)


def assert_bit_exact(got: dict, want: dict) -> None:
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.also_rgw
def test_a_second_save_sends_only_what_changed_and_every_step_stays_whole(bucket, proxy):
    root = f"s3://{bucket}/run"
    total = TENSORS * TENSOR_MIB * MiB
    with dcpstore.AsyncCheckpointer(
        root, storage_options={"endpoint_url": proxy.endpoint}, keep_last=1, transfer=TRANSFER, incremental=True
    ) as ckpt:
        ckpt.save(state(1, 2), step=1)
        ckpt.wait()
        first_sent, first_copies = sent_and_copied(proxy)
        assert first_copies == 0 and first_sent >= total  # nothing committed yet: all of it is sent

        proxy.clear()
        ckpt.save(state(2, 2), step=2)  # 2 of 16 tensors changed (12.5 %)
        ckpt.wait()
        sent, copies = sent_and_copied(proxy)
        assert ckpt.last_stats.copied_bytes >= 13 * TENSOR_MIB * MiB
        assert sent <= 0.20 * total, f"sent {sent / total:.2f}x the state"
        assert 1 <= copies == ckpt.last_stats.copy_requests <= 4  # one run per shard object

        proxy.clear()
        ckpt.save(state(3, 2), step=3)  # copies from step 2, whose own bytes were partly copied from step 1
        ckpt.wait()
        assert sent_and_copied(proxy)[0] <= 0.20 * total
        assert ckpt.last_stats.metadata_patched  # laid out as step 2 was: the commit patches its .metadata
        assert ckpt.committed_steps() == [3]  # keep_last=1 pruned the steps the copies came from

    # Whole steps: torch's reader loads step 3 bit-exact with steps 1 and 2 gone; its items check as any others.
    assert_bit_exact(load_with_torch(f"{root}/step_00000003", state(3, 2)), state(3, 2))
    assert main(["verify", f"{root}/step_00000003", "--deep"]) == 0
    assert main(["gc", root, "--grace", "1"]) == 0
    assert_bit_exact(load_with_torch(f"{root}/step_00000003", state(3, 2)), state(3, 2))


def test_nothing_changed_sends_almost_nothing_and_all_changed_sends_all(bucket, proxy):
    root = f"s3://{bucket}/run"
    total = TENSORS * TENSOR_MIB * MiB
    with dcpstore.AsyncCheckpointer(
        root, storage_options={"endpoint_url": proxy.endpoint}, transfer=TRANSFER, incremental=True
    ) as ckpt:
        ckpt.save(state(1, 0), step=1)
        ckpt.wait()
        proxy.clear()
        ckpt.save(state(1, 0), step=2)
        ckpt.wait()
        assert sent_and_copied(proxy)[0] <= 0.01 * total
        proxy.clear()
        ckpt.save(state(3, TENSORS), step=3)
        ckpt.wait()
        sent, copies = sent_and_copied(proxy)
        assert copies == 0 and sent >= total
    for step, sd in ((1, state(1, 0)), (2, state(1, 0)), (3, state(3, TENSORS))):
        assert_bit_exact(load_with_torch(f"{root}/step_{step:08d}", sd), sd)


def test_off_by_default_and_on_a_filesystem_every_save_sends_everything(tmp_path):
    root = f"file://{tmp_path}/run"
    with dcpstore.AsyncCheckpointer(root, incremental=True) as ckpt:
        for step in (1, 2):
            ckpt.save(state(1, 0), step=step)
            ckpt.wait()
            assert ckpt.last_stats.copied_bytes == 0
    assert_bit_exact(load_with_torch(f"{root}/step_00000002", state(1, 0)), state(1, 0))


@pytest.mark.also_rgw
def test_when_the_last_step_is_gone_changed_or_a_copy_fails_the_bytes_are_sent(bucket, proxy, s3):
    """Of step 1's four objects: one deleted (another run's gc), one rewritten (its ETag changed), one whose copy fails every attempt."""
    root = f"s3://{bucket}/run"
    with dcpstore.AsyncCheckpointer(
        root, storage_options={"endpoint_url": proxy.endpoint}, transfer=TRANSFER, incremental=True
    ) as ckpt:
        ckpt.save(state(1, 2), step=1)
        ckpt.wait()
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/step_00000001/")["Contents"] if o["Key"].endswith(".distcp"))
        assert len(keys) == 4
        s3.delete_object(Bucket=bucket, Key=keys[0])
        body = s3.get_object(Bucket=bucket, Key=keys[1])["Body"].read()
        s3.put_object(Bucket=bucket, Key=keys[1], Body=body[::-1])
        failing = proxy.add("PUT", r"step_00000002/__0_\w+_2\.distcp\?.*partNumber=1(&|$)", status=500, code="InternalError", times=TRANSFER.retry.max_attempts)
        ckpt.save(state(2, 2), step=2)
        ckpt.wait()
        assert failing.hits == TRANSFER.retry.max_attempts  # the copy was retried, then its bytes were sent
        assert ckpt.last_stats.copy_requests == 1  # only the fourth object was copied
    assert_bit_exact(load_with_torch(f"{root}/step_00000002", state(2, 2)), state(2, 2))


def test_ranks_of_a_gloo_group_copy_their_own_shards_and_after_a_restart_what_they_loaded(bucket):
    root = f"s3://{bucket}/run"
    copied = run_ranks(checkpointer_incremental_saves, 2, root)
    for rank in (0, 1):
        first, second, after_restart = copied[rank]
        assert first == 0
        # The frozen shard (8 MiB a rank) is copied; the trained one is sent.
        assert 6 * MiB <= second < 9 * MiB and 6 * MiB <= after_restart < 9 * MiB


def test_a_job_killed_during_an_incremental_save_resumes_bit_exact_and_copies_from_the_step_it_loaded(bucket, proxy, s3):
    proxy.add("PUT", r"step_00000002/.*\.distcp", delay=3)
    proxy.add("POST", r"step_00000002/.*\.distcp", delay=3)
    root = f"s3://{bucket}/run"
    results = run_ranks(checkpointer_incremental_killed, 2, root, proxy.endpoint, expect_killed=(1,))
    assert results[1] is None and "step_00000002 was not committed" in results[0]
    copied = run_ranks(checkpointer_incremental_resume, 2, root)
    assert all(6 * MiB <= copied[rank] < 9 * MiB for rank in (0, 1))


def test_plain_dcp_save_with_an_incremental_writer_copies_once_the_last_save_is_seen_committed(bucket):
    copied = run_ranks(dcp_save_incremental, 2, f"s3://{bucket}/plain")
    assert all(6 * MiB <= copied[rank] < 9 * MiB for rank in (0, 1))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_quantized_tensor_whose_scale_changed_is_sent_not_copied(bucket):
    """Same integer values, another scale: the archive differs where the values do not, so quantized tensors are never copied."""
    import io

    import boto3

    root = f"s3://{bucket}/q"
    x = torch.randn(3 * MiB)

    def sd(scale):
        return {f"q{i}": torch.quantize_per_tensor(x * scale, 0.1 * scale, 0, torch.qint8) for i in range(2)}

    writer = dcpstore.ObjectStoreWriter(root, incremental=True, transfer=TRANSFER, objects_per_rank=1)
    for step, scale in ((1, 1.0), (2, 2.0)):
        dcp.save(sd(scale), storage_writer=writer, checkpoint_id=f"{root}/c{step}", no_dist=True)
    assert writer.incremental.bytes_copied == 0
    writer.close()
    s3 = boto3.client("s3")
    md = read_metadata_raw(s3, bucket, "q/c2")
    for info in md.storage_data.values():
        body = s3.get_object(Bucket=bucket, Key=f"q/c2/{info.relative_path}", Range=f"bytes={info.offset}-{info.offset + info.length - 1}")["Body"].read()
        assert torch.load(io.BytesIO(body), weights_only=True).q_scale() == pytest.approx(0.2)


def lora_state(step: int) -> dict:
    """Frozen 6 MiB weights interleaved with small trained adapters: after the first incremental save, one long run."""
    out = {}
    for i in range(4):
        out[f"l{i}.frozen"] = torch.randn(6 * MiB // 4, generator=torch.Generator().manual_seed(i))
        out[f"l{i}.lora"] = torch.full((1024,), float(step))
    return out


def test_a_run_longer_than_a_copied_part_is_copied_in_several(bucket, monkeypatch):
    import dcpstore.storage.multipart as multipart

    monkeypatch.setattr(multipart, "MAX_COPY_PART_SIZE", 16 * MiB)  # S3's is 5 GiB
    root = f"s3://{bucket}/cap"
    copied = []
    with dcpstore.AsyncCheckpointer(root, transfer=TRANSFER, incremental=True, objects_per_rank=1) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(lora_state(step), step=step)
            ckpt.wait()
            copied.append((ckpt.last_stats.copied_bytes, ckpt.last_stats.copy_requests))
    assert copied[0] == (0, 0) and copied[1][0] >= 4 * 6 * MiB
    assert copied[2][0] == copied[1][0] and copied[2][1] == 2  # one run of 24 MiB: two copied parts of 12 MiB
    assert_bit_exact(load_with_torch(f"{root}/step_00000003", lora_state(3)), lora_state(3))


def test_a_copy_that_fails_after_its_first_part_rewrites_the_object_without_copies(bucket, proxy, monkeypatch):
    import dcpstore.storage.multipart as multipart

    monkeypatch.setattr(multipart, "MAX_COPY_PART_SIZE", 16 * MiB)
    root = f"s3://{bucket}/cap"
    with dcpstore.AsyncCheckpointer(
        root, storage_options={"endpoint_url": proxy.endpoint}, transfer=TRANSFER, incremental=True, objects_per_rank=1
    ) as ckpt:
        for step in (1, 2):
            ckpt.save(lora_state(step), step=step)
            ckpt.wait()
        failing = proxy.add("PUT", r"step_00000003/.*\.distcp\?.*partNumber=2(&|$)", status=500, code="InternalError", times=TRANSFER.retry.max_attempts)
        ckpt.save(lora_state(3), step=3)
        ckpt.wait()
        assert failing.hits == TRANSFER.retry.max_attempts and ckpt.last_stats.copied_bytes == 0
    assert_bit_exact(load_with_torch(f"{root}/step_00000003", lora_state(3)), lora_state(3))


def test_after_a_restart_a_source_changed_since_the_load_is_not_copied_from(bucket, s3):
    root = f"s3://{bucket}/run"
    with dcpstore.AsyncCheckpointer(root, transfer=TRANSFER, incremental=True) as ckpt:
        ckpt.save(state(1, 2), step=1)
        ckpt.wait()
    with dcpstore.AsyncCheckpointer(root, transfer=TRANSFER, incremental=True) as ckpt:  # a restarted job
        loaded = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state(1, 2).items()}
        assert ckpt.load(loaded) == 1
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/step_00000001/")["Contents"] if o["Key"].endswith(".distcp"))
        body = s3.get_object(Bucket=bucket, Key=keys[0])["Body"].read()
        s3.put_object(Bucket=bucket, Key=keys[0], Body=body[::-1])  # same size, other bytes: only its ETag tells
        ckpt.save(state(2, 2), step=2)
        ckpt.wait()
        assert ckpt.last_stats.copy_requests == 3
    assert_bit_exact(load_with_torch(f"{root}/step_00000002", state(2, 2)), state(2, 2))


def test_a_reused_writer_without_checkpoint_ids_copies(bucket, proxy):
    """One ``ObjectStoreWriter(incremental=True)`` under plain ``dcp.save`` with no ``checkpoint_id`` (torch never calls ``reset``)."""
    url = f"s3://{bucket}/reused"
    writer = dcpstore.ObjectStoreWriter(url, incremental=True, overwrite=True, transfer=TRANSFER,
                                        storage_options={"endpoint_url": proxy.endpoint})
    for step in (1, 2):
        dcp.save(state(step, 2), storage_writer=writer, no_dist=True)
    assert writer.incremental.bytes_copied >= (TENSORS - 4) * TENSOR_MIB * MiB  # the three frozen objects of four
    writer.close()
    assert_bit_exact(load_with_torch(url, state(2, 2)), state(2, 2))


@pytest.mark.also_rgw
def test_a_copy_whose_source_is_rewritten_while_it_is_copied_sends_the_bytes(bucket, proxy, s3):
    """Issue 56.3: the source changes between its HEAD and the copy (same length); moto and Ceph RGW ignore ``CopySourceIfMatch``.

    The copy is held at the proxy while another writer rewrites every
    shard of step 1; the source's ETag, read again before the completion,
    has changed, so the object is written again with every byte sent.
    """
    import threading

    root = f"s3://{bucket}/run"
    with dcpstore.AsyncCheckpointer(root, storage_options={"endpoint_url": proxy.endpoint}, transfer=TRANSFER, incremental=True) as ckpt:
        ckpt.save(state(1, 2), step=1)
        ckpt.wait()
        release = threading.Event()
        held = proxy.add("PUT", r"step_00000002/", header="x-amz-copy-source", hold=release, times=1)
        ckpt.save(state(2, 2), step=2)
        try:
            assert held.arrived.wait(60)
            for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/step_00000001/")["Contents"]:
                if o["Key"].endswith(".distcp"):
                    body = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                    s3.put_object(Bucket=bucket, Key=o["Key"], Body=body[::-1])
        finally:
            release.set()
        ckpt.wait()
    assert_bit_exact(load_with_torch(f"{root}/step_00000002", state(2, 2)), state(2, 2))
    assert_bit_exact(load_with_dcpstore(f"{root}/step_00000002", state(2, 2)), state(2, 2))
