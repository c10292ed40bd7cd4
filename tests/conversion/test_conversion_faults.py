"""Fault injection in `convert`: the process killed or interrupted at points spread over the whole run, a full
disk, damaged safetensors headers, inconsistent shard indexes.

Invariant for every fault: SRC is untouched (same files, same bytes); OUT is either absent or complete (the same
tensors, bit for bit, and the same files as an undisturbed conversion); what is left besides is only a hidden
`.OUT.tmp-*` folder without config.json (after SIGKILL; the next run names it); and the error says what happened.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures_conversion import add_side_files, build_builtin, folder_digest
from safetensors.torch import load_file, save_file

from qwen35_packed.cli import main
from qwen35_packed.conversion import ConversionError, convert
from qwen35_packed.conversion.verify import folder_digests, verify_folders

ROOT = Path(__file__).resolve().parents[2]
QUIET = dict(progress=False, log=lambda *_: None)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(SRC: a dense checkpoint in 4 shards with side files, REF: its undisturbed conversion)."""
    base = tmp_path_factory.mktemp("faults")
    src = base / "src"
    build_builtin("dense", seed=7).save_pretrained(src, max_shard_size="60KB")
    add_side_files(src)
    assert len(list(src.glob("*.safetensors"))) >= 3
    ref = base / "ref"
    convert(src, ref, max_shard_size="100KB", **QUIET)
    return src, ref


def assert_absent_or_complete(out: Path, ref: Path, *, leftover_allowed: bool) -> bool:
    """The invariant on OUT and its surroundings; returns whether OUT exists."""
    leftovers = sorted(out.parent.glob(f".{out.name}.tmp-*"))
    if leftover_allowed:
        assert len(leftovers) <= 1 and not any((p / "config.json").exists() for p in leftovers), leftovers
    else:
        assert leftovers == [], leftovers
    if not out.exists():
        return False
    result, _ = verify_folders(out, ref)
    assert result.identical, result.lines()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert (out / "config.json").read_text() == (ref / "config.json").read_text()
    return True


# ------------------------------------------------------------------------------------ killed at any point of the run

# Runs `qwen35-packed convert SRC OUT_i` once per fault point in a forked child. The child counts the lines executed
# in qwen35_packed/conversion/ (sys.settrace) and at the chosen count either SIGKILLs itself (nothing runs after
# it) or raises KeyboardInterrupt there, exactly what the CLI's SIGTERM handler does at that point.
# A first child only counts: the line where write_conversion starts and the total.
FAULT_DRIVER = r"""
import json, os, signal, sys
from pathlib import Path
import qwen35_packed.cli as cli
import qwen35_packed.conversion as conversion

src, base, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
package = str(Path(conversion.__file__).parent) + "/"
watched = lambda path: path.startswith(package)

def run(out, stop_at, counts):
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    fd = os.open(str(out) + ".stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    state = {"n": 0, "write_at": None}

    def local(frame, event, arg):
        if event == "line":
            state["n"] += 1
            if state["n"] == stop_at:
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if not watched(frame.f_code.co_filename):
            return None
        if frame.f_code.co_name == "write_conversion" and state["write_at"] is None:
            state["write_at"] = state["n"]
        return local

    sys.settrace(tracer)
    code = cli.main(["convert", src, str(out), "--no-progress", "--max-shard-size", "100KB"])
    sys.settrace(None)
    if counts:
        Path(counts).write_text(json.dumps(state))
    os._exit(code)

counts = base / "counts.json"
assert run(base / "count_run", None, str(counts)) == 0
state = json.loads(counts.read_text())
n, w = state["n"], state["write_at"]
# 3 points while planning, 12 spread over writing (jittered), the last lines (rename, cleanup, return)
points = sorted({max(1, n_ * w // 4) for n_ in (1, 2, 3)} | {w + (k * (n - w)) // 12 + (7 * k) % 5 for k in range(12)}
                | {n - 3, n - 2, n - 1, n})
results = []
for i, stop in enumerate(points):
    status = run(base / f"out{i}", stop, None)
    results.append({"out": f"out{i}", "stop": stop, "status": status})
print(json.dumps({"lines": n, "write_at": w, "results": results}))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("mode", ["kill", "interrupt"], ids=["SIGKILL", "SIGTERM"])
def test_fault_at_any_point_leaves_out_absent_or_complete(mode, source, tmp_path, capsys):
    src, ref = source
    before = folder_digest(src)
    proc = subprocess.run([sys.executable, "-c", FAULT_DRIVER, str(src), str(tmp_path), mode], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["write_at"] and report["lines"] > report["write_at"]
    complete = said_nothing = 0
    for result in report["results"]:
        out = tmp_path / result["out"]
        err = Path(str(out) + ".stderr").read_text()
        if mode == "kill":
            assert os.WIFSIGNALED(result["status"]) and os.WTERMSIG(result["status"]) == 9, result
        else:
            assert os.WIFEXITED(result["status"]) and os.WEXITSTATUS(result["status"]) == 130, (result, err)
            assert "interrupted" in err and "Traceback" not in err, err
        exists = assert_absent_or_complete(out, ref, leftover_allowed=mode == "kill")
        complete += exists
        if mode == "interrupt":  # never a false claim; interrupts inside convert() say what they left
            assert ("OUT is complete" in err or f"wrote {out}" in err) == exists, (result, err)
            said_nothing += "nothing was written to OUT" in err
        assert folder_digest(src) == before
        if not exists:  # the same command again succeeds (and names a leftover of a killed run)
            leftover = any(tmp_path.glob(f".{out.name}.tmp-*"))
            capsys.readouterr()
            assert main(["convert", str(src), str(out), "--no-progress", "--max-shard-size", "100KB"]) == 0
            assert_absent_or_complete(out, ref, leftover_allowed=True)
            if leftover:
                assert "temporary folder(s) of an interrupted conversion" in capsys.readouterr().out
    assert 0 < complete < len(report["results"])  # faults both before and after the rename were injected
    if mode == "interrupt":
        assert said_nothing >= len(report["results"]) - complete - 1, said_nothing
    print(f"{mode}: {len(report['results'])} fault points over {report['lines']} lines, {complete} after the rename")


# ------------------------------------------------------------------------------------------------------- full disk

FULL_DISK = r"""
import resource, signal, sys
from qwen35_packed.cli import main

