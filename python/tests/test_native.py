"""The typed surface of ``treeattn._native``: the stub ``_native.pyi`` names
every function of the built module with its parameters and defaults (the
check ``mypy.stubtest`` makes in .ci/run, here without mypy), and the error
classes defined in Rust subclass ``ValueError`` and are what bad input raises.
"""

import ast
import inspect
import pathlib

import pytest
import torch

import treeattn
from treeattn import _native

STUB = pathlib.Path(treeattn.__file__).with_name("_native.pyi")
ERRORS = {
    "TreeattnError": "ValueError",
    "RolloutError": "TreeattnError",
    "PackError": "TreeattnError",
    "ShapeError": "TreeattnError",
    "UnsupportedError": "TreeattnError",
}


def stub_nodes(kind):
    return {n.name: n for n in ast.parse(STUB.read_text()).body if isinstance(n, kind)}


def test_py_typed_ships_with_the_stub():
    assert STUB.with_name("py.typed").is_file()


def test_stub_all_is_the_modules():
    assign = next(n for n in ast.parse(STUB.read_text()).body if isinstance(n, ast.Assign))
    assert assign.targets[0].id == "__all__"
    assert sorted(ast.literal_eval(assign.value)) == sorted(_native.__all__)


def test_stub_names_every_native_function():
    runtime = {
        name
        for name, obj in vars(_native).items()
        if callable(obj) and not isinstance(obj, type) and not name.startswith("_")
    }
    assert set(stub_nodes(ast.FunctionDef)) == runtime


@pytest.mark.parametrize("name", sorted(stub_nodes(ast.FunctionDef)))
def test_stub_signature_is_the_modules(name):
    node = stub_nodes(ast.FunctionDef)[name]
    params = inspect.signature(getattr(_native, name)).parameters.values()
    assert [a.arg for a in node.args.args] == [p.name for p in params]
    runtime_defaults = [p.default for p in params if p.default is not inspect.Parameter.empty]
    assert [ast.literal_eval(d) for d in node.args.defaults] == runtime_defaults


def test_stub_declares_the_error_classes():
    classes = {name: node for name, node in stub_nodes(ast.ClassDef).items() if node.bases}
    assert {name: node.bases[0].id for name, node in classes.items()} == ERRORS
    for name, base in ERRORS.items():
        cls = getattr(treeattn, name)
        assert cls is getattr(_native, name)
        assert cls.__bases__ == (getattr(treeattn, base, ValueError),)
        assert issubclass(cls, ValueError) and cls.__module__ == "treeattn"
        assert name in treeattn.__all__


def test_bad_rollouts_raise_rollout_error():
    with pytest.raises(treeattn.RolloutError, match="invalid rollout JSON"):
        _native.pack("text", "{not json", "trie", False, None)
    with pytest.raises(treeattn.RolloutError):
        treeattn.pack([{"id": "r", "calls": [{"context": [], "completion": [1]}]}])


def attention(kv_end, q_heads=2, kv_heads=1, rope_dims=None):
    L, d = len(kv_end), 8
    q = torch.randn(L, q_heads, d, dtype=torch.float64)
    k = torch.randn(L, kv_heads, d, dtype=torch.float64)
    kv = torch.tensor(kv_end, dtype=torch.int32)
    pos = torch.arange(L, dtype=torch.int32)
    o, lse = torch.empty_like(q), torch.empty(q_heads, L, dtype=torch.float64)
    _native.attention_forward(
        "float64",
        q.data_ptr(),
        k.data_ptr(),
        k.data_ptr(),
        kv.data_ptr(),
        pos.data_ptr(),
        o.data_ptr(),
        lse.data_ptr(),
        L,
        q_heads,
        kv_heads,
        d,
        0.5,
        None if rope_dims is None else 10000.0,
        rope_dims,
    )


def test_native_errors_have_their_class():
    attention([3, 3, 3])
    with pytest.raises(treeattn.PackError, match="kv_end"):
        attention([3, 0, 3])
    with pytest.raises(treeattn.ShapeError):
        attention([3, 3, 3], q_heads=3, kv_heads=2)
    with pytest.raises(treeattn.UnsupportedError, match="rotary"):
        attention([3, 3, 3], rope_dims=3)
    # Every one is still the ValueError the callers caught before.
    with pytest.raises(ValueError):
        attention([3, 0, 3])
