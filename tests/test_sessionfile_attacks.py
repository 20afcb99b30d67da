"""Session files under attack: every header bit flipped, fields forged with valid digests, garbage
metadata, junk in the folder, a full disk, a failing planned stop, writers killed mid-spill,
files planted by someone without the store's key. Nothing wrong is ever served, no session is
lost, and no request or status call raises."""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import shadow.core.blockio as blockio
import shadow.core.sessionfile as sessionfile
import shadow.core.store as store_module
from shadow.core.reader import Reader
from shadow.core.sessionfile import Identity, SessionFileError, read_fields, read_ids, read_session
from shadow.model.runtime import arithmetic
from shadow.core.store import SessionStore, check_folder

GRID = 64
DTYPE_NAMES = {torch.int64: "I64", torch.float32: "F32", torch.int32: "I32", torch.float64: "F64"}
BLOCK = 16 << 10  # the files here are digested in blocks this small, so a tiny session's file has several
KEY = b"the store's key"


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def reader(tiny):
    return Reader(tiny.model, GRID)


def fed(store: SessionStore, reader: Reader, name: str, seed: int = 0):
    s = store.get(name)
    reader.feed_prompt(s, ids(300, seed))
    reader.advance(s)
    reader.feed_output(s, ids(40, seed + 100))
    reader.advance(s)
    return s


def fingerprint(session) -> dict:
    out = {k: v.clone() for k, v in session.state.tensors().items()}
    out["ids"] = torch.tensor(session.ids)
    for j, c in enumerate(session.checkpoints):
        out[f"checkpoint.{j}.conv"], out[f"checkpoint.{j}.recurrent"] = c.conv.clone(), c.recurrent.clone()
    out["scalars"] = (session.name, session.committed, [c.position for c in session.checkpoints],
                      list(session.marks), session.rollbacks, session.ids_reread)
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def written(reader, folder: Path, key: bytes | None = None) -> tuple[bytes, dict, str]:
    """One real session file (tiny, 340 ids, a checkpoint, a pending tail) in blocks of BLOCK: its
    bytes, fingerprint and name."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sessionfile, "BLOCK_BYTES", BLOCK)
        store = SessionStore(reader, "h", cap_gib=None, disk=folder, model="tiny", key=key)
        session = fed(store, reader, "a")
        assert store.close() == []
    return store.path_of("a").read_bytes(), fingerprint(session), store.path_of("a").name


@pytest.fixture(scope="module")
def original(reader, tmp_path_factory):
    data, want, name = written(reader, tmp_path_factory.mktemp("original"))
    assert len(split(data)[0]["blocks_sha256"]) // 64 > 4  # several blocks
    return data, want, name


@pytest.fixture(scope="module")
def keyed(reader, tmp_path_factory):
    """The same session's file written by a store with KEY."""
    return written(reader, tmp_path_factory.mktemp("keyed"), KEY)


def place(folder: Path, data: bytes, name: str) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def load(path: Path, reader: Reader, key: bytes | None = None, **kwargs):
    return read_session(path, Identity("h", GRID, arithmetic(reader.model)), reader.model.new_state(), key=key,
                        **kwargs)


# every header bit ------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_single_bit_flip_of_the_header_is_refused_or_restores_bit_equal(original, reader, tmp_path):
    """All bits of the length prefix and the JSON header, flipped one at a time in place."""
    data, want, name = original
    path = place(tmp_path, data, name)
    assert_same(fingerprint(load(path, reader)), want)
    header_end = 8 + int.from_bytes(data[:8], "little")
    refused, equal, reasons = 0, 0, set()
    fd = os.open(path, os.O_RDWR)
    try:
        for bit in range(header_end * 8):
            at = bit // 8
            os.pwrite(fd, bytes([data[at] ^ (1 << (bit % 8))]), at)
            try:
                got = load(path, reader)
            except SessionFileError as e:
                refused += 1
                reasons.add(str(e).split(" (")[0])
            else:
                assert_same(fingerprint(got), want)
                equal += 1
            try:
                read_fields(path)
            except SessionFileError:
                pass
            os.pwrite(fd, data[at : at + 1], at)
    finally:
        os.close(fd)
    assert refused + equal == header_end * 8 and refused > 0
    assert all(reasons), reasons


