"""prfaas.v1 protocol buffers (generated stubs beside their .proto files)."""
