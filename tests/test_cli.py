"""The dcpstore CLI against a bucket with a committed step, an incomplete step and an orphaned upload."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import dcpstore
from dcpstore.cli import main
from dcpstore.layout import TOMBSTONE_SIZE
from conftest import object_exists, wait_until_older_than


@pytest.fixture
def run_root(bucket, s3):
    root = f"s3://{bucket}/run-7"
    ckpt = dcpstore.AsyncCheckpointer(root)
    for step in (100, 200):
        ckpt.save({"model": {"w": torch.randn(64, 8), "b": torch.zeros(8)}, "step": step}, step=step)
    ckpt.wait()
    ckpt.close()
    s3.put_object(Bucket=bucket, Key="run-7/step_00000300/__0_0.distcp", Body=b"partial shard")  # incomplete
    upload = s3.create_multipart_upload(Bucket=bucket, Key="run-7/step_00000300/__0_1.distcp")  # orphaned
    return root, upload["UploadId"]


@pytest.mark.also_rgw
def test_ls(run_root, s3, bucket, capsys):
    root, _ = run_root
    s3.create_multipart_upload(Bucket=bucket, Key="run-7/step_00000400/__0_0.distcp")  # a save's first part in flight
    s3.create_multipart_upload(Bucket=bucket, Key="run-7/step_00000200/__0_9.distcp")  # one a save leaked (issue 56.4)
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line.split() for line in out[1:]}
    assert rows["100"][1] == "committed" and rows["100"][-1] == "0"
    assert rows["200"][1] == "committed" and rows["200"][-1] == "1"  # committed is .metadata's alone
    assert rows["300"][1] == "incomplete" and rows["300"][-1] == "1"  # one open upload
    assert rows["400"][1] == "incomplete" and rows["400"][4] == "0" and rows["400"][-1] == "1"  # no object yet
    assert list(rows) == ["100", "200", "300", "400"]
    assert "WORLD" not in out[0]  # ls reads no metadata; inspect shows the world size


def test_ls_on_a_server_without_list_multipart_uploads(run_root, proxy):
    root, _ = run_root
    rule = proxy.add("GET", r"\?uploads", status=501, code="NotImplemented")
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint}
    out = subprocess.run([sys.executable, "-m", "dcpstore.cli", "ls", root], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "open multipart uploads could not be listed" in out.stderr
    assert {line.split()[0] for line in out.stdout.splitlines()[1:]} == {"100", "200", "300"}
    assert rule.hits == 1  # 501 is not retried


def test_ls_and_help_do_not_import_torch(run_root):
    root, _ = run_root
    code = (
        "import sys\n"
        "from dcpstore.cli import main\n"
        f"assert main(['ls', {root!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "committed" in out.stdout


@pytest.mark.also_rgw
def test_inspect_json_and_text(run_root, capsys):
    root, _ = run_root
    assert main(["inspect", f"{root}/step_00000200", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert {t["fqn"]: t["shape"] for t in summary["tensors"]} == {"train.model.b": [8], "train.model.w": [64, 8]} or \
        {t["fqn"]: t["shape"] for t in summary["tensors"]} == {"model.b": [8], "model.w": [64, 8]}
    assert summary["bytes_items"] == ["step"]
    assert summary["plans_persisted"] and summary["plan_ranks"] == 1 and summary["checksums"]
    assert main(["inspect", f"{root}/step_00000200"]) == 0
    assert "save plans persisted: yes, for 1 ranks" in capsys.readouterr().out


def test_inspect_incomplete_step_fails_clearly(run_root, capsys):
    root, _ = run_root
    assert main(["inspect", f"{root}/step_00000300"]) == 1
    assert "incomplete or missing checkpoint" in capsys.readouterr().err


@pytest.mark.also_rgw
def test_verify_ok_then_truncated_then_corrupted(run_root, s3, bucket, capsys):
    root, _ = run_root
    url = f"{root}/step_00000100"
    assert main(["verify", url]) == 0 and main(["verify", url, "--deep"]) == 0
    capsys.readouterr()
    key = next(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run-7/step_00000100/")["Contents"]
               if o["Key"].endswith(".distcp") and o["Size"] > 1000)
    body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    flipped = bytearray(body)
    flipped[-200] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(flipped))
    assert main(["verify", url]) == 0  # sizes still fine
    assert main(["verify", url, "--deep"]) == 1
    assert f"{key.split('/')[-1]}" in capsys.readouterr().out
    s3.put_object(Bucket=bucket, Key=key, Body=body[:100])
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "truncated" in out and key.split("/")[-1] in out


@pytest.mark.also_rgw
def test_gc_dry_run_then_for_real(run_root, s3, bucket, capsys):
    from dcpstore.storage import open_store

    root, upload_id = run_root
    wait_until_older_than(open_store(root), 1)
    assert main(["gc", root, "--keep-last", "1", "--grace", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would mark incomplete step 300" in out and "would abort" in out and "would delete committed step 100" in out
    assert object_exists(s3, bucket, "run-7/step_00000300/__0_0.distcp")  # dry run touched nothing
    assert main(["gc", root, "--keep-last", "1", "--grace", "1"]) == 0
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert not any(k.startswith("run-7/step_00000100/") for k in keys)
    # The failed save's step is marked; its shard goes at a run a grace later (see collection).
    assert sorted(k for k in keys if k.startswith("run-7/step_00000300/")) == ["run-7/step_00000300/.metadata", "run-7/step_00000300/__0_0.distcp"]
    assert s3.head_object(Bucket=bucket, Key="run-7/step_00000300/.metadata")["ContentLength"] == TOMBSTONE_SIZE
    assert "run-7/step_00000200/.metadata" in keys  # the newest committed step is never touched
    assert s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    capsys.readouterr()
    assert main(["gc", root, "--grace", "1", "--now"]) == 0  # waits out the grace twice: swept, then unmarked
    assert "collecting again in 2s" in capsys.readouterr().out
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    assert not any(k.startswith("run-7/step_00000300/") for k in keys) and "run-7/step_00000200/.metadata" in keys


def test_pruning_a_committed_step_leaves_the_users_files_in_its_folder_and_says_so(run_root, s3, bucket, capsys, caplog):
    """An HF export and evaluation results saved into step 100's folder survive ``gc --keep-last 1``; the dry run lists them."""
    root, _ = run_root
    users = ["hf/model.safetensors", "hf/config.json", "eval_results.json"]
    for name in users:
        s3.put_object(Bucket=bucket, Key=f"run-7/step_00000100/{name}", Body=b"the user's")
    assert main(["gc", root, "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete committed step 100" in out
    assert all(f"{root}/step_00000100/{name}" in out for name in users), out
    with caplog.at_level("WARNING", logger="dcpstore"):
        assert main(["gc", root, "--keep-last", "1"]) == 0
    left = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="run-7/step_00000100/")["Contents"])
    assert left == sorted(f"run-7/step_00000100/{name}" for name in users)  # the checkpoint's objects went, the user's stayed
    assert "hf/model.safetensors" in caplog.text and "no DCP writer wrote" in caplog.text
    assert object_exists(s3, bucket, "run-7/step_00000200/.metadata")


