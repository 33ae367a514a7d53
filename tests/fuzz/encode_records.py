#!/usr/bin/env python3
"""Turns a text seed of tests/fuzz/seeds/peer/ or seeds/session/ into the input of peer_fuzz or
session_fuzz: records of one kind byte, a little-endian 16-bit length and the request's wire
bytes (protobuf text encoded with protoc).

A seed has one request per line: its name, a space, the request in protobuf text format.
  peer:    first line "world_size N"; then set, get, wait, join, heartbeat, membership.
  session: step, push, setstate (streams: TensorChunk messages separated by " ;; "), register,
           unregister, hyper, save, load, and "resize N" (the trainer resizes its segment to N
           4-byte words). Session id "s" is the live session, segment name "seg" the harness's.
  auth:    first line "options N" (bit 0 --allow_unauthenticated_tcp, bit 1 mTLS); then
           use, list, attach, load, open, create, save, tokens, each followed by its payload as
           blank-separated items: a number 0-255 is one byte, a quoted Python string literal its
           bytes (latin-1, so '\x00' is a NUL byte). The payload's layout is auth_fuzz.cc's
           (peer, credential and certificate selector bytes, then the operation's bytes).
Lines starting with '#' are comments.
    encode_records.py peer|session|auth PROTO_DIR SEED.txt OUT
"""
import ast
import re
import struct
import subprocess
import sys

PEER = {"set": (0, "PeerSetRequest"), "get": (1, "PeerGetRequest"),
        "wait": (2, "PeerWaitRequest"), "join": (3, "JoinRequest"),
        "heartbeat": (4, "HeartbeatRequest"), "membership": (5, "GetMembershipRequest")}
SESSION = {"step": (0, "StepRequest"), "push": (1, "TensorChunk"),
           "setstate": (2, "TensorChunk"), "register": (3, "RegisterRegionRequest"),
           "unregister": (4, "UnregisterRegionRequest"),
           "hyper": (5, "SetHyperparametersRequest"), "save": (6, "SaveCheckpointRequest"),
           "load": (7, "LoadCheckpointRequest"), "resize": (8, None)}


def encode(proto_dir, proto, message, text):
    return subprocess.run(
        ["protoc", "-I" + proto_dir, "--encode=diond.v1." + message, "diond/v1/%s.proto" % proto],
        input=text.encode(), capture_output=True, check=True).stdout


def record(kind, payload):
    return struct.pack("<BH", kind, len(payload)) + payload


AUTH = {"use": 0, "list": 1, "attach": 2, "load": 3, "open": 4, "create": 5, "save": 6,
        "tokens": 7}
ITEM = re.compile(r"""'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|\S+""")


def auth_payload(text):
    out = b""
    for item in ITEM.findall(text):
        if item[0] in "'\"":
            out += ast.literal_eval(item).encode("latin-1")
        else:
            out += bytes([int(item)])
    return out


def main(which, proto_dir, src, dst):
    with open(src) as f:
        lines = [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
    out = b""
    if which == "auth":
        name, n = lines.pop(0).split()
        assert name == "options"
        out = bytes([int(n)])
        for line in lines:
            op, _, text = line.partition(" ")
            out += record(AUTH[op], auth_payload(text))
        with open(dst, "wb") as f:
            f.write(out)
        return
    if which == "peer":
        name, n = lines.pop(0).split()
        assert name == "world_size"
        out = bytes([int(n) - 1])
    kinds, proto = (PEER, "peer") if which == "peer" else (SESSION, "optimizer")
    for line in lines:
        op, _, text = line.partition(" ")
        kind, message = kinds[op]
        if message is None:  # resize
            payload = struct.pack("<H", int(text))
        elif op in ("push", "setstate"):
            payload = b"".join(record(0, encode(proto_dir, proto, message, chunk))
                               for chunk in text.split(" ;; "))
        else:
            payload = encode(proto_dir, proto, message, text)
        out += record(kind, payload)
    with open(dst, "wb") as f:
        f.write(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
