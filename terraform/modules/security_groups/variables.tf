variable "vpc_id" {
  description = "the VPC of every group"
  type        = string
}

variable "groups" {
  description = "security groups by key, each with its rules by key"
  type = map(object({
    name_prefix = string
    description = string
    rules = map(object({
      direction   = string                  # ingress or egress
      description = string                  # shown in the console and in audits
      protocol    = optional(string, "tcp") # "-1": all (then no port)
      port        = optional(number)
      cidr        = optional(string) # the peer: a CIDR ...
      peer        = optional(string) # ... or a group of this call, by key
    }))
  }))
  validation {
    condition = alltrue(flatten([
      for group in values(var.groups) : [
        for rule in values(group.rules) :
        contains(["ingress", "egress"], rule.direction) && (rule.cidr == null) != (rule.peer == null) &&
        (rule.peer == null ? true : contains(keys(var.groups), rule.peer))
      ]
    ]))
    error_message = "each rule: direction ingress or egress, and exactly one peer: a cidr, or a group of this call (peer)."
  }
}

variable "tags" {
  description = "tags on every group"
  type        = map(string)
  default     = {}
}
