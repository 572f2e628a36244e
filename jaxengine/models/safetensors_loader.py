"""A Hugging Face safetensors checkpoint -> model parameters, by its family's tensor rules.

Each architecture names its tensors differently; its family's rules (`arch/`) map a Hugging
Face tensor name onto a parameter path of `HybridLM` and say how to convert it (transpose a
linear weight, squeeze a conv weight, stack per-expert tensors, split a fused gate|up
projection, place a projection in some columns of a fused one, fold constant multipliers into
a projection). Every parameter must be filled exactly once with the expected shape; anything
else is an error naming the tensor.
"""

import dataclasses
import json
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxengine.models.arch import ARCHITECTURES
from jaxengine.models.arch.rules import ParamPath, Rule
from jaxengine.models.config import ModelConfig

logger = logging.getLogger(__name__)

# Tensors a checkpoint may carry that serving its text model does not use: rotary tables,
# Falcon-H1's muP vector (computed from the config, as transformers does), the MTP module
# unless speculative decoding drafts with it, and a vision-language checkpoint's vision tower.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|mamba\.mup_vector|^mtp\.|^model\.visual\.)")


def _hf_shape(kind: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape that converts into a parameter of shape `ours`."""
    if kind == "linear":
        return ours[::-1]
    if kind == "conv":
        return (ours[0], 1, ours[1])
    if kind == "experts":
        return (ours[0], ours[2], ours[1])
    if kind == "expert":
        return (ours[2], ours[1])
    if kind == "split":  # a weight, or a bias
        return (2 * ours[1], ours[0]) if len(ours) == 2 else (2 * ours[0],)
    return ours


def _convert(kind: str, tensor: np.ndarray) -> list[np.ndarray]:
    if kind in ("linear", "expert"):
        return [tensor.T]
    if kind == "conv":
        return [tensor[:, 0, :]]
    if kind == "experts":
        return [np.swapaxes(tensor, 1, 2)]
    if kind == "split":
        gate, up = np.split(tensor, 2, axis=0)
        return [gate.T, up.T]
    return [tensor]


def _read_safetensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of a single-file or sharded safetensors checkpoint, one at a time as host
    (numpy) arrays, so converting a checkpoint holds one raw tensor beside the converted ones;
    a ValueError naming the file for a broken file, and naming the tensor for one holding NaN
    or infinity (such weights would turn every output into the same token silently)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    for name in files:
        for key, tensor in _file_tensors(model_dir / name):
            if np.issubdtype(tensor.dtype, np.floating) or tensor.dtype.name == "bfloat16":
                if not np.isfinite(tensor.astype(np.float32)).all():
                    raise ValueError(f"{model_dir}: tensor {key!r} holds NaN or infinite values")
            yield key, tensor


def _file_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """One safetensors file's tensors, one at a time; a ValueError naming the file if it is broken."""
    try:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except (OSError, SafetensorError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the safetensors file ({err})") from None


def params_from_hf(model_dir: Path, cfg: ModelConfig, abstract_state: nnx.State) -> dict:
    """Reads and converts a Hugging Face checkpoint into a pure dict shaped like the model state."""
    expected = {path: leaf for path, leaf in _flat(abstract_state.to_pure_dict())}
    family = ARCHITECTURES[cfg.architecture]
    filled: dict[ParamPath, np.ndarray] = {}
    # Parameters assembled from several tensors: (expert or None, first column) -> [in, width].
    parts: dict[ParamPath, dict[tuple[int | None, int], np.ndarray]] = {}
    ignored: dict[str, int] = {}
    for name, tensor in _read_safetensors(model_dir):
        rule, match, targets = _rule_for(name, cfg, family.rules, family.mtp_rules)
        if rule is None:
            if found := IGNORED.search(name):
                ignored[found.group(0)] = ignored.get(found.group(0), 0) + 1
                continue
            raise ValueError(f"{model_dir}: unexpected tensor {name!r} with shape {tuple(tensor.shape)}")
        if targets == [("lm_head", "kernel")] and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves as the output projection
        for path in targets:
            if path not in expected:
                raise ValueError(f"{model_dir}: unexpected tensor {name!r} (no parameter {'/'.join(map(str, path))})")
        expert = int(match.group("expert")) if "expert" in match.groupdict() else None
        if rule.kind == "columns":
            start, width, perm = rule.columns(match, cfg)
            want = (width, expected[targets[0]].shape[-2])
        else:
            want = _hf_shape(rule.kind, tuple(expected[targets[0]].shape))
        if tuple(tensor.shape) != want:
            raise ValueError(f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        if rule.scale is not None:
            tensor = tensor.astype(np.float32) * rule.scale(match, cfg)
        if rule.kind == "columns":
            parts.setdefault(targets[0], {})[(expert, start)] = (tensor if perm is None else tensor[perm]).T
            continue
        for path, value in zip(targets, _convert(rule.kind, tensor)):
            if rule.kind == "expert":
                parts.setdefault(path, {})[(expert, 0)] = value
            else:
                filled[path] = value
    for found, count in ignored.items():
        if found == "mtp.":
            logger.info(
                "%s: %d tensors mtp.* not loaded (the MTP draft module: speculative_config method 'mtp' uses it)",
                model_dir,
                count,
            )
        elif found not in ("rotary_emb.inv_freq", "mamba.mup_vector"):
            logger.info("%s: %d tensors %s* not loaded (not used to serve the text model)", model_dir, count, found)
    for path, pieces in parts.items():
        filled[path] = _assemble(model_dir, path, pieces, tuple(expected[path].shape))
    missing = [p for p in expected if p not in filled]
    if missing:
        names = ", ".join("/".join(map(str, p)) for p in missing[:8])
        raise ValueError(f"{model_dir}: missing tensors for parameters {names}" + (" ..." if len(missing) > 8 else ""))
    # Host arrays in the model's dtype, each converted as the one before it is let go; the
    # engine puts each straight into its shards on the device mesh.
    return _unflat({p: np.asarray(filled.pop(p), dtype=expected[p].dtype) for p in list(filled)})


def _rule_for(
    name: str, cfg: ModelConfig, rules: Sequence[Rule], mtp_rules: Sequence[Rule]
) -> tuple[Rule | None, re.Match | None, list[ParamPath]]:
    """The rule a tensor name matches, its match and its parameter paths; (None, None, [])
    for none. MTP tensors match only when the model has an MTP module: the module's own by
    `mtp_rules`, its layers by the architecture's own rules, as layers of a model made of the
    MTP layers."""
    if cfg.mtp_layers and name.startswith("mtp."):
        own = any(re.search(r.pattern, name) for r in mtp_rules)
        if name.startswith("mtp.layers.") and not own:
            inner = "model." + name.removeprefix("mtp.")  # mtp.layers.N.x -> model.layers.N.x
            rule, match, targets = _rule_for(
                inner, dataclasses.replace(cfg, layers=cfg.mtp_layers, mtp_layers=()), rules, mtp_rules
            )
            return rule, match, [("mtp", *t) for t in targets]
        rules = mtp_rules
    rule, match = next(((r, m) for r in rules if (m := re.search(r.pattern, name))), (None, None))
    return rule, match, rule.targets(match, cfg) if rule else []


def _assemble(
    model_dir: Path, path: ParamPath, pieces: dict[tuple[int | None, int], np.ndarray], shape: tuple[int, ...]
) -> np.ndarray:
    """A parameter of `shape` from its column pieces, per expert if it is stacked; an error
    naming the parameter for missing experts or columns."""
    name = "/".join(map(str, path))
    stacked = next(iter(pieces))[0] is not None
    experts = sorted({e for e, _ in pieces}) if stacked else [None]
    if stacked and experts != list(range(shape[0])):
        missing = sorted(set(range(shape[0])) - set(experts))
        raise ValueError(f"{model_dir}: missing experts {missing} for parameter {name}")
    rows = []
    for e in experts:
        columns = sorted((start, value) for (pe, start), value in pieces.items() if pe == e)
        end = 0
        for start, value in columns:
            if start != end:
                raise ValueError(f"{model_dir}: missing columns [{end}, {start}) of parameter {name}")
            end += value.shape[-1]
        if end != shape[-1]:
            raise ValueError(f"{model_dir}: missing columns [{end}, {shape[-1]}) of parameter {name}")
        rows.append(np.concatenate([value for _, value in columns], axis=-1))
    return np.stack(rows) if stacked else rows[0]


def _flat(tree: dict, prefix: ParamPath = ()) -> list[tuple[ParamPath, object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(_flat(value, (*prefix, key)))
        else:
            out.append(((*prefix, key), value))
    return out


def _unflat(flat: dict[ParamPath, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree
