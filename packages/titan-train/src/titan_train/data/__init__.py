"""Data: tokenizers, document sources and the packing loader."""
from .loader import IGNORE_INDEX, Batch, PackedLoader, pack_rows
from .mixing import MixedLoader
from .random_tokens import RandomTokenLoader, random_rows
from .sources import open_documents
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = ["IGNORE_INDEX", "Batch", "ByteTokenizer", "HFTokenizer", "MixedLoader", "PackedLoader", "RandomTokenLoader",
           "build_tokenizer", "pack_rows",
           "open_documents", "random_rows"]
