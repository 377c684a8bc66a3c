"""prfaas.control_plane.jobs: a job's life, from admission to its last token.

states.py      JobState and the table of legal moves (the state machine, written once)
errors.py      typed errors: the job store's, and JobEnded (a job that ended without its tokens)
scripts.py     the store's Lua: the transition script generated from states.py, admission
notifier.py    pub/sub wake-ups for waiters on a job
store.py       JobStore: create (admission), transition, hand-offs between dispatch and the API
placement.py   AdmissionPlacer: local jobs placed by the API process at admission
dispatch.py    Dispatcher: the Celery task's body (claim, place, reserve, start; the watcher follows)
prefill_calls.py  the worker's Prefill / Reship calls, followed on the watcher to the hand-off
watcher.py     the worker's asyncio loop that reads the prefill streams (no thread per job)
leases.py      leases on an attempt's stages, heartbeats of workers and API processes
periodic.py    Periodic: a duty run every interval on a daemon thread (heartbeats, the sweeper)
attempts.py    a failed attempt: the next one (backoff, excluded instances) or FAILED
sweeper.py     takes back overrun leases, dead workers' attempts, dead API processes' jobs
generation.py  Follower: the API side (stream the tokens, record DONE, decode failover, cancel)
decode_calls.py  the API's calls to the regions: keepalive channels, Generate / Decode, Cancel in both
tokenlog.py    a job's streamed tokens, for the requests that attach (Idempotency-Key)
attached.py    an attached request's read of that log, counted as a reader from its admission
celery_app.py  the Celery application and `enqueue` (the worker process: control_plane/worker.py)
"""
