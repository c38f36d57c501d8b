output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = aws_s3_bucket.this.bucket
}

output "bucket_arn" {
  description = "ARN of the checkpoint bucket."
  value       = aws_s3_bucket.this.arn
}

output "policy_json" {
  description = "Least-privilege IAM policy document for training jobs."
  value       = data.aws_iam_policy_document.checkpoint_access.json
}

output "read_only_policy_json" {
  description = "IAM policy document that can only read the checkpoints: for evaluation jobs and operators."
  value       = data.aws_iam_policy_document.read_only.json
}

output "read_only_policy_arn" {
  description = "ARN of the read-only managed policy, or null when create_read_only_policy is false."
  value       = var.create_read_only_policy ? aws_iam_policy.read_only[0].arn : null
}

output "role_arn" {
  description = "ARN of the training role, or null when create_role is false."
  value       = var.create_role ? aws_iam_role.training[0].arn : null
}

output "instance_profile_name" {
  description = "Instance profile for EC2 training nodes, or null."
  value       = var.create_role && var.role_trust == "ec2" ? aws_iam_instance_profile.training[0].name : null
}

output "checkpoint_root_uri" {
  description = "The s3:// root to pass to dcpstore (AsyncCheckpointer root, dcpstore ls)."
  value       = "s3://${aws_s3_bucket.this.bucket}/${var.checkpoint_prefix}"
}
