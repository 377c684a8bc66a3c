"""A receiver in a process of its own, for the conformance suite's peer-death case.

    python conformance_peer.py KIND KEY_HEX JOB_ID
prints one JSON line with its endpoint ({"port": N} | {"path": P} | {"webrtc": true}) and,
for webrtc, answers each offer read from stdin (one JSON line) with one JSON line.
"""

import json
import sys
import time

from prfaas.transport.tickets import TicketVerifier


def main() -> None:
    kind, key, job_id = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3]
    verifier = TicketVerifier({"k1": key})
    if kind == "tcp":
        from prfaas.transport.tcp_receiver import TcpReceiver

        rx = TcpReceiver(verifier)
        rx.expect(job_id, 1, timeout_s=60)
        print(json.dumps({"port": rx.address[1]}), flush=True)
    elif kind == "shm":
        from prfaas.transport.shm_receiver import ShmReceiver

        shm = ShmReceiver(verifier, arena_bytes=64 << 20)
        shm.expect(job_id, 1, timeout_s=60)
        print(json.dumps({"path": shm.path}), flush=True)
    elif kind == "webrtc":
        from prfaas.transport.webrtc_receiver import WebRtcReceiver

        rtc = WebRtcReceiver(verifier)
        rtc.expect(job_id, 1, timeout_s=60)
        print(json.dumps({"webrtc": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps(rtc.answer(json.loads(line))), flush=True)
    else:
        raise SystemExit(f"unknown kind {kind}")
    time.sleep(60)


if __name__ == "__main__":
    main()
