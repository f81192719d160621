"""Fixtures for the data-layer tests: tiny offline tokenizers and an isolated, offline datasets cache."""

from __future__ import annotations

import datasets
import huggingface_hub.constants as hub_constants
import pytest
from transformers import AutoTokenizer

from tidal.testing.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session", autouse=True)
def offline_datasets(tmp_path_factory):
    """Keep ``datasets`` off the network and out of the user's cache for the whole session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets_cache")))
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(hub_constants, "HF_HUB_OFFLINE", True)
        datasets.disable_progress_bars()
        yield


def _tokenizer(tmp_path_factory, name: str, add_bos: bool):
    path = tmp_path_factory.mktemp(name)
    build_tiny_tokenizer(path, add_bos=add_bos)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="session")
def llama_tok(tmp_path_factory):
    """Llama-style: plain encoding prepends <|bos|>; the chat template writes bos itself."""
    return _tokenizer(tmp_path_factory, "tok_llama", add_bos=True)


@pytest.fixture(scope="session")
def qwen_tok(tmp_path_factory):
    """Qwen-style: no bos anywhere."""
    return _tokenizer(tmp_path_factory, "tok_qwen2", add_bos=False)


@pytest.fixture(params=["llama", "qwen2"])
def any_tok(request, llama_tok, qwen_tok):
    return llama_tok if request.param == "llama" else qwen_tok
