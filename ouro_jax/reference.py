"""Dense float64 numpy reference of an Ouro model: the oracle of the test suite.

Written from ``docs/model.md`` and ``docs/engine-semantics.md`` alone; it imports neither jax
nor flax and shares nothing with the engine but the HF tensor names (``weights/hf_names.py``).  One sequence at
a time, everything recomputed from scratch, no caches: slow, short and easy to check by eye.

- :func:`reference_forward` runs all ``T`` loops over one sequence and returns every loop's hidden
  state, gate logit and the exit distribution.  With ``exit_depths`` it applies LAST_EXITED KV
  semantics by recompute: at loop ``d`` every query reads position ``j``'s K/V from loop
  ``min(d, e_j)`` of the same layer.
- :func:`select_logits` picks one loop's logits per position (``exit_at_step`` / ``exit_threshold``).
- :func:`exit_decision` is the engine's per-token exit rule (``ouro`` / ``delayed`` / ``fixed``).
- :func:`reference_greedy_generate` is greedy decoding with that rule, by full recompute per token.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from weights.config import OuroConfig
from weights.hf_names import get_path, hf_name_to_path, hf_tensor_shapes

__all__ = [
    "RefWeights",
    "RefLayer",
    "load_reference_weights",
    "from_param_tree",
    "reference_forward",
    "exit_distribution",
    "select_logits",
    "exit_decision",
    "GreedyResult",
    "reference_greedy_generate",
    "reference_shared_greedy_generate",
    "rms_norm",
    "rope_cos_sin",
    "layer_qkv",
    "layer_finish",
]

EXIT_MODES = ("ouro", "delayed", "fixed")


# ----------------------------------------------------------------------------------------- weights
@dataclasses.dataclass(frozen=True)
class RefLayer:
    """One layer, float64, Linear weights in HF layout ``[out, in]``."""

    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    ln_in: np.ndarray  # input_layernorm (before attention)
    ln_in2: np.ndarray  # input_layernorm_2 (on the attention output)
    ln_post: np.ndarray  # post_attention_layernorm (before the MLP)
    ln_post2: np.ndarray  # post_attention_layernorm_2 (on the MLP output)


@dataclasses.dataclass(frozen=True)
class RefWeights:
    embed: np.ndarray  # [V, D]
    layers: tuple[RefLayer, ...]
    norm: np.ndarray  # [D] final norm, applied after every loop
    gate_w: np.ndarray  # [D]
    gate_b: float
    lm_head: np.ndarray  # [V, D]


def load_reference_weights(
    config: OuroConfig, hf_tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]]
) -> RefWeights:
    """Float64 weights from HF-layout tensors (a dict, or ``(name, array)`` pairs such as
    ``random_hf_tensors(config)``).  Shapes are checked against the config."""
    t = dict(hf_tensors)
    out = {}
    for name, shape in hf_tensor_shapes(config).items():
        if name not in t:
            raise KeyError(f"missing tensor {name!r}")
        a = np.asarray(t[name], dtype=np.float64)
        if a.shape != shape:
            raise ValueError(f"{name}: shape {a.shape}, expected {shape}")
        out[name] = a

    def layer(i):
        p = f"model.layers.{i}."
        return RefLayer(
            *(
                out[p + n + ".weight"]
                for n in (
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "mlp.gate_proj",
                    "mlp.up_proj",
                    "mlp.down_proj",
                    "input_layernorm",
                    "input_layernorm_2",
                    "post_attention_layernorm",
                    "post_attention_layernorm_2",
                )
            )
        )

    return RefWeights(
        embed=out["model.embed_tokens.weight"],
        layers=tuple(layer(i) for i in range(config.num_hidden_layers)),
        norm=out["model.norm.weight"],
        gate_w=out["model.early_exit_gate.weight"][0],
        gate_b=float(out["model.early_exit_gate.bias"][0]),
        lm_head=out["lm_head.weight"],
    )


def from_param_tree(config: OuroConfig, params: Mapping) -> RefWeights:
    """Float64 weights from a Flax param tree (kernels ``[in, out]``; numpy or jax leaves)."""
    if "params" in params and "embed_tokens" not in params:  # a {"params": ...} variables dict
        params = params["params"]
    hf = {}
    for name in hf_tensor_shapes(config):
        path, transpose = hf_name_to_path(name)
        a = np.asarray(get_path(params, path), dtype=np.float64)
        hf[name] = a.T if transpose else a
    return load_reference_weights(config, hf)


# ------------------------------------------------------------------------------------ the layers
def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * np.asarray(x, dtype=np.float64)))  # no overflow for any x


def rope_cos_sin(config: OuroConfig, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` of shape ``[S, hd]`` (both halves equal: the ``rotate_half`` convention)."""
    hd = config.head_dim
    inv_freq = config.rope_theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    freqs = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def _apply_rope(x, cos, sin):  # x [S, heads, hd]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def layer_qkv(lw: RefLayer, config: OuroConfig, x: np.ndarray, cos, sin):
    """Roped ``q [S,H,hd]`` and ``k, v [S,KVH,hd]`` of the layer input ``x [S,D]``."""
    c = config
    h = rms_norm(x, lw.ln_in, c.rms_norm_eps)
    q = (h @ lw.wq.T).reshape(-1, c.num_attention_heads, c.head_dim)
    k = (h @ lw.wk.T).reshape(-1, c.num_key_value_heads, c.head_dim)
    v = (h @ lw.wv.T).reshape(-1, c.num_key_value_heads, c.head_dim)
    return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v


