# A checkpoint bucket plus an EC2 role for the training nodes.
#
#   terraform init && terraform apply -var bucket_name=my-team-checkpoints
#   torchrun ... train.py --ckpt "$(terraform output -raw checkpoint_root_uri)/run-7"

terraform {
  required_version = ">= 1.5.0"

  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40, < 7.0"
    }
  }
}

variable "bucket_name" {
  description = "Globally unique name of the checkpoint bucket."
  type        = string
}

variable "region" {
  description = "AWS region of the bucket (put it next to the GPUs)."
  type        = string
  default     = "us-east-1"
}

provider "aws" {
  region = var.region
}

module "checkpoints" {
  source = "../.."

  bucket_name                     = var.bucket_name
  checkpoint_prefix               = "checkpoints"
  abort_incomplete_multipart_days = 1
  create_role                     = true
  role_trust                      = "ec2"
  create_read_only_policy         = true
  tags = {
    purpose = "training-checkpoints"
  }
}

output "checkpoint_root_uri" {
  description = "Pass this to dcpstore."
  value       = module.checkpoints.checkpoint_root_uri
}

output "role_arn" {
  description = "Role for the training nodes."
  value       = module.checkpoints.role_arn
}

output "read_only_policy_arn" {
  description = "Attach to evaluation jobs and operators: they read checkpoints, cannot write them."
  value       = module.checkpoints.read_only_policy_arn
}
