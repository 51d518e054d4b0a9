"""Data: the sources read, the tokenizer, `prepare` (encode pipeline, meta.json and the fingerprint
of its inputs) and the datasets training reads (pretraining windows, instruction sequences).

    sources.py      which files a source holds, their records streamed in chunks
    chat.py         a conversation rendered with a chat template, targets on the assistant's tokens
    tokenizer.py    the BPE prepare trains, loading a tokenizer directory
    fingerprint.py  what prepare read, and what changed since
    encode.py       records -> token arrays per split, in worker processes
    meta.py         a prepared data.dir checked: meta.json against its files, token ids
    prepare.py      prepare and ensure_prepared
    datasets.py     TokenData (pretraining), SftData (instruction data), sharded by data-parallel rank
"""