def layer_finish(
    lw: RefLayer, config: OuroConfig, x: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray
) -> np.ndarray:
    """Attention of ``q [Sq,H,hd]`` over ``k, v [Sk,KVH,hd]`` (``mask [Sq,Sk]``, True = visible),
    then the sandwich residuals and the SwiGLU MLP.  Returns the layer output ``[Sq, D]``."""
    c = config
    rep = c.num_attention_heads // c.num_key_value_heads
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # head h reads KV head h // rep
    s = np.einsum("qhd,khd->hqk", q, k) * c.attn_scale
    s = np.where(mask[None], s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    a = np.einsum("hqk,khd->qhd", p, v).reshape(q.shape[0], -1) @ lw.wo.T
    x = x + rms_norm(a, lw.ln_in2, c.rms_norm_eps)
    h = rms_norm(x, lw.ln_post, c.rms_norm_eps)
    m = (_silu(h @ lw.w_gate.T) * (h @ lw.w_up.T)) @ lw.w_down.T
    return x + rms_norm(m, lw.ln_post2, c.rms_norm_eps)


# ----------------------------------------------------------------------------------- the forward
def exit_distribution(gate_logits: np.ndarray) -> np.ndarray:
    """``p [T, ...]`` from gate logits ``[T, ...]``: ``p_t = lambda_t * S_t`` for ``t < T-1``,
    ``p_{T-1} = S_{T-1}`` where ``S`` is the survival probability; sums to 1 over axis 0."""
    lam = _sigmoid(gate_logits)
    p = np.empty_like(lam)
    survive = np.ones_like(lam[0])
    for t in range(lam.shape[0] - 1):
        p[t] = lam[t] * survive
        survive = survive * (1.0 - lam[t])
    p[-1] = survive
    return p


def reference_forward(
    weights: RefWeights, config: OuroConfig, token_ids: Sequence[int], exit_depths: Sequence[int] | None = None
) -> dict:
    """All ``T`` loops over one sequence ``token_ids [S]`` (positions ``0..S-1``).

    ``exit_depths[j]`` (default all ``T-1``) gives LAST_EXITED semantics: at loop ``d``, position
    ``j``'s K/V as read by every query is the one computed at loop ``min(d, e_j)`` of that layer.
    Returns ``hidden_states [T,S,D]`` (after the final norm of each loop), ``gate_logits [T,S]`` and
    ``exit_probs [T,S]``.
    """
    c, T = config, config.num_loops
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    S = ids.shape[0]
    depths = np.full(S, T - 1) if exit_depths is None else np.asarray(exit_depths, dtype=np.int64)
    if depths.shape != (S,) or depths.min(initial=0) < 0 or depths.max(initial=0) > T - 1:
        raise ValueError(f"exit_depths must be {S} ints in [0, {T - 1}], got {exit_depths!r}")
    cos, sin = rope_cos_sin(c, np.arange(S))
    mask = np.tril(np.ones((S, S), dtype=bool))
    cols = np.arange(S)
    kv = {}  # (loop, layer) -> (k, v) as computed at that loop
    x = weights.embed[ids]
    hs, gates = [], []
    for d in range(T):
        read_loop = np.minimum(d, depths)  # which loop's K/V each position exposes at loop d
        for i, lw in enumerate(weights.layers):
            q, k, v = layer_qkv(lw, c, x, cos, sin)
            kv[d, i] = (k, v)
            k_all = np.stack([kv[t, i][0] for t in range(d + 1)])[read_loop, cols]
            v_all = np.stack([kv[t, i][1] for t in range(d + 1)])[read_loop, cols]
            x = layer_finish(lw, c, x, q, k_all, v_all, mask)
        x = rms_norm(x, weights.norm, c.rms_norm_eps)
        hs.append(x)
        gates.append(x @ weights.gate_w + weights.gate_b)
    gate_logits = np.stack(gates)
    return {"hidden_states": np.stack(hs), "gate_logits": gate_logits, "exit_probs": exit_distribution(gate_logits)}


def select_logits(
    weights: RefWeights,
    hidden_states: np.ndarray,
    gate_logits: np.ndarray,
    exit_at_step: int | None = None,
    exit_threshold: float | None = None,
) -> np.ndarray:
    """Logits ``[S, V]`` from the loop each position exits at: ``exit_at_step`` if given, else the
    first ``t`` with ``cumsum(p)_t >= exit_threshold`` (``T-1`` if none), else the last loop."""
    T, S = gate_logits.shape
    if exit_at_step is not None and exit_threshold is not None:
        raise ValueError("give exit_at_step or exit_threshold, not both")
    if exit_threshold is not None:
        reached = np.cumsum(exit_distribution(gate_logits), axis=0) >= exit_threshold
        step = np.where(reached.any(axis=0), reached.argmax(axis=0), T - 1)
    else:
        step = np.full(S, T - 1 if exit_at_step is None else exit_at_step)
    return hidden_states[step, np.arange(S)] @ weights.lm_head.T


# -------------------------------------------------------------------------------- the exit rule
def exit_decision(
    gate_logits: Sequence[float],
    *,
    exit_threshold: float = 1.0,
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_mode: str = "ouro",
) -> tuple[int, float]:
    """The engine's exit rule for one token given its gate logits ``g[0..]`` (at least up to the
    exit loop).  Returns ``(exit depth e (0-based loop), margin)`` where ``margin`` is the smallest
    ``|1 - remaining - exit_threshold|`` over the threshold tests that decided (``inf`` if none):
    a float32 engine may decide differently only when it is tiny."""
    g = np.asarray(gate_logits, dtype=np.float64)
    max_loops = len(g) if max_loops is None else max_loops
    if exit_mode not in EXIT_MODES:
        raise ValueError(f"exit_mode must be one of {EXIT_MODES}, got {exit_mode!r}")
    if not 1 <= max_loops <= len(g):
        raise ValueError(f"max_loops={max_loops} must lie in [1, {len(g)}]")
    if exit_mode == "fixed":
        return max_loops - 1, np.inf
    remaining, margin = 1.0, np.inf
    for t in range(max_loops):
        loops_done = t + 1
        remaining *= 1.0 - _sigmoid(g[t])
        if loops_done >= max_loops:
            break
        if exit_threshold < 1.0 and loops_done >= min_loops:
            margin = min(margin, abs((1.0 - remaining) - exit_threshold))
            if 1.0 - remaining >= exit_threshold:
                break
    e = t
    if exit_mode == "delayed":
        e = min(e + 1, max_loops - 1)
    return e, margin


@dataclasses.dataclass
class GreedyResult:
    tokens: list[int]  # generated token ids
    exit_depths: list[int]  # per generated token: the loop whose hidden state produced it
    min_margin: float  # smallest exit-threshold margin over all decisions (inf if none)
    min_logit_gap: float  # smallest top-1 minus top-2 logit over all sampled tokens

    def __iter__(self):  # `tokens, exit_depths = reference_greedy_generate(...)` also works
        return iter((self.tokens, self.exit_depths))


def reference_greedy_generate(
    weights: RefWeights,
    config: OuroConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    exit_threshold: float = 1.0,
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_mode: str = "ouro",
    eos_token_id: int | None = None,
) -> GreedyResult:
    """Greedy decoding with per-token early exit and LAST_EXITED KV, by full recompute per token.

    The first token comes from the last prompt position at loop ``T-1``.  Token ``n+1`` comes from
    running token ``n``'s position: its exit depth ``e`` is :func:`exit_decision` on its gates, the
    token is ``argmax lm_head(h[e])``, and ``e`` is also the depth whose K/V later positions read.
    Fixed full depth: ``exit_threshold=1.0`` (the default) with ``max_loops=T``.  Generation stops
    after ``max_new_tokens`` tokens or after ``eos_token_id`` (if given).
    """
    T = config.num_loops
    seq = [int(t) for t in prompt_ids]
    if not seq:
        raise ValueError("prompt_ids must not be empty")
    depths = [T - 1] * len(seq)  # prompt positions always run every loop
    tokens, exit_depths = [], []
    min_margin = min_gap = np.inf
    e = T - 1
    while len(tokens) < max_new_tokens:
        # The newest position has not run yet; its own depth only matters beyond its exit loop,
        # which nothing reads before it is fixed here, so T-1 is a safe placeholder.
        out = reference_forward(weights, config, seq, depths)
        if tokens:
            e, margin = exit_decision(
                out["gate_logits"][:, -1],
                exit_threshold=exit_threshold,
                min_loops=min_loops,
                max_loops=max_loops,
                exit_mode=exit_mode,
            )
            min_margin = min(min_margin, margin)
            depths[-1] = e
        logits = out["hidden_states"][e, -1] @ weights.lm_head.T
        top2 = np.sort(logits)[-2:]
        min_gap = min(min_gap, float(top2[1] - top2[0]))
        tok = int(np.argmax(logits))
        tokens.append(tok)
        exit_depths.append(e)
        seq.append(tok)
        depths.append(T - 1)
        if eos_token_id is not None and tok == eos_token_id:
            break
    return GreedyResult(tokens, exit_depths, float(min_margin), float(min_gap))


def reference_shared_greedy_generate(
    weights: RefWeights,
    config: OuroConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    exit_threshold: float = 1.0,
    min_loops: int = 1,
    max_loops: int | None = None,
    exit_mode: str = "ouro",
) -> GreedyResult:
    """Greedy decoding with the SHARED KV layout: one plane that every loop overwrites.

    Positions run one after another (every loop of ``p`` before ``p+1``). While position ``p`` runs
    loop ``d`` it reads every earlier position at its *final* K/V (the loop it exited at; ``T-1`` for
    prompt positions) and its own K/V of loop ``d``. A generated token's loops past its exit loop
    would only overwrite its own entry, so they are computed and then discarded: its entry keeps
    the exit loop's K/V.
    """
    c, T = config, config.num_loops
    seq = [int(t) for t in prompt_ids]
    if not seq:
        raise ValueError("prompt_ids must not be empty")
    L = len(weights.layers)
    k_plane = [[] for _ in range(L)]  # per layer, per position: the K/V the plane holds
    v_plane = [[] for _ in range(L)]
    tokens, exit_depths = [], []
    min_margin = min_gap = np.inf

    def run_position(p: int, tok: int, loops: int):
        cos, sin = rope_cos_sin(c, np.array([p]))
        x = weights.embed[[tok]]
        hs, gates, kvs = [], [], []
        for _ in range(loops):
            loop_kv = []
            for i, lw in enumerate(weights.layers):
                q, k, v = layer_qkv(lw, c, x, cos, sin)
                ks = np.concatenate(k_plane[i][:p] + [k]) if p else k
                vs = np.concatenate(v_plane[i][:p] + [v]) if p else v
                x = layer_finish(lw, c, x, q, ks, vs, np.ones((1, p + 1), dtype=bool))
                loop_kv.append((k, v))
            x = rms_norm(x, weights.norm, c.rms_norm_eps)
            hs.append(x[0])
            gates.append(float(x[0] @ weights.gate_w + weights.gate_b))
            kvs.append(loop_kv)
        return hs, gates, kvs

    def keep(kvs_of_loop):
        for i, (k, v) in enumerate(kvs_of_loop):
            k_plane[i].append(k)
            v_plane[i].append(v)

    for p, tok in enumerate(seq):  # the prompt: every loop, position by position
        hs, _, kvs = run_position(p, tok, T)
        keep(kvs[T - 1])
    h, e = hs[T - 1], T - 1
    while True:
        logits = h @ weights.lm_head.T
        top2 = np.sort(logits)[-2:]
        min_gap = min(min_gap, float(top2[1] - top2[0]))
        tok = int(np.argmax(logits))
        tokens.append(tok)
        exit_depths.append(e)
        if len(tokens) == max_new_tokens:
            break
        p = len(seq)
        seq.append(tok)
        hs, gates, kvs = run_position(p, tok, T if max_loops is None else max_loops)
        e, margin = exit_decision(
            gates, exit_threshold=exit_threshold, min_loops=min_loops, max_loops=max_loops, exit_mode=exit_mode
        )
        min_margin = min(min_margin, margin)
        keep(kvs[e])
        h = hs[e]
    return GreedyResult(tokens, exit_depths, float(min_margin), float(min_gap))
