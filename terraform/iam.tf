# Least-privilege access for training jobs: objects under the checkpoint
# prefix only, listing only of that prefix.

locals {
  prefix_arn = "${aws_s3_bucket.this.arn}/${var.checkpoint_prefix}"
  trust_services = {
    ec2       = "ec2.amazonaws.com"
    sagemaker = "sagemaker.amazonaws.com"
  }
  oidc_issuer = var.eks_oidc_provider_arn == null ? "" : replace(var.eks_oidc_provider_arn, "/^.*oidc-provider\\//", "")
}

data "aws_iam_policy_document" "checkpoint_access" {
  statement {
    sid = "CheckpointObjects"
    actions = [
      "s3:PutObject",
      "s3:GetObject",
      "s3:DeleteObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${local.prefix_arn}/*"]
  }

  statement {
    sid = "ListCheckpointPrefix"
    actions = [
      "s3:ListBucket",
      "s3:ListBucketMultipartUploads",
    ]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.checkpoint_prefix, "${var.checkpoint_prefix}/*"]
    }
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid       = "CheckpointKmsKey"
      actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_policy" "checkpoint_access" {
  count       = var.create_role ? 1 : 0
  name        = "${var.role_name}-checkpoints"
  description = "dcpstore checkpoint access to s3://${var.bucket_name}/${var.checkpoint_prefix}/"
  policy      = data.aws_iam_policy_document.checkpoint_access.json
  tags        = var.tags
}

data "aws_iam_policy_document" "trust" {
  dynamic "statement" {
    for_each = var.role_trust == "eks_irsa" ? [] : [local.trust_services[var.role_trust]]
    content {
      actions = ["sts:AssumeRole"]
      principals {
        type        = "Service"
        identifiers = [statement.value]
      }
    }
  }

  dynamic "statement" {
    for_each = var.role_trust == "eks_irsa" ? [var.eks_oidc_provider_arn] : []
    content {
      actions = ["sts:AssumeRoleWithWebIdentity"]
      principals {
        type        = "Federated"
        identifiers = [statement.value]
      }
      condition {
        test     = "StringEquals"
        variable = "${local.oidc_issuer}:sub"
        values   = [for sa in var.eks_service_accounts : "system:serviceaccount:${sa}"]
      }
      condition {
        test     = "StringEquals"
        variable = "${local.oidc_issuer}:aud"
        values   = ["sts.amazonaws.com"]
      }
    }
  }
}

resource "aws_iam_role" "training" {
  count              = var.create_role ? 1 : 0
  name               = var.role_name
  assume_role_policy = data.aws_iam_policy_document.trust.json
  tags               = var.tags

  lifecycle {
    precondition {
      condition     = var.role_trust != "eks_irsa" || (var.eks_oidc_provider_arn != null && length(var.eks_service_accounts) > 0)
      error_message = "role_trust = \"eks_irsa\" needs eks_oidc_provider_arn and at least one eks_service_accounts entry."
    }
  }
}

resource "aws_iam_role_policy_attachment" "training" {
  count      = var.create_role ? 1 : 0
  role       = aws_iam_role.training[0].name
  policy_arn = aws_iam_policy.checkpoint_access[0].arn
}

resource "aws_iam_instance_profile" "training" {
  count = var.create_role && var.role_trust == "ec2" ? 1 : 0
  name  = var.role_name
  role  = aws_iam_role.training[0].name
  tags  = var.tags
}

# Read-only access for evaluation jobs and operators (dcpstore ls / inspect /
# verify): whoever holds it cannot plant objects in checkpoints others load.
# ListBucketMultipartUploads is read-only too; `dcpstore ls` shows open uploads,
# and `dcpstore gc --dry-run` asks an old upload for its parts (ListParts).
data "aws_iam_policy_document" "read_only" {
  statement {
    sid       = "ReadCheckpointObjects"
    actions   = ["s3:GetObject", "s3:ListMultipartUploadParts"]
    resources = ["${local.prefix_arn}/*"]
  }

  statement {
    sid = "ListCheckpointPrefixReadOnly"
    actions = [
      "s3:ListBucket",
      "s3:ListBucketMultipartUploads",
    ]
    resources = [aws_s3_bucket.this.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = [var.checkpoint_prefix, "${var.checkpoint_prefix}/*"]
    }
  }

  dynamic "statement" {
    for_each = var.kms_key_arn == null ? [] : [var.kms_key_arn]
    content {
      sid       = "CheckpointKmsKeyDecrypt"
      actions   = ["kms:Decrypt"]
      resources = [statement.value]
    }
  }
}

resource "aws_iam_policy" "read_only" {
  count       = var.create_read_only_policy ? 1 : 0
  name        = "${var.role_name}-checkpoints-read-only"
  description = "dcpstore read-only checkpoint access to s3://${var.bucket_name}/${var.checkpoint_prefix}/"
  policy      = data.aws_iam_policy_document.read_only.json
  tags        = var.tags
}
