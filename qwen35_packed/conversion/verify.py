"""Per-tensor checksums of checkpoint folders, and `convert --verify A B`.

A tensor's checksum is the SHA-256 of its raw bytes as stored in the safetensors file, next to its dtype and shape:
two folders hold bit-identical weights exactly when every key has the same (dtype, shape, sha256). The bytes are
read straight from the file in bounded chunks (the header gives each tensor's byte range), so checking costs no
more memory than a chunk, whatever the model size, and needs no dtype support from torch.

MoE experts stored one by one (transformers' `save_pretrained`) in one folder and fused in the other are compared
as `convert` maps them: a fused tensor's bytes are the per-expert tensors' bytes in `FuseExperts`' order, so the
checksum of the fused tensor they make is computed from the stored bytes, without building it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import ConversionError
from .rules import DTYPE_SIZES, LazyTensor, fused_view

CHUNK = 16 * 2**20
MAX_HEADER = 100 * 2**20  # safetensors' own limit


@dataclass(frozen=True)
class TensorDigest:
    dtype: str
    shape: tuple[int, ...]
    sha256: str


def read_header(path: Path) -> tuple[dict, int]:
    """(header without `__metadata__`, offset of the data section) of a safetensors file, fully checked."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise ConversionError(f"{path.name}: {size} bytes, too short for a safetensors file (truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise ConversionError(f"{path.name}: header length {n} does not fit the file of {size} bytes (truncated?)")
        try:
            header = json.loads(handle.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{path.name}: the header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ConversionError(f"{path.name}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    ranges = []
    for key, info in header.items():
        try:
            start, end = (int(v) for v in info["data_offsets"])
            dtype, shape = info["dtype"], [int(s) for s in info["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConversionError(f"{path.name}: bad header entry for {key!r}") from exc
        if end > data_size:
            raise ConversionError(
                f"{path.name}: {key!r} ends at byte {end} of the data section, which has {data_size} bytes (truncated)"
            )
        expected = DTYPE_SIZES.get(dtype, 0) * _prod(shape)
        if dtype in DTYPE_SIZES and end - start != expected:
            raise ConversionError(f"{path.name}: {key!r} has {end - start} bytes, {dtype} {shape} needs {expected}")
        ranges.append((start, end, key))
    # The tensors tile the data section (as safetensors requires): overlapping or gapped byte ranges mean a damaged
    # header, whose checksums would describe bytes no reader sees as those tensors.
    position = 0
    for start, end, key in sorted(ranges):
        if start != position or end < start:
            raise ConversionError(
                f"{path.name}: {key!r} occupies bytes [{start}, {end}) of the data section, but the previous tensor "
                f"ends at {position} (overlapping or gapped tensors: damaged header)"
            )
        position = end
    return header, 8 + n


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def shard_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return sorted(set(weight_map.values()))
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    names = sorted(p.name for p in folder.glob("*.safetensors"))
    if not names:
        raise ConversionError(f"{folder} holds no safetensors files")
    return names


@dataclass(frozen=True)
class _StoredTensor:
    path: Path
    offset: int  # of the first byte in the file
    size: int
    info: TensorDigest  # dtype and shape (sha256 unset)


def _stored_tensors(folder) -> dict[str, _StoredTensor]:
    """`key -> where its bytes are` over every shard of a checkpoint folder (headers only)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConversionError(f"{folder} is not a folder")
    stored: dict[str, _StoredTensor] = {}
    for name in shard_files(folder):
        path = folder / name
        if not path.is_file():
            raise ConversionError(f"{folder}: the index names {name}, which does not exist")
        header, base = read_header(path)
        for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            if key in stored:
                raise ConversionError(f"{folder}: {key!r} is stored twice")
            start, end = info["data_offsets"]
            stored[key] = _StoredTensor(
                path, base + start, end - start, TensorDigest(info["dtype"], tuple(info["shape"]), "")
            )
    return stored


def _sha256(pieces: list[_StoredTensor]) -> str:
    """SHA-256 of the pieces' bytes one after another, read in bounded chunks."""
    h = hashlib.sha256()
    for piece in pieces:
        with open(piece.path, "rb") as handle:
            handle.seek(piece.offset)
            remaining = piece.size
            while remaining:
                chunk = handle.read(min(CHUNK, remaining))
                if not chunk:
                    raise ConversionError(f"{piece.path.name}: unexpected end of file (truncated)")
                h.update(chunk)
                remaining -= len(chunk)
    return h.hexdigest()


def _digests(stored: dict[str, _StoredTensor], fused_keys=()) -> dict[str, TensorDigest]:
    """`key -> TensorDigest`; per-expert groups whose fused keys are among `fused_keys` are digested as the fused
    tensors `convert` writes from them. Fusing stacks the experts along the first dimension and puts gate before
    up in each: the fused tensor's bytes are the per-expert tensors' bytes in the order `FuseExperts` takes them,
    so its checksum is computed from the stored bytes without building it."""
    sources = {key: LazyTensor.source(key, t.info.shape, t.info.dtype) for key, t in stored.items()}
    try:
        view = fused_view(sources, fused_keys)
    except ConversionError:  # an incomplete group: compared per expert, its keys then differ
        view = sources
    digests = {}
    for key, node in view.items():
        pieces = [node] if node.op == "source" else list(node.inputs)
        if not all(piece.op == "source" for piece in pieces):
            raise AssertionError(f"{key}: a fused view of nested operations ({node.op})")
        digests[key] = TensorDigest(node.dtype, node.shape, _sha256([stored[piece.key] for piece in pieces]))
    return digests


def folder_digests(folder) -> dict[str, TensorDigest]:
    """`key -> TensorDigest` over every shard of a checkpoint folder (streamed, bounded memory)."""
    return _digests(_stored_tensors(folder))


def combined_digest(digests: dict[str, TensorDigest]) -> str:
    """One SHA-256 over the sorted (key, dtype, shape, sha256) list: equal exactly when the tensor sets are equal."""
    h = hashlib.sha256()
    for key in sorted(digests):
        d = digests[key]
        h.update(f"{key}\t{d.dtype}\t{list(d.shape)}\t{d.sha256}\n".encode())
    return h.hexdigest()


@dataclass
class VerifyResult:
    a: str
    b: str
    tensors_a: int
    tensors_b: int
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)  # "key: what differs"
    digest_a: str = ""
    digest_b: str = ""
    # per-expert tensors of A / B compared as the fused tensors of the other folder (what `convert` writes)
    fused_a: tuple[int, int] = (0, 0)  # (per-expert tensors, fused tensors they make)
    fused_b: tuple[int, int] = (0, 0)

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.different)

    def lines(self) -> list[str]:
        out = [
            f"A {self.a}: {self.tensors_a} tensors, digest {self.digest_a[:16]}",
            f"B {self.b}: {self.tensors_b} tensors, digest {self.digest_b[:16]}",
        ]
        for side, (per_expert, fused) in (("A", self.fused_a), ("B", self.fused_b)):
            if per_expert:
                out.append(
                    f"{side} stores experts one by one: its {per_expert} per-expert tensors are compared as the "
                    f"{fused} fused tensors `convert` makes of them (the other folder stores those fused)"
                )
        for title, items in (("only in A", self.only_in_a), ("only in B", self.only_in_b),
                             ("different", self.different)):  # fmt: skip
            if items:
                more = f" ... and {len(items) - 10} more" if len(items) > 10 else ""
                out.append(f"{title} ({len(items)}): " + ", ".join(items[:10]) + more)
        if self.identical:
            out.append(f"identical: the same {self.tensors_a} keys, each with the same dtype, shape and bytes (sha256)")
        else:
            out.append("NOT identical")
        return out

    def to_json(self, digests_a: dict[str, TensorDigest]) -> dict:
        data = asdict(self)
        data["identical"] = self.identical
        data["checksums"] = {k: {"dtype": d.dtype, "shape": list(d.shape), "sha256": d.sha256}
                             for k, d in sorted(digests_a.items())}  # fmt: skip
        return data


def verify_folders(a, b) -> tuple[VerifyResult, dict[str, TensorDigest]]:
    """Compare the tensors of two checkpoint folders by (dtype, shape, sha256); configs are not compared. MoE experts
    stored one by one in one folder and fused in the other are compared as `convert` maps them: the per-expert
    tensors as the fused ones they make. Returns the result and A's digests as compared."""
    sa, sb = _stored_tensors(a), _stored_tensors(b)
    da, db = _digests(sa, fused_keys=sb), _digests(sb, fused_keys=sa)
    result = VerifyResult(str(a), str(b), len(da), len(db), digest_a=combined_digest(da), digest_b=combined_digest(db))
    result.fused_a = (len(set(sa) - set(da)), len(set(da) - set(sa)))
    result.fused_b = (len(set(sb) - set(db)), len(set(db) - set(sb)))
    result.only_in_a = sorted(set(da) - set(db))
    result.only_in_b = sorted(set(db) - set(da))
    for key in sorted(set(da) & set(db)):
        x, y = da[key], db[key]
        if x.dtype != y.dtype:
            result.different.append(f"{key}: dtype {x.dtype} vs {y.dtype}")
        elif x.shape != y.shape:
            result.different.append(f"{key}: shape {list(x.shape)} vs {list(y.shape)}")
        elif x.sha256 != y.sha256:
            result.different.append(f"{key}: bytes differ")
    return result, da


__all__ = ["TensorDigest", "VerifyResult", "combined_digest", "folder_digests", "read_header", "verify_folders"]
