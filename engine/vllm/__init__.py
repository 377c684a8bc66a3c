"""prfaas.engine.vllm: the production backend, vLLM with the prfaas KV connector.

Nothing here imports vLLM at module level except `connector`, `host` and `server`, which run
in the vLLM environment (`make vllm-install`: .venv-vllm); `remote` (what a region process
uses), `params` and `layout` import without it."""
