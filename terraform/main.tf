# The checkpoint bucket: private, encrypted, TLS-only, with lifecycle rules
# that clean up what crashed saves leave behind.

locals {
  sse_algorithm     = var.kms_key_arn == null ? "AES256" : "aws:kms"
  expiration_prefix = coalesce(var.expiration_prefix, var.checkpoint_prefix)
}

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_144:Cross-region replication doubles the cost of multi-TB checkpoints; a job can re-save.
  #checkov:skip=CKV2_AWS_62:No consumer needs event notifications; commits are visible through .metadata objects.
  #checkov:skip=CKV_AWS_21:Versioning is an opt-in variable (versioning_enabled); checkpoints are replaced whole.
  #checkov:skip=CKV_AWS_145:SSE-KMS is used whenever kms_key_arn is set; SSE-S3 is the documented default.
  #checkov:skip=CKV_AWS_18:Access logging is an opt-in variable (access_log_bucket).
  bucket = var.bucket_name
  tags   = var.tags
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = local.sse_algorithm
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_versioning" "this" {
  count  = var.versioning_enabled ? 1 : 0
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "abort-incomplete-multipart-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_incomplete_multipart_days
    }
  }

  dynamic "rule" {
    for_each = var.expiration_days == null ? [] : [var.expiration_days]
    content {
      id     = "expire-checkpoints"
      status = "Enabled"

      filter {
        prefix = "${local.expiration_prefix}/"
      }

      expiration {
        days = rule.value
      }

      # Every rule aborts stale uploads too, so no rule can shadow that cleanup.
      abort_incomplete_multipart_upload {
        days_after_initiation = var.abort_incomplete_multipart_days
      }
    }
  }

  dynamic "rule" {
    for_each = var.versioning_enabled ? [var.noncurrent_version_expiration_days] : []
    content {
      id     = "expire-noncurrent-versions"
      status = "Enabled"

      filter {}

      noncurrent_version_expiration {
        noncurrent_days = rule.value
      }

      abort_incomplete_multipart_upload {
        days_after_initiation = var.abort_incomplete_multipart_days
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

resource "aws_s3_bucket_logging" "this" {
  count         = var.access_log_bucket == null ? 0 : 1
  bucket        = aws_s3_bucket.this.id
  target_bucket = var.access_log_bucket
  target_prefix = var.access_log_prefix
}

data "aws_iam_policy_document" "tls_only" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.tls_only.json

  depends_on = [aws_s3_bucket_public_access_block.this]
}
