"""terraform/: security properties asserted from the parsed HCL, plus checkov and fmt. Offline."""

import pathlib
import shutil
import subprocess
import sys

import hcl2
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "terraform"


def parse(name: str) -> dict:
    with open(ROOT / name) as f:
        return clean(hcl2.load(f))


def clean(value):
    """Drop the quotes python-hcl2 8 keeps around labels and string literals."""
    if isinstance(value, dict):
        return {clean(k): clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def unwrap(value):
    """python-hcl2 wraps attribute values in one-element lists."""
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    return value


def blocks(parsed: dict, kind: str, type_: str) -> dict:
    out = {}
    for entry in parsed.get(kind, []):
        for name, body in entry.get(type_, {}).items():
            out[name] = body
    return out


def test_public_access_fully_blocked():
    (pab,) = blocks(parse("main.tf"), "resource", "aws_s3_bucket_public_access_block").values()
    for flag in ("block_public_acls", "block_public_policy", "ignore_public_acls", "restrict_public_buckets"):
        assert unwrap(pab[flag]) is True, flag


def test_lifecycle_aborts_incomplete_multipart_uploads():
    (lc,) = blocks(parse("main.tf"), "resource", "aws_s3_bucket_lifecycle_configuration").values()
    rules = lc["rule"]
    abort = [r for r in rules if "abort_incomplete_multipart_upload" in r]
    assert abort and unwrap(abort[0]["status"]) == "Enabled"
    days = unwrap(unwrap(abort[0]["abort_incomplete_multipart_upload"])["days_after_initiation"])
    assert days == "${var.abort_incomplete_multipart_days}"
    variables = {k: v for entry in parse("variables.tf")["variable"] for k, v in entry.items()}
    assert unwrap(variables["abort_incomplete_multipart_days"]["default"]) == 1


def test_bucket_policy_denies_non_tls():
    docs = blocks(parse("main.tf"), "data", "aws_iam_policy_document")
    (statement,) = docs["tls_only"]["statement"]
    assert unwrap(statement["effect"]) == "Deny"
    cond = unwrap(statement["condition"])
    assert unwrap(cond["variable"]) == "aws:SecureTransport" and unwrap(cond["values"]) == "false"
    (policy,) = blocks(parse("main.tf"), "resource", "aws_s3_bucket_policy").values()
    assert "tls_only" in unwrap(policy["policy"])


def test_encryption_and_ownership():
    parsed = parse("main.tf")
    (sse,) = blocks(parsed, "resource", "aws_s3_bucket_server_side_encryption_configuration").values()
    rule = unwrap(sse["rule"])
    assert unwrap(rule["bucket_key_enabled"]) is True
    assert unwrap(unwrap(rule["apply_server_side_encryption_by_default"])["sse_algorithm"]) == "${local.sse_algorithm}"
    (own,) = blocks(parsed, "resource", "aws_s3_bucket_ownership_controls").values()
    assert unwrap(unwrap(own["rule"])["object_ownership"]) == "BucketOwnerEnforced"


def test_iam_actions_are_exactly_the_least_privilege_list():
    doc = blocks(parse("iam.tf"), "data", "aws_iam_policy_document")["checkpoint_access"]
    assert _actions(doc) == {
        "s3:PutObject",
        "s3:GetObject",
        "s3:DeleteObject",
        "s3:AbortMultipartUpload",
        "s3:ListMultipartUploadParts",
        "s3:ListBucket",
        "s3:ListBucketMultipartUploads",
        "kms:GenerateDataKey",
        "kms:Decrypt",
    }
    listing = next(st for st in doc["statement"] if unwrap(st["sid"]) == "ListCheckpointPrefix")
    assert unwrap(unwrap(listing["condition"])["variable"]) == "s3:prefix"


def _actions(doc: dict) -> set[str]:
    """Every action a policy document grants; a one-item list unwraps to a string."""
    lists = [st["actions"] for st in doc["statement"]]
    lists += [unwrap(dyn["statement"]["content"])["actions"] for dyn in doc.get("dynamic", [])]
    actions = set()
    for value in map(unwrap, lists):
        actions |= {value} if isinstance(value, str) else set(value)
    return actions


def test_read_only_policy_cannot_write():
    """Readers (evaluation, operators) get a policy that cannot plant objects others load."""
    parsed = parse("iam.tf")
    doc = blocks(parsed, "data", "aws_iam_policy_document")["read_only"]
    # ListMultipartUploadParts reads too: `dcpstore gc --dry-run` asks an old upload for its newest part.
    assert _actions(doc) == {
        "s3:GetObject", "s3:ListMultipartUploadParts", "s3:ListBucket", "s3:ListBucketMultipartUploads", "kms:Decrypt"
    }
    objects = next(st for st in doc["statement"] if unwrap(st["sid"]) == "ReadCheckpointObjects")
    assert unwrap(objects["resources"]) == "${local.prefix_arn}/*"
    listing = next(st for st in doc["statement"] if unwrap(st["sid"]) == "ListCheckpointPrefixReadOnly")
    assert unwrap(unwrap(listing["condition"])["variable"]) == "s3:prefix"
    policy = blocks(parsed, "resource", "aws_iam_policy")["read_only"]
    assert "read_only" in unwrap(policy["policy"])
    assert unwrap(policy["count"]) == "${var.create_read_only_policy ? 1 : 0}"
    outputs = {k: v for entry in parse("outputs.tf")["output"] for k, v in entry.items()}
    assert "read_only" in unwrap(outputs["read_only_policy_json"]["value"])
    assert "aws_iam_policy.read_only" in unwrap(outputs["read_only_policy_arn"]["value"])


def _checkov() -> str | None:
    local = pathlib.Path(sys.prefix).parent / ".venv-tools" / "bin" / "checkov"
    return str(local) if local.exists() else shutil.which("checkov")


def test_checkov_passes_with_only_inline_justified_skips():
    checkov = _checkov()
    if checkov is None:
        pytest.skip("checkov not installed (the README test command installs it in .venv-tools)")
    out = subprocess.run(
        [checkov, "-d", str(ROOT), "--quiet", "--compact", "--skip-download", "-o", "json"],
        capture_output=True, text=True, timeout=600,
    )
    import json

    report = json.loads(out.stdout)
    summary = report["summary"] if isinstance(report, dict) else report[0]["summary"]
    assert summary["failed"] == 0, out.stdout[-3000:]
    assert summary["passed"] > 30
    for line in (ROOT / "main.tf").read_text().splitlines():
        if "checkov:skip" in line:
            assert ":" in line.split("checkov:skip=", 1)[1], f"skip without a reason: {line}"


def test_terraform_fmt():
    terraform = shutil.which("terraform") or shutil.which("tofu")
    if terraform is None:
        pytest.skip("no terraform or tofu binary here; the 2-space style is still checked below")
    out = subprocess.run([terraform, "fmt", "-check", "-recursive", str(ROOT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_two_space_indentation():
    for path in ROOT.rglob("*.tf"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            indent = len(line) - len(line.lstrip(" "))
            assert "\t" not in line and indent % 2 == 0, f"{path}:{n}"
