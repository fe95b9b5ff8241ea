"""The reference C tower (``src/dafka_tower.c`` of zeromq/dafka), byte for byte, on raw ZeroMQ.

What it does, and nothing more (no hello, no ``X U`` copies, no batches, no
reflections):

* an XSUB (beacons in) and an XPUB (beacons out, welcome message ``W``);
* a subscription arriving on the XPUB is forwarded to the XSUB unless it is at
  least 2 bytes long and its second byte is ``W`` (subscribe and unsubscribe alike);
* a message on the XSUB is read as its first frame (any bytes: ``B``, ``X...``,
  anything a node sends) and then ``"ssi"``: sender, host, port (``atoi``; a
  missing frame is an empty string, frames past the fourth are dropped); it is
  relayed as three frames: the first frame as received, the sender, and
  ``tcp://<host>:<port>`` where an empty host becomes the connection's
  Peer-Address, and a Peer-Address of ``127.0.0.1`` (or none) the tower's
  own first interface address (``own_address``).

Run as a process: ``python tests/c_tower.py [OWN_ADDRESS]``; it prints
``ports IN OUT`` and serves until killed.  :class:`CTower` runs it in a thread.
A subclass may send more on the XPUB from :meth:`CTower.idle` (a rogue tower).
"""

from __future__ import annotations

import re
import sys
import threading

import zmq

_DIGITS = re.compile(rb"\s*([+-]?\d+)")
CLOSE_LINGER_MS = 500  # see CTower._close


def atoi(frame: bytes) -> int:
    """C's atoi: leading whitespace, an optional sign, digits; 0 when there are none."""
    match = _DIGITS.match(frame)
    return int(match.group(1)) if match else 0


class CTower:
    """The C tower's loop on raw sockets bound to 127.0.0.1 (see the module)."""

    def __init__(self, own_address: str = "127.0.0.1", in_port: int = 0, out_port: int = 0) -> None:
        self.own_address = own_address
        self.ctx = zmq.Context.instance()
        self.xpub = self.ctx.socket(zmq.XPUB)
        self.xsub = self.ctx.socket(zmq.XSUB)
        for sock in (self.xpub, self.xsub):
            sock.setsockopt(zmq.LINGER, 0)
        self.xpub.setsockopt(zmq.XPUB_WELCOME_MSG, b"W")
        self.out_port = self._bind(self.xpub, out_port)
        self.in_port = self._bind(self.xsub, in_port)
        self.relayed = 0
        self.forwarded: list[bytes] = []  # subscriptions passed to the XSUB (bounded below)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _bind(sock: zmq.Socket, port: int) -> int:
        if port == 0:
            return sock.bind_to_random_port("tcp://127.0.0.1")
        sock.bind(f"tcp://127.0.0.1:{port}")
        return port

    def start(self) -> CTower:
        self._thread = threading.Thread(target=self.run, name="c-tower", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        else:
            self._close()

    def __enter__(self) -> CTower:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def idle(self) -> None:
        """Called after every poll (hook for a rogue tower)."""

    def poll_ms(self) -> int:
        return 100

    def run(self, max_turns: int = 10_000_000) -> None:
        poller = zmq.Poller()
        poller.register(self.xsub, zmq.POLLIN)
        poller.register(self.xpub, zmq.POLLIN)
        try:
            for _ in range(max_turns):  # bounded; a thread is stopped by close()
                if self._stop.is_set():
                    return
                for sock, _ in poller.poll(self.poll_ms()):
                    if sock is self.xsub:
                        self._relay()
                    else:
                        self._forward()
                self.idle()
        finally:
            self._close()

    def _relay(self) -> None:
        topic = self.xsub.recv(copy=False)
        rest = self.xsub.recv_multipart() if topic.more else []
        sender, host, port = (rest + [b"", b"", b""])[:3]
        if not host:
            try:
                peer = topic.get("Peer-Address")
            except zmq.ZMQError:
                peer = None
            host = (self.own_address if peer in (None, "127.0.0.1") else peer).encode()
        endpoint = b"tcp://%s:%d" % (host, atoi(port))
        self.xpub.send_multipart([topic.bytes, sender, endpoint])
        self.relayed += 1

    def _forward(self) -> None:
        subscription = self.xpub.recv()
        if len(subscription) >= 2 and subscription[1:2] == b"W":
            return
        if len(self.forwarded) < 10_000:
            self.forwarded.append(subscription)
        self.xsub.send(subscription)

    def _close(self) -> None:
        self.xsub.close(0)
        # Not 0: libzmq 4.3.5 aborts ("Resource temporarily unavailable
        # (src/session_base.cpp:233)") when a connection breaks while a session,
        # midway through sending a multipart message, is terminated without linger
        # (its pipe can no longer be read for the message's other parts). With a
        # linger the session reads its pipe until the close's delimiter, so a node
        # closing at this moment (as tests do) finds the message whole.
        self.xpub.close(CLOSE_LINGER_MS)


def main() -> None:
    tower = CTower(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1")
    print("ports", tower.in_port, tower.out_port, flush=True)
    tower.run()


if __name__ == "__main__":
    main()
