"""prfaas.cli"""
