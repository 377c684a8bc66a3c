variable "name" {
  description = "deployment name"
  type        = string
  default     = "example"
}

variable "model" {
  description = "served model: catalog name or an HF folder present on the AMI"
  type        = string
  default     = "smollm2-135m"
}

variable "ticket_key_id" {
  description = "id of the ticket key, on the control plane and every region: a new one with each new key (docs/deploy.md, \"Rotating the ticket key\")"
  type        = string
  default     = "k1"
}

variable "prfaas_package" {
  description = "pip requirement the region instances install"
  type        = string
  default     = "prfaas"
}

variable "container_image" {
  description = "control-plane image (prfaas installed)"
  type        = string
}

variable "certificate_arn" {
  description = "ACM certificate (in the decode region) of the API's HTTPS listener"
  type        = string
}

variable "regions" {
  description = "the regions by slot: prefill_a and prefill_b (cheap compute-dense GPUs), decode (the control plane runs in its VPC); each slot has its provider block (versions.tf)"
  type = map(object({
    name               = string
    aws_region         = string
    availability_zones = list(string)
    vpc_cidr           = string
    gpu_type           = string
    instance_types     = list(string)
    usd_per_gpu_hour   = number
    min_size           = number
    max_size           = number
    kv_buffer_bytes    = optional(number) # null: region_aws's default
    # EFA's cluster placement group lies in one AZ: only with one availability zone, so never
    # in the decode slot, whose VPC also holds the control plane (its ALB and RDS need two)
    enable_efa = optional(bool, false)
  }))
  default = {
    prefill_a = {
      name     = "prefill-use2", aws_region = "us-east-2", availability_zones = ["us-east-2a", "us-east-2b"], vpc_cidr = "10.21.0.0/16",
      gpu_type = "l40s", instance_types = ["g6e.xlarge", "g6e.2xlarge"], usd_per_gpu_hour = 1.86, min_size = 1, max_size = 8
    }
    prefill_b = {
      name     = "prefill-usw2", aws_region = "us-west-2", availability_zones = ["us-west-2a", "us-west-2b"], vpc_cidr = "10.22.0.0/16",
      gpu_type = "l40s", instance_types = ["g6e.xlarge", "g6e.2xlarge"], usd_per_gpu_hour = 1.86, min_size = 0, max_size = 8
    }
    decode = {
      name            = "decode-use1", aws_region = "us-east-1", availability_zones = ["us-east-1a", "us-east-1b"], vpc_cidr = "10.20.0.0/16",
      gpu_type        = "h100", instance_types = ["p5.48xlarge"], usd_per_gpu_hour = 12.29, min_size = 1, max_size = 2,
      kv_buffer_bytes = 68719476736
    }
  }
  validation {
    condition     = toset(keys(var.regions)) == toset(["decode", "prefill_a", "prefill_b"])
    error_message = "regions: exactly the slots decode, prefill_a and prefill_b (each has its provider block)."
  }
}

variable "tls_secrets" {
  description = "the mutual-TLS secrets (JSON: ca, cert, key; docs/deploy.md, \"Certificates\"), each in its slot's AWS region: control_plane (prfaas://control-plane/NAME) and one per region slot (prfaas://ROLE/REGION/*)"
  type = map(object({
    arn     = string               # the secret's full ARN
    kms_arn = optional(string, "") # its KMS key; empty: the AWS-managed aws/secretsmanager key
  }))
  validation {
    condition     = toset(keys(var.tls_secrets)) == toset(["control_plane", "decode", "prefill_a", "prefill_b"])
    error_message = "tls_secrets: exactly control_plane, decode, prefill_a and prefill_b."
  }
}

variable "links" {
  description = "estimated prefill -> decode paths until measured (rtt ms, Gbit/s per region pair, egress $/GB)"
  type = map(object({
    rtt_ms            = number
    bandwidth_gbps    = number
    egress_usd_per_gb = number
  }))
  default = {
    prefill_a = { rtt_ms = 12, bandwidth_gbps = 5, egress_usd_per_gb = 0.02 }
    prefill_b = { rtt_ms = 65, bandwidth_gbps = 5, egress_usd_per_gb = 0.02 }
  }
}

variable "tags" {
  description = "default tags of every resource"
  type        = map(string)
  default     = { project = "prfaas" }
}
