"""Training data: documents read from local files or Hugging Face datasets, tokenized and packed
into sequences (``loader``), every record checked before a job starts and the fingerprint a
resume compares (``checks``), and the document boundaries inside a packed sequence that the
document mask and per-document positions use (``documents``); the order of each rank's documents,
long ones upsampled and sources interleaved (``mixture``); and the mixture as the job will train
on it, before training (``report``, ``python -m upipe_dtensor.data_report``). Text tokenized once
into a token folder (``tokenize``, ``python -m upipe_dtensor.tokenize``) is memory-mapped instead
(``token_files``); data that will train badly gets a start-up line (``startup_warnings``)."""