# A file-size limit stands in for a full disk (mounting a small tmpfs needs privileges CI lacks): with SIGXFSZ
# ignored, a write past the limit fails with EFBIG, as one on a full disk fails with ENOSPC.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.exit(main(["convert", sys.argv[1], sys.argv[2], "--no-progress", "--max-shard-size", sys.argv[4]]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE semantics of Linux")
@pytest.mark.parametrize("where", ["first_shard", "later_shard"])
def test_full_disk_is_a_clean_error(where, source, tmp_path):
    """The write that does not fit fails; the conversion says so (exit status 2, no traceback), removes its
    temporary folder and leaves no OUT."""
    src, ref = source
    before = folder_digest(src)
    # shard sizes in write order (model-00001-of-N, ...); a limit that the first ones fit and a later one does not
    sizes = [p.stat().st_size for p in sorted(ref.glob("model-*.safetensors"))]
    later = next(j for j in range(1, len(sizes)) if sizes[j] > max(sizes[:j]))
    limit = 1 if where == "first_shard" else max(sizes[:later])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(src), str(out), str(limit), "100KB"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "File too large" in proc.stderr and "is the disk full" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "nothing was written to OUT" in proc.stderr, proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert folder_digest(src) == before


@pytest.mark.skipif(sys.platform != "linux", reason="tmpfs")
def test_full_tmpfs_is_a_clean_error(source, tmp_path):
    """A real full disk where the tests may mount a small tmpfs (root with CAP_SYS_ADMIN; skipped elsewhere): the
    write fails with ENOSPC, OUT is not created and the temporary folder is removed, leaving the disk empty."""
    src, _ = source
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs privileges); the RLIMIT_FSIZE test above stands in")
    try:
        before = folder_digest(src)
        with pytest.raises(ConversionError, match="No space left on device(.|\n)*nothing was written to OUT"):
            convert(src, disk / "out", max_shard_size="100KB", **QUIET)
        assert list(disk.iterdir()) == []
        assert folder_digest(src) == before
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# ------------------------------------------------------------------------------------------ damaged safetensors files


