"""prfaas.control_plane.api: the HTTP API, one APIRouter per resource (the app: control_plane/app.py).

completions.py  /v1/completions, /v1/chat/completions (SSE with stream=true), /v1/models
attach.py       a retry with an Idempotency-Key attached to its key's job
jobs.py         /v1/jobs: the caller's jobs (state, timeline, placement, cost), cancel
usage.py        /v1/usage (the caller's) and /admin/usage (every tenant's), from the ledger
tenants.py      /admin/tenants: tenants and their API keys
regions.py      /admin/regions, /admin/links: the fleet, drains, links
prices.py       /admin/prices: every price with its source and age, refresh
deps.py         the named dependencies (ServicesDep, TenantDep, AdminDep, MeterDep, GenerationDep)
openai_schemas.py  the generation requests: OpenAI's fields, vLLM's extras, `prfaas`
schemas.py      the other request and response models, a family per resource
shutdown.py     Drain: the API's drain on SIGTERM (503 server_shutting_down, then its jobs canceled)
threads.py      the threads of the waits on jobs' tokens and of the cancels of clients gone
errors.py       OpenAI's error object on every /v1 4xx/5xx: the catalogue and the handlers
body_limit.py   BodyLimit: 413 past Settings.max_body_bytes, before the body is read or parsed
metrics.py      ApiMetrics: responses, tokenizer time, admission refusals
"""
