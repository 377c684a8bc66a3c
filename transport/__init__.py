"""prfaas.transport"""
