variable "roles" {
  description = "roles by key"
  type = map(object({
    name_prefix      = string
    service          = string                    # the principal that assumes it, e.g. ec2.amazonaws.com
    policies         = optional(map(string), {}) # inline policy documents (JSON) by name
    managed_policies = optional(map(string), {}) # managed policy ARNs by name
  }))
}

variable "tags" {
  description = "tags on every role"
  type        = map(string)
  default     = {}
}
