"""Model families: each builds the shared Transformer from its own typed config."""
