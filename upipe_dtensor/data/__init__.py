"""Training data: documents read from local files or Hugging Face datasets, tokenized and packed
into sequences (``loader``), and the document boundaries inside a packed sequence that the
document mask and per-document positions use (``documents``)."""
