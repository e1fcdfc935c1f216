"""Delay (and optionally drop) the packets an nftables ``queue`` rule hands to user space: netem without sch_netem.

Run inside a network namespace whose nftables output chain sends traffic to queue ``--queue``. Every queued
packet is accepted ``--delay-ms`` after it arrived (a FIFO, so one batch verdict releases every packet that is due);
with ``--loss`` a packet is dropped with that probability instead. Standard library only (raw netlink), so it runs
where the kernel lacks ``sch_netem`` (tc reports "Specified qdisc kind is unknown").

Bounded: it exits after ``--lifetime-s`` seconds or on SIGTERM/SIGINT, releasing what it still holds.

    python nfdelay.py --queue 0 --delay-ms 5 --loss 0.01 --lifetime-s 600
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1
NF_DROP = 0
NF_ACCEPT = 1
NLM_F_REQUEST = 1
NLMSG_ERROR = 2


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _message(msg: int, queue: int, attrs: bytes, seq: int) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, NLM_F_REQUEST, seq, 0) + body


def _packet_ids(data: bytes) -> list[int]:
    """Packet ids of the NFQNL_MSG_PACKET messages in one netlink datagram."""
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos = offset + 20
            end = offset + length
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if atype & 0x7FFF == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                    break
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return ids


class Queue:
    def __init__(self, queue: int) -> None:
        self.queue = queue
        self.seq = 0
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.bind((0, 0))
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_BIND, 0, 0)))
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
                     + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 1 << 16)))

    def _send(self, msg: int, attrs: bytes) -> None:
        self.seq += 1
        self.sock.send(_message(msg, self.queue, attrs, self.seq))

    def _config(self, attrs: bytes) -> None:
        self._send(NFQNL_MSG_CONFIG, attrs)

    def verdict(self, packet_id: int, verdict: int, *, batch: bool) -> None:
        kind = NFQNL_MSG_VERDICT_BATCH if batch else NFQNL_MSG_VERDICT
        self._send(kind, _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id)))

    def receive(self) -> list[int]:
        try:
            return _packet_ids(self.sock.recv(1 << 16))
        except OSError:  # ENOBUFS: messages lost, their packets stay queued until a later batch verdict
            return []

    def close(self) -> None:
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BBH", NFQNL_CFG_CMD_UNBIND, 0, 0)))
        self.sock.close()


def serve(queue: Queue, delay_s: float, loss: float, lifetime_s: float, seed: int) -> int:
    """Hold every packet ``delay_s`` (dropping a fraction ``loss``); return the number of packets seen."""
    rng = random.Random(seed)
    held: collections.deque[tuple[float, int]] = collections.deque()
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    signal.signal(signal.SIGINT, lambda *_: stop.__setitem__(0, True))
    seen = 0
    end = time.monotonic() + lifetime_s
    while not stop[0] and time.monotonic() < end:
        now = time.monotonic()
        wait = max(0.0, held[0][0] + delay_s - now) if held else 0.2
        ready, _, _ = select.select([queue.sock], [], [], min(wait, 0.2))
        if ready:
            now = time.monotonic()
            for packet_id in queue.receive():
                seen += 1
                if loss > 0 and rng.random() < loss:
                    queue.verdict(packet_id, NF_DROP, batch=False)
                else:
                    held.append((now, packet_id))
        now = time.monotonic()
        last = None
        while held and held[0][0] + delay_s <= now:
            last = held.popleft()[1]
        if last is not None:
            queue.verdict(last, NF_ACCEPT, batch=True)
    if held:
        queue.verdict(held[-1][1], NF_ACCEPT, batch=True)
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--queue", type=int, default=0)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    parser.add_argument("--loss", type=float, default=0.0)
    parser.add_argument("--lifetime-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-file", default=None, help="written once the queue is bound")
    args = parser.parse_args(argv)
    queue = Queue(args.queue)
    if args.ready_file:
        with open(args.ready_file, "w") as f:
            f.write(str(os.getpid()))
    try:
        seen = serve(queue, args.delay_ms / 1e3, args.loss, args.lifetime_s, args.seed)
    finally:
        queue.close()
    print(f"nfdelay: {seen} packets, delay {args.delay_ms} ms, loss {args.loss}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
