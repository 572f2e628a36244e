"""The model: one hybrid decoder (`hybrid.py`) for every supported architecture.

`config.py` is the schema every architecture maps onto; `mixers.py` the mixer types a layer
can hold (attention, Mamba2, ...), each in its own file. `arch/` holds one file per
architecture family: its Hugging Face config mapping and its tensor rules side by side.
`loader.py` loads a model directory: its safetensors by the family's rules
(`safetensors_loader.py`), or parameters converted before (`param_store.py`, Orbax).

Adding an architecture is its family file under `arch/` and a line in `arch/__init__.py`'s
`ARCHITECTURES` (or a call to `arch.register` from outside jaxengine); a new mixer type
besides is its module file and a line in `mixers.py`'s `MIXERS`.
"""
