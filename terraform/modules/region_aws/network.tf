# The region's network: a VPC of its own (or an existing one by id) with private subnets
# for the instances and public subnets holding only the NAT gateways (package installs and
# AWS APIs go out through them). Flow logs go to CloudWatch, encrypted.

locals {
  create_vpc         = var.vpc.id == ""
  vpc_id             = local.create_vpc ? aws_vpc.this[0].id : var.vpc.id
  vpc_cidr           = local.create_vpc ? aws_vpc.this[0].cidr_block : var.vpc.cidr
  azs                = var.vpc.availability_zones
  private_subnet_ids = local.create_vpc ? aws_subnet.private[*].id : var.vpc.private_subnet_ids
}

resource "aws_vpc" "this" {
  count                = local.create_vpc ? 1 : 0
  cidr_block           = var.vpc.cidr
  enable_dns_support   = true
  enable_dns_hostnames = true
  tags                 = merge(var.tags, { Name = "prfaas-${local.region.name}" })
}

resource "aws_flow_log" "this" {
  count           = local.create_vpc ? 1 : 0
  vpc_id          = aws_vpc.this[0].id
  traffic_type    = "ALL"
  log_destination = module.kms.log_groups["flow"].arn
  iam_role_arn    = module.roles.roles["flow"].arn
  tags            = var.tags
}

# the flow logs' role (module "roles" in main.tf) may write to their log group only
data "aws_iam_policy_document" "flow" {
  count = local.create_vpc ? 1 : 0
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${module.kms.log_groups["flow"].arn}:*"]
  }
}

# the default security group of a new VPC allows nothing (no rules)
resource "aws_default_security_group" "this" {
  count  = local.create_vpc ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  tags   = var.tags
}

# public subnets, routed to the internet gateway: the NAT gateways are in them
resource "aws_subnet" "public" {
  count                   = local.create_vpc ? length(local.azs) : 0
  vpc_id                  = aws_vpc.this[0].id
  availability_zone       = local.azs[count.index]
  cidr_block              = cidrsubnet(var.vpc.cidr, 8, 240 + count.index)
  map_public_ip_on_launch = false
  tags                    = merge(var.tags, { Name = "prfaas-${local.region.name}-public-${count.index}" })
}

resource "aws_internet_gateway" "this" {
  count  = local.create_vpc ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  tags   = var.tags
}

resource "aws_route_table" "public" {
  count  = local.create_vpc ? 1 : 0
  vpc_id = aws_vpc.this[0].id
  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this[0].id
  }
  tags = var.tags
}

resource "aws_route_table_association" "public" {
  count          = local.create_vpc ? length(local.azs) : 0
  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public[0].id
}

# private subnets, the instances': out through the NAT gateway of their AZ
resource "aws_subnet" "private" {
  count                   = local.create_vpc ? length(local.azs) : 0
  vpc_id                  = aws_vpc.this[0].id
  availability_zone       = local.azs[count.index]
  cidr_block              = cidrsubnet(var.vpc.cidr, 4, count.index)
  map_public_ip_on_launch = false
  tags                    = merge(var.tags, { Name = "prfaas-${local.region.name}-private-${count.index}" })
}

resource "aws_eip" "nat" {
  count  = local.create_vpc ? length(local.azs) : 0
  domain = "vpc"
  tags   = var.tags
}

resource "aws_nat_gateway" "this" {
  count         = local.create_vpc ? length(local.azs) : 0
  allocation_id = aws_eip.nat[count.index].id
  subnet_id     = aws_subnet.public[count.index].id
  tags          = var.tags
}

resource "aws_route_table" "private" {
  count  = local.create_vpc ? length(local.azs) : 0
  vpc_id = aws_vpc.this[0].id
  route {
    cidr_block     = "0.0.0.0/0"
    nat_gateway_id = aws_nat_gateway.this[count.index].id
  }
  tags = var.tags
}

resource "aws_route_table_association" "private" {
  count          = local.create_vpc ? length(local.azs) : 0
  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private[count.index].id
}
