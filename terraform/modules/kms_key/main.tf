# A customer-managed KMS key (rotation on) for one module's data, and the CloudWatch log
# groups it encrypts. Its policy lets the account administer the key and CloudWatch Logs in
# this AWS region use it; with `autoscaling_ebs`, also the Auto Scaling service-linked role,
# which encrypts the EBS volumes of the instances it launches.

data "aws_region" "current" {}
data "aws_caller_identity" "current" {}
data "aws_partition" "current" {}

locals {
  account = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}"
}

resource "aws_kms_key" "this" {
  description             = var.description
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.this.json
  tags                    = var.tags
}

data "aws_iam_policy_document" "this" {
  # A key policy's resource "*" is the key itself (it cannot name its own ARN), and the
  # account root must administer it or the key becomes unmanageable:
  #checkov:skip=CKV_AWS_111:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_356:key policy; "*" is this key only
  #checkov:skip=CKV_AWS_109:key policy; the account root keeps administration of its own key
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"] # in a key policy "*" means this key
    principals {
      type        = "AWS"
      identifiers = ["${local.account}:root"]
    }
  }
  statement {
    sid       = "CloudWatchLogsEncrypt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]
    principals {
      type        = "Service"
      identifiers = ["logs.${data.aws_region.current.name}.amazonaws.com"]
    }
  }
  dynamic "statement" {
    for_each = var.autoscaling_ebs ? ["AutoScalingUsesForEBS"] : []
    content {
      sid       = statement.value
      actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey", "kms:CreateGrant"]
      resources = ["*"]
      principals {
        type        = "AWS"
        identifiers = ["${local.account}:role/aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling"]
      }
    }
  }
}

resource "aws_cloudwatch_log_group" "this" {
  for_each          = var.log_groups
  name              = each.value
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
  tags              = var.tags
}
