"""Checkpoints for ouro-jax: load Hugging Face or converted (orbax) folders, convert, write random ones.

``load_checkpoint(path, dtype=None) -> (OuroConfig, params)``
    ``path`` is a Hugging Face folder (``config.json`` + ``model.safetensors`` or sharded with
    ``model.safetensors.index.json``) or a folder written by :func:`convert` (recognised by its
    ``ouro_jax_checkpoint.json`` marker).  ``params`` is the nested dict of jax arrays described in
    ``weights/hf_names.py``; ``dtype`` (``jnp.bfloat16``, ``"float32"``, ...) casts every tensor,
    ``None`` keeps each tensor's stored dtype.
``convert(src, dst, dtype=None, progress=True, overwrite=False)``
    HF folder -> converted folder (orbax checkpoint of the Flax tree + config.json + marker).
``save_random(path, config, seed=0, layout="hf", dtype="float32", max_shard_bytes=None, progress=False)``
    A seeded random checkpoint (``weights.random_init.random_hf_tensors``) in either layout.

Every problem with a checkpoint raises :class:`CheckpointError` (a ``ValueError``) naming the file and
tensor; a non-empty destination raises ``FileExistsError`` unless ``overwrite=True``.

``weights.config`` holds ``OuroConfig`` (what a checkpoint's ``config.json`` holds) and the presets. The package
imports nothing of ``ouro_jax`` (which sits above it).  Its names are imported lazily, so that the jax-free
``weights.config`` and ``weights.hf_names`` (tensor names and shapes) stay importable without jax (the numpy
reference uses them).
"""

_LAZY = {
    "load_checkpoint": "weights.checkpoint",
    "convert": "weights.checkpoint",
    "save_random": "weights.checkpoint",
    "detect_format": "weights.checkpoint",
    "CheckpointError": "weights._common",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'weights' has no attribute {name!r}")


__all__ = list(_LAZY)