@pytest.mark.slow
def test_header_flips_signed_again_never_crash_and_what_is_accepted_is_consistent(original, reader, tmp_path):
    """Each bit of the JSON header flipped and the header digest made valid again (a writer's bug
    rather than damage): the reader refuses with a reason or returns a session that keeps every
    invariant (grid, vocabulary, shapes); it never raises anything else."""
    data, want, name = original
    path = place(tmp_path, data, name)
    n = int.from_bytes(data[:8], "little")
    slot = data.index(b'"header_sha256":"') + len(b'"header_sha256":"')
    accepted, refused = 0, 0
    fd = os.open(path, os.O_RDWR)
    try:
        for bit in range(8 * 8, (8 + n) * 8):
            at = bit // 8
            if slot <= at < slot + 64:
                continue
            flipped = bytearray(data[: 8 + n])
            flipped[at] ^= 1 << (bit % 8)
            flipped[slot : slot + 64] = b"0" * 64
            flipped[slot : slot + 64] = hashlib.sha256(flipped).hexdigest().encode()
            os.pwrite(fd, bytes(flipped), 0)
            try:
                s = load(path, reader)
            except SessionFileError:
                refused += 1
                continue
            accepted += 1
            assert s.committed % GRID == 0 and s.committed <= len(s.ids)
            assert all(0 <= i < reader.model.config.vocab_size for i in s.ids)
            assert all(0 < c.position <= s.committed and c.position % GRID == 0 for c in s.checkpoints)
            assert all(s.committed < m <= len(s.ids) and m % GRID == 0 for m in s.marks)
            fresh = reader.model.new_state()
            fresh.length = s.committed
            assert {k: (v.dtype, v.shape[0]) for k, v in s.state.tensors().items() if k.endswith(("conv", "recurrent"))} == \
                {k: (v.dtype, v.shape[0]) for k, v in fresh.tensors().items() if k.endswith(("conv", "recurrent"))}
    finally:
        os.close(fd)
    assert refused > 0 and accepted < refused


def test_flips_in_the_tensor_bytes_and_truncations_are_refused(original, reader, tmp_path):
    data, _, name = original
    header_end = 8 + int.from_bytes(data[:8], "little")
    path = tmp_path / name
    for at in range(header_end, len(data), 397):  # a byte of every few hundred, each tensor hit
        path.write_bytes(data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :])
        with pytest.raises(SessionFileError, match="data digest mismatch"):
            load(path, reader)
    for cut in [0, 3, 8, 9, header_end - 1, header_end, header_end + 1, len(data) - 1]:
        path.write_bytes(data[:cut])
        with pytest.raises(SessionFileError, match="truncated|unreadable|tensors hold"):
            load(path, reader)
    path.write_bytes(data + b"\0")  # a byte too many
    with pytest.raises(SessionFileError, match="tensors hold"):
        load(path, reader)


# forged files: valid digests, wrong content --------------------------------------------------


def split(data: bytes) -> tuple[dict, dict, bytes]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    return header.pop("__metadata__"), header, data[8 + n :]


ZEROS = b"0" * 64


def sign(meta: dict, entries: dict, body: bytes, blocks: str | None = None, key: bytes | None = None) -> bytes:
    """A format-3 file with these fields whose digests are valid, computed here from the format's
    definition: the SHA-256 of each block of `block_bytes` of the tensor bytes (unless given), the
    keyed digest with `key` (zeros without), the SHA-256 of length and header with its own digest
    as zeros."""
    block = int(meta.get("block_bytes", BLOCK))
    step = block if block > 0 else len(body) + 1
    digests = "".join(hashlib.sha256(body[i : i + step]).hexdigest() for i in range(0, len(body), step))
    meta = {**meta, "block_bytes": str(block), "blocks_sha256": digests if blocks is None else blocks,
            "header_hmac": meta.get("header_hmac", "0" * 64), "header_sha256": "0" * 64}
    return sign_text(json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode(), body, key)


def sign_text(text: bytes, body: bytes, key: bytes | None = None) -> bytes:
    """Length, header padded so the data starts at a multiple of 4096, its digests, the body."""
    text += b" " * (-(8 + len(text)) % 4096)
    prefix = len(text).to_bytes(8, "little")
    if key is not None:
        keyed = hmac.new(key, hashlib.sha256(prefix + text).digest(), "sha256").hexdigest().encode()
        text = text.replace(b'"header_hmac":"' + ZEROS, b'"header_hmac":"' + keyed)
    digest = hashlib.sha256(prefix + text).hexdigest().encode()
    return prefix + text.replace(b'"header_sha256":"' + ZEROS, b'"header_sha256":"' + digest) + body


