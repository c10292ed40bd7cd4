"""The hub tests' shared pieces: a fake token, a recording stand-in for huggingface_hub.HfApi, and a converted
(packed) folder to upload."""

from __future__ import annotations

import pytest
from fixtures_conversion import build_builtin

from qwen35_packed.conversion import convert

SECRET = "hf_NotARealTokenButSecret0123456789"
APACHE = "\n                                 Apache License\n                           Version 2.0, January 2004\n"


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records the calls `upload` makes."""

    def __init__(self):
        self.calls = []

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))
        return f"https://huggingface.co/{kwargs['repo_id']}"

    def create_commit(self, **kwargs):
        self.calls.append(("create_commit", kwargs))

        class Info:
            commit_url = f"https://huggingface.co/{kwargs['repo_id']}/commit/0"

        return Info()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A converted (packed) dense folder with a LICENSE, a tokenizer config and a verification report."""
    root = tmp_path_factory.mktemp("hub")
    src = root / "src"
    build_builtin("dense", seed=1).save_pretrained(src)
    (src / "LICENSE").write_text(APACHE)
    (src / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')
    out = root / "packed"
    convert(src, out, progress=False, log=lambda line: None)
    return out
