"""Data: tokenizers, document sources and the packing loader."""
from .image_text import ImageTextLoader
from .loader import IGNORE_INDEX, Batch, PackedLoader, pack_rows
from .mixing import MixedLoader
from .random_tokens import RandomTokenLoader, random_rows
from .shapes import ShapesLoader
from .sources import open_documents
from .tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = ["IGNORE_INDEX", "Batch", "ByteTokenizer", "HFTokenizer", "ImageTextLoader", "MixedLoader", "PackedLoader",
           "RandomTokenLoader", "ShapesLoader", "build_tokenizer", "pack_rows", "open_documents", "random_rows"]
