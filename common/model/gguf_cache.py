"""GGUF checkpoints, turned once into a Hugging Face directory we can load quickly.

transformers dequantizes GGUF tensors on load (tens of seconds); we do that once per file and
serving dtype and keep config, safetensors weights (in that dtype: a bfloat16 server does not
read, nor store, float32 copies) and tokenizer under `envs.cache_dir()`, keyed by the file's
contents and the dtype. Every later process loads the cached directory like any HF checkpoint.

The key is the contents, not the path: the embedded model's GGUF is reinstalled into every new
virtual environment (a fresh clone, a CI run), and a path-keyed cache grew by a ~0.8 GB copy
of the same weights each time. Hashing ~100 MB takes a fraction of a second, and is done once
per path, size and mtime: the digest is remembered in a one-line file beside the conversions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from common import envs

DTYPES = ("float32", "bfloat16", "float16")


def cached_hf_dir(gguf_path: Path, dtype: str = "float32") -> Path:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    suffix = "" if dtype == "float32" else f"-{dtype}"
    return envs.cache_dir() / "gguf" / f"{gguf_path.stem}-{content_digest(gguf_path)[:12]}{suffix}"


def content_digest(path: Path) -> str:
    """sha256 of `path`'s bytes, remembered per (path, size, mtime) under the cache."""
    stat = path.stat()
    seen = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    memo_name = Path("gguf") / ".digests" / seen.hexdigest()[:32]
    for root in (envs.prebuilt_cache_dir(), envs.cache_dir()):
        if root is not None and (root / memo_name).exists():
            return (root / memo_name).read_text().strip()
    memo = envs.cache_dir() / memo_name
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    # Written whole, then renamed: a reader never sees half a digest. Where the cache cannot be
    # written (a read-only file system serving from the prebuilt cache), the file is hashed again
    # at the next start instead.
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}")
        partial.write_text(digest.hexdigest())
        os.replace(partial, memo)
    return digest.hexdigest()


def _save_plain_checkpoint(model, folder: Path) -> None:
    # save_pretrained refuses GGUF-quantized models; the dequantized tensors are plain, so
    # write config, generation config and safetensors ourselves.
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.to_json_file(str(folder / "generation_config.json"))
    state = model.state_dict()
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def _cast_checkpoint(source: Path, folder: Path, dtype: str) -> None:
    """`source` (a float32 conversion) with its floating tensors cast to `dtype`: the values a
    conversion straight to `dtype` gives (transformers dequantizes to float32, then casts),
    without parsing the GGUF file again."""
    import torch
    from safetensors.torch import load_file, save_file

    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy2(item, folder / item.name)
    config = json.loads((source / "config.json").read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    target = getattr(torch, dtype)
    state = load_file(str(source / "model.safetensors"))
    cast = {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
    save_file(cast, str(folder / "model.safetensors"))


def materialize_gguf(gguf_path: Path, dtype: str = "float32") -> Path:
    """Return an HF model directory holding `gguf_path`'s weights dequantized to `dtype`: the
    prebuilt cache's when it has one, else the cache's, converted now if need be. Another dtype
    than float32 is cast from the float32 conversion when that one is cached."""
    target = cached_hf_dir(gguf_path, dtype)
    prebuilt = envs.prebuilt_cache_dir()
    if prebuilt is not None and (prebuilt / "gguf" / target.name / "config.json").exists():
        return prebuilt / "gguf" / target.name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # One conversion at a time per target: the nodes of a stack (and test processes) that start
    # together would otherwise each spend the tens of seconds; the others wait, then load it.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _materialize(gguf_path, target, dtype)
    return target


def _materialize(gguf_path: Path, target: Path, dtype: str) -> None:
    float32 = cached_hf_dir(gguf_path, "float32")
    # Write into a temporary sibling and rename: a process checking for config.json without
    # the lock (materialize_gguf's fast path) never sees half a directory.
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
    try:
        if dtype != "float32" and (float32 / "config.json").exists():
            _cast_checkpoint(float32, staging, dtype)
        else:
            _convert(gguf_path, staging, dtype)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert(gguf_path: Path, folder: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=getattr(torch, dtype)
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    _save_plain_checkpoint(model, folder)
    tokenizer.save_pretrained(folder)
