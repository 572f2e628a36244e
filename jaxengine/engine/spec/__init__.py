"""Speculative decoding, whole: the engine loop calls a `Speculator` at two points (before a
step: which drafts each sequence offers; after it: what the step showed), the scheduler
finds the offered drafts on each sequence (`SpecState`), and an engine without
`speculative_config` has no speculator and runs none of this.

- `config.py`: the `speculative_config` engine argument (vLLM's names).
- `speculator.py`: the engine's one boundary: proposing (ngram on the host), the gate,
  per-request admission, acceptance and its counters.
- `ngram.py`: prompt lookup. The MTP module (`models/mtp.py`) and a draft model
  (`models/draft_chain.py`, loaded by `draft_model.py`) draft inside the model's step.
- `acceptance.py`: the acceptance rule, one definition for the host and the step.
- `gate.py`: whether drafting pays (`"adaptive": true`).
- `state.py`, `stats.py`: per-sequence state, and the counters `stats()` reports.
"""
