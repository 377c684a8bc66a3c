# IAM roles that an AWS service assumes, each with its inline policies and managed-policy
# attachments. Keys (of roles, policies and attachments) must be known at plan time; the
# policy documents need not be.

data "aws_iam_policy_document" "assume" {
  for_each = var.roles
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = [each.value.service]
    }
  }
}

resource "aws_iam_role" "this" {
  for_each           = var.roles
  name_prefix        = each.value.name_prefix
  assume_role_policy = data.aws_iam_policy_document.assume[each.key].json
  tags               = var.tags
}

locals {
  # "ROLE/NAME" => the role and the policy document (inline) or ARN (managed)
  inline  = merge([for role, r in var.roles : { for name, doc in r.policies : "${role}/${name}" => { role = role, policy = doc } }]...)
  managed = merge([for role, r in var.roles : { for name, arn in r.managed_policies : "${role}/${name}" => { role = role, arn = arn } }]...)
}

resource "aws_iam_role_policy" "this" {
  for_each = local.inline
  role     = aws_iam_role.this[each.value.role].id
  policy   = each.value.policy
}

resource "aws_iam_role_policy_attachment" "this" {
  for_each   = local.managed
  role       = aws_iam_role.this[each.value.role].name
  policy_arn = each.value.arn
}
