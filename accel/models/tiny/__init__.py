"""Offline builders for tiny, seeded, random-weight parts shared by the tiny pipelines.

Tests and demos need real pipeline classes without a model hub, so tokenizers are built from
in-memory vocabularies and text encoders from small configs. Weights are random but seeded,
and the caller's global RNG state is left untouched. One module per job: `seeding` (the seeded
build every module uses), `vaes`, `bpe` (byte-level vocabularies and merges), and one per
text-encoder family (`clip`, `t5`, `llama`, `qwen`, `mistral`, `gemma`: its tokenizer and
processors beside the encoder they fit).
"""
