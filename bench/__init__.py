"""prfaas.bench"""
