"""`attach_jobs` after a run whose API has gone (killed mid-bench) or answers what is not JSON: the outcomes keep
the client's figures and the bench still writes its report (before, a ConnectError traceback, exit 1, no
bench.json). Real sockets: a port nothing listens on, and a server that answers HTML. The turns a failed
conversation never sent count as failed."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

from prfaas.loadgen.client import Outcome, attach_jobs, run_conversations
from prfaas.loadgen.conversations import Conversation


def _outcomes() -> list[Outcome]:
    done = Outcome(0, "short", 0.0, 10, 0, None, 4, ok=True, job_id="job-1")
    return [done, Outcome(1, "short", 0.1, 10, 0, None, 4, job_id="job-2")]


def test_an_api_gone_leaves_the_outcomes_as_the_client_measured_them() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    outcomes = _outcomes()
    attach_jobs(f"http://127.0.0.1:{port}/v1", "key", outcomes, ledger_wait_s=0.5)
    assert [(o.ok, o.job, o.usage) for o in outcomes] == [(True, {}, {}), (False, {}, {})]


class Html(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<html>a proxy's error page</html>"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_api_answering_what_is_not_json_leaves_the_outcomes_alone() -> None:
    server = HTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        outcomes = _outcomes()
        attach_jobs(f"http://127.0.0.1:{server.server_port}/v1", "key", outcomes, ledger_wait_s=0.5)
        assert outcomes[0].job == {} and outcomes[0].ok
    finally:
        server.shutdown()
        server.server_close()


def test_the_turns_a_failed_conversation_never_sent_count_as_failed() -> None:
    """A multi-turn bench whose first turns fail (an API gone): every planned turn is in the outcomes, the
    unsent ones failed with why (before, 2 conversations of 3 turns reported 2 requests, both failed, so the
    failure rate and the share in SLO looked better than they were)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    conversations = [Conversation(i, 0.0, (1, 2, 3), ((4, 5), (6, 7), (8, 9)), (4, 4, 4)) for i in range(2)]
    outcomes, _ = run_conversations(f"http://127.0.0.1:{port}/v1", "key", "m", conversations, "auto", None, 5.0,
                                    lambda text: [1] * len(text), 2048, think_s=0.0)  # fmt: skip
    assert len(outcomes) == 6 and not any(o.ok for o in outcomes)
    assert [o.error.startswith("not sent: turn 0") for o in outcomes if o.error] == [False, True, True] * 2
