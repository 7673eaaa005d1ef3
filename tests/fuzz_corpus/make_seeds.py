#!/usr/bin/env python3
"""Writes the hand-made seed corpus of the safetensors fuzz target into tests/fuzz_corpus/safetensors/.

Files named valid_* are well-formed safetensors files that the reader must accept; files named
bad_* break one rule each (the name says which) and must be rejected with a fourbit::Error; edge_*
are cases the format leaves open (either outcome is fine, but cleanly). The
cpu test test_io_safetensors_corpus checks both, and runs every other file of the directory (the
inputs tools/fuzz.sh --merge added) through the fuzz target's checks. Re-running this script
rewrites the same bytes (deterministic); it does not touch the fuzzer's files.

    python3 tests/fuzz_corpus/make_seeds.py
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors")

SIZES = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
         "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
         "F64": 64, "I64": 64, "U64": 64}


def nbytes(dtype, shape):
    n = 1
    for d in shape:
        n *= d
    return n * SIZES[dtype] // 8


def header_blob(header_text, pad=True):
    raw = header_text.encode("utf-8") if isinstance(header_text, str) else header_text
    if pad:
        raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


def build(tensors, metadata=None, order=None):
    """tensors: list of (name, dtype, shape, data bytes or None = a counting pattern)."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    data = b""
    for name, dtype, shape, payload in tensors:
        size = nbytes(dtype, shape)
        if payload is None:
            payload = bytes((i * 37 + 11) % 256 for i in range(size))
        assert len(payload) == size, name
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + size]}
        data += payload
    return header_blob(json.dumps(header, separators=(",", ":"))) + data


def write(name, blob):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(blob)


def main():
    os.makedirs(OUT, exist_ok=True)
    f32 = struct.pack("<6f", 1.0, -2.0, 0.5, 3.25, -0.0, 65504.0)
    # ---- valid ----
    write("valid_empty", header_blob("{}"))
    write("valid_f32_2x3", build([("w", "F32", [2, 3], f32)]))
    write("valid_metadata", build([("w", "F32", [2, 3], f32)], {"format": "pt", "step": "12"}))
    write("valid_many_dtypes", build([
        ("a.f64", "F64", [2], None), ("b.f32", "F32", [3], None), ("c.bf16", "BF16", [2, 2], None),
        ("d.f16", "F16", [4], None), ("e.i64", "I64", [1], None), ("f.i32", "I32", [2], None),
        ("g.u16", "U16", [3], None), ("h.u8", "U8", [5], None), ("i.e4m3", "F8_E4M3", [4, 4], None),
        ("j.e5m2", "F8_E5M2", [3], None), ("k.e8m0", "F8_E8M0", [2], None), ("l.f4", "F4", [2, 16], None),
        ("m.bool", "BOOL", [3], None), ("n.i8", "I8", [2], None)]))
    write("valid_scalar_and_empty", build([("s", "F32", [], struct.pack("<f", 7.0)),
                                           ("z", "F32", [0, 4], b""), ("y", "U8", [3, 0, 2], b"")]))
    write("valid_nvfp4_layout", build([
        ("model.layers.0.mlp.down_proj.weight", "U8", [4, 8], None),
        ("model.layers.0.mlp.down_proj.weight_scale", "F8_E4M3", [4, 1], None),
        ("model.layers.0.mlp.down_proj.weight_scale_2", "F32", [], None),
        ("model.layers.0.mlp.down_proj.input_scale", "F32", [], None)]))
    write("valid_unicode_name", build([("layer.\u00e9\u4e2d", "F32", [1], None)]))
    write("valid_rank8", build([("r8", "U8", [1, 2, 1, 2, 1, 2, 1, 2], None)]))
    # ---- malformed: each breaks one rule ----
    good = build([("w", "F32", [2, 3], f32)])
    write("bad_empty_file", b"")
    write("bad_short_length", b"\x10\x00\x00")
    write("bad_header_past_end", struct.pack("<Q", 1000) + b"{}")
    write("bad_header_too_large", struct.pack("<Q", 200_000_000) + b"{}" + b" " * 6)
    write("bad_length_overflow", struct.pack("<Q", (1 << 64) - 1) + b"{}")
    write("bad_truncated_data", good[:-4])
    write("bad_trailing_bytes", good + b"\x00" * 8)
    write("bad_not_json", header_blob("{not json"))
    write("bad_not_object", header_blob("[1, 2, 3]"))
    write("bad_leading_space", header_blob(' {"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}') + b"\0" * 4)
    write("bad_invalid_utf8", header_blob(b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}') + b"\0")
    write("bad_unknown_dtype", build([("w", "F32", [1], None)]).replace(b'"F32"', b'"F99"'))
    write("bad_dtype_not_string", header_blob('{"w":{"dtype":32,"shape":[1],"data_offsets":[0,4]}}') + b"\0" * 4)
    write("bad_negative_dim", header_blob('{"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}}'))
    write("bad_float_dim", header_blob('{"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}}') + b"\0")
    write("bad_shape_overflow", header_blob(
        '{"w":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}') + b"\0" * 8)
    write("bad_size_mismatch", header_blob('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}') + b"\0" * 4)
    write("bad_offsets_reversed", header_blob('{"w":{"dtype":"U8","shape":[0],"data_offsets":[4,0]}}') + b"\0" * 4)
    write("bad_offsets_three", header_blob('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}}') + b"\0")
    write("bad_overlap", header_blob('{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
                                     '"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}') + b"\0" * 6)
    write("bad_hole", header_blob('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                  '"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}') + b"\0" * 6)
    write("bad_duplicate_key", header_blob('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                           '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}') + b"\0")
    write("bad_missing_offsets", header_blob('{"w":{"dtype":"U8","shape":[1]}}') + b"\0")
    write("bad_metadata_not_strings", header_blob('{"__metadata__":{"a":1}}'))
    write("bad_nested_deep", header_blob("{\"w\":" + "[" * 2000 + "]" * 2000 + "}"))
    write("bad_f4_odd_count", header_blob('{"w":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}') + b"\0")
    write("bad_entry_not_object", header_blob('{"w":"F32"}'))
    # ---- edge cases either outcome of which is fine (the spec does not say) ----
    write("edge_extra_field", header_blob('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}') + b"\0")
    write("edge_unpadded_header", header_blob('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', pad=False) + b"\0")


if __name__ == "__main__":
    main()
