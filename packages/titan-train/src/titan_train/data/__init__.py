"""Data: tokenizers, document sources and the packing loader."""
from .loader import IGNORE_INDEX, Batch, PackedLoader
from .sources import open_documents
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = ["IGNORE_INDEX", "Batch", "ByteTokenizer", "HFTokenizer", "PackedLoader", "build_tokenizer", "open_documents"]
