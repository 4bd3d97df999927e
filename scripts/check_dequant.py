#!/usr/bin/env python3
"""One-off cross-check of specd's ggml dequantizers (engine/model/gguf.c) against an independent
reference: the numpy dequantizers of the `gguf` Python package (gguf.quants).

Not part of `make test` (it needs numpy + gguf from PyPI). Run by hand:
    python3 -m venv /tmp/ggufvenv && /tmp/ggufvenv/bin/pip install gguf numpy
    /tmp/ggufvenv/bin/python scripts/check_dequant.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]

What it does:
 1. writes rand.gguf: tensors of every type specd dequantizes (F16, BF16, Q8_0, Q4_0, Q4_1,
    Q4_K, Q6_K) made of random bytes (fp16 scale fields forced finite), so every bit
    pattern of the quant fields is exercised, not just what a quantizer would produce;
 2. writes ref.gguf: F32 tensors with gguf.quants.dequantize of each of those, and of the
    tensors of blocks 0 and last of the given model file (default SmolLM2), with the
    model's tensor names;
 3. compiles a small C program against engine/model/gguf.c that dequantizes each tensor of the
    source file with ggml_dequantize and compares it with the reference element by
    element; prints the max abs difference per tensor and exits non-zero on mismatch.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Byte offsets of the fp16 scale fields inside one block, per type.
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q6_K: [208]}

C_CHECK = r'''
#include "engine/model/gguf.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    char err[512];
    gguf *src = gguf_open(argv[1], err, sizeof err), *ref = gguf_open(argv[2], err, sizeof err);
    if (!src || !ref) { fprintf(stderr, "%s\n", err); return 2; }
    int bad = 0, n = 0;
    for (int64_t i = 0; i < gguf_n_tensors(ref); i++) {
        const gguf_tensor *r = gguf_tensor_at(ref, i);
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)r->name_len, r->name);
        const gguf_tensor *s = gguf_find_tensor(src, name);
        if (!s) continue;
        int64_t ne = s->ne[0] * s->ne[1] * s->ne[2] * s->ne[3];
        float *y = malloc(ne * sizeof *y);
        const float *want = r->data;
        int rc = ggml_dequantize(s->type, s->data, y, ne);
        double maxd = 0; int64_t nbad = 0;
        for (int64_t k = 0; k < ne && !rc; k++) {
            double d = fabs((double)y[k] - want[k]);
            if (d > maxd) maxd = d;
            /* float32 math in a different order may differ in the last bit */
            if (d > 1e-6 * fabs(want[k]) + 1e-30) nbad++;
        }
        printf("%-28s %-5s n=%-9lld max|diff|=%.3g %s\n", name, ggml_type_name(s->type),
               (long long)ne, maxd, rc || nbad ? "MISMATCH" : "ok");
        bad += rc || nbad; n++;
        free(y);
    }
    printf("%d tensors compared, %d mismatched\n", n, bad);
    return bad || !n;
}
'''


def random_blocks(qtype, nblocks, rng):
    blck, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        # finite, moderate fp16 scales: exponent field 5..20 of 31
        h = (rng.integers(0, 1024, nblocks) | (rng.integers(5, 21, nblocks) << 10)
             | (rng.integers(0, 2, nblocks) << 15)).astype(np.uint16)
        raw[:, off:off + 2] = h.view(np.uint8).reshape(nblocks, 2)
    return raw, blck


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
    rng = np.random.default_rng(1234)
    tmp = tempfile.mkdtemp(prefix="check_dequant.")
    rand_path, ref_path = os.path.join(tmp, "rand.gguf"), os.path.join(tmp, "ref.gguf")

    w = GGUFWriter(rand_path, "llama")
    refs = []
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K):
        rows, nb_row = 8, 4
        raw, blck = random_blocks(qtype, rows * nb_row, rng)
        raw = raw.reshape(rows, -1)
        w.add_tensor(f"rand.{qtype.name}", raw, raw_dtype=qtype)
        refs.append((f"rand.{qtype.name}", dequantize(raw, qtype).astype(np.float32)))
    h = rng.standard_normal((4, 64)).astype(np.float16)
    w.add_tensor("rand.F16", h)
    refs.append(("rand.F16", h.astype(np.float32)))
    b = rng.integers(0, 65536, (4, 64), dtype=np.uint32).astype(np.uint16)
    b[(b & 0x7f80) == 0x7f80] &= 0x3fff   # keep finite
    w.add_tensor("rand.BF16", b.view(np.uint8).reshape(4, 128), raw_dtype=T.BF16)
    refs.append(("rand.BF16", (b.astype(np.uint32) << 16).view(np.float32)))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    if os.path.exists(model):
        r = GGUFReader(model)
        nblk = max(int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk."))
        for t in r.tensors:
            if t.name.startswith(("blk.0.", f"blk.{nblk}.")) or t.name == "output_norm.weight":
                refs.append(("M:" + t.name,
                             dequantize(t.data, t.tensor_type).astype(np.float32)))
    else:
        print(f"note: {model} absent, checking random blocks only")

    wr = GGUFWriter(ref_path, "llama")
    for name, arr in refs:
        wr.add_tensor(name[2:] if name.startswith("M:") else name, np.ascontiguousarray(arr))
    wr.write_header_to_file(); wr.write_kv_data_to_file(); wr.write_tensors_to_file(); wr.close()

    exe = os.path.join(tmp, "check")
    csrc = os.path.join(tmp, "check.c")
    with open(csrc, "w") as f:
        f.write(C_CHECK)
    subprocess.check_call(["gcc", "-std=c11", "-D_GNU_SOURCE", "-O1", "-I", ROOT, csrc,
                           os.path.join(ROOT, "engine/model/gguf.c"), os.path.join(ROOT, "engine/core/err.c"),
                           "-lm", "-o", exe])
    rc = subprocess.call([exe, rand_path, ref_path])
    if os.path.exists(model):
        rc |= subprocess.call([exe, model, ref_path])
    sys.exit(rc)


if __name__ == "__main__":
    main()
