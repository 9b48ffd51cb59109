"""What a job writes and reads back: nothing a user owns may be lost.

``snapshots`` saves and chooses DCP snapshots (atomic, verified, with fallback to an older good
one); ``manifest`` records and checks each snapshot's files (size, CRC-32); ``storage`` checks
free space and writability before a save; ``job_lock`` keeps two jobs out of one dump folder;
``weights`` loads and saves model weights as DCP or Hugging Face safetensors; ``outputs`` is
the rule every command's writes follow (refuse what exists, write aside, rename into place);
``model_record`` records the model settings a snapshot was trained with and refuses a job whose
model differs; ``batch_record`` records what a step holds and says (or refuses) a resume that
changes it.
"""
