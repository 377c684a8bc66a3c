"""prfaas.engine"""