def test_gc_grace_protects_recent_incomplete_steps(run_root, s3, bucket):
    root, _ = run_root
    assert main(["gc", root]) == 0  # default grace: an hour
    assert object_exists(s3, bucket, "run-7/step_00000300/__0_0.distcp")


@pytest.mark.also_rgw
def test_bad_uri_and_missing_bucket(endpoint, capsys):
    assert main(["ls", "nosuch://x/y"]) == 1
    assert "unknown URL scheme 'nosuch'" in capsys.readouterr().err
    assert main(["inspect", "s3://no-such-bucket-cli/x"]) == 1
    assert "bucket 'no-such-bucket-cli' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["ls", "inspect", "verify", "gc", "demo"])
def test_help_on_every_command(command):
    out = subprocess.run([sys.executable, "-m", "dcpstore.cli", command, "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage: dcpstore" in out.stdout


@pytest.mark.slow
def test_demo_kills_and_resumes(moto_endpoint):
    out = subprocess.run(
        [sys.executable, "-m", "dcpstore.cli", "demo", "--steps", "60", "--save-every", "20"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "SIGKILLed right after its save of step 40" in out.stdout
    assert "resumed from:               step 20 (latest committed)" in out.stdout or \
        "resumed from:               step 40 (latest committed)" in out.stdout
    assert "plans reused: True" in out.stdout
    assert "committed steps now:        [" in out.stdout and "60]" in out.stdout


def test_gc_on_a_server_without_list_multipart_uploads(run_root, proxy, caplog):
    from dcpstore.collection import plan_gc
    from dcpstore.storage import open_store

    root, _ = run_root
    rule = proxy.add("GET", r"\?uploads", status=501, code="NotImplemented")
    store = open_store(root, storage_options={"endpoint_url": proxy.endpoint})
    plan = plan_gc(store, None, grace=1, now=time.time() + 60)
    assert [s.step for s in plan.marks] == [300] and plan.uploads == []
    assert rule.hits == 1  # 501 is not retried
    assert "open multipart uploads could not be listed" in caplog.text


def test_verify_deep_reads_zstd_compressed_items(bucket, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    url = f"s3://{bucket}/zstd"
    writer = dcpstore.ObjectStoreWriter(url, _extensions=[ZStandard()])
    dcp.save({"w": torch.randn(64, 8), "step": 3}, storage_writer=writer, no_dist=True)
    assert main(["verify", url, "--deep"]) == 0, capsys.readouterr().out


def test_no_credentials_is_a_clear_error_naming_the_url_and_what_to_do(moto_endpoint):
    """Issue 57.4: botocore's bare ``Unable to locate credentials`` (raised as it signs: nothing is sent) becomes ``StorageAccessError``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true",
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=moto_endpoint)
    script = (
        "import torch, torch.distributed.checkpoint as dcp, dcpstore\n"
        "try:\n"
        "    dcp.save({'w': torch.zeros(3)}, storage_writer=dcpstore.ObjectStoreWriter('s3://no-creds/ck'), no_dist=True)\n"
        "except BaseException as e:\n"
        "    error = e.failures[0][0]\n"
        "    print(type(error).__name__, isinstance(error, dcpstore.DcpstoreError), error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.startswith("StorageAccessError True s3://no-creds/ck/"), out.stdout + out.stderr[-2000:]
    assert "no AWS credentials found" in out.stdout and "AWS_ACCESS_KEY_ID" in out.stdout
    ls = subprocess.run([sys.executable, "-m", "dcpstore.cli", "ls", "s3://no-creds/run"], capture_output=True, text=True, env=env, timeout=120)
    assert ls.returncode == 1 and "Traceback" not in ls.stderr and len(ls.stderr.strip().splitlines()) == 1, ls.stderr
    assert "s3://no-creds/run" in ls.stderr and "no AWS credentials found" in ls.stderr


def test_verify_or_inspect_on_a_run_root_points_to_ls(run_root, capsys):
    root, _ = run_root
    assert main(["verify", root]) == 1
    err = capsys.readouterr().err
    assert "no metadata object" in err and f"{root} is a root of 3 step(s): `dcpstore ls {root}`" in err


def test_the_cli_stops_quietly_when_its_reader_goes_away(bucket):
    """``dcpstore inspect ... | head -c 1``: no ``Broken pipe`` message, exit 0 (2,000 items: more output than a pipe holds)."""
    import torch.distributed.checkpoint as dcp

    url = f"s3://{bucket}/many"
    dcp.save({f"layer{i:04d}.weight": torch.zeros(1) for i in range(2000)}, storage_writer=dcpstore.ObjectStoreWriter(url), no_dist=True)
    script = f"set -o pipefail; {sys.executable} -m dcpstore.cli inspect {url} | head -c 1; echo; echo ${{PIPESTATUS[0]}}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=os.environ, timeout=120)
    assert out.stdout.splitlines() == ["c", "0"], out.stdout + out.stderr
    assert "Broken pipe" not in out.stderr and "rror" not in out.stderr, out.stderr
