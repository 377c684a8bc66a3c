"""prfaas.control_plane"""
