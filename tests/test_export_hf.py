"""Hugging Face export straight from the bucket to the bucket (issue 45).

Every export is loaded back with ``safetensors.torch.load_file``, the
library transformers and vLLM use, into tensors equal to the full state.
"""

import base64
import json
import zlib

import pytest
import torch
from safetensors.torch import load_file

from dcpstore.cli import main
from dcpstore.storage.config import TransferConfig
from dcpstore.export.hf import INDEX_NAME, export_hf, parse_size, plan_shards
from dist_utils import run_ranks
from workers import hf_model_tensors, save_hf_model


def exported(folder) -> dict[str, torch.Tensor]:
    """Every tensor an export at local ``folder`` holds, through its index."""
    index = json.loads((folder / INDEX_NAME).read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        out.update(load_file(folder / file))
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def download(s3, bucket: str, prefix: str, to) -> None:
    to.mkdir()
    for obj in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")["Contents"]:
        s3.download_file(bucket, obj["Key"], str(to / obj["Key"].rsplit("/", 1)[1]))


@pytest.mark.also_rgw
def test_a_sharded_step_of_mixed_dtypes_exports_to_s3_and_to_a_folder(bucket, s3, tmp_path, capsys):
    root = f"s3://{bucket}/run"
    run_ranks(save_hf_model, 2, root, (2,))
    want = {name.removeprefix("model."): t for name, t in hf_model_tensors().items()}

    # To the bucket, through the CLI, 4 KiB shards: several of them.
    assert main(["export-hf", f"{root}/step_00000001", f"s3://{bucket}/hf", "--max-shard-size", "4KiB", "--prefix", "model."]) == 0
    out = capsys.readouterr().out
    assert "skipped 2 item(s) that are not tensors: train_step, config.lr" in out
    download(s3, bucket, "hf", tmp_path / "s3")
    got = exported(tmp_path / "s3")
    assert len(set(json.loads((tmp_path / "s3" / INDEX_NAME).read_text())["weight_map"].values())) > 2
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    # To a folder, cast to bf16 (floating-point only), names kept.
    result = export_hf(f"{root}/step_00000001", f"file://{tmp_path}/local", dtype="bf16")
    got = exported(tmp_path / "local")
    assert result.shards == ["model-00001-of-00001.safetensors"]
    for name, t in hf_model_tensors().items():
        cast = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == cast.dtype and torch.equal(got[name], cast), name


def test_shards_follow_huggingface_hubs_rule_and_sizes_read_as_it_reads_them():
    from dcpstore.export.hf import _Tensor

    def t(name, n):
        return _Tensor(name, name, torch.uint8, (n,), torch.uint8)

    shards = plan_shards([t("a", 4), t("b", 4), t("big", 20), t("c", 3), t("d", 6)], 10)
    # As huggingface_hub.split_torch_state_dict_into_shards: a tensor over the limit is appended as a shard at once.
    assert [[x.name for x in s] for s in shards] == [["big"], ["a", "b"], ["c", "d"]]
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 << 30 and parse_size("40MB") == 40 * 10**6
    with pytest.raises(ValueError, match="not a size"):
        parse_size("5 gigs")


def test_a_2d_mesh_step_exports_bit_exact(bucket, tmp_path):
    root = f"s3://{bucket}/run2d"
    run_ranks(save_hf_model, 4, root, (2, 2))
    export_hf(f"{root}/step_00000001", f"file://{tmp_path}/hf", max_shard_size="8KB")
    got = exported(tmp_path / "hf")
    for name, t in hf_model_tensors().items():
        assert torch.equal(got[name], t), name


def test_a_step_written_by_stock_fsspec_writer_exports(bucket, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    url = f"s3://{bucket}/stock"
    dcp.save(hf_model_tensors(), storage_writer=FsspecWriter(url), no_dist=True)
    export_hf(url, f"file://{tmp_path}/hf", max_shard_size="10KB")
    got = exported(tmp_path / "hf")
    for name, t in hf_model_tensors().items():
        assert torch.equal(got[name], t), name


def test_a_corrupt_chunk_is_refused_and_leaves_no_export(bucket, s3, capsys):
    root = f"s3://{bucket}/run"
    run_ranks(save_hf_model, 2, root, (2,))
    shards = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run/step_00000001/")["Contents"] if o["Key"].endswith(".distcp")]
    body = bytearray(s3.get_object(Bucket=bucket, Key=shards[-1])["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=shards[-1], Body=bytes(body))
    assert main(["export-hf", f"{root}/step_00000001", f"s3://{bucket}/hf", "--max-shard-size", "4KiB"]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and shards[-1].rsplit("/", 1)[1] in err
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="hf/")  # no index, and the shards written are gone


def test_every_shard_body_goes_with_its_crc32_and_one_damaged_on_the_way_is_sent_again(bucket, s3, proxy, tmp_path, monkeypatch):
    """The shards have no crc32 in any ``.metadata``: S3 checks each body against the CRC32 the export sends (the proxy checks as AWS does).

    The proxy also refuses a completion that does not list each part's
    checksum as the part came with it, as AWS does and moto does not.
    """
    from benchmarks.hf_export import make_model, save_step

    src = f"s3://{bucket}/run/step_00000001"
    part_size = TransferConfig().part_size
    save_step(src, 40)  # one 40 MiB shard: three parts of 16 MiB, each a header or tensors lent as they lie
    proxy.check_crc32 = True
    damaged = proxy.add("PUT", r"[?&]partNumber=2(&|$)", corrupt_request=True, times=1)
    export_hf(src, f"s3://{bucket}/hf", storage_options={"endpoint_url": proxy.endpoint})
    assert damaged.hits == 1  # answered BadDigest, and the part sent again
    parts = [h for method, path, h in proxy.headers if method == "PUT" and "uploadId=" in path]
    assert len(parts) == 4 and all("x-amz-checksum-crc32" in h for h in parts)
    download(s3, bucket, "hf", tmp_path / "big")
    # The object keeps S3's composite checksum: the CRC32 of its parts' CRC32s (AWS appends "-3"; moto does not).
    stored = (tmp_path / "big" / "model-00001-of-00001.safetensors").read_bytes()
    crcs = b"".join(zlib.crc32(stored[k : k + part_size]).to_bytes(4, "big") for k in range(0, len(stored), part_size))
    head = s3.head_object(Bucket=bucket, Key="hf/model-00001-of-00001.safetensors", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"].split("-")[0] == base64.b64encode(zlib.crc32(crcs).to_bytes(4, "big")).decode()
    got = exported(tmp_path / "big")
    for name, t in make_model(40).items():
        assert torch.equal(got[name], t), name

    # A shard smaller than a part goes up as one PUT, with its CRC32 too.
    run_ranks(save_hf_model, 2, f"s3://{bucket}/small", (2,))
    proxy.headers.clear()
    export_hf(f"s3://{bucket}/small/step_00000001", f"s3://{bucket}/hf-small", storage_options={"endpoint_url": proxy.endpoint})
    puts = [h for method, path, h in proxy.headers if method == "PUT" and path.endswith(".safetensors")]
    assert len(puts) == 1 and "x-amz-checksum-crc32" in puts[0]

    # --no-crc32, for servers that refuse the header: none is sent.
    proxy.headers.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    assert main(["export-hf", f"s3://{bucket}/small/step_00000001", f"s3://{bucket}/hf-plain", "--no-crc32"]) == 0
    sent = [h for method, path, h in proxy.headers if method in ("PUT", "POST")]
    assert sent and not any("x-amz-checksum-crc32" in h or "x-amz-checksum-algorithm" in h for h in sent)


def test_an_export_is_refused_where_one_is_committed_unless_overwrite(bucket, tmp_path):
    from dcpstore.errors import CheckpointExistsError

    root = f"s3://{bucket}/run"
    run_ranks(save_hf_model, 2, root, (2,))
    dst = f"file://{tmp_path}/hf"
    export_hf(f"{root}/step_00000001", dst)
    with pytest.raises(CheckpointExistsError, match="already there"):
        export_hf(f"{root}/step_00000001", dst)
    export_hf(f"{root}/step_00000001", dst, overwrite=True, dtype="fp16")
    assert exported(tmp_path / "hf")["lm_head.weight"].dtype == torch.float16


def test_a_killed_exports_shards_go_to_gc_and_a_committed_export_stays(bucket, s3):
    from conftest import wait_until_older_than

    from dcpstore.storage import open_store
    from workers import export_hf_killed_after_first_shard

    root = f"s3://{bucket}/run"
    run_ranks(save_hf_model, 2, root, (2,))
    src = f"{root}/step_00000001"
    run_ranks(export_hf_killed_after_first_shard, 1, src, f"s3://{bucket}/exports/killed", process_group=False, expect_killed=(0,))
    export_hf(src, f"s3://{bucket}/exports/done", max_shard_size="4KiB")
    keys = lambda prefix: sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))  # noqa: E731
    assert keys("exports/killed/") == ["exports/killed/model-00001-of-00004.safetensors"]
    done = keys("exports/done/")
    store = open_store(f"s3://{bucket}/exports")
    assert main(["gc", store.url, "--grace", "60"]) == 0  # too recent: an export may still be writing
    assert keys("exports/killed/") != []
    wait_until_older_than(store, 1)
    assert main(["gc", store.url, "--grace", "1"]) == 0
    assert keys("exports/killed/") == [] and keys("exports/done/") == done


def test_a_128_mib_model_in_40_mb_shards_exports_within_200_mib_of_a_bare_process(bucket):
    """Peak RSS of a fresh process that imported dcpstore and torch, above its own after the imports (VmHWM, reset)."""
    from benchmarks.hf_export import run_child, save_step

    src = f"s3://{bucket}/run/step_00000001"
    save_step(src, 128)
    measured = run_child("export-hf", src, f"s3://{bucket}/hf", "40MB")
    assert measured["peak_rss_mib"] <= 200, measured
