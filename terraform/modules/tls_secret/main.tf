# The operator's mutual-TLS secret of one prfaas node, declared once: region_aws and
# control_plane_aws take `tls_secret` as `type = any` and hand it here, then read it back
# typed, defaulted and checked (as region_config does for the region interface). The secret
# holds JSON {"ca", "cert", "key"} (PEM text) from `prfaas certs init`; the operator creates
# it, so no private key passes through Terraform (docs/deploy.md, "Certificates").
# Pure: no resources, no provider.

terraform {
  required_version = ">= 1.4"
}

variable "secret" {
  description = "the secret: {arn, kms_arn}"
  type = object({
    arn     = string               # the secret's full ARN, with its 6-character suffix
    kms_arn = optional(string, "") # the KMS key encrypting it; empty: the AWS-managed aws/secretsmanager key
  })
  validation {
    condition     = can(regex("^arn:[a-z-]+:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:.+-[A-Za-z0-9]{6}$", var.secret.arn))
    error_message = "tls_secret.arn: a secret's full ARN (with its 6-character suffix, as create-secret prints it)."
  }
}

output "secret" {
  description = "the secret with its defaults filled in, and `region`: the AWS region it is in (from its ARN)"
  value       = merge(var.secret, { region = split(":", var.secret.arn)[3] })
}