def sign_format_2(meta: dict, entries: dict, body: bytes) -> bytes:
    """A format-2 file (the earlier version's): one SHA-256 over the tensor bytes, the header padded
    to 8 bytes, no block digests, no keyed digest."""
    meta = {k: v for k, v in meta.items() if k not in ("block_bytes", "blocks_sha256", "header_hmac")}
    meta |= {"version": "2", "data_sha256": hashlib.sha256(body).hexdigest(), "header_sha256": "0" * 64}
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    prefix = len(text).to_bytes(8, "little")
    digest = hashlib.sha256(prefix + text).hexdigest().encode()
    return prefix + text.replace(b'"header_sha256":"' + ZEROS, b'"header_sha256":"' + digest) + body


def rebuild(meta: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    entries, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    return sign(meta, entries, b"".join(chunks))


def tensors_of(data: bytes, tmp_path: Path) -> dict[str, torch.Tensor]:
    path = place(tmp_path, data, "read.safetensors")
    with safe_open(str(path), framework="pt") as f:  # a plain safetensors file
        return {k: f.get_tensor(k) for k in f.keys()}


def forge_entry(key: str, field: str, value):
    def forge(data, tmp_path):
        meta, entries, body = split(data)
        entries[key][field] = value
        return sign(meta, entries, body)
    return forge


def forge_meta(**fields):
    def forge(data, tmp_path):
        meta, entries, body = split(data)
        meta.update({k: v for k, v in fields.items() if v is not None})
        for k in [k for k, v in fields.items() if v is None]:
            meta.pop(k)
        return sign(meta, entries, body, fields.get("blocks_sha256"))
    return forge


def forge_tensor(change):
    def forge(data, tmp_path):
        meta, _, _ = split(data)
        tensors = tensors_of(data, tmp_path)
        change(tensors, meta)
        return rebuild(meta, tensors)
    return forge


def _short_v(t, meta):
    t["layers.3.v"] = t["layers.3.v"][:, :-64]


def _short_ids(t, meta):
    t["ids"] = t["ids"][:300]
    meta["tokens"] = "300"


def _id_past_vocab(t, meta):
    t["ids"][5] = 248320


def _negative_id(t, meta):
    t["ids"][0] = -1


def _ids_as_int32(t, meta):  # the same bytes, read as twice as many int32
    t["ids"] = t["ids"].view(torch.int32)


def _extra_checkpoint(t, meta):
    for i in range(3):
        t[f"checkpoints.1.{i}.conv"] = t[f"checkpoints.0.{i}.conv"]


def _missing_tensor(t, meta):
    del t["layers.1.recurrent"]


def _overlap(data, tmp_path):
    meta, entries, body = split(data)
    entries["layers.1.conv"]["data_offsets"] = entries["layers.0.conv"]["data_offsets"]  # same size, read twice
    return sign(meta, entries, body)


def _repeated_key(data, tmp_path):
    meta, entries, body = split(data)
    signed = split(sign(meta, entries, body))[0] | {"header_sha256": "0" * 64}  # the block digests filled in
    text = json.dumps({"__metadata__": signed, **entries}, separators=(",", ":")).encode()
    return sign_text(text.replace(b'"model":"tiny"', b'"model":"tiny","model":"big!"', 1), body)


def _blocks_of_another_size(data, tmp_path):
    meta, entries, body = split(data)
    return sign(meta | {"block_bytes": str(2 * BLOCK)}, entries, body, blocks=meta["blocks_sha256"])


def _version_1(data, tmp_path):
    meta, entries, body = split(data)
    meta = {k: v for k, v in meta.items() if not k.endswith(("sha256", "hmac", "block_bytes"))} | {"version": "1"}
    text = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + body


FORGED = {
    "v-dtype-F32-as-I32": (forge_entry("layers.3.v", "dtype", "I32"), "layers.3.v is int32"),
    "ids-dtype-I64-as-F64": (forge_entry("ids", "dtype", "F64"), "ids are float64"),
    "ids-as-int32": (forge_tensor(_ids_as_int32), "ids are int32 \\[680\\]"),
    "checkpoint-off-grid": (forge_meta(checkpoints="[259]"), "checkpoints"),
    "checkpoint-past-committed": (forge_meta(checkpoints="[384]"), "checkpoints"),
    "checkpoints-not-rising": (forge_meta(checkpoints="[256, 256]"), "checkpoints"),
    "committed-off-grid": (forge_meta(committed="319"), "off the grid"),
    "committed-past-ids": (forge_meta(committed="384"), "exceeds"),
    "committed-without-rows": (forge_meta(committed="256"), "layers.3.k"),
    "marks-below-committed": (forge_meta(marks="[64]"), "marks"),
    "v-with-fewer-rows": (forge_tensor(_short_v), "layers.3.v"),
    "ids-shorter-than-committed": (forge_tensor(_short_ids), "exceeds"),
    "id-past-the-vocabulary": (forge_tensor(_id_past_vocab), "vocabulary"),
    "negative-id": (forge_tensor(_negative_id), "vocabulary"),
    "extra-checkpoint-tensors": (forge_tensor(_extra_checkpoint), "unexpected"),
    "missing-tensor": (forge_tensor(_missing_tensor), "missing"),
    "offsets-overlap": (_overlap, "overlap or leave a gap"),
    "repeated-key": (_repeated_key, "repeats a key"),
    "format-version-1": (_version_1, "format version '1', this build reads 2 and 3"),
    "block-digests-one-short": (lambda d, t: forge_meta(blocks_sha256=split(d)[0]["blocks_sha256"][64:])(d, t),
                                "block digests for"),
    "block-digests-of-another-size": (_blocks_of_another_size, "block digests for"),
    "another-format": (forge_meta(format="other"), "not a shadow session file"),
}

GARBAGE = {  # metadata values, each signed: digests valid, the value refused
    "rollbacks-not-integer": dict(rollbacks="x"),
    "rollbacks-negative": dict(rollbacks="-1"),
    "rollbacks-float": dict(rollbacks="1.5"),
    "rollbacks-padded": dict(rollbacks="01"),
    "ids-reread-empty": dict(ids_reread=""),
    "tokens-garbage": dict(tokens="zz"),
    "committed-exponent": dict(committed="3.2e2"),
    "grid-zero": dict(grid="0"),
    "name-missing": dict(name=None),
    "unknown-field": dict(extra="1"),
    "checkpoints-floats": dict(checkpoints="[256.0]"),
    "checkpoints-bool": dict(checkpoints="[true]"),
    "checkpoints-object": dict(checkpoints="{}"),
    "checkpoints-not-json": dict(checkpoints="[256"),
    "checkpoint-at-zero": dict(checkpoints="[0]"),
    "marks-not-a-list": dict(marks="384"),
    "last-use-nan": dict(last_use="nan"),
    "last-use-infinite": dict(last_use="inf"),
    "last-use-text": dict(last_use="yesterday"),
    "data-digest-of-format-2": dict(data_sha256="0" * 64),
    "block-digests-not-hex": dict(blocks_sha256="z" * 64 * 13),
    "block-bytes-unaligned": dict(block_bytes="5000"),
    "block-bytes-zero": dict(block_bytes="0"),
    "block-bytes-huge": dict(block_bytes=str(1 << 40)),
    "keyed-digest-not-hex": dict(header_hmac="z" * 64),
}


@pytest.mark.parametrize("kind", list(FORGED))
def test_forged_fields_with_valid_digests_are_refused(original, reader, tmp_path, kind):
    data, _, name = original
    forge, reason = FORGED[kind]
    path = place(tmp_path, forge(data, tmp_path), name)
    with pytest.raises(SessionFileError, match=reason):
        load(path, reader)


def test_the_forger_here_writes_what_the_reader_accepts(original, reader, tmp_path):
    """The forging helpers re-sign an unchanged file into one that restores bit-equal, so each
    refusal above is about the field it changed, not the signing."""
    data, want, name = original
    meta, entries, body = split(data)
    assert_same(fingerprint(load(place(tmp_path, sign(meta, entries, body), name), reader)), want)
    assert_same(fingerprint(load(place(tmp_path, rebuild(meta, tensors_of(data, tmp_path)), name), reader)), want)


@pytest.mark.parametrize("kind", list(GARBAGE))
def test_metadata_garbage_is_refused_moved_aside_and_never_raises(original, reader, tmp_path, kind):
    data, _, name = original
    path = place(tmp_path, forge_meta(**GARBAGE[kind])(data, tmp_path), name)
    with pytest.raises(SessionFileError):
        read_fields(path)
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    assert store.status() == [] and store.names() == []  # the listing skips it, for everyone
    assert store.totals()["files"] == 1
    rows = check_folder(tmp_path)
    assert len(rows) == 1 and not rows[0].valid and rows[0].reason
    s = store.get("a")  # a request: the file is refused, the session starts over
    assert s.committed == 0 and s.ids == []
    assert len(store.counters.rejected) == 1 and not path.exists()
    assert path.with_name(name + ".rejected").exists()
    store._resident.clear()
    store.get("a")  # asked again: nothing left to report
    assert len(store.counters.rejected) == 1


def test_a_file_refused_that_cannot_be_moved_aside_is_reported_once(original, reader, tmp_path):
    data, _, name = original
    path = place(tmp_path, forge_meta(rollbacks="x")(data, tmp_path), name)
    (tmp_path / (name + ".rejected")).mkdir()  # a folder where the file would go: the rename fails
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    for _ in range(3):
        store._resident.clear()
        assert store.get("a").committed == 0
    assert len(store.counters.rejected) == 1 and path.exists()
    assert "moving" in store.totals()["last_error"]


def test_files_stay_plain_safetensors_and_ids_read_verified(original, tmp_path):
    data, want, name = original
    path = place(tmp_path, data, name)
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("ids"), want["ids"])
    assert read_ids(path) == ("a", want["ids"].tolist())
    place(tmp_path, forge_tensor(_id_past_vocab)(data, tmp_path), name)
    assert read_ids(path)[1][5] == 248320  # no model, no vocabulary: only the bytes are verified
    place(tmp_path, data[:-1] + bytes([data[-1] ^ 1]), name)
    with pytest.raises(SessionFileError, match="data digest"):
        read_ids(path)