def _rewrite_header(path: Path, change) -> None:
    """Apply `change(header dict)` to a safetensors header; the data section stays as it is."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the 8-byte alignment safetensors writes
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


DAMAGE = {
    "empty_file": lambda p: p.write_bytes(b""),
    "header_length_past_the_end": lambda p: p.write_bytes(struct.pack("<Q", 2**40) + p.read_bytes()[8:]),
    "header_not_json": lambda p: p.write_bytes(p.read_bytes()[:8] + b"\xff" * 16 + p.read_bytes()[24:]),
    "cut_inside_the_header": lambda p: p.write_bytes(p.read_bytes()[:40]),
    "offsets_past_the_data": lambda p: _rewrite_header(
        p, lambda h: h[_first_tensor(h)].update(data_offsets=[0, p.stat().st_size])
    ),
    "shape_larger_than_its_bytes": lambda p: _rewrite_header(
        p, lambda h: h[_first_tensor(h)].update(shape=[s * 2 for s in h[_first_tensor(h)]["shape"]])
    ),
    "overlapping_tensors": lambda p: _rewrite_header(p, _overlap),
    "unknown_dtype": lambda p: _rewrite_header(p, lambda h: h[_first_tensor(h)].update(dtype="Q7")),
}


def _overlap(header: dict) -> None:
    """The second tensor's byte range starts inside the first's (both keep their sizes)."""
    keys = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    a, b = header[keys[0]], header[keys[1]]
    size = b["data_offsets"][1] - b["data_offsets"][0]
    start = a["data_offsets"][0] + 4
    b["data_offsets"] = [start, start + size]


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_shard_is_a_clean_error(damage, source, tmp_path, capsys):
    src = _copy(source[0], tmp_path / "src")
    names = list(_index(src)["weight_map"].values())
    shard = src / max(sorted(set(names)), key=names.count)  # one holding several tensors
    DAMAGE[damage](shard)
    before = folder_digest(src)
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert shard.name in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert folder_digest(src) == before
    if damage != "unknown_dtype":  # checksums are of raw bytes: `convert --verify` needs no dtype it knows
        with pytest.raises(ConversionError, match=shard.name):
            folder_digests(src)  # `convert --verify` refuses it too


# --------------------------------------------------------------------------------------------- inconsistent indexes


def _index(src: Path) -> dict:
    return json.loads((src / "model.safetensors.index.json").read_text())


def _write_index(src: Path, index: dict) -> None:
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _missing_shard(src: Path) -> None:
    index = _index(src)
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "model-00009-of-00009.safetensors"
    _write_index(src, index)


def _duplicate_across_shards(src: Path) -> None:
    """One tensor stored in a second shard too (the index names only the first)."""
    index = _index(src)
    key, home = next(iter(index["weight_map"].items()))
    other = src / next(n for n in sorted(set(index["weight_map"].values())) if n != home)
    tensors = load_file(other)
    tensors[key] = load_file(src / home)[key]
    save_file(tensors, str(other), metadata={"format": "pt"})


def _shard_outside_src(src: Path) -> None:
    """The index names a shard by a path that leaves SRC (the file exists there, a copy of a real shard)."""
    index = _index(src)
    name = index["weight_map"][next(iter(index["weight_map"]))]
    outside = src.parent / "elsewhere"
    outside.mkdir()
    (outside / name).write_bytes((src / name).read_bytes())
    index["weight_map"] = {k: (f"../elsewhere/{v}" if v == name else v) for k, v in index["weight_map"].items()}
    _write_index(src, index)


def _unlisted_tensor(src: Path) -> None:
    """A tensor stored in a listed shard but missing from the index (shards the index never names are ignored, as
    transformers ignores them)."""
    index = _index(src)
    names = list(index["weight_map"].values())
    key = next(k for k, v in index["weight_map"].items() if names.count(v) > 1)
    del index["weight_map"][key]
    _write_index(src, index)


def _wrong_shard_named(src: Path) -> None:
    index = _index(src)
    names = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == names[0])
    index["weight_map"][key] = names[1]
    _write_index(src, index)


INDEX_FAULTS = {
    "missing_shard": (_missing_shard, "names shard files that do not exist: ['model-00009-of-00009.safetensors']"),
    "duplicate_across_shards": (_duplicate_across_shards, "is stored twice in SRC"),
    "shard_outside_src": (_shard_outside_src, "names a shard outside SRC"),
    "unlisted_tensor": (_unlisted_tensor, "1 stored tensors not in the index"),
    "wrong_shard_named": (_wrong_shard_named, "1 listed tensors not found where the index says"),
    "index_not_json": (lambda s: (s / "model.safetensors.index.json").write_text("{"), "is not valid JSON"),
}


@pytest.mark.parametrize("fault", sorted(INDEX_FAULTS))
def test_inconsistent_index_is_a_clean_error(fault, source, tmp_path, capsys):
    src = _copy(source[0], tmp_path / "src")
    make, message = INDEX_FAULTS[fault]
    make(src)
    before = folder_digest(src)
    out = tmp_path / "out"
    assert main(["convert", str(src), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    assert folder_digest(src) == before
