"""ouro-jax benchmarks: every figure is printed next to its floor (see ``benchmarks/floors.py``)."""
