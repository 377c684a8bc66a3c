"""prfaas.control_plane.jobs: a job's life, from admission to its last token.

states.py      JobState and the table of legal moves (the state machine, written once)
errors.py      the job store's typed errors
scripts.py     the store's Lua: the transition script generated from states.py, admission
notifier.py    pub/sub wake-ups for waiters on a job
store.py       JobStore: create (admission), transition, hand-offs between dispatch and the API
placement.py   AdmissionPlacer: local jobs placed by the API process at admission
dispatch.py    Dispatcher: the Celery task's body (reserve, prefill, follow, retry elsewhere)
generation.py  Follower: the API side (stream the tokens, record DONE, cancel both regions)
celery_app.py  the Celery application and `enqueue` (the worker process: control_plane/worker.py)
"""
