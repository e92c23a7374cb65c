"""The packages' import direction and the benchmarks' use of the engine, read from the source (``ast``,
nothing imported).

Layers, lowest first: ``scheduler`` (pure Python + numpy) < ``pallas_kernels`` < ``weights`` <
``ouro_jax`` < ``benchmarks``. A module may import its own package or a lower one, at the top or inside
a function; ``pallas_kernels`` and ``weights`` do not import each other either (the kernels know nothing
of checkpoints, the checkpoints nothing of the kernels). ``scheduler`` imports no jax.

The benchmarks drive the engine through its public names only: no ``obj._private`` (nor
``getattr(obj, "_private")``, nor ``from ouro_jax.x import _private``) on anything but ``self``/``cls``
and the benchmark module's own classes, except the few benchmark-internal names of ``PRIVATE_OK``.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = {"scheduler": 0, "pallas_kernels": 1, "weights": 2, "ouro_jax": 3, "benchmarks": 4}
# (importer, imported): allowed by the layer order, still not wanted
INDEPENDENT = {("weights", "pallas_kernels"), ("pallas_kernels", "weights")}
NO_JAX = {"scheduler": {"jax", "jaxlib", "flax", "orbax", "chex"}}

# Benchmark-internal private names that a benchmark module reads on another benchmark module's object:
# name -> why it is not the engine's.
PRIVATE_OK = {
    "_warm": "benchmarks.run.Harness's warm-up, also run by benchmarks.decode's engine runner",
    "_record": "benchmarks.run.Harness's record builder, also used by benchmarks.decode",
    "_executables": "benchmarks.run.Harness's executables by shape, read by benchmarks.decode",
}


def _files(package: str, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    return sorted(p for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def _module_parts(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every import in ``path``: statements anywhere (relative ones
    resolved), ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name, and the
    module names of a lazy ``_LAZY = {...}`` table (``name: "module"`` or ``name: ("module", attr)``)."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_parts(path, root)
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.level <= len(package), f"{path}:{node.lineno}: relative import above the package"
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((node.lineno, mod))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            if isinstance(node.value, ast.Dict):
                for v in node.value.values:
                    v = v.elts[0] if isinstance(v, ast.Tuple) else v
                    if isinstance(v, ast.Constant) and isinstance(v.value, str):
                        out.append((node.lineno, v.value))
    return out


def layer_violations(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for package, level in LAYERS.items():
        for path in _files(package, root):
            for line, mod in imports(path, root):
                top = mod.split(".")[0]
                where = f"{path.relative_to(root)}:{line} imports {mod}"
                if top in LAYERS and LAYERS[top] > level:
                    bad.append(f"{where} (layer {LAYERS[top]} above {package}'s {level})")
                elif (package, top) in INDEPENDENT:
                    bad.append(f"{where} ({package} and {top} are independent)")
                elif top in NO_JAX.get(package, ()):
                    bad.append(f"{where} ({package} imports no jax)")
    return bad


def test_imports_go_down_the_layers():
    assert layer_violations() == []


def test_every_package_is_scanned():
    for package in LAYERS:
        assert (ROOT / package / "__init__.py").exists(), package
        assert len(_files(package)) > 1, package


def test_the_checker_sees_what_it_must(tmp_path):
    """On a made-up tree: a kernel importing the model inside a function, weights importing the engine
    and a kernel, the scheduler importing jax, a lazy table naming a higher module (and a relative
    import and a lower ``import_module`` that pass)."""
    for package in LAYERS:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "pallas_kernels" / "k.py").write_text(
        "def f():\n    from ouro_jax.model import apply_rope\n    return apply_rope\n"
    )
    (tmp_path / "weights" / "c.py").write_text("import ouro_jax.config\nfrom pallas_kernels import rope\n")
    (tmp_path / "scheduler" / "s.py").write_text("import jax.numpy as jnp\nfrom . import x\n")
    (tmp_path / "ouro_jax" / "__init__.py").write_text(
        "_LAZY = {'a': ('benchmarks.run', 'a')}\nimport importlib\nimportlib.import_module('weights.config')\n"
    )
    (tmp_path / "benchmarks" / "b.py").write_text("from ouro_jax import LLM\nimport scheduler\n")
    bad = layer_violations(tmp_path)
    assert len(bad) == 5, bad
    for want in (
        "pallas_kernels/k.py:2 imports ouro_jax.model",
        "weights/c.py:1 imports ouro_jax.config",
        "weights/c.py:2 imports pallas_kernels",
        "scheduler/s.py:1 imports jax.numpy",
        "ouro_jax/__init__.py:1 imports benchmarks.run",
    ):
        assert any(b.startswith(want) for b in bad), (want, bad)


# ------------------------------------------------------------------- benchmarks: public names only
def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _engine(module: str) -> bool:
    """A first-party module below the benchmarks (jax's own ``_src`` is not ours to police)."""
    return LAYERS.get(module.split(".")[0], 4) < LAYERS["benchmarks"]


def private_uses(path: pathlib.Path) -> list[str]:
    """Where ``path`` reaches a ``_private`` name of something not its own: ``x._name`` for ``x`` other
    than ``self``/``cls``/a class of the module, ``getattr(x, "_name")`` and its kin, and ``from m import
    _name`` or ``import m._sub`` for a first-party module ``m`` below ``benchmarks``."""
    tree = ast.parse(path.read_text(), str(path))
    own = {"self", "cls"} | {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    out = []

    def mine(node) -> bool:
        return isinstance(node, ast.Name) and node.id in own

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not mine(node.value):
            if node.attr not in PRIVATE_OK:
                out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and _is_private(name.value):
                    if not mine(node.args[0]) and name.value not in PRIVATE_OK:
                        out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and not node.level and _engine(node.module):
            if any(_is_private(n) for n in node.module.split(".") + [a.name for a in node.names]):
                out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if _engine(a.name) and any(_is_private(n) for n in a.name.split(".")):
                    out.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmarks_use_public_names_of_the_engine(path):
    assert private_uses(path) == []


def test_private_allow_list_is_the_benchmarks_own():
    """Every ``PRIVATE_OK`` name is defined by a benchmark class (a method or a ``self._x``) and by no
    engine module, so that the list cannot let an engine private through."""

    def defined(paths) -> set[str]:
        names = set()
        for p in paths:
            for n in ast.walk(ast.parse(p.read_text())):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                    names.add(n.attr)
        return names

    bench = defined(sorted((ROOT / "benchmarks").glob("*.py")))
    engine = defined(p for package in ("scheduler", "pallas_kernels", "weights", "ouro_jax") for p in _files(package))
    for name in PRIVATE_OK:
        assert name in bench, name
        assert name not in engine, name


def test_private_checker_sees_what_it_must(tmp_path):
    p = tmp_path / "b.py"
    p.write_text(
        "from ouro_jax.server.cli_commands import _ENGINE_FLAGS\n"
        "from benchmarks.run import _memory\n"
        "from jax._src import core\n"
        "class H:\n"
        "    def f(self, r, llm):\n"
        "        self._a, H._b, r.__class__\n"
        "        r._upload_to\n"
        "        getattr(llm.runner, '_exe')\n"
        "        h._warm\n"
    )
    bad = private_uses(p)
    assert [b.split()[0] for b in bad] == ["b.py:1", "b.py:7", "b.py:8"], bad
