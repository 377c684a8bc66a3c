"""A `TcpReceiver` in a process of its own, so a test can read its memory use alone.

    python receiver_peer.py KEY_HEX
prints {"port": N} once listening, then answers one JSON line per line read from stdin:
    {"expect": JOB}  -> {"ok": true}                   (attempt 1, 60 s)
    {"digest": JOB}  -> {"status": S, "xxh3": HEX}    (waits for the shipment: xxh3-64 of K, V, ...)
"""

import json
import sys

import xxhash

from prfaas.transport.tcp_receiver import TcpReceiver
from prfaas.transport.tickets import TicketVerifier


def main() -> None:
    receiver = TcpReceiver(TicketVerifier({"k1": bytes.fromhex(sys.argv[1])}))
    print(json.dumps({"port": receiver.address[1]}), flush=True)
    inbounds = {}
    for line in sys.stdin:
        command = json.loads(line)
        if "expect" in command:
            inbounds[command["expect"]] = receiver.expect(command["expect"], 1, timeout_s=60)
            print(json.dumps({"ok": True}), flush=True)
            continue
        inbound = inbounds.pop(command["digest"])
        status = inbound.wait(30)
        h = xxhash.xxh3_64()
        for index in range(len(inbound.info.layer_shapes) if inbound.info else 0):
            for part in inbound.layer(index, 1) if status.value == "completed" else ():
                h.update(part)
        inbound.release()
        print(json.dumps({"status": status.value, "xxh3": h.hexdigest()}), flush=True)
    receiver.close()


if __name__ == "__main__":
    main()