def test_flips_at_every_block_of_the_data_are_refused_before_the_block_is_used(original, reader, tmp_path):
    """A byte changed in any block, the first and last bytes of each included: refused with the
    block named."""
    data, _, name = original
    meta, _, body = split(data)
    start, count = len(data) - len(body), len(meta["blocks_sha256"]) // 64
    path = tmp_path / name
    for k in range(count):
        for at in {start + k * BLOCK, start + min(len(body), (k + 1) * BLOCK) - 1}:
            path.write_bytes(data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :])
            with pytest.raises(SessionFileError, match=f"data digest mismatch \\(block {k + 1} of {count}"):
                load(path, reader)


def test_a_file_torn_mid_write_is_never_served(original, reader, tmp_path):
    """What a writer killed mid-write could leave, were it ever renamed into place: blocks up to
    some point written and the rest missing (zeros, or cut), or everything but the header (the
    header is written last). Each is refused."""
    data, _, name = original
    meta, _, body = split(data)
    start = len(data) - len(body)
    path = tmp_path / name
    cuts = sorted({start + k * BLOCK + d for k in range(-(-len(body) // BLOCK)) for d in (0, 1, BLOCK // 2)} - {len(data)})
    for at in [a for a in cuts if a < len(data)]:
        for torn in (data[:at] + bytes(len(data) - at), data[:at]):
            if torn == data:
                continue
            path.write_bytes(torn)
            with pytest.raises(SessionFileError, match="data digest mismatch|truncated|tensors hold"):
                load(path, reader)
    path.write_bytes(bytes(start) + data[start:])
    with pytest.raises(SessionFileError, match="not safetensors"):
        load(path, reader)


def test_format_2_files_of_the_earlier_version_still_restore_bit_equal(original, reader, tmp_path, monkeypatch):
    """A file as the earlier version wrote it (one digest over the data) restores bit for bit,
    read in several blocks; a changed byte is refused; a store with a key refuses it."""
    monkeypatch.setattr(sessionfile, "BLOCK_BYTES", BLOCK)
    data, want, name = original
    meta, entries, body = split(data)
    old = sign_format_2(meta, entries, body)
    path = place(tmp_path, old, name)
    assert read_fields(path).version == 2
    assert_same(fingerprint(load(path, reader)), want)
    assert read_ids(path) == ("a", want["ids"].tolist())
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    assert_same(fingerprint(store.get("a")), want)
    assert store.counters.restores == 1 and not store.counters.rejected
    path = place(tmp_path, old[:-5] + bytes([old[-5] ^ 1]) + old[-4:], name)
    with pytest.raises(SessionFileError, match="data digest mismatch"):
        load(path, reader)
    path = place(tmp_path, old, name)
    with pytest.raises(SessionFileError, match="format version 2 has no keyed digest"):
        load(path, reader, KEY)


# files planted by someone without the key -----------------------------------------------------


def _nan_in_v(t, meta):
    t["layers.3.v"][0, 5, 0] = float("nan")


def _ids_changed_under_the_state(t, meta):
    t["ids"][7] = (t["ids"][7] + 1) % 248044


def _counters_changed(t, meta):
    meta.update(rollbacks="7", ids_reread="99")


PLANTED = {"nan-in-v": _nan_in_v, "ids-changed": _ids_changed_under_the_state, "counters-changed": _counters_changed}


@pytest.mark.parametrize("kind", list(PLANTED))
def test_a_planted_file_is_refused_with_the_key_and_accepted_without(keyed, reader, tmp_path, kind):
    """Edited content with every plain digest valid (the keyed one kept, or zeroed): a reader
    without a key accepts it, as it must (the plain digests protect against damage, not against
    forgery); a reader with the key refuses it, and so does a store with the key."""
    data, want, name = keyed
    path = place(tmp_path, forge_tensor(PLANTED[kind])(data, tmp_path), name)
    got = load(path, reader)  # no key: every digest matches, the planted state is read
    if kind == "nan-in-v":
        assert torch.isnan(got.state.tensors()["layers.3.v"]).any()
    elif kind == "ids-changed":
        assert got.ids[7] != want["ids"][7].item()
    else:
        assert (got.rollbacks, got.ids_reread) == (7, 99)
    with pytest.raises(SessionFileError, match="keyed digest mismatch"):
        load(path, reader, KEY)
    meta, entries, body = split(path.read_bytes())
    unkeyed = place(tmp_path, sign(meta | {"header_hmac": "0" * 64}, entries, body, meta["blocks_sha256"]), name)
    load(unkeyed, reader)
    with pytest.raises(SessionFileError, match="written without a key"):
        load(unkeyed, reader, KEY)
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path, key=KEY)
    assert store.status() == [] and store.names() == []  # listings skip it
    assert not check_folder(tmp_path, key=KEY)[0].valid and check_folder(tmp_path)[0].valid
    s = store.get("a")
    assert s.committed == 0 and s.ids == [] and "written without a key" in store.counters.rejected[0][1]


def test_keyed_files_restore_with_their_key_only(keyed, original, reader, tmp_path):
    """A store's keyed file restores bit for bit with its key (and, unkeyed, is still read: the
    plain digests are all valid); another key, or a key against an unkeyed file, is refused. The
    signer here makes, from the format's definition, the digest the store makes."""
    data, want, name = keyed
    path = place(tmp_path, data, name)
    assert_same(fingerprint(load(path, reader, KEY)), want)
    assert_same(fingerprint(load(path, reader)), want)
    with pytest.raises(SessionFileError, match="keyed digest mismatch"):
        load(path, reader, b"another key")
    meta, entries, body = split(data)
    assert sign(meta | {"header_hmac": "0" * 64}, entries, body, key=KEY) == data
    place(tmp_path, original[0], name)
    with pytest.raises(SessionFileError, match="written without a key"):
        load(path, reader, KEY)
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path, key=KEY)
    s = store.get("a")
    assert s.committed == 0 and len(store.counters.rejected) == 1


# file modes -------------------------------------------------------------------------------------


def test_files_are_0600_and_a_folder_the_store_creates_0700(reader, tmp_path, monkeypatch, caplog):
    old = os.umask(0o022)
    try:
        folder = tmp_path / "made" / "store"
        store = SessionStore(reader, "h", cap_gib=0, disk=folder)
        modes = []
        real = blockio.pwrite_all

        def watched(fd, view, offset):
            modes.append(stat.S_IMODE(os.fstat(fd).st_mode))  # the temporary file, while it is written
            real(fd, view, offset)

        monkeypatch.setattr(blockio, "pwrite_all", watched)
        fed(store, reader, "a")
        fed(store, reader, "b", seed=3)
        store.settle(keep="b")
        assert store.close() == []
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = list(folder.iterdir())
    assert len(files) == 2 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert modes and set(modes) == {0o600}
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    with caplog.at_level("WARNING", logger="shadow.core.store"):
        SessionStore(reader, "h", cap_gib=0, disk=shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755  # a folder it did not make keeps its mode
    assert any("open to others" in r.getMessage() for r in caplog.records)


# the folder -----------------------------------------------------------------------------------


def test_junk_in_the_folder_never_stops_the_store_and_is_never_deleted(original, reader, tmp_path):
    data, want, name = original
    disk, outside = tmp_path / "disk", tmp_path / "outside"
    disk.mkdir()
    outside.mkdir()
    old = time.time() - 49 * 3600
    target = place(outside, data, "target.safetensors")  # a valid session file, outside the folder
    junk = {
        "model.safetensors": lambda p: (p.write_bytes(b"\x08" + b"\0" * 7 + b'{"w":{}}'), p),
        "notes.txt": lambda p: (p.write_text("x"), p),
        "0123456789abcdef0123456789abcdef.safetensors": lambda p: (p.write_bytes(b"not a session"), p),
        "dangling.safetensors": lambda p: (p.symlink_to(tmp_path / "nowhere"), None),
        "fedcba9876543210fedcba9876543210.safetensors": lambda p: (p.symlink_to(tmp_path / "nowhere"), None),
        "abcdefabcdefabcdefabcdefabcdefab.safetensors": lambda p: (p.symlink_to(target), None),
        "link-to-outside.safetensors": lambda p: (p.symlink_to(target), None),
        "old.safetensors.rejected": lambda p: (p.mkdir(), p),
        "11111111111111111111111111111111.safetensors": lambda p: (p.mkdir(), p),
        "22222222222222222222222222222222.safetensors.rejected": lambda p: (p.mkdir(), p),
        ".33333333333333333333333333333333.safetensors.1.tmp": lambda p: (p.mkdir(), p),
    }
    for entry, make in junk.items():
        _, aged = make(disk / entry)
        if aged is not None:
            os.utime(aged, (old, old))
    os.utime(target, (old, old))
    own_old = place(disk, data, "4" * 32 + ".safetensors")  # the store's own kind of file, 49 h old
    os.utime(own_old, (old, old))
    (disk / name).symlink_to(target)  # a link at the very name of session "a"'s file
    store = SessionStore(reader, "h", cap_gib=0, disk=disk, disk_cap_gib=1e-9)  # every sweep at its limits
    assert not own_old.exists()  # retention still removes the store's own old file
    s = store.get("a")  # the link at its name is not followed: a new session (its spill replaces the link)
    assert s.committed == 0 and not store.counters.rejected
    fed(store, reader, "b", seed=7)
    store.settle(keep="b")  # a spill, then a sweep past a tiny disk cap
    store.status(), store.names(), store.totals(), check_folder(disk), store.close()
    store.sweep()
    for entry in junk:
        assert os.path.lexists(disk / entry), entry
    assert target.read_bytes() == data
    listed = {r.file: r for r in check_folder(disk)}
    foreign = "0123456789abcdef0123456789abcdef.safetensors"  # named as a session file, so listed: invalid
    assert set(listed) & set(junk) == {foreign}  # links, folders and other names are not listed
    assert not listed[foreign].valid and "not safetensors" in listed[foreign].reason


def test_a_models_weights_older_than_48_hours_survive_retention(reader, tmp_path):
    from safetensors.torch import save_file

    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(4)}, weights)
    hexnamed = tmp_path / ("5" * 32 + ".safetensors")  # our naming, but not our file
    save_file({"w": torch.zeros(4)}, hexnamed)
    old = time.time() - 49 * 3600
    for p in (weights, hexnamed):
        os.utime(p, (old, old))
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    store.sweep()
    assert weights.exists() and hexnamed.exists() and store.counters.removed == 0


# a full disk, a failing stop --------------------------------------------------------------------


def fill_disk_after(limit: int):
    """A block write that writes at most `limit` bytes of what it is given, then fails as a full
    disk does."""
    real = blockio.pwrite_all

    def pwrite_all(fd, view, offset):
        real(fd, view[:limit], offset)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return pwrite_all


def test_disk_full_keeps_the_sessions_copy_in_host_memory_and_counted_then_a_later_settle_writes_it(
        reader, tmp_path, monkeypatch):
    """A session leaving for disk waits in host memory for its write (written behind): on a full
    disk the write fails, the copy stays (counted, its error in status), no session leaves for the
    disk before `retry_s`, the old file is untouched, and a later settle writes it, bit for bit."""
    now = [1000.0]
    store = SessionStore(reader, "h", cap_gib=0, disk=tmp_path, clock=lambda: now[0], retry_s=10)
    a = fed(store, reader, "a", seed=1)
    fed(store, reader, "b", seed=2)
    store.settle(keep="b")  # a first spill works: a's file is there
    store.flush()
    a = store.get("a")
    reader.feed_output(a, ids(100, 3))
    reader.advance(a)  # a moves on: its file is now older than its state
    before = fingerprint(a)
    old_file = store.path_of("a").read_bytes()
    store.settle(keep="a")  # b goes out
    store.flush()
    store.get("b")
    monkeypatch.setattr(blockio, "pwrite_all", fill_disk_after(50_000))
    store.settle(keep="b")  # a leaves the device; its write fails
    store.flush()
    assert store.peek("a") is None and store.holds("a")
    assert store.counters.write_failures == 1 and store.counters.drops == 0
    totals = store.totals()
    assert totals["unwritten_sessions"] == 1 and "No space left" in totals["last_error"]
    row = next(r for r in store.status() if r.name == "a")
    assert (row.resident, row.tier, row.moving) == (False, "host", "to disk") and "No space left" in row.write_error
    assert store.path_of("a").read_bytes() == old_file  # the old file, untouched
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no half file left
    fed(store, reader, "c", seed=4)
    store.settle(keep="c")  # too soon: b does not leave for the full disk, a is not tried again
    store.flush()
    assert store.peek("b") is not None and store.counters.write_failures == 1
    now[0] += 10
    store.settle(keep="c")  # still full: a tried again, b leaves, both writes fail
    store.flush()
    assert store.peek("b") is None and store.counters.write_failures == 3 and store.holds("a") and store.holds("b")
    monkeypatch.undo()  # space returns
    store.settle(keep="c")  # too soon again
    store.flush()
    assert store.totals()["unwritten_sessions"] == 2
    now[0] += 10
    store.settle(keep="c")
    store.flush()
    assert store.totals()["unwritten_sessions"] == 0 and {r.name: r.tier for r in store.status()} == \
        {"a": "disk", "b": "disk", "c": "device"}
    back = SessionStore(reader, "h", cap_gib=None, disk=tmp_path).get("a")
    assert_same(fingerprint(back), before)


def test_close_writes_every_session_it_can_and_reports_the_rest(reader, tmp_path, monkeypatch):
    store = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    prints = {n: fingerprint(fed(store, reader, n, seed=i)) for i, n in enumerate("abc")}
    real = store_module.write_session

    def failing_for_b(path, session, *args, **kwargs):
        if session.name == "b":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path, session, *args, **kwargs)

    monkeypatch.setattr(store_module, "write_session", failing_for_b)
    failed = store.close()
    assert [name for name, _ in failed] == ["b"] and "Input/output error" in failed[0][1]
    assert store.peek("b") is not None and store.counters.write_failures == 1
    monkeypatch.undo()
    fresh = SessionStore(reader, "h", cap_gib=None, disk=tmp_path)
    for n in "ac":
        assert_same(fingerprint(fresh.get(n)), prints[n])
    assert not fresh.path_of("b").exists()
    assert store.close() == []  # the stop tried again once the disk answers


