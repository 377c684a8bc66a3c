"""prfaas.devstack"""
