#!/usr/bin/env python3
"""Turns a text seed of tests/fuzz/seeds/manifest/ into manifest_fuzz's input format.

A seed is a manifest.json whose "tensors" entries carry their values ("values": [...]) instead
of a CRC. The output is the manifest (each entry given "file", "dtype" and the CRC-32 of its
values) followed by the line "#tensors" and the matching tensors.safetensors bytes, i.e. a
checkpoint that ReadCheckpoint accepts, for the fuzzer to mutate.
    encode_manifest_seed.py SEED.json OUT
"""
import json
import struct
import sys
import zlib


def main(src, dst):
    with open(src) as f:
        m = json.load(f)
    header = {}
    data = b""
    for t in m["tensors"]:
        raw = struct.pack("<%df" % len(t["values"]), *t["values"])
        header[t["name"]] = {"dtype": "F32", "shape": t["shape"],
                             "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
        del t["values"]
        t["file"] = "tensors.safetensors"
        t["dtype"] = "F32"
        t["crc32"] = zlib.crc32(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(dst, "wb") as f:
        f.write(json.dumps(m, indent=1).encode())
        f.write(b"\n#tensors\n")
        f.write(struct.pack("<Q", len(h)) + h + data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
