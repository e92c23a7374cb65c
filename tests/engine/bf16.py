"""bf16 engines compared token by token: equal, or equal up to a near tie (for tests whose two
engines round differently: another attention kernel, other GEMM kernels)."""

# bf16: two engines that round differently (attention kernels, GEMM kernels), so a greedy choice
# between two tokens whose log-probabilities lie closer than this may go either way (and the rest
# of that output with it).
BF16_TIE_NATS = 0.05


def bf16_agree(a, b, what: str) -> None:
    """``a``/``b``: per prompt ``(tokens, depths, logprobs)``. Equal, or equal up to a first token
    where each engine ranks the other's choice second, within ``BF16_TIE_NATS`` of its own first
    (the rest of that output is not compared); depths that differ first fail."""
    for i, ((ta, da, la), (tb, db, lb)) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(zip(ta, da), zip(tb, db))):
            if x == y:
                continue
            assert x[0] != y[0], f"{what}: prompt {i} token {j}: exit depth {x[1]} vs {y[1]} at the same token"
            for lp, other in ((la[j], y[0]), (lb[j], x[0])):
                top = dict(lp.top)
                gap = lp.logprob - top.get(other, -float("inf"))
                assert gap <= BF16_TIE_NATS, (
                    f"{what}: prompt {i} token {j}: {x[0]} vs {y[0]}, not a near tie ({gap:.4f} nats apart; "
                    f"top {lp.top})"
                )
            break
