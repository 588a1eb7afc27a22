"""The tokenizer of a GGUF file, converted by transformers once and kept on disk.

transformers builds a GGUF file's tokenizer by parsing the whole file's metadata with
gguf-py (SmolLM2's 49k-token vocabulary: ~8 s on a 2-core CPU, every start of the server);
its own saved form loads in ~0.5 s. The copy is keyed by the file's path, size and
modification time and by the transformers version, so a changed file or library converts
again. Where the cache cannot be written the conversion still serves, uncached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve import envs

logger = logging.getLogger(__name__)


def cached_tokenizer_dir(path: str) -> Path:
    stat = os.stat(path)
    identity = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return envs.KVSERVE_CACHE_DIR / "gguf_tokenizers" / hashlib.sha1(identity.encode()).hexdigest()[:16]


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of the GGUF file at `path`, from the cache when it holds it."""
    cached = cached_tokenizer_dir(path)
    if (cached / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(cached)
        except Exception as error:  # a damaged copy: convert again
            logger.warning("cached tokenizer %s unreadable (%s); converting %s again", cached, error, path)
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    _store(tokenizer, cached)
    return tokenizer


def _store(tokenizer: PreTrainedTokenizerBase, cached: Path) -> None:
    """Save into a fresh directory and rename it into place: concurrent loads of the same file
    (test workers, several servers) never see a half-written copy, and the first rename wins."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f"{cached.name}."))
    except OSError as error:  # e.g. a read-only home: the tokenizer serves uncached
        logger.info("tokenizer not cached at %s (%s)", cached, error)
        return
    try:
        tokenizer.save_pretrained(staging)
        os.rename(staging, cached)
    except OSError as error:  # another process stored it first, or the disk is full
        logger.info("tokenizer not cached at %s (%s)", cached, error)
        shutil.rmtree(staging, ignore_errors=True)
