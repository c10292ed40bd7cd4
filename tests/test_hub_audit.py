"""hub_upload.py against random folder contents: whatever a training run leaves next to a model (symlinks to files
in or outside the folder, hidden files, caches, credential-like names, FIFOs, stale shards, a token pasted into an
allowed file), the upload holds only allow-listed regular files of the folder itself, every other entry is listed
as left out with a reason, and the token is never printed."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from pathlib import Path
from unittest import mock

import pytest
from fixtures_hub import SECRET, RecordingApi, packed  # noqa: F401 (the module-scoped converted folder)
from hypothesis import given
from hypothesis import strategies as st
from properties import property_settings

from qwen35_packed import hub

ALLOWED = sorted({*hub.CONFIG_FILES, *hub.TOKENIZER_FILES, *hub.PROCESSOR_FILES, "LICENSE", hub.REPORT_NAME})
# config.json / adapter_config.json decide what the folder is and the report is validated: not replaced at random
RANDOM_ALLOWED = sorted(set(ALLOWED) - {"config.json", "adapter_config.json", hub.REPORT_NAME})
CREDENTIAL_LIKE = ["token", "hf_token.txt", "credentials.json", "secrets.yaml", "api_key.txt", "my-api-key",
                   "wandb.netrc"]  # fmt: skip
HIDDEN = [".env", ".git", ".huggingface", ".cache", ".token", ".config.json"]
JUNK = ["notes.txt", "optimizer.pt", "training_args.bin", "helper.py", "rng_state.pth", "pytorch_model.bin",
        "model-00009-of-00009.safetensors", "checkpoint-100", "__pycache__", "runs"]  # fmt: skip
KINDS = ["file", "symlink_inside", "symlink_outside", "folder", "fifo", "file_with_token"]
entry = st.tuples(st.sampled_from(RANDOM_ALLOWED + CREDENTIAL_LIKE + HIDDEN + JUNK), st.sampled_from(KINDS))


def _make(folder: Path, outside: Path, name: str, kind: str) -> None:
    path = folder / name
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    if kind in ("file", "file_with_token"):
        path.write_text(f'{{"note": "{SECRET if kind == "file_with_token" else "x"}"}}\n')
    elif kind == "symlink_inside":
        path.symlink_to(folder / "config.json")
    elif kind == "symlink_outside":
        path.symlink_to(outside)
    elif kind == "folder":
        path.mkdir()
        (path / "inner.json").write_text(SECRET)
    else:
        os.mkfifo(path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@property_settings(max_examples=40)
@given(st.lists(entry, min_size=1, max_size=8, unique_by=lambda e: e[0]))
def test_upload_holds_only_allowed_regular_files_and_never_the_token(packed, tmp_path_factory, entries):  # noqa: F811
    base = tmp_path_factory.mktemp("audit")
    folder = base / "model"
    shutil.copytree(packed, folder)
    outside = base / "secret.txt"
    outside.write_text(SECRET)
    before = {p.name for p in folder.iterdir()}
    for name, kind in entries:
        _make(folder, outside, name, kind)

    token_in_allowed = any(kind == "file_with_token" and name in ALLOWED for name, kind in entries)
    code = hub.remote_code_names()
    # the token in the environment, no cached login of this machine
    with mock.patch.dict(os.environ, {"HF_TOKEN": SECRET, "HF_HOME": str(base / "hf_home")}):
        _check_upload(folder, entries, token_in_allowed, code, before)


def _check_upload(folder, entries, token_in_allowed, code, before):
    try:
        plan = hub.plan_upload(folder, "me/audit")
    except hub.UploadError as exc:
        assert token_in_allowed, exc
        assert "looks like a Hugging Face access token" in str(exc) and SECRET not in str(exc)
        return
    assert not token_in_allowed and "HF_TOKEN" in plan.token_source
    uploaded = {f.path_in_repo for f in plan.files}
    index = hub._read_json(folder / hub.INDEX_NAME)["weight_map"] if (folder / hub.INDEX_NAME).exists() else {}
    permitted = set(ALLOWED) | code | {hub.CARD_NAME, hub.INDEX_NAME, *hub.SINGLE_WEIGHTS, *index.values()}
    assert uploaded <= permitted, uploaded - permitted
    for f in plan.files:
        if f.local is not None:
            assert f.local.parent == folder and f.local.is_file() and not f.local.is_symlink()
            assert not f.local.name.startswith(".")
            assert SECRET.encode() not in f.local.read_bytes()
    # nothing disappears silently: every entry of the folder is uploaded or left out with a reason
    skipped = {name for name, _ in plan.skipped}
    assert {p.name for p in folder.iterdir()} <= uploaded | skipped
    assert before - {n for n, _ in entries} <= uploaded | skipped

    api = RecordingApi()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        assert hub.main([str(folder), "--repo-id", "me/audit"], api=api) == 0
        assert hub.main([str(folder), "--repo-id", "me/audit", "--dry-run"]) == 0
    assert SECRET not in printed.getvalue()
    operations = api.calls[1][1]["operations"]
    assert {op.path_in_repo for op in operations} == uploaded


def test_index_naming_a_shard_outside_the_folder_is_refused(packed, tmp_path):  # noqa: F811
    folder = tmp_path / "model"
    shutil.copytree(packed, folder)
    (tmp_path / "elsewhere.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    (folder / hub.INDEX_NAME).write_text('{"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}')
    with pytest.raises(hub.UploadError, match=r"outside the folder or not by a file name: \['\.\./elsewhere"):
        hub.plan_upload(folder, "me/audit")
