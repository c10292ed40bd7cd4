"""What the remote code copied into model folders may do, checked on its source and while it runs.

The remote-code files run inside other people's jobs with `trust_remote_code=True`. They import nothing beyond
torch, transformers, the standard library's harmless modules, the optional kernels (fla, flash_attn, flash_qla, triton) and each
other; they make no network calls, start no processes, evaluate no strings, unpickle nothing (no `torch.load`:
weights come through transformers from safetensors), open no files, and change no process-wide state (environment,
torch's global settings, logging and warning configuration, sys.modules / sys.path).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_packed.conversion.remote_code import remote_code_files

ROOT = Path(__file__).resolve().parents[2]
# triton: the GPU kernel language of modeling/triton_conv.py; flash_qla: the GDN backend FlashQLA (both imported
# optionally, like fla and flash_attn).
OPTIONAL_KERNELS = {"fla", "flash_attn", "flash_qla", "triton"}
# Standard-library modules with no business in model code: network, processes, serialisation that executes code,
# files and the environment (os), native calls, dynamic imports.
FORBIDDEN_STDLIB = {
    "asyncio", "concurrent", "ctypes", "dbm", "ftplib", "http", "imaplib", "marshal", "multiprocessing", "os",
    "pathlib", "pickle", "poplib", "pty", "runpy", "shelve", "shutil", "smtplib", "socket", "socketserver", "ssl",
    "subprocess", "tempfile", "telnetlib", "urllib", "webbrowser", "xmlrpc", "zipimport",
}  # fmt: skip
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__", "open", "breakpoint", "input", "globals"}
# Dotted calls (as written in the source) that load pickles, touch files, the network or process-wide state.
FORBIDDEN_CALLS = {
    "torch.load", "torch.save", "torch.hub.load", "torch.manual_seed", "torch.set_default_dtype",
    "torch.set_default_device", "torch.set_num_threads", "torch.set_grad_enabled", "torch.use_deterministic_algorithms",
    "torch.set_float32_matmul_precision", "torch.backends.cuda.matmul.allow_tf32", "logging.basicConfig",
    "logging.disable", "warnings.filterwarnings", "warnings.simplefilter", "importlib.import_module",
    "importlib.reload", "sys.exit", "sys.settrace", "sys.setprofile",
}  # fmt: skip
# Method names that write files, reach the network or unpickle, whatever the object.
FORBIDDEN_METHODS = {
    "write_text", "write_bytes", "mkdir", "makedirs", "unlink", "rmtree", "rmdir", "touch", "urlopen",
    "hf_hub_download", "snapshot_download", "save_pretrained", "to_json_file", "save_file", "putenv", "unsetenv",
    "system", "popen", "load_state_dict_from_url",
}  # fmt: skip
PROCESS_STATE_ROOTS = {"torch", "transformers", "sys", "logging", "warnings", "os"}


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def audit(path: Path, flat_names: set[str]) -> list[str]:
    """Every forbidden construct in one remote-code file, as 'file:line: what'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}  # local name -> module it stands for (import torch.nn.functional as F)
    found = []

    def report(node, what):
        found.append(f"{path.name}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                _check_module(alias.name, node, report)
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(
                    ".")[0]  # fmt: skip
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: only the sibling remote-code files (they sit flat in the model folder)
                if node.level != 1 or (node.module is not None and node.module not in flat_names):
                    report(node, f"relative import of {'.' * node.level}{node.module or ''} outside the flat set")
                for alias in node.names if node.module is None else ():
                    if alias.name not in flat_names:
                        report(node, f"relative import of {alias.name} outside the flat set")
            else:
                _check_module(node.module, node, report)
                for alias in node.names:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_BUILTINS:
                report(node, f"call of {node.func.id}()")
            if name is not None:
                head, _, rest = name.partition(".")
                resolved = aliases.get(head, head) + (f".{rest}" if rest else "")
                if resolved in FORBIDDEN_CALLS or name in FORBIDDEN_CALLS:
                    report(node, f"call of {resolved}")
                if resolved.startswith("torch.") and resolved.split(".")[-1].startswith("set_") and (
                        resolved.count(".") == 1):  # fmt: skip
                    report(node, f"call of {resolved} (process-wide torch setting)")
            if isinstance(node.func, ast.Attribute) and node.func.attr in FORBIDDEN_METHODS:
                report(node, f"call of .{node.func.attr}()")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                base = target.value if isinstance(target, (ast.Attribute, ast.Subscript)) else None
                name = _dotted(base) if base is not None else None
                root = aliases.get(name.split(".")[0], name.split(".")[0]) if name else None
                if root is not None and root.split(".")[0] in PROCESS_STATE_ROOTS:
                    report(node, f"assignment into {name} (process-wide state)")
    return found


def _check_module(module: str | None, node, report) -> None:
    top = (module or "").split(".")[0]
    if top in ("torch", "transformers", "__future__") or top in OPTIONAL_KERNELS:
        return
    if top in FORBIDDEN_STDLIB:
        report(node, f"import of {module}")
    elif top not in sys.stdlib_module_names:
        report(
            node,
            f"import of {module} (neither torch, transformers, the standard library nor fla / flash_attn / flash_qla / triton)",
        )


def test_remote_code_files_do_nothing_a_reviewer_would_not_expect():
    files = remote_code_files()
    flat = {p.stem for p in files}
    assert {"configuration_qwen3_5_packed", "modeling_qwen3_5_packed", "packing"} <= flat
    problems = [line for path in files for line in audit(path, flat)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import subprocess", "import of subprocess"),
        ("import requests", "import of requests (neither"),
        ("from os import environ", "import of os"),
        ("import torch\nx = torch.load('w.pt')", "call of torch.load"),
        ("import torch as t\nt.save({}, 'w.pt')", "call of torch.save"),
        ("eval('1')", "call of eval()"),
        ("open('x', 'w')", "call of open()"),
        ("from pathlib import Path\nPath('x').write_text('y')", "call of .write_text()"),
        ("import torch\ntorch.backends.cuda.matmul.allow_tf32 = True", "assignment into torch.backends.cuda.matmul"),
        ("import torch\ntorch.set_default_dtype(torch.float64)", "call of torch.set_default_dtype"),
        ("import warnings\nwarnings.simplefilter('ignore')", "call of warnings.simplefilter"),
        ("import sys\nsys.path[0] = '/tmp'", "assignment into sys.path"),
        ("from .evil import x", "relative import of .evil outside the flat set"),
        ("from ..pkg import x", "relative import of ..pkg outside the flat set"),
    ],
)
def test_the_audit_finds_what_it_forbids(source, expected, tmp_path):
    path = tmp_path / "candidate.py"
    path.write_text(source + "\n")
    problems = audit(path, {"packing"})
    assert any(expected in p for p in problems), problems


