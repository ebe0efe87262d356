#!/usr/bin/env python3
"""Fills memory in big buffers with compressible, distinct content, then checks every byte.

Run it under a budget far below its footprint, e.g.
    uzswap run --budget 256M -- python3 examples/fill.py 1024
Arguments: total MiB (default 1024), buffer MiB (default 32), passes over the data (default 2).
Exits 1 on the first wrong byte.
"""
import hashlib
import random
import sys
import time

total_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
buf_mib = int(sys.argv[2]) if len(sys.argv) > 2 else 32
passes = int(sys.argv[3]) if len(sys.argv) > 3 else 2


def content(i):
    """Data that compresses about 8:1 (lz4) and differs for every buffer."""
    rng = random.Random(i)
    block = bytearray()
    for k in range(16):  # a 64 KiB block: text-like runs and random bytes
        block += (b"buffer %08d block %02d " % (i, k)) * 160
        block += rng.randbytes(256)
    block = bytes(block[: 64 << 10])
    reps = (buf_mib << 20) // len(block)
    return block * reps


start = time.time()
n = max(1, total_mib // buf_mib)
bufs = []
digests = []
for i in range(n):
    data = content(i)
    b = bytearray(len(data))  # big: served by uzswap under the shim
    b[:] = data
    bufs.append(b)
    digests.append(hashlib.sha256(data).digest())
    del data
filled = time.time()
for p in range(passes):
    for i, b in enumerate(bufs):
        if hashlib.sha256(b).digest() != digests[i]:
            want = content(i)
            bad = next(k for k in range(len(b)) if b[k] != want[k])
            print(f"buffer {i}: wrong byte at offset {bad}: {b[bad]} != {want[bad]}", flush=True)
            sys.exit(1)
print(
    f"fill.py: {n} buffers of {buf_mib} MiB ({n * buf_mib} MiB) filled in {filled - start:.1f} s, "
    f"verified {passes}x in {time.time() - filled:.1f} s: all bytes correct"
)