# killed writers ---------------------------------------------------------------------------------

KILL_SPILLER = r"""
import sys, torch
from shadow.model import load_model
from shadow.core.reader import Reader
from shadow.core.store import SessionStore
import shadow.core.sessionfile as sessionfile
sessionfile.BLOCK_BYTES = 1 << 20  # ten blocks a file, several in flight when the kill lands
reader = Reader(load_model("tiny").model, 64)
store = SessionStore(reader, "h", cap_gib=0, disk=sys.argv[1])
gen = torch.Generator().manual_seed(0)
for name in "ab":  # a state of 40,000 rows without reading them: random values, the right shapes
    s = store.get(name)
    s.ids = torch.randint(0, 248044, (40000,), generator=gen).tolist()
    for layer in s.state.attention:
        layer.write(0, *torch.randn(2, layer.k.shape[0], 39936, layer.k.shape[2], generator=gen))
    s.state.length = 39936
    s.checkpoints = [s.state.snapshot()]
print("ready", flush=True)
n = 0
while True:  # a and b spill and come back in turn, each write a little different
    for name in "ab":
        store.get(name).rollbacks = n
        store.settle(keep=name)
    n += 1
"""


@pytest.mark.slow
def test_sigkill_during_spills_leaves_no_invalid_file(reader, tmp_path):
    """A process spilling and restoring two sessions in a loop is killed with SIGKILL at varied
    moments until a kill has landed while a file was being replaced (a temporary file beside the
    session files); every time, each file there is valid and restores."""
    mid_write = 0
    for attempt in range(24):
        folder = tmp_path / f"kill{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", KILL_SPILLER, str(folder)], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3 + 0.043 * (attempt % 10))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        names = [p.name for p in folder.iterdir()]
        mid_write += any(n.endswith(".tmp") for n in names) and any(n.endswith(".safetensors") for n in names)
        rows = check_folder(folder, reader, "h")
        assert all(r.valid for r in rows), rows
        store = SessionStore(reader, "h", cap_gib=None, disk=folder)
        for r in rows:
            s = store.get(r.session)
            assert s.committed == 39936 and len(s.ids) == 40000
        assert not store.counters.rejected
        if mid_write and attempt >= 2:
            break
    assert mid_write, "no kill landed during a write; the test proved nothing"


def test_sizes_of_a_real_file_are_what_the_header_says(original):
    """The header's offsets tile the data exactly, 8-byte tensors first (aligned reads)."""
    data, _, _ = original
    meta, entries, body = split(data)
    spans = sorted((e["data_offsets"][0], e["data_offsets"][1], e["dtype"]) for e in entries.values())
    assert spans[0][0] == 0 and spans[-1][1] == len(body)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[0][2] == "I64" and (8 + int.from_bytes(data[:8], "little")) % 4096 == 0
    assert meta["version"] == "3" and math.prod(entries["ids"]["shape"]) == 340
    assert len(meta["blocks_sha256"]) == 64 * -(-len(body) // int(meta["block_bytes"]))