# While running: a Python audit hook (PEP 578) in a fresh process records file writes, processes, sockets,
# environment changes and unpickling done while our remote-code model is built from a converted folder with
# trust_remote_code, runs forward + backward with packed documents, and generates. The hook is installed after
# transformers has copied the remote code into its module cache (that copy is transformers' doing).
RUNTIME_AUDIT = r"""
import json, sys, tempfile
import torch, transformers
from qwen35_packed.tiny import build_tiny_folder

folder = build_tiny_folder(tempfile.mkdtemp() + "/model", "moe")
model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__  # the copied files
ids = torch.randint(3, 100, (1, 24))
cu = torch.tensor([0, 10, 24], dtype=torch.int32)
model(ids, cu_seqlens=cu)  # first call: lazy imports happen before the hook

events = []
WATCHED = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "socket.", "urllib.",
           "http.", "os.putenv", "os.unsetenv", "pickle.", "marshal.load", "os.remove", "os.rename", "os.rmdir",
           "os.mkdir", "os.symlink", "os.truncate", "shutil.", "ctypes.", "os.chmod", "os.chdir")

def hook(event, args):
    if event == "open":
        mode = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        if any(c in mode for c in "wax+") or flags & 0o3:  # O_WRONLY / O_RDWR
            events.append(f"open {args[0]!r} {mode or oct(flags)}")
    elif event.startswith(WATCHED):
        events.append(event)

sys.addaudithook(hook)
model.train()
out = model(ids, labels=ids, cu_seqlens=cu, output_router_logits=True)
out.loss.backward()
model.eval()
with torch.no_grad():
    model.generate(torch.randint(3, 100, (2, 6)), max_new_tokens=3, do_sample=False)
print(json.dumps(events))
"""


def test_remote_code_at_runtime_writes_no_file_and_starts_nothing():
    proc = subprocess.run([sys.executable, "-c", RUNTIME_AUDIT], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_modules_named_by_auto_map_import_every_file_they_need_themselves():
    """transformers 4.x copies into its module cache only the files named by the `from .name import` lines of the
    module auto_map points at (a regex over its text), not the files those import. Everything such a module needs,
    transitively, must therefore be named in it, or a folder loaded with a fresh cache fails with FileNotFoundError
    (as the VL folder did, and the text folder once kernels.py imported triton_conv.py)."""
    import re

    from qwen35_packed.conversion.config import auto_map, vl_auto_map

    sources = {path.stem: path.read_text() for path in remote_code_files()}
    relative_import = re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE)  # as transformers 4.57 reads them

    def named(module: str) -> set[str]:
        return set(relative_import.findall(sources[module]))

    tops = {
        reference.split(".")[0]
        for is_moe in (False, True)
        for mapping in (auto_map(is_moe), vl_auto_map(is_moe))
        for reference in mapping.values()
    }
    assert {"modeling_qwen3_5_packed", "modeling_qwen3_5_packed_vl"} <= tops
    for top in sorted(tops):
        needed, todo = set(), [top]
        while todo:
            for module in named(todo.pop()) - needed:
                needed.add(module)
                todo.append(module)
        assert needed <= named(top), f"{top}.py must also name {sorted(needed - named(top))}"


def test_the_bundle_is_one_folder_with_its_configuration_files():
    """What `convert` copies is exactly the bundle folder qwen35_packed/modeling/ (configuration files included);
    the import-path shims of qwen35_packed/configuration/ import `..modeling` and would break in a flat folder."""
    from qwen35_packed.conversion.remote_code import BUNDLE

    files = remote_code_files()
    assert {path.parent for path in files} == {BUNDLE} and BUNDLE.name == "modeling"
    assert {"configuration_qwen3_5_packed.py", "configuration_qwen3_5_packed_vl.py", "modeling_qwen3_5_packed.py",
            "modeling_qwen3_5_packed_vl.py"} <= {path.name for path in files}  # fmt: skip
