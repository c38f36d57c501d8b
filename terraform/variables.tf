variable "bucket_name" {
  description = "Name of the checkpoint bucket (globally unique)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.bucket_name))
    error_message = "bucket_name must be 3-63 characters of lowercase letters, digits, '.' and '-'."
  }
}

variable "checkpoint_prefix" {
  description = "Key prefix under which training jobs write checkpoints; IAM access is limited to it."
  type        = string
  default     = "checkpoints"

  validation {
    condition     = can(regex("^[A-Za-z0-9!_.*'()-][A-Za-z0-9!_.*'()/-]*[A-Za-z0-9!_.*'()-]$", var.checkpoint_prefix)) || length(var.checkpoint_prefix) == 1
    error_message = "checkpoint_prefix must be a non-empty S3 key prefix without leading or trailing '/'."
  }
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key for SSE-KMS; null uses SSE-S3 (AES256)."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:", var.kms_key_arn))
    error_message = "kms_key_arn must be a KMS key ARN or null."
  }
}

variable "versioning_enabled" {
  description = "Keep object versions. Off by default: checkpoints are large and replaced whole."
  type        = bool
  default     = false
}

variable "noncurrent_version_expiration_days" {
  description = "With versioning on, delete noncurrent versions after this many days."
  type        = number
  default     = 7

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1
    error_message = "noncurrent_version_expiration_days must be >= 1."
  }
}

variable "abort_incomplete_multipart_days" {
  description = "Abort multipart uploads left open this many days (a crashed save leaves parts behind)."
  type        = number
  default     = 1

  validation {
    condition     = var.abort_incomplete_multipart_days >= 1
    error_message = "abort_incomplete_multipart_days must be >= 1."
  }
}

variable "expiration_days" {
  description = "Optionally expire checkpoint objects under expiration_prefix after this many days; null keeps them."
  type        = number
  default     = null

  validation {
    condition     = var.expiration_days == null || try(var.expiration_days >= 1, false)
    error_message = "expiration_days must be >= 1 or null."
  }
}

variable "expiration_prefix" {
  description = "Prefix that expiration_days applies to (defaults to checkpoint_prefix)."
  type        = string
  default     = null
}

variable "access_log_bucket" {
  description = "Bucket that receives S3 server access logs; null disables access logging."
  type        = string
  default     = null
}

variable "access_log_prefix" {
  description = "Key prefix for access log objects in access_log_bucket."
  type        = string
  default     = "s3-access-logs/"
}

variable "create_role" {
  description = "Create an IAM role for the training nodes with the checkpoint policy attached."
  type        = bool
  default     = false
}

variable "create_read_only_policy" {
  description = "Create a managed IAM policy that can only read the checkpoints (for evaluation jobs and operators)."
  type        = bool
  default     = false
}

variable "role_trust" {
  description = "Who may assume the role: \"ec2\", \"eks_irsa\" or \"sagemaker\"."
  type        = string
  default     = "ec2"

  validation {
    condition     = contains(["ec2", "eks_irsa", "sagemaker"], var.role_trust)
    error_message = "role_trust must be one of \"ec2\", \"eks_irsa\", \"sagemaker\"."
  }
}

variable "role_name" {
  description = "Name of the IAM role (and instance profile for EC2)."
  type        = string
  default     = "dcpstore-training"
}

variable "eks_oidc_provider_arn" {
  description = "ARN of the EKS cluster's IAM OIDC provider (role_trust = \"eks_irsa\")."
  type        = string
  default     = null
}

variable "eks_service_accounts" {
  description = "Service accounts allowed to assume the role, as \"namespace:name\" (role_trust = \"eks_irsa\")."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = {}
}
