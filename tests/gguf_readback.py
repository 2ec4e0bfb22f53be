"""Reads GGUF files with the `gguf` Python package (llama.cpp's own reader) and prints what ember's
tests compare with their own reading: metadata values, and per tensor its type, shape and the sum
and sum of squares of its dequantized values.

    python tests/gguf_readback.py FILE.gguf [FILE.gguf ...]   # one JSON object per line
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def read(path):
    r = GGUFReader(path)
    meta = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list):
            meta[key] = {"len": len(value), "first": value[:3], "last": value[-3:]}
        else:
            meta[key] = value
    tensors = {}
    for t in r.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        tensors[t.name] = {
            "type": t.tensor_type.name,
            # gguf-py lists dims fastest-first, as the file stores them; ember reports row-major.
            "shape": [int(d) for d in reversed(t.shape.tolist())],
            "sum": float(values.sum()),
            "sumsq": float((values * values).sum()),
        }
    return {"path": path, "metadata": meta, "tensors": tensors}


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(json.dumps(read(p)))
