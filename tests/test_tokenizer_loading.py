"""`load_tokenizer` gives what AutoTokenizer gives, and after the first load of a tokenizer it
skips AutoTokenizer's model-config read (which imports torch: seconds of a router's start) by
taking the class AutoTokenizer picked, remembered in the cache directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from common.text.tokenizer import apply_chat_template, load_tokenizer
from tests.pd_stack import ROOT
from tests.tiny_models import save_tiny_tool_model

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, wörld! 12345 <|im_end|> tabs\tand\nnewlines"},
]


@pytest.fixture
def cache(smollm_dir, tool_model, tmp_path, monkeypatch):
    """An empty cache directory, set only once the models exist: the embedded GGUF's
    conversion lives in the cache directory too, and redoing it takes a minute."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer_classes.json"


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    """Qwen2 model type with a tokenizer_config naming the generic TokenizersBackend: here
    AutoTokenizer picks Qwen2Tokenizer, which a load by the named class would miss."""
    return save_tiny_tool_model(tmp_path_factory.mktemp("tokenizer-tool-model"))


def same_tokenizer(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    text = MESSAGES[1]["content"]
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.all_special_ids == theirs.all_special_ids
    assert apply_chat_template(ours, MESSAGES) == apply_chat_template(theirs, MESSAGES)


@pytest.mark.parametrize("model", ["embedded", "tool_model"])
def test_the_first_and_the_remembered_load_equal_autotokenizers(model, cache, request):
    directory = request.getfixturevalue("smollm_dir" if model == "embedded" else model)
    reference = AutoTokenizer.from_pretrained(directory)
    before = json.loads(cache.read_text()) if cache.exists() else {}
    same_tokenizer(load_tokenizer(directory), reference)
    added = json.loads(cache.read_text()).items() - before.items()
    assert [name for _, name in added] == [type(reference).__name__]
    same_tokenizer(load_tokenizer(directory), reference)


def test_a_changed_tokenizer_file_is_looked_up_again(tool_model, cache, tmp_path):
    copy = tmp_path / "model"
    copy.mkdir()
    for path in tool_model.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    load_tokenizer(copy)
    stat = (copy / "tokenizer_config.json").stat()
    os.utime(copy / "tokenizer_config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load_tokenizer(copy)
    assert len(json.loads(cache.read_text())) == 2


def test_a_remembered_load_imports_no_torch(smollm_dir, cache):
    load_tokenizer(smollm_dir)
    code = (
        "import sys; from pathlib import Path; from common.text.tokenizer import load_tokenizer; "
        f"assert load_tokenizer(Path({str(smollm_dir)!r})) is not None; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
