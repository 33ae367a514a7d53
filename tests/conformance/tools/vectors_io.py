"""Reads and writes conformance vector files (safetensors layout, all tensors F32).

Written for this project; the layout is the one tests/conformance/README.md describes: an 8-byte
little-endian header length, a JSON header (padded with spaces to a multiple of 8 bytes) with
one entry per tensor and a "__metadata__" object of strings, then the packed tensors.
"""

import json
import struct

import numpy as np


def read(path):
    """Returns (tensors: dict name -> float32 ndarray, metadata: dict str -> str)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        if entry["dtype"] != "F32":
            raise ValueError(f"{path}: tensor {name} has dtype {entry['dtype']}, want F32")
        b, e = entry["data_offsets"]
        arr = np.frombuffer(data[base + b:base + e], dtype="<f4").copy()
        tensors[name] = arr.reshape(entry["shape"])
    return tensors, meta


def write(path, tensors, metadata):
    """Writes `tensors` (ordered dict name -> array, stored as float32) and string metadata."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        a = np.ascontiguousarray(np.asarray(arr, dtype="<f4"))
        raw = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)
