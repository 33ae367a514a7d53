#!/usr/bin/env python3
"""Turns a text seed of tests/fuzz/seeds/peer/ into peer_fuzz's input format.

The first line is "world_size N"; every other line is a request name (set, get, wait, join,
heartbeat, membership) followed by the request in protobuf text format, encoded here with
protoc. Output: the world-size byte, then per request its kind byte, a little-endian 16-bit
length and its wire bytes.
    encode_peer_seed.py PROTO_DIR SEED.txt OUT
"""
import struct
import subprocess
import sys

KINDS = {"set": (0, "PeerSetRequest"), "get": (1, "PeerGetRequest"),
         "wait": (2, "PeerWaitRequest"), "join": (3, "JoinRequest"),
         "heartbeat": (4, "HeartbeatRequest"), "membership": (5, "GetMembershipRequest")}


def main(proto_dir, src, dst):
    with open(src) as f:
        lines = [l.strip() for l in f if l.strip() and not l.startswith("#")]
    name, n = lines[0].split()
    assert name == "world_size"
    out = bytes([int(n) - 1])
    for line in lines[1:]:
        op, _, text = line.partition(" ")
        kind, message = KINDS[op]
        wire = subprocess.run(
            ["protoc", "-I" + proto_dir, "--encode=diond.v1." + message, "diond/v1/peer.proto"],
            input=text.encode(), capture_output=True, check=True).stdout
        out += struct.pack("<BH", kind, len(wire)) + wire
    with open(dst, "wb") as f:
        f.write(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
